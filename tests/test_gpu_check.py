"""scripts/gpu_check.sh's measurements run on any machine (the GPU machine has no network and
one try: a crash there costs the whole check)."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.eval import gpu_check
from lantern_rt.models.config import GPTConfig
from tests.conftest import TINY_GPT, tiny_gpt, tiny_vq


def test_step_costs_and_report_run_on_a_cpu(monkeypatch):
    tiny = GPTConfig(**{**TINY_GPT, "block_size": 256, "num_classes": 10})  # room for 128 + the tree
    monkeypatch.setattr(gpu_check, "gpt_config", lambda preset, **kw: tiny)
    for batch in (1, 3):
        costs = gpu_check.with_projection(
            gpu_check.step_costs("tiny", "chain-3", "cpu", torch.float32, 2, batch, compile=False), 4.0
        )
        assert all(costs[k] > 0 for k in ("ms_ar_step", "ms_verify", "ms_whole_step")), costs
        assert costs["whole_step_over_verify"] == costs["ms_whole_step"] / costs["ms_verify"]
        ar = batch / (256 * costs["ms_ar_step"] / 1e3)  # images/s at one token per AR step
        assert costs["projected_ar_images_per_s"] == ar and costs["batch"] == batch
        assert costs["projected_speedup"] == costs["projected_lantern_images_per_s"] / ar
        result = {"device_name": "cpu", "demo": [], "projection_tau": 4.0, "step_costs": [costs]}
        text = gpu_check.report(result)
        assert f"| tiny | float32 | chain-3 | {batch} |" in text and "Projections (not measurements)" in text


def test_text_conditional_step_costs_run_on_a_cpu(monkeypatch):
    """The T2I row: a caption prefix (mostly padding) and the drafter's caption pairs."""
    tiny = {**TINY_GPT, "block_size": 256, "model_type": "t2i", "cls_token_num": 12, "caption_dim": 16}
    monkeypatch.setattr(gpu_check, "gpt_config", lambda preset, **kw: GPTConfig(**tiny))
    costs = gpu_check.step_costs("tiny", "chain-3", "cpu", torch.float32, 2, 1, text=True, compile=False)
    assert costs["preset"] == "tiny T2I" and all(
        costs[k] > 0 for k in ("ms_ar_step", "ms_verify", "ms_whole_step")
    )


def test_chameleon_shaped_step_costs_run_on_a_cpu():
    """The Anole-7B row, scaled down: prompt-token prefix with per-row padding, q/k norms, 1D
    RoPE, the drafter's prompt pairs."""
    shape = dict(dim=64, n_layer=2, n_head=4, ffn_hidden_size=96, vocab_size=64, text_vocab_size=100)
    costs = gpu_check.step_costs(
        "", "chain-3", "cpu", torch.float32, 2, 2, kind="chameleon", shape=shape, compile=False
    )
    assert costs["preset"] == "Anole-7B shape" and all(
        costs[k] > 0 for k in ("ms_ar_step", "ms_verify", "ms_whole_step")
    )


def test_a_pac_window_s_verify_cost_and_projection_run_on_a_cpu(monkeypatch):
    """The drafter-free rows: a pac tree's verify against an AR step, the projection from tau."""
    tiny = GPTConfig(**{**TINY_GPT, "block_size": 256, "num_classes": 10})
    monkeypatch.setattr(gpu_check, "gpt_config", lambda preset, **kw: tiny)
    row = gpu_check.window_costs("tiny", "pac-2-1-9", 4.5, "cpu", torch.float32, 2)
    assert row["ms_ar_step"] > 0 and row["verify_over_ar_step"] == row["ms_verify"] / row["ms_ar_step"]
    assert row["projected_speedup"] == 4.5 / row["verify_over_ar_step"]
    text = "\n".join(gpu_check.window_report([row]))
    assert "| tiny | float32 | pac-2-1-9 |" in text and "projected speedup" in text


