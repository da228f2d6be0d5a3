"""The one assembly of a :class:`~lantern_rt.runtime.decode.Speculation` from a drafter (or the
Jacobi window) and a tree, for every backend: what a decode stream adds to plain decoding
(docs/method.md §4, §11)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lantern_rt.models.config import GPTConfig
from lantern_rt.runtime.backends.base import Drafter, TargetBackend
from lantern_rt.runtime.decode import Speculation
from lantern_rt.runtime.jacobi import JacobiDrafter
from lantern_rt.runtime.method import MethodConfig
from lantern_rt.runtime.tree import StaticTree

# A method's neighbour table: a bundle's whole table (its acceptance graphs take it whatever the
# method), or a function of k for a model directory (loaded for the relaxed methods only).
Neighbors = torch.Tensor | Callable[[int], torch.Tensor]


def speculation(
    drafter: Drafter, tree: StaticTree, method: MethodConfig, neighbors: Neighbors, device: torch.device | str
) -> Speculation:
    """A speculative ``method``'s drafter, tree, acceptance rule and neighbour table on
    ``device``: ``neighbors`` itself (a table), or ``neighbors(k)`` for the relaxed methods (none
    for exact)."""
    relax = method.relaxation()
    if isinstance(neighbors, torch.Tensor):
        table = neighbors.to(device)
    else:
        table = neighbors(relax.k).to(device) if relax.relaxed else None
    return Speculation(drafter, tree, relax, table)


def jacobi_speculation(
    target: TargetBackend, gpt: GPTConfig, tree: StaticTree, method: MethodConfig, neighbors: Neighbors
) -> Speculation:
    """A Jacobi ``method``'s window (``tree``, a chain or a pac tree) with its coupling over
    ``target``'s batch and cache, on the target's device: no drafter (docs/method.md §11)."""
    cache = target.cache
    row = gpt.grid_size + gpt.row_end  # tokens per image row: the spatial drafts' "above"
    window = JacobiDrafter(
        tree,
        cache.images,
        gpt.vocab_size,
        cache.capacity,
        target.cls_token_num,
        row,
        cache.length.device,
        method.drafts_coupling,
    )
    return speculation(window, tree, method, neighbors, cache.length.device)


def method_speculation(
    target: TargetBackend,
    gpt: GPTConfig,
    tree: StaticTree,
    method: MethodConfig,
    drafter: Drafter | None,
    neighbors: Neighbors,
) -> Speculation:
    """A speculative ``method``'s speculation over ``target`` on ``tree``: the Jacobi window of
    the tree for a Jacobi method (``drafter`` None), else ``drafter``, on the target's device."""
    if method.jacobi:
        return jacobi_speculation(target, gpt, tree, method, neighbors)
    if drafter is None:
        raise ValueError(f"{method.method} drafts with a drafter: pass one")
    return speculation(drafter, tree, method, neighbors, target.cache.length.device)
