"""Host time per decode step on onnxruntime: step wall time minus the time inside graph calls.

    .venv/bin/python scripts/host_time.py --threads 1 -n 2 --tree chain-5

Runs the demo on onnxruntime (AR and LANTERN++ k=10, lambda=5) with every graph call timed
(``OrtGraph.__call__`` wrapped from outside, so the script measures any commit of the package:
run it with ``PYTHONPATH=<checkout>`` to measure another one), and prints per method the decode
seconds per image, the seconds inside graph calls, the steps per image and the host milliseconds
per step. One warm-up image per method first.
"""

from __future__ import annotations

import argparse
import time

import torch

from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.backends import onnxruntime_backend
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig, RunPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-n", type=int, default=2, help="images per class")
    parser.add_argument("--tree", default="chain-5")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    inside = [0.0]
    call = onnxruntime_backend.OrtGraph.__call__

    def timed(self, *tensors, **named):  # graphs called by position (older commits) or by name
        t0 = time.perf_counter()
        try:
            return call(self, *tensors, **named)
        finally:
            inside[0] += time.perf_counter() - t0

    onnxruntime_backend.OrtGraph.__call__ = timed
    md = open_model_dir(None)
    labels = [c for c in range(md.gpt.num_classes) for _ in range(args.n)]
    sampling = SamplingConfig(cfg_scale=3.0)
    print(f"threads {args.threads}, {len(labels)} images, tree {args.tree}")
    print(f"{'method':<10} {'s/image':>8} {'in graphs':>10} {'steps':>6} {'host ms/step':>13}")
    for method in ("ar", "lantern++"):
        mc = MethodConfig(method, tree=args.tree)
        pipe = build_pipeline(RunPlan(md, "onnxruntime", mc, sampling, threads=args.threads))
        generate(pipe, labels[:1], sampling, seed=args.seed + 1, progress=False)  # warm-up
        inside[0] = 0.0
        result = generate(pipe, labels, sampling, seed=args.seed, progress=False)
        stats = result.stats
        decode = stats["decode_seconds"] if isinstance(stats, dict) else stats.decode_seconds
        calls = stats["target_calls"] if isinstance(stats, dict) else stats.target_calls
        steps = calls - len(labels)  # verify calls; each image's prefill is not a step
        graph_seconds = inside[0] - _vq_seconds(stats)
        host = (decode - graph_seconds) / steps * 1e3
        print(
            f"{method:<10} {decode / len(labels):8.4f} {graph_seconds / len(labels):10.4f} "
            f"{steps / len(labels):6.1f} {host:13.3f}"
        )


def _vq_seconds(stats) -> float:
    """The VQ decode's graph time: timed as a graph call, but outside the decode loop."""
    return stats["vq_decode_seconds"] if isinstance(stats, dict) else stats.vq_decode_seconds


if __name__ == "__main__":
    main()
