"""Images whose tokens differ between batch sizes 1 and 16 (same seed): the demo's 40 images on
onnxruntime and torch, AR and LANTERN++, greedy and sampled (BENCHMARKS.md).

    .venv/bin/python scripts/batch_invariance.py
"""

import torch

from lantern_rt.bundle import Bundle
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig, RunPlan

torch.set_num_threads(2)
md = open_model_dir(None)
bundle = Bundle.open(cached_bundle(md, MethodConfig("lantern++", tree="chain-5"), batch_sizes=[1, 4, 16]))
labels = [c for c in range(10) for _ in range(4)]
for backend in ("onnxruntime", "torch"):
    src = bundle if backend == "onnxruntime" else md
    for method in ("ar", "lantern++"):
        mc = MethodConfig(method, tree="chain-5")
        for name, s in (("greedy", SamplingConfig(4.0, 0.0)), ("sampled", SamplingConfig(4.0, 1.0))):
            toks = {}
            for B in (1, 16):
                plan = RunPlan(src, backend, mc, s, RunShape(B), threads=2, cuda_graphs=False)
                pipe = build_pipeline(plan)
                toks[B] = generate(pipe, labels, s, seed=0, progress=False).tokens
            differ = int((toks[1] != toks[16]).any(1).sum())
            print(
                f"{backend} {method} {name}: {differ}/{len(labels)} images differ, {(toks[1] != toks[16]).float().mean():.4f} of tokens",
                flush=True,
            )