def test_a_demo_path_runs_on_a_cpu():
    """One path of the demo table (torch eager, AR, one image): the fields the report reads."""
    row = gpu_check.run_path("torch", False, gpu_check.MethodConfig("ar"), "cpu", [3])
    assert row["s_per_image"] > 0 and row["tau"] == 1.0
    assert row["greedy_tokens"].shape == (1, 256)


def test_each_demo_path_drafts_its_device_s_tree_and_is_compared_on_it(monkeypatch):
    """On a GPU machine the onnxruntime CPU path runs the CPU's tree, not the GPU's, and its
    greedy tokens are compared with paths of the same method and tree only."""
    ran = []

    def fake_run_path(backend, graphs, method, device, labels):
        ran.append((backend, graphs, method.method, method.tree))
        tokens = torch.full((1, 4), len(method.tree) if method.method == "lantern++" else 0)
        return {"s_per_image": 1.0, "tau": 1.0, "greedy_tokens": tokens}

    monkeypatch.setattr(gpu_check, "run_path", fake_run_path)
    rows = gpu_check.demo_rows("cuda", [0])
    trees = {(backend, graphs, tree) for backend, graphs, method, tree in ran if method == "lantern++"}
    cpu, gpu = gpu_check.CPU_DEFAULT_TREE, gpu_check.GPU_DEFAULT_TREE
    assert trees == {("torch", False, gpu), ("torch", True, gpu), ("onnxruntime", False, cpu)}
    assert all(r["greedy_agreement_vs_first_path"] == 1.0 for r in rows)
    text = gpu_check.report({"device_name": "x", "demo": rows, "projection_tau": 1.0, "step_costs": []})
    assert (
        f"| onnxruntime-cpu | lantern++ | {cpu} |" in text and f"| torch-eager | lantern++ | {gpu} |" in text
    )


def test_peak_bandwidth_is_read_by_device_name():
    names = {
        "NVIDIA H200": ("H200", 4.8e12),
        "NVIDIA H100 80GB HBM3": ("H100 SXM", 3.35e12),
        "NVIDIA A100-SXM4-80GB": ("A100 80GB", 2.0e12),
        "NVIDIA L4": ("L4", 0.3e12),
        "NVIDIA L40S": ("L40S", 0.864e12),
        "Orin (nvgpu)": ("Jetson Orin AGX", 0.2048e12),
    }
    for name, want in names.items():
        assert gpu_check.peak_bandwidth(name) == want, name
    assert gpu_check.peak_bandwidth("Tesla T4") is None


def test_memory_floor_counts_layer_head_and_kv_bytes_not_embeddings():
    model = tiny_gpt()
    c = model.config  # dim 32, 2 layers, vocab 64, fp32
    embeddings = sum(p.numel() for m in (model.tok_embeddings, model.cls_embedding) for p in m.parameters())
    weights = (sum(p.numel() for p in model.parameters()) - embeddings) * 4
    kv = 2 * c.n_layer * (2 * 3) * c.kv_heads * (c.cls_token_num + 10) * c.head_dim * 4  # K and V, 2B rows
    assert gpu_check.step_bytes(model, 3, 10) == weights + kv
    assert gpu_check.memory_floor_ms(model, 3, 10, 1e9) == (weights + kv) / 1e9 * 1e3


def test_cpu_kernels_count_compute_ops_not_views():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    assert gpu_check.kernels_per_call(lambda a: (a * 2 + 1).view(-1).t(), (x,)) == 2  # mul, add
    assert gpu_check.kernels_per_call(lambda a: torch.nn.functional.linear(a, w).float(), (x,)) == 1


def test_llamagen_loop_runs_on_a_cpu():
    model = tiny_gpt()
    row = gpu_check.llamagen_loop(model, 2, compiled=False)
    assert row["ms_per_step"] > 0 and row["images_per_s"] > 0 and row["first_batch_s"] > 0
    text = "\n".join(gpu_check.llamagen_report([{"model": "tiny", "batch": 2, "compiled": False, **row}]))
    assert "| tiny | 2 | no |" in text


