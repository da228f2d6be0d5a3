"""Measure tau (tokens per verify step) of drafter trees on the demo and compare it with what
``lantern tune``'s calibration predicts (issue 61, BENCHMARKS.md "chain-8's predicted tau").

    LANTERN_CACHE=DIR .venv/bin/python scripts/tune_tau.py OUT.pkl TREE:SEED:IMAGES ...
    .venv/bin/python scripts/tune_tau.py --report OUT.pkl ... [--calibration N ...]

The first form decodes IMAGES images of each TREE (B = 1, lantern++ k=10 lambda=5, one thread,
image i of class (SEED + i) mod 10 as tune's decodes) on tune's own export, and keeps every
verify step's accepted ranks and committed tokens. The second prints each recorded run's tau
(committed, and untruncated: the last step's cut undone) and, for the first N images of
spine-4-8 and chain-8 at one seed, each named tree's tau as tune predicts it: "old" (every
position pooled over both trees, per step) and "new" (rank 0 from the chain, per whole image),
with each estimate's spread over class-stratified resamples of the recorded images (image i
drawn among the recorded images of its class, the same image for both trees).
"""

from __future__ import annotations

import argparse
import pickle
import time

import numpy as np

from lantern_rt.runtime.tree import StaticTree
from lantern_rt.tune.acceptance import AcceptanceCounts, pooled_counts
from lantern_rt.tune.dp import expected_tokens, image_tokens_per_step

CLASSES, TOKENS = 10, 255  # the demo's classes; tokens after the prefill's first


def _trees():
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.settings import MethodConfig
    from lantern_rt.tune.tuner import DRAFTER_TREES, TuneOptions, Tuner, _named

    method = MethodConfig("lantern++", k=10, lam=5.0)
    tuner = Tuner(open_model_dir(None), TuneOptions((method,), threads=1))
    calibration = tuner.calibration(False)
    named, _ = _named(DRAFTER_TREES, tuner.fits(False))
    return tuner, method, {t.name: t for t in [*calibration, *named]}


def record(out: str, runs: list[str]) -> None:
    from lantern_rt.tune.session import Candidate

    tuner, method, trees = _trees()
    session = tuner._session(list(trees.values()))  # tune's own export
    recorded = {}
    for run in runs:
        name, seed, images = run.split(":")
        tree, paths = trees[name], []

        def watch(t: StaticTree, out, paths=paths) -> None:
            kept, n = out.kept[0].tolist(), int(out.length[0])
            paths.append(tuple(t.ranks[kept[d]] for d in range(1, n + 1)))

        start = time.perf_counter()
        decoded = session.decode(Candidate(method, tree), 1, int(images), int(seed), watch)
        per_image, i = [], 0
        for steps in decoded.image_steps:
            per_image.append({"paths": paths[i : i + steps], "committed": decoded.committed[i : i + steps]})
            i += steps
        recorded[(name, int(seed))] = per_image
        print(f"{run}: {time.perf_counter() - start:.1f} s, tau {decoded.tokens_per_step:.3f}", flush=True)
    with open(out, "wb") as f:
        pickle.dump(recorded, f)


def _counts(tree: StaticTree, images: list[dict]) -> AcceptanceCounts:
    ids = {path: i + 1 for i, path in enumerate(tree.paths)}
    counts = AcceptanceCounts(8, 4)
    for image in images:
        for path in image["paths"]:
            counts.count_step(tree, [0, *(ids[path[:d]] for d in range(1, len(path) + 1))], len(path))
    return counts


def _predict(trees: dict, spine: list[dict], chain: list[dict]) -> tuple[dict, dict]:
    counted = [
        (trees["spine-4-8"], _counts(trees["spine-4-8"], spine)),
        (trees["chain-8"], _counts(trees["chain-8"], chain)),
    ]
    everything = AcceptanceCounts(8, 4)
    for _, counts in counted:
        everything.tests += counts.tests
        everything.accepts += counts.accepts
    old, new = everything.table("old").probabilities(), pooled_counts(counted).table("new").probabilities()
    names = [n for n in trees if n != "spine-4-8"]
    return (
        {n: expected_tokens(trees[n], old) for n in names},
        {n: image_tokens_per_step(trees[n], new, TOKENS) for n in names},
    )


def report(files: list[str], calibration: list[int], resamples: int) -> None:
    recorded: dict = {}
    for name in files:
        with open(name, "rb") as f:
            recorded.update(pickle.load(f))
    _, _, trees = _trees()
    for (name, seed), images in sorted(recorded.items()):
        committed = [c for image in images for c in image["committed"]]
        full = [len(p) + 1 for image in images for p in image["paths"]]
        print(
            f"{name} seed {seed}, {len(images)} images: tau {np.mean(committed):.3f} (untruncated {np.mean(full):.3f})"
        )
        if len(images) >= 2 * CLASSES:  # each class's tau over its images, classes 0-9
            by_class = [images[(k - seed) % CLASSES :: CLASSES] for k in range(CLASSES)]
            taus = [np.mean([c for image in ims for c in image["committed"]]) for ims in by_class]
            print("  classes 0-9: " + " ".join(f"{t:.2f}" for t in taus))

    for (name, seed), spine in sorted(recorded.items()):
        chain = recorded.get(("chain-8", seed))
        if name != "spine-4-8" or chain is None:
            continue
        for n in calibration:
            old, new = _predict(trees, spine[:n], chain[:n])
            print(f"calibration seed {seed}, first {n} images of each:")
            print("  old " + ", ".join(f"{k} {v:.3f}" for k, v in old.items()))
            print("  new " + ", ".join(f"{k} {v:.3f}" for k, v in new.items()))
            rng, spread = np.random.default_rng(0), {"old": [], "new": []}
            for _ in range(resamples):  # image i resampled among the recorded images of its class
                pick = [int(rng.choice(np.arange(i % CLASSES, len(spine), CLASSES))) for i in range(n)]
                both = _predict(trees, [spine[i] for i in pick], [chain[i] for i in pick])
                for rule, taus in zip(spread, both, strict=True):
                    spread[rule].append(taus)
            for rule, taus in spread.items() if resamples else ():
                summary = [
                    f"{k} {np.mean([t[k] for t in taus]):.3f} sd {np.std([t[k] for t in taus]):.3f}"
                    for k in new
                ]
                print(f"  {rule} over {resamples} resamples: " + ", ".join(summary))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "files", nargs="+", help="OUT.pkl then TREE:SEED:IMAGES ..., or with --report: OUT.pkl ..."
    )
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--calibration", type=int, nargs="*", default=[8, 20, 64])
    parser.add_argument("--resamples", type=int, default=100)
    args = parser.parse_args()
    if args.report:
        report(args.files, args.calibration, args.resamples)
    else:
        record(args.files[0], args.files[1:])
