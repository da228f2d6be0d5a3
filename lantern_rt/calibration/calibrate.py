"""INT8 by calibration: a Q/DQ bundle made from an fp32 bundle and the inputs its graphs really see
(or a weight-only bundle: the same MatMuls' weights in 4 or 8 bits; the choice is one
:class:`~.quantization.Quantization`).

:func:`calibrate_bundle` generates images with the fp32 bundle on onnxruntime through a recording
:data:`RunnerFactory` (the decode loop is unchanged), quantizes the target's graphs with
onnxruntime's static QDQ quantizer (symmetric int8, zero points 0, per-channel weight scales, only
the weight MatMul/Gemm inputs: attention products, softmax, the output head that makes the logits,
the drafter's graphs and the VQ decoder stay fp32, :meth:`~.quantization.Quantization.kept`), writes the new bundle as
the exporter does (:func:`lantern_rt.bundle.staged_bundle` and
:func:`~lantern_rt.bundle.write_manifest`), and compares it with the fp32 bundle: accuracy with the
Q/DQ numerics as written (what TensorRT implements), speed on the runtime's onnxruntime sessions.

A weight-only bundle (docs/method.md §14) replaces each of those MatMuls by onnxruntime's
``MatMulNBits`` (blockwise symmetric weights, products in int8 on CPUs with VNNI), in the target's
and the drafter's graphs: no activation is quantized ahead of time, so the recorded inputs serve
only the comparison with fp32. TensorRT cannot build it; it is an onnxruntime bundle.

TensorRT's weight-only form (:mod:`.weight_only`: W4A16 or W8A16) is made from
an fp16 bundle instead: the same MatMuls' weights as int4 or int8 blocks behind a block-wise
``DequantizeLinear`` (standard ONNX, opset 21), activations fp16; TensorRT builds it and
onnxruntime runs it, so it is compared with the fp16 bundle here.

A bundle whose graphs write their caches in place (``export --cache-in-place``, onnxruntime on
the CPU) is quantized the same way and stays in place: its copy is an onnxruntime bundle too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import logging
import math
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import external_data_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    create_calibrator,
    quantize_static,
)
from onnxruntime.quantization.calibrate import save_tensors_data
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
from torch import Tensor

from lantern_rt.assembly import Pipeline, bundle_pipeline
from lantern_rt.bundle import (
    WEIGHTS,
    Bundle,
    GraphEntry,
    io_specs,
    staged_bundle,
    write_manifest,
)
from lantern_rt.calibration.errors import CalibrationError
from lantern_rt.calibration.graph_edits import drop_unread_initializers, reads, tensor_values
from lantern_rt.calibration.quantization import WEIGHT_BLOCK, WEIGHT_ONLY_ACCURACY_LEVEL, Quantization
from lantern_rt.calibration.weight_only import WeightOnly, block_problems, dequantizable, dequantized_model
from lantern_rt.engines.conditionals import has_conditionals
from lantern_rt.families.loading import bundle_info, open_bundle
from lantern_rt.generate import Generation, generate
from lantern_rt.graph_rules import check_graph, with_subgraphs
from lantern_rt.runtime.backends.bundle_graphs import (
    BundleDrafter,
    GraphRunner,
    Outputs,
    RunnerFactory,
    bundle_trees,
    bundle_windows,
)
from lantern_rt.runtime.backends.onnxruntime_backend import CPU, ort_runner, session_options
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.speculation import jacobi_speculation, speculation
from lantern_rt.settings import MethodConfig, calibration_method, default_sampling
from lantern_rt.shared_weights import share_weights
from lantern_rt.stats import GenerationStats

QUANTIZED_OPS = ("MatMul", "Gemm")
MAX_SAMPLES_PER_GRAPH = 32  # recorded calls kept per graph (a demo target step: ~4 MB each)
# and at most this many bytes of them (at least one call). A demo step at B = 1 takes 12 MB a
# call (8 of them its neighbour table), so 21 calls; at B = 32 126 MB, so 2: 32 calls of each
# step graph of a bundle for B = 16, 32 and 64 would need about 100 GB.
MAX_RECORDED_BYTES_PER_GRAPH = 256 * 2**20
QDQ = ("QuantizeLinear", "DequantizeLinear")
_PRECISION = {"float32": "fp32", "float16": "fp16"}  # a graph kept as it was: its compute dtype


class RecordedCalls(Sequence[dict[str, np.ndarray]]):
    """A graph's recorded calls by slot, each kept in a file of a temporary folder of its own
    rather than in memory (at GPT-B two step graphs' calls took 1.2x the weight bytes) and read
    back when indexed, as numpy arrays keyed by input name. The folder goes with the object."""

    def __init__(self, names: Sequence[str]):
        self._names = list(names)
        self._folder = tempfile.TemporaryDirectory(prefix="lantern-recorded-")
        self._count = 0

    def put(self, slot: int, arrays: Sequence[np.ndarray]) -> None:
        """Keep a call's ``arrays`` (one per input name, in order) in ``slot``: the next one, or
        one already kept, which they replace."""
        if not 0 <= slot <= self._count:
            raise IndexError(f"slot {slot} of {self._count}")
        np.savez(self._path(slot), *arrays)
        self._count = max(self._count, slot + 1)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, slot: int) -> dict[str, np.ndarray]:
        if not 0 <= slot < self._count:
            raise IndexError(f"slot {slot} of {self._count}")
        with np.load(self._path(slot)) as stored:
            return {name: stored[f"arr_{i}"] for i, name in enumerate(self._names)}

    def _path(self, slot: int) -> Path:
        return Path(self._folder.name) / f"{slot}.npz"


class Recorder:
    """Wraps a :data:`RunnerFactory`; keeps copies of at most ``limit`` calls per graph, and of
    no more than ``max_bytes`` of them (but at least one), drawn uniformly from all its calls
    (reservoir sampling), in :attr:`samples` by graph name (on disk: :class:`RecordedCalls`)."""

    def __init__(
        self,
        inner: RunnerFactory,
        limit: int = MAX_SAMPLES_PER_GRAPH,
        seed: int = 0,
        max_bytes: int = MAX_RECORDED_BYTES_PER_GRAPH,
        quantization: Quantization = Quantization(),
    ):
        self.inner: RunnerFactory | None = inner
        self.limit, self.max_bytes, self._rng = limit, max_bytes, random.Random(seed)
        self.quantization = quantization  # the graphs it quantizes are the ones recorded
        self.samples: dict[str, RecordedCalls] = {}
        self.calls: dict[str, int] = {}
        self.limits: dict[str, int] = {}  # per graph: calls kept

    def close(self) -> None:
        """Drop the runner factory, and with it what its sessions shared (the bundle's weights,
        memory-mapped); the samples and counts stay."""
        self.inner = None

    def __call__(self, bundle: Bundle, entry: GraphEntry) -> GraphRunner:
        runner = self.inner(bundle, entry)
        if self.quantization.kept(entry):
            return runner
        if entry.name not in self.samples:
            self.samples[entry.name] = RecordedCalls([spec.name for spec in entry.inputs])
        self.calls.setdefault(entry.name, 0)
        call = sum(math.prod(spec.shape) * np.dtype(spec.dtype).itemsize for spec in entry.inputs)
        self.limits[entry.name] = max(1, min(self.limit, self.max_bytes // call))
        return _RecordingRunner(self, entry, runner)

    def offer(self, entry: GraphEntry, inputs: dict[str, Tensor]) -> None:
        """Keep this call's inputs with the probability that keeps the sample uniform."""
        name = entry.name
        seen, kept, limit = self.calls[name], self.samples[name], self.limits[name]
        self.calls[name] = seen + 1
        slot = seen if seen < limit else self._rng.randrange(seen + 1)
        if slot >= limit:
            return
        kept.put(
            slot,
            [
                inputs[spec.name].detach().cpu().numpy().astype(spec.dtype, copy=False)
                for spec in entry.inputs
            ],
        )


class _RecordingRunner:
    """A graph runner that offers every call's inputs to its :class:`Recorder`."""

    def __init__(self, recorder: Recorder, entry: GraphEntry, inner: GraphRunner):
        self.recorder, self.entry, self.inner = recorder, entry, inner
        self.device = inner.device

    def __call__(self, **inputs: Tensor) -> Outputs:
        self.recorder.offer(self.entry, inputs)
        return self.inner(**inputs)


class _Samples(CalibrationDataReader):
    """onnxruntime's calibration reader over recorded inputs."""

    def __init__(self, samples: Sequence[dict[str, np.ndarray]]):
        self._it: Iterator[dict[str, np.ndarray]] = iter(samples)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def spread_labels(count: int, num_classes: int) -> list[int]:
    """``count`` class ids spread evenly over all classes (each class once before any repeats)."""
    return [i * num_classes // count if count < num_classes else i % num_classes for i in range(count)]


def conditions(bundle: Bundle, count: int | None, prompts: Sequence[str]) -> list[int | str]:
    """``count`` conditions to generate from: class ids spread over the classes (default count:
    one per class), or for a prompt-conditioned bundle the ``prompts`` in turn (default count:
    each once); :class:`CalibrationError` for a prompt bundle without prompts or the reverse."""
    if bundle.gpt.takes_prompts:
        if not prompts:
            raise CalibrationError(f"{bundle.path} generates from prompts: give --prompts FILE")
        return [prompts[i % len(prompts)] for i in range(count or len(prompts))]
    if prompts:
        raise CalibrationError(f"{bundle.path} is class-conditional: drop --prompts")
    num_classes = bundle.gpt.num_classes
    return list(spread_labels(count or num_classes, num_classes))


def pipelines(
    bundle: Bundle, method: MethodConfig, runner: RunnerFactory, batch: int = 1
) -> dict[str, Pipeline]:
    """An ``ar`` pipeline and, for a speculative ``method``, one per tree of the bundle (a Jacobi
    method: per chain with a verify graph), all on one set of graph runners, ``batch`` images
    per step."""
    ar = bundle_pipeline(bundle, batch, MethodConfig("ar"), runner, "onnxruntime")
    if method.method == "ar":
        return {"ar": ar}
    if method.jacobi:
        windows = bundle_windows(bundle)
        if not windows:
            raise CalibrationError(
                f"{bundle.path} has no chain verify graph for {method.method}: use method ar"
            )
        return {
            name: dataclasses.replace(
                ar,
                speculation=jacobi_speculation(ar.target, bundle.gpt, window, method, bundle.neighbors()),
                method=dataclasses.replace(method, tree=name),
            )
            for name, window in windows.items()
        } | {"ar": ar}
    if not bundle.has_drafter:
        raise CalibrationError(f"{bundle.path} has no drafter graphs: use method ar")
    drafter = BundleDrafter(bundle.batch(batch), runner, "onnxruntime")
    return {
        name: dataclasses.replace(
            ar,
            speculation=speculation(drafter, tree, method, bundle.neighbors(), ar.device),
            method=dataclasses.replace(method, tree=name),
        )
        for name, tree in bundle_trees(bundle).items()
    } | {"ar": ar}


def bundle_sampling(bundle: Bundle) -> SamplingConfig:
    """The sampling calibration and its comparison run a bundle at: the model's
    (``settings.default_sampling``), its CFG scale at most 1 for a bundle of one row per image
    (exported without guidance: docs/method.md §13)."""
    sampling = default_sampling(bundle_info(bundle))
    if bundle.constants.guided:
        return sampling
    return dataclasses.replace(sampling, cfg_scale=min(sampling.cfg_scale, 1.0))


def record_inputs(
    bundle: Bundle,
    samples: int,
    method: MethodConfig,
    seed: int = 0,
    threads: int = 0,
    progress: bool = False,
    prompts: Sequence[str] = (),
    quantization: Quantization = Quantization(),
) -> Recorder:
    """Generate ``samples`` images (sampling as :func:`bundle_sampling` says) with every pipeline of
    :func:`pipelines`, at each of the bundle's batch sizes, through a :class:`Recorder` of the
    graphs that ``quantization`` quantizes (:meth:`Quantization.kept`); each of them
    must see calls. A prompt-conditioned bundle takes ``prompts``. The recorder comes back
    closed: no session of the bundle stays open."""
    recorder = Recorder(ort_runner(threads, [CPU]), seed=seed, quantization=quantization)
    sampling = bundle_sampling(bundle)
    labels = conditions(bundle, samples, prompts)
    every = [p for b in bundle.constants.batch_sizes for p in pipelines(bundle, method, recorder, b).values()]
    for i, pipe in enumerate(every):  # the graphs of every batch size see calls
        generate(pipe, labels, sampling, seed=seed, progress=progress, start_index=i * samples)
    recorder.close()
    missing = [name for name, calls in recorder.calls.items() if not calls]
    if missing:
        raise CalibrationError(
            f"no calls reached {', '.join(missing)} while calibrating with {method.method}"
        )
    return recorder


def quantize_graph(
    src: Path,
    dst: Path,
    samples: Sequence[dict[str, np.ndarray]],
    vocab: int | None,
    quantization: Quantization = Quantization(),
) -> int:
    """Write ``src`` with Q/DQ on the inputs of its weight MatMul/Gemm nodes but the output
    head (``vocab`` outputs; None: the head too), calibrated on ``samples`` (min/max, symmetric), or
    with ``quantization``'s MatMulNBits weights those nodes' weights alone
    (:func:`quantize_weights`), or in TensorRT's weight-only form (:func:`write_weight_only`);
    -> the number of products quantized. Raises :class:`CalibrationError` if it breaks a rule.

    A Q/DQ graph whose weights lie in an external file is written so too, and its quantization
    holds at most two copies of them: the products are chosen reading one weight at a time,
    onnxruntime's calibrator holds one beside its session's, and they are gone before its
    quantizer loads its own (:func:`_quantize`)."""
    model = onnx.load(str(src), load_external_data=False)
    external = any(external_data_helper.uses_external_data(t) for t in model.graph.initializer)
    weight_only, weight_bits = quantization.weight_only, quantization.weight_bits
    if quantization.bits is not None or transposed_weights(model.graph):
        external_data_helper.load_external_data_for_model(model, str(src.parent))
    folded = fold_weight_transposes(model)
    nodes = weight_nodes(model, vocab, src.parent)
    if weight_only is not None:
        return write_weight_only(src, model, nodes, weight_only, dst)
    if weight_bits is not None:
        quantize_weights(model, nodes, weight_bits, dst)
        return len(nodes)
    # its advice to run quant_pre_process goes to the root logger; that step adds nothing here
    # (static shapes, same ops) but opset imports of onnxruntime's own domains
    logging.disable(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(dir=dst.parent) as folder:
            if folded:  # the quantizer reads a file: the folded graph's
                src = Path(folder) / src.name
                onnx.save(model, str(src), save_as_external_data=external, location=f"{src.name}.data")
            _quantize(src, dst, samples, nodes, external, Path(folder))
    finally:
        logging.disable(logging.NOTSET)
    if has_conditionals(model.graph):
        _restore_order(dst)
    problems = check_graph(dst) + qdq_problems(dst)
    if problems:
        raise CalibrationError(f"{dst.stem}: {problems[0]}")
    return len(nodes)


def write_weight_only(
    src: Path, model: onnx.ModelProto, nodes: list[str], spec: WeightOnly, dst: Path
) -> int:
    """Write ``model`` (the graph at ``src``, its weight transposes folded) to ``dst`` with
    ``nodes``' weights in ``spec``'s form, those that no other node reads
    (:func:`~.weight_only.dequantizable`), or ``src``'s graph as it is when there are none;
    -> how many. Raises :class:`CalibrationError` if the graph breaks a rule."""
    nodes = dequantizable(model, nodes)
    onnx.save(dequantized_model(model, nodes, spec) if nodes else onnx.load(str(src)), str(dst))
    problems = check_graph(dst)
    if problems:
        raise CalibrationError(f"{dst.stem}: {problems[0]}")
    return len(nodes)


def fold_weight_transposes(model: onnx.ModelProto) -> int:
    """Store each weight that ``model`` transposes before its products transposed instead (an
    exact rewrite); -> how many. The exported drafting graphs read the drafter's weights, shared
    by every tree level, through one Transpose each, which hides them from :func:`weight_nodes`."""
    graph = model.graph
    transposed = transposed_weights(graph)
    for node, source in transposed:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        weight = np.ascontiguousarray(onnx.numpy_helper.to_array(source).transpose(perm))
        graph.initializer.append(onnx.numpy_helper.from_array(weight, node.output[0]))
    folding = {id(node) for node, _ in transposed}
    kept = [node for node in graph.node if id(node) not in folding]
    del graph.node[:]
    graph.node.extend(kept)
    drop_unread_initializers(graph)
    return len(transposed)


def transposed_weights(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, onnx.TensorProto]]:
    """The Transpose nodes of ``graph`` that read a 2-D initializer, each with it (its data not read)."""
    consts = {t.name: t for t in graph.initializer}
    found = ((node, consts.get(node.input[0])) for node in graph.node if node.op_type == "Transpose")
    return [(node, source) for node, source in found if source is not None and len(source.dims) == 2]


def quantize_weights(model: onnx.ModelProto, nodes: list[str], bits: int, dst: Path) -> None:
    """Write ``model`` to ``dst`` (weights inline) with the MatMul ``nodes`` as onnxruntime's
    ``MatMulNBits`` on ``bits``-bit weights (:data:`WEIGHT_BLOCK`, symmetric); raises
    :class:`CalibrationError` if a node is left as it was or the graph breaks a rule."""
    others = [  # its nodes_to_include adds to the op types; the other MatMuls are excluded
        n.name
        for g in with_subgraphs(model.graph)
        for n in g.node
        if n.op_type == "MatMul" and n.name not in nodes
    ]
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=WEIGHT_BLOCK,
        is_symmetric=True,
        accuracy_level=WEIGHT_ONLY_ACCURACY_LEVEL,
        nodes_to_exclude=others,
        op_types_to_quantize=("MatMul",),
    )
    logging.disable(logging.INFO)  # a line per node it skips
    try:
        quantizer.process()
    finally:
        logging.disable(logging.NOTSET)
    out = quantizer.model.model
    made = sum(n.op_type == "MatMulNBits" for g in with_subgraphs(out.graph) for n in g.node)
    if made != len(nodes):
        raise CalibrationError(f"{dst.stem}: {made} of its {len(nodes)} weight MatMuls were quantized")
    onnx.save(out, str(dst))
    problems = check_graph(dst)
    if problems:
        raise CalibrationError(f"{dst.stem}: {problems[0]}")


def weight_nodes(model: onnx.ModelProto, vocab: int | None, folder: Path | None = None) -> list[str]:
    """The MatMul/Gemm nodes whose second input is a learned weight: a constant that is not all
    whole numbers (RoPE's pair-swap matrix of 0 and +-1, and the tree's tables of node ids that
    acceptance multiplies by, are exact in any precision, and quantizing them would only add
    error), and that does not have ``vocab`` outputs (None: every one). Weights that ``model``
    was loaded without are read one at a time from their files in ``folder``.

    A target's output head stays fp32: its logits decide every draw and acceptance, and on
    onnxruntime's CPU kernels its int8 form is slower (its weight is dequantized at every call:
    BENCHMARKS.md, "INT8 on a CPU with VNNI"). A drafter's head in a drafter-only bundle is
    quantized: its logits only steer which tokens are proposed."""
    consts = {t.name: t for t in model.graph.initializer}
    return [
        node.name
        for node in model.graph.node
        if node.op_type in QUANTIZED_OPS
        and node.input[1] in consts
        and _outputs(node, consts[node.input[1]]) != vocab
        and not _whole_numbers(tensor_values(consts[node.input[1]], folder))
    ]


def _whole_numbers(values: np.ndarray) -> bool:
    """Whether every entry of ``values`` is a whole number (a table, not a learned weight)."""
    return bool(np.all(values == np.round(values)))


def _outputs(node: onnx.NodeProto, weight: onnx.TensorProto) -> int:
    """Output features of a weight MatMul ([in, out]) or Gemm ([out, in] with transB)."""
    trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    return weight.dims[0] if trans_b else weight.dims[-1]


def _quantize(
    src: Path,
    dst: Path,
    samples: Sequence[dict[str, np.ndarray]],
    nodes: list[str],
    external: bool,
    folder: Path,
) -> None:
    """onnxruntime's static quantization of ``src`` into ``dst`` (weights in an external file when
    ``external``), calibrated first on its own: the calibrator's session and copy of the graph
    are gone before the quantizer loads the graph, which takes the ranges from a calibration
    cache in ``folder`` (``quantize_static``'s ``calibration_cache_path``; the same ranges as its
    own calibration, which would run beside its copy of the weights)."""
    cache = folder / "ranges.json"
    with _errors_only():
        calibrator = create_calibrator(
            src,
            list(QUANTIZED_OPS),
            augmented_model_path=str(folder / "augmented.onnx"),
            calibrate_method=CalibrationMethod.MinMax,
            use_external_data_format=external,
            providers=[CPU],
        )
        calibrator.collect_data(_Samples(samples))
        save_tensors_data(calibrator.compute_data(), cache)
        del calibrator
        quantize_static(
            str(src),
            str(dst),
            None,
            calibration_cache_path=cache,
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=list(QUANTIZED_OPS),
            nodes_to_quantize=nodes,
            use_external_data_format=external,
            extra_options={
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OPS),  # logits stay full precision
            },
        )


