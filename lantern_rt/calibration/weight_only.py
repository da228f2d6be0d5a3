"""TensorRT's weight-only form (W4A16, W8A16): a product's weight stored as int4 or int8 with one
scale per block of its input rows, dequantized by a block-wise ``DequantizeLinear`` that feeds the
unchanged MatMul/Gemm; the activations stay in the graph's dtype (fp16: it is made from an fp16
bundle). Not onnxruntime's ``MatMulNBits``: standard ONNX (opset 21, which has int4 tensors and
``block_size``), which TensorRT builds (its weight-only quantization: the int4 or int8 weights
are what the plan stores) and onnxruntime runs (as written: the dequantized weight folded into a
constant, the product in fp32 through Casts on the CPU; its runtime sessions fuse each
DequantizeLinear and MatMul into its own ``MatMulNBits`` kernel).

The scales are symmetric, plain absmax per block (no activation statistics, not AWQ): for each
block of ``block`` weights along the product's input axis, ``scale = max|w| / qmax`` (qmax 7
for int4, 127 for int8) in the weight's dtype, at least its smallest normal number (no
subnormal scale) and 1 for a block of zeros; ``q = clip(round(w / scale), -qmax, qmax)``. No
zero point: TensorRT's parser refuses a non-zero one (and unsigned int4 weights).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper, version_converter

from lantern_rt.calibration.errors import CalibrationError
from lantern_rt.calibration.graph_edits import reads
from lantern_rt.graph_rules import WEIGHT_ONLY_OPSET

DEFAULT_BLOCK = 128
WEIGHT_FORMATS = {"int4": 4, "int8": 8}
_STORED = {4: ml_dtypes.int4, 8: np.int8}


@dataclass(frozen=True)
class WeightOnly:
    """TensorRT's weight-only form: ``bits``-bit weights (4 or 8), one scale per ``block``
    weights along each product's input axis."""

    bits: int
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.bits not in _STORED:
            raise CalibrationError(f"weights are int4 or int8, not {self.bits} bits")
        if self.block < 1:
            raise CalibrationError(f"the block size must be at least 1, got {self.block}")

    @classmethod
    def named(cls, name: str, block: int = DEFAULT_BLOCK) -> WeightOnly:
        """The form called ``name`` (``int4`` or ``int8``); :class:`CalibrationError` otherwise."""
        if name not in WEIGHT_FORMATS:
            raise CalibrationError(f"unknown weight format {name!r}: choose {' or '.join(WEIGHT_FORMATS)}")
        return cls(WEIGHT_FORMATS[name], block)

    @property
    def dtype(self) -> str:
        """The bundle's dtype: ``w4a16`` or ``w8a16``."""
        return f"w{self.bits}a16"

    @property
    def qmax(self) -> int:
        """The largest stored magnitude (7 or 127)."""
        return 2 ** (self.bits - 1) - 1

    def scheme(self) -> str:
        """The manifest's one-line account of the form."""
        return (
            f"weight-only int{self.bits}: DequantizeLinear (opset {WEIGHT_ONLY_OPSET}) on symmetric "
            f"int{self.bits} weights, one scale per block of {self.block} inputs (absmax / {self.qmax}), "
            "then the MatMul/Gemm in the graph's dtype; activations not quantized"
        )


def input_axis(node: onnx.NodeProto) -> int:
    """The axis of ``node``'s weight (its second input) that the product sums over: 0 for a
    MatMul or Gemm (``[in, out]``), 1 for a Gemm with ``transB`` (``[out, in]``)."""
    trans_b = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    return 1 if trans_b else 0


