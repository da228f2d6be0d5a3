"""TensorRT engines without a builder: keys, refusals, engines.json, flavours, ``build-engines``'
refusals and ``trt_runner`` without a GPU. The real builds (TensorRT for RTX, no GPU needed) are
tests/test_trt_rtx*.py; the one build here goes through a fake ``tensorrt`` module, since NVIDIA's
TensorRT builds only on a GPU. Running plans skips without TensorRT and a GPU."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from lantern_rt.bundle import DTYPES, MANIFEST, WEIGHT_ONLY_DTYPES, Bundle, BundleError, GraphEntry
from lantern_rt.calibration.quantization import DRAFTER_WEIGHT_ONLY_DTYPE, WEIGHT_ONLY_DTYPE
from lantern_rt.cli import main
from lantern_rt.engines import compat, plans, runner
from lantern_rt.engines.compat import EngineError, TensorRTUnavailable
from lantern_rt.engines.plans import (
    check_buildable,
    check_plans,
    choose_precision,
    engine_key,
    find_engines,
    key_slug,
    machine,
    mismatches,
    plan_record,
    write_engines_json,
)
from lantern_rt.engines.runner import io_problems, trt_runner
from lantern_rt.fileio import sha256
from lantern_rt.graph_spec import TensorSpec
from lantern_rt.runtime.backends.bundle_graphs import RELAX_INPUTS, SAMPLING_INPUTS, bound_by_pointer
from tests.test_export import shared_bundle

ORIN = {"name": "Orin (nvgpu)", "compute_capability": "8.7"}
H100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
RTX4090 = {"name": "NVIDIA GeForce RTX 4090", "compute_capability": "8.9"}
HINT = "pip install tensorrt --extra-index-url https://pypi.nvidia.com"
RTX_HINT = "pip install 'lantern-rt[trt-rtx]'"
RTX_TARGETS = ["8.0", "8.6", "8.9", "12.0", "12.1"]


def trt_key(device: dict, version: str, precision: str) -> dict:
    """The key of TensorRT's plans built on ``device``."""
    return engine_key("trt", version, precision, [device["compute_capability"]], device["name"])


def rtx_key(version: str, precision: str, capabilities=RTX_TARGETS) -> dict:
    return engine_key("trt-rtx", version, precision, capabilities)


@pytest.fixture
def bundle(tmp_path_factory, tmp_path) -> Bundle:
    """A private copy of the tiny fp32 bundle, opened (tests write engines into it)."""
    return Bundle.open(shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), tmp_path / "bundle"))


@pytest.fixture
def no_tensorrt(monkeypatch):
    """Neither flavour's module imports, whatever is installed."""
    for flavour in compat.FLAVOURS.values():
        monkeypatch.setitem(sys.modules, flavour.module, None)


def fake_plans(bundle: Bundle, key: dict, manifest_sha: str | None = None) -> Path:
    """A plan set as build_engines writes one, with made-up plan bytes."""
    folder = plans.engines_folder(bundle, key)
    folder.mkdir(parents=True)
    manifest_sha = manifest_sha or sha256(bundle.path / MANIFEST)
    records = []
    for graph in bundle.graphs:
        (folder / f"{graph}.plan").write_bytes(f"plan of {graph}".encode())
        records.append(
            plan_record(graph, f"{graph}.plan", sha256(folder / f"{graph}.plan"), key, manifest_sha)
        )
    write_engines_json(folder, records)
    return folder