@pytest.mark.slow
def test_compiled_step_modes_and_their_kernels_on_a_cpu(monkeypatch):
    """The compiled modes of a step-cost row (tiny, B = 1): timed, inductor's kernels counted,
    the floor at a given bandwidth, and the step-mode table."""
    tiny = GPTConfig(**{**TINY_GPT, "block_size": 256, "num_classes": 10})
    monkeypatch.setattr(gpu_check, "gpt_config", lambda preset, **kw: tiny)
    costs = gpu_check.step_costs("tiny", "chain-3", "cpu", torch.float32, 2, 1, bandwidth=1e11)
    for step in ("ar_step", "verify"):
        assert costs[f"ms_{step}_compiled"] > 0 and costs[f"inductor_kernels_{step}"] > 0
        assert costs[f"kernels_{step}"] > costs[f"inductor_kernels_{step}"] / 4
        assert costs[f"floor_ms_{step}"] > 0
    result = {"step_costs": [costs], "bandwidth": {"label": "x", "bytes_per_s": 1e11}}
    text = "\n".join(gpu_check.step_mode_report(result))
    assert "| tiny | 1 | ar_step |" in text and "| tiny | 1 | verify |" in text


def test_sized_rows_measure_each_method_with_its_floor_and_the_demo_s_tokens(monkeypatch, tmp_path):
    """The sized section on a CPU (torch eager), a tiny model standing in for both the sized
    model and the demo: speed, tau, speedup, floor and greedy agreement per method; the report's
    table and its comparison with LlamaGen's loop at that size."""
    from tests.test_bench import model_with_drafter

    model = model_with_drafter(tmp_path / "tiny", tiny_vq())
    monkeypatch.setattr(gpu_check, "sized_model_dir", lambda size: model)
    monkeypatch.setattr(gpu_check, "DEMO_DIR", model)
    methods = (gpu_check.MethodConfig("ar"), gpu_check.MethodConfig("lantern++", tree="chain-3"))
    monkeypatch.setattr(gpu_check, "SIZED_METHODS", methods)
    reference = {}
    rows = gpu_check.sized_rows("GPT-XL", "cpu", [0, 1], [0], 1e10, reference)
    assert [(r["size"], r["path"], r["method"], r["tree"]) for r in rows] == [
        ("GPT-XL", "torch-eager", "ar", None),
        ("GPT-XL", "torch-eager", "lantern++", "chain-3"),
    ]
    assert set(reference) == {(False, m) for m in methods}
    other = {key: tokens.roll(1, dims=1) for key, tokens in reference.items()}  # not this model's tokens
    assert not any(
        r["greedy_equal_to_demo"] for r in gpu_check.sized_rows("GPT-XL", "cpu", [0], [0], 1e10, other)
    )
    ar, lantern = rows
    assert ar["speedup_vs_ar"] == 1.0 and ar["tau"] == 1.0 and lantern["tau"] > 1.0
    assert lantern["speedup_vs_ar"] == ar["s_per_image"] / lantern["s_per_image"]
    for r in rows:
        assert r["images"] == 2 and r["greedy_equal_to_demo"] and r["floor_s_per_image"] > 0
        assert r["measured_over_floor"] == pytest.approx(r["s_per_image"] / r["floor_s_per_image"])
    best = min(r["s_per_image"] for r in rows)
    loops = [
        {"model": gpu_check.sized_name("GPT-XL"), "batch": 1, "compiled": False, "images_per_s": 0.5 / best}
    ]
    text = "\n".join(gpu_check.sized_report(rows, loops, "a copy loop's 10.00 GB/s"))
    assert "| GPT-XL | torch-eager | lantern++ | chain-3 | 2 |" in text and "| yes |" in text
    assert f"| {2 * best:.4f} | 2.00x | - | - |" in text  # LlamaGen eager at twice the fastest row's s/img
    assert gpu_check.sized_paths("cuda") == [("torch-eager", False), ("torch-cudagraphs", True)]
