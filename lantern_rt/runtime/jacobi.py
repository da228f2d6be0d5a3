"""Drafter-free drafting: a fixed Jacobi window filled from the target's own distributions.

Speculative Jacobi decoding (docs/method.md §11) drafts the positions after each image's root
without a drafter: a position the last verify call already scored (conditioned on that call's
drafts) is drafted from the target distribution p it gave there, with p as the draft's q; a
position it did not reach is initialised from the image itself (the token one grid row above,
else the root) with a one-hot q. How a carried draft is drawn from p is its *coupling* with the
draft the last call held there: ``none`` draws afresh, ``maximal`` keeps the old draft when a
test against p allows it, ``gumbel`` takes the argmax of log p plus the position's own Gumbel
noise, kept from call to call. Each gives a token distributed as p given everything the tests
see, so the unchanged tree acceptance (:func:`~lantern_rt.runtime.acceptance.accept_tree`)
with q = p keeps exact decoding lossless, and LANTERN++'s neighbour credit relaxes it the same
way.

The window is a chain (``chain-N``) or a pac tree (``pac-K-D-N``,
:func:`~lantern_rt.runtime.tree.pac_tree`): every node at one depth drafts the same position,
and a pac tree's K candidates there are drawn without replacement from p, the coupled draft
first.

:class:`JacobiDrafter` is a :class:`~lantern_rt.runtime.backends.base.Drafter`, the decode
loop's one drafting interface (:class:`~lantern_rt.runtime.decode.DecodeStep`), as a drafter
backend is. Its state is device tensors updated in place, and every function here is
fixed-shape tensor work with no host read, so a CUDA graph can capture the step whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern_rt.runtime.acceptance import Verified
from lantern_rt.runtime.backends.base import Draft, FilterInputs, Pending
from lantern_rt.runtime.method import COUPLINGS
from lantern_rt.runtime.sampling import gumbel_offsets, per_row
from lantern_rt.runtime.tree import StaticTree, pac_shape


def window_shape(tree: StaticTree) -> tuple[int, int] | None:
    """(K candidates per position, down to depth D) of a Jacobi window: (1, 0) for a chain, (K, D)
    for a pac tree; None for any other tree."""
    if tree.num_nodes > 0 and tree.width == 1:
        return 1, 0
    return pac_shape(tree)


def is_window(tree: StaticTree) -> bool:
    """Whether ``tree`` can be a Jacobi window: a chain or a pac tree."""
    return window_shape(tree) is not None


def descendants(tree: StaticTree) -> Tensor:
    """LongTensor [N+1, L+2] (L the tree's depth): column j of row v is the node j levels below v
    that the next call reads after a path ending at v was accepted (column 0: v): v's rank-0
    descendant, and past the last of those the node at that depth on the rank-0 path from the
    root (scored given one more stale token, as a chain's are after a rejection); -1 past the
    tree's depth."""
    first_child = [kids[0] if kids else -1 for kids in tree.children]
    spine = [0]  # the rank-0 path: spine[d] is its node at depth d
    while first_child[spine[-1]] >= 0:
        spine.append(first_child[spine[-1]])
    table = torch.full((tree.num_nodes + 1, tree.max_depth + 2), -1, dtype=torch.long)
    for v in range(tree.num_nodes + 1):
        node, depth = v, tree.depths[v]
        for j in range(tree.max_depth + 2 - depth):
            table[v, j] = node
            node = (
                first_child[node]
                if first_child[node] >= 0
                else spine[depth + j + 1]
                if depth + j + 1 < len(spine)
                else -1
            )
            if node < 0:
                break
    return table


def spatial_drafts(
    history: Tensor, root: Tensor, root_position: Tensor, window: int, row: int, prefix: int
) -> Tensor:
    """Initial drafts [B, N] of the positions root_position + 1..N (cache positions; the image
    starts after ``prefix`` condition slots): the committed token one image row (``row``
    tokens) above each, from ``history`` [B, >= capacity] (committed tokens by position), or
    the ``root`` [B] where that is not a committed image position."""
    positions = root_position[:, None] + torch.arange(1, window + 1, device=root.device)
    above = positions - row
    known = (above >= prefix) & (above <= root_position[:, None])
    committed = history.gather(1, torch.minimum(above.clamp_min(0), root_position[:, None]))
    return torch.where(known, committed, root[:, None])


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """``t[b, index[b, i]]`` for t [B, M, V] and index [B, L] -> [B, L, V]."""
    return t.gather(1, index[..., None].expand(-1, -1, t.shape[-1]))


def maximal_coupling(
    p: Tensor, old: Tensor, q_old: Tensor, has_old: Tensor, u: Tensor, offsets: Tensor
) -> tuple[Tensor, Tensor]:
    """Drafts [B, L] distributed as ``p`` [B, L, V], and the q they are tested with: p itself.
    Where there is an ``old`` draft (``has_old``), drawn from ``q_old``, it is kept when
    u * q_old(old) < p(old) (``u`` [B, L] uniform), else redrawn from the normalised
    max(p - q_old, 0); elsewhere the draft is drawn from p. Draws are the Gumbel-max of the
    noise's ``offsets`` [B, L, V] (docs/method.md §11)."""
    at = old[..., None]
    keep = has_old & (u * q_old.gather(-1, at).squeeze(-1) < p.gather(-1, at).squeeze(-1))
    residual = (p - q_old).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) <= torch.finfo(p.dtype).eps, p, residual)
    drawn = (torch.log(torch.where(has_old[..., None], residual, p)) - offsets).argmax(-1)
    return torch.where(keep, old, drawn), p


