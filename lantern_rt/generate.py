"""Generation end to end: load a model directory, decode tokens for each image, VQ-decode them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from lantern_rt.bundle import BUNDLE_VERSION, MANIFEST, BatchGraphs, Bundle
from lantern_rt.errors import warn
from lantern_rt.families.loading import (
    bundle_info,
    load_drafter,
    load_neighbors,
    load_target,
    load_vq,
    open_bundle,
    open_model_dir,
)
from lantern_rt.families.registry import family_named
from lantern_rt.fileio import WriteError, held
from lantern_rt.images import to_uint8
from lantern_rt.models.config import ConfigError, GPTConfig
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.models.target import grid_codes
from lantern_rt.runtime import profiling
from lantern_rt.runtime.backends.base import DrafterBackend, TargetBackend
from lantern_rt.runtime.backends.bundle_graphs import (
    BundleDrafter,
    BundleTarget,
    BundleVQDecoder,
    RunnerFactory,
    bundle_trees,
    bundle_windows,
)
from lantern_rt.runtime.backends.compiled import CompileError, require_compiler
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Condition, ImageResult, Speculation, StepCache
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH, drafter_capacity
from lantern_rt.runtime.jacobi import JacobiDrafter
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.streams import Stream, auto_streams, decode_streams, stream_threads
from lantern_rt.runtime.tree import StaticTree, load_tree, tree_to_json
from lantern_rt.settings import (
    AUTO_STREAMS_MAX,
    BACKENDS,
    CACHE_WINDOWS,
    MethodConfig,
    check_batch_sizes,
    default_sampling,
)
from lantern_rt.stats import GenerationStats
from lantern_rt.version import package_version


def speculation(
    drafter: DrafterBackend | JacobiDrafter,
    tree: StaticTree,
    method: MethodConfig,
    neighbors: torch.Tensor | Callable[[int], torch.Tensor],
    device: torch.device | str,
) -> Speculation:
    """A speculative ``method``'s drafter, tree, acceptance rule and neighbour table on
    ``device``: ``neighbors`` itself (a bundle's whole table, which its acceptance graphs take
    whatever the method), or ``neighbors(k)`` for the relaxed methods (none for exact)."""
    relax = method.relaxation()
    if isinstance(neighbors, torch.Tensor):
        table = neighbors.to(device)
    else:
        table = neighbors(relax.k).to(device) if relax.relaxed else None
    return Speculation(drafter, tree, relax, table)


def jacobi_speculation(
    target: TargetBackend,
    gpt: GPTConfig,
    tree: StaticTree,
    method: MethodConfig,
    neighbors: torch.Tensor | Callable[[int], torch.Tensor],
) -> Speculation:
    """A Jacobi ``method``'s window (``tree``, a chain or a pac tree) with its coupling over
    ``target``'s batch and cache, on the target's device: no drafter (docs/method.md §11)."""
    cache = target.cache
    row = gpt.grid_size + gpt.row_end  # tokens per image row: the spatial drafts' "above"
    window = JacobiDrafter(
        tree,
        cache.images,
        gpt.vocab_size,
        cache.capacity,
        target.cls_token_num,
        row,
        cache.length.device,
        method.drafts_coupling,
    )
    return speculation(window, tree, method, neighbors, cache.length.device)


def image_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of image ``index`` under ``seed`` (independent of batch composition)."""
    state = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(state)


@dataclass
class Pipeline:
    """Everything that turns class labels (or prompts) into images on one backend."""

    info: ModelDir  # names, classes and geometry (for a bundle: rebuilt from its manifest)
    backend: str
    target: TargetBackend
    spec: Speculation | None
    condition: Callable[[int | str], Condition]  # class id or prompt -> the image's condition
    decode_codes: Callable[[torch.Tensor], torch.Tensor]  # codes [N, T] -> images [N, C, H, W]
    method: MethodConfig
    device: str = "cpu"
    step_graphs: StepCache | None = None  # whole decode steps compiled or captured (torch), kept here
    more_streams: tuple[Stream, ...] = ()  # decode streams beside the first (docs/method.md §15)

    @property
    def streams(self) -> tuple[Stream, ...]:
        """The decode streams: ``target``/``spec``/``step_graphs``, then :attr:`more_streams`."""
        return (Stream(self.target, self.spec, self.step_graphs), *self.more_streams)

    @property
    def batch_size(self) -> int:
        """Images decoded per step."""
        return self.target.cache.images

    @property
    def guided(self) -> bool:
        """Whether each image runs its two CFG rows (False: one row, CFG scales of at most 1
        only; docs/method.md §13)."""
        return self.target.cache.guided


