"""Command-line faults of issue 57: a graph input of a dtype the runtime does not feed, a
``--features`` file that calls ``sys.exit``, and an export stopped by SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import lantern_rt.runtime.backends.bundle_graphs as bundle_graphs
from lantern_rt.bundle import CONDITION_DTYPES, MANIFEST, RUNTIME_DTYPES
from lantern_rt.cli import main
from lantern_rt.fileio import sha256
from lantern_rt.graph_spec import dtype_name
from tests.test_export import shared_bundle
from tests.test_faults_output import resign, start

# -- 1. graph dtypes: refused when the bundle is opened ----------------------------------------


@pytest.fixture
def bundle(tmp_path_factory, tmp_path) -> Path:
    """A copy of the tiny class-conditional bundle (tests/test_export.py's, exported once)."""
    return Path(shutil.copytree(shared_bundle(tmp_path_factory, "c2i-fp32"), tmp_path / "bundle"))


def forge_dtype(bundle: Path, graph: str, io: str, name: str, dtype: str) -> None:
    """Declare tensor ``name`` of ``graph`` as ``dtype`` in its ONNX file and in the manifest
    alike, the file's sha256 and the manifest's digest recomputed: a "valid" manifest."""
    file = bundle / json.loads((bundle / MANIFEST).read_text())["graphs"][graph]["file"]
    model = onnx.load(str(file), load_external_data=False)
    values = model.graph.input if io == "inputs" else model.graph.output
    value = next(v for v in values if v.name == name)
    value.type.tensor_type.elem_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    onnx.save(model, str(file))

    def change(manifest: dict[str, Any]) -> None:
        next(s for s in manifest["graphs"][graph][io] if s["name"] == name)["dtype"] = dtype
        manifest["files"][file.name] = sha256(file)

    resign(bundle, change)


# (graph, "inputs"/"outputs", tensor, forged dtype, what the runtime feeds or reads)
FORGED = {
    "class-ids-int32": ("target_prefill", "inputs", "cond", "int32", "feeds it as int64"),
    "tokens-int32": ("target_ar_step_w16", "inputs", "node_tokens", "int32", "feeds it as int64"),
    "noise-float64": ("target_ar_step", "inputs", "noise", "float64", "feeds it as float32"),
    "codes-int32": ("vq_decode", "inputs", "codes", "int32", "feeds it as int64"),
    "kept-int32": ("target_ar_step", "outputs", "kept", "int32", "reads it as int64"),
}


@pytest.mark.parametrize("graph, io, name, dtype, says", FORGED.values(), ids=FORGED)
def test_a_dtype_the_runtime_does_not_feed_is_refused_on_open(bundle, tmp_path, graph, io, name, dtype, says):
    forge_dtype(bundle, graph, io, name, dtype)
    png = tmp_path / "x.png"
    generate = ["generate", "-q", "--bundle", str(bundle), "-n", "1", "--class", "1", "-o", str(png)]
    for args in (generate, ["inspect", str(bundle)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and result.stdout == "", (args[0], result.output)
        assert result.stderr == (
            f"error: {bundle.resolve()}: graph {graph} declares {io[:-1]} {name} as {dtype}, "
            f"and the runtime {says}: re-export the bundle\n"
        )
    assert not png.exists()


def test_the_dtypes_checked_on_open_are_those_the_runtime_feeds(bundle, tmp_path, monkeypatch):
    """Every input an AR run feeds whose name RUNTIME_DTYPES (or CONDITION_DTYPES) holds has that
    dtype: the table is the runtime's, not a copy of what the exporter declares."""
    fed: dict[str, set[str]] = {}
    check = bundle_graphs.check_input

    def record(spec, arg):
        fed.setdefault(spec.name, set()).add(dtype_name(arg.dtype))
        check(spec, arg)

    monkeypatch.setattr(bundle_graphs, "check_input", record)  # every runner's check (changed_inputs)
    args = ["generate", "-q", "--bundle", str(bundle), "-n", "1", "--class", "1", "--method", "ar"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 0, result.output
    wanted = RUNTIME_DTYPES | {"cond": CONDITION_DTYPES["c2i"]}
    known = {name: dtypes for name, dtypes in fed.items() if name in wanted}
    assert len(known) >= 15 and all(dtypes == {wanted[name]} for name, dtypes in known.items()), fed


# -- 2. --features: sys.exit while loading ------------------------------------------------------


def bench_features(model: Path, spec: str, out: Path):
    args = ["bench", "--model", str(model), "--backend", "torch", "--config", "ar", "--out", str(out)]
    return CliRunner().invoke(main, [*args, "--features", spec])


def test_a_features_file_that_exits_is_one_line(tiny_model_dir, tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\n\nsys.exit(3)\n")
    result = bench_features(tiny_model_dir, f"{exits}:make", tmp_path / "never")
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --features {exits}:make: {exits}, line 3: SystemExit: 3\n"
    assert not (tmp_path / "never").exists()


def test_a_features_file_interrupted_still_interrupts(tiny_model_dir, tmp_path):
    """KeyboardInterrupt is not the file's failure: the run stops as for Ctrl-C."""
    interrupts = tmp_path / "interrupts.py"
    interrupts.write_text("raise KeyboardInterrupt\n")
    result = bench_features(tiny_model_dir, f"{interrupts}:make", tmp_path / "never")
    assert result.exit_code == 128 + signal.SIGINT and result.stderr == "error: stopped by SIGINT\n"


# -- 3. an export stopped by a signal (real processes) ------------------------------------------


def stop_when(proc: subprocess.Popen, folder: Path, pattern: str, sig: int, but: Path | None = None) -> str:
    """Send ``sig`` to ``proc`` once a folder matching ``pattern`` in ``folder`` (other than
    ``but``) holds something: a staged export, not the empty probe of whether the folder is
    writable; its stderr once it has exited."""
    deadline = time.monotonic() + 60
    while not (folder.is_dir() and any(p != but and _holds_something(p) for p in folder.glob(pattern))):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary folder appeared"
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc.communicate(timeout=60)[1]


def _holds_something(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # gone since it was listed
        return False


def stopped_by(sig: int, err: str, proc: subprocess.Popen) -> None:
    """The process exited 128 + ``sig``, its last line on stderr saying so (before it: only
    onnx's notes), no traceback."""
    assert proc.returncode == 128 + sig and "Traceback" not in err, err
    assert err.splitlines()[-1] == f"error: stopped by {signal.Signals(sig).name}", err
    assert err.count("error:") == 1, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_export_removes_its_folder_and_a_killed_one_s(tiny_model_dir, tmp_path, sig):
    """The run removes its own temporary folder before it exits, and the one a killed run left
    (unlocked) when it starts."""
    exports = tmp_path / "exports"
    stale = exports / ".b.dead0001.tmp"
    stale.mkdir(parents=True)
    (stale / "half.onnx").write_bytes(b"x")
    args = ["--tree", "chain-1", "--cache-windows", "1", "--out", str(exports / "b")]
    proc = start("export", "-q", "--model", str(tiny_model_dir), *args)
    stopped_by(sig, stop_when(proc, exports, ".b.*.tmp", sig, but=stale), proc)
    assert list(exports.iterdir()) == []


def test_a_stopped_first_use_export_leaves_only_the_cache_s_lock(tiny_model_dir, tmp_path):
    """The export cache's temporary folder is removed too; its lock file stays, empty and unheld."""
    cache = tmp_path / "cache"
    args = ["-n", "1", "--model", str(tiny_model_dir), "--backend", "onnxruntime", "--tree", "chain-1"]
    proc = start("generate", "-q", *args, "-o", str(tmp_path / "x.png"), env={"LANTERN_CACHE": str(cache)})
    stopped_by(signal.SIGTERM, stop_when(proc, cache / "bundles", ".tiny-*.tmp", signal.SIGTERM), proc)
    (lock,) = (cache / "bundles").iterdir()
    assert lock.name.startswith(".tiny-") and lock.name.endswith(".lock") and lock.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "tiny"]
