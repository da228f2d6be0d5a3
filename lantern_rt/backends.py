"""The registry of backends: one record per engine that runs a pipeline's graphs. What the rest of
the package knows of a backend it asks its record (docs/architecture.md, "Adding a backend"):
whether it is installed here, whether it computes on a GPU, what it runs (a model directory, a
bundle or both) and how it builds a pipeline, from the assembly below it (:mod:`lantern_rt.assembly`)
and its engine. Engines are imported when a pipeline is built, never here (this module is
torch-free at import: the command line lists the backends in --help).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lantern_rt.errors import option
from lantern_rt.models.config import ConfigError

if TYPE_CHECKING:
    from lantern_rt.assembly import Pipeline
    from lantern_rt.bundle import Bundle
    from lantern_rt.models.model_dir import ModelDir
    from lantern_rt.runtime.method import MethodConfig
    from lantern_rt.runtime.run_shape import RunShape

MODEL, BUNDLE = "model directory", "bundle"  # what a backend runs


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs beside what it runs: the torch ``device``; CPU ``threads`` (0: the
    engine's choice); ``cuda_graphs`` (a step replayed from one captured CUDA graph, where the
    engine can); ``compile`` (each decode step compiled with ``torch.compile``); ``images``, the
    run's length, for the streams chosen by :attr:`RunShape.streams` None."""

    device: str = "cpu"
    threads: int = 0
    cuda_graphs: bool = True
    compile: bool = False
    images: int | None = None


# source (a model directory or an opened bundle, one the backend runs), method, run shape, options
BuildFn = Callable[["ModelDir | Bundle", "MethodConfig", "RunShape", EngineOptions], "Pipeline"]


@dataclass(frozen=True)
class Backend:
    """One engine: its ``name`` (the ``backend`` option); the Python ``package`` it needs and what
    to run to ``install`` it; what it ``runs`` (:data:`MODEL` and/or :data:`BUNDLE`: a model
    directory given to a bundle-only backend is exported into the cache first); whether it
    computes on a GPU whatever the ``device`` (``gpu_only``) or on the CPU only (``cpu_only``);
    whether it decodes several ``streams`` at once and ``compiles`` decode steps; its rank when
    :func:`default_backend` chooses on a CPU and on a GPU (lowest first, None: never chosen
    there); and ``build``, which makes its pipeline."""

    name: str
    package: str
    install: str
    runs: frozenset[str]
    build: BuildFn
    gpu_only: bool = False
    cpu_only: bool = False
    streams: bool = False
    compiles: bool = False
    cpu_rank: int | None = None
    gpu_rank: int | None = None
    require: Callable[[], object] | None = None  # a deeper check than the import (e.g. a version)
    in_place: Callable[[str], bool] | None = None  # for a device: export its bundles' caches written in place

    def available(self) -> bool:
        """Whether its package can be imported here (without importing it)."""
        return importlib.util.find_spec(self.package) is not None

    def check_available(self) -> None:
        """:class:`ConfigError` with the install hint unless it can run here."""
        if self.require is not None:
            self.require()
        elif not self.available():
            raise ConfigError(f"the {self.name} backend needs {self.package}: {self.install}")

    def runs_on_gpu(self, device: str) -> bool:
        """Whether a run on it computes on a GPU (given ``device``)."""
        return self.gpu_only or not device.startswith("cpu")

    def exports_in_place(self, device: str) -> bool:
        """Whether a model directory it runs on ``device`` is exported with the target's cache
        written in place (``export_bundle``'s ``in_place``: onnxruntime on the CPU)."""
        return self.in_place is not None and self.in_place(device)

    def check_bundle(self) -> None:
        """:class:`ConfigError` unless it runs a bundle (the one place that says so)."""
        if BUNDLE not in self.runs:
            others = " or ".join(b.name for b in BACKENDS.values() if BUNDLE in b.runs)
            raise ConfigError(
                f"the {self.name} backend runs a model directory, not a bundle: use {option('backend')} "
                f"{others}, or run a model directory"
            )


def _torch(
    source: ModelDir | Bundle, method: MethodConfig, shape: RunShape, options: EngineOptions
) -> Pipeline:
    from lantern_rt.assembly import torch_pipeline

    graphs = options.cuda_graphs and options.device.startswith("cuda")
    return torch_pipeline(
        source, method, shape, device=options.device, cuda_graphs=graphs, compile=options.compile
    )  # type: ignore[arg-type]


def _onnxruntime(
    source: ModelDir | Bundle, method: MethodConfig, shape: RunShape, options: EngineOptions
) -> Pipeline:
    from lantern_rt.assembly import onnxruntime_pipeline

    return onnxruntime_pipeline(source, method, shape, threads=options.threads, images=options.images)  # type: ignore[arg-type]


