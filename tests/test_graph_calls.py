"""Graphs are called by the names their manifest declares (runtime/backends/bundle_graphs.py):
the runner puts named tensors in the declared order and refuses a missing or unknown one, or one
of another shape or dtype; an onnxruntime graph gives the same outputs whatever order the names come in."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.graph_spec import TensorSpec
from lantern_rt.runtime.backends.bundle_graphs import cache_inputs, changed_inputs, ordered
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.run_shape import RunShape

INPUTS = (
    TensorSpec("tokens", (2, 3), "int64"),
    TensorSpec("cache_length", (2,), "int64"),
    TensorSpec("past_k_0", (4,), "float32"),
)


def inputs(tokens=(2, 3), length=(2,), past=(4,), dtype=torch.int64) -> dict[str, torch.Tensor]:
    """Tensors for :data:`INPUTS` of these shapes, ``tokens`` of ``dtype``."""
    return {
        "tokens": torch.zeros(tokens, dtype=dtype),
        "cache_length": torch.ones(length, dtype=torch.int64),
        "past_k_0": torch.zeros(past),
    }


def test_named_inputs_come_out_in_the_declared_order():
    tokens, length, past = inputs().values()
    got = ordered(INPUTS, {"past_k_0": past, "tokens": tokens, "cache_length": length})
    assert [id(t) for t in got] == [id(tokens), id(length), id(past)]


@pytest.mark.parametrize(
    "named, message",
    [
        (
            {"tokens": inputs()["tokens"], "cache_length": inputs()["cache_length"]},
            r"missing \['past_k_0'\], unknown \[\]",
        ),
        ({**inputs(), "q": torch.ones(1)}, r"missing \[\], unknown \['q'\]"),
        (inputs(tokens=(3, 2)), r"input tokens has shape \[3, 2\], the graph wants \[2, 3\]"),
        (inputs(dtype=torch.int32), r"input tokens has dtype int32, the graph wants int64"),
        (inputs(dtype=torch.float32), r"input tokens has dtype float32, the graph wants int64"),
        (
            {**inputs(), "past_k_0": torch.zeros(4, dtype=torch.float16)},
            r"past_k_0 has dtype float16, the graph wants float32",
        ),
    ],
    ids=["missing", "unknown", "shape", "int32", "float", "half-cache"],
)
def test_a_wrong_call_is_refused_by_name(named, message):
    with pytest.raises(ValueError, match=message):
        ordered(INPUTS, named)
    with pytest.raises(ValueError, match=message):  # the onnxruntime and OpenVINO runners' check
        list(changed_inputs(INPUTS, named, [None] * len(INPUTS)))


def test_a_runner_rebinds_only_the_inputs_that_are_not_its_buffers():
    named = inputs()
    bound = [named["tokens"], None, torch.zeros(4)]  # tokens where it lies; past_k_0 elsewhere
    got = [(i, spec.name, id(arg)) for i, spec, arg in changed_inputs(INPUTS, named, bound)]
    assert got == [(1, "cache_length", id(named["cache_length"])), (2, "past_k_0", id(named["past_k_0"]))]


@pytest.mark.parametrize("scratch", [0, 3])
def test_cache_layers_are_named_per_layer(scratch):
    """Each layer's K and V by input name: its window, or with scratch slots (a graph that writes
    the cache in place) the window and every scratch slot, views of the cache's storage."""
    cache = KVCache(2, 1, 8, 4, torch.float32, "cpu", RunShape(1), windows=(4,), scratch=scratch)
    cache.fit(3)
    for i, layer in enumerate((*cache.layers_k, *cache.layers_v)):
        layer.fill_(i)
    named = cache_inputs(cache)
    assert list(named) == ["past_k_0", "past_k_1", "past_v_0", "past_v_1"]
    for i, t in enumerate(named.values()):
        assert t.shape == (2, 1, 4 + scratch, 4)
        assert bool((t[:, :, :4] == i).all())
        t[:, :, -1] = -1.0  # a view: the cache's own scratch slot
    if scratch:
        assert bool((cache.in_place(scratch)[0][0][:, :, -1] == -1).all())


