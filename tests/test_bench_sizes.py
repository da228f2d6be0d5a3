"""``lantern bench --size`` and each row's memory floor (lantern_rt/eval/memory_floor.py): the
floor's formula on models and graphs of known sizes, the copy loop's output, the options."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from lantern_rt.cli import main
from lantern_rt.eval import bench
from lantern_rt.eval.memory_floor import (
    Bandwidth,
    StepBytes,
    copy_bandwidth,
    floor_fields,
    graph_weight_bytes,
    last_level_cache_bytes,
    module_bytes,
    torch_step_bytes,
)
from lantern_rt.eval.report import speed_table
from lantern_rt.models.drafter import Drafter, DrafterConfig
from tests.conftest import tiny_gpt, tiny_vq
from tests.test_bench import model_with_drafter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_with_drafter(tmp_path_factory.mktemp("sizes") / "tiny", tiny_vq())


# --- the formula ---------------------------------------------------------------------------


def test_torch_step_bytes_of_a_tiny_model_with_known_sizes():
    """dim 32, 2 layers of FFN width 96, vocabulary 64, 2 heads of 16, a 1-slot prefix, 16 tokens."""
    model = tiny_gpt()
    layer = 32 * 96 + 32 * 32 + 32 * 2 * 96 + 96 * 32 + 2 * 32  # wqkv, wo, w13, w2, two norms
    weights = (2 * layer + 32 + 64 * 32) * 4  # layers, final norm, output head; no embeddings
    step = torch_step_bytes(model)
    assert step == StepBytes("fp32", weights, 0, 2 * 2 * 2 * 16 * 4, 1 + 16 / 2)
    drafter = Drafter(DrafterConfig.for_target(model.config), model.config)
    embedding = drafter.embed_tokens.weight.numel() * 4
    counted = sum(p.numel() * 4 for p in drafter.parameters()) - embedding
    assert module_bytes([drafter]) == counted
    assert torch_step_bytes(model, (drafter, model.output)).draft_weights == counted + 64 * 32 * 4
    assert module_bytes([model.output, model.output, model]) == weights  # once each, no embeddings


def test_floor_fields_follow_the_formula():
    step = StepBytes("int8", target_weights=1000, draft_weights=300, kv_entry=10, mean_entries=9.0)
    row = {"num_images": 4, "verify_calls": 60, "batch_size": 2, "seconds_per_image": 0.5}
    fields = floor_fields(step, row, 2, 1e4)
    # per image: 15 verify calls + the prefill, 15 drafting calls, weights shared by B = 2
    streamed = (1000 * 16 + 300 * 15) / 2 + 10 * 2 * 9.0 * 16
    assert fields == {
        "weight_precision": "int8",
        "floor_bytes_per_image": streamed,
        "floor_seconds_per_image": streamed / 1e4,
        "measured_over_floor": 0.5 / (streamed / 1e4),
    }
    assert set(floor_fields(None, row, 2, 1e4).values()) == {None}


def _external(name: str, array: np.ndarray, location: str, offset: int) -> TensorProto:
    tensor = numpy_helper.from_array(array, name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def test_graph_weight_bytes_count_stored_bytes_per_reader_and_skip_gathered_tables(tmp_path):
    """fp32, fp16 and Q/DQ int8 weights at their stored sizes, once per reading node (a target
    call) or once each (a drafting call: two initializers naming the same bytes of the weights
    file once); a table only Gather reads, and an unread initializer, left out."""
    w = np.ones((4, 8), np.float32)
    (tmp_path / "weights.bin").write_bytes(w.tobytes())
    inits = [
        numpy_helper.from_array(np.ones((10, 4), np.float32), "table"),  # gathered: not counted
        _external("w", w, "weights.bin", 0),  # 128 bytes
        _external("w_again", w, "weights.bin", 0),  # the same bytes
        numpy_helper.from_array(np.ones((4, 8), np.float16), "w16"),  # 64, read twice
        numpy_helper.from_array(np.ones((4, 8), np.float32), "unread"),
        numpy_helper.from_array(np.ones((4, 8), np.int8), "q"),  # 32
        numpy_helper.from_array(np.ones(8, np.float32), "scale"),  # 32
        numpy_helper.from_array(np.zeros(8, np.int8), "zero"),  # 8
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"]),
        helper.make_node("MatMul", ["e", "w"], ["y1"]),
        helper.make_node("MatMul", ["e", "w_again"], ["y2"]),
        helper.make_node("Cast", ["e"], ["e16"], to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["e16", "w16"], ["y3"]),
        helper.make_node("MatMul", ["y3", "w16"], ["y5"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["wq"], axis=1),
        helper.make_node("MatMul", ["e", "wq"], ["y4"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, 8]) for y in ("y1", "y2", "y4")],
        initializer=inits,
    )
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), path)
    assert graph_weight_bytes(path) == 2 * 128 + 2 * 64 + 32 + 32 + 8
    assert graph_weight_bytes(path, per_reader=False) == 128 + 64 + 32 + 32 + 8


# --- the copy loop -------------------------------------------------------------------------


def test_copy_bandwidth_reports_what_it_copied():
    bw = copy_bandwidth(2, array_bytes=1 << 20, repeats=2)
    assert isinstance(bw, Bandwidth) and bw.bytes_per_s > 0
    assert (bw.array_bytes, bw.threads, bw.repeats) == (1 << 20, 2, 2)
    assert set(bw.as_json()) == {"bytes_per_s", "array_bytes", "threads", "repeats"}


def test_last_level_cache_is_the_highest_level_s_size(tmp_path):
    for index, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "32768K"), (1, "32K")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "none") == 32 << 20  # the fallback


# --- the benchmark -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "GPT-Q"], "unknown model size 'GPT-Q'; choose from GPT-B, GPT-L, GPT-XL, tiny"),
        (["--size", "GPT-B", "--model", "x"], "--size GPT-B runs the demo widened to GPT-B: drop --model"),
        (["--size", "GPT-B", "--bundle", "x"], "--size GPT-B runs the demo widened to GPT-B: drop --model"),
    ],
)
def test_bad_size_is_one_line_exit_2_before_any_build(monkeypatch, tmp_path, args, message):
    monkeypatch.setattr(bench, "sized_model_dir", lambda size: pytest.fail("built a model"))
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["bench", *args, "--out", str(out)])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0, r.output
    assert message in r.output and not out.exists()


def test_bench_size_runs_the_sized_model_with_floors(monkeypatch, model_dir, tmp_path):
    """--size runs sized_model_dir(size) (here the tiny model in its place), AR and LANTERN++
    and LlamaGen's loop, each row with its AR reference and its memory floor."""
    monkeypatch.setattr(bench, "sized_model_dir", lambda size: model_dir if size == "GPT-B" else None)
    out = tmp_path / "bench"
    args = "bench --size GPT-B --backend torch --config ar --config lantern++:tree=chain-3 -n 2 "
    args += f"--classes 0 --warmup 0 --no-quality --baseline torch-batched --out {out}"
    r = CliRunner().invoke(main, args.split())
    assert r.exit_code == 0, r.output
    assert "Memory bandwidth" in r.output
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["size"] == "GPT-B" and results["settings"]["source"] == str(model_dir)
    bw = results["machine"]["copy_bandwidth"]["bytes_per_s"]
    ar, lantern, loop = results["rows"]
    assert (ar["method"], lantern["method"], loop["backend"]) == ("ar", "lantern++", "torch-batched")
    for row in results["rows"]:
        assert row["weight_precision"] == "fp32"
        assert row["floor_seconds_per_image"] == pytest.approx(row["floor_bytes_per_image"] / bw)
        assert row["measured_over_floor"] == pytest.approx(
            row["seconds_per_image"] / row["floor_seconds_per_image"]
        )
    assert lantern["ar_seconds_per_image"] == ar["seconds_per_image"] == ar["ar_seconds_per_image"]
    assert lantern["speedup_vs_ar"] == pytest.approx(ar["seconds_per_image"] / lantern["seconds_per_image"])
    # the same target weights and cache per call; LANTERN++ adds its drafter's weights
    ar_calls, lantern_calls = (r["verify_calls"] / 2 + 1 for r in (ar, lantern))
    assert loop["floor_bytes_per_image"] == pytest.approx(ar["floor_bytes_per_image"])
    assert lantern["floor_bytes_per_image"] > ar["floor_bytes_per_image"] * lantern_calls / ar_calls
    md = (out / "results.md").read_text()
    assert "(the demo widened to GPT-B)" in md and "Memory bandwidth" in md and "W_target" in md
    assert all(line in md for line in speed_table(results["rows"]).splitlines())
    header = md.split("## Speed and quality")[1].split("\n")[2]
    for column in ("s/img", "AR s/img", "speedup", "tau", "class acc", "floor s/img", "meas/floor"):
        assert f"| {column} |" in header, column


@pytest.mark.slow  # builds the tiny widening (3 s) and decodes 4 images of it and the demo (about 40 s here)
def test_the_tiny_size_makes_the_demo_s_tokens_at_its_own_cost(monkeypatch, tmp_path):
    """The sized model accepts as the demo does: a sampled run of each, the same seed, the same
    accepted lengths; its floor is the larger one (wider weights)."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    results = {}
    for name, source in (("demo", []), ("tiny", ["--size", "tiny"])):
        out = tmp_path / name
        args = ["bench", *source, "--backend", "torch", "--config", "ar", "--config", "lantern++"]
        args += ["-n", "1", "--classes", "3", "--warmup", "0", "--no-quality", "--out", str(out)]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        results[name] = json.loads((out / "results.json").read_text())["rows"]
    for demo, tiny in zip(results["demo"], results["tiny"], strict=True):
        assert demo["accepted_length_histogram"] == tiny["accepted_length_histogram"]
        assert tiny["floor_bytes_per_image"] > 3 * demo["floor_bytes_per_image"]
