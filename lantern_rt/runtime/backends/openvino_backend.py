"""The OpenVINO engine: a bundle's standard graphs compiled for OpenVINO's CPU plugin.

Each graph file is read (its weights from the bundle's shared ``weights.bin``) and compiled once;
every runner of it (one per decode stream) has its own infer request. Inputs and outputs are torch
tensors whose memory OpenVINO reads and writes directly (``ov.Tensor`` over a numpy view of it):
small inputs are copied into buffers set once, the caches and the other inputs kept where the
caller holds them are set where they lie and set again only when a call passes other memory, and
each output is a buffer allocated once per runner that the request writes into.
"""

from __future__ import annotations

from types import MappingProxyType

import openvino as ov
import torch
from torch import Tensor

from lantern_rt.bundle import Bundle, GraphEntry
from lantern_rt.graph_spec import TensorSpec
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.backends.bundle_graphs import (
    Outputs,
    RunnerFactory,
    bound_by_pointer,
    changed_inputs,
)


def shared(tensor: Tensor) -> ov.Tensor:
    """An OpenVINO tensor over ``tensor``'s memory (contiguous, on the CPU): no copy either way."""
    return ov.Tensor(tensor.numpy(), shared_memory=True)


def compile_options(threads: int, streams: int) -> dict[str, object]:
    """The CPU plugin's settings for a graph: fp32 arithmetic where the graph computes in fp32 (the
    plugin's default on a CPU with bf16 units is bf16, which changes greedy tokens), ``threads``
    CPU threads in all (0: OpenVINO's choice) and ``streams`` execution streams, one per decode
    stream; a single stream is compiled for latency. Threads are not pinned to cores: processes
    that each run OpenVINO (``generate-set`` workers) would pin theirs to the same ones."""
    options: dict[str, object] = {"INFERENCE_PRECISION_HINT": "f32", "ENABLE_CPU_PINNING": False}
    if streams == 1:
        options["PERFORMANCE_HINT"] = "LATENCY"
    else:
        options["NUM_STREAMS"] = streams
    if threads:
        options["INFERENCE_NUM_THREADS"] = threads
    return options


def check_runnable(bundle: Bundle) -> None:
    """:class:`ConfigError` unless OpenVINO can run ``bundle``'s graphs: those written with the
    cache in place use opset 24's ``TensorScatter``, which OpenVINO's ONNX reader lacks (2026.4)."""
    if bundle.constants.cache_scratch or bundle.constants.drafter_scratch:
        raise ConfigError(
            f"openvino cannot run the in-place graphs of {bundle.path} (opset 24's TensorScatter, "
            "which OpenVINO does not read): export the model without --cache-in-place"
        )


class OvGraph:
    """One bundle graph as an infer request of its compiled model (a :class:`GraphRunner`):
    several runners may share a compiled model and run it at once (decode streams)."""

    device = torch.device("cpu")

    def __init__(self, compiled: ov.CompiledModel, entry: GraphEntry):
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self._request = compiled.create_infer_request()
        self._by_pointer = [bound_by_pointer(spec) for spec in self.inputs]
        self._buffers: list[Tensor | None] = [
            None if by_pointer else _allocate(spec)
            for spec, by_pointer in zip(self.inputs, self._by_pointer, strict=True)
        ]
        self._results = {spec.name: _allocate(spec) for spec in self.outputs}
        self._outputs: Outputs = MappingProxyType(self._results)
        for spec, tensor in (
            *zip(self.inputs, self._buffers, strict=True),
            *zip(self.outputs, self._results.values(), strict=True),
        ):
            if tensor is not None:
                self._request.set_tensor(spec.name, shared(tensor))

    def __call__(self, **inputs: Tensor) -> Outputs:
        for i, spec, arg in changed_inputs(self.inputs, inputs, self._buffers):
            buffer = self._buffers[i]
            if not self._by_pointer[i]:
                buffer.copy_(arg)
                continue
            if buffer is None or buffer.data_ptr() != arg.data_ptr() or not arg.is_contiguous():
                arg = arg.cpu().contiguous()
                self._request.set_tensor(spec.name, shared(arg))
            self._buffers[i] = arg  # keeps the memory set alive
        self._request.start_async()
        self._request.wait()
        return self._outputs


def _allocate(spec: TensorSpec) -> Tensor:
    return torch.empty(spec.shape, dtype=spec.torch_dtype)


def ov_runner(threads: int = 0, streams: int = 1) -> RunnerFactory:
    """A :data:`RunnerFactory` compiling each graph file once for OpenVINO's CPU plugin with
    ``threads`` threads in all (0: OpenVINO's choice) shared by ``streams`` execution streams
    (:func:`compile_options`); runners it makes for the same graph (one per decode stream) share
    its compiled model and weights. Drafting graphs get one thread per stream, as on onnxruntime:
    their ops are too small to split. A graph OpenVINO cannot read is a :class:`ConfigError`
    naming it and the reason."""
    core = ov.Core()
    compiled: dict[str, ov.CompiledModel] = {}

    def make(bundle: Bundle, entry: GraphEntry) -> OvGraph:
        path = str(bundle.file(entry))
        if path not in compiled:
            options = compile_options(streams if entry.drafting else threads, streams)
            try:
                compiled[path] = core.compile_model(path, "CPU", options)
            except RuntimeError as error:
                raise ConfigError(f"openvino cannot run {path}: {_reason(error)}") from None
        return OvGraph(compiled[path], entry)

    return make


def _reason(error: RuntimeError) -> str:
    """The line of an OpenVINO error that says what failed (its messages run over many lines)."""
    lines = [line.strip(" -") for line in str(error).splitlines() if line.strip(" -")]
    named = [line for line in lines if "operations:" in line or "not supported" in line.lower()]
    return (named or lines or ["unknown error"])[-1]
