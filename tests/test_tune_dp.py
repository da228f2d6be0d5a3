"""lantern tune's model: Sequoia's dynamic program against brute force over small trees, the
expected tokens of a tree (per step, and per step over an image of a few tokens) against a
simulated acceptance, the acceptance estimates from counted sibling tests against a known
synthetic acceptance model, and exactness on a tuned tree."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from lantern_rt.runtime.tree import StaticTree, build_tree, load_tree
from lantern_rt.tune.acceptance import (
    PRIOR_TESTS,
    AcceptanceCounts,
    AcceptanceError,
    AcceptanceTable,
    calibration_tree,
)
from lantern_rt.tune.dp import best_trees, expected_tokens, fastest_tree, image_tokens_per_step
from tests.test_acceptance import SAMPLES, _chi_square, _markov_sequences

Z = 4.0  # a statistical check's bound in standard errors (false alarms about 6e-5 per check)


def _forests(n: int, d: int, depth: int, width: int, rank: int = 0) -> Iterator[list[tuple[int, ...]]]:
    """Every forest of at most ``n`` nodes of children ranked ``rank``.. below a node at depth
    ``d`` - 1, depth and width bounded (paths relative to that node)."""
    yield []
    if rank >= width or n == 0 or d > depth:
        return
    for m in range(1, n + 1):
        for below in _forests(m - 1, d + 1, depth, width):
            for rest in _forests(n - m, d, depth, width, rank + 1):
                yield [(rank,), *((rank, *p) for p in below), *rest]


def _all_trees(n: int, depth: int, width: int) -> list[StaticTree]:
    return [build_tree(paths) for paths in _forests(n, 1, depth, width) if paths]


def _random_p(seed: int, depth: int = 3, width: int = 3) -> np.ndarray:
    """Acceptance probabilities falling with the rank, varying with the depth."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.uniform(0.05, 0.95, (depth, width)), axis=1)[:, ::-1]


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force(seed: int) -> None:
    p = _random_p(seed)
    trees = _all_trees(6, depth=3, width=3)
    assert len(trees) > 300  # the enumeration covers many shapes
    for choice in best_trees(p, max_nodes=6, max_depth=3, max_width=3):
        n = len(choice.tree.paths)
        best = max(expected_tokens(t, p) for t in trees if t.num_nodes <= n)
        assert choice.tokens == pytest.approx(expected_tokens(choice.tree, p), abs=1e-12)
        assert choice.tokens >= best - 1e-12, (n, choice.tree.paths)


def test_dp_keeps_the_bounds() -> None:
    p = np.full((6, 5), 0.9)
    for choice in best_trees(p, max_nodes=20, max_depth=4, max_width=2):
        assert choice.tree.max_depth <= 4 and choice.tree.width <= 2 and choice.tree.num_nodes <= 20
    never = np.zeros((3, 3))
    never[0, 0] = 0.5  # one position ever accepted: one node is the best of any budget
    assert {c.tree.paths for c in best_trees(never, 8, 3, 3)} == {((0,),)}


def test_fastest_tree_trades_tokens_for_cost() -> None:
    p = np.full((8, 4), 0.7)
    cheap = fastest_tree(p, lambda t: 1.0, max_nodes=12, max_depth=8, max_width=4)
    costly = fastest_tree(p, lambda t: 1.0 + 0.2 * t.num_nodes, max_nodes=12, max_depth=8, max_width=4)
    assert cheap.tree.num_nodes == 12  # free nodes: the whole budget
    assert costly.tree.num_nodes < 12 and costly.rate == pytest.approx(
        max(c.tokens / (1 + 0.2 * c.tree.num_nodes) for c in best_trees(p, 12, 8, 4))
    )


def _simulate(tree: StaticTree, p: np.ndarray, steps: int, rng: np.random.Generator) -> Iterator[list[int]]:
    """Accepted paths (node ids, the root first) of ``steps`` verify steps when a child at depth
    d and rank r is accepted with probability p[d - 1, r] after its elder siblings' rejection."""
    for _ in range(steps):
        path = [0]
        while kids := tree.children[path[-1]]:
            for kid in kids:
                d, r = tree.depths[kid], tree.ranks[kid]
                if rng.random() < p[d - 1, r]:
                    path.append(kid)
                    break
            else:
                break
        yield path


