"""A bundle whose target steps and drafting calls write their K/V into their caches in place
(``export --cache-in-place``: opset 24, onnxruntime on the CPU) against the same model exported
with standard graphs, which return the K/V for the runtime to commit: the same tokens, greedy
and sampled, AR, LANTERN++ on a chain and a wide tree, one and two images per call, across
cache windows."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.assembly import bundle_pipeline
from lantern_rt.backends import backend_named
from lantern_rt.bundle import AR_STEP_GRAPH, Bundle, BundleError, batched_name
from lantern_rt.calibration.calibrate import calibrate_bundle
from lantern_rt.cli import main
from lantern_rt.engines.plans import EngineError, build_engines
from lantern_rt.export.graphs import DrafterTree, TargetVerify
from lantern_rt.generate import generate
from lantern_rt.graph_rules import check_graph
from lantern_rt.graph_spec import IN_PLACE_OPSET
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.backends.bundle_graphs import BundleTarget
from lantern_rt.runtime.backends.onnxruntime_backend import ort_runner, runs_in_place_steps
from lantern_rt.runtime.drafting import drafter_capacity, scratch_rows
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import ROOT_ONLY, load_tree
from lantern_rt.settings import MethodConfig, RunPlan
from tests.conftest import tiny_gpt, tiny_vq
from tests.test_export import make_bundle
from tests.test_onnxruntime_backend import outputs_reversed
from tests.test_speculative import GREEDY

# the wide tree first: tests/test_batching.py's B = 2 exports of the same pair (in place on first
# use; standard with one window) are these bundles' graphs of the wide tree, exported once a run;
# then a chain of two levels (each level more costs each drafting graph's export about 2 s)
TREES = ["mc_sim_7b_63", "chain-2"]
CHAIN = TREES[1]
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
pytestmark = pytest.mark.slow  # two exports of the trained pair


@pytest.fixture(scope="module")
def bundles(trained_pair, tmp_path_factory) -> dict[bool, Bundle]:
    """in place -> the bundle (standard graphs for False): two images per call (at different
    lengths after the first step), two cache windows in place (the standard one, the reference
    whose tokens do not depend on its windows, has one)."""
    target, drafter = trained_pair
    root = tmp_path_factory.mktemp("in-place")
    return {
        in_place: Bundle.open(
            make_bundle(
                root / f"in-place-{in_place}",
                target,
                tiny_vq(),
                drafter,
                TREES,
                "fp32",
                batch_sizes=(2,),
                windows=2 if in_place else 1,
                in_place=in_place,
            )
        )
        for in_place in (False, True)
    }


@pytest.mark.parametrize("tree", [ROOT_ONLY, load_tree("mc_sim_7b_63")], ids=["ar", "tree"])
def test_the_in_place_step_in_torch_equals_the_models_step(tree):
    """The in-place step graph's own forward, run eagerly (the scatter, the mask from the
    lengths, torch's Attention and RotaryEmbedding ops, grouped-query heads), against the
    model's ``step`` with the new K/V scattered into the caches: two images at different
    lengths, the scratch slots wider than the tree."""
    model = tiny_gpt(3, n_head=4, n_kv_head=2).eval()
    module = TargetVerify(model, tree, 8, "step", batch=2, scratch=tree.num_nodes + 3)
    inputs = module.example_inputs(torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, want = module(*inputs), module.reference_forward(*inputs)
    assert [s.name for s in module.spec.outputs][-1] == "present_v_1"
    for spec, g, w in zip(module.spec.outputs, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=spec.name)


@pytest.mark.parametrize("tree", ["chain-4", "mc_sim_7b_63"])
def test_the_in_place_drafting_in_torch_equals_the_drafters_step(tree):
    """The in-place drafting graph's own forward, run eagerly (each call's rows scattered into
    the scratch slots, one mask over the whole cache, grouped-query heads), against
    ``draft_tree`` with the drafter's own step over the window: the same draft, and the caches
    with every row the drafter ran on written after the window in call order."""
    target = tiny_gpt(3, n_head=4, n_kv_head=2).eval()
    c = target.config
    drafter = Drafter(DrafterConfig.for_target(c), c).eval()
    tree = load_tree(tree)
    capacity, scratch = drafter_capacity(c.cls_token_num, c.block_size), scratch_rows(tree) + 2
    module = DrafterTree(drafter, target.output, tree, capacity, "draft", 2, layout=c, scratch=scratch)
    inputs = module.example_inputs(torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, want = module(*inputs), module.reference_forward(*inputs)
    assert [s.name for s in module.spec.outputs][3:] == ["present_k_0", "present_v_0"]
    assert got[3].shape[2] == capacity + scratch
    for spec, g, w in zip(module.spec.outputs, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=spec.name)


def optimized_nodes(path, tmp_path) -> int:
    """Top-level nodes of the graph at ``path`` after onnxruntime's CPU fusions."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return len(onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node)


