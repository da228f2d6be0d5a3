"""Microseconds per KV-cache commit (``KVCache.write``) on the CPU: the demo target's cache (6
layers, 5 heads, 257 slots, head_dim 32, CFG rows) at a few batch sizes B and new entries per
image S (1: an AR step; 6: a chain-5 verify or drafting call), best of five rounds.

    .venv/bin/python scripts/cache_commit_cost.py [--calls 4000]

Run it under ``PYTHONPATH=<another checkout>`` to time that checkout's commit the same way.
"""

from __future__ import annotations

import argparse
import time

import torch

from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.run_shape import RunShape

CASES = ((1, 1), (1, 6), (4, 6), (16, 1))  # (B, S)


def commit_us(images: int, new: int, calls: int) -> float:
    """Best-of-five mean microseconds of one commit of ``new`` entries for ``images`` images."""
    cache = KVCache(6, 5, 257, 32, torch.float32, "cpu", RunShape(images), prefix=1, windows=(80, 144, 208))
    k = torch.randn(6, 2 * images, 5, new, 32)
    count = torch.ones(images, dtype=torch.long)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            cache.write(k, k, count)
            cache.length.zero_()
        best = min(best, (time.perf_counter() - start) / (calls // 5))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for images, new in CASES:
        print(f"B={images:2d} S={new}: {commit_us(images, new, args.calls):6.1f} us per commit")


if __name__ == "__main__":
    main()
