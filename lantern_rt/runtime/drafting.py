"""Drafting a static tree: the drafter's catch-up call, then every tree level, as one function.

Per decode step the drafter
1. catches up on the pairs committed since the last step (accepted path + bonus, at most
   ``max_depth + 1``), right-aligned in ``catch_up_rows(tree)`` rows so that the root is always
   the last row (padding rows come first and see only themselves); the root's output gives the
   distribution its children are drawn from;
2. runs each tree level 1..max_depth-1 at once: every node of the level, paired with its
   parent's predicted hidden state, attends to what the root sees (the committed cache and the
   catch-up rows), to its ancestors' K/V from this same call, and to itself.
At each node ``tree.width`` distinct children are drawn without replacement by Gumbel-top-k
from noise the caller passes in (docs/method.md §4). Every function drafts B images at once,
each with its own pending pairs, cache length and noise (docs/method.md §7). :func:`draft_tree` is therefore a pure
function of tensors and a drafter step: the torch backend runs it eagerly with the drafter's
own step, a bundle holds it as one graph per tree, and the same noise gives the same draft.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from lantern_rt.runtime.acceptance import Verified
from lantern_rt.runtime.backends.base import CatchUp, Draft, DraftOutputs, FilterInputs, Pending
from lantern_rt.runtime.kv_cache import KVCache, cache_mask, gather_rows
from lantern_rt.runtime.sampling import cfg_mix, cfg_rows, filtered_softmax, gumbel_offsets, top_distinct
from lantern_rt.runtime.tree import StaticTree

# Most distinct children drafted per node: tree ranks must stay below it (the authors' TOPK).
MAX_DRAFT_WIDTH = 10


@dataclass(frozen=True)
class Context:
    """What new drafter rows attend to besides themselves, per layer: blocks of keys and
    values [2, Hkv, P_b, D] (the committed cache first, then rows computed in this call)."""

    keys: tuple[tuple[Tensor, ...], ...]
    values: tuple[tuple[Tensor, ...], ...]

    @classmethod
    def of_cache(cls, keys: list[Tensor] | Tensor, values: list[Tensor] | Tensor) -> Context:
        """One block per layer: the cache [2, Hkv, capacity, D] of each layer."""
        return cls(tuple((k,) for k in keys), tuple((v,) for v in values))

    @property
    def slots(self) -> int:
        """Keys per row in all blocks."""
        return sum(block.shape[2] for block in self.keys[0])

    def plus(self, new_k: Tensor, new_v: Tensor) -> Context:
        """This context and the rows ``new_k``/``new_v`` [n_layer, 2, Hkv, S, D]."""
        return Context(
            tuple((*blocks, k) for blocks, k in zip(self.keys, new_k, strict=True)),
            tuple((*blocks, v) for blocks, v in zip(self.values, new_v, strict=True)),
        )

    def to_commit(self, catch_k: Tensor, catch_v: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        """What the caller commits of a drafting call: the catch-up rows' K/V with each image's
        ``m`` [B] real rows first (``KVCache.write``)."""
        return left_aligned(catch_k, m), left_aligned(catch_v, m)


@dataclass(frozen=True)
class Scratch:
    """The drafter cache written in place (a bundle's drafting graphs on onnxruntime's CPU,
    docs/method.md §6): per layer K and V [2B, Hkv, window + scratch, D], the committed window,
    then scratch slots the call's rows are written into in the order :class:`Context` joins
    them (catch-up rows, then each level's nodes), so that a mask over a context's blocks is
    one over these slots. A step returns the caches with its rows written."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    window: int

    @property
    def slots(self) -> int:
        """The committed window's slots (a mask's columns before the call's rows)."""
        return self.window

    def plus(self, keys: tuple[Tensor, ...], values: tuple[Tensor, ...]) -> Scratch:
        """The caches a step returned, its rows written."""
        return Scratch(keys, values, self.window)

    def to_commit(self, catch_k: Tensor, catch_v: Tensor, m: Tensor) -> tuple[tuple[Tensor, ...], ...]:
        """The caches as written (the catch-up rows in the first scratch slots, right-aligned:
        the caller moves them, ``KVCache.commit`` of :func:`caught_up`)."""
        return self.keys, self.values


# A drafter step: pairs (tokens [B, S], target hidden [2B, S, D]) at positions [2B, S] under a
# mask [2B, 1, S, P + S] over the context (P slots in all; None: no context, P = 0) and the new
# rows -> predicted hidden states [2B, S, D] and new K/V [n_layer, 2B, Hkv, S, D] (B rows for
# 2B throughout when guidance is off: docs/method.md §13).
DraftStep = Callable[[Tensor, Tensor, Tensor, Tensor, "Context | None"], tuple[Tensor, Tensor, Tensor]]
# The target's LM head (affine) under its image layout: hidden [B, S, D] at positions [B, S] ->
# fp32 logits [B, S, V] (models.target.layout_logits).
Head = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LevelPlan:
    """Static index tables of one tree level below the root."""

    pick: Tensor  # [n]: each node's draw among its parent level's draws (flat [parents * width])
    parents: Tensor  # [n]: each node's parent, as an index into the parent level
    visible: Tensor  # [1, 1, n, M + n]: each node's strict ancestors among nodes 1..M (the
    # nodes above this level, root excluded), then itself among the level's nodes
    every_draw: bool  # pick is every draw in order (a chain's levels): no gather is needed
    every_parent: bool  # parents is every node of the parent level in order, one child each


@dataclass(frozen=True)
class DraftPlan:
    """A tree's drafting tables: children drawn per node, and the plans of depths 1..max_depth."""

    width: int
    levels: tuple[LevelPlan, ...]


@lru_cache(maxsize=32)
def draft_plan(tree: StaticTree, device: torch.device) -> DraftPlan:
    """The drafting tables of ``tree`` on ``device`` (node ids are numbered level by level).

    Built outside inference mode (a graph export may use them after a decode did); build them
    outside a graph trace too, where tensors would be the tracer's."""
    with torch.inference_mode(False):
        return DraftPlan(tree.width, _level_plans(tree, device))


def _level_plans(tree: StaticTree, device: torch.device) -> tuple[LevelPlan, ...]:
    plans = []
    for depth in range(1, tree.max_depth + 1):
        nodes, above = tree.levels[depth], tree.levels[depth - 1]
        first = nodes[0]
        ancestors = torch.zeros(len(nodes), first - 1, dtype=torch.bool)
        for i, node in enumerate(nodes):
            for a in tree.ancestors[node][:-1]:  # its drafted ancestors (the node itself excluded)
                ancestors[i, a - 1] = True
        parents = [above.index(tree.parents[node]) for node in nodes]
        pick = [p * tree.width + tree.ranks[n] for p, n in zip(parents, nodes, strict=True)]
        visible = torch.cat([ancestors, torch.eye(len(nodes), dtype=torch.bool)], dim=1)
        plans.append(
            LevelPlan(
                pick=torch.tensor(pick, device=device),
                parents=torch.tensor(parents, device=device),
                visible=visible[None, None].to(device),
                every_draw=pick == list(range(len(above) * tree.width)),
                every_parent=parents == list(range(len(above))),
            )
        )
    return tuple(plans)


def catch_up_rows(tree: StaticTree) -> int:
    """Rows of the catch-up call: the longest accepted path plus the bonus token."""
    return tree.max_depth + 1


def drafter_capacity(cls_token_num: int, block_size: int) -> int:
    """Slots in the drafter's KV cache: the condition prefix's pairs but the last (see
    :func:`prefix_pairs`), then one committed pair per image token at most."""
    return cls_token_num - 1 + block_size


def prefix_pairs(
    step: DraftStep, hidden: Tensor, embedded: Tensor | None = None, visible: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The drafter's K/V [n_layer, 2B, Hkv, P - 1, D] over a condition prefix of P slots: the
    target's hidden states at its first P - 1 slots (``hidden`` [2B, P - 1, D]), each paired
    with the next slot's token at that slot's position, causal among themselves; the last
    slot's state pairs with the first image token in the first catch-up (docs/method.md §9).

    A caption prefix (LlamaGen) pairs token 0 with every state, all visible, as the authors'
    ``initialize_tree`` feeds it; a prompt-token prefix (the Chameleon family) pairs each state
    with the embedding of its row's next prompt token (``embedded`` [2B, P - 1, H]) and hides
    the pairs ``visible`` [2B, P - 1] marks False (its padding), as their ``cnets_anole``
    prefill does (§10)."""
    rows, count = hidden.shape[:2]
    device = hidden.device
    positions = torch.arange(1, count + 1, device=device).expand(rows, -1)
    causal = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    mask = causal.expand(rows, 1, -1, -1)
    if visible is not None:
        mask = (mask & visible[:, None, None, :]) | torch.eye(count, dtype=torch.bool, device=device)
    tokens = torch.zeros(rows, count, dtype=torch.long, device=device) if embedded is None else embedded
    _, k, v = step(tokens, hidden, positions, mask, None)
    return k, v


def prompt_pairs(
    step: DraftStep, hidden: Tensor, embed: Callable[[Tensor], Tensor], cond: Tensor, prefix: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`prefix_pairs` over a prompt-token prefix: slot j's state ``hidden`` [2B, P - 1, D]
    with its row's token at slot j + 1 (``cond`` [2B, P], embedded by ``embed``), visible where
    slot j is (``prefix`` [2B, P]); -> (K, V, the pairs' visibility [2B, P - 1] for the cache)."""
    visible = prefix[:, :-1]
    return (*prefix_pairs(step, hidden, embed(cond[:, 1:]), visible), visible)


def cfg_pairs(tokens: Tensor, rows: int) -> Tensor:
    """A drafter step's token input for its ``rows`` rows (2B CFG rows, or B without guidance):
    image tokens [B, S], the same in both rows of an image, repeated
    (:func:`~lantern_rt.runtime.sampling.cfg_rows`); a prompt's embeddings [rows, S, H], one per
    row, as they are."""
    return tokens if tokens.is_floating_point() else cfg_rows(tokens, rows)


def noise_rows(tree: StaticTree) -> int:
    """Nodes that draw children: every node above the tree's last level."""
    return tree.levels[-1][0]


def scratch_rows(tree: StaticTree) -> int:
    """Rows a drafting call runs the drafter on: the catch-up rows, then every node below the
    root that draws children (the scratch slots a :class:`Scratch` cache needs)."""
    return catch_up_rows(tree) + noise_rows(tree) - 1


def catch_up_mask(rows: int, m: Tensor, device: torch.device) -> Tensor:
    """[B, rows, rows]: per image, the last ``m`` [B] rows causal among themselves, padding rows
    see only themselves (``m`` on ``device``: no host read)."""
    r = torch.arange(rows, device=device)
    real = r >= rows - m[:, None]  # [B, rows]
    causal = r[None, :] <= r[:, None]
    return (r[:, None] == r[None, :]) | (real[:, :, None] & real[:, None, :] & causal)


def catch_up_inputs(rows: CatchUp, capacity: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The catch-up call's tokens [B, R], hidden [2B, R, D], positions [2B, R] and mask [2B, 1,
    R, capacity + R] from the pending pairs ``rows`` (per image the first m of R, left-aligned):
    the pairs right-aligned by gathers, so that the root is always the last row and padding rows
    come first, seeing only themselves; the committed slots of a drafter cache of ``capacity``
    but the prefix pairs ``rows.prefix`` hides."""
    tokens, hidden, m, root_position, length, prefix = rows
    width = tokens.shape[1]
    r = torch.arange(width, device=tokens.device)
    source = r[None, :] - (width - m[:, None])  # [B, R]: the pending pair each row holds; < 0: padding
    real = source >= 0
    index = source.clamp_min(0)
    n = hidden.shape[0]  # 2B rows, or B without guidance
    pair_index = cfg_rows(index, n)[..., None].expand(-1, -1, hidden.shape[-1])
    return (
        torch.where(real, tokens.gather(1, index), 0),
        torch.where(cfg_rows(real, n)[..., None], hidden.gather(1, pair_index), 0.0),
        cfg_rows((source + (root_position - m + 1)[:, None]).clamp_min(0), n),
        cache_mask(length, capacity, catch_up_mask(width, m, tokens.device), n, prefix),
    )


def caught_up(rows: int, m: Tensor) -> Tensor:
    """[B, rows]: the catch-up row each image commits j-th: its m [B] real rows (its last m),
    then its last row again."""
    return (torch.arange(rows, device=m.device)[None, :] + (rows - m)[:, None]).clamp_max(rows - 1)


def left_aligned(new: Tensor, m: Tensor) -> Tensor:
    """The catch-up rows' K/V [n_layer, 2B, Hkv, R, D] with each image's m real rows (its last m)
    first."""
    return gather_rows(new, caught_up(new.shape[3], m), 1, 3)


def draft_tree(
    step: DraftStep,
    head: Head,
    plan: DraftPlan,
    rows: CatchUp,
    cache: Context | Scratch,
    noise: Tensor,
    sampling: FilterInputs,
) -> DraftOutputs:
    """Catch up on the pending pairs ``rows`` over the drafter ``cache``, then draft a tree (its
    ``plan``) below the root, the last pending pair.

    ``noise`` [B, noise_rows(tree), V] is the uniform noise of each drawing node's draws, in
    node order (sampling.draw_noise). The last two outputs are what the caller commits
    (:meth:`Context.to_commit`, :meth:`Scratch.to_commit`).
    """
    tokens, hidden, positions, mask = catch_up_inputs(rows, cache.slots)
    out, catch_k, catch_v = step(tokens, hidden, positions, mask, cache)
    level_hidden = out[:, -1:]

    batch = rows.count.shape[0]

    def probabilities(level_hidden: Tensor, level_positions: Tensor) -> Tensor:
        # The head is affine and CFG weights sum to one: mixing the hidden states first gives
        # the mixed logits with half the head's work.
        mixed = cfg_mix(level_hidden, sampling.cfg_scale, batch).to(level_hidden.dtype)
        return filtered_softmax(head(mixed, level_positions[:batch]), sampling)

    seen = mask[:, :, -1:]  # what each root sees: committed slots and catch-up rows
    context = cache.plus(catch_k, catch_v)
    q = probabilities(level_hidden, positions[:, -1:])  # [B, 1, V]
    vocab = q.shape[-1]
    node_tokens = [tokens[:, -1:]]
    valid = [torch.ones(batch, 1, dtype=torch.bool, device=tokens.device)]
    q_rows = [q]
    offsets = gumbel_offsets(noise)  # every level's at once
    drawn, drawn_ok = top_distinct(q, offsets[:, :1], plan.width)
    drawing = 1
    for depth, level in enumerate(plan.levels, start=1):
        level_tokens, level_ok = drawn.flatten(1), drawn_ok.flatten(1)
        if not level.every_draw:
            level_tokens, level_ok = (
                level_tokens.index_select(1, level.pick),
                level_ok.index_select(1, level.pick),
            )
        node_tokens.append(level_tokens)
        valid.append(level_ok)
        n = level_tokens.shape[1]
        if depth == len(plan.levels):
            q_rows.append(q.new_zeros(batch, n, vocab))
            break
        visible = level.visible.expand(seen.shape[0], 1, n, -1)
        level_mask = torch.cat([seen.expand(-1, 1, n, -1), visible], dim=-1)
        level_positions = (positions[:, -1:] + depth).expand(-1, n)
        parent_hidden = level_hidden if level.every_parent else level_hidden.index_select(1, level.parents)
        level_hidden, k, v = step(level_tokens, parent_hidden, level_positions, level_mask, context)
        context = context.plus(k, v)
        q = probabilities(level_hidden, level_positions)
        q_rows.append(q)
        drawn, drawn_ok = top_distinct(q, offsets[:, drawing : drawing + n], plan.width)
        drawing += n
    return (
        torch.cat(node_tokens, 1),
        torch.cat(valid, 1),
        torch.cat(q_rows, 1),
        *context.to_commit(catch_k, catch_v, rows.count),
    )


class TreeDrafter(ABC):
    """The :class:`~lantern_rt.runtime.backends.base.Drafter` of a drafter model (EAGLE), the
    base of the drafter backends: each runs the drafter (with the target's LM head) over B
    images' 2B CFG rows and owns the drafter cache. A proposal is one backend call that catches
    up on the pending pairs and drafts the tree (:func:`draft_tree`), after which the pairs are
    committed to the drafter's cache; the verification teaches it nothing (the next catch-up
    brings the accepted pairs)."""

    name: str
    cache: KVCache
    vocab_size: int

    @abstractmethod
    def prefill(self, hidden: Tensor, fresh: Tensor, cond: Tensor, prefix: Tensor) -> None:
        """Restart the ``fresh`` [B] images' caches with the pairs of their condition prefix
        (:func:`prefix_pairs`, from the target's hidden states ``hidden`` [2B, T - 1, D] at all
        but its last slot; nothing for a one-slot prefix). ``cond`` [2B, ...] and ``prefix``
        [2B, T] are the target's condition rows and their visible slots: a prompt-token drafter
        pairs each state with its row's next token and hides the padding."""

    @abstractmethod
    def draft(self, tree: StaticTree, rows: CatchUp, noise: Tensor, sampling: FilterInputs) -> DraftOutputs:
        """:func:`draft_tree` over this backend's cache: catch-up ``rows``, uniform draw noise and
        the sampling settings. Returned tensors may be the backend's own buffers: valid until its
        next call."""

    @property
    def state(self) -> tuple[Tensor, ...]:
        """What a step updates in place: the drafter cache's length."""
        return (self.cache.length,)

    def noise_rows(self, tree: StaticTree) -> int:
        """One row per node that draws children (the module's :func:`noise_rows`)."""
        return noise_rows(tree)

    def propose(
        self, tree: StaticTree, pending: Pending, noise: Tensor, sampling: FilterInputs, greedy: Tensor
    ) -> Draft:
        """Draft ``tree`` below each image's root (the last of its m pending tokens, at target
        position ``pending.root_position``; ``pending.hidden`` holds the target's hidden states
        before each of them) from the uniform ``noise`` [B, noise_rows(tree), V]
        (sampling.draw_noise: greedy drafts come from its constant noise, so ``greedy`` is not
        read) and commit the pending pairs of the active images to the drafter's cache, all on
        the device."""
        m, cache = pending.count, self.cache
        rows = CatchUp(pending.tokens, pending.hidden, m, pending.root_position, cache.length, cache.prefix)
        tokens, valid, q, new_k, new_v = self.draft(tree, rows, noise, sampling)
        if new_k is None:  # written in place: the catch-up rows lie in the scratch slots
            cache.commit(None, None, caught_up(catch_up_rows(tree), m), m * pending.active)
        else:
            cache.write(new_k, new_v, m * pending.active)
        return Draft(tokens, valid, q)

    def record(self, verified: Verified, active: Tensor) -> None:  # noqa: B027 (a no-op by design)
        """Nothing to keep: the next proposal catches up on the committed pairs."""
