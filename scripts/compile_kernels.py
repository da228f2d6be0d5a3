"""Kernels and time of one torch target call, eager against ``torch.compile`` (inductor,
``fullgraph=True``: a graph break raises) on this CPU: ``TorchTarget.verify`` (the target's step
and the acceptance, one call, as ``gpu_check.verify_call`` sets it up) with the root-only tree
(an AR step) and, with ``--tree``, a draft tree; random weights, B = 1 with guidance, a
half-full cache. Prints per call and per layer the eager kernels (aten compute ops, counted with
torch.profiler: ``gpu_check.kernels_per_call``), the kernels inductor generated
(``torch._inductor.metrics.generated_kernel_count``: matmuls, library calls, are not among
them), how many generated kernels its code calls (on a CPU each a C++ function of one or
more loop nests: ``kernel_count.generated_calls``) and the loop nests those run
(``kernel_count.generated_nests``: the metric also counts the kernels of outer-loop fusions
inductor tries on the CPU and drops, twice a nest), the compile time, and eager and compiled
milliseconds per call (alternated rounds). A benchmark, not a test.

    .venv/bin/python scripts/compile_kernels.py [--preset GPT-B|demo] [--tree chain-5] [--threads 1] [--layers N]

``--layers N`` keeps the preset's shape with N layers: the generated kernels of one layer are the
difference between two runs (N + 1 and N layers), without the step's head and acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from functools import partial

import torch
from torch._inductor.utils import run_and_get_code

from lantern_rt.eval.gpu_check import (
    RELAX,
    SAMPLING,
    _config,
    inductor_kernels,
    kernels_per_call,
    verify_call,
)
from lantern_rt.eval.kernel_count import generated_calls, generated_nests
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.acceptance import relax_inputs
from lantern_rt.runtime.sampling import filter_inputs
from lantern_rt.runtime.tree import ROOT_ONLY, load_tree

ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="GPT-B", help="LlamaGen preset (GPT-B, GPT-L, ...) or demo")
    parser.add_argument("--tree", default=None, help="a draft tree to verify besides the AR step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per mode and round")
    parser.add_argument("--layers", type=int, default=None, help="the preset's shape with this many layers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = open_model_dir(None).gpt if args.preset == "demo" else _config(args.preset, "c2i")
    if args.layers is not None:
        config = dataclasses.replace(config, n_layer=args.layers)
    model = Transformer(config).eval()
    vocab, cpu = config.vocab_size, torch.device("cpu")
    relax = relax_inputs(RELAX, torch.randint(vocab, (vocab, 10)), vocab, False, cpu)
    filters = filter_inputs(SAMPLING, cpu)
    cond = torch.tensor([0, config.num_classes])
    trees = [("AR step", ROOT_ONLY)] + ([(f"verify {args.tree}", load_tree(args.tree))] if args.tree else [])
    layers = config.n_layer
    print(
        f"{args.preset}: dim {config.dim}, {layers} layers, {config.n_head} heads, torch {torch.__version__}, "
        f"{args.threads} thread(s)"
    )
    for name, tree in trees:
        call, inputs = verify_call(model, tree, 1, cond, None, filters, relax)
        eager_kernels = kernels_per_call(call, inputs)
        # fullgraph: a graph break raises here
        (generated, seconds), codes = run_and_get_code(inductor_kernels, call, inputs)
        called = sum(sum(generated_calls(code).values()) for code in codes)
        nests = sum(generated_nests(code) for code in codes)
        compiled = torch.compile(call, fullgraph=True, backend="inductor", dynamic=False)
        runs = {"eager": partial(call, *inputs), "compiled": partial(compiled, *inputs)}
        ms: dict[str, list[float]] = {mode: [] for mode in runs}
        with torch.no_grad():
            for _ in range(ROUNDS):
                for mode, run in runs.items():
                    for _ in range(2):
                        run()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        run()
                    ms[mode].append((time.perf_counter() - t0) / args.calls * 1e3)
        eager_ms, compiled_ms = (statistics.median(ms[m]) for m in ("eager", "compiled"))
        print(
            f"{name}: no graph break; eager {eager_kernels} kernels ({eager_kernels / layers:.1f} per layer), "
            f"inductor {generated} generated kernels ({generated / layers:.1f} per layer) in {called} calls "
            f"({called / layers:.1f} per layer) running {nests} loop nests ({nests / layers:.1f} per layer), compiled in "
            f"{seconds:.1f} s; eager {eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms per call "
            f"({eager_ms / compiled_ms:.2f}x)"
        )


if __name__ == "__main__":
    main()
