"""The one decode loop: prefill, then (draft, verify and accept the tree, compact) until done.

Plain autoregressive decoding is the same loop without a drafter: the tree holds only the
root, each target call scores one token and the "bonus" token is an ordinary sample.
The steps are described in docs/method.md (§4 drafting, §5 acceptance, §6 KV compaction).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern_rt.runtime.acceptance import Relaxation, draw, relax_inputs, target_probabilities
from lantern_rt.runtime.backends.base import Draft, DrafterBackend, TargetBackend
from lantern_rt.runtime.drafting import draft
from lantern_rt.runtime.profiling import span
from lantern_rt.runtime.sampling import TOPK_LIMIT, SamplingConfig, check_sort_width, filter_inputs
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
    """Generate ``num_tokens`` image tokens for the condition rows ``cond`` (cond, uncond).

    Each step drafts (speculative methods), then verifies and accepts the tree in one target
    call (:func:`~lantern_rt.runtime.acceptance.verify_tree`, from uniform noise drawn for the
    step from ``generator``); the host reads one small tensor, the accepted length and tokens,
    and commits the kept K/V, which the verify call gathered on the device (docs/method.md §5-6).
    """
    tree = spec.tree if spec else ROOT_ONLY
    with span("prefill"):
        logits, hidden = target.prefill(cond)
    device, vocab = logits.device, logits.shape[-1]
    check_sort_width(sampling, vocab, min(vocab, TOPK_LIMIT))
    filters = filter_inputs(sampling, device)
    relax = relax_inputs(
        spec.relax if spec else EXACT, spec.neighbors if spec else None, vocab, sampling.greedy, device
    )
    first = draw(
        target_probabilities(logits, filters), _uniform(vocab, sampling, generator, device), relax.greedy
    )
    # What the next step catches up on: the tokens committed since the drafter's last call
    # (left-aligned, m of them; the last is the root) and the target's hidden states before each.
    rows = tree.max_depth + 1
    pending = F.pad(first.reshape(1), (0, rows - 1))
    pending_hidden = F.pad(hidden[:, None], (0, 0, 0, rows - 1))
    m = torch.ones(1, dtype=torch.long, device=device)
    if spec:
        spec.drafter.cache.reset()
    noises = tree.num_nodes + 1
    ar_valid, ar_q = torch.ones(1, dtype=torch.bool, device=device), torch.zeros(1, vocab, device=device)
    tokens = [int(first)]
    accepted: list[int] = []
    while len(tokens) < num_tokens:
        if spec:
            with span("draft"):
                drafted = draft(
                    spec.drafter, tree, pending, pending_hidden, m, target.cache.length, sampling, generator
                )
        else:
            drafted = Draft(pending.gather(0, m - 1), ar_valid, ar_q)  # q: unread
        noise, bonus_noise = _uniform(noises + vocab, sampling, generator, device).split([noises, vocab])
        with span("verify"):
            out = target.verify(
                tree,
                drafted,
                noise,
                bonus_noise,
                filters,
                relax,
            )
        with span("kv_compaction"):
            m = out.length + 1
            target.cache.write(out.new_k, out.new_v, m)
        pending, pending_hidden = out.tokens, out.hidden
        n, *committed = torch.cat([out.length, out.tokens]).tolist()  # the step's one read
        emitted = committed[: min(n + 1, num_tokens - len(tokens))]
        tokens.extend(emitted)
        accepted.append(len(emitted))
    return ImageResult(torch.tensor(tokens, dtype=torch.long), accepted)


def _uniform(
    count: int, sampling: SamplingConfig, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """``count`` uniform values from ``generator`` for a step's tests and draws; in greedy mode
    zeros, which nothing reads (greedy decisions are argmaxes) and which cost no draw."""
    if sampling.greedy:
        return _zeros(count, device)
    return torch.rand(count, generator=generator, device=device)


@lru_cache(maxsize=16)
def _zeros(count: int, device: torch.device) -> Tensor:
    return torch.zeros(count, device=device)