def torch_pipeline(
    md: ModelDir,
    method: MethodConfig = MethodConfig(),
    device: str = "cpu",
    cuda_graphs: bool = False,
    batch_size: int = 1,
    guided: bool = True,
    compile: bool = False,
) -> Pipeline:
    """The reference pipeline: the torch models of a model directory, ``batch_size`` images per
    decode step, eager or compiled (``compile``: ``torch.compile`` of each whole decode step,
    :mod:`lantern_rt.runtime.backends.compiled`), and (``cuda_graphs``, on a CUDA device) with
    every decode step replayed from one captured CUDA graph; ``guided`` False runs one row per
    image (for CFG scales of at most 1, :attr:`SamplingConfig.guided`)."""
    check_batch_sizes([batch_size])
    if compile:
        require_compiler(device)
    target_model = load_target(md, device)
    vq = load_vq(md, device)
    grid = md.gpt.grid_size
    target = TorchTarget(target_model, batch_size, CACHE_WINDOWS, guided)
    spec = None
    if method.jacobi:
        window = load_tree(method.tree, max_width=MAX_DRAFT_WIDTH)
        spec = jacobi_speculation(target, md.gpt, window, method, lambda k: load_neighbors(md, k))
    elif method.method != "ar":
        drafter = load_drafter(md, method.drafter, device)
        capacity = drafter_capacity(md.gpt.cls_token_num, md.gpt.block_size)
        spec = speculation(
            TorchDrafter(
                drafter, target_model.output, capacity, batch_size, md.gpt.cls_token_num - 1, md.gpt, guided
            ),
            load_tree(method.tree, max_width=MAX_DRAFT_WIDTH),
            method,
            lambda k: load_neighbors(md, k),
            device,
        )

    @torch.inference_mode()
    def decode_codes(codes: torch.Tensor) -> torch.Tensor:
        return vq.decode_code(grid_codes(codes.to(device), md.gpt), grid)

    return Pipeline(
        info=md,
        backend="torch",
        target=target,
        spec=spec,
        condition=family_named(md.family).torch_conditioner(md, target_model, device, warn),
        decode_codes=decode_codes,
        method=method,
        device=device,
        step_graphs=StepCache(cuda_graphs, compile) if cuda_graphs or compile else None,
    )


