"""The bundle: graph rules, numerics against torch, the manifest, tamper and failure handling."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from lantern_rt.bundle import (
    BUNDLE_VERSION,
    MANIFEST,
    Bundle,
    BundleError,
    TreeEntry,
    draft_graph_name,
    verify_graph_name,
)
from lantern_rt.export import exporter
from lantern_rt.export.exporter import (
    Differences,
    ExportError,
    check_inputs,
    compare_with_torch,
    disagreement,
    export_bundle,
)
from lantern_rt.export.graphs import DrafterTree, TargetPrefill, TargetVerify, VQDecode
from lantern_rt.families.llamagen.conditions import null_caption
from lantern_rt.families.loading import (
    bundle_info,
    load_drafter,
    load_target,
    load_vq,
    open_bundle,
    open_model_dir,
)
from lantern_rt.fileio import sha256
from lantern_rt.graph_rules import check_graph
from lantern_rt.graph_spec import TensorSpec
from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.neighbors import latent_neighbors
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel
from lantern_rt.runtime.drafting import catch_up_rows, noise_rows
from lantern_rt.runtime.tree import ROOT_ONLY, build_tree, load_tree, tree_to_json
from tests.conftest import exported, randomize, tiny_gpt, tiny_vq, write_model_dir

T2I_GQA = {"model_type": "t2i", "cls_token_num": 3, "caption_dim": 12, "n_head": 4, "n_kv_head": 2}
# name -> (the tiny models' seed, model overrides, dtype, trees, with a drafter): between them
# every feature, fp32 and fp16, a bundle without drafter; tests/test_ort_speculative.py exports
# fp32 drafter graphs. c2i-fp32 is conftest's tiny model (tiny_model_dir's, seed 0): its graphs are
# those of a first run on openvino (standard, the default cache windows; tests/test_openvino.py),
# exported once a run.
BUNDLES = {
    "c2i-fp32": (0, {}, "fp32", ["mc_sim_7b_63"], False),
    "t2i-gqa-fp16": (3, T2I_GQA, "fp16", ["chain-1"], True),
}


def add_drafter(root: Path, drafter: Drafter) -> None:
    """Give the model directory ``root`` a drafter folder, as ``train-drafter`` writes one."""
    folder = root / "drafter"
    folder.mkdir()
    save_safetensors(drafter, folder / "drafter.safetensors")
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(drafter.config)))
    config = json.loads((root / "config.json").read_text())
    config["files"]["drafter"] = "drafter"
    (root / "config.json").write_text(json.dumps(config))


def make_bundle(
    path: Path,
    target: Transformer,
    vq: VQModel,
    drafter: Drafter | None,
    trees: list[str],
    dtype: str,
    **options: Any,
) -> Path:
    """Write the models as ``path``-model beside ``path`` and export them to ``path`` (with
    ``export_bundle``'s ``options``; once per run: :func:`tests.conftest.exported`)."""
    model = write_model_dir(path.with_name(f"{path.name}-model"), target, vq)
    if drafter is not None:
        add_drafter(model, drafter)
    return exported(open_model_dir(model), path, [load_tree(t) for t in trees], dtype=dtype, **options)


def shared_bundle(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """BUNDLES[name], exported once per test session."""
    path = tmp_path_factory.getbasetemp() / "bundles" / name
    if not path.is_dir():
        seed, overrides, dtype, trees, with_drafter = BUNDLES[name]
        target = tiny_gpt(seed, **overrides)
        drafter = randomize(Drafter(DrafterConfig.for_target(target.config), target.config), 4)
        make_bundle(path, target, tiny_vq(), drafter if with_drafter else None, trees, dtype)
    return path


def graph_names(trees: list[str], with_drafter: bool, prefix_slots: int = 1, windows: int = 2) -> set[str]:
    """The graphs a bundle of these trees holds: with a drafter a drafting and a verify graph per
    tree (and, over a longer prefix, its prefill); without one, a verify graph per chain (a
    Jacobi window); the target's steps per cache window (of ``windows`` exported, 1 or more)."""
    names = {"target_prefill", "vq_decode"}
    if with_drafter and prefix_slots > 1:
        names.add("drafter_prefill")
    verified = [i for i, t in enumerate(trees) if with_drafter or t.startswith("chain-")]
    steps = ["target_ar_step", *(verify_graph_name(i) for i in verified)]
    # the tiny models' caches (17 or 19 slots) have one window below the whole cache: 16 slots
    suffixes = ("", "_w16") if windows > 1 else ("",)
    return (
        names
        | {name + suffix for name in steps for suffix in suffixes}
        | {draft_graph_name(i) for i in verified if with_drafter}
    )


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    return {name: shared_bundle(tmp_path_factory, name) for name in BUNDLES}


@pytest.fixture(scope="module")
def opened(bundles) -> dict[str, Bundle]:
    """Each of BUNDLES opened (and so verified) once."""
    return {name: Bundle.open(path) for name, path in bundles.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLES)
def test_every_graph_passes_the_checks(opened, name):
    bundle = opened[name]
    _, overrides, _, trees, with_drafter = BUNDLES[name]
    assert set(bundle.graphs) == graph_names(trees, with_drafter, overrides.get("cls_token_num", 1))
    for entry in bundle.graphs.values():
        assert check_graph(bundle.file(entry)) == []


def test_graph_shapes_follow_the_trees():
    """Verify graphs of N + 1 tokens per image that keep max_depth + 1, for a batch of B images in
    2B CFG rows; a drafting graph per tree whose catch-up takes max_depth + 1 rows and whose
    noise has a row per node that draws (every node above the last level)."""
    trees = [load_tree("naive_extend_57"), load_tree("chain-5")]  # levels 5/13/16/14/9; 1/1/1/1/1
    specs = [TargetVerify(tiny_gpt(0), t, 3, "v", batch=b).spec for t, b in zip(trees, (1, 4), strict=True)]
    assert [sp.name for sp in specs] == ["v", "v_b4"]
    shapes = [(sp.inputs[0].shape, sp.outputs[1].shape, sp.outputs[3].shape[:2]) for sp in specs]
    assert shapes == [((1, 58), (1, 6), (2, 6)), ((4, 6), (4, 6), (8, 6))]
    assert [(catch_up_rows(t), noise_rows(t)) for t in trees] == [(6, 1 + 5 + 13 + 16 + 14), (6, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLES)
def test_every_graph_matches_torch(bundles, opened, name):
    _, _, dtype, trees, with_drafter = BUNDLES[name]
    md = open_model_dir(bundles[name].parent / f"{name}-model")
    target, vq = load_target(md), load_vq(md)
    low = target if dtype == "fp32" else copy.deepcopy(target).half()
    decode = VQDecode(vq, target.config)
    pairs = [(TargetPrefill(low), TargetPrefill(target)), (decode, decode)]
    loaded = [load_tree(t) for t in trees]
    for name_w, window in (("target_ar_step", None), ("target_ar_step_w16", 16)):
        pairs.append(
            (
                TargetVerify(low, ROOT_ONLY, 1, name_w, window=window),
                TargetVerify(target, ROOT_ONLY, 1, name_w, window=window),
            )
        )
    if with_drafter:
        k = opened[name].constants.neighbors_k
        pairs += [
            (
                TargetVerify(low, tree, k, verify_graph_name(i)),
                TargetVerify(target, tree, k, verify_graph_name(i)),
            )
            for i, tree in enumerate(loaded)
        ]
        drafter = load_drafter(md)
        low_drafter = drafter if dtype == "fp32" else copy.deepcopy(drafter).half()
        cap, pairs_p = opened[name].constants.drafter_capacity, opened[name].constants.cls_token_num - 1
        pairs += [
            (
                DrafterTree(low_drafter, low.output, tree, cap, draft_graph_name(i), 1, pairs_p),
                DrafterTree(drafter, target.output, tree, cap, draft_graph_name(i), 1, pairs_p),
            )
            for i, tree in enumerate(loaded)
        ]
    for module, reference in pairs:
        path = bundles[name] / f"{module.spec.name}.onnx"
        seeds = range(11, 11 + check_inputs(module.spec))
        differences = compare_with_torch(path, module, reference, threads=1, seeds=seeds)
        assert not [n for n, d in differences.items() if disagreement(module.spec, d)], differences


@pytest.mark.slow
def test_declared_shapes_and_dtypes(opened):
    graphs = opened["t2i-gqa-fp16"].graphs
    assert all(entry.name == g and entry.file == f"{g}.onnx" for g, entry in graphs.items())
    shapes = {
        g: {t.name: (list(t.shape), t.dtype) for t in entry.inputs + entry.outputs}
        for g, entry in graphs.items()
    }
    kv = [2, 2, 2]  # n_layer, CFG rows, kv heads
    assert shapes["target_prefill"] == {
        "cond": ([2, 3, 12], "float32"),
        "prefix": ([2, 3], "bool"),
        "logits": ([2, 64], "float32"),
        "hidden": ([2, 3, 32], "float16"),
        "new_k": ([*kv, 3, 8], "float16"),
        "new_v": ([*kv, 3, 8], "float16"),
    }
    settings = {
        "cfg_scale": ([1], "float32"),
        "temperature": ([1], "float32"),
        "top_k": ([1], "int64"),
        "top_p": ([1], "float32"),
    }
    relax = {
        "k": ([1], "int64"),
        "cap_a": ([1], "float32"),
        "cap_b": ([1], "float32"),
        "greedy": ([1], "bool"),
    }
    assert shapes["target_ar_step"] == {
        "node_tokens": ([1, 1], "int64"),
        "cache_length": ([1], "int64"),
        "prefix": ([2, 3], "bool"),
        "valid": ([1, 1], "bool"),
        "q": ([1, 1, 64], "float32"),
        "noise": ([1, 1], "float32"),
        "bonus_noise": ([1, 64], "float32"),
        **settings,
        "neighbors": ([64, 1], "int64"),
        **relax,
        **{f"past_{kv_}_{i}": ([2, 2, 19, 8], "float16") for kv_ in "kv" for i in range(2)},
        "length": ([1], "int64"),
        "kept": ([1, 1], "int64"),
        "tokens": ([1, 1], "int64"),
        "hidden": ([2, 1, 32], "float16"),
        "new_k": ([*kv, 1, 8], "float16"),
        "new_v": ([*kv, 1, 8], "float16"),
        "logits": ([2, 1, 64], "float32"),
        "probs": ([1, 1, 64], "float32"),
    }
    verify = shapes["target_verify_0"]  # chain-1: two nodes, both kept at most
    assert verify["node_tokens"] == ([1, 2], "int64") and verify["neighbors"][0][0] == 64
    assert verify["kept"] == ([1, 2], "int64") and verify["new_k"] == ([*kv, 2, 8], "float16")
    assert shapes["vq_decode"] == {"codes": ([1, 16], "int64"), "images": ([1, 1, 8, 8], "float32")}
    drafter_kv = [1, 2, 2]  # one drafter layer, CFG rows, kv heads
    assert shapes["draft_tree_0"] == {  # chain-1: two catch-up rows, one drawing node
        "tokens": ([1, 2], "int64"),
        "hidden": ([2, 2, 32], "float16"),
        "count": ([1], "int64"),
        "root_position": ([1], "int64"),
        "cache_length": ([1], "int64"),
        "prefix": ([2, 2], "bool"),  # the caption's prefix pairs (all visible for LlamaGen)
        "noise": ([1, 1, 64], "float32"),
        "cfg_scale": ([1], "float32"),
        "temperature": ([1], "float32"),
        "top_k": ([1], "int64"),
        "top_p": ([1], "float32"),
        "past_k_0": ([2, 2, 18, 8], "float16"),  # the caption's first 2 pairs, 16 image tokens
        "past_v_0": ([2, 2, 18, 8], "float16"),
        "node_tokens": ([1, 2], "int64"),
        "valid": ([1, 2], "bool"),
        "q": ([1, 2, 64], "float32"),
        "new_k": ([*drafter_kv, 2, 8], "float16"),
        "new_v": ([*drafter_kv, 2, 8], "float16"),
    }
    assert shapes["drafter_prefill"] == {
        "hidden": ([2, 2, 32], "float16"),
        "new_k": ([*drafter_kv, 2, 8], "float16"),
        "new_v": ([*drafter_kv, 2, 8], "float16"),
    }
    raw = opened["t2i-gqa-fp16"].manifest()["graphs"]
    for g, entry in graphs.items():  # the typed specs are the manifest's JSON
        assert [t.to_json() for t in entry.inputs] == raw[g]["inputs"], g
        assert [t.to_json() for t in entry.outputs] == raw[g]["outputs"], g
    assert graphs["vq_decode"].input("codes") == TensorSpec("codes", (1, 16), "int64")


@pytest.mark.slow
def test_manifest_describes_the_bundle(bundles, opened):
    path, bundle = bundles["t2i-gqa-fp16"], opened["t2i-gqa-fp16"]
    manifest = bundle.manifest()
    assert manifest == json.loads((path / MANIFEST).read_text())
    assert bundle.manifest_sha256 == sha256(path / MANIFEST) and bundle.path == path.resolve()
    assert manifest["format"] == "lantern-rt-bundle" and manifest["bundle_version"] == BUNDLE_VERSION == 16
    assert bundle.format_version == BUNDLE_VERSION
    assert bundle.dtype == "fp16" and bundle.opset == 18
    assert set(bundle.versions) == {"lantern_rt", "torch", "onnx"}
    assert bundle.gpt.n_kv_head == 2 and bundle_info(bundle).vq.codebook_size == 64
    assert bundle.family == manifest["family"] == "llamagen" and bundle_info(bundle).family == "llamagen"
    assert bundle.class_names == ["a", "b", "c", "d", "e"] and bundle.image_size == 8
    assert bundle.sampling_defaults == {"cfg_scale": 2.0}
    constants = bundle.constants
    assert constants.cache_capacity == 19 and constants.guided and manifest["constants"]["guided"] is True
    assert constants.cache_scratch == constants.drafter_scratch == 0  # the graphs return their K/V
    assert constants.drafter and constants.drafter_capacity == 18 and constants.max_draft_width == 10
    assert bundle.has_drafter
    chain = {**tree_to_json(load_tree("chain-1")), "graph": "draft_tree_0", "verify": "target_verify_0"}
    assert manifest["trees"] == {"chain-1": chain}
    paths = tuple(map(tuple, tree_to_json(load_tree("chain-1"))["paths"]))
    assert bundle.trees == {"chain-1": TreeEntry("chain-1", paths, "draft_tree_0", "target_verify_0")}
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(bundle.files) == on_disk
    assert constants.null_condition == {"file": "null_caption.npy"}
    null = np.load(path / "null_caption.npy")
    target = load_target(open_model_dir(path.parent / "t2i-gqa-fp16-model"))
    np.testing.assert_array_equal(null, target.null_condition.numpy())
    np.testing.assert_array_equal(null_caption(bundle), null)
    manifest["constants"]["vocab_size"] = 0  # a copy: the bundle keeps its own
    assert bundle.manifest()["constants"]["vocab_size"] == bundle.constants.vocab_size == 64
    c2i = opened["c2i-fp32"]
    assert c2i.manifest()["constants"]["null_condition"] == {"class_id": 5}
    assert c2i.constants.null_condition == {"class_id": 5}
    assert not c2i.constants.drafter and not c2i.has_drafter and c2i.trees["mc_sim_7b_63"].graph is None
    graphs = c2i.manifest()["graphs"]
    assert all(err < 1e-4 for g in graphs.values() for err in g["max_abs_err"].values())


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLES)
def test_neighbour_table_is_the_codebook_s(bundles, opened, name):
    """Every other code, nearest first, stored as uint16 (k = min(1000, V - 1)); read as int64."""
    constants = opened[name].constants
    assert (constants.neighbors_file, constants.neighbors_k) == ("neighbors.npy", 63)
    assert opened[name].manifest()["constants"]["neighbors"] == {"file": "neighbors.npy", "k": 63}
    table = np.load(bundles[name] / "neighbors.npy")
    assert table.dtype == np.uint16
    vq = load_vq(open_model_dir(bundles[name].parent / f"{name}-model"))
    np.testing.assert_array_equal(table, latent_neighbors(vq.quantize.codebook(), 63).numpy())
    full, first = opened[name].neighbors(), opened[name].neighbors(10)
    assert full.dtype == first.dtype == torch.int64 and full.shape == (64, 63) and first.shape == (64, 10)
    np.testing.assert_array_equal(full.numpy(), table)
    assert torch.equal(first, full[:, :10])
    with pytest.raises(BundleError, match="stores 63 neighbours per code, fewer than k=64"):
        opened[name].neighbors(64)


def tampered(bundles, tmp_path) -> Path:
    copy_ = tmp_path / "copy"
    shutil.copytree(bundles["c2i-fp32"], copy_)
    return copy_


def edit_manifest(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    """Apply ``edit`` to the bundle's manifest.json in place (its sha256 is nowhere recorded)."""
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
def test_an_untouched_copy_opens(bundles, tmp_path):
    """The copy the tamper tests break is a valid bundle before they break it."""
    bundle = Bundle.open(tampered(bundles, tmp_path))
    assert bundle.path == (tmp_path / "copy").resolve() and set(bundle.graphs) == set(
        bundle.manifest()["graphs"]
    )


@pytest.mark.slow
def test_modified_graph_is_refused(bundles, tmp_path):
    path = tampered(bundles, tmp_path)
    data = bytearray((path / "target_ar_step.onnx").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "target_ar_step.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match="target_ar_step.onnx does not match its sha256"):
        Bundle.open(path)


@pytest.mark.slow
def test_edited_manifest_is_refused(bundles, tmp_path):
    path = tampered(bundles, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["graphs"]["target_ar_step"]["outputs"][6]["shape"] = [2, 5, 64]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="target_ar_step's inputs/outputs differ"):
        Bundle.open(path)
    manifest["bundle_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=rf"^{re.escape(str(path.resolve()))} is bundle version 99"):
        Bundle.open(path)
    (path / "manifest.json").write_text("{")
    with pytest.raises(BundleError, match=rf"^{re.escape(str(path.resolve() / MANIFEST))} is not valid JSON"):
        Bundle.open(path)
    (path / "manifest.json").unlink()
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.open(path)


@pytest.mark.slow
def test_missing_file_is_refused(bundles, tmp_path):
    path = tampered(bundles, tmp_path)
    (path / "vq_decode.onnx").unlink()
    with pytest.raises(BundleError, match="vq_decode.onnx is missing"):
        Bundle.open(path)


def _set(keys: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        obj = manifest
        for key in keys[:-1]:
            obj = obj[key]
        obj[keys[-1]] = value

    return edit


# a manifest field of the wrong type or value -> what BundleError says (after the bundle's path)
SCHEMA_ERRORS = {
    "vocab_size-a-string": (
        ("constants", "vocab_size"),
        "64",
        r"constants\.vocab_size must be an integer, got '64'",
    ),
    "int-a-bool": (
        ("constants", "cls_token_num"),
        True,
        r"constants\.cls_token_num must be an integer, got True",
    ),
    "inputs-not-a-list": (
        ("graphs", "target_prefill", "inputs"),
        {"name": "cond"},
        r"graphs\.target_prefill\.inputs must be a list",
    ),
    "tree-names-a-missing-graph": (
        ("trees", "mc_sim_7b_63", "graph"),
        "draft_tree_9",
        r"the bundle lacks its draft_tree_9 graph",
    ),
    "dtype-int4": (("dtype",), "int4", r"dtype 'int4' is none of fp32, fp16, int8"),
    "gpt-field-a-string": (("gpt", "n_layer"), "2", r"GPTConfig\.n_layer must be int, got '2'"),
    "vq-field-a-float": (
        ("vq", "encoder_ch_mult"),
        [1, 1.5],
        r"VQConfig\.encoder_ch_mult must be list\[int\], got \[1, 1\.5\]",
    ),
    "family-unknown": (("family",), "gemma", r"family must be one of 'llamagen', 'chameleon', got 'gemma'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("keys, value, message", SCHEMA_ERRORS.values(), ids=SCHEMA_ERRORS)
def test_manifest_schema_is_checked(bundles, tmp_path, keys, value, message):
    path = tampered(bundles, tmp_path)
    edit_manifest(path, _set(keys, value))
    with pytest.raises(BundleError, match=rf"^{re.escape(str(path.resolve()))}: {message}"):
        open_bundle(path)


@pytest.mark.slow
def test_graph_file_that_is_not_onnx_is_refused(bundles, tmp_path):
    """A listed file with the right sha256 that onnx cannot parse: BundleError, not onnx's own."""
    path = tampered(bundles, tmp_path)
    (path / "target_ar_step.onnx").write_bytes(b"not an onnx graph")
    edit_manifest(
        path, lambda m: m["files"].update({"target_ar_step.onnx": sha256(path / "target_ar_step.onnx")})
    )
    with pytest.raises(BundleError, match=r"target_ar_step\.onnx is not a readable ONNX graph"):
        Bundle.open(path)


@pytest.mark.slow
def test_inspect_prints_the_manifest_and_refuses_a_tampered_bundle(bundles, opened, tmp_path):
    from click.testing import CliRunner

    from lantern_rt.cli import main

    result = CliRunner().invoke(main, ["inspect", str(bundles["t2i-gqa-fp16"])])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert f"(format lantern-rt-bundle v{BUNDLE_VERSION})" in lines[0]
    assert "tree     chain-1: 1 nodes, drafted by draft_tree_0, verified by target_verify_0" in lines
    path = bundles["t2i-gqa-fp16"]
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    count = sum(1 for f in path.iterdir() if f.is_file())
    assert f"size     {size / 2**20:.1f} MiB on disk in {count} files (TensorRT plans not counted)" in lines
    prefixes = ("target_", "draft_", "drafter_", "vq_")
    rows = {tuple(line.split(maxsplit=4)) for line in lines if line.startswith(prefixes)}
    assert ("draft_tree_0", "in", "noise", "float32", "[1, 1, 64]") in rows
    assert "batches  1 image(s) per call, 2 CFG rows per image" in lines
    assert ("target_ar_step", "out", "hidden", "float16", "[2, 1, 32]") in rows
    graphs = opened["t2i-gqa-fp16"].graphs
    assert len(rows) == sum(len(g.inputs) + len(g.outputs) for g in graphs.values())
    result = CliRunner().invoke(main, ["inspect", str(bundles["t2i-gqa-fp16"]), "--graph", "nope"])
    assert result.exit_code == 2 and result.output.startswith(
        f"error: {bundles['t2i-gqa-fp16'].resolve()} has no graph 'nope'; it has "
    )
    path = tampered(bundles, tmp_path)
    (path / "vq_decode.onnx").unlink()
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert (
        result.exit_code == 2
        and result.output.count("\n") == 1
        and "vq_decode.onnx is missing" in result.output
    )


def test_failed_check_leaves_nothing_behind(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(
        exporter, "compare_with_torch", lambda *a, **k: {"logits": Differences(1.0, 1.0, 1.0)}
    )
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
    with pytest.raises(ExportError, match="trees must be StaticTrees with at least one node"):
        export_bundle(md, tmp_path / "b", trees=[ROOT_ONLY])
    with pytest.raises(ExportError, match="drafts 11 children per node; at most 10"):
        export_bundle(md, tmp_path / "b", trees=[build_tree([[i] for i in range(11)], name="wide")])
    with pytest.raises(ExportError, match="two different trees are named chain-2"):
        export_bundle(md, tmp_path / "b", trees=[load_tree("chain-2"), build_tree([[0]], name="chain-2")])
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
    # the same rules hold inside an If's branches (the drafting graphs' filter is one)
    branch = helper.make_graph(scatter, "then", [], [io("o", TensorProto.FLOAT, [4])])
    plain = helper.make_graph(
        [helper.make_node("Identity", ["d"], ["e"])], "else", [], [io("e", TensorProto.FLOAT, [4])]
    )
    cond = [helper.make_node("If", ["c"], ["o"], then_branch=branch, else_branch=plain)]
    inputs.append(io("c", TensorProto.BOOL, []))
    assert lint(tmp_path, cond, inputs, [io("o", TensorProto.FLOAT, [4])]) == [
        "ScatterND node o has a 'reduction' attribute"
    ]
