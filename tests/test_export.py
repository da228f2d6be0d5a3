"""The bundle: graph rules, numerics against torch, the manifest, tamper and failure handling."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lantern_rt.export import bundle as bundle_module
from lantern_rt.export.bundle import (
    TOLERANCE,
    BundleError,
    ExportError,
    compare_with_torch,
    export_bundle,
    load_manifest,
)
from lantern_rt.export.checks import check_graph
from lantern_rt.export.graphs import TargetPrefill, TargetStep, VQDecode
from lantern_rt.models.model_dir import load_target, load_vq, open_model_dir
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir

T2I_GQA = {"model_type": "t2i", "cls_token_num": 3, "caption_dim": 12, "n_head": 4, "n_kv_head": 2}
# name -> (model overrides, dtype, tree sizes): between them every feature, fp32 and fp16
BUNDLES = {"c2i-fp32": ({}, "fp32", [26]), "t2i-gqa-fp16": (T2I_GQA, "fp16", [])}


def shared_bundle(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """BUNDLES[name] for the tiny model of seed 3, exported once per test session."""
    path = tmp_path_factory.getbasetemp() / "bundles" / name
    if not path.is_dir():
        overrides, dtype, sizes = BUNDLES[name]
        model = write_model_dir(path.parent / f"{name}-model", tiny_gpt(3, **overrides), tiny_vq())
        export_bundle(open_model_dir(model), path, sizes, dtype=dtype, threads=1)
    return path


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    return {name: shared_bundle(tmp_path_factory, name) for name in BUNDLES}


@pytest.mark.parametrize("name", BUNDLES)
def test_every_graph_passes_the_checks(bundles, name):
    manifest = load_manifest(bundles[name])
    sizes = [1, *BUNDLES[name][2]]
    assert set(manifest["graphs"]) == {"target_prefill", "vq_decode", *(f"target_step_{s}" for s in sizes)}
    for graph in manifest["graphs"].values():
        assert check_graph(bundles[name] / graph["file"]) == []


@pytest.mark.parametrize("name", BUNDLES)
def test_every_graph_matches_torch(bundles, name):
    overrides, dtype, _ = BUNDLES[name]
    md = open_model_dir(bundles[name].parent / f"{name}-model")
    target, vq = load_target(md), load_vq(md)
    low = target if dtype == "fp32" else copy.deepcopy(target).half()
    decode = VQDecode(vq, target.config.grid_size)
    pairs = [(TargetPrefill(low), TargetPrefill(target)), (decode, decode)]
    pairs += [(TargetStep(low, s), TargetStep(target, s)) for s in (1, *BUNDLES[name][2])]
    for module, reference in pairs:
        path = bundles[name] / f"{module.spec.name}.onnx"
        errors = compare_with_torch(path, module, reference, threads=1, seed=11)
        atol, rtol = TOLERANCE[module.spec.compute_dtype]
        assert all(err <= atol + rtol * scale for err, scale in errors.values()), (module.spec.name, errors)


def test_declared_shapes_and_dtypes(bundles):
    graphs = load_manifest(bundles["t2i-gqa-fp16"])["graphs"]
    shapes = {
        g: {t["name"]: (t["shape"], t["dtype"]) for t in graphs[g]["inputs"] + graphs[g]["outputs"]}
        for g in graphs
    }
    kv = [2, 2, 2]  # n_layer, CFG rows, kv heads
    assert shapes["target_prefill"] == {
        "cond": ([2, 3, 12], "float32"),
        "logits": ([2, 64], "float32"),
        "hidden": ([2, 32], "float16"),
        "new_k": ([*kv, 3, 8], "float16"),
        "new_v": ([*kv, 3, 8], "float16"),
    }
    assert shapes["target_step_1"] == {
        "tokens": ([1], "int64"),
        "positions": ([1], "int64"),
        "mask": ([1, 1, 1, 19 + 1], "bool"),
        "past_k": ([*kv, 19, 8], "float16"),
        "past_v": ([*kv, 19, 8], "float16"),
        "logits": ([2, 1, 64], "float32"),
        "hidden": ([2, 1, 32], "float16"),
        "new_k": ([*kv, 1, 8], "float16"),
        "new_v": ([*kv, 1, 8], "float16"),
    }
    assert shapes["vq_decode"] == {"codes": ([1, 16], "int64"), "images": ([1, 1, 8, 8], "float32")}


def test_manifest_describes_the_bundle(bundles):
    path = bundles["t2i-gqa-fp16"]
    manifest = load_manifest(path)
    assert manifest["format"] == "lantern-rt-bundle" and manifest["bundle_version"] == 1
    assert manifest["dtype"] == "fp16" and manifest["opset"] == 18
    assert set(manifest["versions"]) == {"lantern_rt", "torch", "onnx"}
    assert manifest["gpt"]["n_kv_head"] == 2 and manifest["vq"]["codebook_size"] == 64
    assert manifest["class_names"] == ["a", "b", "c", "d", "e"] and manifest["image_size"] == 8
    assert manifest["sampling_defaults"] == {"cfg_scale": 2.0}
    assert manifest["constants"]["cache_capacity"] == 19 and manifest["constants"]["step_sizes"] == [1]
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    null = np.load(path / manifest["constants"]["null_condition"]["file"])
    target = load_target(open_model_dir(path.parent / "t2i-gqa-fp16-model"))
    np.testing.assert_array_equal(null, target.null_condition.numpy())
    c2i = load_manifest(bundles["c2i-fp32"])
    assert c2i["constants"]["null_condition"] == {"class_id": 5}
    assert all(err < 1e-4 for g in c2i["graphs"].values() for err in g["max_abs_err"].values())


def tampered(bundles, tmp_path) -> Path:
    copy_ = tmp_path / "copy"
    shutil.copytree(bundles["c2i-fp32"], copy_)
    return copy_


def test_modified_graph_is_refused(bundles, tmp_path):
    path = tampered(bundles, tmp_path)
    data = bytearray((path / "target_step_1.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "target_step_1.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="target_step_1.onnx does not match its sha256"):
        load_manifest(path)


def test_edited_manifest_is_refused(bundles, tmp_path):
    path = tampered(bundles, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["graphs"]["target_step_26"]["outputs"][0]["shape"] = [2, 5, 64]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="target_step_26's inputs/outputs differ"):
        load_manifest(path)
    manifest["bundle_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="bundle version 99"):
        load_manifest(path)
    (path / "manifest.json").write_text("{")
    with pytest.raises(BundleError, match="not valid JSON"):
        load_manifest(path)
    (path / "manifest.json").unlink()
    with pytest.raises(BundleError, match="no manifest.json"):
        load_manifest(path)


def test_missing_file_is_refused(bundles, tmp_path):
    path = tampered(bundles, tmp_path)
    (path / "vq_decode.onnx").unlink()
    with pytest.raises(BundleError, match="vq_decode.onnx is missing"):
        load_manifest(path)


def test_failed_check_leaves_nothing_behind(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_module, "compare_with_torch", lambda *a, **k: {"logits": (1.0, 1.0)})
    out = tmp_path / "exports" / "bundle"
    with pytest.raises(ExportError, match=r"^target_prefill: output logits differs from torch by 1 "):
        export_bundle(open_model_dir(tiny_model_dir), out, threads=1)
    assert list(out.parent.iterdir()) == []


def test_bad_arguments_are_refused(tiny_model_dir, tmp_path):
    md = open_model_dir(tiny_model_dir)
    with pytest.raises(ExportError, match="dtype must be one of fp32, fp16"):
        export_bundle(md, tmp_path / "b", dtype="bf16")
    with pytest.raises(ExportError, match=r"opset must be in 17\.\.20"):
        export_bundle(md, tmp_path / "b", opset=21)
    with pytest.raises(ExportError, match="tree sizes must be integers >= 1"):
        export_bundle(md, tmp_path / "b", tree_sizes=[0])
    with pytest.raises(ExportError, match="already exists"):
        export_bundle(md, tmp_path, threads=1)


def lint(folder: Path, nodes, inputs, outputs, opset=18) -> list[str]:
    """check_graph on a hand-made one-op graph."""
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    path = folder / "lint.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    return check_graph(path)


def test_checks_catch_each_rule(tmp_path):
    io = helper.make_tensor_value_info
    softmax = [helper.make_node("Softmax", ["x"], ["y"])]
    fp32 = [io("x", TensorProto.FLOAT, [2, 3])], [io("y", TensorProto.FLOAT, [2, 3])]
    assert lint(tmp_path, softmax, *fp32) == []
    fp16 = [io("x", TensorProto.FLOAT16, [2, 3])], [io("y", TensorProto.FLOAT16, [2, 3])]
    assert lint(tmp_path, softmax, *fp16) == ["Softmax node y does not run in float32"]
    dynamic = [io("x", TensorProto.FLOAT, ["n", 3])], [io("y", TensorProto.FLOAT, ["n", 3])]
    assert lint(tmp_path, softmax, *dynamic) == [
        "x: dims ['n', 3] are not all static",
        "y: dims ['n', 3] are not all static",
    ]
    assert lint(tmp_path, softmax, *fp32, opset=21) == ["opset [21] is outside 17..20"]
    scatter = [helper.make_node("ScatterND", ["d", "i", "u"], ["o"], reduction="none")]
    inputs = [
        io("d", TensorProto.FLOAT, [4]),
        io("i", TensorProto.INT64, [1, 1]),
        io("u", TensorProto.FLOAT, [1]),
    ]
    assert lint(tmp_path, scatter, inputs, [io("o", TensorProto.FLOAT, [4])]) == [
        "ScatterND node o has a 'reduction' attribute"
    ]
