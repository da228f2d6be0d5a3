"""Drafting a static tree with the drafter, level by level, in fixed-shape calls.

Per decode step the drafter makes ``max_depth`` calls:
1. catch-up: the pairs committed since the last step (accepted path + bonus, at most
   ``max_depth + 1``, padded to that many rows), whose last row is the root; its output gives
   the distribution the root's children are drawn from;
2. one call per tree level 1..max_depth-1: every node of the level, paired with its parent's
   predicted hidden state, attending to the committed cache, its ancestors' entries (kept in
   scratch slots right after the committed length) and itself.
At each node ``tree.width`` distinct children are drawn without replacement (Gumbel-top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from lantern_rt.runtime.backends.base import DrafterBackend
from lantern_rt.runtime.sampling import SamplingConfig, cfg_mix, distribution, draw_distinct
from lantern_rt.runtime.tree import StaticTree

# Most distinct children drafted per node: tree ranks must stay below it (the authors' TOPK).
MAX_DRAFT_WIDTH = 10


@dataclass
class Draft:
    """A drafted tree: tokens [N+1] (root first), valid [N+1], drafter probabilities q [N+1, V]."""

    tokens: Tensor
    valid: Tensor
    q: Tensor


@dataclass(frozen=True)
class LevelPlan:
    nodes: Tensor  # node ids at this depth
    parents: Tensor  # their parents' node ids
    ranks: Tensor  # their sibling ranks
    scratch: Tensor  # [n, N] bool: the scratch slots (node id - 1) of each node's strict ancestors
    own_mask: Tensor  # [n, n] bool: each node sees only itself among the new rows
    slots: Tensor  # the nodes' scratch slots (node id - 1)
    last_slot: int


@lru_cache(maxsize=32)
def level_plans(tree: StaticTree, device: torch.device) -> tuple[LevelPlan, ...]:
    """Static per-level index tables for depths 1..max_depth, on ``device``."""
    plans = []
    for nodes in tree.levels[1:]:
        scratch = torch.zeros(len(nodes), tree.num_nodes, dtype=torch.bool)
        for i, node in enumerate(nodes):
            for a in tree.ancestors[node][:-1]:
                scratch[i, a - 1] = True
        ids = torch.tensor(nodes)
        plans.append(
            LevelPlan(
                nodes=ids.to(device),
                parents=tree.parent[list(nodes)].to(device),
                ranks=tree.rank[list(nodes)].to(device),
                scratch=scratch.to(device),
                own_mask=torch.eye(len(nodes), dtype=torch.bool, device=device),
                slots=(ids - 1).to(device),
                last_slot=max(nodes) - 1,
            )
        )
    return tuple(plans)


@lru_cache(maxsize=64)
def catch_up_mask(rows: int, m: int, device: torch.device) -> Tensor:
    """[rows, rows]: the first ``m`` rows causal, padding rows see only themselves."""
    causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    causal[m:] = torch.eye(rows, dtype=torch.bool, device=device)[m:]
    return causal


def catch_up_rows(tree: StaticTree) -> int:
    """Rows of the catch-up call: the longest accepted path plus the bonus token."""
    return tree.max_depth + 1


def draft_tree(
    drafter: DrafterBackend,
    tree: StaticTree,
    pending_tokens: Tensor,
    pending_hidden: Tensor,
    root_position: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Draft:
    """Feed the pending pairs, then draft ``tree`` below the root (the last pending token).

    ``pending_tokens`` [m] are the tokens committed since the last call, ``pending_hidden``
    [2, m, D] the target hidden states of the positions before each of them; the root sits at
    target position ``root_position``.
    """
    device = pending_tokens.device
    m, rows = pending_tokens.shape[0], catch_up_rows(tree)
    pad = rows - m
    tokens = torch.cat([pending_tokens, pending_tokens.new_zeros(pad)])
    hidden = torch.cat([pending_hidden, pending_hidden.new_zeros(2, pad, pending_hidden.shape[-1])], dim=1)
    positions = torch.full((rows,), root_position, device=device)
    positions[:m] = torch.arange(root_position - m + 1, root_position + 1, device=device)
    logits, out = drafter.step(tokens, hidden, positions, catch_up_mask(rows, m, device), None)
    drafter.cache.commit(list(range(m)))

    n = tree.num_nodes + 1
    q_rows = distribution(cfg_mix(logits[:, m - 1 : m], sampling.cfg_scale), sampling)
    q = q_rows.new_zeros(n, q_rows.shape[-1])
    q[0] = q_rows[0]
    node_tokens = torch.zeros(n, dtype=torch.long, device=device)
    node_tokens[0] = pending_tokens[-1]
    valid = torch.ones(n, dtype=torch.bool, device=device)
    node_hidden = out.new_zeros(2, n, out.shape[-1])
    node_hidden[:, 0] = out[:, m - 1]
    drawn, drawn_ok = draw_distinct(q[:1], tree.width, sampling.greedy, generator)
    drawn_ids = torch.zeros(n, tree.width, dtype=torch.long, device=device)
    drawn_valid = torch.zeros(n, tree.width, dtype=torch.bool, device=device)
    drawn_ids[0], drawn_valid[0] = drawn[0], drawn_ok[0]

    for depth, plan in enumerate(level_plans(tree, device), start=1):
        nodes, parents, ranks = plan.nodes, plan.parents, plan.ranks
        node_tokens[nodes] = drawn_ids[parents, ranks]
        valid[nodes] = drawn_valid[parents, ranks]
        if depth == tree.max_depth:
            break
        logits, out = drafter.step(
            node_tokens[nodes],
            node_hidden[:, parents],
            torch.full((nodes.shape[0],), root_position + depth, device=device),
            plan.own_mask,
            plan.scratch,
        )
        drafter.cache.place(plan.slots, plan.last_slot)
        node_hidden[:, nodes] = out
        q[nodes] = distribution(cfg_mix(logits, sampling.cfg_scale), sampling)
        ids, ok = draw_distinct(q[nodes], tree.width, sampling.greedy, generator)
        drawn_ids[nodes], drawn_valid[nodes] = ids, ok
    return Draft(node_tokens, valid, q)
