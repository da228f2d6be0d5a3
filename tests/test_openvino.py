"""The OpenVINO backend (``--backend openvino``): a bundle's standard graphs on OpenVINO's CPU
plugin give onnxruntime's tokens on the same bundle (greedy and sampled; ar, exact, LANTERN++,
sjd; one and two decode streams; the demo's recorded greedy tokens), a Q/DQ int8 bundle runs on
int8 kernels, each graph is compiled once with the run's threads, and what it cannot run is
refused in one line: the engine not installed, the in-place graphs of ``--cache-in-place``,
another device."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.backends import backend_named
from lantern_rt.bundle import Bundle
from lantern_rt.cli import main
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.config import ConfigError
from lantern_rt.pipeline import build_pipeline
from lantern_rt.run_options import RunOptions
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig, RunPlan, resolve
from tests import token_fixture_cases as demo
from tests.conftest import tiny_gpt, tiny_vq
from tests.test_export import make_bundle
from tests.test_speculative import GREEDY

needs_openvino = pytest.mark.skipif(
    importlib.util.find_spec("openvino") is None, reason="openvino not installed"
)
TREE = "chain-3"  # the drafter's tree, and the Jacobi window of sjd
LABELS = [0, 1, 2, 3]
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
METHODS = ("ar", "exact", "lantern++", "sjd")


def run(bundle: Path | Bundle, backend: str, method: str, sampling: SamplingConfig, **options):
    """The tokens and accepted-length histogram of LABELS generated from ``bundle`` on ``backend``
    (one thread, one stream unless ``options`` say otherwise)."""
    source = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    streams = options.pop("streams", 1)
    mc = MethodConfig(method, tree=TREE, k=5, lam=5.0)
    plan = RunPlan(source, backend, mc, sampling, RunShape(streams=streams), **{"threads": 1, **options})
    pipe = build_pipeline(plan)
    result = generate(pipe, LABELS, sampling, seed=3, progress=False)
    return result.tokens, result.stats.histogram


@pytest.fixture
def compiled(monkeypatch) -> list[tuple[str, object]]:
    """Every graph OpenVINO compiles in the test, as (file name, compiled model)."""
    import openvino as ov

    seen: list[tuple[str, object]] = []
    compile_model = ov.Core.compile_model

    def spy(self, model, device, config):
        result = compile_model(self, model, device, config)
        seen.append((Path(model).name, result))
        return result

    monkeypatch.setattr(ov.Core, "compile_model", spy)
    return seen


# --- without a bundle ------------------------------------------------------------------------


def test_the_package_does_not_import_openvino():
    code = (
        "import sys, lantern_rt.cli, lantern_rt.pipeline, lantern_rt.backends; "
        "assert 'openvino' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_openvino_a_run_says_what_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else find_spec(name, *a)
    )
    result = CliRunner().invoke(
        main, ["generate", "-q", "--backend", "openvino", "-n", "1", "--class", "0", "-o", "x.png"]
    )
    assert result.exit_code == 2, result.output
    assert "the openvino backend needs openvino: pip install 'lantern-rt[openvino]'" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_the_record_runs_bundles_on_the_cpu_and_is_never_chosen_unasked(monkeypatch):
    record = backend_named("openvino")
    assert record.streams and not record.exports_in_place("cpu")  # standard graphs
    assert record.cpu_rank is None and record.gpu_rank is None  # slower than onnxruntime on the demo
    record.check_bundle()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA device, as torch sees it
    monkeypatch.setattr(type(record), "check_available", lambda self: None)
    with pytest.raises(ConfigError, match="runs on the CPU, not cuda") as refused:
        resolve(open_model_dir(None), RunOptions(backend="openvino", device="cuda"))
    assert "use device='cpu'" in str(refused.value) and "use --device cpu" in refused.value.command_line()


@needs_openvino
def test_a_graph_openvino_cannot_read_is_refused_naming_it_and_the_operator(tmp_path):
    from onnx import TensorProto, helper, save

    from lantern_rt.runtime.backends.openvino_backend import ov_runner

    shape = [1, 4]
    node = helper.make_node("TensorScatter", ["cache", "rows", "start"], ["present"], axis=1)
    inputs = [
        ("cache", TensorProto.FLOAT, shape),
        ("rows", TensorProto.FLOAT, [1, 1]),
        ("start", TensorProto.INT64, [1]),
    ]
    graph = helper.make_graph(
        [node],
        "scatter",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, shape)],
    )
    path = tmp_path / "scatter.onnx"
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]), str(path))
    bundle, entry = SimpleNamespace(file=lambda entry: path), SimpleNamespace(drafting=False)
    with pytest.raises(ConfigError) as refused:
        ov_runner(1)(bundle, entry)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message == f"openvino cannot run {path}: No conversion rule found for operations: TensorScatter-24"


# --- a trained tiny pair's bundles -------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32(trained_pair, tmp_path_factory) -> Path:
    target, drafter = trained_pair
    return make_bundle(
        tmp_path_factory.mktemp("openvino") / "fp32", target, tiny_vq(), drafter, [TREE], "fp32"
    )


@pytest.fixture(scope="module")
def int8(fp32) -> Path:
    out = fp32.with_name("int8")
    args = [
        "calibrate",
        str(fp32),
        "--samples",
        "2",
        "--validate",
        "1",
        "--out",
        str(out),
        "--threads",
        "1",
        "-q",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out


@needs_openvino
@pytest.mark.slow  # the module's bundle: an export of about a minute
@pytest.mark.parametrize(
    ("method", "sampling"),
    [*((m, GREEDY) for m in METHODS), ("ar", SAMPLED), ("lantern++", SAMPLED)],
    ids=[*(f"greedy-{m}" for m in METHODS), "sampled-ar", "sampled-lantern++"],
)
def test_tokens_equal_onnxruntime_on_the_same_bundle(fp32, method, sampling):
    tokens, histogram = run(fp32, "openvino", method, sampling)
    reference = run(fp32, "onnxruntime", method, sampling)
    assert torch.equal(tokens, reference[0]) and histogram == reference[1]
    if method in ("exact", "lantern++"):
        assert max(histogram) > 1  # the drafter's tokens were accepted


@needs_openvino
@pytest.mark.slow
def test_streams_share_each_compiled_graph_and_threads_reach_it(fp32, compiled):
    """Two streams on two threads: each graph file compiled once, on two execution streams of
    one thread each (drafting graphs too); one stream on two threads: two threads for the
    target's graphs, one for drafting; the tokens of one stream either way."""
    one, _ = run(fp32, "onnxruntime", "lantern++", SAMPLED)
    assert torch.equal(run(fp32, "openvino", "lantern++", SAMPLED, streams=2, threads=2)[0], one)
    names = [name for name, _ in compiled]
    assert len(names) == len(set(names)) and "target_verify_0.onnx" in names
    for _, model in compiled:
        assert int(model.get_property("NUM_STREAMS")) == 2
        assert int(model.get_property("INFERENCE_NUM_THREADS")) == 2
        assert str(model.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
    compiled.clear()
    assert torch.equal(run(fp32, "openvino", "lantern++", SAMPLED, threads=2)[0], one)
    threads = {name: int(model.get_property("INFERENCE_NUM_THREADS")) for name, model in compiled}
    assert threads["target_verify_0.onnx"] == threads["target_prefill.onnx"] == 2
    assert threads["draft_tree_0.onnx"] == 1
    assert all(str(model.get_property("PERFORMANCE_HINT")) == "LATENCY" for _, model in compiled)


@needs_openvino
@pytest.mark.slow  # the calibration of the module's bundle
def test_a_qdq_int8_bundle_runs_on_int8_kernels(int8, compiled):
    tokens, histogram = run(int8, "openvino", "lantern++", GREEDY)
    reference, _ = run(int8, "onnxruntime", "lantern++", GREEDY)
    # The engines' outputs of one call differ by fp32 round-off, which a QuantizeLinear turns into a
    # quantum where it falls near a rounding tie: equal tokens on this pair, 72-81% on the demo.
    assert (tokens == reference).float().mean() > 0.5 and max(histogram) > 1
    step = next(model for name, model in compiled if name == "target_verify_0.onnx")
    precisions = {
        op.get_rt_info()["runtimePrecision"].astype(str) for op in step.get_runtime_model().get_ops()
    }
    assert "i8" in precisions or "u8" in precisions  # Q/DQ honoured, not dequantized to fp32


@needs_openvino
@pytest.mark.slow  # an export of a tiny model with its cache written in place
def test_in_place_graphs_are_refused_in_one_line(tmp_path):
    # sjd's window 3: the graphs of tests/test_jacobi.py's first run of the same model (in place)
    path = make_bundle(
        tmp_path / "in-place", tiny_gpt(), tiny_vq(), None, ["chain-3"], "fp32", windows=1, in_place=True
    )
    args = ["generate", "-q", "--bundle", str(path), "--backend", "openvino", "-n", "1", "-o", "x.png"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "openvino cannot run the in-place graphs" in result.output
    assert "export the model without --cache-in-place" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@needs_openvino
@pytest.mark.slow  # exports the model directory into the cache
def test_a_model_directory_is_exported_with_standard_graphs(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "x.png"
    args = [
        "generate",
        "-q",
        "--model",
        str(tiny_model_dir),
        "--backend",
        "openvino",
        "-n",
        "1",
        "-o",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (manifest,) = (tmp_path / "cache").rglob("manifest.json")
    constants = Bundle.open(manifest.parent).constants
    assert constants.cache_scratch == constants.drafter_scratch == 0 and out.is_file()


@needs_openvino
@pytest.mark.slow
def test_bench_measures_openvino_beside_onnxruntime(fp32, tmp_path):
    args = ["bench", "--bundle", str(fp32), "--backend", "onnxruntime", "--backend", "openvino"]
    args += ["--config", "ar", "--config", "lantern++", "-n", "1", "--class", "0", "--no-quality"]
    result = CliRunner().invoke(main, [*args, "--threads", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    assert results["machine"]["openvino"] == importlib.metadata.version("openvino")
    by = {(row["backend"], row["method"]): row for row in rows}
    assert set(by) == {(b, m) for b in ("onnxruntime", "openvino") for m in ("ar", "lantern++")}
    tau = {b: by[b, "lantern++"]["mean_accepted_length"] for b in ("onnxruntime", "openvino")}
    assert tau["openvino"] == tau["onnxruntime"] > 1 and by["openvino", "ar"]["seconds_per_image"] > 0


# --- the demo ---------------------------------------------------------------------------------


@needs_openvino
@pytest.mark.slow  # the demo's export (one tree, one cache window): about a minute, once per run
def test_the_demos_greedy_tokens_equal_onnxruntimes(tmp_path):
    """ar, exact and LANTERN++ against the tokens onnxruntime recorded (tests/fixtures), sjd
    against onnxruntime on the same bundle."""
    bundle = Bundle.open(demo.demo_bundle(tmp_path / "demo"))  # tests/test_token_fixtures.py's too
    with np.load(demo.FIXTURE) as data:
        recorded = {key: torch.from_numpy(data[key]) for key in data.files}
    for method in (*demo.METHODS, "sjd"):
        tokens = {}
        for backend in ("openvino", "onnxruntime"):
            plan = RunPlan(bundle, backend, demo.method_config(method), demo.sampling("greedy"), threads=1)
            pipe = build_pipeline(plan)
            tokens[backend] = generate(
                pipe, demo.LABELS, demo.sampling("greedy"), seed=demo.SEED, progress=False
            ).tokens
        assert torch.equal(tokens["openvino"], tokens["onnxruntime"]), method
        if method in demo.METHODS:
            assert torch.equal(tokens["openvino"], recorded[f"onnxruntime/{method}/greedy"]), method
