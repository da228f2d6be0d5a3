"""Seed noise of FD on the demo: pairwise FD among three AR and two exact sample sets (onnxruntime,
chain-4, 20 images per class); exact decoding should sit inside the AR-vs-AR spread.

Run: python scripts/seed_noise.py (about 15 min on one core).
"""

import itertools
import json
import time

import torch

from lantern_rt.eval.classifier import load_classifier
from lantern_rt.eval.metrics import extract_features, frechet_distance
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.model_dir import DEMO_DIR
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig, RunPlan

SETS = [
    ("AR0", "ar", 100),
    ("AR1", "ar", 101),
    ("AR2", "ar", 102),
    ("exact0", "exact", 100),
    ("exact1", "exact", 101),
]


def main() -> None:
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    md = open_model_dir(DEMO_DIR)
    labels = [c for c in range(10) for _ in range(20)]
    sampling = SamplingConfig(cfg_scale=3.0)
    classifier = load_classifier()
    features = {}
    for name, method, seed in SETS:
        mc = MethodConfig(method, tree="chain-4")
        pipe = build_pipeline(RunPlan(md, "onnxruntime", mc, sampling, threads=1))
        t0 = time.time()
        images = generate(pipe, labels, sampling, seed=seed, progress=False).images
        features[name] = extract_features(classifier, images)[0]
        print(name, f"{time.time() - t0:.0f}s", flush=True)
    pairs = {
        f"{a}-{b}": frechet_distance(features[a], features[b]) for a, b in itertools.combinations(features, 2)
    }
    print(json.dumps(pairs, indent=1))


if __name__ == "__main__":
    main()
