"""The run options, declared once (lantern_rt/run_options.py): the commands' flags and the Python
API's keywords are made from the declarations, and every refusal of the resolver
(``settings.resolve``) names the options it refuses as the caller wrote them: as keywords
through ``lantern_rt.load``, as flags through ``lantern generate``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import lantern_rt
from lantern_rt import backends
from lantern_rt.bundle import Bundle
from lantern_rt.cli import main
from lantern_rt.errors import LanternError, flag, option
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.config import ConfigError
from lantern_rt.run_options import RunOptions, declaration, option_types
from lantern_rt.runtime.backends import compiled
from lantern_rt.runtime.tree import load_tree
from lantern_rt.settings import resolve
from tests.conftest import exported, tiny_gpt, tiny_vq, write_model_dir

RUN = tuple(option_types())
FLAGS = [flag(name) for name in RUN]


def _flags_of(command: str) -> set[str]:
    return {opt for param in main.commands[command].params for opt in (*param.opts, *param.secondary_opts)}


# --- declared once --------------------------------------------------------------------------


def test_every_option_is_declared_with_its_help_and_default():
    for f in dataclasses.fields(RunOptions):
        assert declaration(f.name).help, f.name
    assert RunOptions() == RunOptions.of({"model_path": None, "seed": 3})  # a command's other params


def test_the_commands_flags_and_the_api_keywords_are_made_from_the_declarations():
    assert set(FLAGS) <= _flags_of("generate") and set(FLAGS) <= _flags_of("serve")
    assert set(FLAGS) - _flags_of("generate-set") == {"--drafter", "--streams"}  # a set: auto streams
    shared = ("cfg_scale", "temperature", "top_k", "top_p", "device", "threads", "cuda_graphs", "compile")
    assert {flag(name) for name in (*shared, "backend", "tree")} <= _flags_of("bench")
    for name in ("compile", "cuda_graphs", "greedy"):  # a switch and its negation
        assert {flag(name, True), flag(name, False)} <= _flags_of("generate")
    keywords = inspect.signature(lantern_rt.load).parameters
    declared = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    assert {k: p.default for k, p in keywords.items() if k in declared} == declared
    params = {p.name: p for p in main.commands["generate"].params}
    assert params["batch_size"].default == 1 and params["streams"].default == "auto"  # generate's own
    assert {p.name: p for p in main.commands["serve"].params}["streams"].default == 1


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"batch_size": 0}, "batch_size must be in 1..256, got 0"),
        ({"streams": 65}, "streams must be in 1..64, got 65"),
        ({"threads": -1}, "threads must be >= 0, got -1"),
        ({"top_k": 1.5}, "top_k must be an integer, got 1.5"),
        ({"greedy": 1}, "greedy must be True or False, got 1"),
        ({"method": "best"}, "unknown method 'best'; choose from ar, exact"),
        ({"backend": "jax"}, "unknown backend 'jax'; choose from onnxruntime, openvino, tensorrt, torch"),
        ({"drafter": 3}, "drafter must be a path, got 3"),
    ],
)
def test_an_option_is_checked_against_its_declaration(given, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        RunOptions(**given)


def test_an_unknown_keyword_names_the_options():
    with pytest.raises(ConfigError, match="unknown option 'top_q'; the options are cfg_scale, temperature"):
        lantern_rt.load(top_q=0.9)


def test_an_error_names_an_option_as_its_caller_does():
    error = ConfigError(
        f"{option('compile')} no; use {option('backend', 'torch')} or {option('compile', False)}"
    )
    assert str(error) == "compile no; use backend='torch' or compile=False"
    assert error.command_line() == "--compile no; use --backend torch or --no-compile"
    assert flag("batch_size", 2) == "--batch-size 2" and flag("cuda_graphs", False) == "--no-cuda-graphs"


# --- every refusal, as keywords and as flags ------------------------------------------------


def _spoken(message: str) -> str:
    """``message`` without what it quotes ('...', `...`: a command to run, such as 'lantern export
    --tree chain-4', names that command's flags)."""
    return re.sub(r"'lantern [^']*'|`[^`]*`", "", message)


def refused(source: Path, given: dict, names: list[tuple], monkeypatch, tmp_path: Path) -> None:
    """``given`` refused through ``lantern_rt.load`` and through ``lantern generate``, each naming
    ``names`` (an option, or an option and a value) as it takes them and no other way."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(LanternError) as api:
        lantern_rt.load(source, **given)
    message = str(api.value)
    for name in names:
        keyword = name[0] if len(name) == 1 else f"{name[0]}={name[1]!r}"
        assert keyword in message, (keyword, message)
    assert not any(f in _spoken(message) for f in FLAGS), message
    args = ["generate", "-q", "--bundle" if (source / "manifest.json").is_file() else "--model", str(source)]
    args += [part for key, value in given.items() for part in flag(key, value).split(" ", 1)]
    out = tmp_path / "x.png"
    result = CliRunner().invoke(main, [*args, "-o", str(out)])
    line = result.output
    assert result.exit_code == 2 and line.startswith("error: ") and line.count("\n") == 1, line
    for name in names:
        assert flag(*name) in line, (flag(*name), line)
    assert not re.search(rf"\b({'|'.join(RUN)})=", line), line
    assert not out.exists() and not (tmp_path / "cache").exists()  # refused before any work


