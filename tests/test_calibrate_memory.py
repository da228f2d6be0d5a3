"""``lantern calibrate`` within memory (issue 58: at GPT-XL a step graph holds 3 GB of weights,
and quantizing one held six copies of them): the Q/DQ quantization of a graph holds about one
copy, the same Q/DQ as onnxruntime's own calibration writes, and the recorded calls stay on disk."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

from lantern_rt.bundle import GraphEntry
from lantern_rt.calibration.calibrate import QUANTIZED_OPS, Recorder, _Samples, quantize_graph
from lantern_rt.graph_spec import TensorSpec

ROWS = 4


def products_graph(folder: Path, layers: int, width: int) -> tuple[Path, list[dict[str, np.ndarray]]]:
    """``graph.onnx`` in ``folder``: x [ROWS, width] through ``layers`` MatMuls by random
    [width, width] weights, every weight in ``weights.bin`` (as a bundle's graph holds them);
    and two calibration inputs."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32) / width**0.5, f"w{i}")
        for i in range(layers)
    ]
    nodes = [
        helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"], [f"h{i}"], name=f"matmul{i}")
        for i in range(layers)
    ]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "products",
        [info("x", TensorProto.FLOAT, [ROWS, width])],
        [info(f"h{layers - 1}", TensorProto.FLOAT, [ROWS, width])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "graph.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    samples = [{"x": rng.standard_normal((ROWS, width), dtype=np.float32)} for _ in range(2)]
    return path, samples


def qdq_content(path: Path) -> tuple[list, dict[str, np.ndarray]]:
    """The nodes (op, inputs, outputs, attributes) and the initializers of the graph at ``path``."""
    model = onnx.load(str(path))
    nodes = [(n.op_type, list(n.input), list(n.output), str(n.attribute)) for n in model.graph.node]
    return nodes, {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_the_qdq_graph_is_onnxruntimes_own(tmp_path):
    """Calibrated apart (its ranges handed over in a calibration cache) and with its weights left
    on disk until needed, a graph's Q/DQ is what ``quantize_static`` writes calibrating it
    itself: the same nodes, scales and int8 weights; the weights stay in an external file."""
    src, samples = products_graph(tmp_path / "src", 3, 64)
    assert quantize_graph(src, tmp_path / "ours.onnx", samples, vocab=7) == 3
    quantize_static(
        str(src),
        str(tmp_path / "theirs.onnx"),
        _Samples(samples),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        per_channel=True,
        op_types_to_quantize=list(QUANTIZED_OPS),
        nodes_to_quantize=["matmul0", "matmul1", "matmul2"],
        extra_options={
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS),
        },
    )
    (ours_nodes, ours), (their_nodes, theirs) = (
        qdq_content(tmp_path / f) for f in ("ours.onnx", "theirs.onnx")
    )
    assert ours_nodes == their_nodes and sorted(ours) == sorted(theirs)
    for name, values in theirs.items():
        assert ours[name].dtype == values.dtype and np.array_equal(ours[name], values), name
    assert sum(values.dtype == np.int8 and values.ndim == 2 for values in ours.values()) == 3
    bare = onnx.load(str(tmp_path / "ours.onnx"), load_external_data=False)
    assert (tmp_path / "ours.onnx.data").is_file()
    assert any(onnx.external_data_helper.uses_external_data(t) for t in bare.graph.initializer)


# One process quantizes a small graph (paying onnxruntime's one-time costs), then one whose
# weights dwarf the process's own memory, and measures how far its resident memory rises above
# what it held before each (VmHWM reset there). The wide graph's rise over the small one's is
# the quantization's: 1.97x the weight bytes, while onnxruntime's calibrator holds its copy of
# the graph beside its session's; 4.93x when the graph was also loaded whole beside them and
# the quantizer's own copy, and the calibration graph written inline.
MAX_RISE_PER_WEIGHT_BYTE = 2.5
CHILD = """
import json, re, sys
from pathlib import Path
import numpy as np
from lantern_rt.calibration.calibrate import quantize_graph

def kib(field):
    return int(re.search(field + r":\\s*(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

rises = []
for src in sys.argv[1:]:
    src = Path(src)
    samples = [{"x": x} for x in np.load(src.with_name("samples.npy"))]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = kib("VmRSS")
    quantize_graph(src, src.with_name("int8.onnx"), samples, vocab=7)
    rises.append((kib("VmHWM") - before) * 1024)
print(json.dumps(rises))
"""


def test_quantizing_a_graph_holds_about_one_copy_of_its_weights(tmp_path):
    graphs = []
    for name, layers, width in (("small", 2, 64), ("wide", 24, 1024)):  # wide: 96 MiB of fp32
        path, samples = products_graph(tmp_path / name, layers, width)
        np.save(path.with_name("samples.npy"), np.stack([s["x"] for s in samples]))
        graphs.append(path)
    weights = 24 * 1024 * 1024 * 4
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, graphs)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    small, wide = json.loads(done.stdout.splitlines()[-1])
    assert wide - small <= MAX_RISE_PER_WEIGHT_BYTE * weights, (
        f"quantizing {weights / 2**20:.0f} MiB of weights raised memory {(wide - small) / 2**20:.0f} MiB "
        f"more than a small graph ({small / 2**20:.0f} MiB): {(wide - small) / weights:.2f}x the weight bytes"
    )


def test_recorded_calls_are_kept_on_disk():
    """A recorder keeps the calls it samples in files, not in memory (at GPT-B the two step
    graphs' kept calls took 1.2x the weight bytes, beside the recording's sessions): four kept
    calls of 8 MiB leave no copy in memory, and each reads back as it was offered."""
    entry = GraphEntry(
        "target_ar_step",
        "x.onnx",
        (TensorSpec("x", (1024, 2048), "float32"), TensorSpec("n", (1,), "int64")),
        (),
    )
    recorder = Recorder(lambda bundle, entry: SimpleNamespace(device=torch.device("cpu")), limit=4)
    recorder(None, entry)
    x, n = torch.zeros(1024, 2048), torch.zeros(1, dtype=torch.int64)
    tracemalloc.start()
    try:
        for i in range(10):
            x.fill_(i)
            n.fill_(i)
            recorder.offer(entry, {"x": x, "n": n})
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2**20, f"{held / 2**20:.1f} MiB held after recording 4 calls of 8 MiB"
    kept = list(recorder.samples["target_ar_step"])
    assert len(kept) == 4 and recorder.calls["target_ar_step"] == 10
    for record in kept:
        i = int(record["n"][0])
        assert record["x"].dtype == np.float32 and record["x"].shape == (1024, 2048)
        assert (record["x"] == i).all()
    assert len({int(r["n"][0]) for r in kept}) == 4
