"""A pipeline and its assembly: what turns conditions into images on one backend (:class:`Pipeline`),
and each kind of backend's pipeline: torch's over a model directory's models, a bundle's over an
engine's graph runners (its decode streams from :func:`~lantern_rt.runtime.backends.bundle_graphs.bundle_stream`).
The backend registry (:mod:`lantern_rt.backends`) builds through these, for a plan that
:func:`lantern_rt.settings.resolve` checked; :func:`lantern_rt.pipeline.build_pipeline` is the
entry point."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lantern_rt.bundle import Bundle
from lantern_rt.errors import option, warn
from lantern_rt.families.loading import bundle_info, load_drafter, load_neighbors, load_target, load_vq
from lantern_rt.families.registry import family_named
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.models.target import grid_codes
from lantern_rt.runtime.backends.base import TargetBackend
from lantern_rt.runtime.backends.bundle_graphs import BundleVQDecoder, RunnerFactory, bundle_stream
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Condition, Speculation, StepCache
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH, drafter_capacity
from lantern_rt.runtime.method import MethodConfig
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.speculation import method_speculation
from lantern_rt.runtime.streams import Stream, cpu_streams, stream_threads
from lantern_rt.runtime.tree import load_tree


@dataclass
class Pipeline:
    """Everything that turns class labels (or prompts) into images on one backend."""

    info: ModelDir  # names, classes and geometry (for a bundle: rebuilt from its manifest)
    backend: str
    target: TargetBackend
    speculation: Speculation | None
    condition: Callable[[int | str], Condition]  # class id or prompt -> the image's condition
    decode_codes: Callable[[torch.Tensor], torch.Tensor]  # codes [N, T] -> images [N, C, H, W]
    method: MethodConfig
    device: str = "cpu"
    step_graphs: StepCache | None = None  # whole decode steps compiled or captured (torch), kept here
    more_streams: tuple[Stream, ...] = ()  # decode streams beside the first (docs/method.md §15)

    @property
    def streams(self) -> tuple[Stream, ...]:
        """The decode streams: ``target``/``speculation``/``step_graphs``, then :attr:`more_streams`."""
        return (Stream(self.target, self.speculation, self.step_graphs), *self.more_streams)

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
    method: MethodConfig,
    shape: RunShape = RunShape(),
    *,
    device: str = "cpu",
    cuda_graphs: bool = False,
    compile: bool = False,
) -> Pipeline:
    """The reference pipeline: the torch models of a model directory in the run ``shape`` (one
    stream), eager or compiled (``compile``: ``torch.compile`` of each whole decode step,
    :mod:`lantern_rt.runtime.backends.compiled`), and (``cuda_graphs``, on a CUDA device) with
    every decode step replayed from one captured CUDA graph."""
    target_model = load_target(md, device)
    vq = load_vq(md, device)
    grid = md.gpt.grid_size
    tree = None if method.method == "ar" else load_tree(method.tree, max_width=MAX_DRAFT_WIDTH)
    nodes = tree.num_nodes + 1 if tree else 1  # the K/V a verify writes into the cache
    target = TorchTarget(target_model, shape, scratch=nodes)
    spec = drafter = None
    if method.method != "ar" and not method.jacobi:  # a Jacobi window drafts without a drafter
        drafter = TorchDrafter(
            load_drafter(md, method.drafter, device),
            target_model.output,
            drafter_capacity(md.gpt.cls_token_num, md.gpt.block_size),
            shape,
            prefix=md.gpt.cls_token_num - 1,
            layout=md.gpt,
        )
    if tree is not None:
        spec = method_speculation(target, md.gpt, tree, method, drafter, lambda k: load_neighbors(md, k))

    @torch.inference_mode()
    def decode_codes(codes: torch.Tensor) -> torch.Tensor:
        return vq.decode_code(grid_codes(codes.to(device), md.gpt), grid)

    return Pipeline(
        info=md,
        backend="torch",
        target=target,
        speculation=spec,
        condition=family_named(md.family).torch_conditioner(md, target_model, device, warn),
        decode_codes=decode_codes,
        method=method,
        device=device,
        step_graphs=StepCache(cuda_graphs, compile) if cuda_graphs or compile else None,
    )


def bundle_pipeline(
    bundle: Bundle, batch: int, method: MethodConfig, runner: RunnerFactory, backend: str, streams: int = 1
) -> Pipeline:
    """A bundle's graphs for ``batch`` images a step run by an engine's graph runners
    (``backend`` names it) in ``streams`` decode streams; no torch model is built."""
    info = bundle_info(bundle)
    first = bundle_stream(bundle, batch, method, runner, backend)
    device = first.target.cache.k.device
    if streams > 1 and device.type != "cpu":
        raise ConfigError(
            f"{option('streams')} shares out CPU cores; this pipeline runs on {device}: use "
            f"{option('streams', 1)} (and a larger {option('batch_size')})"
        )
    more = tuple(bundle_stream(bundle, batch, method, runner, backend) for _ in range(streams - 1))
    return Pipeline(
        info=info,
        backend=backend,
        target=first.target,
        speculation=first.speculation,
        condition=family_named(info.family).bundle_conditioner(bundle, runner, device, warn),
        decode_codes=BundleVQDecoder(bundle, runner).decode,
        method=method,
        device=str(device),
        more_streams=more,
    )


def onnxruntime_pipeline(
    bundle: Bundle,
    method: MethodConfig,
    shape: RunShape = RunShape(),
    *,
    threads: int = 0,
    images: int | None = None,
) -> Pipeline:
    """A bundle on onnxruntime (CPU, or CUDA with onnxruntime-gpu), decoding ``shape.streams``
    batches at once on the CPU, each with its share of ``threads`` (the streams share one
    session per graph, so the weights are loaded once). Streams None: one on a GPU, else
    :func:`~lantern_rt.runtime.streams.auto_streams` for ``images`` images (None: a run of
    any length)."""
    from lantern_rt.runtime.backends.onnxruntime_backend import CUDA, default_providers, ort_runner

    streams = shape.streams
    if streams is None:
        streams = 1
        if default_providers()[0] != CUDA:
            streams, threads = cpu_streams(shape, threads, images)
    # one stream calls its sessions alone: their pools may spin within a call (not measured
    # shared by several streams)
    runner = ort_runner(stream_threads(threads, streams), spin=streams == 1)
    return bundle_pipeline(bundle, shape.batch_size, method, runner, "onnxruntime", streams)


def openvino_pipeline(
    bundle: Bundle,
    method: MethodConfig,
    shape: RunShape = RunShape(),
    *,
    threads: int = 0,
    images: int | None = None,
) -> Pipeline:
    """A bundle on OpenVINO's CPU plugin, decoding ``shape.streams`` batches at once (None:
    :func:`~lantern_rt.runtime.streams.cpu_streams` for ``images`` images), as onnxruntime's
    streams do: they share one compiled model per graph, each on an execution stream of its own
    with its share of ``threads``. :class:`ConfigError` for a bundle OpenVINO cannot run."""
    from lantern_rt.runtime.backends.openvino_backend import check_runnable, ov_runner

    check_runnable(bundle)
    streams, threads = cpu_streams(shape, threads, images)
    stream_threads(threads, streams)  # raises for fewer threads than streams
    runner = ov_runner(threads, streams)
    return bundle_pipeline(bundle, shape.batch_size, method, runner, "openvino", streams)
