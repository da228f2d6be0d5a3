"""Decodes of candidates on one tuning bundle: the pipeline of each batch size (one stream),
the speculation each candidate (method and tree) runs on it, and decodes whose target and
drafter calls are timed and whose accepted paths can be watched."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lantern_rt.assembly import Pipeline, jacobi_speculation, speculation
from lantern_rt.bundle import Bundle
from lantern_rt.generate import image_job
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.acceptance import Verified
from lantern_rt.runtime.decode import Speculation, decode_images
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import StaticTree
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


class _Timed:
    """A backend whose calls named in ``calls`` are timed into that dict's lists (after a device
    synchronisation on CUDA), verify results also handed to ``watch``; the rest passes through."""

    def __init__(self, inner: Any, calls: dict[str, list[float]], watch: Watcher | None = None):
        self._inner, self._calls, self._watch = inner, calls, watch
        self._cuda = inner.cache.length.is_cuda

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._calls:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = attr(*args, **kwargs)
            if self._cuda:
                torch.cuda.synchronize()
            self._calls[name].append(time.perf_counter() - start)
            if name == "verify" and self._watch is not None:
                self._watch(args[0], out)
            return out

        return timed


class TuneSession:
    """Pipelines over one bundle on one backend, per batch size, that decode candidates."""

    def __init__(
        self, bundle: Bundle, backend: str, device: str, threads: int, sampling: SamplingConfig
    ) -> None:
        self.bundle, self.backend, self.device, self.threads = bundle, backend, device, threads
        self.sampling = sampling
        self._pipes: dict[int, Pipeline] = {}

    def pipeline(self, batch: int) -> Pipeline:
        """The pipeline of ``batch`` images per step (one stream), built once; with the
        bundle's drafter when it has one."""
        if batch not in self._pipes:
            bundle = self.bundle
            first = next((name for name, t in bundle.trees.items() if t.graph), None)
            method = MethodConfig("lantern++", first) if bundle.has_drafter and first else MethodConfig("ar")
            shape = RunShape(batch, bundle.constants.guided, streams=1)
            plan = RunPlan(bundle, self.backend, method, self.sampling, shape, self.device, self.threads)
            self._pipes[batch] = build_pipeline(plan)
        return self._pipes[batch]

    def speculation(self, candidate: Candidate, pipe: Pipeline) -> Speculation | None:
        """What ``candidate`` drafts and accepts with on ``pipe``: its tree, its method's rule,
        the pipeline's drafter or (a Jacobi method) a fresh window; None for AR."""
        tree, method = candidate.tree, candidate.method
        if tree is None:
            return None
        if method.jacobi:
            return jacobi_speculation(pipe.target, self.bundle.gpt, tree, method, self.bundle.neighbors())
        drafter = pipe.speculation.drafter
        return speculation(drafter, tree, method, self.bundle.neighbors(), pipe.target.cache.k.device)

    def decode(
        self, candidate: Candidate, batch: int, images: int, seed: int, watch: Watcher | None = None
    ) -> DecodeRun:
        """Decode ``images`` images (classes in turn from ``seed``, each image's own random
        stream) with ``candidate`` at ``batch`` images per step, its calls timed."""
        pipe = self.pipeline(batch)
        run = DecodeRun(images, 0.0)
        target = _Timed(pipe.target, {"verify": run.calls["verify"], "prefill": run.calls["prefill"]}, watch)
        spec = self.speculation(candidate, pipe)
        if spec is not None and not candidate.method.jacobi:  # a drafter model's calls
            drafter = _Timed(spec.drafter, {"propose": run.calls["draft"]})
            spec = Speculation(drafter, spec.tree, spec.relax, spec.neighbors)  # type: ignore[arg-type]
        classes = self.bundle.gpt.num_classes
        jobs = [image_job(pipe, (seed + i) % classes, seed, i) for i in range(images)]
        tokens = self.bundle.gpt.block_size
        start = time.perf_counter()
        for _, result in decode_images(target, jobs, tokens, self.sampling, spec):  # type: ignore[arg-type]
            run.committed.extend(result.accepted)
            run.image_steps.append(len(result.accepted))
        run.seconds = time.perf_counter() - start
        return run
