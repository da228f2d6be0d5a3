"""lantern tune's calibration counts pooled over its trees (:func:`pooled_counts`), against
synthetic images whose hard tokens come in runs: there a wide tree's steps start past a run
more often than a chain's, and the chain's tau must be predicted from the chain's own steps."""

from __future__ import annotations

import numpy as np
import pytest

from lantern_rt.runtime.tree import StaticTree, chain_tree
from lantern_rt.tune.acceptance import AcceptanceCounts, calibration_tree, pooled_counts
from lantern_rt.tune.dp import expected_tokens

Z = 4.0  # a statistical check's bound in standard errors
TOKENS = 256
EASY, HARD, SECOND = 0.97, 0.3, 0.5  # rank 0's chance on an easy and a hard token; a later rank's


def _image(rng: np.random.Generator) -> np.ndarray:
    """Rank 0's chance at each of an image's tokens: easy, but for a run of four hard tokens at a
    random place in every 32."""
    chance = np.full(TOKENS, EASY)
    for block in range(0, TOKENS, 32):
        start = block + int(rng.integers(0, 28))
        chance[start : start + 4] = HARD
    return chance


def _decode(
    tree: StaticTree, chance: np.ndarray, rng: np.random.Generator, counts: AcceptanceCounts
) -> list[int]:
    """One image decoded with ``tree``, each step's sibling tests counted: a node of rank 0 is
    accepted with the chance of its token, a later rank with :data:`SECOND` once the ranks before
    it were rejected. Returns the tokens each step commits, the bonus included (untruncated)."""
    children: list[list[int]] = [[] for _ in range(tree.num_nodes + 1)]
    for node in range(1, tree.num_nodes + 1):
        children[tree.parents[node]].append(node)
    start, committed = 0, []
    while start < TOKENS:
        kept = [0]
        while True:
            token = min(start + len(kept) - 1, TOKENS - 1)
            taken = next(
                (
                    child
                    for child in children[kept[-1]]
                    if rng.random() < (chance[token] if tree.ranks[child] == 0 else SECOND)
                ),
                None,
            )
            if taken is None:
                break
            kept.append(taken)
        counts.count_step(tree, kept, len(kept) - 1)
        committed.append(len(kept))
        start += len(kept)
    return committed


def _calibrate(trees: list[StaticTree], images: int, seed: int) -> list[tuple[StaticTree, AcceptanceCounts]]:
    """Each tree's counts over ``images`` synthetic images (the same difficulty per image for
    every tree, as the tune's calibration decodes the same images with each)."""
    rng = np.random.default_rng(seed)
    counted = [(tree, AcceptanceCounts(8, 4)) for tree in trees]
    for _ in range(images):
        chance = _image(rng)
        for tree, counts in counted:
            _decode(tree, chance, rng, counts)
    return counted


def test_a_chain_is_predicted_from_its_own_steps_not_the_wide_trees() -> None:
    spine, chain = calibration_tree(4, 8), chain_tree(8)
    counted = _calibrate([spine, chain], images=200, seed=0)
    rng, measured = np.random.default_rng(1), []
    for _ in range(400):
        measured += _decode(chain, _image(rng), rng, AcceptanceCounts(8, 4))
    tau, error = np.mean(measured), Z * np.std(measured) / np.sqrt(len(measured))
    predicted = expected_tokens(chain, pooled_counts(counted).table("synthetic").probabilities())
    everything = AcceptanceCounts(8, 4)  # every position pooled over both trees
    for _, counts in counted:
        everything.tests += counts.tests
        everything.accepts += counts.accepts
    pooled_all = expected_tokens(chain, everything.table("synthetic").probabilities())
    print(f"chain-8 tau {tau:.3f} +- {error:.3f}: predicted {predicted:.3f}, all pooled {pooled_all:.3f}")
    assert pooled_all > tau * 1.04  # the spine's easier starts: the bias this pooling avoids
    assert abs(predicted - tau) < error + 0.02 * tau


def test_only_rank_0_where_a_chain_reached_comes_from_the_chain() -> None:
    wide, chain = calibration_tree(4, 8), chain_tree(3)
    counted = _calibrate([wide, chain], images=4, seed=2)
    pooled = pooled_counts(counted)
    (_, w), (_, c) = counted
    assert (pooled.tests[:3, 0] == c.tests[:3, 0]).all() and (pooled.accepts[:3, 0] == c.accepts[:3, 0]).all()
    assert (pooled.tests[3:, 0] == w.tests[3:, 0]).all()  # deeper than the chain: the wide tree's
    assert (pooled.tests[:, 1:] == w.tests[:, 1:]).all() and (pooled.accepts[:, 1:] == w.accepts[:, 1:]).all()


@pytest.mark.parametrize(
    "trees", [[calibration_tree(4, 8)], [calibration_tree(4, 8), calibration_tree(2, 8)]]
)
def test_without_a_chain_every_position_is_pooled(trees: list[StaticTree]) -> None:
    counted = _calibrate(trees, images=3, seed=3)
    pooled = pooled_counts(counted)
    assert (pooled.tests == sum(c.tests for _, c in counted)).all()
    assert (pooled.accepts == sum(c.accepts for _, c in counted)).all()
