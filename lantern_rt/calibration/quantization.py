"""What ``lantern calibrate`` makes of a bundle, as one value: Q/DQ int8 (the default),
onnxruntime's MatMulNBits weights of the whole bundle or of the drafter alone, or TensorRT's
weight-only form (docs/method.md §14). It says which graphs stay as they were, the new bundle's
dtype and the manifest's account of the scheme."""

from __future__ import annotations

from dataclasses import dataclass

from lantern_rt.bundle import DRAFTER_PREFILL_GRAPH, VQ_DECODE_GRAPH, GraphEntry
from lantern_rt.calibration.errors import CalibrationError
from lantern_rt.calibration.weight_only import WeightOnly

# MatMulNBits bundles: the dtype per weight width (bundle.WEIGHT_ONLY_DTYPES); weights in blocks
# of 32 along the input, one fp32 scale per block; accuracy level 4 lets onnxruntime quantize
# each activation block to int8 as it runs and use int8 dot products (VNNI/AMX), the level its
# CPU kernels are fastest at.
WEIGHT_ONLY_DTYPE = {4: "int4-weights", 8: "int8-weights"}
# the target's graphs as they were (fp32), the drafter's weight-only
DRAFTER_WEIGHT_ONLY_DTYPE = {4: "int4-drafter", 8: "int8-drafter"}
WEIGHT_BLOCK = 32
WEIGHT_ONLY_ACCURACY_LEVEL = 4
QDQ_SCHEME = "QDQ int8, symmetric (zero points 0), per-channel weights, min/max activations"


@dataclass(frozen=True)
class Quantization:
    """One quantization of a bundle: Q/DQ int8 with neither field set; with ``weight_bits``
    (4 or 8) onnxruntime's MatMulNBits weights, of the drafter's graphs alone (its output head
    included) with ``drafter_only``; with ``weight_only`` TensorRT's weight-only form of an fp16
    bundle. :class:`CalibrationError` for any other combination."""

    weight_bits: int | None = None
    weight_only: WeightOnly | None = None
    drafter_only: bool = False

    def __post_init__(self) -> None:
        if self.weight_bits is not None and self.weight_only is not None:
            raise CalibrationError(
                "choose MatMulNBits (--weights-only) or TensorRT's form (--weights), not both"
            )
        if self.drafter_only and self.weight_bits is None:
            raise CalibrationError("only the MatMulNBits form (--weights-only) quantizes the drafter alone")
        if self.weight_bits is not None and self.weight_bits not in WEIGHT_ONLY_DTYPE:
            raise CalibrationError(f"weights are quantized to 4 or 8 bits, not {self.weight_bits}")

    @property
    def bits(self) -> int | None:
        """The stored weights' width, None for Q/DQ (whose weights and activations are int8)."""
        return self.weight_only.bits if self.weight_only is not None else self.weight_bits

    @property
    def dtype(self) -> str:
        """The quantized bundle's dtype (``int8``, ``int4-weights``, ``int4-drafter``, ``w4a16``, ...)."""
        if self.weight_only is not None:
            return self.weight_only.dtype
        if self.weight_bits is None:
            return "int8"
        return (DRAFTER_WEIGHT_ONLY_DTYPE if self.drafter_only else WEIGHT_ONLY_DTYPE)[self.weight_bits]

    @property
    def graph_precision(self) -> str:
        """A quantized graph's precision in the manifest: the bundle's dtype, but the whole
        bundle's MatMulNBits dtype for a drafter-only one (the graph's own weights are that)."""
        return Quantization(self.weight_bits, self.weight_only).dtype

    def kept(self, entry: GraphEntry) -> bool:
        """Whether ``entry``'s graph is left as it was: the VQ decoder (convolutions that run once
        per image); in a Q/DQ bundle the drafter's graphs (their products have a few rows each,
        where onnxruntime's unfused Quantize/DequantizeLinear cost more than int8 saves, and the
        drafter's accuracy is acceptance, docs/method.md §14); with ``drafter_only`` the
        target's. A verify graph's acceptance has no weights: only its target step's MatMuls are
        quantized."""
        drafter = entry.drafting or entry.name == DRAFTER_PREFILL_GRAPH
        if entry.name == VQ_DECODE_GRAPH:
            return True
        return drafter if self.bits is None else self.drafter_only and not drafter

    def head_vocab(self, vocab: int) -> int | None:
        """The output width of the head that stays unquantized (``vocab``), or None when the
        head is quantized too (drafter-only: a drafter's head is a large share of its weights)."""
        return None if self.drafter_only else vocab

    def scheme(self) -> str:
        """The manifest's one-line account of the quantization."""
        if self.weight_only is not None:
            return self.weight_only.scheme()
        if self.weight_bits is None:
            return QDQ_SCHEME
        return (
            f"MatMulNBits: {self.weight_bits}-bit symmetric weights in blocks of {WEIGHT_BLOCK}, "
            f"accuracy level {WEIGHT_ONLY_ACCURACY_LEVEL}; activations not quantized ahead of time"
            + (
                "; the drafter's graphs alone, its output head included, the target's as they were"
                if self.drafter_only
                else ""
            )
        )
