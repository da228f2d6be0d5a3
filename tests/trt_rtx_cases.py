"""What the suite builds with TensorRT for RTX's real builder (ahead of time, no GPU): the demo's
bundles and the results of building every graph of a bundle, each made once per run in the run's
shared folder (tests/conftest.py), whichever test or worker asks first.

The demo's bundles hold the trees a user builds engines for: chain-5 (the CPU default),
naive_extend_57 (the GPU default) and a pac tree (a Jacobi window of ``--method sjd``), at one cache
window (the windows' step graphs are the same graphs over other cache spans; the tiny bundles of
tests/test_trt_rtx.py build two windows each).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lantern_rt.bundle import Bundle
from lantern_rt.engines.compat import TRT_RTX, EngineError
from lantern_rt.engines.plans import PlanBuilder
from lantern_rt.fileio import held

DEMO_TREES = ("chain-5", "naive_extend_57", "pac-2-2-7")
# int8: lantern calibrate's Q/DQ copy of the fp32 bundle; w4a16 and w8a16: its weight-only copies
# of the fp16 bundle (``lantern calibrate --weights int4|int8 --block-size 32``, TensorRT's form)
DEMO_PRECISIONS = ("fp32", "fp16", "int8", "w4a16", "w8a16")


def shared_dir(name: str) -> Path:
    """``name`` in the run's shared folder, made when missing."""
    folder = Path(os.environ["LANTERN_TEST_SHARED"]) / name
    folder.mkdir(exist_ok=True)
    return folder


def once_per_run(name: str, make: Callable[[Path], Any], out: Path) -> Path:
    """The folder ``name`` of the run's shared bundles, written by ``make(folder)`` under a lock
    by whichever test asks first, copied to ``out``."""
    folder = shared_dir("bundles")
    made = folder / name
    with held(folder / f".{name}.lock", create=True):
        if not made.is_dir():
            make(made)
    shutil.copytree(made, out)
    return out


def demo_bundle(out: Path, precision: str) -> Path:
    """The demo's bundle of :data:`DEMO_TREES` at ``precision`` (:data:`DEMO_PRECISIONS`), copied
    to ``out``: ``lantern export --dtype`` for fp32 and fp16, ``lantern calibrate`` of the fp32
    one for int8 and of the fp16 one with ``--weights int4|int8`` for w4a16 and w8a16 (one image
    to calibrate). The calibration's closing comparison of whole images (``validation``: 24
    decodes of the demo, about half of a calibration's time) only reads the bundles, so it is left
    out here; the graph agreement before it still runs every quantized graph on onnxruntime
    (tests/test_calibrate.py and tests/test_weight_only.py check the validation itself)."""
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.models.model_dir import DEMO_DIR
    from lantern_rt.runtime.tree import load_tree
    from tests.conftest import exported

    if precision in ("fp32", "fp16"):
        trees = [load_tree(name) for name in DEMO_TREES]
        return exported(open_model_dir(DEMO_DIR), out, trees, dtype=precision, windows=1)
    bits = {"w4a16": 4, "w8a16": 8}.get(precision)

    def calibrate(dest: Path) -> None:
        from lantern_rt.calibration import calibrate as calibrate_module
        from lantern_rt.calibration.calibrate import calibrate_bundle
        from lantern_rt.calibration.quantization import Quantization
        from lantern_rt.calibration.weight_only import WeightOnly

        source = demo_bundle(dest.with_name(f"{dest.name}.source"), "fp32" if bits is None else "fp16")
        quantization = Quantization(
            weight_only=None if bits is None else WeightOnly(bits, block=32)
        )  # 32 divides the demo's widths
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(calibrate_module, "validation", lambda *args, **kwargs: {})
            calibrate_bundle(
                Bundle.open(source), dest, samples=1, validate=1, threads=1, quantization=quantization
            )
        shutil.rmtree(source)

    return once_per_run(f"demo-{precision}", calibrate, out)


def build_every_graph(bundle: Bundle) -> list[dict[str, Any]]:
    """Every graph of ``bundle`` built by TensorRT for RTX for its default compute capabilities,
    once per run (the results kept by the bundle's manifest): per graph ``{"graph", "seconds",
    "bytes"}`` (the build's wall time, the plan's size), or ``{"graph", "error"}`` with the
    parser's or builder's message."""
    folder = shared_dir("plans")
    results = folder / f"{bundle.manifest_sha256[:16]}.json"
    with held(folder / f".{results.name}.lock", create=True):
        if not results.is_file():
            builder, built = PlanBuilder(TRT_RTX), []
            for name, entry in bundle.graphs.items():
                t0 = time.perf_counter()
                try:
                    size = len(builder.build(bundle.file(entry)))
                except EngineError as err:
                    built.append({"graph": name, "error": str(err)})
                    continue
                built.append({"graph": name, "seconds": round(time.perf_counter() - t0, 2), "bytes": size})
            results.write_text(json.dumps(built, indent=1))
    return json.loads(results.read_text())


def assert_every_graph_builds(bundle: Bundle) -> list[dict[str, Any]]:
    """:func:`build_every_graph`, failing with each rejected graph's message."""
    built = build_every_graph(bundle)
    rejected = [f"{row['graph']}: {row['error']}" for row in built if "error" in row]
    assert not rejected, f"{len(rejected)} of {len(built)} graphs were rejected: " + " | ".join(rejected)
    assert [row["graph"] for row in built] == list(bundle.graphs)
    return built
