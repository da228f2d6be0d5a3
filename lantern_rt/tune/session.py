"""Decodes of candidates on one source: a tuning bundle, or (a backend that runs model
directories: torch) the model directory itself; the pipeline of each batch size (one stream),
the speculation each candidate (method and tree) runs on it, and decodes whose target and
drafter calls are timed and whose accepted paths can be watched. On a pipeline whose steps are
replayed from CUDA graphs (torch on a CUDA device) a step is one replay: each step's replay,
drafting included, is timed as its verify call and no drafting call is timed; each candidate's
graph is captured in a decode of its own before any timed one, and a watched decode (the
acceptance counts) runs eagerly, its verify calls seen from Python."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lantern_rt.assembly import Pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.families.loading import bundle_info, load_neighbors
from lantern_rt.generate import image_job
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.acceptance import Verified
from lantern_rt.runtime.decode import Speculation, StepCache, decode_images
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.speculation import method_speculation
from lantern_rt.runtime.tree import StaticTree, tree_to_json
from lantern_rt.settings import MethodConfig, RunPlan

# A verify call's tree and result, handed to a decode's watcher
Watcher = Callable[[StaticTree, Verified], None]


@dataclass(frozen=True)
class Candidate:
    """A way to decode: AR (``tree`` None) or a speculative ``method`` over ``tree``."""

    method: MethodConfig
    tree: StaticTree | None = None

    @property
    def label(self) -> str:
        """``ar``, or the method and the tree's name, e.g. ``lantern++ chain-5``."""
        return "ar" if self.tree is None else f"{self.method.method} {self.tree.name}"


@dataclass
class DecodeRun:
    """What one decode of ``images`` images measured: wall seconds, each call's seconds (verify,
    draft, prefill), and the tokens each verify call committed (bonus included)."""

    images: int
    seconds: float
    calls: dict[str, list[float]] = field(default_factory=lambda: {"verify": [], "draft": [], "prefill": []})
    committed: list[int] = field(default_factory=list)
    image_steps: list[int] = field(default_factory=list)  # verify calls of each image

    @property
    def steps(self) -> int:
        """Decode steps: one verify call each."""
        return len(self.calls["verify"])

    @property
    def tokens_per_step(self) -> float:
        """Tokens an image commits per verify call, the bonus included (tau)."""
        return sum(self.committed) / len(self.committed) if self.committed else 0.0