def files_of(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


# keys and refusals, pure ---------------------------------------------------------------------


def test_engine_key_and_its_folder_name():
    key = trt_key(ORIN, "10.3.0.30", "fp16")
    assert key == {
        "flavour": "trt",
        "version": "10.3.0.30",
        "precision": "fp16",
        "gpu": "Orin (nvgpu)",
        "compute_capabilities": ["8.7"],
    }
    assert key_slug(key) == "orin-nvgpu-sm87-trt10.3.0.30-fp16"
    assert key_slug(trt_key(H100, "11.4.0.106", "int8")) == "nvidia-h100-80gb-hbm3-sm90-trt11.4.0.106-int8"
    rtx = rtx_key("1.7.1.116", "fp16")
    assert rtx["gpu"] is None and key_slug(rtx) == "sm80-sm86-sm89-sm120-sm121-trt-rtx1.7.1.116-fp16"
    variants = [
        trt_key(H100, "10.3.0.30", "fp16"),
        trt_key(ORIN, "10.3.0.31", "fp16"),
        trt_key(ORIN, "10.3.0.30", "fp32"),
        rtx,
        rtx_key("1.7.1.116", "fp16", ["8.6"]),
        rtx_key("1.7.1.117", "fp16"),
    ]
    assert len({key_slug(k) for k in [key, *variants]}) == 7
    with pytest.raises(EngineError, match="precision must be one of"):
        trt_key(ORIN, "10.3.0.30", "bf16")


ORIN_TRT = machine("trt", "10.3.0.30", ORIN, "fp16")


@pytest.mark.parametrize(
    ("built", "here", "reason"),
    [
        (trt_key(H100, "10.3.0.30", "fp16"), ORIN_TRT, "built on another GPU: NVIDIA H100"),
        ({**trt_key(ORIN, "10.3.0.30", "fp16"), "compute_capabilities": ["8.6"]}, ORIN_TRT, "another GPU"),
        (
            trt_key(ORIN, "10.7.0.23", "fp16"),
            ORIN_TRT,
            "built with TensorRT 10.7.0.23, this is TensorRT 10.3.0.30",
        ),
        (trt_key(ORIN, "10.3.0.30", "fp32"), ORIN_TRT, "fp32 plans, not fp16"),
        (
            rtx_key("1.7.1.116", "fp16", ["8.7"]),
            machine("trt", "1.7.1.116", ORIN, "fp16"),
            "built with TensorRT for RTX 1.7.1.116, this is TensorRT 1.7.1.116",
        ),
        (
            rtx_key("1.7.1.116", "fp16"),
            machine("trt-rtx", "1.7.1.116", H100, "fp16"),
            "built for compute capability 8.0, 8.6, 8.9, 12.0, 12.1, and this GPU is NVIDIA H100 80GB HBM3 (9.0)",
        ),
        (
            rtx_key("1.7.1.116", "fp16"),
            machine("trt-rtx", "1.8.0.1", RTX4090, "fp16"),
            "built with TensorRT for RTX 1.7.1.116, this is TensorRT for RTX 1.8.0.1",
        ),
    ],
)
def test_mismatches_name_the_reason(built, here, reason):
    record = plan_record("target_prefill", "target_prefill.plan", "0" * 64, built, "a" * 64)
    found = mismatches(record, here, "a" * 64)
    assert len(found) == 1 and reason in found[0]
    key = trt_key(ORIN, "10.3.0.30", "fp16")
    assert mismatches(plan_record("g", "g.plan", "0" * 64, key, "a" * 64), ORIN_TRT, "a" * 64) == []
    assert (
        "another bundle" in mismatches(plan_record("g", "g.plan", "0", key, "b" * 64), ORIN_TRT, "a" * 64)[0]
    )


def test_rtx_plans_run_on_any_gpu_of_their_capabilities():
    record = plan_record("g", "g.plan", "0" * 64, rtx_key("1.7.1.116", "int8"), "m")
    for device in (RTX4090, {"name": "NVIDIA RTX A6000", "compute_capability": "8.6"}):
        assert mismatches(record, machine("trt-rtx", "1.7.1.116", device, "int8"), "m") == []


def test_check_plans_wants_every_graph_and_refuses_any_mismatch():
    key = trt_key(ORIN, "10.3.0.30", "fp16")
    records = [plan_record(g, f"{g}.plan", "0" * 64, key, "m") for g in ("a", "b")]
    assert set(check_plans(records, ORIN_TRT, "m", ["a", "b"])) == {"a", "b"}
    with pytest.raises(EngineError, match="no plan for graph"):
        check_plans(records, ORIN_TRT, "m", ["a", "b", "c"])
    records[1] = plan_record("b", "b.plan", "0" * 64, trt_key(ORIN, "10.4.0.1", "fp16"), "m")
    with pytest.raises(EngineError, match="plan for b was built with TensorRT 10.4.0.1"):
        check_plans(records, ORIN_TRT, "m", ["a", "b"])


def test_precision_comes_from_the_bundle(bundle):
    assert bundle.dtype == "fp32" and plans.choose_precision(bundle.dtype, None) == "fp32"
    # every dtype a bundle opens with (int8: Q/DQ) has engines but onnxruntime's weight-only ones
    assert set(DTYPES) - set(WEIGHT_ONLY_DTYPES) == set(compat.PRECISIONS)
    manifest = json.loads((bundle.path / MANIFEST).read_text())
    (bundle.path / MANIFEST).write_text(json.dumps({**manifest, "dtype": "bf16"}))
    with pytest.raises(BundleError, match="dtype 'bf16' is none of fp32, fp16, int8, int8-weights"):
        Bundle.open(bundle.path)  # a bundle of another precision never opens
    assert choose_precision("fp32", None) == "fp32" and choose_precision("int8", "int8") == "int8"
    with pytest.raises(EngineError, match="graphs are fp32.*--dtype fp16"):
        choose_precision("fp32", "fp16")
    with pytest.raises(EngineError, match="graphs are fp16.*quantize"):
        choose_precision("fp16", "int8")


def test_weight_only_bundles_are_refused_naming_the_fix(bundle, monkeypatch):
    assert {*WEIGHT_ONLY_DTYPE.values(), *DRAFTER_WEIGHT_ONLY_DTYPE.values()} == set(WEIGHT_ONLY_DTYPES)
    check_buildable(bundle)
    for dtype in WEIGHT_ONLY_DTYPES:
        monkeypatch.setattr(bundle, "dtype", dtype)
        with pytest.raises(
            EngineError, match=f"graphs are {dtype} .*TensorRT cannot build: build engines from"
        ):
            check_buildable(bundle)


# flavours, with stand-in modules ---------------------------------------------------------------


def test_require_names_the_flavour_s_hint_and_version(no_tensorrt, monkeypatch):
    with pytest.raises(TensorRTUnavailable, match="pip install tensorrt --extra-index-url") as err:
        compat.require(compat.TRT)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    with pytest.raises(TensorRTUnavailable, match=re.escape(RTX_HINT)):
        compat.require(compat.TRT_RTX)
    with pytest.raises(TensorRTUnavailable, match=f"no TensorRT is installed: .*{re.escape(RTX_HINT)}"):
        compat.require_tensorrt()
    old = ModuleType("tensorrt")
    old.__version__ = "8.6.1"
    monkeypatch.setitem(sys.modules, "tensorrt", old)
    with pytest.raises(TensorRTUnavailable, match="TensorRT 8.6.1 is too old"):
        compat.require(compat.TRT)
    new = ModuleType("tensorrt")
    new.__version__ = "10.3.0.30"
    monkeypatch.setitem(sys.modules, "tensorrt", new)
    assert compat.require(compat.TRT) is new and compat.require_tensorrt() is new
    assert compat.version_tuple("11.4.0.106") == (11, 4, 0, 106)
    assert compat.version_tuple("10.3.0b1") == (10, 3)


def test_the_flavour_is_the_one_installed_or_the_one_asked(no_tensorrt, monkeypatch):
    with pytest.raises(TensorRTUnavailable, match="no TensorRT is installed"):
        compat.choose_flavour(None)
    assert compat.choose_flavour("trt-rtx") is compat.TRT_RTX  # installed or not: require says
    with pytest.raises(EngineError, match="unknown TensorRT flavour 'rtx': choose trt or trt-rtx"):
        compat.choose_flavour("rtx")
    monkeypatch.setitem(sys.modules, "tensorrt_rtx_bindings", ModuleType("tensorrt_rtx_bindings"))
    assert compat.choose_flavour(None) is compat.TRT_RTX
    monkeypatch.setitem(sys.modules, "tensorrt", ModuleType("tensorrt"))
    with pytest.raises(
        EngineError,
        match="both TensorRT and TensorRT for RTX are installed: choose one "
        "with --flavour trt or --flavour trt-rtx",
    ):
        compat.choose_flavour(None)


def test_network_flags_per_flavour_and_version():
    trt10 = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=5))
    trt11 = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=5))
    assert compat.network_flags(trt10, compat.TRT) == (1 << 5) | 1
    assert compat.network_flags(trt11, compat.TRT) == 1 << 5
    assert compat.network_flags(trt10, compat.TRT_RTX) == 1 << 5


