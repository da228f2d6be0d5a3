"""share_weights: one weights file for the graphs of a bundle, and onnxruntime sessions over it."""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from lantern_rt.shared_weights import (
    SharedWeights,
    ShareError,
    initializer_names,
    share_weights,
)

WEIGHTS = "weights.bin"
CANONICAL = re.compile(r"w_[0-9a-f]{20}")
X = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
FEEDS = {  # graph -> the inputs it runs on; the cond graph takes both branches
    "plain.onnx": [{"x": X}],
    "cond.onnx": [{"x": X, "flag": np.array(True)}, {"x": X, "flag": np.array(False)}],
}


class Plain(nn.Module):
    """The shared layer (as ``head``) plus a constant under ``min_bytes``."""

    def __init__(self, shared: nn.Linear):
        super().__init__()
        self.head = shared
        self.register_buffer("offset", torch.arange(3.0).reshape(3, 1))

    def forward(self, x):
        return torch.tanh(self.head(x)) + self.offset


class Cond(nn.Module):
    """The shared layer (as ``proj``) after an If whose then-branch alone reads ``branch``."""

    def __init__(self, shared: nn.Linear, branch: nn.Linear):
        super().__init__()
        self.proj, self.branch = shared, branch

    def forward(self, x, flag):
        y = torch.cond(flag, lambda t: self.branch(t), lambda t: t * 1.0, (x,))
        return self.proj(y)


def run(path: Path, options: ort.SessionOptions | None = None) -> list[list[np.ndarray]]:
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [session.run(None, feeds) for feeds in FEEDS[path.name]]


def assert_same(got: list[list[np.ndarray]], want: list[list[np.ndarray]]) -> None:
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, dict, nn.Linear, nn.Linear]:
    """plain.onnx (weights in plain.onnx.data) and cond.onnx (weights inline), their outputs,
    and the two layers."""
    folder = tmp_path_factory.mktemp("exported")
    torch.manual_seed(0)
    shared, branch = nn.Linear(64, 256), nn.Linear(64, 64)
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the exporter's notes on missing torchvision ops
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for module, args, name, external in (
                (Plain(shared), (torch.from_numpy(X),), "plain.onnx", True),
                (Cond(shared, branch), (torch.from_numpy(X), torch.tensor(True)), "cond.onnx", False),
            ):
                path = str(folder / name)
                torch.onnx.export(
                    module.eval(), args, path, opset_version=18, dynamo=True, external_data=external
                )
    finally:
        logger.setLevel(level)
    return folder, {name: run(folder / name) for name in FEEDS}, shared, branch


@pytest.fixture
def bundle(exported, tmp_path) -> Path:
    """A fresh copy of the exported folder."""
    return Path(shutil.copytree(exported[0], tmp_path / "bundle"))


def graphs(folder: Path) -> list[Path]:
    return [folder / name for name in FEEDS]


def test_graphs_share_one_copy_of_each_weight(exported, bundle):
    _, outputs, shared, branch = exported
    assert sorted(p.name for p in bundle.iterdir()) == ["cond.onnx", "plain.onnx", "plain.onnx.data"]
    result = share_weights(graphs(bundle), bundle / WEIGHTS)

    # shared's weight and bias once, branch's weight; branch's bias (256 bytes) stays inline
    big = [shared.weight, shared.bias, branch.weight]
    distinct = sum(p.numel() * p.element_size() for p in big)
    size = (bundle / WEIGHTS).stat().st_size
    assert result == SharedWeights(bundle / WEIGHTS, tensors=3, bytes=size, references=5)
    assert distinct <= size < distinct + 64 * len(big)  # 64-byte alignment at most
    assert sorted(p.name for p in bundle.iterdir()) == ["cond.onnx", "plain.onnx", WEIGHTS]
    for path in graphs(bundle):
        assert path.stat().st_size < branch.weight.numel() * 4, path.name  # no big weight inline
        assert_same(run(path), outputs[path.name])
        onnx.checker.check_model(str(path), full_check=True)

    plain, cond = (initializer_names(p) for p in graphs(bundle))
    assert all(CANONICAL.fullmatch(name) for name in plain + cond)
    assert len(plain) == 2 and set(plain) < set(cond) and len(cond) == 3  # one name for shared's
    [only_in_branch] = set(cond) - set(plain)
    model = onnx.load(str(bundle / "cond.onnx"), load_external_data=False)
    [if_node] = [n for n in model.graph.node if n.op_type == "If"]
    then_branch = next(a.g for a in if_node.attribute if a.name == "then_branch")
    assert only_in_branch in [name for node in then_branch.node for name in node.input]
    assert only_in_branch not in [name for node in model.graph.node for name in node.input]


