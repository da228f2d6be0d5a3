"""The one decode loop: prefill, then (draft, verify the tree, accept, compact) until done.

Plain autoregressive decoding is the same loop without a drafter: the tree holds only the
root, each target call scores one token and the "bonus" token is an ordinary sample.
The steps are described in docs/method.md (§4 drafting, §5 acceptance, §6 KV compaction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lantern_rt.runtime.acceptance import Relaxation, relax_inputs
from lantern_rt.runtime.backends.base import DrafterBackend, TargetBackend
from lantern_rt.runtime.drafting import Draft, draft
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
    """Generate ``num_tokens`` image tokens for the condition rows ``cond`` (cond, uncond).

    Each step drafts (speculative methods), verifies the tree in one target call and accepts on
    the backend (:func:`~lantern_rt.runtime.acceptance.accept_tree`, from uniform noise drawn
    for the step from ``generator``); the host then reads one small tensor, the accepted length
    and tokens, and the cache keeps the accepted entries by a gather on the device.
    """
    tree = spec.tree if spec else ROOT_ONLY
    if spec:
        vocab = spec.drafter.vocab_size
        check_sort_width(sampling, vocab, min(vocab, TOPK_LIMIT))
    with span("prefill"):
        logits, hidden = target.prefill(cond)
    p = distribution(cfg_mix(logits, sampling.cfg_scale), sampling)
    device, vocab = p.device, p.shape[-1]
    relax = relax_inputs(
        spec.relax if spec else EXACT, spec.neighbors if spec else None, vocab, sampling.greedy, device
    )
    tokens = [int(sample(p, sampling, generator))]
    pending = tokens[:]
    pending_hidden = hidden[:, None]
    if spec:
        spec.drafter.cache.reset()
    depth, mask = tree.depth.to(device), tree.mask.to(device)
    ar_valid, ar_q = torch.ones(1, dtype=torch.bool, device=device), p.new_zeros(1, vocab)  # q: unread
    no_noise = (torch.zeros(tree.num_nodes + 1, device=device), p.new_zeros(vocab))  # greedy: unread
    accepted: list[int] = []
    while len(tokens) < num_tokens:
        root_position = target.cache.length
        if spec:
            with span("draft"):
                drafted = draft(
                    spec.drafter, tree, pending, pending_hidden, root_position, sampling, generator
                )
        else:
            drafted = Draft(torch.tensor(pending[-1:], device=device), ar_valid, ar_q)
        with span("verify"):
            logits, hidden = target.step(drafted.tokens, root_position + depth, mask)
        with span("accept"):
            noise, bonus_noise = (
                no_noise
                if sampling.greedy
                else torch.rand(tree.num_nodes + 1 + vocab, generator=generator, device=device).split(
                    [tree.num_nodes + 1, vocab]
                )
            )
            out = target.accept(
                tree, logits, drafted.tokens, drafted.valid, drafted.q, noise, bonus_noise, sampling, relax
            )
            n, *committed = torch.cat([out.length, out.tokens[0]]).tolist()  # the step's one read
        new = committed[: n + 1]
        emitted = new[: num_tokens - len(tokens)]
        tokens.extend(emitted)
        accepted.append(len(emitted))
        if len(tokens) == num_tokens:
            break
        kept = out.kept[0]
        with span("kv_compaction"):
            target.cache.commit(kept, n + 1)
        pending = new
        pending_hidden = hidden.index_select(1, kept)[:, : n + 1]
    return ImageResult(torch.tensor(tokens, dtype=torch.long), accepted)