@contextlib.contextmanager
def _errors_only() -> Iterator[None]:
    """onnxruntime logs errors only while the block runs: its quantizer's calibration sessions
    take the process's default severity, and an in-place graph (a ``TensorScatter`` it cannot
    write in place) logs a warning per call, thousands over a calibration at LlamaGen's sizes.
    After the block: onnxruntime's default, warnings (it has no getter to restore from)."""
    ort.set_default_logger_severity(3)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)


def _restore_order(path: Path) -> None:
    """Sort the nodes of the graph at ``path`` again, counting what If branches read from
    outside them: onnxruntime's quantizer sorts by explicit inputs only, so an If (a drafting
    graph's filter) can land before the logits its branches read. Its weights stay where they
    are."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = list(model.graph.node)
    producer = {name: i for i, node in enumerate(nodes) for name in node.output if name}
    needs = [{producer[name] for name in reads(node) if name in producer} for node in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for i, deps in enumerate(needs):
        for dep in deps:
            users[dep].append(i)
    waiting = [len(deps) for deps in needs]
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:  # Kahn's algorithm, earliest original position first
        i = heapq.heappop(ready)
        order.append(i)
        for user in users[i]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(nodes):
        raise CalibrationError(f"{path.stem}: the quantized graph has a cycle")
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)
    onnx.save(model, str(path))


def qdq_problems(path: Path) -> list[str]:
    """TensorRT's Q/DQ rules the graph breaks: standard ops only, int8 zero points that are 0."""
    model = onnx.load(str(path))
    consts = {t.name: t for t in model.graph.initializer}
    problems = [
        f"{n.op_type} is from domain {n.domain}" for n in model.graph.node if n.domain not in ("", "ai.onnx")
    ]
    for node in model.graph.node:
        if node.op_type in QDQ:
            zero = consts.get(node.input[2]) if len(node.input) > 2 else None
            if zero is None or zero.data_type != onnx.TensorProto.INT8:
                problems.append(f"{node.name} has no int8 zero point")
            elif onnx.numpy_helper.to_array(zero).any():
                problems.append(f"{node.name} has a non-zero zero point")
    if not any(node.op_type in QDQ for node in model.graph.node):
        problems.append("no Q/DQ nodes")
    return problems