def _timed(fn: Callable[..., Any], into: list[float], cuda: bool) -> Callable[..., Any]:
    """``fn``, its calls' seconds appended to ``into`` (after a device synchronisation on CUDA)."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        into.append(time.perf_counter() - start)
        return out

    return timed


class _Timed:
    """A backend whose calls named in ``calls`` are timed into that dict's lists (after a device
    synchronisation on CUDA), verify results also handed to ``watch``; the rest passes through.
    One wrapper per backend for the session (a captured step is kept by its backends' identity):
    each decode sets its own ``calls`` and ``watch``."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._cuda = inner.cache.length.is_cuda
        self.calls: dict[str, list[float]] = {}
        self.watch: Watcher | None = None

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self.calls:
            return attr
        timed = _timed(attr, self.calls[name], self._cuda)
        if name != "verify" or self.watch is None:
            return timed
        watch = self.watch

        def watched(tree: StaticTree, *args: Any, **kwargs: Any) -> Any:
            out = timed(tree, *args, **kwargs)
            watch(tree, out)
            return out

        return watched


class _TimedSteps(dict):
    """A :class:`StepCache`'s steps (replayed from CUDA graphs), each handed out timed into
    ``calls`` (after a device synchronisation on ``cuda``)."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda
        self.calls: list[float] = []

    def __getitem__(self, key: Hashable) -> Any:
        return _timed(super().__getitem__(key), self.calls, self.cuda)


class TuneSession:
    """Pipelines over one source on one backend, per batch size, that decode candidates: a bundle
    (its graphs), or a model directory on a backend that runs it (torch), whose target is built
    to verify the largest of ``trees`` (and so any tree of as many nodes or fewer), steps replayed
    from CUDA graphs when ``cuda_graphs`` on a CUDA device."""

    def __init__(
        self,
        source: Bundle | ModelDir,
        backend: str,
        device: str,
        threads: int,
        sampling: SamplingConfig,
        trees: tuple[StaticTree, ...] = (),
        cuda_graphs: bool = True,
    ) -> None:
        self.source, self.backend, self.device, self.threads = source, backend, device, threads
        self.sampling, self.cuda_graphs = sampling, cuda_graphs
        self.bundle = source if isinstance(source, Bundle) else None
        self.info = bundle_info(source) if isinstance(source, Bundle) else source
        self.largest = max(trees, key=lambda t: t.num_nodes, default=None)
        self._pipes: dict[int, Pipeline] = {}
        self._targets: dict[int, _Timed] = {}
        self._specs: dict[tuple, Speculation] = {}  # by batch size, method and tree paths
        self._tables: dict[int, torch.Tensor] = {}  # a model directory's neighbour tables by k
        self._captured: set[tuple] = set()
        if self.bundle is None and threads:
            torch.set_num_threads(threads)  # torch's threads are the process's

    def verifies(self, tree: StaticTree) -> bool:
        """Whether the session's pipelines verify ``tree``: a bundle's when it holds its graphs,
        a model directory's when the tree has no more nodes than the largest it was built for."""
        if self.bundle is not None:
            return tree.paths in {t.paths for t in self.bundle.trees.values()}
        return self.largest is not None and tree.num_nodes <= self.largest.num_nodes

    def pipeline(self, batch: int) -> Pipeline:
        """The pipeline of ``batch`` images per step (one stream), built once; with the
        source's drafter when it has one."""
        if batch not in self._pipes:
            self._pipes[batch] = pipe = self._build(batch)
            self._targets[batch] = _Timed(pipe.target)
            if pipe.step_graphs is not None:
                pipe.step_graphs.steps = _TimedSteps(pipe.target.cache.length.is_cuda)
        return self._pipes[batch]

    def _build(self, batch: int) -> Pipeline:
        graphs, bundle = self.cuda_graphs, self.bundle
        if bundle is not None:
            first = next((name for name, t in bundle.trees.items() if t.graph), None)
            method = MethodConfig("lantern++", first) if bundle.has_drafter and first else MethodConfig("ar")
            shape = RunShape(batch, bundle.constants.guided, streams=1)
            return build_pipeline(
                RunPlan(bundle, self.backend, method, self.sampling, shape, self.device, self.threads, graphs)
            )
        if self.largest is None:
            raise ValueError("a model directory's session verifies the trees it is built for: none given")
        shape = RunShape(batch, self.sampling.guided, cache_windows=1, streams=1)
        kind = "lantern++" if "drafter" in self.info.files else "sjd"
        with tempfile.TemporaryDirectory() as folder:  # the largest tree, read as the target is built
            spec = Path(folder) / "largest.json"
            spec.write_text(json.dumps(tree_to_json(self.largest)))
            method = MethodConfig(kind, str(spec))
            plan = RunPlan(
                self.source, self.backend, method, self.sampling, shape, self.device, self.threads, graphs
            )
            return build_pipeline(plan)

    def _neighbors(self) -> torch.Tensor | Callable[[int], torch.Tensor]:
        """A bundle's whole neighbour table, or a model directory's of each k on the device, one
        tensor per k (a captured step reads its relaxation's tensors where they lie)."""
        if self.bundle is not None:
            return self.bundle.neighbors()

        def table(k: int) -> torch.Tensor:
            if k not in self._tables:
                self._tables[k] = load_neighbors(self.source, k).to(self.device)  # type: ignore[arg-type]
            return self._tables[k]

        return table

    def speculation(self, candidate: Candidate, batch: int) -> Speculation | None:
        """What ``candidate`` drafts and accepts with on the pipeline of ``batch``, built once:
        its tree, its method's rule, the pipeline's drafter (timed: :class:`_Timed`) or (a Jacobi
        method) a window of its own; None for AR."""
        tree, method = candidate.tree, candidate.method
        if tree is None:
            return None
        key = (batch, method, tree.paths)
        if key not in self._specs:
            pipe = self.pipeline(batch)
            drafter = None if method.jacobi else _Timed(pipe.speculation.drafter)
            self._specs[key] = method_speculation(
                pipe.target,
                self.info.gpt,
                tree,
                method,
                drafter,  # type: ignore[arg-type]
                self._neighbors(),
            )
        return self._specs[key]

    def decode(
        self, candidate: Candidate, batch: int, images: int, seed: int, watch: Watcher | None = None
    ) -> DecodeRun:
        """Decode ``images`` images (classes in turn from ``seed``, each image's own random
        stream) with ``candidate`` at ``batch`` images per step, its calls timed; ``watch``ed
        decodes run eagerly (no captured steps)."""
        pipe = self.pipeline(batch)
        graphs = pipe.step_graphs if watch is None else None
        key = (batch, candidate.method, candidate.tree.paths if candidate.tree else None)
        if graphs is not None and key not in self._captured:
            self._captured.add(key)
            self._decode(pipe, candidate, batch, batch, seed, graphs, None)  # the capture, untimed
        return self._decode(pipe, candidate, batch, images, seed, graphs, watch)

    def _decode(
        self,
        pipe: Pipeline,
        candidate: Candidate,
        batch: int,
        images: int,
        seed: int,
        graphs: StepCache | None,
        watch: Watcher | None,
    ) -> DecodeRun:
        run = DecodeRun(images, 0.0)
        target = self._targets[batch]
        target.calls = {"prefill": run.calls["prefill"]}
        if graphs is None:
            target.calls["verify"] = run.calls["verify"]
        else:
            graphs.steps.calls = run.calls["verify"]  # type: ignore[attr-defined]
        target.watch = watch
        spec = self.speculation(candidate, batch)
        if spec is not None and isinstance(spec.drafter, _Timed):
            spec.drafter.calls = {} if graphs is not None else {"propose": run.calls["draft"]}
        gpt = self.info.gpt
        jobs = [image_job(pipe, (seed + i) % gpt.num_classes, seed, i) for i in range(images)]
        start = time.perf_counter()
        for _, result in decode_images(target, jobs, gpt.block_size, self.sampling, spec, graphs):  # type: ignore[arg-type]
            run.committed.extend(result.accepted)
            run.image_steps.append(len(result.accepted))
        run.seconds = time.perf_counter() - start
        return run