def make_pipeline(
    source: ModelDir | Bundle,
    backend: str,
    method: MethodConfig = MethodConfig(),
    device: str = "cpu",
    threads: int = 0,
    cuda_graphs: bool = True,
    batch_size: int = 1,
    guided: bool = True,
    streams: int | None = 1,
    images: int | None = None,
    compile: bool = False,
) -> Pipeline:
    """A pipeline for a model directory (torch) or an opened bundle (onnxruntime, tensorrt; a
    model directory is exported into the cache first, for ``method``'s tree, ``batch_size`` and
    ``guided``), decoding ``batch_size`` images per step. ``cuda_graphs`` applies to torch on a
    CUDA device and to tensorrt. ``guided`` False (for CFG scales of at most 1,
    :attr:`SamplingConfig.guided`) runs one row per image instead of two; a bundle runs the rows
    it was exported with. The batch size is checked by what builds the pipeline (the torch
    models, the export or the bundle's graphs). ``streams`` above 1 (onnxruntime on the CPU)
    decodes that many batches at once, each on its share of ``threads``
    (:mod:`lantern_rt.runtime.streams`); None chooses (:func:`onnxruntime_pipeline`) for a run
    of ``images`` images, and means one stream on the other backends. ``compile`` (torch only)
    compiles each whole decode step with ``torch.compile``."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if compile and backend != "torch":
        raise CompileError(
            f"--compile compiles the torch backend's decode step; {backend} runs its own graphs: "
            "use --backend torch or --no-compile"
        )
    if streams is not None and streams > 1 and backend != "onnxruntime":
        raise ConfigError(
            f"--streams runs a bundle on onnxruntime on the CPU; the {backend} backend decodes one "
            "stream: use --backend onnxruntime or --streams 1"
        )
    if backend == "torch":
        if not isinstance(source, ModelDir):
            raise ConfigError(
                "the torch backend runs a model directory, not a bundle: use --backend onnxruntime"
            )
        graphs = cuda_graphs and device.startswith("cuda")
        return torch_pipeline(source, method, device, graphs, batch_size, guided, compile)
    if backend == "tensorrt":
        from lantern_rt.engines.compat import require_tensorrt

        require_tensorrt()  # before any export: without TensorRT there is nothing to build for
    if isinstance(source, ModelDir):
        family_named(source.family).check_runnable(
            source
        )  # before the export it would otherwise finish first
        if method.drafter is not None:
            raise ConfigError(
                "a --drafter override runs on the torch backend (bundles hold the model's own "
                "drafter): add --backend torch"
            )
        source = open_bundle(cached_bundle(source, method, batch_sizes=(batch_size,), guided=guided))
    if backend == "onnxruntime":
        return onnxruntime_pipeline(source, method, threads, batch_size, streams, images)
    from lantern_rt.engines.runner import trt_runner

    runner = trt_runner(source, cuda_graphs=cuda_graphs)
    return bundle_pipeline(source.batch(batch_size), method, runner, "tensorrt")


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


def cache_root() -> Path:
    """Where exported bundles are cached: ``$LANTERN_CACHE`` or ``~/.cache/lantern-rt``."""
    return Path(os.environ.get("LANTERN_CACHE", Path.home() / ".cache" / "lantern-rt")) / "bundles"


def model_fingerprint(md: ModelDir) -> str:
    """sha256 over the model's config and every weight file it names (folders included)."""
    h = hashlib.sha256((md.root / "config.json").read_bytes())
    for key in sorted(md.files):
        path = md.path(key)
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and file.name != "train_state.pt":
                h.update(file.name.encode())
                h.update(file.read_bytes())
    return h.hexdigest()


