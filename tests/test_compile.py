"""``--compile``: the whole decode step compiled with ``torch.compile`` (inductor, fullgraph) on
the CPU gives eager torch's tokens, compiles once per shape, breaks no graph, and refuses the
runs it cannot do in one line. Compiling takes tens of seconds on a busy CPU: slow tests."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch._dynamo.utils import counters

from lantern_rt.cli import main
from lantern_rt.eval import gpu_check
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.runtime.acceptance import Relaxation, relax_inputs
from lantern_rt.runtime.backends import compiled
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Speculation, StepCache, decode_image
from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs
from lantern_rt.runtime.tree import ROOT_ONLY, load_tree
from tests.conftest import tiny_gpt

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)


def _images(model, sampling: SamplingConfig, steps: StepCache | None, drafting: bool) -> list:
    """Two images (class 1, seeds 0 and 1) decoded greedily or sampled, AR or LANTERN++ on
    chain-3 with a random drafter, eager (``steps`` None) or through ``steps``."""
    n = model.config.block_size
    spec = None
    if drafting:
        torch.manual_seed(0)
        drafter = Drafter(DrafterConfig.for_target(model.config), model.config).eval()
        neighbors = torch.stack([torch.roll(torch.arange(64), -i) for i in range(1, 4)], dim=1)
        relax = Relaxation("lantern++", k=3, lam=2.0)
        spec = Speculation(TorchDrafter(drafter, model.output, n), load_tree("chain-3"), relax, neighbors)
    target = TorchTarget(model)
    cond = torch.tensor([1, model.config.num_classes])
    return [
        decode_image(target, cond, n, sampling, torch.Generator().manual_seed(seed), spec, steps)
        for seed in (0, 1)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("drafting", [False, True], ids=["ar", "lantern++"])
def test_compiled_steps_give_eager_tokens_and_compile_once(drafting):
    """Greedy and sampled, one image after another: the compiled whole step commits eager's
    tokens and accepted lengths; the second image and the other sampling settings (tensors of
    the same shapes) compile nothing again (a recompile would raise)."""
    model = tiny_gpt()
    torch._dynamo.reset()
    counters.clear()
    steps = StepCache(compile=True)
    for sampling in (GREEDY, SAMPLED):
        eager = _images(model, sampling, None, drafting)
        first = sampling is GREEDY  # later images and settings: a recompile raises
        with torch._dynamo.config.patch(error_on_recompile=not first):
            got = _images(model, sampling, steps, drafting)
        for e, g in zip(eager, got, strict=True):
            assert torch.equal(e.tokens, g.tokens) and e.accepted == g.accepted
    assert counters["stats"]["unique_graphs"] == 1  # one graph: the whole step
    assert steps.compiled and steps.compile_seconds > 0


@pytest.mark.slow
def test_verify_compiles_to_one_graph_at_a_small_gpt_b_like_shape():
    """``TorchTarget.verify`` with the root-only tree (an AR step) compiles with fullgraph=True:
    no graph break (the tree's tables once took a lock that dynamo cannot trace)."""
    from lantern_rt.models.config import GPTConfig
    from lantern_rt.models.target import Transformer

    config = GPTConfig(dim=96, n_layer=2, n_head=2, vocab_size=64, num_classes=10, block_size=256)
    torch.manual_seed(0)
    model = Transformer(config).eval()
    filters = filter_inputs(SamplingConfig(cfg_scale=3.0), torch.device("cpu"))
    relax = relax_inputs(
        Relaxation("lantern++", k=10, lam=5.0), torch.randint(64, (64, 10)), 64, False, torch.device("cpu")
    )
    call, args = gpu_check.verify_call(model, ROOT_ONLY, 1, torch.tensor([1, 10]), None, filters, relax)
    torch._dynamo.reset()
    eager = call(*args)
    with torch.no_grad():
        got = torch.compile(call, fullgraph=True)(*args)
    torch.testing.assert_close(got[6], eager[6], rtol=1e-4, atol=1e-4)  # the target's logits
    assert torch.equal(got[2], eager[2])  # the drawn token


def test_compile_needs_a_compiler(monkeypatch):
    """No C++ compiler on a CPU (or no Triton on a GPU): one line naming it and how to turn the
    option off (the Python API's keyword; the command line's flag)."""
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    assert "C++ compiler" in compiled.missing_compiler("cpu")
    with pytest.raises(compiled.CompileError, match="C\\+\\+ compiler.*compile=False") as refused:
        compiled.require_compiler("cpu")
    assert refused.value.command_line().endswith("use --no-compile")
    monkeypatch.undo()
    assert compiled.missing_compiler("cpu") is None  # g++ is here


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--backend", "onnxruntime", "--compile"], ["onnxruntime", "--no-compile"]),
        (["--backend", "torch", "--compile"], ["C++ compiler", "--no-compile"]),
    ],
    ids=["onnxruntime", "no-compiler"],
)
def test_compile_refusals_are_one_line(extra, words, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    out = tmp_path / "x.png"
    r = CliRunner().invoke(
        main,
        ["generate", "-q", "--model", str(tiny_model_dir), "-n", "1", "--class", "1", "-o", str(out), *extra],
        env={"LANTERN_CACHE": str(tmp_path / "cache")},
    )
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert all(w in r.stderr for w in words), r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_llamagen_loop_compiled_as_its_compile_gives_eager_greedy_tokens():
    """The GPU check's peer: LlamaGen's loop with its step compiled (mode reduce-overhead,
    fullgraph) decodes eager's greedy tokens, two chunks through the same static caches."""
    from lantern_rt.eval.baseline import CompiledLoopStep, torch_batched_ar

    model = tiny_gpt()
    torch._dynamo.reset()
    eager = torch_batched_ar(model, [1, 2, 3], GREEDY, 2, 0)
    got = torch_batched_ar(model, [1, 2, 3], GREEDY, 2, 0, CompiledLoopStep())
    assert torch.equal(eager.tokens, got.tokens)


@pytest.mark.slow
def test_generate_compile_reports_its_compile_time_once(tiny_model_dir, tmp_path):
    """``lantern generate --backend torch --compile``: eager's greedy tokens, the compile time
    in the stats and in one message, paid by the first image only."""
    import json

    import numpy as np

    runs = {}
    for flag in ("--no-compile", "--compile"):
        tokens, stats = tmp_path / f"{flag}.npy", tmp_path / f"{flag}.json"
        args = [
            "generate",
            "-q",
            "--backend",
            "torch",
            "--model",
            str(tiny_model_dir),
            "--class",
            "1",
            "-n",
            "3",
        ]
        args += ["--greedy", "-o", str(tmp_path / f"{flag}.png"), "--save-tokens", str(tokens)]
        r = CliRunner().invoke(main, [*args, "--stats-json", str(stats), flag])
        assert r.exit_code == 0, r.output
        runs[flag] = (np.load(tokens), json.loads(stats.read_text()), r.stderr)
    np.testing.assert_array_equal(runs["--no-compile"][0], runs["--compile"][0])
    compiled_stats, message = runs["--compile"][1], runs["--compile"][2]
    assert "compile_seconds" not in runs["--no-compile"][1]
    assert compiled_stats["compile_seconds"] > 0 and message.count("compiled the decode step in") == 1
    first, *later = compiled_stats["seconds_per_image"]
    assert first > compiled_stats["compile_seconds"] > max(later)


@pytest.mark.slow
@pytest.mark.parametrize(("tree", "coupling"), [("chain-3", "maximal"), ("pac-2-2-7", "gumbel")])
def test_compiled_jacobi_steps_give_eager_tokens(tree, coupling):
    """sjd (a Jacobi window, no drafter; a chain or a pac tree, its coupling's state updated in
    place) compiles whole too: eager's greedy tokens."""
    from lantern_rt.runtime.speculation import jacobi_speculation
    from lantern_rt.settings import MethodConfig

    model = tiny_gpt()
    cond = torch.tensor([1, model.config.num_classes])
    results = []
    for steps in (None, StepCache(compile=True)):
        target = TorchTarget(model)
        method = MethodConfig("sjd", tree=tree, coupling=coupling)
        spec = jacobi_speculation(target, model.config, load_tree(tree), method, lambda k: None)
        results.append(decode_image(target, cond, model.config.block_size, GREEDY, None, spec, steps))
    assert torch.equal(results[0].tokens, results[1].tokens)
    assert results[0].accepted == results[1].accepted


def test_generated_calls_counts_the_calls_of_generated_kernels():
    """Kernels called in inductor's wrapper, each call once: a C++ function called by two layers
    twice, a Triton kernel's ``.run``; one defined but not called, library calls and the
    definitions themselves not at all."""
    from lantern_rt.eval.kernel_count import generated_calls

    code = """
cpp_fused_add_mean_mul_rsqrt_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {}
''')
cpp_fused_mul_silu_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {}
''')
cpp_fused_unused_2 = async_compile.cpp_pybinding(['float*'], r'''...''')
triton_poi_fused_cat_3 = async_compile.triton('triton_poi_fused_cat_3', '''...''')
class Runner:
    def call(self, args):
        # Topologically Sorted Source Nodes: [mul, mean], Original ATen: [aten.mul, aten.mean]
        cpp_fused_add_mean_mul_rsqrt_0(arg0_1, buf0)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        cpp_fused_mul_silu_1(buf1, buf2)
        cpp_fused_add_mean_mul_rsqrt_0(buf2, buf3)
        triton_poi_fused_cat_3.run(buf3, buf4, 16, stream=stream0)
        return (buf4, )
"""
    assert generated_calls(code) == {
        "cpp_fused_add_mean_mul_rsqrt_0": 2,
        "cpp_fused_mul_silu_1": 1,
        "triton_poi_fused_cat_3": 1,
    }


NESTS_CODE = """
cpp_fused_rms_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0)
{
    {
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(2L); x0+=static_cast<int64_t>(1L))
        {
            {
                float tmp_acc0 = 0;
                tmp_acc0 = tmp_acc0 + at::vec::vec_reduce_all<float, 1>([](auto& x, auto& y) { return x + y; }, v);
            }
        }
    }
    {
        {
            {
                auto tmp0 = in_ptr0[static_cast<int64_t>(0L)];
            }
        }
    }
}
''')
cpp_fused_parallel_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0)
{
    #pragma omp parallel num_threads(2)
    {
        int tid = omp_get_thread_num();
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(24L); x0+=static_cast<int64_t>(1L))
            {
                {
                    out_ptr0[x0] = in_ptr0[x0];
                }
            }
        }
        {
            #pragma omp for
            for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(24L); x0+=static_cast<int64_t>(1L))
            {
                out_ptr0[x0] = in_ptr0[x0];
            }
        }
        {
            #pragma omp single
            {
                {
                    out_ptr0[0] = in_ptr0[0];
                }
            }
        }
        {
            {
                out_ptr0[2] = in_ptr0[2];
            }
            {
                out_ptr0[3] = in_ptr0[3];
            }
        }
    }
    {
        out_ptr0[1] = in_ptr0[1];
    }
}
''')
triton_poi_fused_cat_2 = async_compile.triton('triton_poi_fused_cat_2', '''...''')
class Runner:
    def call(self, args):
        cpp_fused_rms_0(arg0_1, buf0)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        cpp_fused_parallel_1(buf1, buf2)
        cpp_fused_rms_0(buf2, buf3)
        triton_poi_fused_cat_2.run(buf3, buf4, 16, stream=stream0)
        return (buf4, )
"""


def test_generated_nests_counts_the_loop_nests_a_call_runs():
    """Loop nests per call in inductor's output: a C++ function of a reduction nest and a scalar
    one called twice (4), one with four nests inside an OpenMP parallel region and one after it
    (5), a Triton kernel (1). And a real compile: an RMSNorm over two rows of GPT-B's width runs
    two nests at 1 and 2 threads (a parallel region around them), where inductor's kernel metric
    says 4."""
    import torch._inductor.metrics as metrics
    from torch._inductor.utils import run_and_get_code

    from lantern_rt.eval.kernel_count import generated_nests

    assert generated_nests(NESTS_CODE) == 2 * 2 + 5 + 1
    weight = torch.randn(768)

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight

    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch._dynamo.reset()
            metrics.reset()
            compiled = torch.compile(rms, fullgraph=True, dynamic=False)
            _, codes = run_and_get_code(compiled, torch.randn(2, 768))
            assert [generated_nests(code) for code in codes] == [2], n
            assert metrics.generated_kernel_count == 4
    finally:
        torch.set_num_threads(threads)
