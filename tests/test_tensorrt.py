"""TensorRT engines: keys, refusals, engines.json, the build around a fake ``tensorrt`` module,
``build-engines`` and ``trt_runner`` without TensorRT. Real builds and runs skip without
TensorRT and a GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import onnx
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.bundle import DTYPES, MANIFEST, WEIGHT_ONLY_DTYPES, Bundle, BundleError, GraphEntry
from lantern_rt.calibration.calibrate import WEIGHT_ONLY_DTYPE
from lantern_rt.cli import main
from lantern_rt.engines import compat, plans
from lantern_rt.engines.compat import EngineError, TensorRTUnavailable
from lantern_rt.engines.conditionals import has_conditionals
from lantern_rt.engines.plans import (
    check_plans,
    choose_precision,
    engine_key,
    find_engines,
    key_slug,
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
HINT = "pip install tensorrt --extra-index-url https://pypi.nvidia.com"


@pytest.fixture
def bundle(tmp_path_factory, tmp_path) -> Bundle:
    """A private copy of the tiny fp32 bundle, opened (tests write engines into it)."""
    return Bundle.open(shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), tmp_path / "bundle"))


@pytest.fixture
def no_tensorrt(monkeypatch):
    """``import tensorrt`` fails, whatever is installed."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)


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
    key = engine_key(ORIN, "10.3.0.30", "fp16")
    assert key == {
        "gpu": "Orin (nvgpu)",
        "compute_capability": "8.7",
        "tensorrt": "10.3.0.30",
        "precision": "fp16",
    }
    assert key_slug(key) == "orin-nvgpu-sm87-trt10.3.0.30-fp16"
    assert key_slug(engine_key(H100, "11.4.0.106", "int8")) == "nvidia-h100-80gb-hbm3-sm90-trt11.4.0.106-int8"
    variants = [
        engine_key(H100, "10.3.0.30", "fp16"),
        engine_key(ORIN, "10.3.0.31", "fp16"),
        engine_key(ORIN, "10.3.0.30", "fp32"),
    ]
    assert len({key_slug(k) for k in [key, *variants]}) == 4
    with pytest.raises(EngineError, match="precision must be one of"):
        engine_key(ORIN, "10.3.0.30", "bf16")


@pytest.mark.parametrize(
    ("built", "reason"),
    [
        (engine_key(H100, "10.3.0.30", "fp16"), "built on another GPU: NVIDIA H100"),
        ({**engine_key(ORIN, "10.3.0.30", "fp16"), "compute_capability": "8.6"}, "another GPU"),
        (engine_key(ORIN, "10.7.0.23", "fp16"), "built with TensorRT 10.7.0.23, this is TensorRT 10.3.0.30"),
        (engine_key(ORIN, "10.3.0.30", "fp32"), "fp32 plans, not fp16"),
    ],
)
def test_mismatches_name_the_reason(built, reason):
    key = engine_key(ORIN, "10.3.0.30", "fp16")
    record = plan_record("target_prefill", "target_prefill.plan", "0" * 64, built, "a" * 64)
    found = mismatches(record, key, "a" * 64)
    assert len(found) == 1 and reason in found[0]
    assert mismatches(plan_record("g", "g.plan", "0" * 64, key, "a" * 64), key, "a" * 64) == []
    assert "another bundle" in mismatches(plan_record("g", "g.plan", "0", key, "b" * 64), key, "a" * 64)[0]


def test_check_plans_wants_every_graph_and_refuses_any_mismatch():
    key = engine_key(ORIN, "10.3.0.30", "fp16")
    records = [plan_record(g, f"{g}.plan", "0" * 64, key, "m") for g in ("a", "b")]
    assert set(check_plans(records, key, "m", ["a", "b"])) == {"a", "b"}
    with pytest.raises(EngineError, match="no plan for graph"):
        check_plans(records, key, "m", ["a", "b", "c"])
    records[1] = plan_record("b", "b.plan", "0" * 64, engine_key(ORIN, "10.4.0.1", "fp16"), "m")
    with pytest.raises(EngineError, match="plan for b was built with TensorRT 10.4.0.1"):
        check_plans(records, key, "m", ["a", "b"])