def shifted_noise(kept: Tensor, fresh: Tensor, m: Tensor, ready: Tensor) -> Tensor:
    """Each position's Gumbel offsets [B, L, V] after ``m`` [B] tokens were committed: the ones
    ``kept`` from the last call's position (its slot i + m) where the image has had one
    (``ready`` [B]) and that slot exists, else ``fresh`` ones."""
    window = kept.shape[1]
    moved = torch.arange(window, device=kept.device)[None, :] + m[:, None]  # the last call's slot
    stays = (ready[:, None] & (moved < window))[..., None]
    return torch.where(stays, _rows(kept, moved.clamp_max(window - 1)), fresh)


def ranked_candidates(p: Tensor, first: Tensor, offsets: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``width`` distinct candidates [B, L, width] per position: ``first`` [B, L] (drawn from p),
    then a draw without replacement from the rest of ``p`` [B, L, V] (Gumbel-top-k of log p minus
    ``offsets``); and whether p gives each mass (valid)."""
    scores = (torch.log(p) - offsets).scatter(-1, first[..., None], torch.inf)
    tokens = scores.topk(width, dim=-1).indices
    return tokens, p.gather(-1, tokens) > 0


class JacobiDrafter:
    """The Jacobi window's :class:`~lantern_rt.runtime.backends.base.Drafter` for B images: its
    state, the drafts it proposes each step and what it records of their verification.

    ``probs`` [B, N+1, V]: each image's target distributions from its last verify call; ``node``
    [B]: the last node of the path that call accepted; ``ready`` [B]: whether an image has had
    one since its prefill; ``history`` [B, capacity+1]: its committed tokens by cache position
    (the last column takes the padding of a write). The coupling keeps more: ``maximal`` the last
    drafts and their q (``tokens`` [B, N+1], ``q`` [B, N+1, V]), ``gumbel`` each position's
    Gumbel noise as offsets (``offsets`` [B, L, V], L the window's positions)."""

    name = "jacobi"

    def __init__(
        self,
        tree: StaticTree,
        batch: int,
        vocab: int,
        capacity: int,
        prefix: int,
        row: int,
        device,
        coupling: str = "none",
    ):
        shape = window_shape(tree)
        if shape is None:
            raise ValueError(
                f"a Jacobi window is a chain (chain-N) or a pac tree (pac-K-D-N), not tree {tree.name}"
            )
        if coupling not in COUPLINGS:
            raise ValueError(f"coupling must be one of {', '.join(COUPLINGS)}, not {coupling!r}")
        self.tree, self.vocab_size, self.prefix, self.row, self.coupling = tree, vocab, prefix, row, coupling
        self.width, self.slots = shape[0], tree.max_depth
        self.descendants = descendants(tree).to(device)
        depth = tree.depth.to(device)
        # node v (1..N) is candidate rank(v) of position depth(v) - 1: its index in [L * K]
        self.candidate = (depth[1:] - 1) * self.width + tree.rank.to(device)[1:]
        self.q_slot = depth.clamp_max(self.slots - 1)  # node v's children draft position depth(v)
        nodes = tree.num_nodes + 1
        self.probs = torch.zeros(batch, nodes, vocab, device=device)
        self.node = torch.zeros(batch, dtype=torch.long, device=device)
        self.ready = torch.zeros(batch, dtype=torch.bool, device=device)
        self.history = torch.zeros(batch, capacity + 1, dtype=torch.long, device=device)
        kept = {"maximal": ((batch, nodes), (batch, nodes, vocab)), "gumbel": ((batch, self.slots, vocab),)}
        self.kept = tuple(
            torch.zeros(size, dtype=torch.long if len(size) == 2 else torch.float32, device=device)
            for size in kept.get(coupling, ())
        )

    @property
    def state(self) -> tuple[Tensor, ...]:
        """The tensors a step updates in place (restored after a CUDA graph's warm-up calls)."""
        return self.probs, self.node, self.ready, self.history, *self.kept

    def noise_rows(self, tree: StaticTree) -> int:
        """Rows of V uniforms a step's drafts of the window (``tree``) take: L for the first draws
        (the fresh Gumbel noise of ``gumbel``), with ``maximal`` L more for the siblings of a pac
        tree and L whose first column is the keep tests' uniform."""
        return self.slots * (3 if self.coupling == "maximal" else 1)

    def prefill(self, hidden: Tensor, fresh: Tensor, cond: Tensor, prefix: Tensor) -> None:
        """The ``fresh`` [B] images start with no last call (nothing else of the prefill is
        needed)."""
        self.ready.masked_fill_(fresh, False)

    def propose(
        self, tree: StaticTree, pending: Pending, noise: Tensor, sampling: FilterInputs, greedy: Tensor
    ) -> Draft:
        """The window's (``tree``'s) draft below each image's root, the last of its m pending
        tokens (committed since the last call) at cache position ``pending.root_position`` [B],
        from ``noise`` [B, :meth:`noise_rows`, V], argmax drafts where ``greedy`` (each image's
        [B], or [1] for all; the target's distributions already carry the ``sampling``
        settings): the pending tokens are recorded in the history, then each position takes its
        coupled carried draft where there is one, else its spatial one, and a pac tree's
        siblings are drawn after it (docs/method.md §11)."""
        pending, m, root_position = pending.tokens, pending.count, pending.root_position
        batch, rows = pending.shape
        offsets = torch.arange(rows, device=pending.device)
        slots = root_position[:, None] - m[:, None] + 1 + offsets
        trash = self.history.shape[1] - 1
        self.history.scatter_(1, torch.where(offsets < m[:, None], slots, trash).clamp_max(trash), pending)
        root = pending.gather(1, (m - 1)[:, None]).squeeze(1)
        window = self.slots
        chain = self.descendants.index_select(0, self.node)  # [B, L+2]
        row = chain[:, 1 : window + 1]  # the node whose distribution each position was scored by
        carried = self.ready[:, None] & (row >= 0)
        spatial = spatial_drafts(self.history, root, root_position, window, self.row, self.prefix)
        one_hot = F.one_hot(spatial, self.vocab_size).to(self.probs.dtype)
        p = torch.where(carried[..., None], _rows(self.probs, row.clamp_min(0)), one_hot)  # [B, L, V]
        first_offsets = gumbel_offsets(noise[:, :window])
        if self.coupling == "gumbel":
            (kept,) = self.kept
            first_offsets = shifted_noise(kept, first_offsets, m, self.ready)
            kept.copy_(first_offsets)
        sibling_offsets, q = first_offsets, p
        if self.coupling == "maximal":
            tokens, last_q = self.kept
            old_node = chain[:, 2:]
            has_old = self.ready[:, None] & (old_node >= 0)
            old = tokens.gather(1, old_node.clamp_min(0))
            u = noise[:, 2 * window :, 0]
            first, q = maximal_coupling(p, old, _rows(last_q, row.clamp_min(0)), has_old, u, first_offsets)
            sibling_offsets = gumbel_offsets(noise[:, window : 2 * window])
        else:
            first = (torch.log(p) - first_offsets).argmax(-1)
        first = torch.where(per_row(greedy, first), p.argmax(-1), first)
        if self.width > 1:
            sibling_offsets = torch.where(per_row(greedy, sibling_offsets), 0.0, sibling_offsets)
            candidates, valid = ranked_candidates(p, first, sibling_offsets, self.width)
            node_tokens = candidates.flatten(1).index_select(1, self.candidate)
            node_valid = valid.flatten(1).index_select(1, self.candidate)
        else:
            node_tokens, node_valid = first, torch.ones_like(first, dtype=torch.bool)
        draft = Draft(
            torch.cat([root[:, None], node_tokens], 1),
            torch.cat([torch.ones_like(node_valid[:, :1]), node_valid], 1),
            q.index_select(1, self.q_slot),  # q[:, v]: what node v's children were drawn from
        )
        if self.coupling == "maximal":
            self.kept[0].copy_(draft.tokens)
            self.kept[1].copy_(draft.q)
        return draft

    def record(self, verified: Verified, active: Tensor) -> None:
        """Keep the target's distributions at every node of this call (:attr:`Verified.probs
        <lantern_rt.runtime.acceptance.Verified.probs>` [B, N+1, V]) and the last node of its
        accepted path for the next draft of the ``active`` [B] images."""
        self.probs.copy_(verified.probs)
        self.node.copy_(verified.kept.gather(1, verified.length[:, None]).squeeze(1))
        self.ready |= active