def cached_bundle(
    md: ModelDir,
    method: MethodConfig,
    dtype: str = "fp32",
    batch_sizes: Sequence[int] = (1,),
    guided: bool = True,
) -> Path:
    """The bundle of ``md`` for ``method``'s tree, ``batch_sizes`` and ``guided`` (two CFG rows
    per image, or one: ``export_bundle``), exported on first use into
    the cache. Every method shares it: AR runs on the one-token step graph every bundle holds.
    The model is loaded and checked first: a model its loaders refuse writes nothing (no lock,
    no folder). The export holds a lock (``.NAME-KEY.lock``): concurrent first runs export
    once, the others wait and reuse it; :class:`WriteError` when the cache cannot be written."""
    from lantern_rt.export.bundle import export_bundle, load_export_models

    trees = [load_tree(method.tree, MAX_DRAFT_WIDTH)] if "drafter" in md.files or method.jacobi else []
    sizes = check_batch_sizes(list(batch_sizes))
    key = hashlib.sha256(
        json.dumps(
            {
                "model": model_fingerprint(md),
                "trees": [tree_to_json(t) for t in trees],
                "dtype": dtype,
                "batch_sizes": sizes,
                "guided": guided,
                "version": package_version(),
                "bundle_version": BUNDLE_VERSION,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    root = cache_root()
    out = root / f"{md.name}-{key}"
    if (out / MANIFEST).is_file():
        return out
    models = load_export_models(md)
    with contextlib.ExitStack() as stack:  # one run exports; the others wait, then reuse its bundle
        try:
            root.mkdir(parents=True, exist_ok=True)
            waiting = functools.partial(
                print, f"waiting for another run exporting {md.name}", file=sys.stderr
            )
            stack.enter_context(held(root / f".{out.name}.lock", create=True, waiting=waiting))
        except OSError as exc:
            raise WriteError(
                f"cannot write the export cache {root}: {exc.strerror or exc} (set LANTERN_CACHE to a "
                "writable folder)"
            ) from None
        if not (out / MANIFEST).is_file():  # staged_bundle removes the .tmp folders of killed runs
            export_bundle(
                md,
                out,
                trees=trees,
                dtype=dtype,
                overwrite=True,
                progress=True,
                batch_sizes=sizes,
                guided=guided,
                models=models,
                on_start=functools.partial(
                    print, f"exporting {md.name} to {out} (once; later runs reuse it)", file=sys.stderr
                ),
            )
    return out


def bundle_pipeline(
    graphs: BatchGraphs, method: MethodConfig, runner: RunnerFactory, backend: str
) -> Pipeline:
    """A bundle's graphs for one batch size (:meth:`Bundle.batch`) run by an engine's graph
    runners; no torch model is built."""
    bundle = graphs.bundle
    info = bundle_info(bundle)
    first = bundle_stream(graphs, method, runner, backend)
    target, spec = first.target, first.spec
    decoder = BundleVQDecoder(bundle, runner)
    condition = family_named(info.family).bundle_conditioner(bundle, runner, target.cache.k.device, warn)
    return Pipeline(
        info=info,
        backend=backend,
        target=target,
        spec=spec,
        condition=condition,
        decode_codes=decoder.decode,
        method=method,
        device=str(target.cache.k.device),
    )


def bundle_stream(graphs: BatchGraphs, method: MethodConfig, runner: RunnerFactory, backend: str) -> Stream:
    """The target (its own cache) and the speculation ``method`` runs over a bundle's graphs for
    one batch size: what a decode stream holds."""
    bundle = graphs.bundle
    target = BundleTarget(graphs, runner, backend)
    spec = None
    if method.jacobi:
        window = load_tree(method.tree, MAX_DRAFT_WIDTH)
        if window.paths not in {t.paths for t in bundle_windows(bundle).values()}:
            named = (
                f"--window {window.num_nodes}"
                if method.tree.startswith("chain-")
                else f"--tree {method.tree}"
            )
            raise ConfigError(
                f"bundle {bundle.path} has no verify graph for {named}: export one "
                f"with 'lantern export --model MODEL_DIR --tree {method.tree} --out BUNDLE'"
            )
        spec = jacobi_speculation(target, bundle.gpt, window, method, bundle.neighbors())
    elif method.method != "ar":
        if not bundle.has_drafter:
            raise ConfigError(
                f"bundle {bundle.path} has no drafter graphs: re-export a model that has a drafter"
            )
        tree = bundle_trees(bundle).get(method.tree) or load_tree(method.tree, MAX_DRAFT_WIDTH)
        if tree.paths not in {t.paths for t in bundle.trees.values()}:
            raise ConfigError(
                f"bundle {bundle.path} was not exported for tree {method.tree}; export it with --tree {method.tree}"
            )
        drafter = BundleDrafter(graphs, runner, backend)
        spec = speculation(drafter, tree, method, bundle.neighbors(), target.cache.k.device)
    return Stream(target, spec)


def onnxruntime_pipeline(
    bundle: Bundle,
    method: MethodConfig = MethodConfig(),
    threads: int = 0,
    batch_size: int = 1,
    streams: int | None = 1,
    images: int | None = None,
    compile: bool = False,
) -> Pipeline:
    """A bundle on onnxruntime (CPU, or CUDA with onnxruntime-gpu), decoding ``streams``
    batches at once on the CPU, each with its share of ``threads`` (the streams share one
    session per graph, so the weights are loaded once). ``streams`` None: one on a GPU, else
    :func:`~lantern_rt.runtime.streams.auto_streams` for ``images`` images (None: a run of
    any length)."""
    from lantern_rt.runtime.backends.onnxruntime_backend import CUDA, default_providers, ort_runner

    if streams is None:
        streams = 1
        if default_providers()[0] != CUDA:
            batches = AUTO_STREAMS_MAX if images is None else -(-images // batch_size)
            streams, threads = auto_streams(threads, batches)
    graphs = bundle.batch(batch_size)
    # one stream calls its sessions alone: their pools may spin within a call (not measured
    # shared by several streams)
    runner = ort_runner(stream_threads(threads, streams), spin=streams == 1)
    pipe = bundle_pipeline(graphs, method, runner, "onnxruntime")
    if streams > 1 and pipe.device != "cpu":
        raise ConfigError(
            f"--streams shares out CPU cores; this pipeline runs on {pipe.device}: use --streams 1 "
            "(and a larger --batch-size)"
        )
    more = tuple(bundle_stream(graphs, method, runner, "onnxruntime") for _ in range(streams - 1))
    return dataclasses.replace(pipe, more_streams=more)


@dataclass
class Generation:
    labels: list[int | str]  # class ids, or prompts for a text-conditional model
    tokens: torch.Tensor  # [N, T] int64
    images: np.ndarray  # [N, H, W, C] uint8
    stats: GenerationStats


def generate(
    pipe: Pipeline,
    labels: Iterable[int | str],
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    progress: bool = True,
    start_index: int = 0,
    profile: bool = False,
) -> Generation:
    """Generate one image per entry of ``labels`` (class ids, or prompts for a text-conditional
    model); timings and acceptance stats in ``stats``. ``sampling`` None samples as the model's
    ``sampling_defaults`` say (:func:`~lantern_rt.settings.default_sampling`).

    Image ``i`` draws from the random stream ``(seed, start_index + i)``, so a run split into
    pieces gives the same images as one run. ``profile`` records NVTX ranges (see
    :mod:`lantern_rt.runtime.profiling`) and brackets every image after the first (the warm-up)
    and the VQ decode with cudaProfilerStart/Stop.
    """
    t_start = time.perf_counter()
    sampling = default_sampling(pipe.info) if sampling is None else sampling
    if sampling.guided and not pipe.guided:
        raise ConfigError(
            f"CFG scale {sampling.cfg_scale} needs each image's unconditional row, and this pipeline "
            "runs one row per image (a bundle exported with --no-guidance): use --cfg-scale 1 or a "
            "bundle exported without --no-guidance"
        )
    labels = list(labels)
    md, method, spec = pipe.info, pipe.method, pipe.spec
    n_tokens = md.gpt.block_size
    jobs = (
        (pipe.condition(label), image_generator(seed, start_index + i, pipe.device))
        for i, label in enumerate(labels)
    )
    results: dict[int, ImageResult] = {}
    per_image = []
    compiled_before = pipe.step_graphs.compile_seconds if pipe.step_graphs else 0.0
    desc = f"{method.method}/{pipe.backend}"
    steady = contextlib.ExitStack()
    with (
        profiling.recording(profile),
        steady,
        tqdm(total=len(labels), desc=desc, unit="img", disable=not progress) as bar,
    ):
        t0 = time.perf_counter()
        with profiling.span("decode"):
            for index, result in decode_streams(pipe.streams, jobs, n_tokens, sampling):
                if not results:
                    steady.enter_context(profiling.capture(profile))
                results[index] = result
                per_image.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                bar.update()
        ordered = [results[i] for i in range(len(labels))]
        accepted = [a for r in ordered for a in r.accepted]
        tokens = (
            torch.stack([r.tokens for r in ordered])
            if ordered
            else torch.zeros(0, n_tokens, dtype=torch.long)
        )
        t_vq = time.perf_counter()
        with profiling.span("vq_decode"):
            images = (
                to_uint8(
                    torch.cat([pipe.decode_codes(tokens[i : i + 64]) for i in range(0, len(tokens), 64)])
                )
                if len(tokens)
                else np.zeros((0, md.image_size, md.image_size, md.vq.out_channels), np.uint8)
            )
    stats = GenerationStats(
        model=md.name,
        method=method.method,
        params=method.params(),
        tree=tree_to_json(spec.tree) if spec else None,
        backend=pipe.backend,
        device=pipe.device,
        tokens_per_image=n_tokens,
        accepted=accepted,
        seconds_per_image=per_image,
        vq_decode_seconds=time.perf_counter() - t_vq,
        total_seconds=time.perf_counter() - t_start,
        seed=seed,
        sampling=sampling,
        labels=labels,
        batch_size=pipe.batch_size,
        streams=len(pipe.streams),
    )
    if pipe.step_graphs and pipe.step_graphs.compile:
        compile_seconds = pipe.step_graphs.compile_seconds - compiled_before
        stats.extra["compile_seconds"] = compile_seconds  # 0 when every step was compiled before
        if compile_seconds:
            print(
                f"compiled the decode step in {compile_seconds:.1f} s (torch.compile, inductor); "
                "later images reuse it",
                file=sys.stderr,
            )
    return Generation(labels, tokens, images, stats)