def one_node_runner(
    tmp_path, op: str, inputs: tuple[TensorSpec, ...], output: TensorSpec, opset: int = 18, **attrs
):
    """An onnxruntime runner (``ort_runner``, one thread) of a graph of one ``op`` node over
    ``inputs``, written under ``tmp_path``."""
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import helper

    from lantern_rt.bundle import GraphEntry
    from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner

    def value(spec: TensorSpec):
        return helper.make_tensor_value_info(
            spec.name, helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype)), list(spec.shape)
        )

    node = helper.make_node(op, [s.name for s in inputs], [output.name], **attrs)
    graph = helper.make_graph([node], "g", [value(s) for s in inputs], [value(output)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), tmp_path / "g.onnx")

    class Folder:  # what the runner reads of a bundle: where a graph's file is
        def file(self, entry: GraphEntry):
            return tmp_path / entry.file

    return ort_runner(threads=1)(Folder(), GraphEntry("g", "g.onnx", inputs, (output,)))


def test_an_onnxruntime_graph_ignores_the_order_of_its_names(tmp_path):
    """A two-input graph (out = a - b): the same result for a, b given in either order, and the
    arguments' names, not their positions, decide which is which."""
    specs = (TensorSpec("a", (3,), "float32"), TensorSpec("b", (3,), "float32"))
    run = one_node_runner(tmp_path, "Sub", specs, TensorSpec("out", (3,), "float32"))
    a, b = torch.tensor([5.0, 6.0, 7.0]), torch.tensor([1.0, 2.0, 3.0])
    first = run(a=a, b=b)["out"].clone()
    assert torch.equal(first, a - b) and torch.equal(run(b=b, a=a)["out"], first)
    assert torch.equal(run(a=b, b=a)["out"], b - a)


def test_an_onnxruntime_graph_reads_bound_inputs_where_they_lie(tmp_path):
    """A cache input is bound by pointer and checked when bound: the same tensor, written between
    calls, is read as it is now; another tensor is bound in its place; a wrong one is refused on
    any call, as are a missing input and a copied input of the wrong shape."""
    specs = (TensorSpec("past_k_0", (3,), "float32"), TensorSpec("a", (3,), "float32"))
    run = one_node_runner(tmp_path, "Add", specs, TensorSpec("out", (3,), "float32"))
    cache, a = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(run(past_k_0=cache, a=a)["out"], a)
    cache += 10.0
    assert torch.equal(run(past_k_0=cache, a=a)["out"], a + 10.0)
    other = torch.full((3,), -1.0)
    assert torch.equal(run(past_k_0=other, a=a)["out"], a - 1.0)
    for named, message in (
        ({"past_k_0": torch.zeros(4), "a": a}, r"past_k_0 has shape \[4\]"),
        ({"past_k_0": other, "a": torch.zeros(1)}, r"input a has shape \[1\]"),
        ({"past_k_0": other, "b": a}, r"missing \['a'\], unknown \['b'\]"),
        ({"past_k_0": other}, r"missing \['a'\]"),
    ):
        with pytest.raises(ValueError, match=message):
            run(**named)
    assert torch.equal(run(past_k_0=other, a=a)["out"], a - 1.0)


def test_an_onnxruntime_graph_call_prints_no_warnings(tmp_path, capfd):
    """A ``TensorScatter`` whose cache is not bound as its output copies it and onnxruntime warns
    about that on every call; a runner's session logs errors only, so a decode prints nothing."""
    from lantern_rt.runtime.backends.onnxruntime_backend import runs_in_place_steps

    if not runs_in_place_steps():
        pytest.skip("this onnxruntime has no TensorScatter")
    specs = (
        TensorSpec("cache", (1, 1, 4, 2), "float32"),
        TensorSpec("rows", (1, 1, 1, 2), "float32"),
        TensorSpec("start", (1,), "int64"),
    )
    out_spec = TensorSpec("out", (1, 1, 4, 2), "float32")
    run = one_node_runner(tmp_path, "TensorScatter", specs, out_spec, opset=24, axis=2)
    capfd.readouterr()
    out = run(cache=torch.zeros(1, 1, 4, 2), rows=torch.ones(1, 1, 1, 2), start=torch.tensor([2]))["out"]
    assert float(out.sum()) == 2.0
    assert capfd.readouterr().err == ""