def test_precision_comes_from_the_bundle(bundle):
    assert bundle.dtype == "fp32" and plans.choose_precision(bundle.dtype, None) == "fp32"
    # every dtype a bundle opens with (int8: Q/DQ) has engines but onnxruntime's weight-only ones
    assert set(DTYPES) - set(WEIGHT_ONLY_DTYPES) == set(compat.PRECISIONS)
    assert set(WEIGHT_ONLY_DTYPE.values()) == set(WEIGHT_ONLY_DTYPES)
    for dtype in WEIGHT_ONLY_DTYPES:
        with pytest.raises(EngineError, match=f"graphs are {dtype} .*TensorRT cannot build"):
            choose_precision(dtype, None)
    manifest = json.loads((bundle.path / MANIFEST).read_text())
    (bundle.path / MANIFEST).write_text(json.dumps({**manifest, "dtype": "bf16"}))
    with pytest.raises(BundleError, match="dtype 'bf16' is none of fp32, fp16, int8, int8-weights"):
        Bundle.open(bundle.path)  # a bundle of another precision never opens
    assert choose_precision("fp32", None) == "fp32" and choose_precision("int8", "int8") == "int8"
    with pytest.raises(EngineError, match="graphs are fp32.*--dtype fp16"):
        choose_precision("fp32", "fp16")
    with pytest.raises(EngineError, match="graphs are fp16.*quantize"):
        choose_precision("fp16", "int8")


# compat, with fake tensorrt pieces ------------------------------------------------------------


def test_require_tensorrt_hint_and_version(no_tensorrt, monkeypatch):
    with pytest.raises(TensorRTUnavailable, match="pip install tensorrt --extra-index-url") as err:
        compat.require_tensorrt()
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    old = ModuleType("tensorrt")
    old.__version__ = "8.6.1"
    monkeypatch.setitem(sys.modules, "tensorrt", old)
    with pytest.raises(TensorRTUnavailable, match="TensorRT 8.6.1 is too old"):
        compat.require_tensorrt()
    new = ModuleType("tensorrt")
    new.__version__ = "10.3.0.30"
    monkeypatch.setitem(sys.modules, "tensorrt", new)
    assert compat.require_tensorrt() is new
    assert compat.version_tuple("11.4.0.106") == (11, 4, 0, 106) and compat.version_tuple("10.3.0b1") == (
        10,
        3,
    )


def test_network_flags_per_version():
    trt10 = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=5))
    trt11 = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=5))
    assert compat.network_flags(trt10) == (1 << 5) | 1
    assert compat.network_flags(trt11) == 1 << 5


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
    key = engine_key(ORIN, "10.3.0.30", "fp32")
    folder = fake_plans(bundle, key)
    assert folder == bundle.path / "engines" / "orin-nvgpu-sm87-trt10.3.0.30-fp32"
    found = find_engines(bundle, key)
    assert set(found) == set(bundle.graphs) and all(p.parent == folder for p in found.values())
    assert found["target_prefill"].read_bytes() == b"plan of target_prefill"
    reopened = Bundle.open(bundle.path)  # the engines/ subfolder is not part of the bundle
    assert reopened.manifest() == before and reopened.manifest_sha256 == bundle.manifest_sha256
    (bundle.path / "vq_decode.onnx").write_bytes(b"tampered")
    with pytest.raises(BundleError, match="vq_decode.onnx does not match its sha256"):
        Bundle.open(bundle.path)  # and top-level files are still checked


def test_a_modified_plan_is_refused(bundle):
    key = engine_key(ORIN, "10.3.0.30", "fp32")
    folder = fake_plans(bundle, key)
    (folder / "target_ar_step.plan").write_bytes(b"another plan")
    with pytest.raises(EngineError, match="target_ar_step.plan is missing or does not match its sha256"):
        find_engines(bundle, key)
    (folder / "target_ar_step.plan").unlink()
    with pytest.raises(EngineError, match="missing"):
        find_engines(bundle, key)
    (folder / "engines.json").write_text("{}")
    with pytest.raises(EngineError, match="not a lantern-rt-engines v1 file"):
        find_engines(bundle, key)


@pytest.mark.parametrize(
    ("built", "reason"),
    [
        (engine_key(H100, "10.3.0.30", "fp32"), "built on another GPU"),
        (engine_key(ORIN, "10.7.0.23", "fp32"), "built with TensorRT 10.7.0.23"),
        (engine_key(ORIN, "10.3.0.30", "fp16"), "fp16 plans, not fp32"),
    ],
)
def test_plans_of_another_machine_are_refused(bundle, built, reason):
    key = engine_key(ORIN, "10.3.0.30", "fp32")
    other = fake_plans(bundle, built)
    with pytest.raises(EngineError) as err:
        find_engines(bundle, key)
    message = str(err.value)
    assert "no TensorRT engines for Orin (nvgpu)" in message and reason in message
    assert f"lantern build-engines {bundle.path}" in message
    other.rename(plans.engines_folder(bundle, key))  # copied under this machine's name
    with pytest.raises(EngineError, match=reason):
        find_engines(bundle, key)