def test_expected_tokens_match_simulated_steps() -> None:
    p = _random_p(7, depth=5, width=4)
    rng = np.random.default_rng(0)
    for tree in (load_tree("mc_sim_7b_63"), load_tree("chain-4"), calibration_tree(3, 4)):
        committed = np.array([len(path) for path in _simulate(tree, p, 20_000, rng)], float)
        error = Z * committed.std() / math.sqrt(len(committed))
        assert abs(committed.mean() - expected_tokens(tree, p)) < error, tree.name


def test_an_images_last_step_keeps_only_the_tokens_it_lacks() -> None:
    p = _random_p(5, depth=5, width=4)
    rng = np.random.default_rng(2)
    tokens = 12  # few tokens a step: the last step's cut weighs
    for tree in (load_tree("chain-4"), load_tree("mc_sim_7b_63")):
        steps = []
        for _ in range(4000):
            left, taken = tokens, 0
            while left > 0:
                left -= len(next(_simulate(tree, p, 1, rng)))
                taken += 1
            steps.append(taken)
        error = Z * np.std(steps) / math.sqrt(len(steps))
        assert abs(np.mean(steps) - tokens / image_tokens_per_step(tree, p, tokens)) < error, tree.name
        assert np.mean(steps) - tokens / expected_tokens(tree, p) > 3 * error, tree.name  # the cut


def test_acceptance_estimates_recover_a_synthetic_model() -> None:
    depth, width = 4, 3
    p = _random_p(11, depth, width)
    tree = calibration_tree(width, depth)
    counts = AcceptanceCounts(depth, width)
    for path in _simulate(tree, p, 6000, np.random.default_rng(1)):
        counts.count_step(tree, path, len(path) - 1)
    table = counts.table("synthetic")
    estimate, tests = table.probabilities(), np.asarray(table.tests)
    assert tests.min() >= 100  # every position was tested below the spine
    bound = Z * np.sqrt(p * (1 - p) / tests) + PRIOR_TESTS / (tests + PRIOR_TESTS)
    assert (np.abs(estimate - p) < bound).all(), np.round(estimate - p, 3)
    again = AcceptanceTable.from_json(table.to_json())
    assert (again.probabilities() == estimate).all()


@pytest.mark.parametrize(
    ("tests", "accepts", "match"),
    [
        ([[3, 1]], [[4, 0]], "more tests than it had"),
        ([[3, 1]], [[1]], "of one shape"),
        ([[3, 1], [2]], [[1, 0], [1]], "of one shape"),
        ([[3.0, 1]], [[1, 0]], "of one shape"),
        ([[0, 0]], [[0, 0]], "tested no draft"),
        ("x", [[0]], "of one shape"),
    ],
)
def test_malformed_acceptance_tables_are_refused(tests, accepts, match) -> None:
    with pytest.raises(AcceptanceError, match=match):
        AcceptanceTable.from_json({"rule": "exact", "tests": tests, "accepts": accepts})


def test_a_tuned_tree_is_exact() -> None:
    """Sampling over a tree the dynamic program chose is lossless: the chi-square test of
    tests/test_acceptance.py (a Markov target and a drafter that disagrees with it) on it."""
    p = np.array([[0.6, 0.5, 0.4, 0.3], [0.7, 0.5, 0.3, 0.2]])
    choice = fastest_tree(p, lambda t: 1.0 + 0.02 * t.num_nodes, 9, 2, 4)
    tree = choice.tree
    assert tree.width > 1 and tree.max_depth == 2  # a real tree, not a chain
    stat, critical = _chi_square(_markov_sequences(tree, SAMPLES, seed=5))
    print(f"chi-square on the tuned tree {tree.paths}: {stat:.1f} (critical {critical:.1f})")
    assert stat < critical
