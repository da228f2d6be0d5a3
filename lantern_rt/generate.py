"""Generation end to end: load a model directory, decode tokens for each image, VQ-decode them."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from lantern_rt.images import to_uint8
from lantern_rt.models.config import ConfigError, GPTConfig, VQConfig, config_from_dict
from lantern_rt.models.model_dir import ModelDir, load_drafter, load_neighbors, load_target, load_vq
from lantern_rt.models.target import Transformer
from lantern_rt.runtime import profiling
from lantern_rt.runtime.acceptance import Relaxation
from lantern_rt.runtime.backends.base import TargetBackend
from lantern_rt.runtime.backends.bundle_graphs import (
    BundleDrafter,
    BundleTarget,
    BundleVQDecoder,
    RunnerFactory,
    bundle_neighbors,
    bundle_trees,
)
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Speculation, decode_image
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH, drafter_capacity
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree, tree_to_json

METHODS = ("ar", "exact", "lantern", "lantern++")


@dataclass(frozen=True)
class MethodConfig:
    """A decoding method and its parameters (ignored by ``ar``)."""

    method: str = "ar"
    tree: str = "naive_extend_57"
    k: int = 10
    delta: float = 0.1
    lam: float = 5.0
    drafter: str | None = None  # an EAGLE-layout folder overriding the model's drafter

    def relaxation(self) -> Relaxation:
        if self.method == "lantern":
            return Relaxation("lantern", k=self.k, delta=self.delta)
        if self.method == "lantern++":
            return Relaxation("lantern++", k=self.k, lam=self.lam)
        return Relaxation("exact")

    def params(self) -> dict[str, Any]:
        """The parameters that matter for this method, for reports."""
        if self.method == "ar":
            return {}
        extra = {
            "lantern": {"k": self.k, "delta": self.delta},
            "lantern++": {"k": self.k, "lambda": self.lam},
        }
        return {"tree": self.tree, **extra.get(self.method, {})}


def speculation(
    md: ModelDir, target: Transformer, mc: MethodConfig, device: str, cuda_graphs: bool = False
) -> Speculation | None:
    """Drafter, tree, relaxation and neighbour table for a speculative method (None for ar)."""
    if mc.method == "ar":
        return None
    relax = mc.relaxation()
    tree = load_tree(mc.tree, max_width=MAX_DRAFT_WIDTH)
    drafter = load_drafter(md, mc.drafter, device)
    neighbors = load_neighbors(md, relax.k).to(device) if relax.relaxed else None
    capacity = drafter_capacity(md.gpt.block_size)
    return Speculation(TorchDrafter(drafter, target.output, capacity, cuda_graphs), tree, relax, neighbors)


def image_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of image ``index`` under ``seed`` (independent of batch composition)."""
    state = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(state)


def condition_rows(model: Transformer, cond: int | torch.Tensor) -> torch.Tensor:
    """The two CFG rows (conditional, unconditional) for a class id or caption features."""
    device = model.output.weight.device
    if model.config.model_type == "c2i":
        return torch.tensor([int(cond), model.config.num_classes], device=device)
    caption = torch.as_tensor(cond, device=device, dtype=model.cls_embedding.uncond_embedding.dtype)
    return torch.stack([caption, model.null_condition])


@dataclass
class Pipeline:
    """Everything that turns class labels into images on one backend."""

    info: ModelDir  # names, classes and geometry (for a bundle: rebuilt from its manifest)
    backend: str
    target: TargetBackend
    spec: Speculation | None
    condition: Callable[[int], torch.Tensor]  # label -> the two CFG condition rows
    decode_codes: Callable[[torch.Tensor], torch.Tensor]  # codes [N, T] -> images [N, C, H, W]
    method: MethodConfig
    device: str = "cpu"


def torch_pipeline(
    md: ModelDir, method: MethodConfig = MethodConfig(), device: str = "cpu", cuda_graphs: bool = False
) -> Pipeline:
    """The reference pipeline: the torch models of a model directory, eager or (``cuda_graphs``,
    on a CUDA device) with every step replayed from a captured CUDA graph."""
    target_model = load_target(md, device)
    vq = load_vq(md, device)
    grid = md.gpt.grid_size

    @torch.inference_mode()
    def decode_codes(codes: torch.Tensor) -> torch.Tensor:
        return vq.decode_code(codes.to(device), grid)

    return Pipeline(
        info=md,
        backend="torch",
        target=TorchTarget(target_model, cuda_graphs),
        spec=speculation(md, target_model, method, device, cuda_graphs),
        condition=lambda label: condition_rows(target_model, label),
        decode_codes=decode_codes,
        method=method,
        device=device,
    )