def test_plans_of_another_bundle_are_refused(bundle):
    key = engine_key(ORIN, "10.3.0.30", "fp32")
    fake_plans(bundle, key, manifest_sha="f" * 64)
    with pytest.raises(EngineError, match="built for another bundle.*lantern build-engines"):
        find_engines(bundle, key)


# the build, around a fake tensorrt module ---------------------------------------------------


class FakeTensorRT(ModuleType):
    """The slice of the TensorRT 10 Python API that build_engines uses; records what it is told."""

    def __init__(self, reject: dict[str, list[str]] | None = None):
        super().__init__("tensorrt")
        self.__version__ = "10.3.0.30"
        self.reject = reject or {}  # ONNX file name -> parser errors
        self.calls: list[tuple] = []
        fake = self

        class ILogger:
            INTERNAL_ERROR, ERROR, WARNING, INFO = range(4)

            def __init__(self):
                pass

        class Config:
            def set_memory_pool_limit(self, pool, size):
                fake.calls.append(("workspace", pool, size))

            def set_flag(self, flag):
                fake.calls.append(("flag", flag))

            def create_timing_cache(self, data):
                return SimpleNamespace(serialize=lambda: b"timing:" + bytes(data))

            def set_timing_cache(self, cache, ignore_mismatch):
                return True

        class Parser:
            def __init__(self, network, logger):
                self.network, self.errors = network, []

            def parse_from_file(self, path):
                self.network["file"] = Path(path).name
                graph = onnx.load(path, load_external_data=False).graph
                fake.calls.append(("parsed", Path(path).name, has_conditionals(graph)))
                self.errors = fake.reject.get(Path(path).name, [])
                return not self.errors

            @property
            def num_errors(self):
                return len(self.errors)

            def get_error(self, i):
                return SimpleNamespace(node=lambda: i, desc=lambda: self.errors[i])

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


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(plans, "device_info", lambda index=None: dict(ORIN))


def test_build_writes_a_checked_plan_set(bundle, fake_gpu, monkeypatch, tmp_path):
    trt = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    cache = tmp_path / "timing.cache"
    folder = plans.build_engines(bundle, workspace_mb=512, timing_cache=cache)
    key = engine_key(ORIN, "10.3.0.30", "fp32")
    assert folder == plans.engines_folder(bundle, key)
    found = find_engines(bundle, key)
    assert {g: p.read_bytes() for g, p in found.items()} == {
        g: f"plan of {e.file}".encode() for g, e in bundle.graphs.items()
    }
    assert ("network", (1 << 5) | 1) in trt.calls  # strongly typed
    assert not [c for c in trt.calls if c[0] == "flag"]  # no precision flags
    assert ("workspace", "workspace", 512 << 20) in trt.calls
    assert cache.read_bytes() == b"timing:"
    assert [p.name for p in (bundle.path / "engines").iterdir()] == [folder.name]  # no temporary left
    entries = json.loads((folder / "engines.json").read_text())["plans"]
    assert {e["graph"] for e in entries} == set(bundle.graphs)
    assert all(e["bundle_manifest_sha256"] == sha256(bundle.path / MANIFEST) for e in entries)
    plans.build_engines(bundle)  # a rebuild replaces the set
    assert [p.name for p in (bundle.path / "engines").iterdir()] == [folder.name]


@pytest.mark.slow
def test_tensorrt_parses_drafting_graphs_without_their_ifs(tmp_path_factory, tmp_path, fake_gpu, monkeypatch):
    """An If keeps TensorRT from capturing a CUDA graph: the parser gets each drafting graph with
    its Ifs replaced by their then-branches (an equal graph: see test_ort_speculative)."""
    bundle = Bundle.open(
        shutil.copytree(shared_bundle(tmp_path_factory, "t2i-gqa-fp16"), tmp_path / "bundle")
    )
    drafting = bundle.file(bundle.graph("draft_tree_0"))
    assert has_conditionals(onnx.load(str(drafting), load_external_data=False).graph)
    trt = FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    plans.build_engines(bundle)
    parsed = {call[1]: call[2] for call in trt.calls if call[0] == "parsed"}
    assert parsed == {entry.file: False for entry in bundle.graphs.values()}