def calibrate_bundle(
    bundle: Bundle,
    out: Path,
    samples: int,
    method: MethodConfig | None = None,
    *,
    seed: int = 0,
    validate: int | None = None,
    threads: int = 0,
    overwrite: bool = False,
    progress: bool = False,
    prompts: Sequence[str] = (),
    quantization: Quantization = Quantization(),
) -> dict[str, Any]:
    """Write an int8 Q/DQ copy of the fp32 ``bundle`` at ``out`` (temporary folder, then rename),
    calibrated on ``samples`` generated images per pipeline (default method: lantern++ when the
    bundle has a drafter), or the copy ``quantization`` says: MatMulNBits weights (of the
    drafter's graphs alone, its head included, with ``drafter_only``), or of an fp16 ``bundle``
    TensorRT's weight-only form; compare it with ``bundle`` on ``validate`` images (default: one
    per class, or per prompt of a prompt-conditioned bundle, which takes ``prompts``) before
    the rename, so that a failed
    comparison leaves nothing at ``out``, and return the report (see :func:`validation` and
    :func:`markdown_table`; the copy is named by its dtype, ``report["dtype"]``, the source by
    its own, ``report["source"]``)."""
    out = Path(out)
    dtype = quantization.dtype
    _check_source(bundle, quantization)
    if quantization.drafter_only and not bundle.has_drafter:
        raise CalibrationError(
            f"{bundle.path} has no drafter graphs to quantize: drop the drafter-only choice"
        )
    if samples < 1:
        raise CalibrationError(f"samples must be at least 1, got {samples}")
    if out.resolve() == bundle.path:
        raise CalibrationError(f"the {dtype} bundle must go elsewhere than {bundle.path}")
    if out.exists() and not overwrite:
        raise CalibrationError(f"{out} already exists; choose another folder or overwrite it")
    labels = conditions(bundle, validate, prompts)  # refuses a mismatch before any work
    method = method or calibration_method(bundle)
    recorder = record_inputs(bundle, samples, method, seed, threads, progress, prompts, quantization)
    with staged_bundle(out) as tmp:
        graphs = _write_graphs(bundle, recorder, tmp, quantization)
        manifest = _quantized_manifest(bundle, graphs, recorder, method, samples, seed, quantization)
        write_manifest(tmp, manifest)
        quantized = open_bundle(tmp)
        agreement = graph_agreement(bundle, quantized, recorder, threads)
        del recorder  # its recorded inputs, before the validation's sessions open
        report = {
            "dtype": dtype,
            "source": bundle.dtype,
            bundle.dtype: str(bundle.path),
            dtype: str(out.resolve()),
            "samples": samples,
            "graphs": agreement,
            "validation": validation(bundle, quantized, labels, method, seed, threads, progress),
        }
    return report


