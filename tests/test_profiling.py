"""``--profile`` (NVTX ranges) and CUDA-graph replay: what can be checked without a GPU here,
and the GPU checks that run where CUDA is present."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime import profiling
from lantern_rt.runtime.backends.torch_backend import TorchTarget
from lantern_rt.runtime.decode import StepCache, decode_image
from lantern_rt.runtime.sampling import SamplingConfig
from tests.conftest import tiny_gpt

STAGES = {"decode", "prefill", "verify", "kv_compaction", "vq_decode"}  # acceptance is in verify


@pytest.fixture
def fake_nvtx(monkeypatch):
    """An ``nvtx`` module that records the ranges opened, in order."""
    opened: list[tuple[str, str]] = []

    class Range:
        def __init__(self, name: str, domain: str):
            opened.append((name, domain))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(annotate=Range))
    return opened


def generate(model_dir, tmp_path, *extra: str) -> np.ndarray:
    tokens = tmp_path / f"t{len(extra)}.npy"
    args = ["generate", "-q", "--backend", "torch", "--model", str(model_dir), "--class", "1"]
    args += ["-n", "2", "-o", str(tmp_path / "g.png"), "--save-tokens", str(tokens), *extra]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return np.load(tokens)


def test_profile_opens_a_range_per_stage_and_changes_no_token(tiny_model_dir, tmp_path, fake_nvtx):
    plain = generate(tiny_model_dir, tmp_path)
    assert fake_nvtx == []  # off unless asked
    profiled = generate(tiny_model_dir, tmp_path, "--profile")
    np.testing.assert_array_equal(plain, profiled)
    names = [name for name, _ in fake_nvtx]
    assert set(names) == STAGES and {d for _, d in fake_nvtx} == {profiling.DOMAIN}
    assert names.count("decode") == 1 and names.count("prefill") == 2 and names.count("vq_decode") == 1
    assert names.count("verify") == 2 * 15  # 16 tokens: prefill + 15 steps
    assert names.count("kv_compaction") == 2 * 15  # every step commits on the device


def test_profile_without_nvtx_or_gpu_records_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with profiling.recording(True) as recorded:
        assert not recorded and profiling.span("x") is profiling.span("y")  # the shared no-op


def test_cuda_graphs_need_a_cuda_device():
    model = tiny_gpt()
    cond = torch.tensor([1, model.config.num_classes])
    greedy = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        decode_image(TorchTarget(model), cond, 4, greedy, None, step_graphs=StepCache(cuda_graphs=True))


def test_tensorrt_backend_without_tensorrt_is_one_line(tiny_model_dir, tmp_path):
    pytest.importorskip("onnxruntime")
    if "tensorrt" in sys.modules or _has("tensorrt"):
        pytest.skip("TensorRT is installed here")
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "-q",
            "--model",
            str(tiny_model_dir),
            "--backend",
            "tensorrt",
            "-o",
            str(tmp_path / "x.png"),
        ],
        env={"LANTERN_CACHE": str(tmp_path / "cache")},
    )
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert "tensorrt" in r.stderr.lower() and not (tmp_path / "x.png").exists()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; none here")
def test_cuda_graph_replay_gives_eager_tokens():
    """Greedy AR on a tiny model: replayed graphs equal eager torch (the drafter's graphs are
    compared on the demo by scripts/gpu_check.sh)."""
    model = tiny_gpt().cuda()
    cond = torch.tensor([1, model.config.num_classes], device="cuda")
    greedy = SamplingConfig(cfg_scale=2.0, temperature=0.0)
    n = model.config.block_size
    eager = decode_image(TorchTarget(model), cond, n, greedy, None)
    graphs = StepCache(cuda_graphs=True)
    replayed = decode_image(TorchTarget(model), cond, n, greedy, None, step_graphs=graphs)
    assert torch.equal(eager.tokens, replayed.tokens)
    (step,) = graphs.steps.values()
    assert len(step.graphs) == 1  # the whole step captured once, replayed n - 2 times


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; none here")
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_whole_speculative_step_replays_from_one_cuda_graph(temperature):
    """LANTERN++ on chain-3 with a random drafter: a captured whole step (draft, verify and
    accept, both commits) gives eager torch's tokens and accepted lengths, from the same seed."""
    from lantern_rt.models.drafter import Drafter, DrafterConfig
    from lantern_rt.runtime.acceptance import Relaxation
    from lantern_rt.runtime.backends.torch_backend import TorchDrafter
    from lantern_rt.runtime.decode import Speculation
    from lantern_rt.runtime.tree import load_tree

    model = tiny_gpt().cuda()
    drafter = Drafter(DrafterConfig.for_target(model.config), model.config).cuda().eval()
    cond = torch.tensor([1, model.config.num_classes], device="cuda")
    sampling = SamplingConfig(cfg_scale=2.0, temperature=temperature)
    n, relax = model.config.block_size, Relaxation("lantern++", k=3, lam=2.0)
    neighbors = torch.stack([torch.roll(torch.arange(64), -i) for i in range(1, 4)], dim=1).cuda()
    results, graphs = [], StepCache(cuda_graphs=True)
    for step_graphs in (None, graphs):
        spec = Speculation(TorchDrafter(drafter, model.output, n), load_tree("chain-3"), relax, neighbors)
        g = torch.Generator(device="cuda").manual_seed(0)
        results.append(decode_image(TorchTarget(model), cond, n, sampling, g, spec, step_graphs))
    assert torch.equal(results[0].tokens, results[1].tokens)
    assert results[0].accepted == results[1].accepted and len(graphs.steps) == 1
