"""Replacing finished images (one call over all jobs) vs batch by batch (one call per B jobs):
onnxruntime LANTERN++ (chain-5) on the demo, sampled, 64 images, two interleaved rounds, best
of the two (BENCHMARKS.md, batched generation).

    .venv/bin/python scripts/batch_refill.py 1
"""

from __future__ import annotations

import sys
import time

import torch

from lantern_rt.assembly import onnxruntime_pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    method = MethodConfig("lantern++", tree="chain-5")
    bundle = Bundle.open(cached_bundle(open_model_dir(None), method, batch_sizes=[1, 4, 16]))
    sampling = SamplingConfig(4.0, 1.0)
    labels = [i % 10 for i in range(64)]
    for batch in (4, 16):
        pipe = onnxruntime_pipeline(bundle, method, RunShape(batch), threads=threads)
        generate(pipe, labels[:batch], sampling, progress=False)  # warm-up

        def batchwise(pipe=pipe, batch=batch) -> None:
            for i in range(0, len(labels), batch):
                generate(pipe, labels[i : i + batch], sampling, progress=False, start_index=i)

        runs = {"replacing": [], "batch by batch": []}
        for _ in range(2):
            runs["replacing"].append(
                seconds(lambda pipe=pipe: generate(pipe, labels, sampling, progress=False))
            )
            runs["batch by batch"].append(seconds(batchwise))
        per_image = {name: f"{min(t) / len(labels):.4f} s/img" for name, t in runs.items()}
        print(f"threads {threads}, B {batch}: {per_image}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