def quantize_blocks(weight: np.ndarray, spec: WeightOnly, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """A 2-D ``weight``'s stored values (int8 array in ``[-qmax, qmax]``, its shape) and scales
    (the weight's dtype; ``axis`` divided by the block size), blocks along ``axis``."""
    moved = np.moveaxis(weight.astype(np.float32), axis, 0)  # [in, out]
    rows, cols = moved.shape
    blocks = moved.reshape(rows // spec.block, spec.block, cols)
    amax = np.abs(blocks).max(axis=1)
    smallest = np.finfo(weight.dtype).tiny
    scale = np.where(amax > 0, np.maximum(amax / spec.qmax, smallest), 1.0).astype(weight.dtype)
    q = np.rint(blocks / scale.astype(np.float32)[:, None, :])
    q = np.clip(q, -spec.qmax, spec.qmax).astype(np.int8).reshape(rows, cols)
    return np.moveaxis(q, 0, axis), np.moveaxis(scale, 0, axis)


def block_problems(model: onnx.ModelProto, nodes: Sequence[str], spec: WeightOnly) -> list[str]:
    """Why ``nodes``' weights cannot take ``spec``'s blocks: not 2-D, or an input width the block
    size does not divide (naming the largest block size that divides them all)."""
    consts = {t.name: t for t in model.graph.initializer}
    wanted = [n for n in model.graph.node if n.name in set(nodes)]
    bad_rank = [n.name for n in wanted if len(consts[n.input[1]].dims) != 2]
    if bad_rank:
        return [f"the weight of {bad_rank[0]} is not 2-D"]
    widths = {n.name: consts[n.input[1]].dims[input_axis(n)] for n in wanted}
    uneven = [name for name, width in widths.items() if width % spec.block]
    if not uneven:
        return []
    fits = math.gcd(*widths.values())
    return [
        f"block size {spec.block} does not divide the input width {widths[uneven[0]]} of {uneven[0]}'s "
        f"weight: choose a block size that divides {fits} (--block-size)"
    ]


def dequantizable(model: onnx.ModelProto, nodes: Sequence[str]) -> list[str]:
    """Those of the MatMul/Gemm ``nodes`` whose weight no other node reads. A weight that
    several products read (the drafting graph's: one product per tree level) stays in the
    graph's dtype: TensorRT for RTX 1.7 fails to build an int4 weight that feeds several
    MatMuls ("empty runtime-fusion MVMF for '__myl_ReplCastMulCastFc'"), with a
    DequantizeLinear each or shared, and a copy per product is one tensor again once the
    bundle's weights are shared (:mod:`lantern_rt.shared_weights` stores a content once)."""
    readers = Counter(name for node in model.graph.node for name in reads(node))
    chosen = set(nodes)
    return [n.name for n in model.graph.node if n.name in chosen and readers[n.input[1]] == 1]


def dequantized_model(model: onnx.ModelProto, nodes: Sequence[str], spec: WeightOnly) -> onnx.ModelProto:
    """``model`` at opset :data:`WEIGHT_ONLY_OPSET` with each of the MatMul/Gemm ``nodes``
    (each the one reader of its weight: :func:`dequantizable`) reading its weight through a
    block-wise ``DequantizeLinear`` of ``spec``'s stored values and scales instead.
    :class:`CalibrationError` when a weight cannot take the blocks."""
    problems = block_problems(model, nodes, spec)
    if problems:
        raise CalibrationError(problems[0])
    model = version_converter.convert_version(model, WEIGHT_ONLY_OPSET)
    graph = model.graph
    consts = {t.name: t for t in graph.initializer}
    chosen, kept = set(nodes), []
    for node in graph.node:
        if node.name in chosen:
            weight = consts[node.input[1]]
            graph.initializer.remove(weight)
            node.input[1] = _dequantize(graph, weight, input_axis(node), spec, kept)
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return model


def _dequantize(
    graph: onnx.GraphProto, weight: onnx.TensorProto, axis: int, spec: WeightOnly, nodes: list[onnx.NodeProto]
) -> str:
    """Add ``weight``'s stored values and scales to ``graph`` and its ``DequantizeLinear`` to
    ``nodes``; -> the dequantized weight's name."""
    q, scale = quantize_blocks(numpy_helper.to_array(weight), spec, axis)
    base = f"{weight.name}_int{spec.bits}"
    graph.initializer.extend(
        [
            numpy_helper.from_array(q.astype(_STORED[spec.bits]), f"{base}_q"),
            numpy_helper.from_array(scale, f"{base}_scale"),
        ]
    )
    nodes.append(
        onnx.helper.make_node(
            "DequantizeLinear",
            [f"{base}_q", f"{base}_scale"],
            [base],
            name=f"{base}_dequantize",
            axis=axis,
            block_size=spec.block,
        )
    )
    return base
