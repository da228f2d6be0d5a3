"""The onnxruntime engine: a bundle's graphs run on torch tensors, bound in place (IOBinding).

Inputs and outputs are torch tensors whose memory onnxruntime reads and writes directly, on the
CPU or, with the CUDA execution provider, on the GPU, so the KV cache never leaves its device.
Bindings persist between calls: small inputs are copied into buffers bound once, the caches are
bound in place (they never move), and outputs live in buffers allocated once per graph.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import external_data_helper
from torch import Tensor

from lantern_rt.bundle import Bundle, GraphEntry
from lantern_rt.graph_spec import PRESENT_PREFIX, TensorSpec
from lantern_rt.runtime.backends.bundle_graphs import (
    Outputs,
    RunnerFactory,
    bound_by_pointer,
    changed_inputs,
)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"

# The bytes of prepacked weights this process's CPU sessions may hold, each its own copy: past
# them, a session shares its factory's one copy of the weights, unpacked
# (:class:`SharedInitializers`). Unpacked MatMul weights ran 1.8x slower at GPT-B's 383 MB and
# 1.3-1.7x on the demo's 12 MB (BENCHMARKS.md, "Issue 58"), so a step graph's session prepacks
# while memory allows: half of the machine's (a process holds one session per graph file, so
# at most one copy per graph). A graph called once per image never takes the budget: its call
# is a sliver of an image's time, and its copy could leave a step graph unpacked.
PREPACK_BUDGET = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
_prepacked = [0]  # the bytes the live prepacked sessions hold, against PREPACK_BUDGET
_budget_lock = threading.Lock()
# ONNX element types a graph's external weights are shared in (as numpy arrays)
_SHARED_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.BOOL: np.bool_,
}
# Weights that onnxruntime turns into a copy of its own in each session whatever it is given:
# fp16 ones folded into fp32 through the Casts it inserts on the CPU, int8 and packed int4 ones
# into its quantized kernels' packed form (without prepacking, a Q/DQ graph runs DequantizeLinear
# then an fp32 MatMul: other numbers than the calibrated ones). A graph holding one keeps its own
# weights, prepacked.
_OWN_COPY_DTYPES = {
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT4,
    onnx.TensorProto.UINT4,
}


def default_providers() -> list[str]:
    """The CUDA execution provider when both onnxruntime and torch can use a GPU, else the CPU."""
    if CUDA in ort.get_available_providers() and torch.cuda.is_available():
        return [CUDA, CPU]
    return [CPU]


def writes_cache_in_place(device: str) -> bool:
    """Whether a bundle run here on ``device`` has its target's cache written in place by its
    graphs (exported so): when the run is on the CPU and this onnxruntime can
    (:func:`runs_in_place_steps`). Measured faster there (BENCHMARKS.md, "Issue 47: the cache
    written in place")."""
    return device.startswith("cpu") and default_providers()[0] == CPU and runs_in_place_steps()


@functools.cache
def runs_in_place_steps() -> bool:
    """Whether this onnxruntime runs what an in-place step graph needs on the CPU: opset 24's
    ``TensorScatter`` into a cache bound as its input and output, then ``Attention`` over it
    (1.32 does; older releases may lack either). A one-node-each graph run once per process."""
    from onnx import TensorProto, helper

    shapes = {"cache": [1, 1, 4, 2], "rows": [1, 1, 1, 2], "start": [1], "q": [1, 1, 1, 2]}
    graph = helper.make_graph(
        [
            helper.make_node("TensorScatter", ["cache", "rows", "start"], ["present"], axis=2),
            helper.make_node("Attention", ["q", "present", "present"], ["y"]),
        ],
        "in_place_probe",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64 if n == "start" else TensorProto.FLOAT, shape)
            for n, shape in shapes.items()
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("present", "y")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    cache = torch.zeros(shapes["cache"])
    inputs = {"rows": torch.ones(shapes["rows"]), "start": torch.tensor([2]), "q": torch.ones(shapes["q"])}
    try:
        session = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=[CPU])
        binding = session.io_binding()
        for name, tensor in {"cache": cache, **inputs}.items():
            binding.bind_input(
                name,
                "cpu",
                0,
                np.dtype(str(tensor.dtype).removeprefix("torch.")),
                list(tensor.shape),
                tensor.data_ptr(),
            )
        binding.bind_output("present", "cpu", 0, np.float32, shapes["cache"], cache.data_ptr())
        binding.bind_output("y")
        session.run_with_iobinding(binding)
    except Exception:  # an operator or opset this onnxruntime does not have
        return False
    return bool(cache[0, 0, 2].eq(1).all() and cache.sum() == 2)


