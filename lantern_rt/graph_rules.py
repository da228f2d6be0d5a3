"""The rules every bundle graph keeps, for TensorRT 10.3 (JetPack 6) and the runtime: a lint for
ONNX graphs, used by the exporter and by calibration on the graphs they write.

:func:`check_graph` returns human-readable violations; an empty list means the graph is fine.
:func:`tensorrt_problems` names what TensorRT's ONNX parser rejects in a graph, in the parser's
own words (tests/test_trt_rtx_builds.py holds them to the real parser's): the exporter holds
every graph meant for TensorRT to it, and ``lantern build-engines`` every graph it builds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import TensorProto

from lantern_rt.graph_spec import IN_PLACE_OPSET, GraphSpec, TensorSpec, writes_cache

MIN_OPSET, MAX_OPSET = 17, 20  # TensorRT 10.3 parses opsets up to 20
# a graph with block-wise DequantizeLinear (int4/int8 weight-only: lantern_rt.calibration.weight_only)
WEIGHT_ONLY_OPSET = 21  # int4 tensors and DequantizeLinear's block_size
SCATTER_OPS = {"Scatter", "ScatterElements", "ScatterND"}
COMPLEX = {TensorProto.COMPLEX64, TensorProto.COMPLEX128}


def check_graph(path: Path, spec: GraphSpec | None = None) -> list[str]:
    """Every rule the graph at ``path`` breaks; with ``spec``, also where its I/O differs. A graph
    that writes its cache in place (``present_*`` outputs: ``spec``'s, or the graph's own) is
    held to :data:`IN_PLACE_OPSET` instead of TensorRT's opsets."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        return [f"onnx.checker: {str(err).splitlines()[0]}"]
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    graph = model.graph
    outputs = spec.outputs if spec is not None else tuple(TensorSpec(v.name, (), "") for v in graph.output)
    problems = _opset(model, writes_cache(outputs))
    typed = [*graph.input, *graph.output]
    problems += [f"{v.name}: dims {_dims(v)} are not all static" for v in typed if not _static(v)]
    graphs = list(with_subgraphs(graph))  # If branches hold nodes too
    inner = [v for g in graphs for v in g.value_info] + [v for g in graphs[1:] for v in g.output]
    loose = [v.name for v in inner if not _static(v)]
    if loose:
        problems.append(f"{len(loose)} intermediate tensors have non-static dims, e.g. {loose[0]}")
    elem = {v.name: v.type.tensor_type.elem_type for v in [*typed, *inner]}
    elem.update({t.name: t.data_type for g in graphs for t in g.initializer})
    problems += [f"tensor {name} is complex" for name, t in elem.items() if t in COMPLEX]
    for node in (node for g in graphs for node in g.node):
        label = f"{node.op_type} node {node.name or node.output[0]}"
        if node.op_type in SCATTER_OPS and any(a.name == "reduction" for a in node.attribute):
            problems.append(f"{label} has a 'reduction' attribute")
        if node.op_type == "Softmax" and elem.get(node.input[0]) != TensorProto.FLOAT:
            problems.append(f"{label} does not run in float32")
    if spec is not None:
        problems += _io_mismatches(graph, spec)
    return problems


def tensorrt_problems(path: Path) -> list[str]:
    """What TensorRT's ONNX parser rejects in the graph at ``path``, one line each with the
    parser's reason: a ``TensorScatter`` other than linear (the in-place caches' circular one),
    a ``MatMulNBits`` (onnxruntime's weight-only matrix product: activations not in fp16, or no
    plugin for it)."""
    model = onnx.load(str(path), load_external_data=False)
    if any(node.op_type == "MatMulNBits" for g in with_subgraphs(model.graph) for node in g.node):
        model = onnx.shape_inference.infer_shapes(model)  # the type of its activations
    graphs = list(with_subgraphs(model.graph))
    values = [*model.graph.input, *model.graph.output, *(v for g in graphs for v in g.value_info)]
    elem = {v.name: v.type.tensor_type.elem_type for v in values}
    problems = []
    for node in (node for g in graphs for node in g.node):
        label = f"{node.op_type} node {node.name or node.output[0]}"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "TensorScatter":
            mode = attrs.get("mode", b"linear").decode()
            if mode != "linear":
                problems.append(f"{label}: Only linear mode is supported for now, got {mode}")
        if node.op_type == "MatMulNBits":  # TensorRT for RTX would need a plugin for it
            fp16 = elem.get(node.input[0]) == TensorProto.FLOAT16
            problems.append(
                f"{label}: {'failed to load MatMulNBits plugin' if fp16 else 'input tensor A must be FP16'}"
            )
    return problems


def node_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs held in ``node``'s attributes (an If's branches, a loop's body)."""
    for attr in node.attribute:
        yield from [attr.g] if attr.HasField("g") else attr.graphs


def with_subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in its nodes, at any depth."""
    yield graph
    for node in graph.node:
        for sub in node_subgraphs(node):
            yield from with_subgraphs(sub)


def _opset(model: onnx.ModelProto, in_place: bool) -> list[str]:
    """The graph's opset within TensorRT's range, exactly :data:`IN_PLACE_OPSET` for a graph
    that writes its cache in place (onnxruntime only), or exactly :data:`WEIGHT_ONLY_OPSET` for
    one with block-wise weights."""
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if in_place:
        if versions != [IN_PLACE_OPSET]:
            return [
                f"opset {versions} is not {IN_PLACE_OPSET}, which a graph writing its cache in place needs"
            ]
        return []
    if any(
        a.name == "block_size"
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
        for a in n.attribute
    ):
        if versions != [WEIGHT_ONLY_OPSET]:
            return [f"opset {versions} is not {WEIGHT_ONLY_OPSET}, which block-wise DequantizeLinear needs"]
        return []
    if len(versions) != 1 or not MIN_OPSET <= versions[0] <= MAX_OPSET:
        return [f"opset {versions} is outside {MIN_OPSET}..{MAX_OPSET}"]
    return []


def _static(value: onnx.ValueInfoProto) -> bool:
    t = value.type.tensor_type
    return t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _as_dict(value: onnx.ValueInfoProto) -> dict[str, object]:
    t = value.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
    return {"name": value.name, "shape": _dims(value), "dtype": dtype}


def _io_mismatches(graph: onnx.GraphProto, spec: GraphSpec) -> list[str]:
    problems = []
    for kind, declared, actual in (
        ("inputs", spec.inputs, graph.input),
        ("outputs", spec.outputs, graph.output),
    ):
        want = [t.to_json() for t in declared]
        got = [_as_dict(v) for v in actual]
        if want != got:
            problems.append(f"{kind} {got} differ from the declared {want}")
    return problems
