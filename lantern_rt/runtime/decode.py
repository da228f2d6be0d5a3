"""The one decode loop: prefill, then (draft, verify the tree, accept, compact) until done.

Plain autoregressive decoding is the same loop with a tree that holds only the root: each
target call then scores one token and the "bonus" token is an ordinary sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lantern_rt.runtime.acceptance import Relaxation, verify_tree
from lantern_rt.runtime.backends.base import TargetBackend
from lantern_rt.runtime.sampling import SamplingConfig, cfg_mix, distribution, sample
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree

EXACT = Relaxation("exact")


@dataclass
class ImageResult:
    """The tokens of one image and the tokens committed by each target call (bonus included)."""

    tokens: Tensor
    accepted: list[int]


def decode_image(
    target: TargetBackend,
    cond: Tensor,
    num_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    tree: StaticTree = ROOT_ONLY,
    relax: Relaxation = EXACT,
) -> ImageResult:
    """Generate ``num_tokens`` image tokens for the condition rows ``cond`` (cond, uncond)."""
    logits, _ = target.prefill(cond)
    p = distribution(cfg_mix(logits, sampling.cfg_scale), sampling)
    tokens = [int(sample(p, sampling, generator))]
    accepted: list[int] = []
    device = p.device
    depth = tree.depth.to(device)
    mask = tree.mask.to(device)
    valid = torch.ones(tree.num_nodes + 1, dtype=torch.bool, device=device)
    while len(tokens) < num_tokens:
        draft = torch.tensor([tokens[-1]], device=device)
        logits, _ = target.step(draft, target.cache.length + depth, mask)
        p = distribution(cfg_mix(logits, sampling.cfg_scale), sampling)
        result = verify_tree(tree, draft, valid, p, p, None, relax, sampling.greedy, generator)
        emitted = ([int(draft[i]) for i in result.path] + [result.bonus])[: num_tokens - len(tokens)]
        target.cache.commit([0, *result.path])
        tokens.extend(emitted)
        accepted.append(len(emitted))
    return ImageResult(torch.tensor(tokens, dtype=torch.long), accepted)