BACKENDS = ("torch", "onnxruntime", "tensorrt")


def make_pipeline(
    source: ModelDir | Path,
    backend: str,
    method: MethodConfig = MethodConfig(),
    device: str = "cpu",
    threads: int = 0,
    cuda_graphs: bool = True,
) -> Pipeline:
    """A pipeline for a model directory (torch) or an exported bundle folder (onnxruntime,
    tensorrt; a model directory is exported into the cache first). ``cuda_graphs`` applies to
    torch on a CUDA device and to tensorrt."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "torch":
        if not isinstance(source, ModelDir):
            raise ConfigError(
                "the torch backend runs a model directory, not a bundle: use --backend onnxruntime"
            )
        return torch_pipeline(source, method, device, cuda_graphs and device.startswith("cuda"))
    if backend == "tensorrt":
        from lantern_rt.engines.compat import require_tensorrt

        require_tensorrt()  # before any export: without TensorRT there is nothing to build for
    if isinstance(source, ModelDir):
        if method.drafter is not None:
            raise ConfigError(
                "a --drafter override runs on the torch backend (bundles hold the model's own "
                "drafter): add --backend torch"
            )
        source = cached_bundle(source, method)
    if backend == "onnxruntime":
        return onnxruntime_pipeline(Path(source), method, threads)
    from lantern_rt.runtime.backends.tensorrt_backend import trt_runner

    return bundle_pipeline(Path(source), method, trt_runner(source, cuda_graphs=cuda_graphs), "tensorrt")


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


def cached_bundle(md: ModelDir, method: MethodConfig, dtype: str = "fp32") -> Path:
    """The bundle of ``md`` for ``method``'s tree, exported on first use into the cache."""
    from lantern_rt.export.bundle import BUNDLE_VERSION, export_bundle

    trees = (
        []
        if method.method == "ar" or "drafter" not in md.files
        else [load_tree(method.tree, MAX_DRAFT_WIDTH)]
    )
    key = hashlib.sha256(
        json.dumps(
            {
                "model": model_fingerprint(md),
                "trees": [tree_to_json(t) for t in trees],
                "dtype": dtype,
                "version": importlib.metadata.version("lantern-rt"),
                "bundle_version": BUNDLE_VERSION,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:16]
    out = cache_root() / f"{md.name}-{key}"
    if not (out / "manifest.json").is_file():
        print(f"exporting {md.name} to {out} (once; later runs reuse it)", file=sys.stderr)
        export_bundle(md, out, trees=trees, dtype=dtype, overwrite=True, progress=True)
    return out


def bundle_info(bundle: Path, manifest: dict[str, Any]) -> ModelDir:
    """Names, classes and geometry of a bundle, in the shape the pipeline reports them."""
    return ModelDir(
        root=bundle,
        raw={"name": manifest["model_name"], "sampling_defaults": manifest.get("sampling_defaults", {})},
        gpt=config_from_dict(GPTConfig, manifest["gpt"]),
        vq=config_from_dict(VQConfig, manifest["vq"]),
        files={},
        image_size=manifest["image_size"],
        class_names=list(manifest.get("class_names", [])),
    )


def bundle_pipeline(bundle: Path, method: MethodConfig, runner: RunnerFactory, backend: str) -> Pipeline:
    """A bundle run by an engine's graph runners; no torch model is built."""
    from lantern_rt.export.bundle import load_manifest

    manifest = load_manifest(bundle)
    info = bundle_info(bundle, manifest)
    if info.gpt.model_type != "c2i":
        raise ConfigError("the command line runs class-conditional bundles; use the Python API for captions")
    target = BundleTarget(bundle, runner, backend)
    spec = None
    if method.method != "ar":
        if not manifest["constants"].get("drafter"):
            raise ConfigError(f"bundle {bundle} has no drafter graphs: re-export a model that has a drafter")
        tree = bundle_trees(bundle).get(method.tree) or load_tree(method.tree, MAX_DRAFT_WIDTH)
        exported = {json.dumps(t["paths"]) for t in manifest.get("trees", {}).values()}
        if json.dumps(tree_to_json(tree)["paths"]) not in exported:
            raise ConfigError(
                f"bundle {bundle} was not exported for tree {method.tree}; export it with --tree {method.tree}"
            )
        relax = method.relaxation()
        neighbors = bundle_neighbors(bundle, relax.k).to(target.cache.k.device) if relax.relaxed else None
        spec = Speculation(BundleDrafter(bundle, runner, backend), tree, relax, neighbors)
    decoder = BundleVQDecoder(bundle, runner)
    null = info.gpt.num_classes
    return Pipeline(
        info=info,
        backend=backend,
        target=target,
        spec=spec,
        condition=lambda label: torch.tensor([int(label), null]),
        decode_codes=decoder.decode,
        method=method,
        device=str(target.cache.k.device),
    )


def onnxruntime_pipeline(bundle: Path, method: MethodConfig = MethodConfig(), threads: int = 0) -> Pipeline:
    """A bundle on onnxruntime (CPU, or CUDA with onnxruntime-gpu)."""
    from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner

    return bundle_pipeline(bundle, method, ort_runner(threads), "onnxruntime")


@dataclass
class Generation:
    labels: list[int]
    tokens: torch.Tensor  # [N, T] int64
    images: np.ndarray  # [N, H, W, C] uint8
    stats: dict[str, Any] = field(default_factory=dict)


def generate(
    pipe: Pipeline,
    labels: Iterable[int],
    sampling: SamplingConfig,
    seed: int = 0,
    progress: bool = True,
    start_index: int = 0,
    profile: bool = False,
) -> Generation:
    """Generate one image per entry of ``labels``; timings and acceptance stats in ``stats``.

    Image ``i`` draws from the random stream ``(seed, start_index + i)``, so a run split into
    pieces gives the same images as one run. ``profile`` records NVTX ranges (see
    :mod:`lantern_rt.runtime.profiling`) and brackets every image after the first (the warm-up)
    and the VQ decode with cudaProfilerStart/Stop.
    """
    t_start = time.perf_counter()
    labels = list(labels)
    md, method, spec = pipe.info, pipe.method, pipe.spec
    n_tokens = md.gpt.block_size
    all_tokens, accepted, per_image = [], [], []
    desc = f"{method.method}/{pipe.backend}"
    steady = contextlib.ExitStack()
    with profiling.recording(profile), steady:
        for i, label in enumerate(tqdm(labels, desc=desc, unit="img", disable=not progress)):
            if i == 1:
                steady.enter_context(profiling.capture(profile))
            t0 = time.perf_counter()
            generator = image_generator(seed, start_index + i, pipe.device)
            with profiling.span("image"):
                result = decode_image(pipe.target, pipe.condition(label), n_tokens, sampling, generator, spec)
            per_image.append(time.perf_counter() - t0)
            all_tokens.append(result.tokens)
            accepted.extend(result.accepted)
        tokens = torch.stack(all_tokens) if all_tokens else torch.zeros(0, n_tokens, dtype=torch.long)
        t_vq = time.perf_counter()
        with profiling.span("vq_decode"):
            images = (
                to_uint8(
                    torch.cat([pipe.decode_codes(tokens[i : i + 64]) for i in range(0, len(tokens), 64)])
                )
                if len(tokens)
                else np.zeros((0, md.image_size, md.image_size, md.vq.out_channels), np.uint8)
            )
    calls = len(accepted)
    stats = {
        "model": md.name,
        "method": method.method,
        "params": method.params(),
        "tree": tree_to_json(spec.tree) if spec else None,
        "backend": pipe.backend,
        "device": pipe.device,
        "num_images": len(labels),
        "tokens_per_image": n_tokens,
        "target_calls": calls + len(labels),
        "verify_calls": calls,
        "mean_accepted_length": (sum(accepted) / calls) if calls else 0.0,
        "accepted_length_histogram": {str(n): accepted.count(n) for n in sorted(set(accepted))},
        "decode_seconds": sum(per_image),
        "seconds_per_image": per_image,
        "vq_decode_seconds": time.perf_counter() - t_vq,
        "total_seconds": time.perf_counter() - t_start,
        "seed": seed,
        "sampling": {
            "cfg_scale": sampling.cfg_scale,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
        },
        "labels": labels,
    }
    return Generation(labels, tokens, images, stats)
