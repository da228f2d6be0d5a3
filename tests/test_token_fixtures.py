"""Tokens recorded before a change (tests/fixtures/demo_tokens.npz, by
tests/record_token_fixtures.py) must come out of the code after it: greedy and sampled AR, exact
and LANTERN++ on the demo, on torch and on onnxruntime. Also the demo's greedy tokens on
onnxruntime equal torch's (at the demo's real size, as tests/test_ort_speculative.py checks on
tiny models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from token_fixture_cases import CASES, FIXTURE, LABELS, SEED, TREE, method_config, sampling

from lantern_rt.bundle import Bundle
from lantern_rt.export.bundle import export_bundle
from lantern_rt.generate import generate, onnxruntime_pipeline, torch_pipeline
from lantern_rt.models.model_dir import DEMO_DIR, open_model_dir
from lantern_rt.runtime.tree import load_tree


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    md = open_model_dir(DEMO_DIR)
    path = export_bundle(md, tmp_path_factory.mktemp("demo") / "bundle", trees=[load_tree(TREE)], threads=1)
    return md, Bundle.open(path)


@pytest.fixture(scope="module")
def recorded():
    with np.load(FIXTURE) as data:
        return {key: torch.from_numpy(data[key]) for key in data.files}


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
    """The fixtures themselves: the same seed gives the same tokens on torch and onnxruntime, and
    greedy exact speculative decoding gives greedy AR's tokens."""
    for method, mode in {(m, s) for _, m, s in CASES}:
        assert torch.equal(recorded[f"torch/{method}/{mode}"], recorded[f"onnxruntime/{method}/{mode}"])
    assert torch.equal(recorded["torch/exact/greedy"], recorded["torch/ar/greedy"])
    assert not torch.equal(recorded["torch/ar/sampled"], recorded["torch/ar/greedy"])