def session_options(
    threads: int, config: dict[str, str] | None = None, spin: bool = False, prepack: bool = True
) -> ort.SessionOptions:
    """One intra-op pool of ``threads`` (0: onnxruntime's choice), all graph optimisations, and
    session ``config`` entries (e.g. ``{"session.disable_quant_qdq": "1"}``). The pool's threads
    never spin between calls: the runtime works in Python there, and spinning threads would take
    its core (measured: LANTERN++ 2.5x slower on two cores). With ``spin`` they spin within a
    call, handing each op to a thread that is awake, and stop as the call returns (onnxruntime's
    ``session.force_spinning_stop``): for a session one decode stream calls alone (BENCHMARKS.md,
    "Pool threads that spin only within a call"). The session logs errors only: its warnings
    are notes for onnxruntime's developers (a ``TensorScatter`` in a chain of them copies the
    cache it cannot write in place, once per call), not for a user. Without ``prepack`` the
    session reads MatMul weights as they are instead of making its own packed copy of each
    (``session.disable_prepacking``)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    return options


class SharedInitializers:
    """One in-memory copy of the external weights that a bundle's graphs read (its
    ``weights.bin``), handed to each of their sessions as user-owned ``OrtValue`` initializers
    (``SessionOptions.add_initializer``: onnxruntime reads them where they lie, in one read-only
    memory map per file, and copies nothing). A session that prepacks its MatMul weights makes
    a private packed copy of each whatever it is given, so the sessions given shared weights
    run with prepacking off (:func:`session_options`). Holds its arrays: it must outlive the
    sessions given them."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}
        # (file, offset, length, element type, shape) -> (the array, its OrtValue)
        self._values: dict[tuple, tuple[np.ndarray, ort.OrtValue]] = {}

    def add_to(self, options: ort.SessionOptions, folder: Path, tensors: list[onnx.TensorProto]) -> None:
        """Give ``options`` the shared arrays of ``tensors``, external initializers of a graph
        in ``folder`` (:func:`shareable_initializers`)."""
        for tensor in tensors:
            options.add_initializer(tensor.name, self._value(folder, tensor))

    def _value(self, folder: Path, tensor: onnx.TensorProto) -> ort.OrtValue:
        info = external_data_helper.ExternalDataInfo(tensor)
        file = (folder / info.location).resolve()
        if file not in self._maps:
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        offset = info.offset or 0
        key = (file, offset, tensor.data_type, tuple(tensor.dims))
        if key not in self._values:
            raw = self._maps[file][offset : offset + _nbytes(tensor)]
            array = raw.view(_SHARED_DTYPES[tensor.data_type]).reshape(tuple(tensor.dims))
            self._values[key] = (array, ort.OrtValue.ortvalue_from_numpy(array))
        return self._values[key][1]


def shareable_initializers(path: Path) -> list[onnx.TensorProto]:
    """The initializers of the graph at ``path`` (its main graph) whose data lies in an external
    file, to be shared, in an element type of :data:`_SHARED_DTYPES`; none when one of them is
    of :data:`_OWN_COPY_DTYPES`. Their data is not read."""
    graph = onnx.load(str(path), load_external_data=False).graph
    external = [t for t in graph.initializer if external_data_helper.uses_external_data(t)]
    if any(t.data_type in _OWN_COPY_DTYPES for t in external):
        return []
    return [t for t in external if t.data_type in _SHARED_DTYPES]


def _nbytes(tensor: onnx.TensorProto) -> int:
    """The bytes of ``tensor``'s data (an element type of :data:`_SHARED_DTYPES`)."""
    return int(np.prod(tensor.dims, dtype=np.int64)) * np.dtype(_SHARED_DTYPES[tensor.data_type]).itemsize


