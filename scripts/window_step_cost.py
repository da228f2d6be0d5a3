"""A target step's cost against the cache window it reads, on onnxruntime (CPU): for each batch
size and cache window of a bundle, the AR step and each tree's verify step, called alternately
(one call per window in turn, ``--calls`` rounds), median milliseconds per call.

    .venv/bin/python scripts/window_step_cost.py BUNDLE [--threads 1] [--calls 200]

Each call sees a cache filled to its window's end (the longest image a window serves), random
cache contents and draft tokens, sampling without filters (CFG 3). The whole-cache row is what
every step read before cache windows (docs/method.md §12).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lantern_rt.bundle import Bundle
from lantern_rt.runtime.acceptance import Relaxation, relax_inputs
from lantern_rt.runtime.backends.base import Draft
from lantern_rt.runtime.backends.bundle_graphs import BundleTarget, bundle_trees
from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner
from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs
from lantern_rt.runtime.tree import ROOT_ONLY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    bundle = Bundle.open(args.bundle)
    c = bundle.constants
    trees = {"ar": ROOT_ONLY} | {
        name: t for name, t in bundle_trees(bundle).items() if bundle.trees[name].verify
    }
    filters = filter_inputs(SamplingConfig(cfg_scale=3.0), torch.device("cpu"))
    print(f"threads {args.threads}, {args.calls} calls per row, cache {c.cache_capacity} slots")
    print("B  step      " + "".join(f"{f'w {w}':>10}" for w in c.cache_windows))
    for batch in c.batch_sizes:
        target = BundleTarget(bundle.batch(batch), ort_runner(threads=args.threads), "onnxruntime")
        cache = target.cache
        for name, tree in trees.items():
            table = None if tree is ROOT_ONLY else bundle.neighbors()  # AR's step credits none
            relax = relax_inputs(Relaxation("exact"), table, c.vocab_size, False, torch.device("cpu"))
            s = tree.num_nodes + 1
            draft = Draft(
                torch.randint(c.vocab_size, (batch, s)),
                torch.ones(batch, s, dtype=torch.bool),
                torch.softmax(torch.randn(batch, s, c.vocab_size), -1),
            )
            noise, bonus = torch.rand(batch, s), torch.rand(batch, c.vocab_size)
            times: dict[int, list[float]] = {w: [] for w in c.cache_windows}
            for _ in range(args.calls):
                for w in c.cache_windows:
                    cache.fit(w)
                    cache.length.fill_(w - tree.max_depth - 2)
                    start = time.perf_counter()
                    target.verify(tree, draft, noise, bonus, filters, relax)
                    times[w].append(time.perf_counter() - start)
            row = "".join(f"{statistics.median(t) * 1e3:>8.3f}ms" for t in times.values())
            print(f"{batch:<3}{name:<10}{row}")


if __name__ == "__main__":
    main()
