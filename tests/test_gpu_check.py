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
    costs = gpu_check.step_costs("tiny", "chain-3", "cpu", torch.float32, 2)
    assert all(costs[k] > 0 for k in ("ms_ar_step", "ms_verify", "ms_whole_step")), costs
    assert costs["whole_step_over_verify"] == costs["ms_whole_step"] / costs["ms_verify"]
    text = gpu_check.report({"device_name": "cpu", "demo": [], "step_costs": [costs]})
    assert "| tiny | float32 | chain-3 |" in text


def test_a_demo_path_runs_on_a_cpu():
    """One path of the demo table (torch eager, AR, one image): the fields the report reads."""
    row = gpu_check.run_path("torch", False, gpu_check.MethodConfig("ar"), "cpu", [3])
    assert row["s_per_image"] > 0 and row["tau"] == 1.0
    assert row["greedy_tokens"].shape == (1, 256)
