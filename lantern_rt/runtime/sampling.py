"""Sampling primitives shared by every backend: CFG mixing, logits processors, draws
(docs/method.md §2).

All functions are pure and device-agnostic (torch tensors on CPU or GPU). Randomness comes
only from an explicit ``torch.Generator`` so that a seed fixes every token.
"""

from __future__ import annotations

import math
from dataclasses import astuple
from functools import lru_cache, partial
from typing import NamedTuple

import torch
from torch import Tensor

from lantern_rt.errors import option
from lantern_rt.models.sampling_config import SamplingConfig, SamplingError, setting_types


def cfg_mix(logits: Tensor, scale: float | Tensor, images: int) -> Tensor:
    """Mix the CFG rows of a batch of ``images`` B: logits [2B, ..., V] (the B images'
    conditional rows, then their unconditional rows: :func:`cfg_rows`) -> [B, ..., V], u + s *
    (c - u) (written out: ``torch.lerp`` exports as two formulas and a Where; a tensor ``scale``
    is each image's [B], or [1] for all); for a scale of at most 1 the conditional rows alone,
    as LlamaGen guides only above 1 (docs/method.md §2). Logits of B rows (one per image:
    guidance off, §13) are returned as they are."""
    if logits.shape[0] == images:
        return logits
    cond, uncond = logits.split(images)
    if isinstance(scale, Tensor):
        scale = per_row(scale, cond)
        return torch.where(scale > 1, uncond + scale * (cond - uncond), cond)
    return uncond + scale * (cond - uncond) if scale > 1 else cond


def per_row(setting: Tensor, like: Tensor) -> Tensor:
    """A per-image setting [B] (or [1]: every image's) shaped to broadcast over ``like``
    [B, ..., V], whose first axis is the images; a [1] setting broadcasts as it is (no
    reshape in a one-image graph)."""
    return setting if setting.shape[0] == 1 else setting.reshape(-1, *(1,) * (like.dim() - 1))


def cfg_rows(per_image: Tensor, rows: int) -> Tensor:
    """A per-image tensor [B, ...] as the ``rows`` rows a target or drafter call runs: 2B with
    guidance (each image's conditional row, then the same B again for the unconditional rows;
    LlamaGen's ``torch.cat([cond, uncond])`` layout), B without (one row per image, for a CFG
    scale of at most 1: docs/method.md §13)."""
    return per_image if rows == per_image.shape[0] else torch.cat([per_image, per_image])


def guided_rows(images: int, guided: bool) -> int:
    """The rows a call runs for ``images`` B: 2B with guidance, B without (docs/method.md §13)."""
    return 2 * images if guided else images


# TensorRT's TopK returns at most this many values: fixed-shape graphs filter on that many.
TOPK_LIMIT = 3840


def filter_logits(logits: Tensor, temperature: Tensor, k: Tensor, p: Tensor, sort_width: int) -> Tensor:
    """Temperature, then top-k (``k``; 0 = off), then top-p (``p``; 1 = off) applied to logits
    [B, ..., V]; removed entries are -inf. The settings are tensors, each image's [B] (or [1]:
    every image's), so that a fixed-shape graph can take them as inputs (:class:`FilterInputs`).

    Tokens are kept by value: at least the k-th largest logit, and at least the smallest of the
    fewest largest whose mass reaches ``p`` (tokens tied with a threshold all stay). Both
    thresholds are read from the ``sort_width`` largest logits: exact when ``sort_width`` is V,
    or top-k is on and at most ``sort_width`` (see :func:`check_sort_width`).

    In an exported graph the filter is the branch of an If taken only when top-k or top-p is
    on: its sort costs more than the rest of a drafter level. Eager code always filters (a
    no-op when both are off), as a CUDA-graph capture needs: ``torch.cond`` would sync.
    """
    temperature, k, p = (per_row(t, logits) for t in (temperature, k, p))
    logits = logits.float() / temperature
    if not torch.compiler.is_exporting():
        return _keep_top(logits, k, p, sort_width)
    on = ((k > 0) | (p < 1.0)).any()  # any image's filter on: each row filters as it says
    return torch.cond(on, partial(_keep_top, sort_width=sort_width), _unfiltered, (logits, k, p))


def _keep_top(logits: Tensor, k: Tensor, p: Tensor, sort_width: int) -> Tensor:
    """The top-k, then top-p, filter of :func:`filter_logits` on tempered logits."""
    top = torch.topk(logits, sort_width, dim=-1).values  # descending
    index = (k.clamp(1, sort_width) - 1).expand(*top.shape[:-1], 1)
    kth = torch.where(k > 0, top.gather(-1, index), float("-inf"))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    top = top.masked_fill(top < kth, float("-inf"))
    mass = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
    before = torch.cumsum(mass, dim=-1) - mass  # the mass of the larger logits
    kept = before <= p
    smallest = torch.where(kept, top, float("inf")).amin(dim=-1, keepdim=True)
    # top-p off keeps every token top-k kept, beyond the sort width too (a no-op when both are off)
    smallest = torch.where(p >= 1.0, float("-inf"), smallest)
    return logits.masked_fill(logits < smallest, float("-inf"))


def _unfiltered(logits: Tensor, *filters: Tensor) -> Tensor:
    return logits.clone()  # a cond branch may not return its input


