"""Every graph of the demo's bundles, as a user builds engines for them, parsed and built by
TensorRT for RTX's real builder (ahead of time, no GPU): fp32 and fp16 (``lantern export
--dtype``) and int8 (``lantern calibrate``'s Q/DQ copy), each holding chain-5 (the CPU default),
naive_extend_57 (the GPU default) and pac-2-2-7 (a Jacobi window of ``--method sjd``). A graph
the builder rejects fails its bundle's test with the parser's or builder's message."""

from __future__ import annotations

import pytest

from lantern_rt.bundle import AR_STEP_GRAPH, VQ_DECODE_GRAPH, Bundle, draft_graph_name, verify_graph_name
from tests.trt_rtx_cases import DEMO_PRECISIONS, DEMO_TREES, assert_every_graph_builds, demo_bundle

pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT for RTX is not installed (the trt-rtx extra)")

GRAPHS = {"target_prefill", AR_STEP_GRAPH, VQ_DECODE_GRAPH} | {
    name(i) for name in (draft_graph_name, verify_graph_name) for i in range(len(DEMO_TREES))
}


@pytest.mark.parametrize("precision", DEMO_PRECISIONS)
def test_every_graph_of_the_demo_builds(precision, tmp_path):
    bundle = Bundle.open(demo_bundle(tmp_path / "bundle", precision))
    assert bundle.dtype == precision and list(bundle.trees) == list(DEMO_TREES)
    assert set(bundle.graphs) == GRAPHS
    built = assert_every_graph_builds(bundle)
    assert all(row["bytes"] > 1 << 20 for row in built)  # each plan holds its graph's weights
