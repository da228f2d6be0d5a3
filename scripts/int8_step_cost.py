"""fp32 against int8 (Q/DQ, onnxruntime's int8 kernels) for one AR step graph of a LlamaGen-shaped
target with random weights, on this CPU: the step's median seconds for each, calls alternated.

The graph is exported by the bundle's own ``export_graph`` (with its check against torch) and
quantized by ``lantern calibrate``'s ``quantize_graph`` on random valid inputs (the graph's own
example inputs: the scales, not the accuracy, matter for speed). Heavy for GPT-B and larger (a
few minutes): a benchmark, not a test.

    .venv/bin/python scripts/int8_step_cost.py [--preset GPT-B] [--threads 1] [--calls 50]
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
from lantern_rt.calibration.calibrate import quantize_graph
from lantern_rt.eval.gpu_check import _config
from lantern_rt.export.exporter import export_graph
from lantern_rt.export.graphs import TargetVerify
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.backends.onnxruntime_backend import session_options
from lantern_rt.runtime.tree import ROOT_ONLY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="GPT-B", help="LlamaGen preset (GPT-B, GPT-L, ...)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=50, help="timed calls per graph")
    parser.add_argument("--batch", type=int, default=1, help="images per call")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(_config(args.preset, "c2i")).eval()
    graph = TargetVerify(model, ROOT_ONLY, 1, AR_STEP_GRAPH, args.batch)
    folder = Path(tempfile.mkdtemp(prefix="lantern-int8-"))
    with torch.no_grad():
        export_graph(graph, graph, folder, threads=args.threads)
    fp32 = folder / f"{graph.spec.name}.onnx"
    names = [t.name for t in graph.spec.inputs]
    samples = [
        {
            n: x.numpy()
            for n, x in zip(names, graph.example_inputs(torch.Generator().manual_seed(s)), strict=True)
        }
        for s in range(8)
    ]
    int8 = folder / "int8" / fp32.name
    int8.parent.mkdir()
    quantize_graph(fp32, int8, samples, model.config.vocab_size)
    sessions = {
        name: ort.InferenceSession(
            str(path), session_options(args.threads), providers=["CPUExecutionProvider"]
        )
        for name, path in (("fp32", fp32), ("int8", int8))
    }
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for i in range(args.calls + 3):
        for name, session in sessions.items():
            t0 = time.perf_counter()
            session.run(None, samples[i % len(samples)])
            if i >= 3:  # warm-up calls
                times[name].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"{args.preset} ({params:.0f}M parameters), AR step at B = {args.batch}, {args.threads} thread(s): "
        f"fp32 {medians['fp32']:.2f} ms, int8 {medians['int8']:.2f} ms, "
        f"int8 speedup {medians['fp32'] / medians['int8']:.2f}x"
    )


if __name__ == "__main__":
    main()
