"""The backend registry: what a run chooses and refuses by asking it, and a backend of our own
added by one registry line (docs/architecture.md, "Adding a backend"), run end to end from the
command line: a model directory exported into the cache and decoded by the toy engine to the
tokens torch gives."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from lantern_rt import backends as registry
from lantern_rt.assembly import Pipeline, bundle_pipeline
from lantern_rt.backends import (
    BACKENDS,
    BUNDLE,
    Backend,
    EngineOptions,
    backend_named,
    cpu_backends,
    default_backend,
    runs_on_gpu,
)
from lantern_rt.bundle import Bundle, GraphEntry
from lantern_rt.cli import main
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.method import MethodConfig
from lantern_rt.runtime.run_shape import RunShape


class ToyGraph:
    """A bundle graph run by plain ``InferenceSession.run``: numpy in, numpy out (no bindings)."""

    device = torch.device("cpu")

    def __init__(self, bundle: Bundle, entry: GraphEntry, calls: list[str]):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(bundle.file(entry)), options, providers=["CPUExecutionProvider"]
        )
        self.entry, self.calls = entry, calls

    def __call__(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls.append(self.entry.name)
        feed = {spec.name: inputs[spec.name].contiguous().numpy() for spec in self.entry.inputs}
        names = [spec.name for spec in self.entry.outputs]
        outputs = self.session.run(names, feed)
        return {
            name: torch.from_numpy(np.ascontiguousarray(o)) for name, o in zip(names, outputs, strict=True)
        }


TOY_CALLS: list[str] = []


def toy_pipeline(source: Bundle, method: MethodConfig, shape: RunShape, options: EngineOptions) -> Pipeline:
    """The toy engine's pipeline: the bundle's graphs for the batch size, run by :class:`ToyGraph`."""
    return bundle_pipeline(source, shape.batch_size, method, lambda b, e: ToyGraph(b, e, TOY_CALLS), "toy")


TOY = Backend("toy", "onnxruntime", "pip install onnxruntime", frozenset({BUNDLE}), toy_pipeline)


@pytest.fixture
def toy_registered(monkeypatch):
    """The registry line that adds the backend (docs/architecture.md, "Adding a backend")."""
    monkeypatch.setitem(BACKENDS, TOY.name, TOY)


def test_the_default_backend_follows_the_old_rules(monkeypatch):
    """onnxruntime on a CPU (torch without onnxruntime, or for a --drafter override); on a GPU
    TensorRT for a bundle when installed, else torch for a model directory and onnxruntime for a
    bundle: each case against the rules as they were written before the registry."""

    def old_rule(device: str, bundle: bool, override: bool, has_ort: bool, has_trt: bool) -> str:
        on_gpu = not device.startswith("cpu")
        if bundle:
            return "tensorrt" if on_gpu and has_trt else "onnxruntime"
        return "torch" if override or on_gpu or not has_ort else "onnxruntime"

    for has_ort in (True, False):
        for has_trt in (True, False):
            installed = {"torch": True, "onnxruntime": has_ort, "tensorrt": has_trt}
            monkeypatch.setattr(Backend, "available", lambda self, i=installed: i[self.name])
            for device in ("cpu", "cuda", "cuda:1"):
                for bundle in (True, False):
                    for override in (False,) if bundle else (True, False):
                        want = old_rule(device, bundle, override, has_ort, has_trt)
                        assert default_backend(device, bundle, override) == want, (
                            device,
                            bundle,
                            override,
                            installed,
                        )


def test_what_a_backend_runs_and_where_is_asked_of_its_record():
    assert list(BACKENDS) == ["onnxruntime", "openvino", "tensorrt", "torch"]
    assert cpu_backends(bundle=False) == ("torch", "onnxruntime")  # lantern bench's default rows
    assert cpu_backends(bundle=True) == ("onnxruntime",)
    assert runs_on_gpu("tensorrt", "cpu") and runs_on_gpu("torch", "cuda:0")
    assert not runs_on_gpu("onnxruntime", "cpu") and not runs_on_gpu("torch", "cpu")
    with pytest.raises(
        ConfigError, match="unknown backend 'jax'; choose from onnxruntime, openvino, tensorrt, torch"
    ):
        backend_named("jax")
    with pytest.raises(ConfigError, match="the torch backend runs a model directory, not a bundle"):
        backend_named("torch").check_bundle()
    backend_named("onnxruntime").check_bundle()


def test_a_missing_engine_says_what_to_install(monkeypatch):
    missing = Backend(
        "absent", "no_such_engine_package", "pip install no-such-engine", frozenset({BUNDLE}), toy_pipeline
    )
    monkeypatch.setitem(BACKENDS, missing.name, missing)
    assert not missing.available()
    with pytest.raises(ConfigError, match="needs no_such_engine_package: pip install no-such-engine"):
        missing.check_available()
    result = CliRunner().invoke(
        main, ["generate", "-q", "--backend", "absent", "-n", "1", "--class", "0", "-o", "x.png"]
    )
    assert result.exit_code == 2 and "pip install no-such-engine" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_a_toy_backend_is_one_registry_line_from_the_command_line(
    toy_registered, tiny_model_dir, tmp_path, monkeypatch
):
    """``lantern generate --backend toy`` on a model directory: the registry's record says it runs
    bundles, so the model is exported into the cache, and the toy engine decodes it to the tokens
    of the torch backend (same seed); --bundle then runs that bundle on it, and torch is refused
    a bundle by the one message."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    TOY_CALLS.clear()
    tokens = {}
    for backend in ("toy", "torch"):
        out = tmp_path / f"{backend}.npy"
        args = [
            "generate",
            "-q",
            "--model",
            str(tiny_model_dir),
            "--backend",
            backend,
            "-n",
            "2",
            "--class",
            "1,3",
        ]
        result = CliRunner().invoke(
            main, [*args, "--seed", "4", "--save-tokens", str(out), "-o", str(tmp_path / f"{backend}.png")]
        )
        assert result.exit_code == 0, result.output
        assert f"ar, {backend})" in result.output
        tokens[backend] = np.load(out)
    assert TOY_CALLS and {"vq_decode", "target_ar_step"} <= set(TOY_CALLS)
    np.testing.assert_array_equal(tokens["toy"], tokens["torch"])
    (bundle,) = (tmp_path / "cache" / "bundles").glob("tiny-*")
    args = [
        "generate",
        "-q",
        "--bundle",
        str(bundle),
        "-n",
        "1",
        "--class",
        "1",
        "-o",
        str(tmp_path / "b.png"),
    ]
    assert CliRunner().invoke(main, [*args, "--backend", "toy"]).exit_code == 0
    refused = CliRunner().invoke(main, [*args, "--backend", "torch"])
    assert (
        refused.exit_code == 2 and "the torch backend runs a model directory, not a bundle" in refused.output
    )


def test_the_registry_module_imports_no_engine():
    """The command line lists the backends in --help: the registry is torch-free at import."""
    assert registry.__name__ == "lantern_rt.backends"
    import subprocess
    import sys

    code = (
        "import sys, lantern_rt.backends, lantern_rt.settings, lantern_rt.run_options; "
        "print(sorted(m for m in ('torch', 'onnxruntime', 'tensorrt') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
