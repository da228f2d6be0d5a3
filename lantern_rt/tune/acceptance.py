"""Positional acceptance (Sequoia's acceptance vector, arXiv 2402.12374, per depth): how often a
drafted node at each tree position (depth x sibling rank) is accepted once its parent is and its
elder siblings were rejected, counted in calibration decodes of the model itself.

A verify step's accepted path says which sibling tests it made (docs/method.md §5.1): at each
depth on the path, the ranks before the accepted node's were tested and rejected and its own
accepted; below the path's last node every child was tested and rejected (:func:`count_step`).
The calibration tree (:func:`calibration_tree`) gives every node of its rank-0 spine ``width``
children, so each position is tested below an all-rank-0 path: the positional assumption is
that a position's chance does not depend on the ranks above it. Where a step starts does depend
on the tree, though: hard tokens come in runs, and a wide tree that accepts a lower rank where a
chain's rank 0 is rejected commits one token more, so its next step starts past the run more
often. Rank 0 is counted in a chain's steps where a chain is calibrated (:func:`pooled_counts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lantern_rt.errors import LanternError
from lantern_rt.runtime.tree import StaticTree, build_tree

# Pseudo-tests that pull a position's estimate towards its rank's estimate over all depths: a
# deep position is tested only when the path reaches it, and a handful of tests say little
PRIOR_TESTS = 4.0


class AcceptanceError(LanternError, ValueError):
    """An acceptance table that is malformed or from a calibration that tested nothing."""


def calibration_tree(width: int, depth: int) -> StaticTree:
    """``spine-W-D``: each node of the rank-0 path from the root down to depth ``depth`` - 1 has
    ``width`` children (W x D nodes)."""
    paths = [(0,) * d + (r,) for d in range(depth) for r in range(width)]
    return build_tree(paths, name=f"spine-{width}-{depth}")


@dataclass
class AcceptanceCounts:
    """Sibling tests made and passed at each position, [depth 1..D][rank 0..W-1]."""

    depth: int
    width: int
    tests: np.ndarray = field(init=False)
    accepts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.tests = np.zeros((self.depth, self.width), dtype=np.int64)
        self.accepts = np.zeros((self.depth, self.width), dtype=np.int64)

    def count_step(self, tree: StaticTree, kept: Sequence[int], length: int) -> None:
        """Count the tests of one verify step of ``tree`` whose accepted path is ``kept[1 :
        length + 1]`` (node ids, :class:`~lantern_rt.runtime.acceptance.Verified`'s ``kept``)."""
        node = 0
        for d in range(1, length + 1):
            node = kept[d]
            rank = tree.ranks[node]
            if d <= self.depth:
                self.tests[d - 1, : min(rank + 1, self.width)] += 1
                if rank < self.width:
                    self.accepts[d - 1, rank] += 1
        children = len(tree.children[node])
        if children and length < self.depth:
            self.tests[length, : min(children, self.width)] += 1

    def table(self, rule: str) -> AcceptanceTable:
        """The estimates of these counts for the acceptance ``rule`` (a label)."""
        return AcceptanceTable(rule, self.tests.tolist(), self.accepts.tolist())


def pooled_counts(counts: Sequence[tuple[StaticTree, AcceptanceCounts]]) -> AcceptanceCounts:
    """The counts of several calibration trees (each tree and what its decodes counted, all of
    one shape) as one: every position pooled over the trees, except the rank-0 positions a chain
    among them tested, counted in the chains' steps alone. A wide tree's steps start in easier
    places than a chain's (see the module's docstring), which on the demo put the spine tree's
    rank-0 rates 1-3 points above chain-8's and chain-8's predicted tau 1.4% high."""
    depth, width = counts[0][1].depth, counts[0][1].width
    total, chains = AcceptanceCounts(depth, width), AcceptanceCounts(depth, width)
    for tree, c in counts:
        for into in (total, chains) if tree.is_chain else (total,):
            into.tests += c.tests
            into.accepts += c.accepts
    tested = chains.tests[:, 0] > 0
    total.tests[tested, 0] = chains.tests[tested, 0]
    total.accepts[tested, 0] = chains.accepts[tested, 0]
    return total


@dataclass(frozen=True)
class AcceptanceTable:
    """One acceptance rule's counts per position and their estimates (:meth:`probabilities`)."""

    rule: str  # e.g. "lantern++ k=10 lambda=5"
    tests: list[list[int]]  # [depth][rank]
    accepts: list[list[int]]

    def __post_init__(self) -> None:
        tests, accepts = _grid(self.tests), _grid(self.accepts)
        if tests is None or accepts is None or tests.shape != accepts.shape or not (0 <= accepts).all():
            raise AcceptanceError(
                f"acceptance table of {self.rule}: tests and accepts must be [depth][rank] tables of "
                "integers >= 0 of one shape"
            )
        if (accepts > tests).any():
            raise AcceptanceError(
                f"acceptance table of {self.rule}: a position passed more tests than it had"
            )
        if not tests[0, 0]:
            raise AcceptanceError(f"acceptance table of {self.rule}: the calibration tested no draft")

    @property
    def shape(self) -> tuple[int, int]:
        """(depth, width) calibrated."""
        return len(self.tests), len(self.tests[0])

    def probabilities(self) -> np.ndarray:
        """[D, W]: each position's acceptance estimate, its rate pulled towards its rank's rate
        over all depths by :data:`PRIOR_TESTS` pseudo-tests (0 for a rank never tested)."""
        tests, accepts = np.asarray(self.tests, float), np.asarray(self.accepts, float)
        pooled = np.divide(accepts.sum(0), tests.sum(0), out=np.zeros(tests.shape[1]), where=tests.sum(0) > 0)
        return (accepts + PRIOR_TESTS * pooled) / (tests + PRIOR_TESTS)

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "tests": self.tests, "accepts": self.accepts}

    @classmethod
    def from_json(cls, data: Any) -> AcceptanceTable:
        """The table :meth:`to_json` wrote; :class:`AcceptanceError` for anything else."""
        if not isinstance(data, dict) or not isinstance(data.get("rule"), str):
            raise AcceptanceError("an acceptance table is {rule, tests, accepts}")
        return cls(data["rule"], data.get("tests"), data.get("accepts"))


def _grid(value: Any) -> np.ndarray | None:
    """``value`` as a 2-D integer array when it is a non-empty list of equally long non-empty
    lists of integers (not booleans), else None."""
    if not isinstance(value, list) or not value or not all(isinstance(row, list) and row for row in value):
        return None
    if len({len(row) for row in value}) != 1:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for row in value for v in row):
        return None
    return np.asarray(value, dtype=np.int64)
