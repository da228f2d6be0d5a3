"""Where a bundle's graph calls spend their time on onnxruntime (CPU): generate a few images of a
class-conditional bundle twice, timing each graph call (wall time, median), then with per-node
profiling on, and print each graph's median time per call with its share by operator type.

    .venv/bin/python scripts/profile_graphs.py BUNDLE [--method lantern++] [-n 2] [--threads 1]

Profiling slows every node, so the operator shares (onnxruntime's per-node kernel times, from
``enable_profiling``) are read as fractions of the profiled kernel time, and the milliseconds
per call come from the unprofiled run, which also prints each graph's milliseconds per image
and the host's rest.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

from lantern_rt.assembly import bundle_pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.generate import generate
from lantern_rt.runtime.backends.onnxruntime_backend import CPU, OrtGraph, session_options
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--method", default="lantern++")
    parser.add_argument("-n", type=int, default=2, help="images per class")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=8, help="operator types shown per graph")
    args = parser.parse_args()
    bundle = Bundle.open(args.bundle)
    folder = Path(tempfile.mkdtemp(prefix="lantern-profile-"))
    labels = [c for c in range(len(bundle.class_names)) for _ in range(args.n)]
    calls: dict[str, list[float]] = collections.defaultdict(list)
    profiled: list[tuple[str, OrtGraph]] = []

    def runner(profile: bool):
        def make(b: Bundle, entry) -> OrtGraph:
            options = session_options(1 if entry.drafting else args.threads)
            options.enable_profiling = profile
            options.profile_file_prefix = str(folder / entry.name)
            graph = OrtGraph(ort.InferenceSession(str(b.file(entry)), options, providers=[CPU]), entry)
            if profile:
                profiled.append((entry.name, graph))
                return graph

            return Timed(graph, calls[entry.name])

        return make

    for profile in (False, True):
        pipe = bundle_pipeline(bundle, 1, MethodConfig(method=args.method), runner(profile), "onnxruntime")
        t0 = time.perf_counter()
        generate(pipe, labels, SamplingConfig(cfg_scale=3.0), progress=False)
        if not profile:
            budget(calls, time.perf_counter() - t0, len(labels))
    for name, graph in profiled:
        if calls.get(name):
            report(name, calls[name], Path(graph.session.end_profiling()), args.top)


class Timed:
    """A graph runner that appends each call's wall time to ``seconds``."""

    def __init__(self, graph: OrtGraph, seconds: list[float]):
        self.graph, self.seconds = graph, seconds

    def __getattr__(self, name: str):
        return getattr(self.graph, name)

    def __call__(self, **inputs):
        t0 = time.perf_counter()
        out = self.graph(**inputs)
        self.seconds.append(time.perf_counter() - t0)
        return out


def budget(calls: dict[str, list[float]], seconds: float, images: int) -> None:
    """Print where an image's wall time went in the unprofiled run: each graph's calls and
    milliseconds per image, and the rest (the host: Python, copies, the decode loop)."""
    print(f"per image: {seconds / images * 1e3:.1f} ms over {images} images")
    spent = 0.0
    for name, times in sorted((n, t) for n, t in calls.items() if t):
        spent += sum(times)
        print(f"  {name:28s} {len(times) / images:6.1f} calls  {sum(times) / images * 1e3:7.1f} ms")
    print(f"  {'host (the rest)':28s} {'':12s} {(seconds - spent) / images * 1e3:7.1f} ms")


def report(name: str, seconds: list[float], path: Path, top: int) -> None:
    """Print one graph's median wall time per call and its kernel time's shares by operator
    type, read from its profile ``path``."""
    events = json.loads(path.read_text())
    by_op: collections.Counter[str] = collections.Counter()
    nodes = set()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
            nodes.add(e["name"])
    kernels = sum(by_op.values())
    median = statistics.median(seconds) * 1e3
    print(f"{name}: {len(seconds)} calls, {median:.3f} ms per call (median), {len(nodes)} nodes")
    for op, us in by_op.most_common(top):
        print(f"  {op:28s} {us / kernels:6.1%}  {us / kernels * median:.3f} ms")


if __name__ == "__main__":
    main()
