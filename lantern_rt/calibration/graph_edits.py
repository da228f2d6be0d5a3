"""Small edits that quantization makes to an ONNX graph's values."""

from __future__ import annotations

import onnx

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