def test_the_step_graphs_write_the_cache(bundles, tmp_path):
    standard, in_place = bundles[False], bundles[True]
    assert standard.constants.cache_scratch == 0
    scratch = max(len(tree.paths) + 1 for tree in in_place.trees.values())  # the root included
    assert in_place.constants.cache_scratch == scratch == load_tree("mc_sim_7b_63").num_nodes + 1
    assert standard.constants.drafter_scratch == 0
    assert in_place.constants.drafter_scratch == max(scratch_rows(load_tree(t)) for t in TREES)
    width = in_place.constants.cache_capacity + scratch
    drafter_width = in_place.constants.drafter_capacity + in_place.constants.drafter_scratch
    steps = [name for name in in_place.graphs if name.startswith(("target_ar_step", "target_verify"))]
    drafting = [name for name in in_place.graphs if name.startswith("draft_tree")]
    assert len(steps) > 3 and len(drafting) == len(TREES)  # AR's and each tree's, per window
    for name, entry in in_place.graphs.items():
        model = onnx.load(str(in_place.file(entry)), load_external_data=False)
        opset = next(o.version for o in model.opset_import if o.domain == "")
        ops = {node.op_type for node in model.graph.node}
        if name in steps:
            assert opset == IN_PLACE_OPSET and {"TensorScatter", "Attention", "RotaryEmbedding"} <= ops
            presents = [s.name for s in entry.outputs if s.name.startswith("present_")]
            assert presents == [
                s.name.replace("past_", "present_") for s in entry.inputs if s.name.startswith("past_")
            ]
            assert all(s.shape[2] == width for s in entry.outputs if s.name in presents) or "_w" in name
            assert check_graph(in_place.file(entry), entry) == []
        elif name in drafting:
            assert opset == IN_PLACE_OPSET and {"TensorScatter", "Attention", "RotaryEmbedding"} <= ops
            presents = [s.name for s in entry.outputs if s.name.startswith("present_")]
            assert presents == ["present_k_0", "present_v_0"]
            assert all(s.shape[2] == drafter_width for s in entry.outputs if s.name in presents)
            assert check_graph(in_place.file(entry), entry) == []
        else:  # prefill, the drafter's prefill, VQ: the same standard graphs as any bundle
            assert opset == standard.opset and "TensorScatter" not in ops
            assert entry.inputs == standard.graph(name).inputs
    for graph in (AR_STEP_GRAPH, drafting[1].removesuffix("_b2")):
        before, after = (
            optimized_nodes(b.file(b.graph(batched_name(graph, 2))), tmp_path) for b in (standard, in_place)
        )
        assert after < before * 0.8, (graph, before, after)


def tokens(bundle: Bundle, method: MethodConfig, sampling: SamplingConfig) -> torch.Tensor:
    pipe = build_pipeline(RunPlan(bundle, "onnxruntime", method, sampling, RunShape(2, streams=1), threads=1))
    return generate(pipe, [0, 1, 2, 1, 0], sampling, seed=7, progress=False).tokens


@pytest.mark.parametrize(
    "method",
    [
        MethodConfig("ar"),
        MethodConfig("lantern++", tree=CHAIN, k=5),
        MethodConfig("lantern++", tree="mc_sim_7b_63", k=5),
        MethodConfig("exact", tree="mc_sim_7b_63"),
    ],
    ids=["ar", "lantern++-chain", "lantern++-tree", "exact-tree"],
)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_tokens_equal_the_standard_graphs(bundles, method, sampling):
    """The kept nodes' K/V move from the scratch slots into place on commit: any slot off by one,
    a node's K/V kept for another's or a stale scratch slot seen changes the tokens that follow."""
    want = tokens(bundles[False], method, sampling)
    got = tokens(bundles[True], method, sampling)
    assert torch.equal(got, want)


@pytest.mark.parametrize("in_place", [False, True], ids=["standard", "in-place"])
def test_graph_outputs_in_another_order_decode_the_same_tokens(bundles, in_place):
    """Every graph (prefill, drafting, verify, VQ) with its outputs in reverse order: the same
    greedy LANTERN++ tokens, the K/V returned or written in place read by name."""
    method = MethodConfig("lantern++", tree=CHAIN, k=5)
    got, want = (
        generate(
            bundle_pipeline(bundles[in_place], 2, method, make, "onnxruntime"),
            [0, 1, 2],
            GREEDY,
            seed=7,
            progress=False,
        ).tokens
        for make in (outputs_reversed(ort_runner(threads=1)), ort_runner(threads=1))
    )
    assert torch.equal(got, want)


def test_the_cache_stays_on_the_cpu(bundles):
    """onnxruntime writes a cache in place on the CPU only: a runner on another device is refused
    before any cache is made."""
    bundle = bundles[True]
    make = ort_runner(threads=1)

    def on_gpu(b, entry):
        graph = make(b, entry)
        graph.device = torch.device("cuda", 0)
        return graph

    with pytest.raises(BundleError, match="onnxruntime does on the CPU only"):
        BundleTarget(bundle.batch(2), on_gpu, "onnxruntime")


