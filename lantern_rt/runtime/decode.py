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

from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.acceptance import Relaxation, RelaxInputs, draw, relax_inputs, target_probabilities
from lantern_rt.runtime.backends.base import Draft, DrafterBackend, FilterInputs, TargetBackend
from lantern_rt.runtime.backends.cuda_graphs import CudaGraphed
from lantern_rt.runtime.drafting import draft, noise_rows
from lantern_rt.runtime.profiling import span
from lantern_rt.runtime.sampling import (
    TOPK_LIMIT,
    SamplingConfig,
    check_sort_width,
    draw_noise,
    filter_inputs,
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


@dataclass(frozen=True)
class DecodeStep:
    """One decode step as a function of device tensors alone: draft (speculative methods), verify
    and accept, commit both caches (docs/method.md §4-6). It reads nothing back to the host, so a
    CUDA graph can capture it whole (:class:`~lantern_rt.runtime.backends.cuda_graphs.CudaGraphed`).

    Called with the pending pairs (tokens [R] left-aligned, the target's hidden states before
    them [2, R, D], their count m [1]), the drafter's noise [noise_rows, V] and the verify
    noise [N+1] and bonus noise [V]; returns the accepted length [1], the committed tokens
    [R] (bonus included) and their hidden states [2, R, D]: the next step's pending pairs."""

    target: TargetBackend
    spec: Speculation | None
    tree: StaticTree
    filters: FilterInputs
    relax: RelaxInputs
    ar_valid: Tensor  # [1] True: AR's root-only "draft"
    ar_q: Tensor  # [1, V] zeros, never read

    def __call__(
        self,
        pending: Tensor,
        hidden: Tensor,
        m: Tensor,
        draft_noise: Tensor,
        noise: Tensor,
        bonus_noise: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        target = self.target
        if self.spec:
            with span("draft"):
                drafted = draft(
                    self.spec.drafter,
                    self.tree,
                    pending,
                    hidden,
                    m,
                    target.cache.length,
                    draft_noise,
                    self.filters,
                )
        else:
            drafted = Draft(pending.gather(0, m - 1), self.ar_valid, self.ar_q)
        with span("verify"):
            out = target.verify(self.tree, drafted, noise, bonus_noise, self.filters, self.relax)
        with span("kv_compaction"):
            target.cache.write(out.new_k, out.new_v, out.length + 1)
        return out.length, out.tokens, out.hidden


def decode_image(
    target: TargetBackend,
    cond: Tensor,
    num_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    spec: Speculation | None = None,
    step_graphs: dict | None = None,
) -> ImageResult:
    """Generate ``num_tokens`` image tokens for the condition rows ``cond`` (cond, uncond).

    Each step (:class:`DecodeStep`) drafts, verifies and accepts the tree, and commits on the
    device, from uniform noise drawn for the step from ``generator``; the host then reads one
    small tensor, the accepted length and tokens. With ``step_graphs`` (a dict the caller keeps
    across images, on a CUDA device) each step is replayed from one captured CUDA graph.
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
    step = _step(target, spec, tree, filters, relax, vocab, device, step_graphs)
    noises = tree.num_nodes + 1
    tokens = [int(first)]
    accepted: list[int] = []
    while len(tokens) < num_tokens:
        draft_noise = (
            draw_noise(noise_rows(tree), vocab, sampling.greedy, generator, device)
            if spec
            else _zeros(1, device)
        )
        noise, bonus_noise = _uniform(noises + vocab, sampling, generator, device).split([noises, vocab])
        length, pending, pending_hidden = step(pending, pending_hidden, m, draft_noise, noise, bonus_noise)
        m = length + 1
        n, *committed = torch.cat([length, pending]).tolist()  # the step's one read
        emitted = committed[: min(n + 1, num_tokens - len(tokens))]
        tokens.extend(emitted)
        accepted.append(len(emitted))
    return ImageResult(torch.tensor(tokens, dtype=torch.long), accepted)


def _step(
    target: TargetBackend,
    spec: Speculation | None,
    tree: StaticTree,
    filters: FilterInputs,
    relax: RelaxInputs,
    vocab: int,
    device: torch.device,
    graphs: dict | None,
) -> DecodeStep | CudaGraphed:
    """The step of these backends and settings, captured once in ``graphs`` when given."""
    key = (id(target), id(spec), tree.paths, *map(id, filters), *map(id, relax))
    if graphs is not None and key in graphs:
        return graphs[key]
    step = DecodeStep(
        target,
        spec,
        tree,
        filters,
        relax,
        torch.ones(1, dtype=torch.bool, device=device),
        torch.zeros(1, vocab, device=device),
    )
    if graphs is None:
        return step
    if device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA device; the model is on {device}")
    lengths = (target.cache.length, *((spec.drafter.cache.length,) if spec else ()))
    graphs[key] = CudaGraphed(step, state=lengths)
    return graphs[key]


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