def test_parser_errors_read_as_lines():
    class Old:
        def node(self):
            return 3

        def desc(self):
            return "unsupported op"

    class New(Old):
        def node_name(self):
            return "/attn/ScatterND"

        def node_operator(self):
            return "ScatterND"

    whole_graph = SimpleNamespace(node=lambda: -1, desc=lambda: "bad opset")
    assert compat.parser_error_text(Old()) == "node 3: unsupported op"
    assert compat.parser_error_text(New()) == "node 3 (ScatterND '/attn/ScatterND'): unsupported op"
    assert compat.parser_error_text(whole_graph) == "bad opset"


# engines.json in a real bundle -------------------------------------------------------------


def test_engines_round_trip_and_manifest_ignores_them(bundle):
    before = bundle.manifest()
    key = trt_key(ORIN, "10.3.0.30", "fp32")
    folder = fake_plans(bundle, key)
    assert folder == bundle.path / "engines" / "orin-nvgpu-sm87-trt10.3.0.30-fp32"
    found = find_engines(bundle, machine("trt", "10.3.0.30", ORIN, "fp32"))
    assert set(found) == set(bundle.graphs) and all(p.parent == folder for p in found.values())
    assert found["target_prefill"].read_bytes() == b"plan of target_prefill"
    reopened = Bundle.open(bundle.path)  # the engines/ subfolder is not part of the bundle
    assert reopened.manifest() == before and reopened.manifest_sha256 == bundle.manifest_sha256
    (bundle.path / "vq_decode.onnx").write_bytes(b"tampered")
    with pytest.raises(BundleError, match="vq_decode.onnx does not match its sha256"):
        Bundle.open(bundle.path)  # and top-level files are still checked


