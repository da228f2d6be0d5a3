"""Graphs without If nodes, for TensorRT.

A bundle's drafting and verify graphs skip the top-k/top-p sort with an If when both are off
(:func:`lantern_rt.runtime.sampling.filter_logits`). TensorRT reads an If's condition on the
host, so an engine holding one cannot be captured in a CUDA graph (NVIDIA/TensorRT#2836).
Those Ifs only skip work: their then-branch (the filter) gives the else-branch's result
whenever the condition is false. Replacing each If by its then-branch is therefore exact, and
it is what :func:`lantern_rt.engines.plans.build_plan` parses.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
from onnx import helper


def has_conditionals(graph: onnx.GraphProto) -> bool:
    """Whether ``graph`` holds an If node at its top level."""
    return any(node.op_type == "If" for node in graph.node)


def inline_then_branches(graph: onnx.GraphProto) -> None:
    """Replace, in place, every If of ``graph`` by the nodes of its then-branch, writing the
    If's outputs (see the module's note for when that is exact)."""
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "If":
            nodes.append(node)
            continue
        branch = next(attr.g for attr in node.attribute if attr.name == "then_branch")
        inline_then_branches(branch)
        graph.initializer.extend(branch.initializer)
        graph.value_info.extend(branch.value_info)
        outputs = {inner.name: outer for inner, outer in zip(branch.output, node.output, strict=True)}
        produced = set()
        for inner in branch.node:
            inner.input[:] = [outputs.get(name, name) for name in inner.input]
            inner.output[:] = [outputs.get(name, name) for name in inner.output]
            produced.update(inner.output)
            nodes.append(inner)
        nodes += [  # a branch output that is an outer value or an initializer as it is
            helper.make_node("Identity", [inner], [outer], name=f"{node.name}/{outer}")
            for inner, outer in outputs.items()
            if outer not in produced
        ]
    del graph.node[:]
    graph.node.extend(nodes)


@contextlib.contextmanager
def without_conditionals(onnx_path: Path) -> Iterator[Path]:
    """``onnx_path`` itself when it holds no If, else a temporary copy (same file name) with
    every If replaced by its then-branch."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    if not has_conditionals(model.graph):
        yield onnx_path
        return
    model = onnx.load(str(onnx_path))  # with any external weights: the copy holds them inline
    inline_then_branches(model.graph)
    with tempfile.TemporaryDirectory(prefix="lantern-inlined-") as tmp:
        path = Path(tmp) / onnx_path.name
        onnx.save(model, str(path))
        yield path