def _check_source(bundle: Bundle, quantization: Quantization) -> None:
    """:class:`CalibrationError` unless ``bundle`` is what ``quantization`` is made from: an fp32
    bundle, or for TensorRT's weight-only form an fp16 one that TensorRT can build whose weights
    take that form's blocks (checked before any image is generated)."""
    weight_only = quantization.weight_only
    if weight_only is None:
        if bundle.dtype != "fp32":
            raise CalibrationError(f"{bundle.path} is a {bundle.dtype} bundle; calibrate an fp32 bundle")
        return
    if bundle.dtype != "fp16":
        raise CalibrationError(
            f"{bundle.path} is a {bundle.dtype} bundle; TensorRT's weight-only form keeps the activations "
            "fp16: calibrate an fp16 bundle (lantern export --dtype fp16)"
        )
    if bundle.constants.cache_scratch:
        raise CalibrationError(
            f"{bundle.path} writes its caches in place (onnxruntime only), which TensorRT cannot build: "
            "export it again without --cache-in-place"
        )
    for name, entry in bundle.graphs.items():
        if quantization.kept(entry):
            continue
        model = onnx.load(str(bundle.file(entry)))
        fold_weight_transposes(model)
        nodes = dequantizable(model, weight_nodes(model, bundle.constants.vocab_size))
        problems = block_problems(model, nodes, weight_only)
        if problems:
            raise CalibrationError(f"{name}: {problems[0]}")