def test_the_plan_set_that_runs_here_is_found_among_others(bundle):
    """Plan sets of both flavours side by side: each machine finds the one it can run."""
    rtx = fake_plans(bundle, rtx_key("1.7.1.116", "fp32"))
    trt = fake_plans(bundle, trt_key(RTX4090, "10.8.0.43", "fp32"))
    here = {
        "trt-rtx": machine("trt-rtx", "1.7.1.116", RTX4090, "fp32"),
        "trt": machine("trt", "10.8.0.43", RTX4090, "fp32"),
    }
    assert {p.parent for p in find_engines(bundle, here["trt-rtx"]).values()} == {rtx}
    assert {p.parent for p in find_engines(bundle, here["trt"]).values()} == {trt}


def test_a_modified_plan_is_refused(bundle):
    key = trt_key(ORIN, "10.3.0.30", "fp32")
    here = machine("trt", "10.3.0.30", ORIN, "fp32")
    folder = fake_plans(bundle, key)
    (folder / "target_ar_step.plan").write_bytes(b"another plan")
    with pytest.raises(EngineError, match="target_ar_step.plan is missing or does not match its sha256"):
        find_engines(bundle, here)
    (folder / "target_ar_step.plan").unlink()
    with pytest.raises(EngineError, match="missing"):
        find_engines(bundle, here)
    (folder / "engines.json").write_text("{}")
    with pytest.raises(EngineError, match="not a lantern-rt-engines v2 file"):
        find_engines(bundle, here)


@pytest.mark.parametrize(
    ("built", "reason"),
    [
        (trt_key(H100, "10.3.0.30", "fp32"), "built on another GPU"),
        (trt_key(ORIN, "10.7.0.23", "fp32"), "built with TensorRT 10.7.0.23"),
        (trt_key(ORIN, "10.3.0.30", "fp16"), "fp16 plans, not fp32"),
        (
            rtx_key("1.7.1.116", "fp32", ["8.7"]),
            "built with TensorRT for RTX 1.7.1.116, this is TensorRT 10.3.0.30",
        ),
    ],
)
def test_plans_of_another_machine_or_flavour_are_refused(bundle, built, reason):
    here = machine("trt", "10.3.0.30", ORIN, "fp32")
    other = fake_plans(bundle, built)
    with pytest.raises(EngineError) as err:
        find_engines(bundle, here)
    message = str(err.value)
    assert "has no engines for TensorRT 10.3.0.30 on Orin (nvgpu)" in message and reason in message
    assert f"it only has {other.name} (" in message and f"lantern build-engines {bundle.path}" in message
    assert "\n" not in message


