"""What a decode step costs on this machine, per batch size: an AR step, a drafting call, a
verify call of n tokens and the host's share of a step (noise, commit, the loop), measured by
timing the calls of real decodes in rounds until their means settle (:class:`CostRounds`), and
the cost model the tree search reads (:class:`CostModel`).

The verify curve over n = 1..N tokens runs through the verify calls measured (AR's one token and
each measured tree's N + 1), linear between them; drafting and the host's share are a measured
tree's own, and for a tree of another shape fitted linearly in its depth and nodes over the
trees measured. A step's prediction for a tree
of n nodes and depth d is verify(n + 1) + draft(d, n) + host(d, n), and holds for the trees
the model covers (:meth:`CostModel.covers`): depth and nodes within those of the trees measured,
where the fit interpolates rather than extrapolates. On a pipeline whose steps are replayed from
CUDA graphs (torch on a CUDA device) a step is one replay, measured as its verify call (drafting
included, :mod:`.session`): the verify curve is then the whole step's and drafting adds nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lantern_rt.runtime.tree import StaticTree, chain_tree
from lantern_rt.tune import MAX_ROUNDS
from lantern_rt.tune.session import Candidate, DecodeRun

# Rounds of one batch per candidate, the candidates in turn (a load that comes and goes on a shared
# machine weighs on each alike): at least MIN_ROUNDS, then until a candidate's mean step moves by
# less than SETTLED between its rounds, at most MAX_ROUNDS (a tune's own, when it asks fewer)
MIN_ROUNDS, SETTLED = 3, 0.03


@dataclass(frozen=True)
class StepCost:
    """One candidate's measured costs at one batch size (seconds, means over its calls)."""

    label: str
    nodes: int  # drafted nodes (0: AR)
    depth: int
    jacobi: bool  # drafts from a Jacobi window (its drafting is host work)
    verify: float  # a verify call (AR: the AR step)
    draft: float  # a drafting call (0: AR or a Jacobi window)
    host: float  # the rest of a step
    prefill: float  # prefill seconds per image
    tokens_per_step: float  # measured tau (bonus included)
    spread: float  # the images' steps: standard deviation over mean
    rounds: int

    @property
    def step(self) -> float:
        return self.verify + self.draft + self.host


def step_cost(candidate: Candidate, runs: Sequence[DecodeRun]) -> StepCost:
    """The costs ``runs`` of ``candidate`` measured: its calls' means, and the host's share of a
    step, the wall time no call took."""
    calls = {name: [t for run in runs for t in run.calls[name]] for name in ("verify", "draft", "prefill")}
    steps = sum(run.steps for run in runs)
    host = (sum(run.seconds for run in runs) - sum(sum(times) for times in calls.values())) / steps
    per_image = [n for run in runs for n in run.image_steps]
    tree = candidate.tree
    return StepCost(
        candidate.label,
        tree.num_nodes if tree else 0,
        tree.max_depth if tree else 0,
        candidate.method.jacobi,
        statistics.fmean(calls["verify"]),
        statistics.fmean(calls["draft"]) if calls["draft"] else 0.0,
        max(host, 0.0),
        sum(calls["prefill"]) / sum(run.images for run in runs),
        sum(sum(run.committed) for run in runs) / sum(len(run.committed) for run in runs),
        statistics.pstdev(per_image) / statistics.fmean(per_image),
        len(runs),
    )


class CostRounds:
    """The rounds of one batch size's cost candidates: :meth:`settle` before the tree search,
    :meth:`round` between the measured slices after it (one clock for the cost rounds and the
    candidates' measurements), and :meth:`model`, fitted to every round so far."""

    def __init__(
        self, batch_size: int, candidates: Sequence[Candidate], decode: Callable[[Candidate, int], DecodeRun]
    ) -> None:
        """``decode(candidate, round)`` decodes one batch of ``candidate``, its ``round``-th."""
        self.batch_size, self.candidates, self.decode = batch_size, list(candidates), decode
        self.runs: list[list[DecodeRun]] = [[] for _ in self.candidates]

    def _add(self, index: int) -> None:
        done = self.runs[index]
        done.append(self.decode(self.candidates[index], len(done)))

    def settle(self, after_round: Callable[[], None], max_rounds: int = MAX_ROUNDS) -> None:
        """Rounds of the candidates in turn, each until its mean step settles (:data:`SETTLED`),
        between :data:`MIN_ROUNDS` (or ``max_rounds`` when fewer) and ``max_rounds`` rounds;
        ``after_round()`` after each."""
        for _ in range(max_rounds):
            for index, (candidate, done) in enumerate(zip(self.candidates, self.runs, strict=True)):
                if len(done) >= min(MIN_ROUNDS, max_rounds):
                    last, before = step_cost(candidate, done).step, step_cost(candidate, done[:-1]).step
                    if abs(last - before) <= SETTLED * before:
                        continue
                self._add(index)
            after_round()

    def round(self) -> None:
        """One more round: a batch of every candidate, in turn."""
        for index in range(len(self.candidates)):
            self._add(index)

    def model(self) -> CostModel:
        """The cost model of every round measured so far."""
        return CostModel(
            self.batch_size,
            tuple(step_cost(c, done) for c, done in zip(self.candidates, self.runs, strict=True)),
        )


