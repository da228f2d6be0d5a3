"""``lantern info`` and the memory plan (lantern_rt/memory_plan.py, lantern_rt/plan_sizes.py): the
predicted plan sizes against plans TensorRT for RTX really builds for the demo, the plan from a
model's configuration against the bundle it exports, the published models' shapes, the fit table
of docs/jetson.md, the JSON and one-line errors of the command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.devices import DEVICES, device_named, device_table
from lantern_rt.memory_plan import (
    PRECISIONS,
    ExportLayout,
    Weight,
    bundle_plan,
    graph_shapes,
    model_plan,
    stored_bytes,
)
from lantern_rt.models.model_dir import DEMO_DIR
from lantern_rt.plan_sizes import kernels
from lantern_rt.reference_models import REFERENCE_MODELS, fit_table

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.05  # issue 59: `lantern info`'s plan sizes within 5% of the built plans for the demo


def info(*args: str):
    return CliRunner().invoke(main, ["info", *args])


def test_stored_bytes_per_precision():
    """A product weight [in 256, out 64] and a norm's 64: fp32/fp16 whole; Q/DQ int8 one byte a
    weight plus an fp32 scale and an int8 zero point per output; weight-only one scale (fp16)
    per block of 128 inputs per output."""
    weights = [Weight(256 * 64, (256, 64)), Weight(64)]
    assert stored_bytes(weights, PRECISIONS["fp32"]) == 4 * (256 * 64 + 64)
    assert stored_bytes(weights, PRECISIONS["fp16"]) == 2 * (256 * 64 + 64)
    assert stored_bytes(weights, PRECISIONS["int8"]) == 256 * 64 + 64 * 5 + 4 * 64
    assert stored_bytes(weights, PRECISIONS["w8a16"]) == 256 * 64 + 64 * 2 * 2 + 2 * 64
    assert stored_bytes(weights, PRECISIONS["w4a16"]) == 256 * 64 // 2 + 64 * 2 * 2 + 2 * 64


def test_target_kernels_grow_per_layer():
    """The kernel table: a layer adds the same kernels (two or more) to every graph of a kind; a
    step graph over a window of the cache has two more, a verify graph four fewer (as built)."""
    for kind in ("prefill", "step", "verify"):
        for precision in ("fp32", "fp16", "int8", "w8a16", "w4a16"):
            counts = [kernels(kind, precision, layers) for layers in (2, 6, 10)]
            assert abs((counts[2] - counts[1]) - (counts[1] - counts[0])) <= 1  # rounding
            assert counts[1] - counts[0] >= 8
    assert kernels("step", "fp16", 6, full_window=False) == kernels("step", "fp16", 6) + 2
    assert kernels("verify", "fp16", 6, full_window=False) == kernels("verify", "fp16", 6) - 4


def test_the_export_rules_restated_are_the_exporter_s():
    """The plan restates two of the exporter's rules (only the command line imports export/):
    the neighbours a bundle keeps per code, and which trees get a verify graph."""
    from lantern_rt.export import exporter
    from lantern_rt.memory_plan import EXPORT_NEIGHBORS_K, ModelShape, model_layout
    from lantern_rt.runtime.tree import load_tree

    assert EXPORT_NEIGHBORS_K == exporter.NEIGHBORS_K
    names = ("chain-5", "naive_extend_57", "pac-2-2-7", "mc_sim_7b_63")
    base = REFERENCE_MODELS["llamagen-b"]()
    for layers in (0, 1):
        model = ModelShape(base.name, base.family, base.gpt, base.vq, base.image_size, layers)
        layout = model_layout(model, names, [1], 1)
        verified = [t.verify is not None for t in layout.trees]
        assert verified == [exporter.verified(load_tree(n), layers > 0) for n in names]


@pytest.mark.parametrize(
    ("name", "params"),
    [("llamagen-b", 111e6), ("llamagen-l", 343e6), ("llamagen-xl", 775e6), ("llamagen-xxl", 1.4e9)],
)
def test_llamagen_sizes_are_the_published_ones(name, params):
    """LlamaGen's c2i models: 111M, 343M, 775M and 1.4B parameters (its paper's Table 2)."""
    plan = model_plan(REFERENCE_MODELS[name](), _layout(), "published shapes", name, ["fp16"])
    assert plan.parameters["target"] == pytest.approx(params, rel=0.02)


def test_a_chameleon_7b_plan():
    """Anole-7B in the runtime's layout: 32 layers of 4096 (6.48B), the image head and image rows
    (8192 x 4096 each) and the 65536-word prompt table; its fp16 KV cache holds 2 rows x 32
    layers x (K, V) x 4096 x 1088 slots per image; at fp16 it fits none of the 8 and 16 GB boards."""
    model = REFERENCE_MODELS["anole-7b"]()
    c = model.gpt
    assert (c.dim, c.n_layer, c.n_head, c.ffn_hidden, c.vocab_size, c.text_vocab_size) == (
        4096,
        32,
        32,
        11008,
        8192,
        65536,
    )
    layout = ExportLayout((1,), 1088, (1088,), 64, 1087, True, (), False, False)
    plan = model_plan(model, layout, "published shapes", "anole-7b", ["fp16", "w4a16"])
    assert plan.parameters["target"] == pytest.approx(6.48e9 + 2 * 8192 * 4096 + 65536 * 4096, rel=0.01)
    assert plan.precisions["fp16"].kv[1][0] == 2 * 32 * 2 * 4096 * 1088 * 2
    assert not plan.fits(device_named("orin-nx-16gb"), "fp16", 1)
    assert plan.weights["w4a16"] < plan.weights["fp16"] / 3


def _layout() -> ExportLayout:
    return ExportLayout((1,), 257, (257,), 1, 256, True, (), False, False)


def test_the_tables_of_docs_jetson_are_the_generated_ones():
    """docs/jetson.md holds device_table()'s and fit_table()'s rows as they are: regenerate them
    when the devices or the plan change."""
    text = (ROOT / "docs" / "jetson.md").read_text()
    missing = [line for line in [*device_table(), *fit_table()] if line not in text]
    assert not missing, f"docs/jetson.md's tables are stale; first differing row: {missing[0]}"


def test_info_json_of_a_published_model_parses():
    r = info("llamagen-b", "--json", "--precision", "fp16", "--precision", "w4a16", "--batch-size", "1,4")
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert set(body["precisions"]) == {"fp16", "w4a16"}
    assert body["export"]["trees"] == ["naive_extend_57"] and body["export"]["batch_sizes"] == [1, 4]
    assert [d["key"] for d in body["devices"]] == [d.key for d in DEVICES]
    fp16 = body["precisions"]["fp16"]
    assert fp16["need"]["4"] > fp16["need"]["1"] > 0
    assert body["devices"][0]["fits"]["w4a16"]["1"] is True


def test_info_text_of_the_demo_model_directory():
    r = info(str(DEMO_DIR), "--device", "orin-nano-8gb", "--cache-windows", "1")
    assert r.exit_code == 0, r.output
    assert "fashion-mnist-demo: model directory" in r.stdout
    assert "Jetson Orin Nano 8 GB" in r.stdout and "Jetson AGX Orin" not in r.stdout
    assert "NVIDIA Jetson Orin Nano Series data sheet" in r.stdout  # --device: the source of its memory


def _tiny_bundle(tmp_path_factory, tmp_path) -> Path:
    from tests.test_export import shared_bundle

    return shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), tmp_path / "bundle")


BAD = {
    "no such path": (lambda tmp: [str(tmp / "nope")], "is not a bundle"),
    "a file": (lambda tmp: [str(_touch(tmp / "x.json"))], "is not a bundle"),
    "an empty folder": (lambda tmp: [str(tmp)], "is not a bundle"),
    "unknown device": (lambda tmp: ["llamagen-b", "--device", "jetson-nano"], "unknown device 'jetson-nano'"),
    "unknown precision": (lambda tmp: ["llamagen-b", "--precision", "fp8"], "unknown precision 'fp8'"),
    "bad batch size": (lambda tmp: ["llamagen-b", "--batch-size", "0"], "batch sizes must be"),
    "bad cache windows": (lambda tmp: ["llamagen-b", "--cache-windows", "0"], "--cache-windows"),
    "unknown tree": (lambda tmp: ["llamagen-b", "--tree", "oak"], "oak"),
    "broken manifest": (lambda tmp: [str(_broken_bundle(tmp))], "not valid JSON"),
    "model options on a bundle": (lambda tmp: [str(_broken_bundle(tmp)), "--tree", "chain-3"], "--tree"),
}


def _touch(path: Path) -> Path:
    path.write_text("{}")
    return path


def _broken_bundle(tmp: Path) -> Path:
    (tmp / "manifest.json").write_text("{")
    return tmp


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2(case, tmp_path):
    args, message = BAD[case]
    r = info(*args(tmp_path))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


@pytest.mark.slow  # a tiny bundle's plans built by TensorRT for RTX (a few seconds; the export is shared)
def test_info_reads_the_plans_built_beside_a_bundle(tmp_path_factory, tmp_path):
    pytest.importorskip(
        "tensorrt_rtx_bindings", reason="TensorRT for RTX is not installed (the trt-rtx extra)"
    )
    from lantern_rt.engines.plans import build_engines
    from lantern_rt.families.loading import open_bundle

    bundle = open_bundle(_tiny_bundle(tmp_path_factory, tmp_path))
    folder = build_engines(bundle, flavour="trt-rtx", capabilities=["8.9"])
    r = info(str(bundle.path), "--json")
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert body["source"]["built_from"] == folder.name
    graphs = body["precisions"]["fp32"]["graphs"]
    assert {g["name"] for g in graphs} == set(bundle.graphs)
    for g in graphs:
        assert g["built"] == (folder / f"{g['name']}.plan").stat().st_size
    assert "built: engines/" in info(str(bundle.path)).stdout


@pytest.mark.slow  # the demo's bundles and their plans, made once per run (tests/trt_rtx_cases.py)
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "w4a16", "w8a16"])
def test_predicted_plans_are_within_5_percent_of_the_built_ones(precision, tmp_path):
    """Every graph of the demo's bundle (chain-5, naive_extend_57, pac-2-2-7; the target's steps,
    drafting, verify and VQ graphs) built by TensorRT for RTX: the predicted plan is within 5%
    of the built one, and so is the bundle's sum."""
    pytest.importorskip(
        "tensorrt_rtx_bindings", reason="TensorRT for RTX is not installed (the trt-rtx extra)"
    )
    from lantern_rt.bundle import Bundle
    from tests.trt_rtx_cases import assert_every_graph_builds, demo_bundle

    bundle = Bundle.open(demo_bundle(tmp_path / "bundle", precision))
    built = {row["graph"]: row["bytes"] for row in assert_every_graph_builds(bundle)}
    plan = bundle_plan(bundle).precisions[precision]
    errors = {g.shape.name: g.predicted / built[g.shape.name] - 1 for g in plan.graphs}
    assert set(errors) == set(built)
    worst = max(errors, key=lambda name: abs(errors[name]))
    assert abs(errors[worst]) <= TOLERANCE, f"{worst}: predicted {errors[worst]:+.1%} off the built plan"
    total = sum(g.predicted for g in plan.graphs) / sum(built.values()) - 1
    assert abs(total) <= TOLERANCE / 2, f"the bundle's plans: predicted {total:+.1%} off"