def graph_agreement(
    source: Bundle, quantized: Bundle, recorder: Recorder, threads: int = 0
) -> dict[str, dict[str, Any]]:
    """Per quantized graph, on its recorded (calibration) inputs and ``AS_WRITTEN`` sessions:
    calls seen, inputs kept, the fraction of logits rows whose argmax the quantized graph keeps, and
    its largest logits error relative to the source's largest logit. A drafting graph is scored on
    its root's distribution ``q[0]``, which depends on its inputs alone (deeper rows follow the
    tokens each graph drew); the drafter's prefill graph (K/V out, no distribution) on the
    relative error of its keys alone, its agreement None. One session is open at a time."""
    options = session_options(threads, AS_WRITTEN)
    result = {}
    for name, samples in recorder.samples.items():
        (scored, wants), (_, gots) = (
            _scored_outputs(b.file(b.graph(name)), samples, options) for b in (source, quantized)
        )
        agree, error = [], 0.0
        for want, got in zip(wants, gots, strict=True):
            if scored == "q":
                want, got = want[:1], got[:1]
            if scored in ("logits", "q"):
                agree.append(float((want.argmax(-1) == got.argmax(-1)).mean()))
            error = max(error, float(np.abs(got - want).max() / np.abs(want).max()))
        result[name] = {
            "calls": recorder.calls[name],
            "samples": len(samples),
            "top1_agreement": float(np.mean(agree)) if agree else None,
            "max_rel_error": error,
        }
    return result


