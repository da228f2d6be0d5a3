"""Per-call time of the same graphs in two bundles (say, before and after a change), on
onnxruntime's CPU provider at one thread, old and new alternated in one process.

    .venv/bin/python scripts/compare_graph_calls.py OLD_BUNDLE NEW_BUNDLE [--rounds 8] [--calls 100]

Each graph of ``--graphs`` is loaded from both bundles in two sessions and fed the same inputs
(random noise and probabilities, a cache length of 100, 3 pending pairs, CFG 3, no filters, no
relaxation, sampling mode); rounds of ``--calls`` calls alternate between the sessions, the first
session of a round alternating too. Prints the mean milliseconds per call of each, their ratio,
and whether the two graphs' outputs on those inputs are bit-identical. On a shared machine only
the ratios mean anything.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort

SETTINGS = {
    "cache_length": 100,
    "count": 3,
    "root_position": 100,
    "top_k": 0,
    "top_p": 1.0,
    "temperature": 1.0,
    "cfg_scale": 3.0,
    "k": 0,
    "cap_a": 0.0,
    "cap_b": 0.0,
}


def session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def feed(s: ort.InferenceSession, rng: np.random.Generator) -> dict[str, np.ndarray]:
    inputs = {}
    for i in s.get_inputs():
        if i.name in SETTINGS:
            dtype = np.int64 if "int64" in i.type else np.float32
            inputs[i.name] = np.full(i.shape, SETTINGS[i.name], dtype=dtype)
        elif "bool" in i.type:
            inputs[i.name] = np.full(i.shape, i.name != "greedy")
        elif "int64" in i.type:
            inputs[i.name] = rng.integers(0, 8, size=i.shape).astype(np.int64)
        else:
            inputs[i.name] = rng.random(i.shape, dtype=np.float32)
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--graphs", nargs="+", default=["target_ar_step", "target_verify_0", "draft_tree_0"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for graph in args.graphs:
        sessions = {
            name: session(f"{path}/{graph}.onnx") for name, path in (("old", args.old), ("new", args.new))
        }
        inputs = feed(sessions["old"], rng)
        outputs = {name: s.run(None, inputs) for name, s in sessions.items()}
        same = all(np.array_equal(a, b) for a, b in zip(outputs["old"], outputs["new"], strict=True))
        ms: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                start = time.perf_counter()
                for _ in range(args.calls):
                    sessions[name].run(None, inputs)
                ms[name].append((time.perf_counter() - start) / args.calls * 1e3)
        old, new = np.mean(ms["old"]), np.mean(ms["new"])
        print(
            f"{graph}: old {old:.2f} ms, new {new:.2f} ms, new/old {new / old:.3f}; outputs bit-identical: {same}"
        )


if __name__ == "__main__":
    main()