def test_plans_of_another_bundle_are_refused(bundle):
    fake_plans(bundle, trt_key(ORIN, "10.3.0.30", "fp32"), manifest_sha="f" * 64)
    with pytest.raises(EngineError, match="built for another bundle.*lantern build-engines"):
        find_engines(bundle, machine("trt", "10.3.0.30", ORIN, "fp32"))


# TensorRT's build, around a fake tensorrt module (it builds only on a GPU) -------------------


class FakeTensorRT(ModuleType):
    """The slice of the TensorRT 10 Python API that a build uses; records what it is told."""

    def __init__(self):
        super().__init__("tensorrt")
        self.__version__ = "10.3.0.30"
        self.calls: list[tuple] = []
        fake = self

        class ILogger:
            INTERNAL_ERROR, ERROR, WARNING, INFO = range(4)

            def __init__(self):
                pass

        class Config:
            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("workspace", pool, size))

            def create_timing_cache(self, data):
                return SimpleNamespace(serialize=lambda: b"timing:" + bytes(data))

            def set_timing_cache(self, cache, ignore_mismatch):
                fake.calls.append(("timing cache",))
                return True

        class Parser:
            def __init__(self, network, logger):
                self.network = network

            def parse_from_file(self, path):
                self.network["file"] = Path(path).name
                return True

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls.append(("network", flags))
                return {}

            def create_builder_config(self):
                return Config()

            def build_serialized_network(self, network, config):
                return f"plan of {network['file']}".encode()

        self.ILogger, self.Builder, self.OnnxParser = ILogger, Builder, Parser
        self.NetworkDefinitionCreationFlag = SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=5)
        self.MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")


def test_tensorrt_builds_for_this_gpu_with_its_timing_cache(bundle, monkeypatch, tmp_path):
    trt = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(plans, "device_info", lambda index=None: dict(ORIN))
    cache = tmp_path / "timing.cache"
    folder = plans.build_engines(bundle, flavour="trt", workspace_mb=512, timing_cache=cache)
    assert folder == plans.engines_folder(bundle, trt_key(ORIN, "10.3.0.30", "fp32"))
    found = find_engines(bundle, machine("trt", "10.3.0.30", ORIN, "fp32"))
    assert {g: p.read_bytes() for g, p in found.items()} == {
        g: f"plan of {e.file}".encode() for g, e in bundle.graphs.items()
    }
    assert ("network", (1 << 5) | 1) in trt.calls  # strongly typed
    assert ("workspace", "workspace", 512 << 20) in trt.calls and ("timing cache",) in trt.calls
    assert cache.read_bytes() == b"timing:"
    with pytest.raises(EngineError, match="TensorRT builds for the GPU it runs on and takes no --compute"):
        plans.build_engines(bundle, flavour="trt", capabilities=["8.7"])


# the command line and the runner without a GPU -----------------------------------------------


def build_cmd(*args: str):
    return CliRunner().invoke(main, ["build-engines", *args])


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def test_build_engines_without_tensorrt_exits_2_with_the_hints(bundle, no_tensorrt):
    before = files_of(bundle.path)
    line = one_error_line(build_cmd(str(bundle.path), "--workspace-mb", "256"))
    assert HINT in line and RTX_HINT in line
    assert RTX_HINT in one_error_line(build_cmd(str(bundle.path), "--flavour", "trt-rtx"))
    assert files_of(bundle.path) == before and not bundle.engines_dir.exists()


def test_build_engines_checks_its_input_first(bundle, tmp_path, no_tensorrt):
    assert "not a lantern-rt bundle" in one_error_line(build_cmd(str(tmp_path / "nope")))
    assert "graphs are fp32" in one_error_line(build_cmd(str(bundle.path), "--precision", "fp16"))
    assert "'rtx' is not one of" in one_error_line(build_cmd(str(bundle.path), "--flavour", "rtx"))
    r = build_cmd(str(bundle.path), "--workspace-mb", "0")
    assert r.exit_code == 2 and "--workspace-mb" in r.stderr  # click's own usage error
    assert not bundle.engines_dir.exists()


def test_trt_runner_without_tensorrt_fails_cleanly(bundle, no_tensorrt):
    with pytest.raises(TensorRTUnavailable, match=f"{re.escape(HINT)}.*{re.escape(RTX_HINT)}"):
        trt_runner(bundle)


