"""Drafter-free drafting: a fixed Jacobi window filled from the target's own distributions.

Speculative Jacobi decoding (docs/method.md §11) drafts the N positions after each image's root
without a drafter: a position the last verify call already scored (conditioned on that call's
drafts) is drafted by sampling the target distribution it gave there, with that distribution as
the draft's q; a position it did not reach is initialised from the image itself (the token one
grid row above, else the root) with a one-hot q. Every draft is a token drawn from a known q, so
the unchanged acceptance of a chain (:func:`~lantern_rt.runtime.acceptance.accept_tree`) keeps
exact decoding lossless, and LANTERN++'s neighbour credit relaxes it the same way.

:class:`JacobiDrafter` fills the draft slots of the one decode loop
(:class:`~lantern_rt.runtime.decode.DecodeStep`) in place of a drafter backend. Its state is
device tensors updated in place, and every function here is fixed-shape tensor work with no
host read, so a CUDA graph can capture the step whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern_rt.runtime.acceptance import draw
from lantern_rt.runtime.backends.base import Draft
from lantern_rt.runtime.tree import StaticTree


def is_window(tree: StaticTree) -> bool:
    """Whether ``tree`` is a chain (one child per node), the only shape a Jacobi window has."""
    return tree.num_nodes > 0 and tree.width == 1


def carried_drafts(
    probs: Tensor, ready: Tensor, accepted: Tensor, noise: Tensor, greedy: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Drafts of the N positions after each root from the last verify call's distributions:
    ``probs`` [B, N+1, V] (row j: the target's distribution after node j), of which the first
    ``accepted`` [B] + 1 rows led to the committed tokens; the new root sits where row
    ``accepted`` pointed, so position i (1..N) after it is row accepted + i, carried when that
    row exists and the image has a last call (``ready`` [B]). -> (carried [B, N] bool, tokens
    [B, N] drawn from those rows with uniform ``noise`` [B, N, V], the rows themselves [B, N, V])."""
    window = probs.shape[1] - 1
    row = accepted[:, None] + torch.arange(1, window + 1, device=probs.device)  # [B, N]
    carried = ready[:, None] & (row <= window)
    q = probs.gather(1, row.clamp_max(window)[..., None].expand(-1, -1, probs.shape[-1]))
    return carried, draw(q, noise, greedy), q


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


class JacobiDrafter:
    """The Jacobi window's state for B images, and the drafts it yields each step.

    ``probs`` [B, N+1, V]: each image's target distributions from its last verify call;
    ``ready`` [B]: whether an image has had one since its prefill; ``history`` [B, capacity+1]:
    its committed tokens by cache position (the last column takes the padding of a write)."""

    name = "jacobi"

    def __init__(
        self, tree: StaticTree, batch: int, vocab: int, capacity: int, prefix: int, row: int, device
    ):
        if not is_window(tree):
            raise ValueError(f"a Jacobi window is a chain (chain-N), not tree {tree.name}")
        self.tree, self.vocab_size, self.prefix, self.row = tree, vocab, prefix, row
        self.probs = torch.zeros(batch, tree.num_nodes + 1, vocab, device=device)
        self.ready = torch.zeros(batch, dtype=torch.bool, device=device)
        self.history = torch.zeros(batch, capacity + 1, dtype=torch.long, device=device)

    @property
    def state(self) -> tuple[Tensor, ...]:
        """The tensors a step updates in place (restored after a CUDA graph's warm-up calls)."""
        return self.probs, self.ready, self.history

    def prefill(self, hidden: Tensor, fresh: Tensor, cond: Tensor, prefix: Tensor) -> None:
        """The ``fresh`` [B] images start with no last call (the drafter backends' signature:
        nothing else of the prefill is needed)."""
        self.ready.masked_fill_(fresh, False)

    def draft(
        self, pending: Tensor, m: Tensor, root_position: Tensor, noise: Tensor, greedy: Tensor
    ) -> Draft:
        """The window's draft below each image's root, the last of its ``m`` [B] ``pending``
        [B, R] tokens (committed since the last call) at cache position ``root_position`` [B]:
        the pending tokens are recorded in the history, then each position takes its carried
        draft where there is one, else its spatial one (docs/method.md §11)."""
        batch, rows = pending.shape
        offsets = torch.arange(rows, device=pending.device)
        slots = root_position[:, None] - m[:, None] + 1 + offsets
        trash = self.history.shape[1] - 1
        self.history.scatter_(1, torch.where(offsets < m[:, None], slots, trash).clamp_max(trash), pending)
        root = pending.gather(1, (m - 1)[:, None]).squeeze(1)
        carried, drawn, q = carried_drafts(self.probs, self.ready, m - 1, noise, greedy)
        window = self.tree.num_nodes
        spatial = spatial_drafts(self.history, root, root_position, window, self.row, self.prefix)
        tokens = torch.where(carried, drawn, spatial)
        q = torch.where(carried[..., None], q, F.one_hot(spatial, self.vocab_size).to(q.dtype))
        return Draft(
            torch.cat([root[:, None], tokens], 1),
            torch.ones(batch, window + 1, dtype=torch.bool, device=pending.device),
            F.pad(q, (0, 0, 0, 1)),  # q[:, i]: what node i + 1 was drawn from; none below the last
        )

    def record(self, probs: Tensor, active: Tensor) -> None:
        """Keep the target's distributions at every node of this call (``probs`` [B, N+1, V],
        :attr:`Verified.probs <lantern_rt.runtime.acceptance.Verified.probs>`) for the next
        draft of the ``active`` [B] images."""
        self.probs.copy_(probs)
        self.ready |= active