def test_a_cache_copy_is_refused(bundles):
    """A cache that is not contiguous would be copied before binding, and the graph would write
    the copy: refused."""
    target = BundleTarget(bundles[True].batch(2), ort_runner(threads=1), "onnxruntime")
    graph = target._verify[next(iter(target._verify))]
    past = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in graph.inputs}
    name = next(n for n in past if n.startswith("past_k_"))
    past[name] = torch.zeros(past[name].shape[::-1], dtype=past[name].dtype).permute(3, 2, 1, 0)
    with pytest.raises(ValueError, match=f"{name} is written in place"):
        graph(**past)


def test_tensorrt_refuses_the_bundle(bundles):
    with pytest.raises(EngineError, match="write the KV cache in place.*without --cache-in-place"):
        build_engines(bundles[True])


def test_a_bench_plans_at_the_batch_sizes_it_is_asked_for(bundles, tmp_path):
    """``lantern bench --batch-size 2`` on a bundle exported for two images per call alone: every
    row is planned at B = 2, and no check asks the bundle for graphs of another batch size."""
    from lantern_rt.eval.bench import BenchSettings, bench_plans

    settings = BenchSettings(
        out=tmp_path, configs=("ar", "lantern++"), backends=("onnxruntime",), batch_sizes=(2,)
    )
    plans = bench_plans(bundles[True], settings)
    assert len(plans) == 2 and {plan.shape.batch_size for plan in plans} == {2}
    with pytest.raises(BundleError, match="batch sizes 2, not 1"):
        bench_plans(bundles[True], BenchSettings(out=tmp_path, configs=("ar",), backends=("onnxruntime",)))


def test_int8_calibration_keeps_the_graphs_in_place(bundles, tmp_path, capfd):
    """``lantern calibrate`` on an in-place bundle: Q/DQ on the target's step graphs, which still
    write the cache in place (the drafting graphs stay fp32, in place too), without onnxruntime's
    warning per call that it copies a cache; the quantized logits agree with fp32's on most
    recorded inputs, and the bundle decodes."""
    report = calibrate_bundle(bundles[True], tmp_path / "int8", samples=2, validate=2, threads=1)
    assert "TensorScatter" not in capfd.readouterr().err
    int8 = Bundle.open(tmp_path / "int8")
    c, fp32 = int8.constants, bundles[True].constants
    assert int8.dtype == "int8" and (c.cache_scratch, c.drafter_scratch) == (
        fp32.cache_scratch,
        fp32.drafter_scratch,
    )
    for name, entry in int8.graphs.items():
        ops = {n.op_type for n in onnx.load(str(int8.file(entry)), load_external_data=False).graph.node}
        if name.startswith(("target_ar_step", "target_verify", "draft_tree")):
            assert "TensorScatter" in ops and any(s.name.startswith("present_") for s in entry.outputs)
            assert ("QuantizeLinear" in ops) == (not name.startswith("draft_tree")), name
    steps = [g for name, g in report["graphs"].items() if g["top1_agreement"] is not None]
    assert steps and min(g["top1_agreement"] for g in steps) > 0.8
    out = tokens(int8, MethodConfig("lantern++", tree=CHAIN, k=5), SAMPLED)
    assert out.shape == (5, int8.constants.block_size)


def test_inspect_says_so(bundles):
    result = CliRunner().invoke(main, ["inspect", str(bundles[True].path)])
    assert result.exit_code == 0, result.output
    c = bundles[True].constants
    said = f"in place ({c.cache_scratch} scratch slots, the drafter's {c.drafter_scratch}, onnxruntime on the CPU only)"
    assert said in result.output
    plain = CliRunner().invoke(main, ["inspect", str(bundles[False].path)])
    assert "in place" not in plain.output


def test_onnxruntime_on_the_cpu_exports_in_place(monkeypatch):
    """What a model directory run on onnxruntime is exported as (the export cache's choice):
    in place on the CPU where this onnxruntime runs TensorScatter and Attention, else standard."""
    onnxruntime, torch_backend = backend_named("onnxruntime"), backend_named("torch")
    assert onnxruntime.exports_in_place("cpu") and not onnxruntime.exports_in_place("cuda")
    assert not torch_backend.exports_in_place("cpu")

    def older(*args, **kwargs):
        raise ort.capi.onnxruntime_pybind11_state.InvalidGraph(
            "Unrecognized attribute: axis for TensorScatter"
        )

    runs_in_place_steps.cache_clear()
    monkeypatch.setattr(ort, "InferenceSession", older)
    try:
        assert not runs_in_place_steps() and not onnxruntime.exports_in_place("cpu")
    finally:
        runs_in_place_steps.cache_clear()