def check_sort_width(cfg: SamplingConfig, vocab: int, sort_width: int) -> None:
    """:class:`SamplingError` when :func:`filter_logits` over ``sort_width`` of ``vocab`` logits
    cannot apply ``cfg`` exactly (a top-k above the width, or top-p without such a top-k)."""
    if sort_width >= vocab or cfg.greedy:
        return
    if cfg.top_k > sort_width:
        raise SamplingError(
            f"top-k {cfg.top_k} is above {sort_width}, the most this runtime's drafter keeps for a "
            f"vocabulary of {vocab}: use {option('top_k', sort_width)} or less"
        )
    if cfg.filters and cfg.top_k == 0:  # top-p alone
        raise SamplingError(
            f"top-p on a vocabulary of {vocab} needs a top-k of at most {sort_width} as well: add "
            f"{option('top_k')}"
        )


# The sampling settings as tensors, :class:`SamplingConfig`'s fields by name: each image's [B]
# (:class:`SamplingRows`), or [1] for every image (:func:`filter_inputs`). The graphs take them as
# inputs of these names.
FilterInputs = NamedTuple("FilterInputs", [(name, Tensor) for name in setting_types()])  # type: ignore[misc]


def filtered_softmax(logits: Tensor, sampling: FilterInputs) -> Tensor:
    """The distribution of mixed ``logits`` [B, ..., V] under ``sampling``'s filter
    (:func:`filter_logits` over at most :data:`TOPK_LIMIT` of the largest), then a softmax."""
    width = min(logits.shape[-1], TOPK_LIMIT)
    return torch.softmax(filter_logits(logits, *sampling[1:], width), dim=-1)


def row_settings(cfg: SamplingConfig) -> tuple[float | int | bool, ...]:
    """One image's :class:`FilterInputs` values and greedy flag as the filter reads them; in
    greedy mode, where the logits are not filtered, the defaults' (no temperature, top-k or
    top-p)."""
    kept = SamplingConfig(cfg.cfg_scale) if cfg.greedy else cfg
    return (*astuple(kept), cfg.greedy)


class SamplingRows:
    """Each of B images' sampling settings on ``device``: :class:`FilterInputs` [B]
    (:attr:`filters`) and the greedy flags [B] (:attr:`greedy`). :meth:`write` sets a slot's in
    place when it takes an image, so that a step reads them where they lie (a captured CUDA
    graph, a graph input bound by pointer) and no step reads them back."""

    DTYPES = (
        *(torch.int64 if kind is int else torch.float32 for kind in setting_types().values()),
        torch.bool,
    )

    def __init__(self, images: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.tensors = tuple(torch.zeros(images, dtype=dtype, device=self.device) for dtype in self.DTYPES)

    @property
    def filters(self) -> FilterInputs:
        return FilterInputs(*self.tensors[:4])

    @property
    def greedy(self) -> Tensor:
        return self.tensors[4]

    def write(self, slots: list[int], configs: list[SamplingConfig]) -> None:
        """The images in ``slots`` sample as ``configs`` say (one each)."""
        index = torch.tensor(slots, device=self.device)
        columns = zip(*map(row_settings, configs), strict=True)
        for tensor, values in zip(self.tensors, columns, strict=True):
            tensor.index_copy_(0, index, torch.tensor(values, dtype=tensor.dtype).to(self.device))


def check_filterable(cfg: SamplingConfig, vocab: int) -> None:
    """:func:`check_sort_width` at the width the runtime sorts a vocabulary of ``vocab`` over:
    all of it, at most :data:`TOPK_LIMIT`."""
    check_sort_width(cfg, vocab, min(vocab, TOPK_LIMIT))


@lru_cache(maxsize=16)
def filter_inputs(cfg: SamplingConfig, device: torch.device) -> FilterInputs:
    """``cfg`` for every image: :class:`FilterInputs` of one element each (:func:`row_settings`)."""
    rows = SamplingRows(1, device)
    rows.write([0], [cfg])
    return rows.filters


def draw_noise(
    rows: int, vocab: int, greedy: bool, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """Uniform noise [rows, V] for :func:`draw_distinct`; in greedy mode e^-1 everywhere, whose
    Gumbel transform is one constant, so the draw is the plain top-w."""
    if greedy:
        return _greedy_noise(rows, vocab, device)
    return torch.rand(rows, vocab, generator=generator, device=device)


@lru_cache(maxsize=16)
def _greedy_noise(rows: int, vocab: int, device: torch.device) -> Tensor:
    return torch.full((rows, vocab), math.exp(-1.0), device=device)


def gumbel_offsets(noise: Tensor) -> Tensor:
    """log(-log u) of uniform ``noise``: minus the Gumbel noise :func:`draw_distinct` adds to
    log p (a drafting call transforms all its levels' noise at once, not once per level)."""
    return torch.log(-torch.log(noise.clamp_min(1e-20)))


def draw_distinct(probs: Tensor, noise: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``width`` distinct tokens per row of ``probs`` [M, V], drawn without replacement.

    Gumbel-top-k (top-``width`` of log p + Gumbel noise, made from the uniform ``noise``
    [M, V]) gives the same law as drawing one by one without replacement, in one fixed-shape
    op. Returns (tokens [M, width] in draw order, valid [M, width]): a token is invalid when its
    probability is zero (fewer than ``width`` tokens have support).
    """
    return top_distinct(probs, gumbel_offsets(noise), width)


def top_distinct(probs: Tensor, offsets: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """:func:`draw_distinct` from the noise's :func:`gumbel_offsets` [M, V]: the top-``width``
    of log p - offsets."""
    tokens = torch.topk(torch.log(probs) - offsets, width, dim=-1).indices
    return tokens, torch.gather(probs, -1, tokens) > 0