def _scored_outputs(
    path: Path, samples: Sequence[dict[str, np.ndarray]], options: ort.SessionOptions
) -> tuple[str, list[np.ndarray]]:
    """The output of the graph at ``path`` that :func:`graph_agreement` scores (``logits``, else
    a drafting graph's ``q``, else its first) and its values on each of ``samples``, from one
    session, closed on return."""
    graph = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in graph.get_outputs()]
    scored = next((n for n in ("logits", "q") if n in names), names[0])
    return scored, [graph.run([scored], sample)[0] for sample in samples]


def _write_graphs(
    bundle: Bundle,
    recorder: Recorder,
    tmp: Path,
    quantization: Quantization,
) -> dict[str, Any]:
    """The graphs ``quantization`` quantizes, quantized, the others kept as they were (and a
    graph of TensorRT's form with no weight to quantize), copies of the other files in ``tmp``,
    all the graphs' weights in one shared file again; the new manifest's graph entries."""
    raw = bundle.manifest()["graphs"]
    vocab = quantization.head_vocab(bundle.constants.vocab_size)
    graphs = {}
    for name, entry in bundle.graphs.items():
        src, dst = bundle.file(entry), tmp / entry.file
        made = (
            0
            if quantization.kept(entry)
            else quantize_graph(src, dst, recorder.samples[name], vocab, quantization)
        )
        if not made:
            onnx.save(onnx.load(str(src)), str(dst))  # its weights inline, until shared below
            graphs[name] = {**raw[name], "precision": _PRECISION[raw[name]["compute_dtype"]]}
            continue
        inputs, outputs = io_specs(dst)
        if (inputs, outputs) != ([s.to_json() for s in entry.inputs], [s.to_json() for s in entry.outputs]):
            raise CalibrationError(f"{name}: quantization changed the graph's inputs or outputs")
        kept = {k: v for k, v in raw[name].items() if k != "max_abs_err"}  # that was fp32 vs torch
        graphs[name] = {
            **kept,
            "precision": quantization.graph_precision,
            "calibration_samples": len(recorder.samples[name]),
        }
    share_weights([tmp / entry.file for entry in bundle.graphs.values()], tmp / WEIGHTS)
    for file in bundle.files:
        if not (tmp / file).exists():
            shutil.copy2(bundle.path / file, tmp / file)
    return graphs