def batch_drain(batch: int) -> float:
    """The expected largest of ``batch`` standard normal values (Blom's approximation; 0 for
    one): how many standard deviations of an image's steps a batch started together runs
    beyond the mean, its slots idling as images finish."""
    if batch == 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((batch - 0.375) / (batch + 0.25))


def _linear_fit(points: Sequence[tuple[int, int, float]]) -> np.ndarray:
    """(a, b, c) of seconds = a + b * depth + c * nodes over (depth, nodes, seconds), least squares
    of the relative errors (a cost under a microsecond counts as one): the costs of the largest
    trees, far above a line through the small ones, do not pull the plane off the small ones."""
    design = np.array([[1.0, d, n] for d, n, _ in points])
    values = np.array([s for _, _, s in points])
    weights = 1.0 / np.maximum(values, 1e-6)
    return np.linalg.lstsq(design * weights[:, None], values * weights, rcond=None)[0]


@dataclass(frozen=True)
class CostModel:
    """The costs of one batch size's steps, from the candidates measured there."""

    batch_size: int
    measured: tuple[StepCost, ...]

    @property
    def ar(self) -> StepCost:
        return next(c for c in self.measured if c.nodes == 0)

    @property
    def max_nodes(self) -> int:
        """The most drafted nodes a measured verify call scored: the curve's end."""
        return max(c.nodes for c in self.measured)

    def verify(self, tokens: int) -> float:
        """A verify call of ``tokens`` tokens (the root included): linear between the measured ones."""
        points = sorted({c.nodes + 1: c.verify for c in self.measured}.items())
        return float(np.interp(tokens, [n for n, _ in points], [s for _, s in points]))

    def covers(self, tree: StaticTree, jacobi: bool = False) -> bool:
        """Whether ``tree``'s depth and its nodes each lie within those of the measured trees of
        its drafting kind (the plane's range): outside it a step's drafting and host costs would
        be extrapolated."""
        shapes = [(c.depth, c.nodes) for c in self.measured if c.nodes and c.jacobi == jacobi]
        if not shapes:
            return False
        depths, nodes = zip(*shapes, strict=True)
        return min(depths) <= tree.max_depth <= max(depths) and min(nodes) <= tree.num_nodes <= max(nodes)

    def _fitted(self, field_name: str, tree: StaticTree, jacobi: bool) -> float:
        """``field_name`` (draft or host) of a step over ``tree``: a measured tree's of its shape
        (nodes and depth), else the plane fitted over the measured trees."""
        same = [
            getattr(c, field_name)
            for c in self.measured
            if (c.nodes, c.depth, c.jacobi) == (tree.num_nodes, tree.max_depth, jacobi)
        ]
        if same:
            return float(np.mean(same))
        points = [
            (c.depth, c.nodes, getattr(c, field_name))
            for c in self.measured
            if c.nodes and c.jacobi == jacobi
        ]
        if not points:
            return 0.0
        if len({(d, n) for d, n, _ in points}) < 3:  # too few shapes for a plane: their mean
            return float(np.mean([s for _, _, s in points]))
        a, b, c = _linear_fit(points)
        return max(float(a + b * tree.max_depth + c * tree.num_nodes), 0.0)

    def step(self, tree: StaticTree | None, jacobi: bool = False) -> float:
        """A step's predicted seconds: AR's measured step (``tree`` None), else verify, drafting
        (none for a Jacobi window) and the host's share over ``tree``."""
        if tree is None:
            return self.ar.step
        draft = 0.0 if jacobi else self._fitted("draft", tree, jacobi)
        return self.verify(tree.num_nodes + 1) + draft + self._fitted("host", tree, jacobi)

    def prefill(self) -> float:
        """Prefill seconds per image (the mean over the candidates measured)."""
        return float(np.mean([c.prefill for c in self.measured]))

    def spread(self, tree: StaticTree | None) -> float:
        """The spread of an image's steps (standard deviation over mean): 0 for AR, else the mean
        of the speculative candidates measured."""
        spreads = [c.spread for c in self.measured if c.nodes]
        return 0.0 if tree is None or not spreads else float(np.mean(spreads))

    def seconds_per_image(
        self, tree: StaticTree | None, tokens_per_step: float, tokens: int, jacobi: bool = False
    ) -> float:
        """An image's predicted seconds in a batch of this size started together: its ``tokens``
        after the prefill's first in steps of ``tokens_per_step``, the batch running until its
        longest image ends (:func:`batch_drain`), each step shared by the batch's images."""
        steps = (tokens - 1) / tokens_per_step * (1 + self.spread(tree) * batch_drain(self.batch_size))
        return steps * self.step(tree, jacobi) / self.batch_size + self.prefill()

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "measured": [asdict(c) for c in self.measured]}

    def curves(self) -> dict[str, Any]:
        """The verify curve at n = 1..N tokens and the drafting call per depth of the chains the
        model covers, as the tree search reads them, for the record."""
        chains = [chain_tree(d) for d in range(1, 1 + max(c.depth for c in self.measured))]
        return {
            "verify_seconds": [self.verify(n) for n in range(1, self.max_nodes + 2)],
            "draft_seconds_per_depth": {
                t.max_depth: self._fitted("draft", t, False) for t in chains if self.covers(t)
            },
        }
