"""Every graph of the text-to-image and Chameleon families' bundles, on their small test models,
parsed and built by TensorRT for RTX's real builder (ahead of time, no GPU): LlamaGen t2i (fp16,
GQA, a caption prefix, a drafter and its prefill, two cache windows) with its T5 text encoder,
and an Anole model with the authors' drafter (fp32). A graph the builder rejects fails its test
with the parser's or builder's message."""

from __future__ import annotations

import pytest

from lantern_rt.bundle import Bundle
from lantern_rt.engines.plans import build_plan
from tests.test_export import shared_bundle
from tests.trt_rtx_cases import assert_every_graph_builds

pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT for RTX is not installed (the trt-rtx extra)")


def test_every_graph_of_a_t2i_bundle_builds(tmp_path_factory):
    bundle = Bundle.open(shared_bundle(tmp_path_factory, "t2i-gqa-fp16"))
    assert bundle.gpt.model_type == "t2i" and bundle.dtype == "fp16"
    assert {"drafter_prefill", "draft_tree_0", "target_verify_0_w16"} <= set(bundle.graphs)
    assert_every_graph_builds(bundle)


def test_the_t2i_text_encoder_builds(prompt_model, tmp_path):
    """The T5 encoder graph of a t2i bundle (always fp32), exported alone: its other graphs are
    the t2i bundle's above."""
    from lantern_rt.export.exporter import export_graph
    from lantern_rt.families.loading import load_target, open_model_dir
    from lantern_rt.families.registry import family_named

    md = open_model_dir(prompt_model)
    (encoder,) = family_named(md.family).extra_graphs(md, load_target(md))
    entry = export_graph(encoder, encoder, tmp_path, threads=1)
    assert entry["file"] == "text_encoder.onnx"
    assert len(build_plan(tmp_path / entry["file"])) > 0


def test_every_graph_of_a_chameleon_bundle_builds(tmp_path):
    pytest.importorskip("transformers")
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.runtime.tree import load_tree
    from tests.chameleon_fixtures import hf_model, write_authors_drafter, write_model_dir
    from tests.conftest import exported
    from tests.test_chameleon_runtime import BUNDLE_TREE

    model = hf_model()
    root = tmp_path / "anole"
    write_authors_drafter(root / "drafter", model)
    md = open_model_dir(write_model_dir(root, model, root / "drafter"))
    # test_chameleon_runtime.py's trees and windows: its export serves this bundle's graphs
    bundle = Bundle.open(exported(md, tmp_path / "bundle", [load_tree(BUNDLE_TREE)], windows=1))
    assert bundle.gpt.model_type == "chameleon" and bundle.has_drafter
    assert {"drafter_prefill", "draft_tree_0", "target_verify_0"} <= set(bundle.graphs)
    assert_every_graph_builds(bundle)
