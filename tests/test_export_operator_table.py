"""torch.onnx's operator table, built once per process for the exports (lantern_rt/export/exporter.py):
the graphs are the ones an export building it each time writes."""

from __future__ import annotations

import onnx
import pytest
import torch

from lantern_rt.export import exporter

registration = pytest.importorskip("torch.onnx._internal.exporter._registration")


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x).tanh(), dim=-1)


def export(path) -> onnx.ModelProto:
    torch.manual_seed(0)
    torch.onnx.export(Small().eval(), (torch.ones(2, 4),), str(path), dynamo=True, verbose=False)
    return onnx.load(str(path))


def test_the_table_is_built_once_and_the_graphs_are_unchanged(tmp_path, monkeypatch):
    fresh = export(tmp_path / "fresh.onnx")  # the table built by torch.onnx itself
    original = registration.ONNXRegistry.__dict__["from_torchlib"]
    calls = []

    def counted(cls, *args, **kwargs):
        calls.append(args)
        return original.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(registration.ONNXRegistry, "from_torchlib", classmethod(counted))
    monkeypatch.setattr(exporter, "_OPERATOR_TABLES", {})
    with exporter._operator_table_built_once():
        first, second = export(tmp_path / "a.onnx"), export(tmp_path / "b.onnx")
    assert len(calls) == 1
    assert registration.ONNXRegistry.__dict__["from_torchlib"].__func__ is counted  # put back
    for model in (first, second):
        assert model.graph.SerializeToString() == fresh.graph.SerializeToString()
