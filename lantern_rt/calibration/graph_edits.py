"""Small edits that quantization makes to an ONNX graph's values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from lantern_rt.graph_rules import node_subgraphs, with_subgraphs


def reads(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads: its inputs and what its subgraphs read from outside them."""
    names = set(node.input)
    for graph in node_subgraphs(node):
        inside = {i.name for i in graph.input} | {t.name for t in graph.initializer}
        inside |= {name for inner in graph.node for name in inner.output}
        names |= {name for inner in graph.node for name in reads(inner)} - inside
    return names - {""}


def drop_unread_initializers(graph: onnx.GraphProto) -> None:
    """Remove the initializers of ``graph`` that no node (at any depth) and no output reads."""
    read = {name for g in with_subgraphs(graph) for n in g.node for name in reads(n)}
    read |= {o.name for o in graph.output}
    for tensor in [t for t in graph.initializer if t.name not in read]:
        graph.initializer.remove(tensor)


def tensor_values(tensor: onnx.TensorProto, folder: Path | None = None) -> np.ndarray:
    """``tensor``'s values; those of a tensor whose data lies in an external file (in ``folder``)
    read into the array alone, the proto left without them."""
    if not external_data_helper.uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    if folder is None:
        raise ValueError(f"{tensor.name}'s data lies in an external file: give its folder")
    loaded = onnx.TensorProto()
    loaded.CopyFrom(tensor)
    external_data_helper.load_external_data_for_tensor(loaded, str(folder))
    return numpy_helper.to_array(loaded)
