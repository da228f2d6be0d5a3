"""The one decode loop: prefill, then (draft, verify the tree, accept, compact) until done.

Plain autoregressive decoding is the same loop without a drafter: the tree holds only the
root, each target call scores one token and the "bonus" token is an ordinary sample.
The steps are described in docs/method.md (§4 drafting, §5 acceptance, §6 KV compaction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lantern_rt.runtime.acceptance import Relaxation, verify_tree
from lantern_rt.runtime.backends.base import DrafterBackend, TargetBackend
from lantern_rt.runtime.drafting import Draft, draft
from lantern_rt.runtime.kv_cache import take
from lantern_rt.runtime.profiling import span
from lantern_rt.runtime.sampling import (
    TOPK_LIMIT,
    SamplingConfig,
    cfg_mix,
    check_sort_width,
    distribution,
    sample,
)
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree


@dataclass(frozen=True)
class Speculation:
    """What speculative decoding adds to plain decoding."""

    drafter: DrafterBackend
    tree: StaticTree
    relax: Relaxation
    neighbors: Tensor | None = None  # [V, k_max] latent neighbours, needed when relaxed


@dataclass
class ImageResult:
    """The tokens of one image and the tokens committed by each verify call (bonus included)."""

    tokens: Tensor
    accepted: list[int]


EXACT = Relaxation("exact")


def decode_image(
    target: TargetBackend,
    cond: Tensor,
    num_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    spec: Speculation | None = None,
) -> ImageResult:
    """Generate ``num_tokens`` image tokens for the condition rows ``cond`` (cond, uncond)."""
    tree = spec.tree if spec else ROOT_ONLY
    relax = spec.relax if spec else EXACT
    neighbors = spec.neighbors if spec else None
    if spec:
        vocab = spec.drafter.vocab_size
        check_sort_width(sampling, vocab, min(vocab, TOPK_LIMIT))
    with span("prefill"):
        logits, hidden = target.prefill(cond)
    p = distribution(cfg_mix(logits, sampling.cfg_scale), sampling)
    device = p.device
    tokens = [int(sample(p, sampling, generator))]
    pending = tokens[:]
    pending_hidden = hidden[:, None]
    if spec:
        spec.drafter.cache.reset()
    depth, mask = tree.depth.to(device), tree.mask.to(device)
    accepted: list[int] = []
    while len(tokens) < num_tokens:
        root_position = target.cache.length
        if spec:
            with span("draft"):
                drafted = draft(
                    spec.drafter, tree, pending, pending_hidden, root_position, sampling, generator
                )
        else:
            # no children: q is never read
            drafted = Draft(
                torch.tensor(pending[-1:], device=device),
                torch.ones(1, dtype=torch.bool, device=device),
                p[None],
            )
        with span("verify"):
            logits, hidden = target.step(drafted.tokens, root_position + depth, mask)
        with span("accept"):
            p_tree = distribution(cfg_mix(logits, sampling.cfg_scale), sampling)
            result = verify_tree(
                tree,
                drafted.tokens,
                drafted.valid,
                p_tree,
                drafted.q,
                neighbors,
                relax,
                sampling.greedy,
                generator,
            )
        kept = [0, *result.path]
        new = result.tokens
        emitted = new[: num_tokens - len(tokens)]
        tokens.extend(emitted)
        accepted.append(len(emitted))
        if len(tokens) == num_tokens:
            break
        with span("kv_compaction"):
            target.cache.commit(kept)
        pending = new
        pending_hidden = take(hidden, 1, kept)
    return ImageResult(torch.tensor(tokens, dtype=torch.long), accepted)
