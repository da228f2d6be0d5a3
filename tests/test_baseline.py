"""The torch-batched baseline (LlamaGen's sampler loop over our target): greedy tokens are our
runtime's AR tokens and each one the argmax of a cache-free teacher-forced forward, whatever the
batch size; sampled first tokens follow the CFG-mixed, filtered softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import tiny_gpt
from token_fixture_cases import FIXTURE
from token_fixture_cases import LABELS as FIXTURE_LABELS
from token_fixture_cases import sampling as fixture_sampling

from lantern_rt.eval.baseline import BaselineRun, filtered, torch_batched_ar
from lantern_rt.families.loading import load_target, open_model_dir
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.sampling import SamplingConfig

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
LABELS = [0, 3, 7]


@pytest.fixture(scope="module")
def demo() -> Transformer:
    return load_target(open_model_dir(None))


@pytest.fixture(scope="module")
def demo_greedy(demo) -> BaselineRun:
    return torch_batched_ar(demo, LABELS, GREEDY, batch_size=2, seed=0)


def mixed_logits(
    model: Transformer, labels: list[int], tokens: torch.Tensor, cfg_scale: float
) -> torch.Tensor:
    """CFG-mixed logits [N, T + 1, V] of one full causal forward (no cache) over ``tokens`` [N, T]."""
    cond = torch.tensor(labels)
    null = torch.full_like(cond, model.config.num_classes)
    with torch.inference_mode():
        logits = model(torch.cat([tokens, tokens]), torch.cat([cond, null]))
    c, u = logits.split(len(labels))
    return u + (c - u) * cfg_scale if cfg_scale > 1 else c  # LlamaGen guides only above 1


def assert_teacher_forced_greedy(model: Transformer, labels: list[int], run: BaselineRun, cfg_scale: float):
    """Every token is the argmax of the mixed softmax given the tokens before it."""
    n = model.config.block_size
    assert run.tokens.shape == (len(labels), n) and run.tokens.dtype == torch.int64
    mixed = mixed_logits(model, labels, run.tokens[:, :-1], cfg_scale)
    assert torch.equal(mixed.softmax(-1).argmax(-1), run.tokens)


def test_greedy_tokens_are_the_teacher_forced_argmax(demo, demo_greedy):
    assert_teacher_forced_greedy(demo, LABELS, demo_greedy, GREEDY.cfg_scale)
    assert demo_greedy.seconds > 0 and demo_greedy.seconds_per_image == pytest.approx(demo_greedy.seconds / 3)


def test_greedy_tokens_equal_our_recorded_ar_tokens(demo):
    """tests/fixtures/demo_tokens.npz holds the runtime's greedy AR tokens (kept current by
    tests/test_token_fixtures.py)."""
    with np.load(FIXTURE) as data:
        recorded = torch.from_numpy(data["torch/ar/greedy"])
    run = torch_batched_ar(demo, FIXTURE_LABELS, fixture_sampling("greedy"), batch_size=2, seed=0)
    assert torch.equal(run.tokens, recorded)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_tokens_do_not_depend_on_the_batch_size(demo, demo_greedy, batch_size):
    run = torch_batched_ar(demo, LABELS, GREEDY, batch_size=batch_size, seed=5)
    assert torch.equal(run.tokens, demo_greedy.tokens)


@pytest.mark.parametrize("n_kv_head", [None, 1])
def test_greedy_on_a_tiny_model_with_and_without_grouped_kv(n_kv_head):
    model = tiny_gpt(seed=3, n_kv_head=n_kv_head)
    labels = [0, 4, 2, 2, 1]
    run = torch_batched_ar(
        model, labels, SamplingConfig(cfg_scale=1.5, temperature=0.0), batch_size=2, seed=0
    )
    assert_teacher_forced_greedy(model, labels, run, 1.5)


@pytest.mark.parametrize("cfg_scale", [1.0, 0.6])
def test_no_guidance_at_scales_up_to_1_equals_our_ar(cfg_scale):
    """At cfg_scale <= 1 LlamaGen runs the conditional row alone: the baseline (one row per
    image) and our runtime (two rows, the conditional logits taken as they are) agree."""
    from lantern_rt.runtime.backends.torch_backend import TorchTarget
    from lantern_rt.runtime.decode import decode_image

    model = tiny_gpt(seed=3)
    labels = [0, 4, 2]
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    run = torch_batched_ar(model, labels, sampling, batch_size=2, seed=0)
    assert_teacher_forced_greedy(model, labels, run, cfg_scale)
    for label, tokens in zip(labels, run.tokens, strict=True):
        cond = torch.tensor([label, model.config.num_classes])
        assert torch.equal(decode_image(TorchTarget(model), cond, 16, sampling, None).tokens, tokens)


def test_top_k_1_is_greedy(demo, demo_greedy):
    run = torch_batched_ar(demo, LABELS, SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=1), 3, seed=1)
    assert torch.equal(run.tokens, demo_greedy.tokens)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The filtered distribution of one logits row [V], by definition: the k largest (ties aside),
    then of those the largest while the mass before each, renormalised over the k, is <= top_p."""
    order = torch.argsort(logits, descending=True)[: top_k or None]
    p = torch.zeros_like(logits)
    p[order] = (logits[order] / temperature).softmax(-1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for token in order.tolist():
        if mass > top_p:
            break
        keep[token] = True
        mass += float(p[token])
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(0, 1.0), (7, 1.0), (0, 0.6), (12, 0.8), (1, 0.5), (60, 0.7), (0, 0.99)]
)
def test_the_filter_keeps_what_the_definition_keeps(top_k, top_p):
    logits = 2.0 * torch.randn(6, 50, generator=torch.Generator().manual_seed(top_k))
    sampling = SamplingConfig(cfg_scale=1.0, temperature=0.7, top_k=top_k, top_p=top_p)
    for row, out in zip(logits, filtered(logits, sampling), strict=True):
        expected = reference_probs(row, 0.7, top_k, top_p)
        torch.testing.assert_close(out.softmax(-1), expected, atol=1e-6, rtol=1e-5)


