"""What a run takes when the user leaves it unset: the model's ``sampling_defaults`` (in every
command, the Python API and the bundle), the tree ``lantern export`` writes, and the CPU threads,
capped at the cores the process may use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.assembly import torch_pipeline
from lantern_rt.cli import main
from lantern_rt.eval.bench import BenchSettings, bench_plans
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.run_options import RunOptions
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import (
    CPU_DEFAULT_TREE,
    GPU_DEFAULT_TREE,
    MethodConfig,
    capped_threads,
    export_tree,
    resolve,
)
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir

# every key differs from the library's defaults (temperature 1, top-k 0, top-p 1)
MODEL_SAMPLING = {"cfg_scale": 2.5, "temperature": 0.7, "top_k": 3, "top_p": 0.9}


def with_sampling(root: Path, values: dict) -> Path:
    """A tiny model directory at ``root`` whose config.json has these ``sampling_defaults``."""
    write_model_dir(root, tiny_gpt(), tiny_vq())
    config = json.loads((root / "config.json").read_text())
    config["sampling_defaults"] = values
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def sampled_dir(tmp_path: Path) -> Path:
    return with_sampling(tmp_path / "sampled", MODEL_SAMPLING)


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def generated(model: Path, tmp_path: Path, *args: str) -> tuple[dict, np.ndarray]:
    """``lantern generate`` on torch: (its stats JSON, its tokens)."""
    stats, tokens = tmp_path / "s.json", tmp_path / "t.npy"
    r = cli(
        "generate", "-q", "--backend", "torch", "--model", str(model), "--class", "0,1", "-n", "2",
        "-o", str(tmp_path / "g.png"), "--stats-json", str(stats), "--save-tokens", str(tokens), *args,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return json.loads(stats.read_text()), np.load(tokens)


# --- sampling_defaults --------------------------------------------------------------------------


def test_generate_samples_as_the_model_says_unless_told(sampled_dir, tmp_path):
    stats, _ = generated(sampled_dir, tmp_path)
    assert stats["sampling"] == MODEL_SAMPLING
    flags = ["--cfg-scale", "1.5", "--temperature", "1.2", "--top-k", "0", "--top-p", "1"]
    stats, _ = generated(sampled_dir, tmp_path, *flags)
    assert stats["sampling"] == {"cfg_scale": 1.5, "temperature": 1.2, "top_k": 0, "top_p": 1.0}
    stats, _ = generated(sampled_dir, tmp_path, "--greedy", "--top-p", "0.5")
    assert stats["sampling"] == {**MODEL_SAMPLING, "temperature": 0.0, "top_p": 0.5}


def test_the_model_s_top_k_decides_the_tokens(tmp_path):
    """top-k 1 keeps the most likely token alone: the model's top_k 1 samples greedy tokens at
    temperature 1, and --top-k 0 (off) samples others."""
    model = with_sampling(tmp_path / "top1", {"top_k": 1})
    _, greedy = generated(model, tmp_path, "--greedy", "--top-k", "0")
    stats, by_model = generated(model, tmp_path)
    assert stats["sampling"]["temperature"] == 1.0 and stats["sampling"]["top_k"] == 1
    assert np.array_equal(by_model, greedy)
    _, unfiltered = generated(model, tmp_path, "--top-k", "0")
    assert not np.array_equal(unfiltered, greedy)


def test_generate_set_samples_as_the_model_says(sampled_dir, tmp_path):
    out = tmp_path / "set"
    common = ["generate-set", "-q", "--backend", "torch", "--model", str(sampled_dir), "--class", "0"]
    r = cli(*common, "-n", "2", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads((out / "settings.json").read_text())["sampling"] == MODEL_SAMPLING
    r = cli(*common, "-n", "2", "--top-k", "5", "--out", str(tmp_path / "set-k5"))
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "set-k5" / "settings.json").read_text())["sampling"]["top_k"] == 5


def test_bench_samples_as_the_model_says(sampled_dir, tmp_path):
    md = open_model_dir(sampled_dir)
    plans = bench_plans(md, BenchSettings(out=tmp_path, configs=("ar",)))
    assert {plan.sampling for plan in plans} == {SamplingConfig(**MODEL_SAMPLING)}
    options = RunOptions(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=4.0)
    told = bench_plans(md, BenchSettings(out=tmp_path, configs=("ar",), options=options))
    assert {plan.sampling for plan in told} == {SamplingConfig(4.0, 1.0, 0, 1.0)}
    params = {p.name: p for p in next(c for n, c in main.commands.items() if n == "bench").params}
    assert all(params[key].default is None for key in ("cfg_scale", "temperature", "top_k", "top_p"))


def test_the_python_api_samples_as_the_model_says(sampled_dir):
    md = open_model_dir(sampled_dir)
    result = generate(torch_pipeline(md, MethodConfig()), [0], progress=False)
    assert result.stats.sampling == SamplingConfig(**MODEL_SAMPLING)
    assert resolve(md).sampling == SamplingConfig(**MODEL_SAMPLING)
    assert resolve(md, RunOptions(top_k=7, greedy=True)).sampling == SamplingConfig(2.5, 0.0, 7, 0.9)


def test_a_model_without_sampling_defaults_gets_the_library_s(tmp_path):
    md = open_model_dir(with_sampling(tmp_path / "none", {}))
    assert resolve(md).sampling == SamplingConfig(4.0, 1.0, 0, 1.0)  # LlamaGen's class-conditional CFG
    demo = open_model_dir(None)  # the demo's config says the library's values: its runs are unchanged
    assert resolve(demo).sampling == SamplingConfig(3.0, 1.0, 0, 1.0)


def test_a_top_k_that_is_not_an_integer_is_refused(tmp_path):
    model = with_sampling(tmp_path / "bad", {"top_k": 2.5})
    r = cli("generate", "-q", "--model", str(model), "-o", str(tmp_path / "x.png"))
    assert r.exit_code == 2 and "sampling_defaults.top_k must be an integer, got 2.5" in r.output
    assert r.output.count("\n") == 1 and not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_a_bundle_carries_the_model_s_sampling_and_the_device_s_tree(sampled_dir, tmp_path):
    """``lantern export`` with no --tree on a CPU writes chain-5 (the tree generate runs there),
    ``generate --bundle`` samples as the model's config said, with an explicit flag winning, and
    a manifest whose sampling_defaults are not the model's kind is refused in one line."""
    bundle = tmp_path / "bundle"
    args = ["--device", "cpu", "--cache-windows", "1", "--out", str(bundle)]
    r = cli("export", "-q", "--model", str(sampled_dir), *args)
    assert r.exit_code == 0, r.output
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert list(manifest["trees"]) == [CPU_DEFAULT_TREE]
    assert manifest["sampling_defaults"] == MODEL_SAMPLING
    stats = tmp_path / "s.json"
    r = cli(
        "generate", "-q", "--bundle", str(bundle), "--method", "sjd", "--class", "0", "-n", "1",
        "-o", str(tmp_path / "g.png"), "--stats-json", str(stats),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(stats.read_text())["sampling"] == MODEL_SAMPLING
    r = cli(
        "generate", "-q", "--bundle", str(bundle), "--class", "0", "-n", "1", "--top-k", "0",
        "-o", str(tmp_path / "g.png"), "--stats-json", str(stats),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(stats.read_text())["sampling"] == {**MODEL_SAMPLING, "top_k": 0}
    manifest["sampling_defaults"]["top_k"] = 2.5
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    r = cli("generate", "-q", "--bundle", str(bundle), "-o", str(tmp_path / "never.png"))
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "sampling_defaults.top_k must be an integer, got 2.5" in r.output
    assert not (tmp_path / "never.png").exists()


# --- the export's tree ----------------------------------------------------------------------------


@pytest.fixture
def has_cuda(monkeypatch):
    """torch sees one CUDA device (no CUDA call is made: the export's tree is chosen, no more)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_the_export_s_tree_is_generate_s_on_the_cpu(tiny_model_dir):
    md = open_model_dir(tiny_model_dir)
    assert export_tree("cpu") == resolve(md, RunOptions(device="cpu")).method.tree == CPU_DEFAULT_TREE
    if not torch.cuda.is_available():
        assert export_tree() == CPU_DEFAULT_TREE  # this machine
        assert export_tree("cuda:1") == GPU_DEFAULT_TREE  # a bundle for another machine's GPU


def test_the_export_s_tree_is_generate_s_on_a_gpu(tiny_model_dir, has_cuda):
    md = open_model_dir(tiny_model_dir)
    assert export_tree("cuda") == resolve(md, RunOptions(device="cuda")).method.tree == GPU_DEFAULT_TREE
    assert export_tree() == GPU_DEFAULT_TREE  # this machine (as torch sees it here)
    assert export_tree("cpu") == CPU_DEFAULT_TREE


def test_export_refuses_a_device_it_has_not(tiny_model_dir, tmp_path):
    out = tmp_path / "b"
    r = cli(
        "export", "--model", str(tiny_model_dir), "--device", "bogus", "--tree", "chain-1", "--out", str(out)
    )
    assert r.exit_code == 2 and "--device 'bogus' is not a torch device" in r.output
    assert not out.exists()


# --- threads --------------------------------------------------------------------------------------


@pytest.fixture
def two_cores(monkeypatch):
    """The process may run on two cores (its CPU affinity), whatever the machine has."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)


def test_threads_are_capped_at_the_cores_with_a_warning(two_cores, capsys):
    assert capped_threads(64) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: --threads 64 is more than the 2 CPU cores")
    assert [capped_threads(n) for n in (2, 1, 0, None)] == [2, 1, 0, None]
    assert capsys.readouterr().err == ""


def test_without_an_affinity_the_cap_is_the_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert capped_threads(8) == 3 and capped_threads(3) == 3


def test_every_command_with_threads_caps_them_and_says_so(two_cores):
    with_threads = {
        name: next(p for p in command.params if p.name == "threads")
        for name, command in main.commands.items()
        if any(p.name == "threads" for p in command.params)
    }
    assert {"generate", "generate-set", "bench", "calibrate", "train-drafter"} <= set(with_threads)
    for name, param in with_threads.items():
        ctx = click.Context(main.commands[name])
        assert param.process_value(ctx, "64") == 2, name
        assert param.process_value(ctx, "2") == 2, name
        assert "capped" in param.help, name


def test_generate_runs_on_the_capped_threads(two_cores, tiny_model_dir, tmp_path, monkeypatch):
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    r = cli(
        "generate", "-q", "--backend", "torch", "--model", str(tiny_model_dir), "--class", "0", "-n", "1",
        "--threads", "64", "-o", str(tmp_path / "g.png"),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert asked == [2]
    assert "warning: --threads 64 is more than the 2 CPU cores this process may use: using 2" in r.stderr
