"""Sampling primitives shared by every backend: CFG mixing, logits processors, draws.

All functions are pure and device-agnostic (torch tensors on CPU or GPU). Randomness comes
only from an explicit ``torch.Generator`` so that a seed fixes every token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


class SamplingError(ValueError):
    """Sampling settings are out of range."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the mixed logits. ``temperature == 0`` means greedy."""

    cfg_scale: float = 3.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.cfg_scale) or self.cfg_scale < 0:
            raise SamplingError(f"CFG scale must be a finite number >= 0, got {self.cfg_scale}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1) or math.isnan(self.top_p):
            raise SamplingError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def cfg_mix(logits: Tensor, scale: float) -> Tensor:
    """Mix [2, ..., V] logits (row 0 conditional, row 1 unconditional): u + s * (c - u)."""
    return torch.lerp(logits[1], logits[0], scale)


def processed_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """Temperature, top-k and top-p applied to mixed logits [..., V]; removed entries are -inf."""
    logits = logits.float()
    if cfg.greedy:
        return logits
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cum > cfg.top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def distribution(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """Probabilities [..., V] after CFG-free processing (pass mixed logits).

    In greedy mode this is the plain softmax: greedy decisions use argmax, and the relaxed
    greedy test compares probability mass, so it needs real probabilities.
    """
    return torch.softmax(processed_logits(logits, cfg), dim=-1)


def categorical(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of ``probs`` [..., V] (unnormalised is fine) by inverting the CDF: a
    few cheap ops, where ``torch.multinomial`` costs tens of microseconds per call on a CPU.

    u is uniform on (0, 1], so the first index whose cumulative mass reaches u * total always
    has positive probability.
    """
    cum = torch.cumsum(probs, dim=-1)
    u = 1.0 - torch.rand((*probs.shape[:-1], 1), generator=generator, device=probs.device, dtype=cum.dtype)
    return torch.searchsorted(cum, u * cum[..., -1:]).clamp_max(probs.shape[-1] - 1).squeeze(-1)


def sample(probs: Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs`` [..., V]: argmax when greedy, else a categorical draw."""
    if cfg.greedy:
        return probs.argmax(dim=-1)
    return categorical(probs, generator)


def draw_distinct(
    probs: Tensor, width: int, greedy: bool, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """``width`` distinct tokens per row of ``probs`` [M, V], drawn without replacement.

    Gumbel-top-k (top-``width`` of log p + Gumbel noise) gives the same law as drawing one by
    one without replacement, in one fixed-shape op; greedy mode takes the top-``width``.
    Returns (tokens [M, width] in draw order, valid [M, width]): a token is invalid when its
    probability is zero (fewer than ``width`` tokens have support).
    """
    if width == 1 and not greedy:  # one draw: a categorical sample is the same law, cheaper
        tokens = categorical(probs, generator)[:, None]
        return tokens, torch.ones_like(tokens, dtype=torch.bool)
    logp = torch.log(probs)
    if not greedy:
        u = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
        logp = logp - torch.log(-torch.log(u.clamp_min(1e-20)))
    tokens = torch.topk(logp, width, dim=-1).indices
    valid = torch.gather(probs, -1, tokens) > 0
    return tokens, valid