@pytest.mark.slow  # the demo's fp16 bundle, made once per run (tests/trt_rtx_cases.py)
def test_a_model_directory_plans_the_bundle_it_exports(tmp_path):
    """The demo's configuration alone gives the graphs its export holds, its KV caches exactly,
    and each graph's weights but its constants, which do not grow with the model (RoPE's tables,
    a tree's masks and index tables: 0.4 MB in naive_extend_57's verify graph)."""
    from lantern_rt.bundle import Bundle
    from lantern_rt.memory_plan import dir_model, model_layout
    from tests.trt_rtx_cases import DEMO_TREES, demo_bundle

    bundle = Bundle.open(demo_bundle(tmp_path / "bundle", "fp16"))
    from_bundle = bundle_plan(bundle)
    model = dir_model(DEMO_DIR)
    layout = model_layout(model, DEMO_TREES, [1], 1)
    names = [g.name for g in graph_shapes(layout)]
    assert names == [g.name for g in graph_shapes(from_bundle.layout)] and set(names) == set(bundle.graphs)
    from_config = model_plan(model, layout, "model directory", str(DEMO_DIR), ["fp16"]).precisions["fp16"]
    measured = from_bundle.precisions["fp16"]
    assert from_config.kv == measured.kv and from_config.neighbours == measured.neighbours
    for counted, read in zip(from_config.graphs, measured.graphs, strict=True):
        assert 0 <= read.weights - counted.weights < 2**19, counted.shape.name
