"""Per-call time of the same graphs in two bundles (say, before and after a change), on
onnxruntime's CPU provider at one thread, old and new alternated in one process.

    .venv/bin/python scripts/compare_graph_calls.py OLD_BUNDLE NEW_BUNDLE [--rounds 8] [--calls 100]

Each graph of ``--graphs`` is loaded from both bundles in two sessions and fed the same inputs
(random noise and probabilities, a cache length of 100, 3 pending pairs, CFG 3, no filters, no
relaxation, sampling mode); a graph that writes its cache in place (``present_*`` outputs) gets
the other's caches with its scratch slots after them, bound as its outputs as the runtime binds
them. Rounds of ``--calls`` calls alternate between the sessions, the first session of a round
alternating too. Prints the mean milliseconds per call of each, their ratio, and the largest
difference of the outputs both graphs have (0: bit-identical). On a shared machine only the
ratios mean anything.
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


def widened(
    inputs: dict[str, np.ndarray], s: ort.InferenceSession, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """``inputs`` for session ``s``: a cache input it declares wider (scratch slots after the
    window, axis 2) gets random slots appended."""
    out = dict(inputs)
    for i in s.get_inputs():
        given = inputs[i.name]
        if list(given.shape) != list(i.shape):
            extra = list(given.shape)
            extra[2] = i.shape[2] - given.shape[2]
            out[i.name] = np.concatenate([given, rng.random(extra, dtype=np.float32)], axis=2)
    return out


def bound(s: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> tuple[ort.IOBinding, list[str]]:
    """An IO binding of ``inputs``, each ``present_*`` output bound to its ``past_*`` input."""
    binding = s.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x)) for name, x in inputs.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    names = [o.name for o in s.get_outputs()]
    for name in names:
        if name.startswith("present_"):
            binding.bind_ortvalue_output(name, values[name.replace("present_", "past_", 1)])
        else:
            binding.bind_output(name)
    return binding, names


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
        base = feed(sessions["old"], rng)
        runs, results = {}, {}
        for name, s in sessions.items():
            binding, names = bound(s, widened(base, s, rng))
            s.run_with_iobinding(binding)
            results[name] = dict(zip(names, binding.copy_outputs_to_cpu(), strict=True))
            runs[name] = (s, binding)
        common = [n for n in results["old"] if n in results["new"] and not n.startswith(("present_", "new_"))]
        diff = max(
            float(np.abs(results["old"][n].astype(np.float64) - results["new"][n]).max()) for n in common
        )
        ms: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                s, binding = runs[name]
                start = time.perf_counter()
                for _ in range(args.calls):
                    s.run_with_iobinding(binding)
                ms[name].append((time.perf_counter() - start) / args.calls * 1e3)
        old, new = np.mean(ms["old"]), np.mean(ms["new"])
        print(
            f"{graph}: old {old:.2f} ms, new {new:.2f} ms, new/old {new / old:.3f}; "
            f"largest difference of {', '.join(common)}: {diff:.3g}"
        )


if __name__ == "__main__":
    main()