def _quantized_manifest(
    source: Bundle,
    graphs: dict[str, Any],
    recorder: Recorder,
    method: MethodConfig,
    samples: int,
    seed: int,
    quantization: Quantization,
) -> dict[str, Any]:
    """The source's manifest with the quantized graphs and what the calibration did (its
    ``files`` are :func:`~lantern_rt.bundle.write_manifest`'s)."""
    tool = (
        f"onnxruntime.quantization {ort.__version__}"
        if quantization.weight_only is None
        else f"lantern_rt.calibration.weight_only, onnx {onnx.__version__}"
    )
    new = {**source.manifest(), "dtype": quantization.dtype, "graphs": graphs}
    new["versions"] = {**source.versions, "onnxruntime": ort.__version__}
    new["calibration"] = {
        "source_manifest_sha256": source.manifest_sha256,
        "tool": tool,
        "scheme": quantization.scheme(),
        "ops": [f"{op} with constant weights" for op in QUANTIZED_OPS],
        "method": method.method,
        "params": method.params(),
        "images_per_pipeline": samples,
        "seed": seed,
        "calls": dict(recorder.calls),
    }
    return new


# Run Q/DQ graphs as written (DequantizeLinear, then the float op): the numerics a TensorRT
# engine implements. onnxruntime's fused int8 CPU kernels are not that reference: on x86 CPUs
# without VNNI their u8s8 products saturate. Such a session folds each weight's DequantizeLinear
# into an fp32 copy of the weight that it holds (prepacked). Without the folding
# ("optimization.disable_specified_optimizers": "ConstantFolding") it would hold the int8 weights,
# but its products, on weights dequantized at each call, ran 6-8x slower at GPT-B and rounded
# differently from the folded ones (greedy AR tokens of one int8 bundle: 43% of them equal).
AS_WRITTEN = {"session.disable_quant_qdq": "1"}


