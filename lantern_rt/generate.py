"""Generation end to end: load a model directory, decode tokens for each image, VQ-decode them."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from lantern_rt.images import to_uint8
from lantern_rt.models.model_dir import ModelDir, load_drafter, load_neighbors, load_target, load_vq
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.acceptance import Relaxation
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Speculation, decode_image
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree, tree_to_json

METHODS = ("ar", "exact", "lantern", "lantern++")
BACKENDS = ("torch",)


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


def speculation(md: ModelDir, target: Transformer, mc: MethodConfig, device: str) -> Speculation | None:
    """Drafter, tree, relaxation and neighbour table for a speculative method (None for ar)."""
    if mc.method == "ar":
        return None
    relax = mc.relaxation()
    tree = load_tree(mc.tree, max_width=MAX_DRAFT_WIDTH)
    drafter = load_drafter(md, mc.drafter, device)
    neighbors = load_neighbors(md, relax.k).to(device) if relax.relaxed else None
    capacity = md.gpt.block_size + tree.num_nodes + 1
    return Speculation(TorchDrafter(drafter, target.output, capacity), tree, relax, neighbors)


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
class Generation:
    labels: list[int]
    tokens: torch.Tensor  # [N, T] int64
    images: np.ndarray  # [N, H, W, C] uint8
    stats: dict[str, Any] = field(default_factory=dict)


def generate(
    md: ModelDir,
    labels: Iterable[int],
    sampling: SamplingConfig,
    seed: int = 0,
    method: MethodConfig = MethodConfig(),
    backend: str = "torch",
    device: str = "cpu",
    progress: bool = True,
) -> Generation:
    """Generate one image per entry of ``labels``; timings and acceptance stats in ``stats``."""
    t_start = time.perf_counter()
    labels = list(labels)
    target_model = load_target(md, device)
    vq = load_vq(md, device)
    target = TorchTarget(target_model)
    spec = speculation(md, target_model, method, device)
    n_tokens = md.gpt.block_size
    all_tokens, accepted, per_image = [], [], []
    desc = f"{method.method}/{backend}"
    for i, label in enumerate(tqdm(labels, desc=desc, unit="img", disable=not progress)):
        t0 = time.perf_counter()
        cond = condition_rows(target_model, label)
        result = decode_image(target, cond, n_tokens, sampling, image_generator(seed, i, device), spec)
        per_image.append(time.perf_counter() - t0)
        all_tokens.append(result.tokens)
        accepted.extend(result.accepted)
    tokens = torch.stack(all_tokens) if all_tokens else torch.zeros(0, n_tokens, dtype=torch.long)
    with torch.inference_mode():
        pixels = [
            vq.decode_code(tokens[i : i + 64].to(device), md.gpt.grid_size) for i in range(0, len(tokens), 64)
        ]
    images = (
        to_uint8(torch.cat(pixels))
        if pixels
        else np.zeros((0, md.image_size, md.image_size, md.vq.out_channels), np.uint8)
    )
    calls = len(accepted)
    stats = {
        "model": md.name,
        "method": method.method,
        "params": method.params(),
        "tree": tree_to_json(spec.tree) if spec else None,
        "backend": backend,
        "device": device,
        "num_images": len(labels),
        "tokens_per_image": n_tokens,
        "target_calls": calls + len(labels),
        "verify_calls": calls,
        "mean_accepted_length": (sum(accepted) / calls) if calls else 0.0,
        "accepted_length_histogram": {str(n): accepted.count(n) for n in sorted(set(accepted))},
        "decode_seconds": sum(per_image),
        "seconds_per_image": per_image,
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
