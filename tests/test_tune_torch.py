"""lantern tune on the torch backend: a model directory tuned as it is (no export), its record
kept beside onnxruntime's (one per backend) and followed by torch runs only, as onnxruntime's is
by onnxruntime runs only; a bundle refused in one line; calls and replayed steps timed after a
device synchronisation, each candidate's step captured once, in a decode that is not timed; the
GPU check's tune of a sized model in its JSON and report."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.eval import gpu_check
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.run_options import RunOptions
from lantern_rt.runtime import decode as decode_module
from lantern_rt.runtime.decode import StepCache
from lantern_rt.runtime.tree import chain_tree, load_tree
from lantern_rt.settings import MethodConfig, default_sampling, resolve
from lantern_rt.tune import session as session_module
from lantern_rt.tune.record import read_record, record_path, this_machine, write_record
from lantern_rt.tune.session import Candidate, TuneSession, _Timed, _TimedSteps
from tests.conftest import randomize, tiny_gpt, tiny_vq, write_model_dir
from tests.test_export import add_drafter

CHAIN = {"name": "chain-2", "paths": [[0], [0, 0]]}


def _record(backend: str, label: str, tree: dict | None) -> dict:
    """A record of this machine on ``backend`` whose choice at B = 1 is ``label`` over ``tree``."""
    method = "ar" if tree is None else "lantern++"
    choice = {"label": label, "method": method, "tree": tree, "measured_s_per_image": 0.25}
    return {"machine": this_machine(backend, backend), "batch_sizes": {"1": {"choice": choice}}}


ONNX_RECORD = _record(
    "onnxruntime", "lantern++ chain-3", {"name": "chain-3", "paths": [[0], [0, 0], [0, 0, 0]]}
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model directory with a random drafter."""
    target = tiny_gpt(3)
    root = write_model_dir(tmp_path_factory.mktemp("tune-torch") / "model", target, tiny_vq())
    add_drafter(root, randomize(Drafter(DrafterConfig.for_target(target.config), target.config), 4))
    return root