def validation(
    source: Bundle,
    quantized: Bundle,
    labels: list[int | str],
    method: MethodConfig,
    seed: int = 0,
    threads: int = 0,
    progress: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Both bundles with every pipeline of :func:`pipelines` and the same seeds, at the smallest
    batch size they were exported for (an image's tokens do not depend on it).

    ``accuracy``: greedy and sampling, the quantized bundle on ``AS_WRITTEN`` onnxruntime sessions
    (the source on the runtime's: the same sessions as its ``speed`` runs); per run, the fraction of
    equal tokens (position by position), the mean count of equal tokens before the first
    difference and each bundle's mean accepted length. ``speed``: sampling on the runtime's
    onnxruntime runners; per run, each bundle's mean accepted length and seconds per image.

    One set of sessions is alive at a time, each closed before the next opens: the source's (its
    reference runs, then its timed ones), the quantized bundle's as written, then the runtime's.
    """
    sampled = bundle_sampling(source)
    modes = {"greedy": dataclasses.replace(sampled, temperature=0.0), "sampling": sampled}
    timed = {"sampling": sampled}
    batch = min(source.constants.batch_sizes)

    def images(
        bundle: Bundle, config: dict[str, str] | None, *rounds: dict[str, SamplingConfig]
    ) -> list[dict[tuple[str, str], Generation]]:
        """Per round, its modes with every pipeline of ``bundle`` (by pipeline and mode), all
        on one set of sessions (``config``), closed on return."""
        pipes = pipelines(bundle, method, ort_runner(threads, [CPU], config), batch)
        done = [
            {
                (name, mode): generate(pipe, labels, sampling, seed=seed, progress=progress)
                for name, pipe in pipes.items()
                for mode, sampling in chosen.items()
            }
            for chosen in rounds
        ]
        del pipes
        gc.collect()  # its sessions are gone before the next bundle's open
        return done

    reference, source_timed = images(source, None, modes, timed)
    (written,) = images(quantized, AS_WRITTEN, modes)
    (quantized_timed,) = images(quantized, None, timed)
    accuracy = []
    for (name, mode), want in reference.items():
        got = written[name, mode]
        same = want.tokens == got.tokens
        accuracy.append(
            {
                "run": f"{_run_label(name, method)} {mode}",
                "token_agreement": float(same.float().mean()),
                "common_prefix": float(same.int().cumprod(dim=1).sum(dim=1).float().mean()),
                **{
                    d: {"mean_accepted_length": r.stats.mean_accepted_length}
                    for d, r in ((source.dtype, want), (quantized.dtype, got))
                },
            }
        )
    speed = [
        {
            "run": f"{_run_label(name, method)} {mode}",
            source.dtype: _speed(run.stats),
            quantized.dtype: _speed(quantized_timed[name, mode].stats),
        }
        for (name, mode), run in source_timed.items()
    ]
    return {"accuracy": accuracy, "speed": speed}


def _run_label(name: str, method: MethodConfig) -> str:
    """A validation run's label: ``ar``, or the method and the pipeline's tree."""
    return "ar" if name == "ar" else f"{method.method} {name}"


def _speed(stats: GenerationStats) -> dict[str, float]:
    return {
        "mean_accepted_length": stats.mean_accepted_length,
        "seconds_per_image": stats.decode_seconds / max(1, stats.num_images),
    }


def markdown_table(report: dict[str, Any]) -> str:
    """A :func:`calibrate_bundle` report as markdown: the runs, then the graphs."""
    q, s = report["dtype"], report["source"]
    lines = [
        f"| run (reference numerics) | token agreement | equal prefix | tau {s} | tau {q} |",
        "|---|---|---|---|---|",
    ]
    for row in report["validation"]["accuracy"]:
        lines.append(
            f"| {row['run']} | {row['token_agreement']:.3f} | {row['common_prefix']:.1f} "
            f"| {row[s]['mean_accepted_length']:.2f} | {row[q]['mean_accepted_length']:.2f} |"
        )
    lines += [
        "",
        f"| run (onnxruntime runtime) | tau {s} | tau {q} | s/img {s} | s/img {q} |",
        "|---|---|---|---|---|",
    ]
    for row in report["validation"]["speed"]:
        f, i = row[s], row[q]
        lines.append(
            f"| {row['run']} | {f['mean_accepted_length']:.2f} | {i['mean_accepted_length']:.2f} "
            f"| {f['seconds_per_image']:.3f} | {i['seconds_per_image']:.3f} |"
        )
    lines += [
        "",
        "| graph | calls | inputs kept | logits top-1 agreement | max logits error (rel.) |",
        "|---|---|---|---|---|",
    ]
    for name, g in report["graphs"].items():
        top1 = "n/a (K/V)" if g["top1_agreement"] is None else f"{g['top1_agreement']:.3f}"
        lines.append(f"| {name} | {g['calls']} | {g['samples']} | {top1} | {g['max_rel_error']:.3f} |")
    return "\n".join(lines)
