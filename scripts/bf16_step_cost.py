"""bf16 against fp32 on this CPU: whether onnxruntime's CPU provider runs a bf16 MatMul, and the
torch backend's AR step and chain-5 verify (``TorchTarget.verify``: the target's step and the
acceptance, one call, as ``gpu_check.verify_call`` sets it up) in fp32 and in bf16, random
weights, B = 1 with guidance, a half-full cache, the two dtypes alternated in rounds.
onnxruntime's fp32 and int8 steps of the same shape: ``scripts/drafting_step_cost.py`` and
``scripts/int8_step_cost.py``. A benchmark, not a test.

    .venv/bin/python scripts/bf16_step_cost.py [--preset GPT-B|demo] [--threads 1] [--calls 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from lantern_rt.eval.gpu_check import RELAX, SAMPLING, _config, verify_call
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.acceptance import relax_inputs
from lantern_rt.runtime.sampling import filter_inputs
from lantern_rt.runtime.tree import ROOT_ONLY, chain_tree

ROUNDS = 3


def onnxruntime_bf16_matmul() -> str:
    """'yes', or onnxruntime's reason for refusing a bf16 MatMul on its CPU provider."""
    a = helper.make_tensor_value_info("a", TensorProto.BFLOAT16, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 8])
    w = helper.make_tensor("w", TensorProto.BFLOAT16, [8, 8], np.zeros(64, np.uint16).tobytes(), raw=True)
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "g", [a], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return str(exc).splitlines()[0]
    return "yes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="GPT-B", help="LlamaGen preset (GPT-B, GPT-L, ...) or demo")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per graph and round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"onnxruntime {ort.__version__} CPU provider, bf16 MatMul: {onnxruntime_bf16_matmul()}")
    config = open_model_dir(None).gpt if args.preset == "demo" else _config(args.preset, "c2i")
    fp32 = Transformer(config).eval()
    models = {"fp32": fp32, "bf16": Transformer(config).eval()}
    models["bf16"].load_state_dict(fp32.state_dict())
    models["bf16"].to(torch.bfloat16)
    vocab = config.vocab_size
    cpu = torch.device("cpu")
    relax = relax_inputs(RELAX, torch.randint(vocab, (vocab, 10)), vocab, False, cpu)
    filters = filter_inputs(SAMPLING, cpu)
    cond = torch.tensor([0, config.num_classes])
    calls = {}
    for dtype, model in models.items():
        for name, tree in (("AR step", ROOT_ONLY), ("verify chain-5", chain_tree(5))):
            call, inputs = verify_call(model, tree, 1, cond, None, filters, relax)
            calls[dtype, name] = partial(call, *inputs)
    ms: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(ROUNDS):
        for key, call in calls.items():
            for _ in range(2):
                call()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            ms[key].append((time.perf_counter() - t0) / args.calls * 1e3)
    params = sum(p.numel() for p in fp32.parameters()) / 1e6
    print(f"{args.preset} ({params:.0f}M parameters), torch {torch.__version__}, {args.threads} thread(s):")
    for name in ("AR step", "verify chain-5"):
        a, b = statistics.median(ms["fp32", name]), statistics.median(ms["bf16", name])
        print(f"  {name}: fp32 {a:.2f} ms, bf16 {b:.2f} ms ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
