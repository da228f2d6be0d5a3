"""Sampling primitives: the fixed-shape logits filter against the classic sort-and-scatter one,
its sort-width limits, Gumbel-top-k draws, and CFG mixing."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from lantern_rt.runtime.sampling import (
    SamplingConfig,
    SamplingError,
    cfg_mix,
    check_sort_width,
    draw_distinct,
    draw_noise,
    filter_inputs,
    filter_logits,
)

CHI2_999 = {2: 13.82, 3: 16.27}  # chi-square critical values at p = 0.999, by degrees of freedom


def chi_square(observed: Tensor, expected: Tensor) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def reference_filter(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Temperature, top-k, top-p as Hugging Face's warpers write them (sort, cumsum, scatter)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 0, 0.8),
    (1.3, 20, 0.6),
    (1.0, 1, 0.9),
    (1.0, 0, 0.01),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_filter_matches_the_sort_and_scatter_reference(temperature, top_k, top_p):
    logits = 3.0 * torch.randn(6, 64, generator=torch.Generator().manual_seed(top_k))
    cfg = SamplingConfig(cfg_scale=3.0, temperature=temperature, top_k=top_k, top_p=top_p)
    _, t, k, p = filter_inputs(cfg, torch.device("cpu"))
    want = reference_filter(logits, temperature, top_k, top_p)
    got = filter_logits(logits, t, k, p, 64)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()])
    # a narrower sort is exact whenever top-k is on and fits in it
    if 0 < top_k <= 32:
        assert torch.equal(filter_logits(logits, t, k, p, 32), got)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (3000, 1.0), (100, 0.5)])
def test_filter_beyond_the_sort_width_matches_the_reference(top_k, top_p):
    """A vocabulary above the sort width (LlamaGen's 16384, Chameleon's 8192 codes): off is a
    no-op and top-k alone keeps its k, however many logits are past the sorted ones."""
    vocab, width = 5000, 3840
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    cfg = SamplingConfig(cfg_scale=3.0, temperature=0.9, top_k=top_k, top_p=top_p)
    _, t, k, p = filter_inputs(cfg, torch.device("cpu"))
    got = filter_logits(logits, t, k, p, min(vocab, width))
    want = reference_filter(logits, 0.9, top_k, top_p)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()])


def test_sort_width_limits_are_one_line_errors():
    check_sort_width(SamplingConfig(3.0, top_k=2000, top_p=0.9), 16384, 3840)  # LlamaGen's settings fit
    check_sort_width(SamplingConfig(3.0, top_p=0.9), 1024, 1024)  # the whole vocabulary is sorted
    check_sort_width(SamplingConfig(3.0, temperature=0.0, top_p=0.5), 16384, 3840)  # greedy: no filter
    with pytest.raises(SamplingError, match="top-k 5000 is above 3840"):
        check_sort_width(SamplingConfig(3.0, top_k=5000), 16384, 3840)
    with pytest.raises(SamplingError, match="needs a top-k of at most 3840"):
        check_sort_width(SamplingConfig(3.0, top_p=0.9), 16384, 3840)


def test_cfg_mix_is_uncond_plus_scale_times_the_difference():
    logits = torch.randn(4, 3, 8)  # two images: their conditional rows, then their unconditional rows
    torch.testing.assert_close(cfg_mix(logits, 4.0, 2), logits[2:] + 4.0 * (logits[:2] - logits[2:]))
    torch.testing.assert_close(cfg_mix(logits, torch.tensor([4.0]), 2), cfg_mix(logits, 4.0, 2))


def test_draws_are_distinct_and_follow_the_law_without_replacement():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 20000
    noise = draw_noise(n, 5, False, torch.Generator().manual_seed(0), torch.device("cpu"))
    tokens, valid = draw_distinct(probs.expand(n, -1), noise, 2)
    assert (tokens[:, 0] != tokens[:, 1]).all() and valid.all()  # two tokens always have mass
    first = torch.bincount(tokens[:, 0], minlength=5).float()
    assert first[4] == 0
    assert chi_square(first[:4], n * probs[:4]) < CHI2_999[3]
    # second draw given the first is 0: p renormalised without token 0
    second = torch.bincount(tokens[tokens[:, 0] == 0, 1], minlength=5).float()
    want = probs[1:4] / probs[1:4].sum() * second.sum()
    assert chi_square(second[1:4], want) < CHI2_999[2]


def test_greedy_noise_draws_the_top_tokens_and_flags_zero_mass():
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.0, 0.0, 1.0, 0.0]])
    noise = draw_noise(2, 4, True, None, torch.device("cpu"))
    assert torch.allclose(noise, torch.full((2, 4), math.exp(-1.0)))
    tokens, valid = draw_distinct(probs, noise, 3)
    assert tokens[0].tolist() == [1, 2, 0] and valid[0].all()
    assert tokens[1, 0] == 2 and valid[1].tolist() == [True, False, False]