@pytest.fixture(scope="module")
def tuned(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One tune on torch (CPU, one thread, two images per candidate, two cost rounds) in a cache of its own that
    holds an onnxruntime record already: (model, the command's result, the cache)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LANTERN_CACHE", str(cache))
        md = open_model_dir(model)
        write_record(record_path(md, "onnxruntime"), ONNX_RECORD)
        args = ["tune", str(model), "--backend", "torch", "--threads", "1", "--images", "2"]
        args += [
            "--calibration-images",
            "2",
            "--max-rounds",
            "2",
            "--tree",
            "chain-2",
            "--tree",
            "chain-4",
            "-q",
        ]
        yield md, CliRunner().invoke(main, args), cache


def test_tune_on_torch_writes_its_own_record_without_an_export(tuned) -> None:
    md, result, cache = tuned
    assert result.exit_code == 0, result.output
    assert "on torch" in result.output and "| B = 1 |" in result.output
    path = record_path(md, "torch")
    assert path.name.endswith(".torch.json") and str(path) in result.output
    data = read_record(path, this_machine("torch", "torch"))
    assert data["model"]["tuning_bundle"] is None and data["settings"]["cuda_graphs"] is True
    assert sorted(p.name for p in cache.iterdir()) == ["tuning"]  # no bundle exported
    assert {c["rounds"] for c in data["batch_sizes"]["1"]["costs_at_search"]["measured"]} == {
        2
    }  # --max-rounds
    rows = data["batch_sizes"]["1"]["candidates"]
    measured = {r["label"]: r for r in rows if r["measured_s_per_image"] is not None}
    assert set(measured) >= {"ar", "lantern++ chain-2", "lantern++ chain-4"}
    assert all(r["predicted_s_per_image"] > 0 and r["measured_s_per_image"] > 0 for r in measured.values())
    choice = data["batch_sizes"]["1"]["choice"]
    assert choice["measured_s_per_image"] == min(r["measured_s_per_image"] for r in measured.values())
    # the onnxruntime record of the same model is as it was
    kept = read_record(record_path(md, "onnxruntime"))
    assert kept["machine"]["backend"] == "onnxruntime"
    assert kept["batch_sizes"]["1"]["choice"]["label"] == "lantern++ chain-3"


def _resolved(md, capsys, backend: str) -> tuple[str, str, str]:
    plan = resolve(md, RunOptions(backend=backend))
    return plan.method.method, load_tree(plan.method.tree).name, capsys.readouterr().err


def test_each_backends_record_steers_its_own_runs_only(
    model: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    md = open_model_dir(model)
    default = _resolved(md, capsys, "torch")
    assert default[2] == ""  # no record: today's defaults, nothing said
    write_record(record_path(md, "onnxruntime"), ONNX_RECORD)
    assert _resolved(md, capsys, "torch") == default  # an onnxruntime record does not steer torch
    method, tree, said = _resolved(md, capsys, "onnxruntime")
    assert (method, tree) == ("lantern++", "chain-3") and said.count("\n") == 1
    write_record(record_path(md, "torch"), _record("torch", "lantern++ chain-2", CHAIN))
    method, tree, said = _resolved(md, capsys, "torch")
    assert (method, tree) == ("lantern++", "chain-2")
    assert said.count("\n") == 1 and "tuning record of this machine" in said and ".torch.json" in said
    assert _resolved(md, capsys, "onnxruntime")[:2] == ("lantern++", "chain-3")  # nor torch's onnxruntime
    record_path(md, "onnxruntime").unlink()
    assert _resolved(md, capsys, "onnxruntime")[2] == ""
    write_record(record_path(md, "torch"), _record("torch", "ar", None))
    assert _resolved(md, capsys, "torch")[0] == "ar"


def test_generate_on_torch_follows_the_torch_record(model: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    write_record(record_path(open_model_dir(model), "torch"), _record("torch", "lantern++ chain-2", CHAIN))
    args = ["generate", "--model", str(model), "--backend", "torch", "-n", "1", "-o", str(tmp_path / "x.png")]
    result = CliRunner().invoke(main, [*args, "-q"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if "tuning record of this machine" in line]
    assert len(notes) == 1 and "lantern++ chain-2" in notes[0]


def test_a_bundle_on_torch_is_one_line_exit_2(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")  # refused before it is read
    result = CliRunner().invoke(main, ["tune", str(bundle), "--backend", "torch", "-q"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: the torch backend runs a model directory, not a bundle")
    assert result.output.count("\n") == 1
    assert sorted(p.name for p in bundle.iterdir()) == ["manifest.json"]


DEVICE_WORK = 0.05  # seconds a device synchronisation waits in the tests below


@pytest.fixture
def slow_device(monkeypatch) -> None:
    """A CUDA device whose queued work ends only at a synchronisation, DEVICE_WORK later."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: time.sleep(DEVICE_WORK))


def test_timed_calls_and_steps_wait_for_the_device(slow_device) -> None:
    inner = SimpleNamespace(cache=SimpleNamespace(length=SimpleNamespace(is_cuda=True)), verify=lambda t: t)
    timed = _Timed(inner)
    seen: list = []
    timed.calls, timed.watch = {"verify": []}, lambda tree, out: seen.append(out)
    assert timed.verify("tree") == "tree" and seen == ["tree"]
    steps = _TimedSteps(cuda=True)
    steps["step"] = lambda: None
    steps["step"]()
    assert timed.calls["verify"][0] >= DEVICE_WORK and steps.calls[0] >= DEVICE_WORK


class _Capture:
    """Stands in for a step's capture (``Compiled``, kept in a :class:`StepCache` as a CUDA
    graph is): each made once per step kept, counting its calls."""

    made: list[_Capture] = []

    def __init__(self, step, state) -> None:
        self.step, self.calls = step, 0
        _Capture.made.append(self)

    def __call__(self, *args):
        self.calls += 1
        return self.step(*args)


def test_each_candidate_is_captured_once_in_a_decode_not_timed(model: Path, monkeypatch) -> None:
    build = session_module.build_pipeline

    def kept_steps(plan):  # the pipeline's steps kept across decodes, as CUDA graphs are
        pipe = build(plan)
        pipe.step_graphs = StepCache(compile=True)
        return pipe

    monkeypatch.setattr(session_module, "build_pipeline", kept_steps)
    monkeypatch.setattr(decode_module, "Compiled", _Capture)
    monkeypatch.setattr(_Capture, "made", [])
    md = open_model_dir(model)
    session = TuneSession(md, "torch", "cpu", 1, default_sampling(md), (chain_tree(4),))
    method = MethodConfig("lantern++", tree="chain-2")
    for candidate in (Candidate(MethodConfig("ar")), Candidate(method, chain_tree(2))):
        runs = [session.decode(candidate, 1, 1, seed) for seed in range(3)]
        capture = _Capture.made[-1]
        steps = [r.image_steps[0] for r in runs]
        assert [len(r.calls["verify"]) for r in runs] == steps  # each timed decode's steps, no more
        assert capture.calls > sum(steps)  # its capture's decode came first, untimed
    assert len(_Capture.made) == 2  # once per candidate, whatever the decodes
    seen: list = []
    session.decode(Candidate(method, chain_tree(2)), 1, 1, 0, lambda tree, out: seen.append(tree))
    assert seen and len(_Capture.made) == 2  # a watched decode runs eagerly


def test_the_gpu_check_reports_the_tune_of_a_sized_model(model: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_check, "sized_model_dir", lambda size: model)  # the tiny model for a size
    row = json.loads(json.dumps(gpu_check.tune_size("tiny", "cpu", quick=True)))  # as gpu_check.json holds it
    labels = {r["label"] for r in row["rows"] if r["measured_s_per_image"] is not None}
    assert labels >= {"ar", "lantern++ chain-2", "lantern++ chain-4"} and row["chosen"] in labels
    assert row["speedup_vs_ar"] == pytest.approx(row["ar_s_per_image"] / row["chosen_s_per_image"])
    assert row["record"].endswith(".torch.json")
    text = "\n".join(gpu_check.tune_report_lines([row]))
    assert f"| tiny | {row['chosen']} |" in text and "| B = 1 |" in text