def test_trt_runner_refuses_plans_of_another_flavour(bundle, monkeypatch):
    """TensorRT for RTX installed (the suite's), a GPU: a plan set TensorRT built is refused in
    one line that says what it is and how to build one that runs here."""
    rtx = compat.require(compat.TRT_RTX)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(runner, "device_info", lambda index=None: dict(RTX4090))
    fake_plans(bundle, trt_key(RTX4090, "10.8.0.43", "fp32"))
    with pytest.raises(EngineError) as err:
        trt_runner(bundle)
    message = str(err.value)
    assert f"has no engines for TensorRT for RTX {rtx.__version__} on NVIDIA GeForce RTX 4090" in message
    assert "built with TensorRT 10.8.0.43, this is TensorRT for RTX" in message and "\n" not in message
    assert f"lantern build-engines {bundle.path}" in message


def test_importing_the_backend_imports_no_tensorrt():
    code = (
        "import sys, lantern_rt.engines.runner, lantern_rt.engines.cli, lantern_rt.cli; "
        "assert not {'tensorrt', 'tensorrt_rtx_bindings'} & set(sys.modules), 'tensorrt was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_runner_helpers():
    entry = GraphEntry(
        "target_ar_step",
        "target_ar_step.onnx",
        inputs=(TensorSpec("tokens", (1,), "int64"), TensorSpec("past_k_0", (2,), "float16")),
        outputs=(TensorSpec("logits", (2, 4), "float32"),),
    )
    io = {
        "tokens": {"input": True, "shape": [1], "dtype": "int64"},
        "past_k_0": {"input": True, "shape": [2], "dtype": "float16"},
        "logits": {"input": False, "shape": [2, 4], "dtype": "float32"},
    }
    assert io_problems(io, entry) == []
    assert "tensor logits is" in io_problems({**io, "logits": {**io["logits"], "dtype": "float16"}}, entry)[0]
    assert io_problems({k: v for k, v in io.items() if k != "tokens"}, entry) == [
        "the plan has no tensor tokens"
    ]
    assert [bound_by_pointer(s) for s in entry.inputs] == [False, True]


# real TensorRT on a GPU ----------------------------------------------------------------------


def test_trt_graphs_match_onnxruntime(bundle):
    pytest.importorskip(
        "tensorrt", reason="TensorRT is not installed (pip install tensorrt needs NVIDIA's index)"
    )
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from lantern_rt.runtime.acceptance import Relaxation, relax_inputs
    from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner
    from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs

    plans.build_engines(bundle, flavour="trt", workspace_mb=256)
    entry = bundle.graph("target_ar_step")
    trt_graph = trt_runner(bundle)(bundle, entry)
    ort_graph = ort_runner(threads=1, providers=["CPUExecutionProvider"])(bundle, entry)
    g, cpu, vocab = torch.Generator().manual_seed(0), torch.device("cpu"), bundle.constants.vocab_size
    fixed = {s.name: torch.randn(s.shape, generator=g) for s in entry.inputs if s.name.startswith("past_")}
    fixed |= dict(zip(SAMPLING_INPUTS, filter_inputs(SamplingConfig(2.0), cpu), strict=True))
    fixed |= dict(zip(RELAX_INPUTS, relax_inputs(Relaxation("exact"), None, vocab, False, cpu), strict=True))
    cuda_fixed = {name: t.cuda() for name, t in fixed.items()}  # bound once, where they lie
    for step in range(3):  # plain run and capture, then replays with new small inputs
        small = {
            "node_tokens": torch.tensor([[step + 1]]),
            "cache_length": torch.tensor([bundle.constants.cls_token_num + step]),
            "prefix": torch.ones(entry.input("prefix").shape, dtype=torch.bool),
            "valid": torch.ones(1, 1, dtype=torch.bool),
            "q": torch.zeros(1, 1, vocab),
            "noise": torch.zeros(1, 1),
            "bonus_noise": torch.rand(1, vocab, generator=g),
        }
        want = ort_graph(**fixed, **small)
        got = trt_graph(**cuda_fixed, **{k: t.cuda() for k, t in small.items()})
        assert got.keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(got[name].cpu(), w, atol=1e-3, rtol=1e-3)
    assert trt_graph.cuda_graph_error is None and trt_graph._graph is not None
