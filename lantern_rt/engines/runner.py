"""The TensorRT engine: a bundle's plans run by ``execute_async_v3`` on a torch CUDA stream.

Every input has a fixed address, so that each graph runner captures one CUDA graph on its first
call and replays it afterwards. Small inputs (tokens, positions, masks, hidden states) are
copied into buffers allocated once; the per-layer caches (``past_k_{i}``/``past_v_{i}``), which
the runtime keeps in place, are bound by pointer, and a new pointer re-captures the graph.
Outputs are buffers allocated once per graph. When capture fails the runner keeps executing
plainly and says why in ``cuda_graph_error``.

The same runner serves every flavour (:mod:`lantern_rt.engines.compat`): TensorRT and TensorRT
for RTX share this part of the API. This module imports no TensorRT: :func:`trt_runner` does,
with an install hint when it cannot.
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lantern_rt.bundle import Bundle, GraphEntry
from lantern_rt.engines import compat
from lantern_rt.engines.compat import EngineError, TensorRTUnavailable, make_logger
from lantern_rt.engines.plans import device_info, find_engines, machine
from lantern_rt.errors import first_line
from lantern_rt.graph_spec import TensorSpec
from lantern_rt.runtime.backends.bundle_graphs import (
    Outputs,
    RunnerFactory,
    bound_by_pointer,
    ordered,
)


def io_problems(engine_io: dict[str, dict[str, Any]], entry: GraphEntry) -> list[str]:
    """How an engine's I/O tensors (name -> {"input", "shape", "dtype"}) differ from a bundle
    graph's inputs and outputs: [] when they match."""
    problems = []
    declared = [(spec, True) for spec in entry.inputs] + [(spec, False) for spec in entry.outputs]
    for spec, is_input in declared:
        got = engine_io.get(spec.name)
        want = {"input": is_input, "shape": list(spec.shape), "dtype": spec.dtype}
        if got is None:
            problems.append(f"the plan has no tensor {spec.name}")
        elif got != want:
            problems.append(f"tensor {spec.name} is {got} in the plan, {want} in the manifest")
    extra = sorted(set(engine_io) - {spec.name for spec, _ in declared})
    problems += [f"the plan has an undeclared tensor {name}" for name in extra]
    return problems


def engine_io(trt: Any, engine: Any) -> dict[str, dict[str, Any]]:
    """An engine's I/O tensors as name -> {"input", "shape", "dtype" (numpy's name)}."""
    io = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        io[name] = {
            "input": engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT,
            "shape": list(engine.get_tensor_shape(name)),
            "dtype": np.dtype(trt.nptype(engine.get_tensor_dtype(name))).name,
        }
    return io


class TrtGraph:
    """One bundle graph as a TensorRT engine (a :class:`GraphRunner`), on the current CUDA device."""

    def __init__(
        self, trt: Any, runtime: Any, logger: Any, plan: Path, entry: GraphEntry, cuda_graph: bool = True
    ):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._runtime, self._logger = runtime, logger  # TensorRT wants both to outlive the engine
        with plan.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            self.engine = runtime.deserialize_cuda_engine(data)  # file pages, not a copy in memory
        if self.engine is None:
            reason = "; ".join(logger.errors) or "no reason logged"
            raise EngineError(
                f"TensorRT could not load {plan}: {reason}; rebuild it with `lantern build-engines`"
            )
        problems = io_problems(engine_io(trt, self.engine), entry)
        if problems:
            raise EngineError(f"{plan} does not match the bundle's graph: {problems[0]}")
        self.context = self.engine.create_execution_context()
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self.stream = torch.cuda.Stream(self.device)
        self._buffers = [self._empty(spec) for spec in self.inputs]
        self._bound: list[Tensor] = list(self._buffers)  # what each input is bound to (kept alive)
        self._results = {spec.name: self._empty(spec) for spec in self.outputs}
        self._outputs: Outputs = MappingProxyType(self._results)
        for spec, tensor in zip(
            self.inputs + self.outputs, self._buffers + list(self._results.values()), strict=True
        ):
            self._bind(spec, tensor)
        self.use_cuda_graph = cuda_graph
        self.cuda_graph_error: str | None = None
        self._graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, **inputs: Tensor) -> Outputs:
        args = ordered(self.inputs, inputs)
        current = torch.cuda.current_stream(self.device)
        for i, (spec, arg) in enumerate(zip(self.inputs, args, strict=True)):
            if bound_by_pointer(spec) and self._in_place(arg, spec):
                target = arg
            else:
                target = self._buffers[i]
                target.copy_(arg)  # on the caller's stream, which ours waits for below
            if target.data_ptr() != self._bound[i].data_ptr():
                self._bind(spec, target)
                self._graph = None  # the captured graph holds the old address
            self._bound[i] = target
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self._run()
        current.wait_stream(self.stream)
        return self._outputs

    def _run(self) -> None:
        if self._graph is not None:
            self._graph.replay()
            return
        self._enqueue()  # this call's results; TensorRT also wants one run before a capture
        if self.use_cuda_graph and self.cuda_graph_error is None:
            self._graph = self._capture()

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self._enqueue()
        except RuntimeError as err:
            self.cuda_graph_error = first_line(err)
            print(f"warning: running without a CUDA graph: {self.cuda_graph_error}", file=sys.stderr)
            return None
        return graph

    def _enqueue(self) -> None:
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT's execute_async_v3 failed (see its log above)")

    def _in_place(self, arg: Tensor, spec: TensorSpec) -> bool:
        """Whether ``arg`` can be bound as it is: on this GPU, of the graph's dtype, contiguous."""
        return arg.device == self.device and arg.dtype == spec.torch_dtype and arg.is_contiguous()

    def _empty(self, spec: TensorSpec) -> Tensor:
        return torch.zeros(spec.shape, dtype=spec.torch_dtype, device=self.device)

    def _bind(self, spec: TensorSpec, tensor: Tensor) -> None:
        if not self.context.set_tensor_address(spec.name, tensor.data_ptr()):
            raise RuntimeError(f"TensorRT refused the address of {spec.name}")


def trt_runner(bundle: Bundle, cuda_graphs: bool = True) -> RunnerFactory:
    """A :data:`RunnerFactory` over the plans built for ``bundle`` that run here: the first
    installed flavour (TensorRT's first) with a plan set of its version for this GPU.
    :class:`EngineError` when no flavour is installed, there is no GPU or no matching plans (one
    line, each plan set found with why it cannot run here)."""
    flavours = compat.installed_flavours()
    if not flavours:
        raise TensorRTUnavailable(compat.no_tensorrt_hint())
    modules = [compat.require(flavour) for flavour in flavours]
    device = device_info()
    refusals = []
    for flavour, trt in zip(flavours, modules, strict=True):
        try:
            plans = find_engines(bundle, machine(flavour.name, trt.__version__, device, bundle.dtype))
            break
        except EngineError as err:
            refusals.append(str(err))
    else:
        raise EngineError("; ".join(refusals))
    logger = make_logger(trt)
    runtime = trt.Runtime(logger)

    def make(graph_bundle: Bundle, entry: GraphEntry) -> TrtGraph:
        if graph_bundle.path != bundle.path:
            raise EngineError(f"this TensorRT runner serves {bundle.path}, not {graph_bundle.path}")
        return TrtGraph(trt, runtime, logger, plans[entry.name], entry, cuda_graphs)

    return make