@pytest.fixture
def no_compiler(monkeypatch):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)


@pytest.fixture
def a_cuda_device(monkeypatch):
    """torch sees one CUDA device (nothing runs on it: the run is refused first)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(backends.Backend, "check_available", lambda self: None)


MODEL_REFUSALS = {
    "compile-elsewhere": (
        {"backend": "onnxruntime", "compile": True},
        [("compile",), ("backend", "torch"), ("compile", False)],
    ),
    "streams-on-torch": ({"backend": "torch", "streams": 2}, [("streams",), ("backend",), ("streams", 1)]),
    "streams-over-threads": (
        {"backend": "onnxruntime", "streams": 3, "threads": 2},
        [("threads",), ("streams", 2), ("threads", 0)],
    ),
    "window-without-jacobi": ({"method": "lantern++", "window": 3}, [("window",), ("method", "lantern++")]),
    "window-and-tree": ({"method": "sjd", "window": 3, "tree": "chain-3"}, [("window",), ("tree",)]),
    "jacobi-tree": ({"method": "sjd", "tree": "mc_sim_7b_63"}, [("method", "sjd"), ("tree",)]),
    "coupling-without-jacobi": ({"method": "ar", "coupling": "gumbel"}, [("coupling",), ("method", "ar")]),
    "jacobi-drafter": ({"method": "sjd", "drafter": "somewhere"}, [("method", "sjd"), ("drafter",)]),
    "drafter-exported": (
        {"backend": "onnxruntime", "method": "lantern++", "drafter": "somewhere"},
        [("drafter",), ("backend", "torch")],
    ),
    "no-cuda": ({"device": "cuda"}, [("device", "cuda"), ("device", "cpu")]),
}


@pytest.mark.parametrize(("given", "names"), MODEL_REFUSALS.values(), ids=MODEL_REFUSALS)
def test_a_refusal_names_the_options_as_keywords_and_as_flags(
    given, names, tiny_model_dir, monkeypatch, tmp_path
):
    if torch.cuda.is_available() and given.get("device") == "cuda":
        pytest.skip("this machine has a CUDA device")
    refused(tiny_model_dir, given, names, monkeypatch, tmp_path)


def test_a_missing_compiler_names_the_option(no_compiler, tiny_model_dir, monkeypatch, tmp_path):
    refused(
        tiny_model_dir,
        {"backend": "torch", "compile": True},
        [("compile",), ("compile", False)],
        monkeypatch,
        tmp_path,
    )


def test_a_backend_of_the_cpu_refuses_a_gpu(a_cuda_device, tiny_model_dir, monkeypatch, tmp_path):
    refused(
        tiny_model_dir, {"backend": "openvino", "device": "cuda"}, [("device", "cpu")], monkeypatch, tmp_path
    )


@pytest.fixture(scope="module")
def no_drafter_bundle(tmp_path_factory) -> Bundle:
    """tests/test_jacobi.py's bundle (exported once per run): no drafter; the verify graphs of
    chain-3 and pac-2-2-7 at B 1 and 2."""
    path = tmp_path_factory.mktemp("refusals") / "bundle"
    model = write_model_dir(path.with_name("bundle-model"), tiny_gpt(1), tiny_vq())
    trees = [load_tree("chain-3"), load_tree("pac-2-2-7")]
    return Bundle.open(exported(open_model_dir(model), path, trees, batch_sizes=(1, 2), windows=1))


BUNDLE_REFUSALS = {
    "torch": ({"backend": "torch"}, [("backend",)]),
    "drafter": ({"drafter": "somewhere"}, [("drafter",)]),
    "window": ({"method": "sjd", "window": 4}, [("window", 4)]),
    "pac-tree": ({"method": "sjd", "tree": "pac-2-1-4"}, [("tree", "pac-2-1-4")]),
}


@pytest.mark.slow  # the bundle's export, shared with tests/test_jacobi.py: about a minute, once per run
@pytest.mark.parametrize(("given", "names"), BUNDLE_REFUSALS.values(), ids=BUNDLE_REFUSALS)
def test_a_bundle_refuses_what_it_lacks_naming_the_options(
    given, names, no_drafter_bundle, monkeypatch, tmp_path
):
    refused(no_drafter_bundle.path, given, names, monkeypatch, tmp_path)


@pytest.mark.slow
def test_a_bundle_refuses_a_batch_size_and_a_drafter_method_it_lacks(no_drafter_bundle):
    with pytest.raises(LanternError, match="lantern export --batch-size"):
        resolve(no_drafter_bundle, RunOptions(batch_size=3))
    with pytest.raises(ConfigError, match="has no drafter graphs"):
        resolve(no_drafter_bundle, RunOptions(method="lantern++"))
    plan = resolve(no_drafter_bundle, RunOptions(method="sjd", window=3, batch_size=2))
    assert plan.method.tree == "chain-3" and plan.backend == "onnxruntime" and not plan.exports
