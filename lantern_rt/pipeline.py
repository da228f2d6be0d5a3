"""Building a pipeline: what a run is built from (a model directory or a bundle) and the one
entry point that turns it into a :class:`~lantern_rt.assembly.Pipeline` on a backend of the
registry (:mod:`lantern_rt.backends`), exporting a model directory into the
cache first for a backend that runs bundles."""

from __future__ import annotations

from pathlib import Path

from lantern_rt.assembly import Pipeline
from lantern_rt.backends import MODEL, EngineOptions, backend_named
from lantern_rt.bundle import Bundle
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import bundle_info, open_bundle, open_model_dir
from lantern_rt.families.registry import family_named
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.backends.compiled import CompileError
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.settings import MethodConfig


def open_source(model: Path | None, bundle: Path | None) -> tuple[ModelDir, ModelDir | Bundle]:
    """(model info, what pipelines are built from): the model directory ``model`` (the built-in
    demo when None), or the bundle at ``bundle``, opened; :class:`ConfigError` for both."""
    if bundle is None:
        md = open_model_dir(model)
        return md, md
    if model is not None:
        raise ConfigError("--bundle runs an exported bundle: drop --model")
    opened = open_bundle(bundle)
    return bundle_info(opened), opened


def build_pipeline(
    source: ModelDir | Bundle,
    method: MethodConfig,
    shape: RunShape = RunShape(),
    *,
    backend: str,
    device: str = "cpu",
    threads: int = 0,
    cuda_graphs: bool = True,
    compile: bool = False,
    images: int | None = None,
) -> Pipeline:
    """The pipeline of ``backend`` for a model directory or an opened bundle, running ``method``
    in the run ``shape``: a backend that runs bundles gets a model directory's bundle from the
    export cache (exported there first, for ``method``'s tree and ``shape``); a bundle runs the
    rows it was exported with. ``device``: where torch computes; ``threads``: CPU threads (0:
    the engine's choice), shared out among ``shape.streams`` (None: chosen for a run of
    ``images`` images; one stream where the backend decodes one); ``cuda_graphs`` applies where
    the backend can replay a captured step (torch on a CUDA device, tensorrt); ``compile``
    compiles each whole decode step with ``torch.compile`` where the backend compiles."""
    record = backend_named(backend)
    if compile and not record.compiles:
        raise CompileError(
            f"--compile compiles the torch backend's decode step; {backend} runs its own graphs: "
            "use --backend torch or --no-compile"
        )
    if not record.streams and shape.streams is not None and shape.streams > 1:
        raise ConfigError(
            f"--streams runs a bundle on onnxruntime on the CPU; the {backend} backend decodes one "
            "stream: use --backend onnxruntime or --streams 1"
        )
    record.check_available()  # before any export: without its engine there is nothing to run it
    if isinstance(source, Bundle):
        record.check_bundle()
    elif MODEL not in record.runs:
        family_named(source.family).check_runnable(
            source
        )  # before the export it would otherwise finish first
        if method.drafter is not None:
            raise ConfigError(
                "a --drafter override runs on the torch backend (bundles hold the model's own "
                "drafter): add --backend torch"
            )
        source = open_bundle(cached_bundle(source, method, shape, in_place=record.exports_in_place(device)))
    options = EngineOptions(device, threads, cuda_graphs, compile, images)
    return record.build(source, method, shape, options)