def _onnxruntime_in_place(device: str) -> bool:
    from lantern_rt.runtime.backends.onnxruntime_backend import writes_cache_in_place

    return writes_cache_in_place(device)


def _openvino(
    source: ModelDir | Bundle, method: MethodConfig, shape: RunShape, options: EngineOptions
) -> Pipeline:
    from lantern_rt.assembly import openvino_pipeline

    return openvino_pipeline(source, method, shape, threads=options.threads, images=options.images)  # type: ignore[arg-type]


def _tensorrt(
    source: ModelDir | Bundle, method: MethodConfig, shape: RunShape, options: EngineOptions
) -> Pipeline:
    from lantern_rt.assembly import bundle_pipeline
    from lantern_rt.engines.runner import trt_runner

    runner = trt_runner(source, cuda_graphs=options.cuda_graphs)  # type: ignore[arg-type]
    return bundle_pipeline(source, shape.batch_size, method, runner, "tensorrt")  # type: ignore[arg-type]


def _require_tensorrt() -> object:
    """TensorRT's module, where a plan can run: a flavour installed and a CUDA GPU (both checked
    before a model directory's export, which would be wasted without them)."""
    from lantern_rt.engines.compat import require_tensorrt
    from lantern_rt.engines.plans import device_info

    module = require_tensorrt()
    device_info()
    return module


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend(
            "onnxruntime",
            "onnxruntime",
            "pip install onnxruntime (or onnxruntime-gpu: pip install 'lantern-rt[gpu]')",
            frozenset({BUNDLE}),
            _onnxruntime,
            streams=True,
            in_place=_onnxruntime_in_place,
            cpu_rank=0,
            gpu_rank=2,
        ),
        Backend(
            "openvino",
            "openvino",
            "pip install 'lantern-rt[openvino]'",
            frozenset({BUNDLE}),
            _openvino,
            cpu_only=True,
            streams=True,
        ),  # ranked nowhere: an extra; onnxruntime stays the CPU default (BENCHMARKS.md, "OpenVINO")
        Backend(
            "tensorrt",
            "tensorrt",
            "pip install 'lantern-rt[trt]'",
            frozenset({BUNDLE}),
            _tensorrt,
            gpu_only=True,
            gpu_rank=1,
            require=_require_tensorrt,
        ),
        Backend(
            "torch",
            "torch",
            "pip install torch",
            frozenset({MODEL}),
            _torch,
            compiles=True,
            cpu_rank=1,
            gpu_rank=0,
        ),
    )
}


def backend_named(name: str) -> Backend:
    """The backend called ``name``; :class:`ConfigError` listing the known ones."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}"[:300])
    return BACKENDS[name]


def default_backend(device: str, bundle: bool, drafter_override: bool) -> str:
    """The backend a run chooses for ``device`` when it names none: of those that run what it
    runs (a bundle; a model directory, exported for a bundle-only backend, but run as it is for a
    ``--drafter`` override, which bundles cannot hold), the installed one of lowest rank on a CPU
    or a GPU; the last ranked, the fallback, when none is (it says what to install).
    Today: onnxruntime on a CPU (torch without onnxruntime, or for a ``--drafter`` override); on
    a GPU TensorRT for a bundle when it is installed, else torch for a model directory and
    onnxruntime for a bundle."""
    on_gpu = not device.startswith("cpu")
    ranked = sorted(
        (rank, b.name)
        for b in BACKENDS.values()
        if (rank := b.gpu_rank if on_gpu else b.cpu_rank) is not None
        and (BUNDLE in b.runs if bundle else MODEL in b.runs or not drafter_override)
    )
    installed = [name for _, name in ranked if BACKENDS[name].available()]
    return installed[0] if installed else ranked[-1][1]


def runs_on_gpu(backend: str, device: str) -> bool:
    """Whether a run on ``backend`` computes on a GPU (TensorRT always; the others by ``device``)."""
    return backend_named(backend).runs_on_gpu(device)


def cpu_backends(bundle: bool) -> tuple[str, ...]:
    """The backends ranked on a CPU (:attr:`Backend.cpu_rank`) that take a bundle (``bundle``)
    or a model directory (as it is or exported), those that run it as it is first: what
    ``lantern bench`` measures when given none (torch and onnxruntime; onnxruntime for a bundle)."""
    given = BUNDLE if bundle else MODEL
    able = [b for b in BACKENDS.values() if b.cpu_rank is not None and (BUNDLE in b.runs or not bundle)]
    return tuple(b.name for b in sorted(able, key=lambda b: given not in b.runs))
