"""Tokens recorded before a change (tests/fixtures/demo_tokens.npz, by
tests/record_token_fixtures.py) must come out of the code after it: greedy AR, exact and
LANTERN++ on the demo, on torch and on onnxruntime. Sampled tokens are not pinned, but the same
seed gives the same sampled tokens on torch and onnxruntime (at the demo's real size, as
tests/test_ort_speculative.py checks on tiny models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from token_fixture_cases import (
    CASES,
    FIXTURE,
    LABELS,
    METHODS,
    SEED,
    demo_bundle,
    method_config,
    sampling,
)

from lantern_rt.assembly import onnxruntime_pipeline, torch_pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.model_dir import DEMO_DIR


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo and its bundle of TREE (one cache window: the tokens do not depend on the
    windows, tests/test_cache_windows.py), exported once per run (tests/test_openvino.py's too)."""
    md = open_model_dir(DEMO_DIR)
    return md, Bundle.open(demo_bundle(tmp_path_factory.mktemp("demo") / "bundle"))


@pytest.fixture(scope="module")
def recorded():
    with np.load(FIXTURE) as data:
        return {key: torch.from_numpy(data[key]) for key in data.files}


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "method", "mode"), CASES)
def test_tokens_match_the_recorded_fixtures(demo, recorded, backend, method, mode):
    md, bundle = demo
    mc = method_config(method)
    pipe = torch_pipeline(md, mc) if backend == "torch" else onnxruntime_pipeline(bundle, mc, threads=1)
    result = generate(pipe, LABELS, sampling(mode), seed=SEED, progress=False)
    assert torch.equal(result.tokens, recorded[f"{backend}/{method}/{mode}"])
    if method == "lantern++":
        assert result.stats.mean_accepted_length > 2.0  # the drafter really drafts


def test_recorded_tokens_agree_across_backends(recorded):
    """The fixtures themselves: torch and onnxruntime recorded the same tokens, and greedy exact
    speculative decoding gave greedy AR's tokens."""
    for method in METHODS:
        assert torch.equal(recorded[f"torch/{method}/greedy"], recorded[f"onnxruntime/{method}/greedy"])
    assert torch.equal(recorded["torch/exact/greedy"], recorded["torch/ar/greedy"])


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_sampled_tokens_equal_on_torch_and_onnxruntime(demo, recorded, method):
    md, bundle = demo
    mc, settings = method_config(method), sampling("sampled")
    ours = generate(onnxruntime_pipeline(bundle, mc, threads=1), LABELS, settings, seed=SEED, progress=False)
    reference = generate(torch_pipeline(md, mc), LABELS, settings, seed=SEED, progress=False)
    assert torch.equal(ours.tokens, reference.tokens)
    assert ours.stats.histogram == reference.stats.histogram
    # it really sampled: not the greedy tokens (torch's, as test_tokens_match_the_recorded_fixtures checks)
    assert not torch.equal(reference.tokens, recorded[f"torch/{method}/greedy"])
