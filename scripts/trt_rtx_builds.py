"""Build every graph of each bundle given with TensorRT for RTX (ahead of time, no GPU needed) and
print a Markdown table: graph, precision, build seconds (wall and CPU) and plan size; a graph the
builder rejects prints its message instead. Nothing is written into the bundles.

    .venv/bin/python scripts/trt_rtx_builds.py BUNDLE [BUNDLE ...] [--compute-capability 8.9]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lantern_rt.bundle import Bundle
from lantern_rt.engines.compat import TRT_RTX, EngineError
from lantern_rt.engines.plans import PlanBuilder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--compute-capability", action="append", default=[], dest="capabilities")
    args = parser.parse_args()
    builder = PlanBuilder(TRT_RTX, args.capabilities)
    print(f"TensorRT for RTX {builder.version}, compute capabilities {', '.join(builder.capabilities)}\n")
    print("| bundle | graph | precision | build s (wall) | build s (CPU) | plan MB |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    totals = [0.0, 0.0, 0]
    for path in args.bundles:
        bundle = Bundle.open(path)
        for name, entry in bundle.graphs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                size = len(builder.build(bundle.file(entry)))
            except EngineError as err:
                print(f"| {path.name} | {name} | {bundle.dtype} | rejected: {err} | | |")
                continue
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            totals = [totals[0] + wall, totals[1] + cpu, totals[2] + size]
            print(f"| {path.name} | {name} | {bundle.dtype} | {wall:.2f} | {cpu:.2f} | {size / 1e6:.1f} |")
    print(f"| all | | | {totals[0]:.1f} | {totals[1]:.1f} | {totals[2] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
