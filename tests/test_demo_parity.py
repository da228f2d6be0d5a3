"""The built-in demo exported to a bundle: greedy tokens on onnxruntime equal torch's, for AR and
LANTERN++ (the same check as tests/test_ort_speculative.py, at the demo's real size)."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.export.bundle import export_bundle
from lantern_rt.generate import MethodConfig, generate, onnxruntime_pipeline, torch_pipeline
from lantern_rt.models.model_dir import DEMO_DIR, open_model_dir
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree

TREE = "chain-3"
GREEDY = SamplingConfig(cfg_scale=3.0, temperature=0.0)
LABELS = [3, 7]  # dress, sneaker


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    md = open_model_dir(DEMO_DIR)
    bundle = export_bundle(md, tmp_path_factory.mktemp("demo") / "bundle", trees=[load_tree(TREE)], threads=1)
    return md, bundle


@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_demo_greedy_tokens_equal_on_onnxruntime_and_torch(demo, method):
    md, bundle = demo
    mc = MethodConfig(method, tree=TREE, k=10, lam=5.0)
    ours = generate(onnxruntime_pipeline(bundle, mc, threads=1), LABELS, GREEDY, progress=False)
    reference = generate(torch_pipeline(md, mc), LABELS, GREEDY, progress=False)
    assert torch.equal(ours.tokens, reference.tokens)
    assert ours.stats["accepted_length_histogram"] == reference.stats["accepted_length_histogram"]
    if method == "lantern++":
        assert ours.stats["mean_accepted_length"] > 2.0  # the drafter really drafts
