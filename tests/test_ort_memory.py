"""One copy of a bundle's weights in memory across the onnxruntime sessions of one runner factory
(issue 58): graphs sharing one ``weights.bin`` (:func:`lantern_rt.shared_weights.share_weights`),
opened and run through :func:`ort_runner`, fp32, fp16 and int8 Q/DQ weights."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lantern_rt.bundle import WEIGHTS, GraphEntry
from lantern_rt.graph_spec import TensorSpec
from lantern_rt.runtime.backends import onnxruntime_backend
from lantern_rt.runtime.backends.onnxruntime_backend import CPU, ort_runner
from lantern_rt.shared_weights import share_weights

DIM = 1024  # a weight is DIM x DIM fp32: 4 MiB
ROWS = 2


def matmul_chain(path: Path, weights: list[np.ndarray], kind: str = "fp32") -> None:
    """A graph ``y = x @ w_0 @ w_1 ...`` (``x``: ROWS x DIM fp32) whose weights are stored as
    ``kind``: fp32, fp16 (cast to fp32) or int8 (DequantizeLinear, per-tensor scale)."""
    nodes, inits, value = [], [], "x"
    for i, w in enumerate(weights):
        name = f"w{i}"
        if kind == "fp32":
            inits.append(numpy_helper.from_array(w, name))
        elif kind == "fp16":
            inits.append(numpy_helper.from_array(w.astype(np.float16), f"{name}_h"))
            nodes.append(helper.make_node("Cast", [f"{name}_h"], [name], to=TensorProto.FLOAT))
        else:
            scale = np.float32(np.abs(w).max() / 127)
            q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
            inits += [numpy_helper.from_array(q, f"{name}_q"), numpy_helper.from_array(scale, f"{name}_s")]
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s"], [name]))
        nodes.append(helper.make_node("MatMul", [value, name], [f"h{i}"]))
        value = f"h{i}"
    nodes.append(helper.make_node("Identity", [value], ["y"]))
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, DIM])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(path), save_as_external_data=True, location=f"{path.stem}.data", size_threshold=1024)


def shared_bundle(folder: Path, graphs: int, tensors: int, kind: str = "fp32") -> list[GraphEntry]:
    """``graphs`` graphs of the same ``tensors`` weights (seeded), sharing one WEIGHTS file in
    ``folder``; their entries."""
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((DIM, DIM)) / DIM**0.5).astype(np.float32) for _ in range(tensors)]
    paths = [folder / f"g{i}.onnx" for i in range(graphs)]
    for path in paths:
        matmul_chain(path, weights, kind)
    share_weights(paths, folder / WEIGHTS)
    x, y = TensorSpec("x", (ROWS, DIM), "float32"), TensorSpec("y", (ROWS, DIM), "float32")
    return [GraphEntry(p.stem, p.name, (x,), (y,)) for p in paths]


def resident_bytes() -> int:
    """This process's resident memory (VmRSS)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


@pytest.mark.slow  # about 10 s: 6 sessions over 80 MiB of weights (the size the rule shares)
def test_the_sessions_of_a_bundle_hold_its_weights_once(tmp_path, monkeypatch):
    """Past the prepacking budget (here: one graph's weights), opening and running every graph of
    a bundle whose graphs read 80 MiB of shared weights grows resident memory by about two copies
    of them (the one prepacked session's and the shared one), not one per session."""
    graphs, tensors = 6, 20
    weight_bytes = tensors * DIM * DIM * 4
    monkeypatch.setattr(onnxruntime_backend, "PREPACK_BUDGET", weight_bytes)
    entries = shared_bundle(tmp_path, graphs, tensors)
    bundle = SimpleNamespace(file=lambda entry: tmp_path / entry.file)
    x = torch.randn(ROWS, DIM)
    gc.collect()
    before = resident_bytes()
    make = ort_runner(threads=1, providers=[CPU])
    runners = [make(bundle, entry) for entry in entries]
    outputs = [runner(x=x)["y"].clone() for runner in runners]
    grown = resident_bytes() - before
    assert grown < 2.5 * weight_bytes, (
        f"{grown / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f} MiB of weights"
    )
    for out in outputs[1:]:  # the prepacked session's sums run in another order: round-off apart
        torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["fp32", "fp16", "int8"])
