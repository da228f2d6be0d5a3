"""``lantern tune``'s run: export the candidates' graphs once (a model directory on a backend that
runs bundles) or take a bundle's, or run the model directory itself (torch, which verifies any
static tree), count each method's acceptance per tree position in calibration decodes, measure
the step costs per batch size, search the fastest tree (Sequoia's program for a drafter, the
best window for a Jacobi method), export it (a backend of bundles), then measure every candidate
(the tuned trees, every named tree, AR) and keep the fastest in the tuning record. A cost round
runs after each slice of the candidates' measurement, and their rows are predicted from the
rounds of before and during it: a machine whose speed moves over the minutes of a tune weighs on
the predictions as on the measurements.

Every measurement runs one decode stream with the graphs reading the whole KV cache (one cache
window), so that a call's cost does not depend on where in an image it runs.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lantern_rt.backends import MODEL, backend_named, default_backend
from lantern_rt.bundle import Bundle
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import bundle_info, open_bundle
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.backends.bundle_graphs import bundle_trees, bundle_windows
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
from lantern_rt.runtime.jacobi import is_window
from lantern_rt.runtime.run_shape import RunShape, check_batch_sizes
from lantern_rt.runtime.tree import MAX_PAC_WIDTH, StaticTree, TreeError, chain_tree, load_tree, pac_tree
from lantern_rt.settings import MethodConfig, default_sampling
from lantern_rt.tune import CALIBRATION_IMAGES, MAX_ROUNDS, MEASURED_IMAGES
from lantern_rt.tune.acceptance import AcceptanceCounts, AcceptanceTable, calibration_tree, pooled_counts
from lantern_rt.tune.costs import CostModel, CostRounds
from lantern_rt.tune.dp import Choice, expected_tokens, fastest_tree, image_tokens_per_step
from lantern_rt.tune.record import TUNED_TREE, record_path, this_machine, write_record
from lantern_rt.tune.session import Candidate, DecodeRun, TuneSession

# The named trees measured beside the tuned one: a drafter's, and a Jacobi window's
DRAFTER_TREES = ("chain-3", "chain-5", "chain-8", "mc_sim_7b_63", "naive_extend_57")
WINDOW_TREES = ("chain-5", "chain-16", "pac-2-1-33")
# The calibration tree's children per spine node and depth (a Jacobi window's: pac-W-1-...)
CALIBRATION_WIDTH, CALIBRATION_DEPTH = 4, 8
SEED = 0


@dataclass(frozen=True)
class TuneOptions:
    """What ``lantern tune`` measures: the speculative ``methods`` (their k, lambda and coupling;
    their tree is chosen here), the batch sizes, the named trees (empty: :data:`DRAFTER_TREES`
    and :data:`WINDOW_TREES`), images per candidate and batch size (at least four batches),
    calibration images, CPU threads, the backend (None: the run's default), the device,
    whether steps are replayed from CUDA graphs there (torch on a CUDA device, as its runs do)
    and the cost rounds before the search, at most (fewer: a quicker, rougher tune)."""

    methods: tuple[MethodConfig, ...]
    batch_sizes: tuple[int, ...] = (1,)
    trees: tuple[str, ...] = ()
    images: int = MEASURED_IMAGES
    calibration_images: int = CALIBRATION_IMAGES
    threads: int = 0
    backend: str | None = None
    device: str = "cpu"
    cuda_graphs: bool = True
    max_rounds: int = MAX_ROUNDS


@dataclass
class Row:
    """One candidate at one batch size: predicted and measured tokens per step (over whole
    images: an image's last step keeps only the tokens it lacks) and s/image, or why it was
    skipped. The s/image predicted is the cost model's of every round (those before the search
    and those between the measured slices); ``seconds_per_image_at_search`` is the search's
    (the rounds before it)."""

    batch_size: int
    label: str
    method: str
    tree: StaticTree | None
    tokens_per_step: float = 1.0
    seconds_per_image: float = 0.0
    measured_tokens_per_step: float | None = None
    measured_seconds_per_image: float | None = None
    skipped: str | None = None
    tuned: bool = False
    seconds_per_image_at_search: float | None = None

    def to_json(self) -> dict[str, Any]:
        tree = (
            None
            if self.tree is None
            else {"name": self.tree.name, "paths": [list(p) for p in self.tree.paths]}
        )
        return {
            "label": self.label,
            "method": self.method,
            "tree": tree,
            "tuned": self.tuned,
            "predicted_tokens_per_step": self.tokens_per_step,
            "predicted_s_per_image": self.seconds_per_image,
            "predicted_s_per_image_at_search": self.seconds_per_image_at_search,
            "measured_tokens_per_step": self.measured_tokens_per_step,
            "measured_s_per_image": self.measured_seconds_per_image,
            "skipped": self.skipped,
        }


@dataclass
class TuneResult:
    """A tune's rows per batch size, the chosen row of each, the record and where it was written."""

    rows: list[Row]
    choices: dict[int, Row]
    record: dict[str, Any]
    path: Path
    seconds: float
    notes: list[str] = field(default_factory=list)


def rule_label(method: MethodConfig) -> str:
    """A method's acceptance rule in words, e.g. ``lantern++ k=10 lambda=5.0``."""
    params = {k: v for k, v in method.params().items() if k not in ("tree", "window")}
    return " ".join([method.method, *(f"{k}={v}" for k, v in params.items())])


def _named(
    specs: Sequence[str], fits: Callable[[StaticTree], str | None]
) -> tuple[list[StaticTree], list[tuple[str, str]]]:
    """The trees ``specs`` name that ``fits`` takes (it returns why not, or None), and (name,
    reason) for the others."""
    trees, skipped = [], []
    for spec in specs:
        try:
            tree = load_tree(spec, MAX_DRAFT_WIDTH)
        except TreeError as err:
            raise ConfigError(f"--tree {spec}: {err}") from None
        reason = fits(tree)
        if reason is None:
            trees.append(tree)
        else:
            skipped.append((spec, reason))
    return trees, skipped


def _window_candidates(max_nodes: int, max_depth: int, width: int) -> list[StaticTree]:
    """The Jacobi windows the search weighs: chains and pac-K-1-N trees within the bounds."""
    found = [chain_tree(n) for n in range(1, min(max_nodes, max_depth) + 1)]
    for k in range(2, min(width, MAX_PAC_WIDTH) + 1):
        found += [pac_tree(k, 1, n) for n in range(k, max_nodes + 1) if n - k + 1 <= max_depth]
    return found


class Progress:
    """Where a tune reports how far it is: ``start(total)`` once, then ``tick(what)`` before each
    of about ``total`` measurements (a progress bar; this one says nothing)."""

    def start(self, total: int) -> None:
        """The measurements to come."""

    def tick(self, what: str) -> None:
        """``what`` is measured next."""


class Tuner:
    """One ``lantern tune`` run over a model directory or a bundle (see the module's docstring)."""

    def __init__(
        self, source: ModelDir | Bundle, options: TuneOptions, progress: Progress | None = None
    ) -> None:
        self.source, self.options = source, options
        self.progress = progress or Progress()
        self.is_bundle = isinstance(source, Bundle)
        self.info = bundle_info(source) if isinstance(source, Bundle) else source
        if self.info.gpt.takes_prompts:
            raise ConfigError(
                f"{self.info.name} is a text-to-image model: lantern tune runs class-conditional ones"
            )
        self.sampling = default_sampling(self.info)
        self.backend = options.backend or default_backend(options.device, self.is_bundle, False)
        record = backend_named(self.backend)
        record.check_available()
        if self.is_bundle:
            record.check_bundle()
        self.runs_model = not self.is_bundle and MODEL in record.runs  # no export: the model directory
        self.package = record.package
        self.in_place = record.exports_in_place(options.device)
        self.batch_sizes = check_batch_sizes(list(options.batch_sizes))
        self.tokens = self.info.gpt.block_size
        has_drafter = source.has_drafter if isinstance(source, Bundle) else "drafter" in source.files
        for method in options.methods:
            if method.method == "ar":
                raise ConfigError("lantern tune weighs AR always: give it the speculative methods to tune")
            if not method.jacobi and not has_drafter:
                raise ConfigError(
                    f"--method {method.method} drafts with a drafter, which {self.info.name} lacks"
                )

    def calibration(self, jacobi: bool) -> list[StaticTree]:
        """The trees a method's acceptance is counted over, within the image's tokens: a drafter's
        spine (every rank below the rank-0 path) and the chain of its depth, pooled; a Jacobi
        window's pac tree; a bundle's largest tree the method runs and its deepest chain. A step
        starts where its tree's last step ended, so the spine (a wide tree, past hard places in
        fewer steps) sees easier starts than a chain does: rank 0 is counted in the chain's
        steps, the other ranks in the spine's (:func:`pooled_counts`)."""
        if self.is_bundle:
            usable = self._bundle_trees(jacobi)
            if not usable:
                kind = "chain or pac verify graph" if jacobi else "drafting graph"
                raise ConfigError(f"bundle {self.source.path} has no {kind} to calibrate on")  # type: ignore[union-attr]
            chains = [t for t in usable if t.is_chain]
            picked = [
                max(usable, key=lambda t: t.num_nodes),
                *([max(chains, key=lambda t: t.num_nodes)] if chains else []),
            ]
            return list({t.paths: t for t in picked}.values())
        depth = min(CALIBRATION_DEPTH, self.tokens - 2)
        if jacobi:
            width = min(CALIBRATION_WIDTH, self.tokens - 2)
            return [pac_tree(width, 1, width + depth - 1) if width >= 2 else chain_tree(depth)]
        return [calibration_tree(CALIBRATION_WIDTH, depth), chain_tree(depth)]

    def _bundle_trees(self, jacobi: bool) -> list[StaticTree]:
        bundle = self.source
        assert isinstance(bundle, Bundle)
        if jacobi:
            return list(bundle_windows(bundle).values())
        return [t for name, t in bundle_trees(bundle).items() if bundle.trees[name].graph]

    def fits(self, jacobi: bool) -> Callable[[StaticTree], str | None]:
        """Why a tree cannot be a candidate of a drafter (``jacobi`` False) or a window, or None."""

        def reason(tree: StaticTree) -> str | None:
            if tree.num_nodes >= self.tokens:
                return f"{tree.num_nodes} nodes; the image has {self.tokens} tokens"
            if jacobi and not is_window(tree):
                return "a Jacobi window is a chain or a pac tree"
            if self.is_bundle and tree.paths not in {t.paths for t in self._bundle_trees(jacobi)}:
                return "the bundle has no graphs for it"
            return None

        return reason

    def run(self) -> TuneResult:
        start = time.perf_counter()
        opts = self.options
        kinds = sorted({m.jacobi for m in opts.methods})
        calibration = {jacobi: self.calibration(jacobi) for jacobi in kinds}
        named: dict[bool, list[StaticTree]] = {}
        skipped: dict[bool, list[tuple[str, str]]] = {}
        for jacobi in kinds:
            default = WINDOW_TREES if jacobi else DRAFTER_TREES
            specs = opts.trees or default
            if self.is_bundle and not opts.trees:
                specs = [t.name for t in self._bundle_trees(jacobi)]
            named[jacobi], skipped[jacobi] = _named(specs, self.fits(jacobi))
        slices = {b: -(-max(opts.images, 4 * b if b > 1 else 1) // b) for b in self.batch_sizes}
        self.progress.start(  # a cost round after each measured slice
            len(opts.methods) + len(self.batch_sizes) * (opts.max_rounds + 1) + 2 * sum(slices.values())
        )
        session = self._session(
            [*(t for ts in calibration.values() for t in ts), *(t for ts in named.values() for t in ts)]
        )
        tables = {rule_label(m): self._acceptance(session, m, calibration[m.jacobi]) for m in opts.methods}
        costs: dict[int, tuple[CostModel, CostModel]] = {}  # at the search, after the slices
        tuned_trees: dict[tuple, StaticTree] = {}  # by paths, named tuned, tuned-2, ...
        rows: list[Row] = []
        notes: list[str] = []
        for b in self.batch_sizes:  # costs, search and candidates of one size close together in time
            rounds = self._costs(session, b, named)
            searched = rounds.model()
            tuned = {
                m: self._tuned(self._search(searched, tables[rule_label(m)], m.jacobi), m.jacobi, tuned_trees)
                for m in opts.methods
            }
            notes += [
                f"B = {b}: no tuned tree for {rule_label(m)}: no position accepted within the depths and "
                "nodes the cost rounds measured"
                for m, tree in tuned.items()
                if tree is None
            ]
            tuned_session, note = self._tuned_session(
                session, [t for t in tuned.values() if t is not None], b
            )
            notes += note
            candidates: list[tuple[Candidate, TuneSession | None, AcceptanceTable | None, bool]] = [
                (Candidate(MethodConfig("ar")), session, None, False)
            ]
            for m in opts.methods:
                table = tables[rule_label(m)]
                if (tree := tuned[m]) is not None:
                    candidates.append((Candidate(m, tree), tuned_session, table, True))
                candidates += [(Candidate(m, tree), session, table, False) for tree in named[m.jacobi]]
            rows += self._measure(candidates, b, rounds, slices[b])
            costs[b] = (searched, rounds.model())
            for m in opts.methods:
                rows += [
                    Row(b, f"{m.method} {name}", m.method, None, skipped=why)
                    for name, why in skipped[m.jacobi]
                ]
        choices = {
            b: min(
                (r for r in rows if r.batch_size == b and r.measured_seconds_per_image is not None),
                key=lambda r: r.measured_seconds_per_image,
            )
            for b in self.batch_sizes
        }
        seconds = time.perf_counter() - start
        record = self._record(session, tables, costs, rows, choices, tuned_trees, seconds)
        path = record_path(self.source, self.backend)
        write_record(path, record)
        return TuneResult(rows, choices, record, path, seconds, notes)

    def _session(self, trees: Sequence[StaticTree], batch_sizes: Sequence[int] | None = None) -> TuneSession:
        """The session over the source bundle, over the model directory verifying ``trees`` on a
        backend that runs it, or over the cached export of ``trees`` (repeats dropped, by name)
        for ``batch_sizes`` (None: every batch size tuned)."""
        bundle = self.source
        opts = self.options
        if not isinstance(bundle, Bundle):
            unique: dict[tuple, StaticTree] = {}
            for tree in trees:
                unique.setdefault(tree.paths, tree)
            if self.runs_model:
                return TuneSession(
                    bundle,
                    self.backend,
                    opts.device,
                    opts.threads,
                    self.sampling,
                    tuple(unique.values()),
                    opts.cuda_graphs,
                )
            sizes = list(batch_sizes or self.batch_sizes)
            shape = RunShape(sizes[0], self.sampling.guided, cache_windows=1)
            path = cached_bundle(
                bundle,
                MethodConfig("ar"),
                shape,
                batch_sizes=sizes,
                in_place=self.in_place,
                trees=sorted(unique.values(), key=lambda t: t.name),  # one export whatever the order
            )
            bundle = open_bundle(path)
        return TuneSession(
            bundle, self.backend, opts.device, opts.threads, self.sampling, (), opts.cuda_graphs
        )

    def _acceptance(
        self, session: TuneSession, method: MethodConfig, trees: Sequence[StaticTree]
    ) -> AcceptanceTable:
        """``method``'s acceptance per position, counted over each of ``trees`` in calibration
        decodes (B = 1), pooled (:func:`pooled_counts`)."""
        shape = max(t.max_depth for t in trees), max(t.width for t in trees)
        self.progress.tick(f"acceptance of {rule_label(method)}")
        counted = []
        for tree in trees:
            counts = AcceptanceCounts(*shape)

            def watch(verified_tree: StaticTree, out: Any, counts: AcceptanceCounts = counts) -> None:
                counts.count_step(verified_tree, out.kept[0].tolist(), int(out.length[0]))

            session.decode(Candidate(method, tree), 1, self.options.calibration_images, SEED + 1000, watch)
            counted.append((tree, counts))
        return pooled_counts(counted).table(rule_label(method))

    def _costs(self, session: TuneSession, batch: int, named: dict[bool, list[StaticTree]]) -> CostRounds:
        """The cost rounds of ``batch``, settled: AR and every named tree measured (each tree once
        per drafting kind, with the first method of that kind), in rounds of one batch each."""
        candidates = [Candidate(MethodConfig("ar"))]
        for jacobi, trees in named.items():
            method = next(m for m in self.options.methods if m.jacobi == jacobi)
            candidates += [Candidate(method, t) for t in trees]
        rounds = CostRounds(
            batch,
            candidates,
            lambda candidate, round_: session.decode(candidate, batch, batch, SEED + 2000 + round_),
        )
        rounds.settle(lambda: self.progress.tick(f"step costs at B={batch}"), self.options.max_rounds)
        return rounds

    def _search(self, model: CostModel, table: AcceptanceTable, jacobi: bool) -> Choice | None:
        """The tree of the most predicted tokens per second for a method at one batch size,
        within the positions its acceptance table holds and the shapes ``model`` covers (its
        costs measured or interpolated, never extrapolated: :meth:`CostModel.covers`)."""
        p = table.probabilities()
        depth, width = table.shape
        depth = min(depth, self.tokens - 2)
        nodes = min(model.max_nodes, self.tokens - 2)
        if jacobi:
            windows = _window_candidates(nodes, depth, width)
            found = [
                Choice(t, expected_tokens(t, p), model.step(t, True))
                for t in windows
                if model.covers(t, True)
            ]
            return max(found, key=lambda c: c.rate, default=None)
        return fastest_tree(p, model.step, nodes, depth, min(width, MAX_DRAFT_WIDTH), model.covers)

    def _tuned(
        self, choice: Choice | None, jacobi: bool, names: dict[tuple, StaticTree]
    ) -> StaticTree | None:
        """The tree of ``choice``: a Jacobi window under its own name (chain-N, pac-K-D-N: what
        makes it a window), a drafter's under its name among the tuned ``names`` (by its paths):
        ``tuned`` for the first, ``tuned-2``, ... for others, added there."""
        if choice is None or jacobi:
            return None if choice is None else choice.tree
        if choice.tree.paths not in names:
            name = TUNED_TREE if not names else f"{TUNED_TREE}-{len(names) + 1}"
            names[choice.tree.paths] = replace(choice.tree, name=name)
        return names[choice.tree.paths]

    def _tuned_session(
        self, session: TuneSession, trees: Sequence[StaticTree], batch: int
    ) -> tuple[TuneSession | None, list[str]]:
        """A session that verifies the tuned ``trees`` at ``batch``: ``session`` when it does (a
        bundle holding their graphs, a model directory's target as large), else the cached
        export of them at that batch size (a model directory), else None with a note."""
        if all(session.verifies(tree) for tree in trees):
            self.progress.tick(f"the tuned trees at B={batch} run on the pipelines measured")
            return session, []
        if self.is_bundle:
            return None, [
                f"B = {batch}: the tuned tree needs graphs this bundle lacks: export it from the model"
            ]
        self.progress.tick(f"exporting the tuned trees at B={batch}")
        return self._session(trees, [batch]), []

    def _measure(
        self,
        candidates: Sequence[tuple[Candidate, TuneSession | None, AcceptanceTable | None, bool]],
        batch: int,
        rounds: CostRounds,
        slices: int,
    ) -> list[Row]:
        """Each candidate's row at ``batch`` (with its session, acceptance table and whether it
        is tuned): measured over ``slices`` batches, one batch of each candidate in turn, then a
        cost round of ``rounds``; predicted from the table and the cost model of every round,
        and at the search from the rounds before it."""
        rows = []
        searched = rounds.model()
        for candidate, _, table, tuned in candidates:
            tree = candidate.tree
            tau = (
                1.0
                if tree is None or table is None
                else image_tokens_per_step(tree, table.probabilities(), self.tokens - 1)
            )
            row = Row(batch, candidate.label, candidate.method.method, tree, tau, tuned=tuned)
            row.seconds_per_image_at_search = self._predicted(searched, row, candidate)
            rows.append(row)
        runs: list[list[DecodeRun]] = [[] for _ in candidates]
        for slice_ in range(slices):
            for (candidate, session, _, _), done in zip(candidates, runs, strict=True):
                if session is not None:
                    # images s*B.. of the run: the classes in turn over the slices, as calibrated
                    done.append(session.decode(candidate, batch, batch, SEED + 3000 + slice_ * batch))
            self.progress.tick(f"candidates at B={batch}")
            rounds.round()
            self.progress.tick(f"step costs at B={batch}")
        model = rounds.model()
        for row, (candidate, *_), done in zip(rows, candidates, runs, strict=True):
            row.seconds_per_image = self._predicted(model, row, candidate)
            if not done:
                row.skipped = "no graphs for it in the bundle"
                continue
            images = sum(run.images for run in done)
            row.measured_seconds_per_image = sum(run.seconds for run in done) / images
            row.measured_tokens_per_step = sum(sum(r.committed) for r in done) / sum(
                len(r.committed) for r in done
            )
        return rows

    def _predicted(self, model: CostModel, row: Row, candidate: Candidate) -> float:
        """``row``'s s/image as ``model`` predicts it at the row's tokens per step."""
        return model.seconds_per_image(row.tree, row.tokens_per_step, self.tokens, candidate.method.jacobi)

    def _record(
        self,
        session: TuneSession,
        tables: dict[str, AcceptanceTable],
        costs: dict[int, tuple[CostModel, CostModel]],
        rows: list[Row],
        choices: dict[int, Row],
        tuned: dict[tuple, StaticTree],
        seconds: float,
    ) -> dict[str, Any]:
        """The record's JSON (:mod:`lantern_rt.tune.record` adds its format and version)."""
        source = self.source
        return {
            "machine": this_machine(self.backend, self.package),
            "platform": platform.platform(),
            "model": {
                "name": self.info.name,
                "bundle": str(source.path) if isinstance(source, Bundle) else None,
                "tuning_bundle": None if session.bundle is None else str(session.bundle.path),
            },
            "settings": {
                "threads": self.options.threads,
                "streams": 1,
                "cache_windows": 1,
                "device": self.options.device,
                "cuda_graphs": self.options.cuda_graphs,
                "sampling": asdict(self.sampling),
                "methods": [{"method": m.method, **m.params()} for m in self.options.methods],
            },
            "acceptance": {label: table.to_json() for label, table in tables.items()},
            "batch_sizes": {
                str(b): {
                    "costs": costs[b][1].to_json() | costs[b][1].curves(),
                    "costs_at_search": costs[b][0].to_json() | costs[b][0].curves(),
                    "candidates": [r.to_json() for r in rows if r.batch_size == b],
                    "choice": choices[b].to_json(),
                }
                for b in self.batch_sizes
            },
            "tuned_trees": {t.name: [list(p) for p in t.paths] for t in tuned.values()},
            "seconds": seconds,
        }


def tune(source: ModelDir | Bundle, options: TuneOptions, progress: Progress | None = None) -> TuneResult:
    """Tune ``source`` (see :class:`Tuner`), reporting to ``progress``."""
    return Tuner(source, options, progress).run()