class OrtGraph:
    """One bundle graph in an onnxruntime session (a :class:`GraphRunner`), with bindings of
    its own: several runners may share a session and run it at once (decode streams, a bench's
    pipelines).

    Small inputs are copied into buffers bound once; cache inputs (``past_*``), too large to
    copy, are bound where they lie and rebound only when a call passes other memory. A graph's
    ``present_*`` output is bound to its ``past_*`` input's memory: the graph writes the cache in
    place (onnxruntime's TensorScatter on the CPU). ``opened``: the session and the
    :class:`SharedInitializers` it was given, if any, kept alive with the runner.
    """

    def __init__(self, opened: _Opened, entry: GraphEntry):
        self._opened = opened  # the session and the shared weights it reads: alive as long as it is
        self.session = opened.session
        on_gpu = self.session.get_providers()[0] == CUDA
        self.device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        self.inputs, self.outputs = entry.inputs, entry.outputs
        self._binding = self.session.io_binding()
        self._in_place = [bound_by_pointer(spec) for spec in self.inputs]
        self._buffers: list[Tensor | None] = [
            None if in_place else self._allocate(spec)
            for spec, in_place in zip(self.inputs, self._in_place, strict=True)
        ]
        for spec, buffer in zip(self.inputs, self._buffers, strict=True):
            if buffer is not None:
                self._bind(self._binding.bind_input, spec, buffer)
        names = [spec.name for spec in self.inputs]
        # output index -> the index of the input whose memory it is written into
        self._aliases = {
            j: names.index(spec.name.replace(PRESENT_PREFIX, "past_", 1))
            for j, spec in enumerate(self.outputs)
            if spec.name.startswith(PRESENT_PREFIX)
        }
        # output name -> the tensor it is written into (an aliased one's once its input is bound)
        self._results: dict[str, Tensor] = {}
        for j, spec in enumerate(self.outputs):
            if j not in self._aliases:
                self._results[spec.name] = self._allocate(spec)
                self._bind(self._binding.bind_output, spec, self._results[spec.name])
        self._outputs: Outputs = MappingProxyType(self._results)

    def __call__(self, **inputs: Tensor) -> Outputs:
        for i, spec, arg in changed_inputs(self.inputs, inputs, self._buffers):
            buffer = self._buffers[i]
            if not self._in_place[i]:
                buffer.copy_(arg)
                continue
            if buffer is None or buffer.data_ptr() != arg.data_ptr():
                given, arg = arg, arg.to(self.device, spec.torch_dtype).contiguous()
                if arg.data_ptr() != given.data_ptr() and i in self._aliases.values():
                    raise ValueError(f"{spec.name} is written in place: pass it contiguous, on {self.device}")
                self._bind(self._binding.bind_input, spec, arg)
                for j in (j for j, source in self._aliases.items() if source == i):
                    self._bind(self._binding.bind_output, self.outputs[j], arg)
                    self._results[self.outputs[j].name] = arg
            self._buffers[i] = arg  # keeps the bound memory alive
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # torch's pending writes, e.g. a cache commit
        self.session.run_with_iobinding(self._binding)
        return self._outputs

    def _allocate(self, spec: TensorSpec) -> Tensor:
        return torch.empty(spec.shape, dtype=spec.torch_dtype, device=self.device)

    def _bind(self, bind: Any, spec: TensorSpec, tensor: Tensor) -> None:
        index = self.device.index or 0
        bind(spec.name, self.device.type, index, np.dtype(spec.dtype), list(spec.shape), tensor.data_ptr())


def ort_runner(
    threads: int = 0,
    providers: list[str] | None = None,
    config: dict[str, str] | None = None,
    spin: bool = False,
) -> RunnerFactory:
    """A :data:`RunnerFactory` making onnxruntime sessions (default providers: see above;
    ``config`` and ``spin``: see :func:`session_options`). Drafting graphs get one
    thread whatever ``threads`` says: their ops are too small to split, and waking a second
    thread per op made LANTERN++ 8% slower on two cores. A graph file is opened once per process
    and settings: runners of the same graph (one per decode stream, one per pipeline of a bench or
    a calibration) share its session while one of them lives (:data:`_OPEN`). On the CPU,
    sessions prepack their weights, each its own copy, while the process's live copies stay within
    :data:`PREPACK_BUDGET`; the sessions opened past it, and those of graphs called once per
    image, share one copy of the bundle's weights (:class:`SharedInitializers`), unpacked."""
    chosen = providers or default_providers()
    shared = SharedInitializers()

    def make(bundle: Bundle, entry: GraphEntry) -> OrtGraph:
        path = bundle.file(entry)
        pool = 1 if entry.drafting else threads
        key = (*_file_key(path), pool, tuple(chosen), tuple(sorted((config or {}).items())), spin)
        with _budget_lock:
            opened = _OPEN.get(key)
        if opened is None:
            tensors = shareable_initializers(path) if chosen[0] == CPU else []
            size = sum(map(_nbytes, tensors))
            with _budget_lock:  # the budget is the process's: a bench holds several pipelines
                share = bool(tensors) and (entry.per_image or _prepacked[0] + size > PREPACK_BUDGET)
                _prepacked[0] += 0 if share else size
            options = session_options(pool, config, spin, prepack=not share)
            if share:
                shared.add_to(options, path.parent, tensors)
            session = ort.InferenceSession(str(path), options, providers=chosen)
            if not share and size:
                weakref.finalize(session, _release_prepacked, size)
            opened = _Opened(session, shared if share else None)
            with _budget_lock:
                opened = _OPEN.setdefault(key, opened)
        return OrtGraph(opened, entry)

    return make


@dataclass(eq=False)
class _Opened:
    """A session and the shared weights it was given (None: its own), alive while a runner
    holds it."""

    session: ort.InferenceSession
    weights: SharedInitializers | None


# The sessions this process holds, by graph file (its path and version) and session settings:
# every factory's runners of one graph share one session and one copy of its weights (a bench's
# pipelines, a calibration's recording and comparison); a session is closed when no runner holds it
_OPEN: weakref.WeakValueDictionary[tuple, _Opened] = weakref.WeakValueDictionary()


def _file_key(path: Path) -> tuple:
    """``path`` and the version of the file there (a bundle rewritten in place is another)."""
    stat = path.stat()
    return str(path.resolve()), stat.st_ino, stat.st_mtime_ns, stat.st_size


def _release_prepacked(size: int) -> None:
    """A prepacked session is gone: its bytes return to :data:`PREPACK_BUDGET`."""
    with _budget_lock:
        _prepacked[0] -= size
