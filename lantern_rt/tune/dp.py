"""Sequoia's dynamic program (arXiv 2402.12374, section 3.1) for the static tree of at most n
nodes that commits the most tokens per verify step, given how often each tree position (depth x
sibling rank) is accepted (:class:`~lantern_rt.tune.acceptance.AcceptanceTable`), and the tree
of the most tokens per second given what a step over a tree of n nodes and depth d costs.

A child of rank r at depth d is accepted, once its parent is, with probability
``chance[d, r] = p(d, r) * prod_{j < r} (1 - p(d, j))``: its elder siblings were tested first
and rejected (the sibling tests of docs/method.md §5.1). A node is reached with the product of
the chances on its path, and a step commits ``1 + sum over nodes of that product`` tokens
(the bonus included): :func:`expected_tokens`. That sum splits over a node's children, so the
best forest of at most n nodes under a node at depth d - 1 is the best split of n among its
children of ranks 0, 1, ... (siblings contiguous from rank 0, as every tree here must be).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lantern_rt.runtime.tree import StaticTree, build_tree


def accept_chances(p: np.ndarray) -> np.ndarray:
    """[D, W] chances that the child of each rank at each depth (rows depth 1..D) is the one its
    parent accepts, from the acceptance probabilities ``p`` [D, W] of each position given its
    elder siblings were rejected."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    rejected_before = np.cumprod(np.concatenate([np.ones((p.shape[0], 1)), 1.0 - p[:, :-1]], axis=1), axis=1)
    return p * rejected_before


def _reach(tree: StaticTree, p: np.ndarray) -> list[float]:
    """Node id -> the chance a verify step of ``tree`` accepts its path, the root's 1."""
    chances = accept_chances(p)
    depth, width = chances.shape
    reach = [1.0]
    for node, (d, r) in enumerate(zip(tree.depths[1:], tree.ranks[1:], strict=True), start=1):
        chance = chances[d - 1, r] if d <= depth and r < width else 0.0
        reach.append(reach[tree.parents[node]] * chance)
    return reach


def expected_tokens(tree: StaticTree, p: np.ndarray) -> float:
    """Tokens one verify step of ``tree`` commits on average (the bonus included) when each
    position is accepted with probability ``p`` [D, W] (0 for a position ``p`` does not hold)."""
    return float(sum(_reach(tree, p)))


def image_tokens_per_step(tree: StaticTree, p: np.ndarray, tokens: int) -> float:
    """Tokens per verify step over an image of ``tokens`` tokens decoded with ``tree`` (steps
    independent, as in :func:`expected_tokens`): an image's last step keeps only the tokens the
    image still lacks, so this is below :func:`expected_tokens` (on the demo's 255 tokens, by
    0.6-0.9% for chain-3 to chain-8 as measured)."""
    reach = _reach(tree, p)
    ends = np.zeros(tree.max_depth + 2)  # [k]: the chance a step commits k tokens
    for node, chance in enumerate(reach):
        below = sum(reach[child] for child in tree.children[node])
        ends[tree.depths[node] + 1] += chance - below
    steps = np.zeros(tokens + 1)  # [t]: the expected steps to commit t more tokens
    for t in range(1, tokens + 1):
        steps[t] = 1.0 + sum(ends[k] * steps[max(t - k, 0)] for k in range(1, len(ends)))
    return tokens / float(steps[tokens])


@dataclass(frozen=True)
class Choice:
    """The best tree the program found for a budget: its expected tokens per step and, when
    costed, per second."""

    tree: StaticTree
    tokens: float  # expected tokens per step, the bonus included
    seconds: float = 0.0  # a step's predicted seconds (0: not costed)

    @property
    def rate(self) -> float:
        """Expected tokens per second."""
        return self.tokens / self.seconds if self.seconds else 0.0


def best_trees(p: np.ndarray, max_nodes: int, max_depth: int, max_width: int) -> list[Choice]:
    """For every budget n = 1..``max_nodes``, the tree of at most n nodes, depth ``max_depth``
    and ``max_width`` children per node that commits the most tokens per step (ties: the fewer
    nodes), by Sequoia's dynamic program over the acceptance probabilities ``p`` [D, W]
    (positions beyond them are never accepted, so never chosen)."""
    chances = accept_chances(p)
    depth = min(max_depth, chances.shape[0])
    width = min(max_width, chances.shape[1])
    # forest[d][n]: the most reached-node mass of at most n nodes hanging below a node at depth
    # d - 1 (children at depth d); split[d][r][n]: nodes the rank-r child's subtree takes there
    forest = np.zeros((depth + 2, max_nodes + 1))
    split = np.zeros((depth + 2, width + 1, max_nodes + 1), dtype=np.int64)
    for d in range(depth, 0, -1):
        later = np.zeros(max_nodes + 1)  # the best of the ranks after r, for each budget
        for r in range(width - 1, -1, -1):
            subtree = chances[d - 1, r] * (1.0 + forest[d + 1])  # a rank-r child with m - 1 below it
            best = np.zeros(max_nodes + 1)
            for n in range(1, max_nodes + 1):
                options = subtree[:n] + later[n - 1 :: -1]  # m = 1..n nodes for the child's subtree
                m = int(np.argmax(options))
                if options[m] > best[n]:
                    best[n], split[d][r][n] = options[m], m + 1
            later = best
        forest[d] = later
    choices = []
    for n in range(1, max_nodes + 1):
        paths: list[tuple[int, ...]] = []
        _grow(split, width, 1, n, (), paths)
        if paths:
            choices.append(Choice(build_tree(paths, name="tuned"), 1.0 + float(forest[1][n])))
    return choices


def _grow(split: np.ndarray, width: int, d: int, n: int, above: tuple[int, ...], paths: list) -> None:
    """The paths of the best forest of at most ``n`` nodes below the node ``above`` (at depth d - 1)."""
    for r in range(width):
        m = int(split[d][r][n]) if n > 0 else 0
        if m == 0:
            return
        paths.append((*above, r))
        _grow(split, width, d + 1, m - 1, (*above, r), paths)
        n -= m


def fastest_tree(
    p: np.ndarray,
    step_seconds: Callable[[StaticTree], float],
    max_nodes: int,
    max_depth: int,
    max_width: int,
    costed: Callable[[StaticTree], bool] = lambda tree: True,
) -> Choice | None:
    """The tree of the most expected tokens per second: the best tree of every budget of nodes
    and depth (:func:`best_trees`) that ``costed(tree)`` says ``step_seconds`` holds for, each
    costed by ``step_seconds(tree)`` (a verify step's seconds: drafting, verify and the host's
    share); None when no such tree accepts a position."""
    found: dict[tuple, Choice] = {}
    for depth in range(1, max_depth + 1):
        for choice in best_trees(p, max_nodes, depth, max_width):
            if choice.tree.paths not in found and costed(choice.tree):
                found[choice.tree.paths] = Choice(choice.tree, choice.tokens, step_seconds(choice.tree))
    return max(found.values(), key=lambda c: c.rate, default=None)
