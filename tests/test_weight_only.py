"""TensorRT's weight-only form (``lantern calibrate --weights int4|int8``): the stored blocks against
an independent quantizer, a product within its quantization bound, the bundle of the trained tiny
pair against fp32, the real TensorRT for RTX builder, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from lantern_rt.bundle import TENSORRT_WEIGHT_ONLY_DTYPES, Bundle
from lantern_rt.calibration.calibrate import AS_WRITTEN, fold_weight_transposes, record_inputs, weight_nodes
from lantern_rt.calibration.quantization import Quantization
from lantern_rt.calibration.weight_only import WeightOnly, dequantizable, dequantized_model
from lantern_rt.cli import main
from lantern_rt.graph_rules import WEIGHT_ONLY_OPSET, check_graph
from lantern_rt.settings import MethodConfig
from tests.conftest import tiny_vq
from tests.test_export import make_bundle

BLOCK = 16  # the tiny model's widths are 32 and 96: two blocks per column of its dim-32 weights


def reference_blocks(weight: np.ndarray, bits: int, block: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-block quantization written out block by block: for each block of ``block``
    weights along ``axis``, scale = max|w| / qmax in the weight's dtype (computed in float32; at
    least its smallest normal number, 1 for zeros), values = w / scale rounded half to even."""
    qmax = 2 ** (bits - 1) - 1
    rows = weight if axis == 0 else weight.T  # blocks run down the rows of ``rows``
    values = np.zeros(rows.shape, np.int8)
    scales = np.zeros((rows.shape[0] // block, rows.shape[1]), weight.dtype)
    for b in range(rows.shape[0] // block):
        for col in range(rows.shape[1]):
            part = rows[b * block : (b + 1) * block, col].astype(np.float32)
            amax = np.float32(np.abs(part).max())
            scale = max(amax / np.float32(qmax), np.float32(np.finfo(weight.dtype).tiny)) if amax else 1.0
            scales[b, col] = scale
            values[b * block : (b + 1) * block, col] = np.clip(
                np.rint(part / np.float32(scales[b, col])), -qmax, qmax
            )
    return (values, scales) if axis == 0 else (values.T, scales.T)


def products_graph(k: int = 64, n: int = 48, dtype=np.float16) -> onnx.ModelProto:
    """x [4, k] -> MatMul by W [k, n] and Gemm by V [n, k] (transB), outputs y and z; W has a
    block of zeros and a block too small for a normal fp16 scale."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.1).astype(dtype)
    w[:BLOCK, 0] = 0
    w[:BLOCK, 1] = 1e-7
    v = (rng.standard_normal((n, k)) * 0.1).astype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
            helper.make_node("Gemm", ["x", "V"], ["z"], name="gemm", transB=1),
        ],
        "products",
        [helper.make_tensor_value_info("x", elem, [4, k])],
        [helper.make_tensor_value_info("y", elem, [4, n]), helper.make_tensor_value_info("z", elem, [4, n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(v, "V")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def dequantize_nodes(model: onnx.ModelProto) -> dict[str, tuple[onnx.NodeProto, np.ndarray, np.ndarray]]:
    """Per product reading a DequantizeLinear: that node, its stored values (int8) and scales."""
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return {
        n.name: (
            dq[n.input[1]],
            consts[dq[n.input[1]].input[0]].astype(np.int8),
            consts[dq[n.input[1]].input[1]],
        )
        for n in model.graph.node
        if n.input[1:] and n.input[1] in dq
    }


def attribute(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_stored_blocks_are_an_independent_quantizers(bits):
    model = products_graph()
    spec = WeightOnly(bits, BLOCK)
    out = dequantized_model(model, ["matmul", "gemm"], spec)
    assert [o.version for o in out.opset_import if o.domain == ""] == [WEIGHT_ONLY_OPSET]
    types = {t.name: t.data_type for t in out.graph.initializer}
    sources = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    stored = dequantize_nodes(out)
    assert set(stored) == {"matmul", "gemm"} and not {"W", "V"} & set(types)  # the float weights are gone
    for name, weight_name, axis in (("matmul", "W", 0), ("gemm", "V", 1)):
        node, values, scales = stored[name]
        assert attribute(node, "axis") == axis and attribute(node, "block_size") == BLOCK
        assert types[node.input[0]] == (TensorProto.INT4 if bits == 4 else TensorProto.INT8)
        assert len(node.input) == 2  # no zero point: symmetric
        weight = sources[weight_name]
        want_values, want_scales = reference_blocks(weight, bits, BLOCK, axis)
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(scales, want_scales)
        assert scales.dtype == weight.dtype
        # the dequantized weight is within half a step of the weight, everywhere
        step = np.repeat(scales.astype(np.float32), BLOCK, axis=axis)
        dequantized = values.astype(np.float32) * step
        assert np.all(np.abs(dequantized - weight.astype(np.float32)) <= step / 2 * (1 + 1e-6))
    _, values, scales = stored["matmul"]
    assert scales[0, 0] == 1 and not values[:BLOCK, 0].any()  # a block of zeros
    assert scales[0, 1] == np.finfo(np.float16).tiny  # no subnormal scale


@pytest.mark.parametrize("bits", [4, 8])
def test_a_product_stays_within_its_quantization_bound(bits, tmp_path):
    """onnxruntime runs the rewritten graph (DequantizeLinear's axis and blocks as written): each
    output differs from the float product x W by at most sum_i |x_i| * step_ij / 2 (step: the
    block's scale), plus fp16's rounding of the output."""
    model = products_graph()
    out = dequantized_model(model, ["matmul", "gemm"], WeightOnly(bits, BLOCK))
    onnx.save(out, tmp_path / "w.onnx")
    assert check_graph(tmp_path / "w.onnx") == []
    options = ort.SessionOptions()
    for key, value in AS_WRITTEN.items():
        options.add_session_config_entry(key, value)
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float16)
    y, z = ort.InferenceSession(str(tmp_path / "w.onnx"), options).run(None, {"x": x})
    weights = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
    stored = dequantize_nodes(out)
    x32 = x.astype(np.float32)
    for got, name, weight in ((y, "matmul", weights["W"]), (z, "gemm", weights["V"].T)):
        _, _, scales = stored[name]
        step = np.repeat(scales.astype(np.float32), BLOCK, axis=attribute(stored[name][0], "axis"))
        step = step if name == "matmul" else step.T  # as [in, out]
        want = x32 @ weight
        bound = np.abs(x32) @ (step / 2) + np.abs(want) * 2.0**-10 + 1e-4
        assert np.all(np.abs(got.astype(np.float32) - want) <= bound), name
        assert np.abs(got.astype(np.float32) - want).max() > 0  # the weights did change


def test_a_weight_read_by_several_products_stays_as_it_is():
    model = products_graph()
    second = helper.make_node("MatMul", ["x", "W"], ["y2"], name="matmul_again")
    model.graph.node.append(second)
    model.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT16, [4, 48]))
    assert dequantizable(model, ["matmul", "gemm", "matmul_again"]) == ["gemm"]


def test_block_wise_weights_are_held_to_opset_21(tmp_path):
    """Opset 21 and block-wise weights go together: below it onnx's checker refuses block_size,
    above it TensorRT for RTX is not known to parse the graph, and without block-wise weights a
    graph keeps TensorRT 10.3's opsets."""
    model = dequantized_model(products_graph(), ["matmul"], WeightOnly(4, BLOCK))
    for version, problem in (
        (20, "onnx.checker: Unrecognized attribute: block_size for operator DequantizeLinear"),
        (22, f"opset [22] is not {WEIGHT_ONLY_OPSET}, which block-wise DequantizeLinear needs"),
    ):
        model.opset_import[0].version = version
        onnx.save(model, tmp_path / "graph.onnx")
        assert check_graph(tmp_path / "graph.onnx")[:1] == [problem]
    plain = products_graph()
    plain.opset_import[0].version = WEIGHT_ONLY_OPSET
    onnx.save(plain, tmp_path / "plain.onnx")
    assert check_graph(tmp_path / "plain.onnx") == ["opset [21] is outside 17..20"]
    assert {WeightOnly(b).dtype for b in (4, 8)} == set(TENSORRT_WEIGHT_ONLY_DTYPES)


# --- the trained tiny pair ------------------------------------------------------------------------
# One fp16 export of the pair (tests/test_calibrate.py's fp32 one is shared with it in a run) and
# two calibrations: about 40 s on an idle core, hence slow.
# Measured (seed 0, recorded inputs of one lantern++ image per pipeline): the quantized weights'
# relative error ||W - dequantized W|| / ||W|| over a graph is 0.085 at int4 and 0.0047 at int8
# (blocks of 16 along dim 32 and 96); the logits' largest error relative to the largest fp32 logit
# is 4.9-5.0x that at int4 and 9.2-11.2x at int8 (fp16's own 0.0014-0.0026 included).
PRODUCTS_IN_SERIES = 8  # per layer qkv -> out and w1w3 -> w2 (fused), two layers: every product
# First order, the relative errors of products in series add up (<= 8e in norm); the largest
# element of a [rows, vocab] error is within about twice its share of the norm here.
ERROR_PER_WEIGHT_ERROR = 2 * PRODUCTS_IN_SERIES
# Greedy token agreement with the fp16 bundle (5 images of 16 tokens): 1.0 at int8; 0.4 at int4,
# where this dim-32 model keeps too little (one early flip changes every later token).
MIN_GREEDY_AGREEMENT = {"int8": 0.9, "int4": 0.2}


@pytest.fixture(scope="module")
def pair_bundles(trained_pair, tmp_path_factory) -> dict[str, Path]:
    """The trained tiny target and drafter (chain-3) at fp32 (tests/test_calibrate.py's export)
    and at fp16 (one cache window)."""
    target, drafter = trained_pair
    root = tmp_path_factory.mktemp("weight_only")
    return {
        "fp32": make_bundle(root / "fp32", target, tiny_vq(), drafter, ["chain-3"], "fp32"),
        "fp16": make_bundle(root / "fp16", target, tiny_vq(), drafter, ["chain-3"], "fp16", windows=1),
    }


@pytest.fixture(scope="module")
def weight_only_bundles(pair_bundles) -> dict[str, tuple[Path, dict, str]]:
    """``lantern calibrate --weights int4|int8`` of the fp16 bundle: each bundle, JSON report and
    printed table."""
    made = {}
    fp16 = pair_bundles["fp16"]
    for name in ("int4", "int8"):
        out, report = fp16.with_name(name), fp16.with_name(f"{name}.json")
        args = ["calibrate", str(fp16), "--weights", name, "--block-size", str(BLOCK), "--out", str(out)]
        args += ["--samples", "2", "--validate", "5", "--threads", "1", "--report-json", str(report), "-q"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        made[name] = out, json.loads(report.read_text()), result.stdout
    return made


def folded(bundle: Bundle, name: str) -> onnx.ModelProto:
    """A graph of ``bundle`` with its weight transposes folded (the weights calibration sees)."""
    model = onnx.load(str(bundle.file(bundle.graph(name))))
    fold_weight_transposes(model)
    return model


def reference_weights(source: onnx.ModelProto, names: set[str], bits: int) -> dict[str, np.ndarray]:
    """Per product of ``names`` in ``source``: its weight dequantized by :func:`reference_blocks`
    (blocks along its input axis: rows of a MatMul's weight, columns of a Gemm's with transB)."""
    consts = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    result = {}
    for node in source.graph.node:
        if node.name in names:
            axis = 1 if any(a.name == "transB" and a.i for a in node.attribute) else 0
            weight = consts[node.input[1]]
            values, scales = reference_blocks(weight, bits, BLOCK, axis)
            dequantized = values.astype(np.float32) * np.repeat(scales.astype(np.float32), BLOCK, axis=axis)
            result[node.name] = dequantized.astype(weight.dtype)
    return result


@pytest.mark.slow
def test_the_bundle_holds_tensorrts_weight_only_form(pair_bundles, weight_only_bundles):
    fp16 = Bundle.open(pair_bundles["fp16"])
    vocab = fp16.constants.vocab_size
    sizes = {"fp16": (fp16.path / "weights.bin").stat().st_size}
    for name, (out, _, _) in weight_only_bundles.items():
        bits, got = int(name[3:]), Bundle.open(out)  # hashes and graph I/O verified on open
        raw = got.manifest()
        assert got.dtype == f"w{bits}a16" and raw["calibration"]["scheme"] == WeightOnly(bits, BLOCK).scheme()
        assert raw["calibration"]["source_manifest_sha256"] == fp16.manifest_sha256
        assert raw["graphs"]["vq_decode"]["precision"] == "fp32"
        # the drafting graph's weights are read once per tree level: kept fp16 (dequantizable)
        assert raw["graphs"]["draft_tree_0"]["precision"] == "fp16"
        for graph in ("target_prefill", "target_ar_step", "target_verify_0"):
            assert raw["graphs"][graph]["precision"] == got.dtype
            path = got.file(got.graph(graph))
            model = onnx.load(str(path))
            source = folded(fp16, graph)
            products = set(dequantizable(source, weight_nodes(source, vocab)))
            stored = dequantize_nodes(model)
            assert set(stored) == products and len(products) == PRODUCTS_IN_SERIES
            assert [o.version for o in model.opset_import if o.domain == ""] == [WEIGHT_ONLY_OPSET]
            assert not [n for n in model.graph.node if n.op_type == "MatMulNBits"]
            assert check_graph(path) == []
            want = reference_weights(source, products, bits)
            for product, (node, values, scales) in stored.items():
                axis = attribute(node, "axis")
                dequantized = values.astype(np.float32) * np.repeat(
                    scales.astype(np.float32), BLOCK, axis=axis
                )
                np.testing.assert_array_equal(dequantized.astype(np.float16), want[product], err_msg=product)
        sizes[name] = (out / "weights.bin").stat().st_size
    assert sizes["int4"] < sizes["int8"] < sizes["fp16"]


@pytest.mark.slow
def test_the_graphs_compute_the_dequantized_model_close_to_fp32(pair_bundles, weight_only_bundles):
    """On recorded inputs (one lantern++ image per pipeline of the fp16 bundle): each weight-only
    graph computes what the fp16 graph computes with the reference's dequantized weights in place
    of its own (the same numbers: onnxruntime folds the DequantizeLinear), and its logits stay
    within ERROR_PER_WEIGHT_ERROR times the weights' relative quantization error (plus fp16's own
    error) of the fp32 graph's."""
    fp32, fp16 = (Bundle.open(pair_bundles[d]) for d in ("fp32", "fp16"))
    recorder = record_inputs(fp16, 1, MethodConfig("lantern++"), quantization=Quantization(weight_bits=4))
    options = ort.SessionOptions()
    for key, value in AS_WRITTEN.items():
        options.add_session_config_entry(key, value)
    vocab = fp16.constants.vocab_size
    for name, (out, _, _) in weight_only_bundles.items():
        got_bundle, bits = Bundle.open(out), int(name[3:])
        for graph in ("target_prefill", "target_ar_step", "target_verify_0"):
            source = folded(fp16, graph)
            products = set(dequantizable(source, weight_nodes(source, vocab)))
            want = reference_weights(source, products, bits)
            consts = {t.name: t for t in source.graph.initializer}
            num = den = 0.0
            for node in source.graph.node:  # the fp16 graph with the reference's weights
                if node.name in products:
                    weight = numpy_helper.to_array(consts[node.input[1]]).astype(np.float32)
                    num += float(((weight - want[node.name]) ** 2).sum())
                    den += float((weight**2).sum())
                    source.graph.initializer.append(
                        numpy_helper.from_array(want[node.name], f"{node.name}_ref")
                    )
                    node.input[1] = f"{node.name}_ref"
            weight_error = (num / den) ** 0.5
            sessions = {
                "reference": ort.InferenceSession(source.SerializeToString(), options),
                "weight-only": ort.InferenceSession(str(got_bundle.file(got_bundle.graph(graph))), options),
                "fp16": ort.InferenceSession(str(fp16.file(fp16.graph(graph))), options),
                "fp32": ort.InferenceSession(str(fp32.file(fp32.graph(graph))), options),
            }
            for inputs in recorder.samples[graph]:
                wide = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in inputs.items()}
                logits = {
                    d: s.run(["logits"], wide if d == "fp32" else inputs)[0].astype(np.float32)
                    for d, s in sessions.items()
                }
                np.testing.assert_array_equal(logits["weight-only"], logits["reference"], err_msg=graph)
                peak = np.abs(logits["fp32"]).max()
                fp16_error = np.abs(logits["fp16"] - logits["fp32"]).max() / peak
                error = np.abs(logits["weight-only"] - logits["fp32"]).max() / peak
                assert error <= ERROR_PER_WEIGHT_ERROR * weight_error + fp16_error, (name, graph, error)
                assert error > fp16_error  # the weights did change


@pytest.mark.slow
def test_the_report_gives_greedy_agreement_with_fp16(weight_only_bundles):
    for name, (_, report, table) in weight_only_bundles.items():
        dtype = f"w{name[3:]}a16"
        assert report["dtype"] == dtype and report["source"] == "fp16"
        rows = {row["run"]: row for row in report["validation"]["accuracy"]}
        for run in ("ar greedy", "lantern++ chain-3 greedy"):
            assert rows[run]["token_agreement"] >= MIN_GREEDY_AGREEMENT[name], (name, rows[run])
        assert (
            f"| run (reference numerics) | token agreement | equal prefix | tau fp16 | tau {dtype} |" in table
        )
        speed = {row["run"]: row for row in report["validation"]["speed"]}
        assert speed["lantern++ chain-3 sampling"][dtype]["mean_accepted_length"] > 1


@pytest.mark.slow
def test_tensorrt_for_rtx_builds_the_bundles(weight_only_bundles, tmp_path):
    """The real builder (ahead of time, no GPU): every graph of the int4 bundle through
    ``lantern build-engines``, and the int8 bundle's target step."""
    pytest.importorskip("tensorrt_rtx_bindings", reason="the trt-rtx extra")
    from lantern_rt.engines.plans import build_plan

    bundle = tmp_path / "int4"
    shutil.copytree(weight_only_bundles["int4"][0], bundle)
    args = ["build-engines", str(bundle), "--flavour", "trt-rtx", "--compute-capability", "8.6"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (folder,) = (bundle / "engines").iterdir()
    assert "w4a16" in folder.name and (folder / "engines.json").is_file()
    assert {p.stem for p in folder.glob("*.plan")} == set(Bundle.open(bundle).graphs)
    int8 = Bundle.open(weight_only_bundles["int8"][0])
    assert len(build_plan(int8.file(int8.graph("target_ar_step")), capabilities=["8.6"])) > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--weights", "int2"], "'int2' is not one of 'int4', 'int8'"),
        (["--block-size", "32"], "--block-size sets the blocks of --weights"),
        (["--weights", "int4", "--block-size", "0"], "0 is not in the range x>=1"),
    ],
)
def test_a_bad_request_is_one_line(args, message, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "bundle"), "--out", str(out), *args])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, (
        result.output
    )
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "bundle, args, message",
    [
        ("fp16", ["--weights", "int4"], "target_prefill: block size 128 does not divide the input width 32"),
        ("fp16", ["--weights", "int8", "--block-size", "64"], "choose a block size that divides 32"),
        (
            "fp32",
            ["--weights", "int4", "--block-size", "16"],
            "calibrate an fp16 bundle (lantern export --dtype fp16)",
        ),
        ("fp16", ["--weights", "int4", "--weights-only", "4"], "not both"),
        ("fp16", ["--weights-only", "4"], "is a fp16 bundle; calibrate an fp32 bundle"),
    ],
)
def test_a_bundle_it_cannot_quantize_is_one_line(pair_bundles, bundle, args, message, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["calibrate", str(pair_bundles[bundle]), "--out", str(out), *args])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, (
        result.output
    )
    assert not out.exists()
