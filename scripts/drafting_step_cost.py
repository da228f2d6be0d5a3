"""A LlamaGen-shaped target's AR step, chain-5 verify and one-layer drafter's chain-5 drafting on
onnxruntime (CPU), random weights: each graph's median milliseconds per call, and the drafting
and verify calls as multiples of an AR step.

The graphs are the bundle's own (``export_graph``, with its check against torch), at B = 1 with
guidance (two rows), reading the whole cache, their inputs bound in place as the runtime binds
them. The calls run as in their decode loops, in rounds: AR steps back to back, then drafting
and verify calls taking turns (a small model's weights stay in the CPU's caches between AR
steps, not between a drafting and a verify call). What a LANTERN++ step costs against the AR
steps it replaces, without the host's share: ``tau`` AR steps against one drafting plus one
verify call. Heavy for GPT-L and larger (minutes, gigabytes): a benchmark, not a test.

    .venv/bin/python scripts/drafting_step_cost.py [--preset GPT-B|demo] [--threads 1] [--calls 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

from lantern_rt.bundle import AR_STEP_GRAPH
from lantern_rt.eval.gpu_check import _config
from lantern_rt.export.exporter import NEIGHBORS_K, export_graph
from lantern_rt.export.graphs import DrafterTree, TargetVerify
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.backends.onnxruntime_backend import session_options
from lantern_rt.runtime.drafting import drafter_capacity
from lantern_rt.runtime.tree import ROOT_ONLY, chain_tree

ROUND = 10  # calls of one loop in a row: AR steps back to back, drafting and verify taking turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="GPT-B", help="LlamaGen preset (GPT-B, GPT-L, ...) or demo")
    parser.add_argument("--threads", type=int, default=1, help="the target graphs' threads (drafting: 1)")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per graph")
    parser.add_argument("--tau", type=float, default=4.61, help="mean accepted length (the demo's)")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = open_model_dir(None).gpt if args.preset == "demo" else _config(args.preset, "c2i")
    model = Transformer(config).eval()
    drafter = Drafter(DrafterConfig.for_target(config), config).eval()
    chain = chain_tree(5)
    capacity = drafter_capacity(config.cls_token_num, config.block_size)
    graphs = {
        "AR step": TargetVerify(model, ROOT_ONLY, 1, AR_STEP_GRAPH),
        "verify": TargetVerify(model, chain, min(NEIGHBORS_K, config.vocab_size - 1), "target_verify_0"),
        "drafting": DrafterTree(drafter, model.output, chain, capacity, "draft_tree_0", layout=config),
    }
    folder = Path(tempfile.mkdtemp(prefix="lantern-drafting-"))
    sessions, bindings = {}, {}
    for label, graph in graphs.items():
        with torch.no_grad():
            export_graph(graph, graph, folder, threads=args.threads)
        path = folder / f"{graph.spec.name}.onnx"
        threads = 1 if label == "drafting" else args.threads
        sessions[label] = ort.InferenceSession(
            str(path), session_options(threads), providers=["CPUExecutionProvider"]
        )
        inputs = graph.example_inputs(torch.Generator().manual_seed(1))
        bindings[label] = binding = sessions[label].io_binding()  # inputs bound in place, as the runtime does
        for spec, x in zip(graph.spec.inputs, inputs, strict=True):
            binding.bind_ortvalue_input(spec.name, ort.OrtValue.ortvalue_from_numpy(x.numpy()))
        for spec in graph.spec.outputs:
            binding.bind_output(spec.name, "cpu")
    times: dict[str, list[float]] = {label: [] for label in sessions}
    loops = (("AR step",), ("drafting", "verify"))  # each call in the company it keeps in its loop
    for _ in range(max(1, args.calls // ROUND)):
        for loop in loops:
            for i in range(ROUND + 1):
                for label in loop:
                    t0 = time.perf_counter()
                    sessions[label].run_with_iobinding(bindings[label])
                    if i:  # the round's first calls warm it up
                        times[label].append(time.perf_counter() - t0)
    ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
    ar = ms["AR step"]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"{args.preset} ({params:.0f}M parameters, {config.n_layer} layers, width {config.dim}), "
        f"B = 1, CFG, {args.threads} thread(s): AR step {ar:.2f} ms, "
        f"verify chain-5 {ms['verify']:.2f} ms ({ms['verify'] / ar:.2f} AR steps), "
        f"drafting chain-5 {ms['drafting']:.2f} ms ({ms['drafting'] / ar:.2f} AR steps); "
        f"at tau {args.tau}: LANTERN++ <= {args.tau * ar / (ms['verify'] + ms['drafting']):.2f}x AR "
        f"({args.tau * ar / ms['verify']:.2f}x with free drafting), graphs only"
    )


if __name__ == "__main__":
    main()