def test_a_failed_build_leaves_nothing_and_lists_every_parser_error(bundle, fake_gpu, monkeypatch):
    reject = {"target_ar_step.onnx": ["ScatterND: reduction unsupported", "Gather: int64 index"]}
    monkeypatch.setitem(sys.modules, "tensorrt", FakeTensorRT(reject))
    before = files_of(bundle.path)
    with pytest.raises(EngineError) as err:
        plans.build_engines(bundle)
    message = str(err.value)
    assert "rejected target_ar_step.onnx (2 errors)" in message
    assert "(1) node 0: ScatterND: reduction unsupported; (2) node 1: Gather: int64 index" in message
    assert files_of(bundle.path) == before and not bundle.engines_dir.exists()


def test_build_refuses_another_precision_before_tensorrt(bundle, no_tensorrt):
    with pytest.raises(EngineError, match="graphs are fp32"):
        plans.build_engines(bundle, precision="int8")
    with pytest.raises(TensorRTUnavailable):
        plans.build_engines(bundle)
    assert not bundle.engines_dir.exists()


# the command line and the runner without TensorRT ------------------------------------------


def build_cmd(*args: str):
    return CliRunner().invoke(main, ["build-engines", *args])


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def test_build_engines_without_tensorrt_exits_2_with_the_hint(bundle, no_tensorrt):
    before = files_of(bundle.path)
    assert HINT in one_error_line(build_cmd(str(bundle.path), "--workspace-mb", "256"))
    assert files_of(bundle.path) == before and not bundle.engines_dir.exists()


def test_build_engines_checks_its_input_first(bundle, tmp_path, no_tensorrt):
    assert "not a lantern-rt bundle" in one_error_line(build_cmd(str(tmp_path / "nope")))
    assert "graphs are fp32" in one_error_line(build_cmd(str(bundle.path), "--precision", "fp16"))
    r = build_cmd(str(bundle.path), "--workspace-mb", "0")
    assert r.exit_code == 2 and "--workspace-mb" in r.stderr  # click's own usage error
    assert not bundle.engines_dir.exists()


def test_trt_runner_without_tensorrt_fails_cleanly(bundle, no_tensorrt):
    with pytest.raises(TensorRTUnavailable, match="pip install tensorrt"):
        trt_runner(bundle)


def test_importing_the_backend_imports_no_tensorrt():
    code = (
        "import sys, lantern_rt.engines.runner, lantern_rt.engines.cli, lantern_rt.cli; "
        "assert 'tensorrt' not in sys.modules, 'tensorrt was imported'"
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

    plans.build_engines(bundle, workspace_mb=256)
    entry = bundle.graph("target_ar_step")
    trt_graph = trt_runner(bundle)(bundle, entry)
    ort_graph = ort_runner(threads=1, providers=["CPUExecutionProvider"])(bundle, entry)
    g, cpu, vocab = torch.Generator().manual_seed(0), torch.device("cpu"), bundle.constants.vocab_size
    fixed = {s.name: torch.randn(s.shape, generator=g) for s in entry.inputs if s.name.startswith("past_")}
    fixed |= dict(zip(SAMPLING_INPUTS, filter_inputs(SamplingConfig(2.0), cpu), strict=True))
    fixed |= dict(zip(RELAX_INPUTS, relax_inputs(Relaxation("exact"), None, vocab, False, cpu), strict=True))
    cuda_fixed = {name: t.cuda() for name, t in fixed.items()}  # bound once, where they lie
    for step in range(3):  # plain run and capture, then replays with new small inputs
        capacity = entry.input("mask").shape[-1]
        small = {
            "node_tokens": torch.tensor([step + 1]),
            "positions": torch.tensor([step]),
            "mask": torch.arange(capacity)[None, None, None] <= step,
            "valid": torch.ones(1, dtype=torch.bool),
            "q": torch.zeros(1, vocab),
            "noise": torch.zeros(1),
            "bonus_noise": torch.rand(vocab, generator=g),
        }
        want = ort_graph(*({**fixed, **small}[s.name] for s in entry.inputs))
        got = trt_graph(
            *({**cuda_fixed, **{k: t.cuda() for k, t in small.items()}}[s.name] for s in entry.inputs)
        )
        for w, o in zip(want, got, strict=True):
            torch.testing.assert_close(o.cpu(), w, atol=1e-3, rtol=1e-3)
    assert trt_graph.cuda_graph_error is None and trt_graph._graph is not None