def test_sharing_twice_is_refused(bundle):
    share_weights(graphs(bundle), bundle / WEIGHTS)
    files = {p.name: p.read_bytes() for p in bundle.iterdir()}
    with pytest.raises(ShareError, match="already exists"):
        share_weights(graphs(bundle), bundle / WEIGHTS)
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == files
    with pytest.raises(ShareError, match="not in the folder"):
        share_weights(graphs(bundle), bundle.parent / "elsewhere.bin")


def branchy(extra_value: str | None = None) -> onnx.ModelProto:
    """``If(c, x + W + V, U), K``: the top-level W, also an (overridable) input, is read only
    by the then-branch, whose own V is a copy of W; the else-branch returns its own U (held in
    float_data, not raw_data); the top-level K is an output itself. ``extra_value`` names one
    more value, an output."""
    rng = np.random.default_rng(1)
    w, u, k = (rng.standard_normal(512).astype(np.float32) for _ in range(3))
    value = helper.make_tensor_value_info
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["t"]), helper.make_node("Add", ["t", "V"], ["o_then"])],
        "then",
        [],
        [value("o_then", TensorProto.FLOAT, [512])],
        [numpy_helper.from_array(w, "V")],
    )
    other = helper.make_graph(
        [],
        "else",
        [],
        [value("U", TensorProto.FLOAT, [512])],
        [helper.make_tensor("U", TensorProto.FLOAT, [512], u)],
    )
    nodes = [helper.make_node("If", ["c"], ["o"], then_branch=then, else_branch=other)]
    outputs = [value(name, TensorProto.FLOAT, [512]) for name in ("o", "K")]
    if extra_value is not None:
        nodes.append(helper.make_node("Neg", ["x"], [extra_value]))
        outputs.append(value(extra_value, TensorProto.FLOAT, [512]))
    inputs = [value("x", TensorProto.FLOAT, [512]), value("c", TensorProto.BOOL, [])]
    inputs.append(value("W", TensorProto.FLOAT, [512]))
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(k, "K")]
    graph = helper.make_graph(nodes, "branchy", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def shared_branchy(folder: Path, extra_value: str | None = None) -> tuple[SharedWeights, onnx.GraphProto]:
    """Share the weights of :func:`branchy` alone, checking that both branches compute as before."""
    folder.mkdir()
    path = folder / "branchy.onnx"
    onnx.save(branchy(extra_value), str(path))
    feeds = [{"x": np.linspace(-1, 1, 512, dtype=np.float32), "c": np.array(c)} for c in (True, False)]
    before = [ort.InferenceSession(str(path)).run(None, f) for f in feeds]
    result = share_weights([path], folder / WEIGHTS)
    assert_same([ort.InferenceSession(str(path)).run(None, f) for f in feeds], before)
    onnx.checker.check_model(str(path), full_check=True)
    return result, onnx.load(str(path), load_external_data=False).graph


def test_subgraph_references_follow_the_renaming(tmp_path):
    result, graph = shared_branchy(tmp_path / "a")
    assert (result.tensors, result.references) == (2, 3)  # V is W's copy: dropped
    w, k = graph.initializer
    branches = {attr.name: attr.g for attr in graph.node[0].attribute}
    then, other = branches["then_branch"], branches["else_branch"]
    assert not then.initializer  # V now reads the outer W
    assert [v.name for v in graph.input] == ["x", "c", w.name]
    assert [list(node.input) for node in then.node] == [["x", w.name], ["t", w.name]]
    [u] = other.initializer
    assert CANONICAL.fullmatch(w.name) and CANONICAL.fullmatch(u.name) and w.name != u.name
    assert other.output[0].name == u.name
    assert k.name == "K" and k.HasField("raw_data")  # a graph output keeps its name and data

    # a value that already bears W's content name: W is given another
    _, graph = shared_branchy(tmp_path / "b", extra_value=w.name)
    assert graph.initializer[0].name not in (w.name, "W")