def test_shared_weights_compute_what_the_file_does(tmp_path, monkeypatch, kind):
    """With no prepacking budget, each graph's output equals a plain session's over the same
    files (round-off apart: a plain session prepacks). fp32 weights lie in the factory's one
    memory map of the weights file, each once for both graphs; fp16 and int8 Q/DQ graphs keep
    their own prepacked weights, computing exactly what a plain session does."""
    monkeypatch.setattr(onnxruntime_backend, "PREPACK_BUDGET", 0)
    entries = shared_bundle(tmp_path, graphs=2, tensors=2, kind=kind)
    bundle = SimpleNamespace(file=lambda entry: tmp_path / entry.file)
    make = ort_runner(threads=1, providers=[CPU])
    x = torch.randn(ROWS, DIM)
    tolerance = 1e-5 if kind == "fp32" else 0
    for entry in entries:
        got = make(bundle, entry)(x=x)["y"]
        plain = ort.InferenceSession(str(tmp_path / entry.file), providers=[CPU])
        want = plain.run(None, {"x": x.numpy()})[0]
        np.testing.assert_allclose(got.numpy(), want, rtol=tolerance, atol=tolerance)
    shared = make(bundle, entries[0])._opened.weights
    arrays = [] if shared is None else [array for array, _ in shared._values.values()]
    if kind != "fp32":
        assert not arrays
        return
    (weights_map,) = shared._maps.values()
    assert len(arrays) == 2  # each weight once for both graphs
    assert all(np.shares_memory(array, weights_map) for array in arrays)


def test_the_prepacking_budget_is_the_process_s(tmp_path, monkeypatch):
    """Runner factories share one budget (a bench holds a pipeline, so a factory, per method): with
    room for one graph's weights, a second factory's session shares its weights unpacked; once
    the first session is gone its bytes return to the budget."""
    entries = shared_bundle(tmp_path, graphs=2, tensors=2)
    bundle = SimpleNamespace(file=lambda entry: tmp_path / entry.file)
    gc.collect()
    # room for one graph's weights beside what sessions of earlier tests in this process hold
    held = onnxruntime_backend._prepacked[0]
    monkeypatch.setattr(onnxruntime_backend, "PREPACK_BUDGET", held + 2 * DIM * DIM * 4)
    first = ort_runner(threads=1, providers=[CPU])(bundle, entries[0])
    assert first._opened.weights is None  # prepacked: its own copy
    second = ort_runner(threads=1, providers=[CPU])(bundle, entries[1])
    assert second._opened.weights._values  # past the budget: the one shared copy
    del first
    gc.collect()
    third = ort_runner(threads=1, providers=[CPU])(bundle, entries[0])
    assert third._opened.weights is None


def test_factories_share_a_graphs_session_while_a_runner_holds_it(tmp_path):
    """Two factories (a bench's pipelines) open a graph once: their runners share the session and
    its weights; other settings, a rewritten file, or a graph no runner holds any more get a
    session of their own."""
    entries = shared_bundle(tmp_path, graphs=1, tensors=2)
    bundle = SimpleNamespace(file=lambda entry: tmp_path / entry.file)
    first = ort_runner(threads=1, providers=[CPU])(bundle, entries[0])
    second = ort_runner(threads=1, providers=[CPU])(bundle, entries[0])
    assert second.session is first.session
    assert ort_runner(threads=2, providers=[CPU])(bundle, entries[0]).session is not first.session
    x = torch.randn(ROWS, DIM)
    torch.testing.assert_close(second(x=x)["y"], first(x=x)["y"], rtol=0, atol=0)
    path = tmp_path / entries[0].file
    path.write_bytes(path.read_bytes())  # the same graph written again: another file
    assert ort_runner(threads=1, providers=[CPU])(bundle, entries[0]).session is not first.session
    held = weakref.ref(first.session)
    del first, second
    gc.collect()
    assert held() is None


def test_a_graph_called_once_per_image_never_takes_the_prepacking_budget(tmp_path):
    """A prefill (at any batch size) shares the weights unpacked however much budget is left; a
    step graph prepacks its own copy."""
    entries = shared_bundle(tmp_path, graphs=2, tensors=2)
    names = ["target_prefill_b2", "target_verify_0"]
    renamed = [dataclasses.replace(e, name=n) for e, n in zip(entries, names, strict=True)]
    assert [e.per_image for e in renamed] == [True, False]
    bundle = SimpleNamespace(file=lambda entry: tmp_path / entry.file)
    make = ort_runner(threads=1, providers=[CPU])
    prefill, step = (make(bundle, e) for e in renamed)
    assert prefill._opened.weights._values and step._opened.weights is None
    x = torch.randn(ROWS, DIM)
    want = ort.InferenceSession(str(tmp_path / entries[0].file), providers=[CPU]).run(None, {"x": x.numpy()})[
        0
    ]
    np.testing.assert_allclose(prefill(x=x)["y"].numpy(), want, rtol=1e-5, atol=1e-5)
