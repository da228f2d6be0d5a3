"""scripts/gpu_check.sh's measurements run on any machine (the GPU machine has no network and
one try: a crash there costs the whole check)."""

from __future__ import annotations

import torch

from lantern_rt.eval import gpu_check
from lantern_rt.models.config import GPTConfig
from tests.conftest import TINY_GPT


def test_step_costs_and_report_run_on_a_cpu(monkeypatch):
    tiny = GPTConfig(**{**TINY_GPT, "block_size": 256, "num_classes": 10})  # room for 128 + the tree
    monkeypatch.setattr(gpu_check, "gpt_config", lambda preset, **kw: tiny)
    for batch in (1, 3):
        costs = gpu_check.with_projection(
            gpu_check.step_costs("tiny", "chain-3", "cpu", torch.float32, 2, batch), 4.0
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
    costs = gpu_check.step_costs("tiny", "chain-3", "cpu", torch.float32, 2, 1, text=True)
    assert costs["preset"] == "tiny T2I" and all(
        costs[k] > 0 for k in ("ms_ar_step", "ms_verify", "ms_whole_step")
    )


def test_chameleon_shaped_step_costs_run_on_a_cpu():
    """The Anole-7B row, scaled down: prompt-token prefix with per-row padding, q/k norms, 1D
    RoPE, the drafter's prompt pairs."""
    shape = dict(dim=64, n_layer=2, n_head=4, ffn_hidden_size=96, vocab_size=64, text_vocab_size=100)
    costs = gpu_check.step_costs("", "chain-3", "cpu", torch.float32, 2, 2, kind="chameleon", shape=shape)
    assert costs["preset"] == "Anole-7B shape" and all(
        costs[k] > 0 for k in ("ms_ar_step", "ms_verify", "ms_whole_step")
    )


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
