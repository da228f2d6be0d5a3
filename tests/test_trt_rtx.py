"""``lantern build-engines`` with TensorRT for RTX's real builder on a machine without a GPU
(ahead of time): the plan set and its key, the compute capabilities asked, one-line refusals that
leave nothing in ``engines/``, a graph the parser rejects, and the lint that names what the parser
rejects in the parser's own words."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from lantern_rt.bundle import MANIFEST, Bundle, write_manifest
from lantern_rt.cli import main
from lantern_rt.engines import compat, conditionals
from lantern_rt.engines.compat import EngineError
from lantern_rt.engines.plans import PlanBuilder, build_plan, find_engines, machine
from lantern_rt.graph_rules import tensorrt_problems
from tests.test_export import shared_bundle
from tests.test_tensorrt import H100, RTX4090, files_of, one_error_line

trt = pytest.importorskip(
    "tensorrt_rtx_bindings", reason="TensorRT for RTX is not installed (the trt-rtx extra)"
)

DEFAULT_TARGETS = ["8.0", "8.6", "8.9", "12.0", "12.1"]


@pytest.fixture
def bundle(tmp_path_factory, tmp_path, monkeypatch) -> Bundle:
    """A private copy of the tiny fp32 bundle (two cache windows), opened; NVIDIA's TensorRT
    hidden, so that TensorRT for RTX is the one flavour installed."""
    monkeypatch.setitem(sys.modules, compat.TRT.module, None)
    return Bundle.open(shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), tmp_path / "bundle"))


def build_cmd(*args: str):
    return CliRunner().invoke(main, ["build-engines", *args])


def test_build_engines_builds_every_graph_ahead_of_time(bundle):
    """No GPU here: the plans are built for TensorRT for RTX's default compute capabilities,
    and run on any GPU of one of them."""
    assert not torch.cuda.is_available()
    r = build_cmd(str(bundle.path))
    assert r.exit_code == 0, r.output
    version = trt.__version__
    folder = bundle.engines_dir / f"sm80-sm86-sm89-sm120-sm121-trt-rtx{version}-fp32"
    assert "built TensorRT engines in" in r.stderr and str(folder) in r.stderr
    assert (
        f"(1/{len(bundle.graphs)}, TensorRT for RTX {version}, fp32, for compute capability 8.0, 8.6"
        in r.stderr
    )
    entries = json.loads((folder / "engines.json").read_text())["plans"]
    assert {e["graph"] for e in entries} == set(bundle.graphs)
    for entry in entries:
        assert (entry["flavour"], entry["version"], entry["gpu"]) == ("trt-rtx", version, None)
        assert entry["compute_capabilities"] == DEFAULT_TARGETS and entry["precision"] == "fp32"
    found = find_engines(bundle, machine("trt-rtx", version, RTX4090, "fp32"))
    assert set(found) == set(bundle.graphs) and all(p.stat().st_size > 0 for p in found.values())
    with pytest.raises(EngineError, match=r"built for compute capability 8.0, .*this GPU is NVIDIA H100"):
        find_engines(bundle, machine("trt-rtx", version, H100, "fp32"))
    r = build_cmd(str(bundle.path), "--flavour", "trt-rtx", "--compute-capability", "8.9,8.6")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in bundle.engines_dir.iterdir()) == sorted(
        [folder.name, f"sm86-sm89-trt-rtx{version}-fp32"]
    )


@pytest.mark.parametrize("cc", ["9.0", "8.7", "86", "sm_86"])
def test_an_unknown_compute_capability_is_one_line(bundle, cc):
    before = files_of(bundle.path)
    line = one_error_line(build_cmd(str(bundle.path), "--compute-capability", cc))
    assert f"cannot build for compute capability '{cc}': choose from 8.0, 8.6, 8.9, 12.0, 12.1" in line
    assert files_of(bundle.path) == before and not bundle.engines_dir.exists()


def test_a_timing_cache_is_refused(bundle, tmp_path):
    line = one_error_line(build_cmd(str(bundle.path), "--timing-cache", str(tmp_path / "t.cache")))
    assert "TensorRT for RTX takes no timing cache" in line and "drop --timing-cache" in line
    assert not bundle.engines_dir.exists() and not (tmp_path / "t.cache").exists()


def test_turing_is_refused_in_one_line(bundle):
    """TensorRT for RTX has no fp32 matrix products for Turing, and every bundle keeps some."""
    before = files_of(bundle.path)
    line = one_error_line(build_cmd(str(bundle.path), "--compute-capability", "8.6,7.5"))
    assert "cannot build lantern-rt's graphs for compute capability 7.5: it has no fp32 matrix" in line
    assert line.endswith("; leave it out")
    assert files_of(bundle.path) == before and not bundle.engines_dir.exists()


def test_what_turing_lacks_is_what_its_builder_says(tmp_path_factory):
    """The refusal above is the builder's own: the tiny bundle's first graph, built for 7.5."""
    bundle = Bundle.open(shared_bundle(tmp_path_factory, "c2i-fp32"))
    builder = PlanBuilder(compat.TRT_RTX)
    builder.capabilities = ["7.5"]  # past target_capabilities' refusal
    with pytest.raises(EngineError, match=r"for Turing \(SM75\): FP32 GEMM is not supported"):
        builder.build(bundle.file(bundle.graph("target_prefill")))


def plant(bundle: Bundle, graph: str, op_type: str) -> None:
    """Turn the first MatMul of ``graph`` into ``op_type`` and re-sign the bundle."""
    path = bundle.file(bundle.graph(graph))
    model = onnx.load(str(path), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    node.op_type, node.name = op_type, "/planted"
    onnx.save(model, str(path))
    write_manifest(bundle.path, json.loads((bundle.path / MANIFEST).read_text()))


def test_a_graph_the_parser_rejects_fails_with_the_parser_s_message(bundle):
    """Graphs after the first are refused too, in one error line (after the build's progress
    lines), and the plans already built are removed."""
    plant(bundle, "target_ar_step", "LanternNoSuchOp")
    before = files_of(bundle.path)
    r = build_cmd(str(bundle.path), "--compute-capability", "8.9")
    assert r.exit_code == 2 and "Traceback" not in r.output and "building target_prefill (1/" in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == r.stderr.strip().splitlines()[-1]
    assert "TensorRT for RTX's ONNX parser rejected target_ar_step.onnx (1 errors): (1) node" in errors[0]
    assert "(LanternNoSuchOp '/planted'): " in errors[0] and "Plugin not found" in errors[0]
    assert files_of(bundle.path) == before and not bundle.engines_dir.exists()


def test_drafting_graphs_are_built_without_their_ifs(tmp_path_factory, monkeypatch):
    """An If keeps TensorRT from capturing a CUDA graph: the builder gets each drafting graph with
    its Ifs replaced by their then-branches (an equal graph: see test_ort_speculative)."""
    bundle = Bundle.open(shared_bundle(tmp_path_factory, "t2i-gqa-fp16"))
    drafting = bundle.file(bundle.graph("draft_tree_0"))
    assert conditionals.has_conditionals(onnx.load(str(drafting), load_external_data=False).graph)
    parsed = []
    inline = conditionals.without_conditionals

    @contextlib.contextmanager
    def seen(path: Path):
        with inline(path) as given:
            parsed.append(
                conditionals.has_conditionals(onnx.load(str(given), load_external_data=False).graph)
            )
            yield given

    monkeypatch.setattr(conditionals, "without_conditionals", seen)
    assert len(build_plan(drafting, capabilities=["8.9"])) > 0
    assert parsed == [False]


# the lint says what the parser rejects, in its words ------------------------------------------


def graph_file(path: Path, nodes, inputs, outputs, initializers=(), opset: int = 17, **domains) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in domains.items()]
    onnx.save(helper.make_model(graph, opset_imports=imports), str(path))
    return path


def scatter(tmp: Path, mode: str) -> Path:
    """A cache written at a position as the in-place step graphs write theirs (opset 24)."""
    cache = [1, 2, 8, 4]
    return graph_file(
        tmp / f"scatter-{mode}.onnx",
        [
            helper.make_node(
                "TensorScatter", ["cache", "rows", "at"], ["present"], name="/w", axis=2, mode=mode
            )
        ],
        [
            helper.make_tensor_value_info("cache", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, 2, 1, 4]),
            helper.make_tensor_value_info("at", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, cache)],
        opset=24,
    )


def nbits(tmp: Path, dtype: int) -> Path:
    """onnxruntime's 4-bit weight-only product, as ``lantern calibrate --weights-only`` writes it."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    return graph_file(
        tmp / f"nbits-{np_dtype.name}.onnx",
        [
            helper.make_node(
                "MatMulNBits",
                ["x", "w", "s"],
                ["y"],
                name="/q",
                domain="com.microsoft",
                K=64,
                N=64,
                bits=4,
                block_size=32,
            )
        ],
        [helper.make_tensor_value_info("x", dtype, [4, 64])],
        [helper.make_tensor_value_info("y", dtype, [4, 64])],
        [
            numpy_helper.from_array(np.zeros((64, 2, 16), np.uint8), "w"),
            numpy_helper.from_array(np.ones(128, np_dtype), "s"),
        ],
        **{"com.microsoft": 1},
    )


def parser_message(path: Path) -> str | None:
    """The real parser's and builder's message on ``path``; None when it builds."""
    try:
        build_plan(path, capabilities=["8.9"])
    except EngineError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: scatter(tmp, "circular"),
        lambda tmp: nbits(tmp, TensorProto.FLOAT),
        lambda tmp: nbits(tmp, TensorProto.FLOAT16),
    ],
    ids=["circular-scatter", "nbits-fp32", "nbits-fp16"],
)
def test_the_lint_gives_the_parser_s_reason(make, tmp_path):
    path = make(tmp_path)
    (problem,) = tensorrt_problems(path)
    message = parser_message(path)
    assert message is not None and "ONNX parser rejected" in message
    assert problem.split(": ", 1)[1] in message, (problem, message)


def test_what_the_lint_passes_the_parser_takes(tmp_path):
    path = scatter(tmp_path, "linear")
    assert tensorrt_problems(path) == [] and parser_message(path) is None


def test_a_plan_builder_needs_a_whole_mib_of_workspace():
    with pytest.raises(EngineError, match="at least 1 MiB"):
        PlanBuilder(compat.TRT_RTX, workspace_mb=0)