def chi_square_critical(df: int) -> float:
    """The chi-square quantile at p = 0.9999 (Wilson-Hilferty; close enough for a fixed seed)."""
    z, a = 3.719, 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the bins expecting >= 5 draws, the rest pooled."""
    expected = probs.double() * draws
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 5:  # too few to stand alone: fold the pooled bin into the smallest big one
        obs, exp = obs[:-1], exp[:-1]
        obs[exp.argmin()] += counts[~big].sum()
        exp[exp.argmin()] += expected[~big].sum()
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (1.5, 20, 0.9)])
def test_first_tokens_follow_the_cfg_mixed_softmax(temperature, top_k, top_p):
    model = tiny_gpt(seed=1)
    draws, label, scale = 2000, 2, 1.5
    sampling = SamplingConfig(cfg_scale=scale, temperature=temperature, top_k=top_k, top_p=top_p)
    run = torch_batched_ar(model, [label] * draws, sampling, batch_size=draws, seed=7)
    counts = torch.bincount(run.tokens[:, 0], minlength=model.config.vocab_size)
    empty = torch.zeros(1, 0, dtype=torch.long)
    mixed = mixed_logits(model, [label], empty, scale)[0, 0]
    probs = reference_probs(mixed, temperature, top_k, top_p)
    assert int(counts[probs == 0].sum()) == 0  # filtered tokens are never drawn
    stat, df = chi_square(counts, probs, draws)
    assert df >= 5 and stat < chi_square_critical(df)
    # The test has power: the unmixed conditional distribution is rejected.
    with torch.inference_mode():
        cond_only = model(empty, torch.tensor([label]))[0, 0]
    wrong, wrong_df = chi_square(counts, reference_probs(cond_only, temperature, top_k, top_p), draws)
    assert wrong > chi_square_critical(wrong_df)


def test_sampled_runs_repeat_with_the_seed_and_chunks_differ():
    model = tiny_gpt(seed=2)
    sampling = SamplingConfig(cfg_scale=2.0)
    a = torch_batched_ar(model, [1, 1, 1, 1], sampling, batch_size=2, seed=4)
    b = torch_batched_ar(model, [1, 1, 1, 1], sampling, batch_size=2, seed=4)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens[:2], a.tokens[2:])  # each chunk has its own stream


def test_bad_arguments_are_refused(demo):
    with pytest.raises(ValueError, match="batch size"):
        torch_batched_ar(demo, [0], GREEDY, batch_size=0, seed=0)
    with pytest.raises(ValueError, match="class ids"):
        torch_batched_ar(demo, [10], GREEDY, batch_size=1, seed=0)
    empty = torch_batched_ar(demo, [], GREEDY, batch_size=4, seed=0)
    assert empty.tokens.shape == (0, 256) and empty.seconds == 0.0
