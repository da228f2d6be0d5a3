"""One GPU check in one command (``scripts/gpu_check.sh``): what the device machine measures.

1. The demo on every available path: torch eager and torch CUDA graphs on the GPU, onnxruntime
   on the CPU (and TensorRT where installed and its plans can be built): AR and LANTERN++ (on
   the tree its device runs by default: ``GPU_DEFAULT_TREE`` on the GPU, ``CPU_DEFAULT_TREE``
   on the CPU), seconds per image, mean accepted length, speedup over AR on the same path, and
   greedy token agreement between the paths that run the same method and tree.
2. Per-step costs for a LlamaGen-XL shaped target with random weights (fp16, CUDA
   graphs) at batch sizes 1, 4 and 16, for LlamaGen-XL T2I Stage I's shape (a 120-slot
   caption prefix, partly padding) and, on a GPU, Anole-7B's (14 GB of fp16 weights, a 64-slot
   prompt with per-row padding, 1024 image tokens): an AR step, a tree verify (acceptance included, one
   call) and a whole speculative step as the decode loop runs it (draft, verify, commit, host
   work): the ratios that decide the speedup at real sizes, and images/s projected from them
   with the demo's tau (labelled as projections).
3. What decides whether the kernels or the weights bound a step (issue 47): the AR step and the
   tree verify eager, compiled (``torch.compile``, inductor, fullgraph) and, on a GPU, replayed
   from CUDA graphs (eager and compiled), each beside its memory floor (the weight and KV bytes
   it must read over the device's peak bandwidth, :data:`PEAK_BANDWIDTH`) and with its kernels
   per call (torch.profiler: GPU kernels on a GPU, compute ops on a CPU).
4. The GPU peer: LlamaGen's own sampling loop (:mod:`lantern_rt.eval.baseline`), eager and
   compiled as its ``--compile`` does (``torch.compile(decode_one_token, mode="reduce-overhead",
   fullgraph=True)``), over the demo and each sized model of 6. (fp32, the same weights), in the
   same run.
5. A drafter-free window (issue 50): a pac tree's verify (``PAC_TREE``, exact ``sjd``) against
   an AR step at B = 1 at LlamaGen-XL's and, on a GPU, Anole-7B's shapes, with the speedup
   projected from the demo's tau with that tree (``PAC_TAU``).
6. The demo widened to LlamaGen's sizes (:mod:`lantern_rt.sized_demo`; ``--sizes``, GPT-XL then
   GPT-L while ``--sizes-budget`` allows): the demo's tokens and acceptance at a real model's step
   cost, so s/image at XL is measured, not projected. Torch eager and CUDA graphs (fp32, B = 1),
   AR against LANTERN++ on ``GPU_DEFAULT_TREE`` and on chain-5, each with its memory floor and
   whether its greedy tokens are the demo's; the fastest against LlamaGen's loop (4.).
7. ``lantern tune --backend torch`` on each sized model of 6. (issue 61; on a GPU with CUDA
   graphs, as its runs go): the tuned tree and the few named ones of :data:`TUNE_TREES` against
   AR at B = 1, few images each (:func:`tune_size`): the chosen configuration, its measured
   s/image against AR's and the tune's table; the records land in the cache's ``tuning/``.

Order and budget: the demo, then the sized models (the first built in another process while the
demo runs), their tunes, LlamaGen's loops, then the step costs; a run stays under 8 minutes on
an H100 by skipping a second size past ``--sizes-budget``, a second tune past ``--tune-budget``
and compiled modes past ``--compile-budget``.
Writes ``gpu_check.json`` and prints a markdown report. ``--quick`` shrinks everything (used by
the tests on a CPU; ``scripts/gpu_check.sh --quick`` runs it on a CPU, with the ``tiny`` size).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lantern_rt.eval.baseline import CompiledLoopStep, LoopStep, torch_batched_ar
from lantern_rt.eval.memory_floor import (
    copy_bandwidth,
    floor_fields,
    kv_entry_bytes,
    pipeline_step_bytes,
    target_weight_bytes,
)
from lantern_rt.families.loading import load_target, open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.config import gpt_config
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.model_dir import DEMO_DIR, ModelDir
from lantern_rt.models.target import Transformer
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime.acceptance import Relaxation, RelaxInputs, relax_inputs
from lantern_rt.runtime.backends.base import Draft, FilterInputs
from lantern_rt.runtime.backends.compiled import Compiled
from lantern_rt.runtime.backends.cuda_graphs import CudaGraphed
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Condition, Speculation, decode_images
from lantern_rt.runtime.drafting import drafter_capacity
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree, load_tree
from lantern_rt.settings import CPU_DEFAULT_TREE, GPU_DEFAULT_TREE, MethodConfig, RunPlan
from lantern_rt.sized_demo.cache import sized_model_dir
from lantern_rt.tune.report import report as tune_table
from lantern_rt.tune.tuner import TuneOptions, TuneResult, tune

SAMPLING = SamplingConfig(cfg_scale=3.0)
GREEDY = SamplingConfig(cfg_scale=3.0, temperature=0.0)
RELAX = Relaxation("lantern++", k=10, lam=5.0)
# The drafter-free window of the check's pac-tree rows and the tau `sjd` made with it on the demo
# (BENCHMARKS.md, "Issue 50": onnxruntime, 100 images; tau does not depend on the hardware)
PAC_TREE, PAC_TAU = "pac-2-1-33", 4.54


def paths(device: str) -> list[tuple[str, str, bool, str, str]]:
    """(name, backend, cuda_graphs, LANTERN++ tree, device) for every path this machine can run:
    a path on the GPU drafts its default tree, the onnxruntime CPU path the CPU's."""
    found = [("onnxruntime-cpu", "onnxruntime", False, CPU_DEFAULT_TREE, "cpu")]
    if device.startswith("cuda"):
        gpu = [
            ("torch-eager", "torch", False, GPU_DEFAULT_TREE, device),
            ("torch-cudagraphs", "torch", True, GPU_DEFAULT_TREE, device),
        ]
        found = [*gpu, *found]
    return found


def run_path(
    backend: str, graphs: bool, method: MethodConfig, device: str, labels: list[int]
) -> dict[str, Any]:
    """Sampling-mode speed and greedy tokens for one path and method (first image: warm-up)."""
    md = open_model_dir(DEMO_DIR)
    pipe = build_pipeline(
        RunPlan(md, backend, method, SAMPLING, device=device, threads=1, cuda_graphs=graphs)
    )
    generate(pipe, labels[:1], SAMPLING, seed=99, progress=False)
    timed = generate(pipe, labels, SAMPLING, seed=0, progress=False)
    greedy = generate(pipe, labels[:2], GREEDY, seed=0, progress=False)
    seconds = sorted(timed.stats.seconds_per_image)
    return {
        "s_per_image": seconds[len(seconds) // 2],
        "tau": timed.stats.mean_accepted_length,
        "greedy_tokens": greedy.tokens,
    }


def demo_rows(device: str, labels: list[int]) -> list[dict[str, Any]]:
    """Every path x (ar, lantern++ on the path's tree, sjd over a window of 5): speed, tau,
    speedup vs AR on that path, greedy agreement with the first path of the same method and tree
    (sjd's greedy tokens are AR's)."""
    rows, reference = [], {}
    for name, backend, graphs, tree, path_device in paths(device):
        ar = None
        for method in (
            MethodConfig("ar"),
            MethodConfig("lantern++", tree=tree),
            MethodConfig("sjd", tree="chain-5"),
        ):
            r = run_path(backend, graphs, method, path_device, labels)
            ar = ar or r["s_per_image"]
            tokens = r.pop("greedy_tokens")
            first = reference.setdefault((method.method, method.tree), tokens)
            rows.append(
                {
                    "path": name,
                    "method": method.method,
                    "tree": None if method.method == "ar" else method.tree,
                    **r,
                    "speedup_vs_ar": ar / r["s_per_image"],
                    "greedy_agreement_vs_first_path": float((tokens == first).float().mean()),
                }
            )
    return rows


# The demo widened to LlamaGen's sizes (lantern_rt.sized_demo): the demo's tokens and acceptance at
# a real model's step cost, so that its s/image is measured, not projected. Each size runs these.
SIZED_METHODS = (
    MethodConfig("ar"),
    MethodConfig("lantern++", tree=GPU_DEFAULT_TREE),
    MethodConfig("lantern++", tree="chain-5"),
)


def sized_paths(device: str) -> list[tuple[str, bool]]:
    """(name, cuda_graphs) of the torch paths a sized model runs on ``device``."""
    eager = [("torch-eager", False)]
    return [*eager, ("torch-cudagraphs", True)] if device.startswith("cuda") else eager


def prebuild(size: str) -> subprocess.Popen:
    """Start building the sized model ``size`` into the cache in another process (``lantern
    widen``), so that the check runs meanwhile; :func:`sized_model_dir` waits on the cache's
    lock for it."""
    command = [sys.executable, "-m", "lantern_rt.cli", "widen", "--size", size]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def greedy_tokens(
    md: ModelDir, graphs: bool, method: MethodConfig, device: str, labels: list[int]
) -> torch.Tensor:
    """Greedy tokens of ``labels`` on the torch path (``graphs``: CUDA graphs)."""
    pipe = build_pipeline(
        RunPlan(md, "torch", method, SAMPLING, device=device, threads=1, cuda_graphs=graphs)
    )
    return generate(pipe, labels, GREEDY, seed=0, progress=False).tokens


def sized_run(
    md: ModelDir, graphs: bool, method: MethodConfig, device: str, labels: list[int], bandwidth: float | None
) -> dict[str, Any]:
    """One sized row on the torch path: the greedy tokens of ``labels[0]`` (the warm-up too),
    then ``labels`` sampled and timed: seconds per image (median), tau, and the memory floor at
    ``bandwidth`` bytes/s (:mod:`lantern_rt.eval.memory_floor`; B = 1; None: no floor)."""
    pipe = build_pipeline(
        RunPlan(md, "torch", method, SAMPLING, device=device, threads=1, cuda_graphs=graphs)
    )
    greedy = generate(pipe, labels[:1], GREEDY, seed=0, progress=False).tokens
    stats = generate(pipe, labels, SAMPLING, seed=0, progress=False).stats
    seconds = statistics.median(stats.seconds_per_image)
    measured = {
        "num_images": stats.num_images,
        "verify_calls": stats.verify_calls,
        "batch_size": 1,
        "seconds_per_image": seconds,
    }
    step = pipeline_step_bytes(pipe, md) if bandwidth else None
    floor = floor_fields(step, measured, 2 if SAMPLING.guided else 1, bandwidth or 1.0)
    return {
        "images": len(labels),
        "s_per_image": seconds,
        "tau": stats.mean_accepted_length,
        "floor_s_per_image": floor["floor_seconds_per_image"],
        "measured_over_floor": floor["measured_over_floor"],
        "greedy_tokens": greedy,
    }


def sized_rows(
    size: str,
    device: str,
    labels: list[int],
    eager_labels: list[int],
    bandwidth: float | None,
    reference: dict[tuple[bool, MethodConfig], torch.Tensor],
) -> list[dict[str, Any]]:
    """The demo widened to ``size`` on each torch path (:func:`sized_paths`) x
    :data:`SIZED_METHODS` at B = 1 (``labels`` timed, ``eager_labels`` on the slower eager path
    of a GPU): speed, tau, speedup vs AR on that path, memory floor, and whether the greedy
    tokens equal the demo's on the same path and method (``reference``: the demo's, filled
    once and kept across sizes)."""
    md = open_model_dir(sized_model_dir(size))
    demo = open_model_dir(DEMO_DIR)
    cuda = device.startswith("cuda")
    rows = []
    for path, graphs in sized_paths(device):
        ar = None
        for method in SIZED_METHODS:
            timed = eager_labels if cuda and not graphs else labels
            r = sized_run(md, graphs, method, device, timed, bandwidth)
            if (graphs, method) not in reference:
                reference[graphs, method] = greedy_tokens(demo, graphs, method, device, labels[:1])
            tokens = r.pop("greedy_tokens")
            ar = ar or r["s_per_image"]
            rows.append(
                {
                    "size": size,
                    "path": path,
                    "method": method.method,
                    "tree": None if method.method == "ar" else method.tree,
                    **r,
                    "speedup_vs_ar": ar / r["s_per_image"],
                    "greedy_equal_to_demo": bool(torch.equal(tokens, reference[graphs, method])),
                }
            )
            if cuda:  # the next row loads the model again: free this one's (pipelines hold cycles)
                gc.collect()
                torch.cuda.empty_cache()
    return rows


# What the check tunes at each sized model (7.): LANTERN++ at the run's k and lambda, B = 1, a
# chain either side of the depths that pay and the GPU's default tree (the cost model's range:
# depths 3-8, up to 57 nodes), few images and the fewest cost rounds that settle (the quick run's
# fewer and smaller: one image, one round)
TUNE_METHOD = MethodConfig("lantern++", k=10, lam=5.0)
TUNE_TREES = ("chain-3", "chain-8", GPU_DEFAULT_TREE)
QUICK_TUNE_TREES = ("chain-2", "chain-4")


def tune_size(size: str, device: str, quick: bool) -> dict[str, Any]:
    """``lantern tune --backend torch`` on the demo widened to ``size`` (CUDA graphs on a GPU):
    the chosen row at B = 1, its measured s/image against AR's, and the tune's table as the
    command prints it."""
    options = TuneOptions(
        (TUNE_METHOD,),
        trees=QUICK_TUNE_TREES if quick else TUNE_TREES,
        images=1 if quick else 2,
        calibration_images=1 if quick else 2,
        threads=0,  # the process's threads, as the other rows run: the tune leaves them be
        backend="torch",
        device=device,
        cuda_graphs=device.startswith("cuda"),
        max_rounds=1 if quick else 3,
    )
    result: TuneResult = tune(open_model_dir(sized_model_dir(size)), options)
    choice = result.choices[1]
    ar = next(r for r in result.rows if r.tree is None and r.measured_seconds_per_image is not None)
    return {
        "size": size,
        "trees": list(options.trees),
        "images": options.images,
        "calibration_images": options.calibration_images,
        "cuda_graphs": options.cuda_graphs,
        "seconds": result.seconds,
        "chosen": choice.label,
        "chosen_tree": None if choice.tree is None else [list(p) for p in choice.tree.paths],
        "chosen_s_per_image": choice.measured_seconds_per_image,
        "chosen_predicted_s_per_image": choice.seconds_per_image,
        "ar_s_per_image": ar.measured_seconds_per_image,
        "speedup_vs_ar": ar.measured_seconds_per_image / choice.measured_seconds_per_image,
        "rows": [r.to_json() for r in result.rows],
        "table": tune_table(result),
        "record": str(result.path),
    }


def tune_report_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The tunes' section (:func:`tune_size`): each size's choice against AR, then its table."""
    if not rows:
        return []
    lines = [
        "",
        "## lantern tune at the sized models (torch, B = 1; issue 61)",
        "",
        "| size | chosen | s/img measured | s/img predicted | AR s/img | speedup vs AR | tune s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['chosen']} | {r['chosen_s_per_image']:.4f} | "
            f"{r['chosen_predicted_s_per_image']:.4f} | {r['ar_s_per_image']:.4f} | "
            f"{r['speedup_vs_ar']:.2f}x | {r['seconds']:.0f} |"
        )
    for r in rows:
        lines += ["", f"### {r['size']}: named trees {', '.join(r['trees'])}, {r['images']} images each", ""]
        lines += r["table"]
    return lines


T2I = dict(model_type="t2i", cls_token_num=120, caption_dim=2048)  # LlamaGen-XL T2I's prefix
# Anole-7B as the runtime runs it (docs/method.md §10): 1024 image tokens after a 64-slot prompt.
ANOLE_7B = dict(
    model_type="chameleon",
    dim=4096,
    n_layer=32,
    n_head=32,
    ffn_hidden_size=11008,
    vocab_size=8192,
    text_vocab_size=65536,
    cls_token_num=64,
    block_size=1024,
    qk_norm=True,
)


def _config(preset: str, kind: str, shape: dict[str, Any] | None = None):
    """The target config of a step-cost row; ``preset`` is ignored for the Chameleon shape
    (``ANOLE_7B`` updated with ``shape``)."""
    if kind == "chameleon":
        values = ANOLE_7B | (shape or {})
        return gpt_config(None, **values, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)
    extra = T2I if kind == "t2i" else {"num_classes": 1000}
    return gpt_config(preset, vocab_size=16384, block_size=256, **extra)


def step_costs(
    preset: str,
    tree: str,
    device: str,
    dtype: torch.dtype,
    repeats: int,
    batch: int = 1,
    text: bool = False,
    kind: str | None = None,
    shape: dict[str, Any] | None = None,
    compile: bool = True,
    bandwidth: float | None = None,
) -> dict[str, Any]:
    """Milliseconds, random weights, sampled LANTERN++ settings, a half-full cache, ``batch``
    images per call: an AR step (one token per image verified and drawn), a tree verify (target
    step and acceptance, one call), and a whole speculative step as the decode loop runs it
    (draft, verify with acceptance, commit, its host work and one read), from images decoded
    with a random one-layer drafter. ``text``: a text-conditional target (``T2I``'s caption
    prefix, five sixths of it padding) whose drafter first commits the caption's pairs; ``kind``
    "chameleon": Anole-7B's shape (``ANOLE_7B``: a 64-slot prompt, each row with its own
    padding, 1024 image tokens), whatever ``preset`` says, its fields replaced by ``shape``.
    The AR step and the verify run in each of :func:`step_runs` (``compile`` False: none
    compiled; compiled: with the kernels inductor generated), with their kernels per call (:func:`kernels_per_call`) and their memory floor at
    ``bandwidth`` bytes/s (None: unknown, no floor)."""
    from torch._inductor import metrics

    kind = kind or ("t2i" if text else "c2i")
    config = _config(preset, kind, shape)
    with torch.device(device):  # a 7B model initialised on the GPU, not on the host
        model = Transformer(config).to(dtype).eval()
    graphs = device.startswith("cuda")
    verify = load_tree(tree)
    vocab = config.vocab_size
    neighbors = torch.randint(vocab, (vocab, 10), device=device)
    relax = relax_inputs(RELAX, neighbors, vocab, False, torch.device(device))
    filters = filter_inputs(SAMPLING, torch.device(device))
    name = {"c2i": preset, "t2i": f"{preset} T2I", "chameleon": "Anole-7B shape"}[kind]
    out = {"preset": name, "tree": tree, "dtype": str(dtype).removeprefix("torch."), "batch": batch}
    out["n_layer"] = config.n_layer
    cond, prefix = _conditions(model, kind, batch, device, dtype)
    for name, t in (("ar_step", ROOT_ONLY), ("verify", verify)):
        call, args = verify_call(model, t, batch, cond, prefix, filters, relax)
        out[f"kernels_{name}"] = kernels_per_call(call, args)
        for mode, run in step_runs(call, graphs, compile).items():
            metrics.reset()
            out[f"ms_{name}_{mode}"] = _timed(partial(run, *args), repeats, graphs)
            if mode == "compiled":  # its first warm-up call compiled it
                out[f"inductor_kernels_{name}"] = metrics.generated_kernel_count
        out[f"ms_{name}"] = out[f"ms_{name}_{'graphed' if graphs else 'eager'}"]  # the runtime's path
        if bandwidth:
            out[f"floor_ms_{name}"] = memory_floor_ms(model, batch, 128, bandwidth)
    with torch.device(device):
        drafter = Drafter(DrafterConfig.for_target(config), config).to(dtype).eval()
    capacity = drafter_capacity(config.cls_token_num, config.block_size)
    drafting = TorchDrafter(drafter, model.output, capacity, RunShape(batch), prefix=config.cls_token_num - 1)
    spec = Speculation(drafting, verify, RELAX, neighbors)
    target = TorchTarget(model, RunShape(batch, cache_windows=1))
    tokens = 8 if repeats < 10 else 128
    step_graphs = {} if graphs else None  # one CUDA graph per whole decode step
    steps = [0]

    def images() -> None:
        jobs = [
            (
                Condition(cond[[b, batch + b]], None if prefix is None else _rows(prefix, b, batch)),
                torch.Generator(device=device).manual_seed(b),
            )
            for b in range(batch)
        ]
        results = [r for _, r in decode_images(target, jobs, tokens, SAMPLING, spec, step_graphs)]
        steps[0] += max(len(r.accepted) for r in results)  # the batch steps until its last image is done

    images()  # capture
    steps[0] = 0
    seconds = _timed(images, 3, graphs) * 3 / 1e3
    out["ms_whole_step"] = seconds / (steps[0] / 2) * 1e3  # _timed ran 3 warm-up + 3 timed batches
    out["verify_over_ar_step"] = out["ms_verify"] / out["ms_ar_step"]
    out["whole_step_over_verify"] = out["ms_whole_step"] / out["ms_verify"]
    return out


def _conditions(
    model: Transformer, kind: str, batch: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CFG condition rows [2B, ...] and prefix visibility [2B, T] (None: all) of a step-cost
    row's ``batch`` images: class labels; a caption prefix, five sixths padding (t2i); a prompt
    with per-row padding (chameleon)."""
    config = model.config
    if kind == "chameleon":
        cond = torch.randint(config.text_vocab_size, (2 * batch, config.cls_token_num), device=device)
        slots = torch.arange(config.cls_token_num, device=device)
        prefix = torch.cat(
            [(slots >= 40).expand(batch, -1), (slots >= 62).expand(batch, -1)]
        )  # 24 and 2 tokens
        return cond, prefix
    if kind == "t2i":
        captions = torch.randn(batch, config.cls_token_num, config.caption_dim, device=device, dtype=dtype)
        cond = torch.cat([captions, model.null_condition.expand(batch, -1, -1)])
        padding = config.cls_token_num * 5 // 6  # 100 of LlamaGen's 120 slots: a 20-token prompt
        return cond, (torch.arange(config.cls_token_num, device=device) >= padding).expand(batch, -1)
    labels = torch.arange(batch, device=device) % config.num_classes
    return torch.cat([labels, torch.full_like(labels, config.num_classes)]), None


def window_costs(
    preset: str,
    tree: str,
    tau: float,
    device: str,
    dtype: torch.dtype,
    repeats: int,
    kind: str = "c2i",
    shape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A drafter-free window's verify (``tree``, e.g. a pac tree; acceptance included) against an
    AR step at B = 1 on the runtime's path (CUDA graphs on a GPU), random weights, and the
    speedup projected from them with the demo's measured ``tau`` (its Jacobi drafting, a few
    small tensor ops, left out): tau / (verify / AR step)."""
    config = _config(preset, kind, shape)
    with torch.device(device):
        model = Transformer(config).to(dtype).eval()
    graphs = device.startswith("cuda")
    vocab = config.vocab_size
    relax = relax_inputs(Relaxation("exact"), None, vocab, False, torch.device(device))
    filters = filter_inputs(SAMPLING, torch.device(device))
    cond, prefix = _conditions(model, kind, 1, device, dtype)
    name = {"c2i": preset, "t2i": f"{preset} T2I", "chameleon": "Anole-7B shape"}[kind]
    out: dict[str, Any] = {"preset": name, "tree": tree, "dtype": str(dtype).removeprefix("torch.")}
    for step, t in (("ar_step", ROOT_ONLY), ("verify", load_tree(tree))):
        call, args = verify_call(model, t, 1, cond, prefix, filters, relax)
        run = step_runs(call, graphs, compile=False)["graphed" if graphs else "eager"]
        out[f"ms_{step}"] = _timed(partial(run, *args), repeats, graphs)
    out["verify_over_ar_step"] = out["ms_verify"] / out["ms_ar_step"]
    out["tau"] = tau
    out["projected_speedup"] = tau / out["verify_over_ar_step"]
    return out


def verify_call(
    model: Transformer,
    tree: StaticTree,
    batch: int,
    cond: torch.Tensor,
    prefix: torch.Tensor | None,
    filters: FilterInputs,
    relax: RelaxInputs,
) -> tuple[Callable[..., tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """(call, args): one ``TorchTarget.verify`` of ``tree`` (``ROOT_ONLY``: an AR step) over
    ``model``, ``batch`` images prefilled with ``cond``/``prefix`` and their caches filled to 128
    entries, and random draft and noise inputs on the model's device."""
    device = model.output.weight.device
    vocab = model.config.vocab_size
    target = TorchTarget(model, RunShape(batch, cache_windows=1))
    target.prefill(cond, prefix)
    target.cache.length.fill_(128)  # half of LlamaGen's 256 image tokens

    def call(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(target.verify(tree, Draft(*a[:3]), a[3], a[4], filters, relax))

    s = tree.num_nodes + 1
    args = (
        torch.zeros(batch, s, dtype=torch.long, device=device),
        torch.ones(batch, s, dtype=torch.bool, device=device),
        torch.softmax(torch.randn(batch, s, vocab, device=device), -1),
        torch.rand(batch, s, device=device),
        torch.rand(batch, vocab, device=device),
    )
    return call, args


# Peak DRAM bandwidth by device name (a substring of torch.cuda.get_device_name()), bytes/s:
# vendors' data sheets. The first match wins: longer names first.
PEAK_BANDWIDTH: tuple[tuple[str, str, float], ...] = (
    ("H200", "H200", 4.8e12),
    ("H100 PCIe", "H100 PCIe", 2.0e12),
    ("H100 NVL", "H100 NVL", 3.9e12),
    ("H100", "H100 SXM", 3.35e12),
    ("A100-SXM4-80GB", "A100 80GB", 2.0e12),
    ("A100 80GB", "A100 80GB PCIe", 1.935e12),
    ("A100", "A100 40GB", 1.555e12),
    ("L40S", "L40S", 0.864e12),
    ("L40", "L40", 0.864e12),
    ("L4", "L4", 0.3e12),
    ("RTX 4090", "RTX 4090", 1.008e12),
    ("Orin", "Jetson Orin AGX", 0.2048e12),
)


def peak_bandwidth(device_name: str) -> tuple[str, float] | None:
    """(label, bytes/s) of the first :data:`PEAK_BANDWIDTH` entry in ``device_name``; None when
    the device is not in the table."""
    return next(((label, bw) for key, label, bw in PEAK_BANDWIDTH if key in device_name), None)


def step_bytes(model: Transformer, batch: int, cached: int) -> int:
    """Bytes one decode call must read at least (:mod:`lantern_rt.eval.memory_floor`'s rule):
    the weights of the layers, final norm and LM head (embedding tables are gathered, a few
    rows) and the K and V of ``cached`` committed entries (after the condition prefix) for each
    of the 2B CFG rows."""
    cfg = model.config
    kv = kv_entry_bytes(cfg, model.output.weight.element_size()) * 2 * batch * (cfg.cls_token_num + cached)
    return target_weight_bytes(model) + kv


def memory_floor_ms(model: Transformer, batch: int, cached: int, bandwidth: float) -> float:
    """:func:`step_bytes` over ``bandwidth`` bytes/s, in milliseconds."""
    return step_bytes(model, batch, cached) / bandwidth * 1e3


def step_runs(call: Callable[..., Any], cuda: bool, compile: bool = True) -> dict[str, Callable[..., Any]]:
    """``call`` (one that updates no state in place) as each mode runs it: eager, compiled
    (:class:`~lantern_rt.runtime.backends.compiled.Compiled`), and on CUDA replayed from CUDA
    graphs, eager (the runtime's default) and the compiled one captured."""
    runs: dict[str, Callable[..., Any]] = {"eager": call}
    compiled = Compiled(call) if compile else None
    if compiled:
        runs["compiled"] = compiled
    if cuda:
        runs["graphed"] = CudaGraphed(call)
        if compiled:
            runs["compiled_graphed"] = CudaGraphed(compiled)
    return runs


# Not kernels: views, metadata, allocation and casts that copy nothing (a real cast's copy_ counts).
NOT_KERNELS = frozenset(
    "as_strided view _unsafe_view _reshape_alias reshape expand expand_as view_as slice select "
    "unsqueeze squeeze transpose permute t alias detach split split_with_sizes unbind narrow chunk "
    "flatten unflatten movedim contiguous resolve_conj resolve_neg real to type_as _to_copy empty "
    "empty_strided empty_like new_empty zeros zeros_like ones ones_like dropout resize_ lift_fresh "
    "scalar_tensor _local_scalar_dense item".split()
)


def kernels_per_call(call: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> int:
    """Kernels one eager ``call(*args)`` launches (after a warm-up call), from torch.profiler:
    on CUDA the GPU kernels recorded; on a CPU the aten compute ops that call no other compute
    op (``NOT_KERNELS`` left out: ``linear`` counts as its ``mm``)."""
    call(*args)
    cuda = args[0].is_cuda
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        call(*args)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)

    def leaves(event: Any) -> int:
        below = sum(leaves(child) for child in event.cpu_children)
        name = event.name.removeprefix("aten::")
        is_kernel = event.name.startswith("aten::") and name not in NOT_KERNELS
        return below or int(is_kernel)

    return sum(leaves(e) for e in events if e.cpu_parent is None)


def inductor_kernels(call: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> tuple[int, float]:
    """(kernels inductor generates, seconds) for ``call(*args)`` compiled with fullgraph=True
    from a fresh dynamo state (``torch._inductor.metrics.generated_kernel_count``: C++ kernels
    on a CPU, Triton kernels on a GPU; library calls such as matmuls are not counted)."""
    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(call, fullgraph=True, backend="inductor", dynamic=False)(*args)
    return metrics.generated_kernel_count, time.perf_counter() - start


def llamagen_loop(
    model: Transformer, batch: int, compiled: bool, images: int | None = None
) -> dict[str, Any]:
    """LlamaGen's sampling loop (:func:`~lantern_rt.eval.baseline.torch_batched_ar`, sampled,
    class-conditional) over ``model`` at ``batch`` images per step, eager or ``compiled`` as
    LlamaGen's ``--compile`` (:class:`~lantern_rt.eval.baseline.CompiledLoopStep`): the first batch
    warms up (compiles), then ``images`` (default one batch) are timed. -> seconds of the first
    batch, milliseconds per decode step, images/s."""
    cfg = model.config
    step = CompiledLoopStep() if compiled else LoopStep()
    labels = [i % cfg.num_classes for i in range(images or batch)]
    start = time.perf_counter()
    torch_batched_ar(model, labels[:batch], SAMPLING, batch, 0, step)
    first = time.perf_counter() - start
    run = torch_batched_ar(model, labels, SAMPLING, batch, 1, step)
    steps = -(-len(labels) // batch) * cfg.block_size  # a prefill and block_size - 1 steps per batch
    return {
        "first_batch_s": first,
        "ms_per_step": run.seconds / steps * 1e3,
        "images_per_s": len(labels) / run.seconds,
    }


def llamagen_rows(
    models: list[tuple[str, Transformer]], batches: list[int], compile: bool = True
) -> list[dict[str, Any]]:
    """:func:`llamagen_loop` eager and (``compile``) compiled, for each (name, model) and batch."""
    rows = []
    for name, model in models:
        for batch in batches:
            for compiled in (False, True) if compile else (False,):
                loop = llamagen_loop(model, batch, compiled)
                rows.append({"model": name, "batch": batch, "compiled": compiled, **loop})
    return rows


def _rows(prefix: torch.Tensor, b: int, batch: int) -> torch.Tensor:
    """Image ``b``'s visible prefix slots: [T] (both rows alike) or its two rows of [2B, T]."""
    return prefix[[b, batch + b]] if prefix.shape[0] == 2 * batch else prefix[b]


def _timed(fn: Any, repeats: int, cuda: bool) -> float:
    """Milliseconds per call of ``fn`` after three warm-up calls."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def report(result: dict[str, Any]) -> str:
    lines = [f"# GPU check ({result['device_name']})", "", "## Demo", ""]
    lines += [
        "| path | method | tree | s/img | tau | speedup vs AR | greedy agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["demo"]:
        lines.append(
            f"| {r['path']} | {r['method']} | {r['tree'] or ''} | {r['s_per_image']:.4f} | {r['tau']:.2f} | "
            f"{r['speedup_vs_ar']:.2f}x | {r['greedy_agreement_vs_first_path']:.3f} |"
        )
    lines += sized_report(result.get("sized", []), result.get("llamagen", []), result.get("sized_bandwidth"))
    lines += tune_report_lines(result.get("tune", []))
    lines += ["", "## Step costs, acceptance included (random weights, sampled LANTERN++)", ""]
    lines += [
        "| preset | dtype | tree | B | ms AR step | ms verify | verify / AR | ms whole step | whole / verify |"
        " projected AR img/s | projected LANTERN++ img/s | projected speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["step_costs"]:
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['tree']} | {r['batch']} | {r['ms_ar_step']:.3f} | "
            f"{r['ms_verify']:.3f} | {r['verify_over_ar_step']:.2f} | {r['ms_whole_step']:.3f} | "
            f"{r['whole_step_over_verify']:.2f} | {r['projected_ar_images_per_s']:.1f} | "
            f"{r['projected_lantern_images_per_s']:.1f} | {r['projected_speedup']:.2f}x |"
        )
    lines += [
        "",
        f"Projections (not measurements): {PROJECTED_TOKENS} tokens per image, AR at one token per "
        f"AR step, LANTERN++ at the demo's measured tau ({result['projection_tau']:.2f}) tokens per "
        "whole step, B images per call.",
    ]
    lines += window_report(result.get("window_costs", []))
    lines += step_mode_report(result) + llamagen_report(result.get("llamagen", []))
    return "\n".join(lines)


def bandwidth_label(peak: tuple[str, float] | None, bandwidth: float | None) -> str:
    """What the sized rows' floors are taken at, in words."""
    if peak is not None:
        return f"the {peak[0]}'s peak bandwidth, {peak[1] / 1e12:.4g} TB/s"
    return (
        "an unknown bandwidth (no floors)"
        if bandwidth is None
        else f"a copy loop's {bandwidth / 1e9:.2f} GB/s"
    )


def _cell(value: float | None, spec: str = ".4f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def sized_name(size: str) -> str:
    """The name of a sized model's rows in the LlamaGen-loop table."""
    return f"{size} (demo widened)"


def sized_report(rows: list[dict[str, Any]], loops: list[dict[str, Any]], bandwidth: Any) -> list[str]:
    """The sized models' table (:func:`sized_rows`) and, per size, its fastest row against
    LlamaGen's loop over the same weights at B = 1 (``loops``: :func:`llamagen_rows`)."""
    if not rows:
        return []
    lines = [
        "",
        "## The demo at LlamaGen's sizes: measured (the demo's weights widened, its tokens and acceptance;"
        " torch, fp32, B = 1)",
        "",
        "| size | path | method | tree | images | s/img | tau | speedup vs AR | floor s/img | measured / floor |"
        " greedy = demo |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['path']} | {r['method']} | {r['tree'] or ''} | {r['images']} | "
            f"{r['s_per_image']:.4f} | {r['tau']:.2f} | {r['speedup_vs_ar']:.2f}x | {_cell(r['floor_s_per_image'])} | "
            f"{_cell(r['measured_over_floor'], '.2f', 'x')} | {'yes' if r['greedy_equal_to_demo'] else 'NO'} |"
        )
    seconds = {(r["model"], r["compiled"]): r["batch"] / r["images_per_s"] for r in loops if r["batch"] == 1}
    lines += [
        "",
        f"Floor: the bytes an image's calls read (lantern_rt/eval/memory_floor.py) over {bandwidth}.",
        "",
        "| size | fastest row | s/img | LlamaGen's loop eager s/img | speedup | compiled s/img | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in dict.fromkeys(r["size"] for r in rows):
        best = min((r for r in rows if r["size"] == size), key=lambda r: r["s_per_image"])
        cells = [
            f"{best['path']} {best['method']} {best['tree'] or ''}".strip(),
            f"{best['s_per_image']:.4f}",
        ]
        for compiled in (False, True):
            loop = seconds.get((sized_name(size), compiled))
            cells += ["-", "-"] if loop is None else [f"{loop:.4f}", f"{loop / best['s_per_image']:.2f}x"]
        lines.append(f"| {size} | {' | '.join(cells)} |")
    return lines


def window_report(rows: list[dict[str, Any]]) -> list[str]:
    """The drafter-free window table: a pac tree's verify against an AR step, and the speedup
    projected with the demo's tau (:func:`window_costs`)."""
    if not rows:
        return []
    lines = ["", "## Drafter-free window: a pac tree's verify vs an AR step (B = 1, exact sjd)", ""]
    lines += [
        "| preset | dtype | tree | ms AR step | ms verify | verify / AR | demo tau | projected speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['tree']} | {r['ms_ar_step']:.3f} | {r['ms_verify']:.3f} | "
            f"{r['verify_over_ar_step']:.2f} | {r['tau']:.2f} | {r['projected_speedup']:.2f}x |"
        )
    lines += ["", "Projected speedup = tau / (verify / AR step): a projection, drafting left out."]
    return lines


MODES = ("eager", "compiled", "graphed", "compiled_graphed")


def step_mode_report(result: dict[str, Any]) -> list[str]:
    """The step-mode table: ms per mode, memory floor, kernels per call and per layer."""
    bw = result.get("bandwidth")
    lines = ["", "## Step modes, memory floors and kernels per call", ""]
    lines.append(
        "Peak bandwidth: "
        + (f"{bw['label']} {bw['bytes_per_s'] / 1e12:.4g} TB/s" if bw else "unknown device: no floors")
        + " (table: "
        + ", ".join(f"{label} {b / 1e12:.4g}" for _, label, b in PEAK_BANDWIDTH)
        + " TB/s). Floor: weight and KV bytes read once at that bandwidth."
    )
    lines += [
        "",
        "| preset | B | step | ms eager | ms compiled | ms graphed | ms compiled+graphed | ms floor | best / floor |"
        " kernels/call | kernels/layer | inductor kernels/layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["step_costs"]:
        for step in ("ar_step", "verify"):
            times = [r.get(f"ms_{step}_{m}") for m in MODES]
            floor = r.get(f"floor_ms_{step}")
            best = min(t for t in times if t is not None)
            inductor = r.get(f"inductor_kernels_{step}")
            per_layer = "-" if inductor is None else f"{inductor / r['n_layer']:.1f}"
            cells = [f"{t:.3f}" if t is not None else "-" for t in times]
            lines.append(
                f"| {r['preset']} | {r['batch']} | {step} | {' | '.join(cells)} | "
                f"{f'{floor:.3f}' if floor else '-'} | {f'{best / floor:.1f}x' if floor else '-'} | "
                f"{r[f'kernels_{step}']} | {r[f'kernels_{step}'] / r['n_layer']:.1f} | "
                f"{per_layer} |"
            )
    lines += [
        "",
        "Kernels/call: GPU kernels (torch.profiler) on a GPU; on a CPU aten compute ops (views, "
        "allocations and no-op casts left out). Inductor kernels: what torch.compile generated "
        "(C++ or Triton; library matmuls not counted).",
    ]
    return lines


def llamagen_report(rows: list[dict[str, Any]]) -> list[str]:
    """The GPU peer's table: LlamaGen's loop, eager and compiled, per model and batch."""
    if not rows:
        return []
    lines = [
        "",
        "## LlamaGen's own loop: the peer (torch.compile mode reduce-overhead, fullgraph, as its --compile)",
        "",
        "| model | B | compiled | first batch s (compile) | ms/step | images/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {'yes' if r['compiled'] else 'no'} | "
            f"{r['first_batch_s']:.1f} | {r['ms_per_step']:.3f} | {r['images_per_s']:.2f} |"
        )
    return lines


PROJECTED_TOKENS = 256  # LlamaGen's 256x256 images: a 16 x 16 grid


def with_projection(costs: dict[str, Any], tau: float) -> dict[str, Any]:
    """``costs`` with images/s projected from its step costs and the demo's ``tau``."""
    b, ar, whole = costs["batch"], costs["ms_ar_step"], costs["ms_whole_step"]
    ar_rate = b / (PROJECTED_TOKENS * ar / 1e3)
    lantern_rate = b / (PROJECTED_TOKENS / tau * whole / 1e3)
    return {
        **costs,
        "projected_ar_images_per_s": ar_rate,
        "projected_lantern_images_per_s": lantern_rate,
        "projected_speedup": lantern_rate / ar_rate,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="Tiny sizes: a smoke run on any machine.")
    parser.add_argument("--no-compile", action="store_true", help="No torch.compile modes (faster).")
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=240.0,
        help="Seconds into the run after which no new compiled mode starts (keeps a run under 8 min).",
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="The demo widened to these sizes (lantern_rt.sized_demo), comma-separated, in order; '' for "
        "none. Default: GPT-XL,GPT-L (tiny with --quick).",
    )
    parser.add_argument(
        "--sizes-budget",
        type=float,
        default=150.0,
        help="Seconds into the run after which no further size starts (the first always runs).",
    )
    parser.add_argument(
        "--tune-budget",
        type=float,
        default=270.0,
        help="Seconds into the run after which no further sized model is tuned (the first always is).",
    )
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name() if cuda else "cpu"
    found = peak_bandwidth(name)
    bw = found[1] if found else None
    started = time.perf_counter()
    default_sizes = "tiny" if args.quick else "GPT-XL,GPT-L"
    sizes = [s for s in (default_sizes if args.sizes is None else args.sizes).split(",") if s]
    builder = prebuild(sizes[0]) if sizes and not args.quick else None  # built while the demo runs

    def compile_now() -> bool:
        """Whether to run compiled modes still: compiles cost tens of seconds each, and the
        whole check must end within ``--compile-budget`` seconds of compiling (later ones skipped)."""
        return not args.no_compile and time.perf_counter() - started < args.compile_budget

    labels = [0, 1] if args.quick else list(range(5))
    presets = ["GPT-B"] if args.quick else ["GPT-XL"]
    batches = [1, 2] if args.quick else [1, 4, 16]
    demo = demo_rows(args.device, labels)
    tau = next(r["tau"] for r in demo if r["method"] == "lantern++")  # the first path's: the GPU's on a GPU
    # the sized rows' floors: at the device's peak bandwidth on a GPU (none off the table), a copy loop's on a CPU
    sized_bw = bw if cuda else copy_bandwidth(torch.get_num_threads()).bytes_per_s
    sized_labels = [0] if args.quick else [0, 1, 2]
    sized, measured, reference = [], [], {}
    for i, size in enumerate(sizes):
        if i and time.perf_counter() - started > args.sizes_budget:
            print(f"{size}: skipped (--sizes-budget {args.sizes_budget:g} s spent)", file=sys.stderr)
            continue
        sized += sized_rows(size, args.device, sized_labels, sized_labels[:1], sized_bw, reference)
        measured.append(size)
    tunes = []
    for i, size in enumerate(measured):
        if i and time.perf_counter() - started > args.tune_budget:
            print(f"{size}: not tuned (--tune-budget {args.tune_budget:g} s spent)", file=sys.stderr)
            continue
        tunes.append(tune_size(size, args.device, args.quick))
        if cuda:  # the next model loads beside nothing of this one's
            gc.collect()
            torch.cuda.empty_cache()
    if builder is not None:
        builder.wait()
    # LlamaGen's loop over the demo and each sized model measured (fp32, the same weights), one at a time
    peers = [("demo", DEMO_DIR)] + [(sized_name(size), sized_model_dir(size)) for size in measured]
    llamagen = []
    for peer, root in peers:
        model = load_target(open_model_dir(root), args.device)
        llamagen += llamagen_rows([(peer, model)], [1], compile_now())
        del model
    dtype = torch.float16 if cuda else torch.float32
    repeats = 2 if args.quick else 50
    costs = [  # compiled modes at B = 1 only, the largest shape first: each compile costs tens of seconds
        step_costs(
            p,
            GPU_DEFAULT_TREE,
            args.device,
            dtype,
            repeats,
            b,
            compile=b == 1 and compile_now(),
            bandwidth=bw,
        )
        for p in reversed(presets)
        for b in batches
    ]
    costs += [
        step_costs(
            presets[-1],
            GPU_DEFAULT_TREE,
            args.device,
            dtype,
            repeats,
            1,
            text=True,
            compile=False,
            bandwidth=bw,
        )
    ]
    if cuda and not args.quick:  # 14 GB of fp16 weights: a GPU row only
        costs += [
            step_costs(
                "",
                GPU_DEFAULT_TREE,
                args.device,
                dtype,
                repeats,
                1,
                kind="chameleon",
                compile=False,
                bandwidth=bw,
            )
        ]
    kinds = [(presets[-1], "c2i")] + ([("", "chameleon")] if cuda and not args.quick else [])
    windows = [window_costs(p, PAC_TREE, PAC_TAU, args.device, dtype, repeats, kind) for p, kind in kinds]
    result = {
        "device": args.device,
        "device_name": name,
        "bandwidth": {"label": found[0], "bytes_per_s": bw} if found else None,
        "sized_bandwidth": bandwidth_label(found, sized_bw),
        "sized": sized,
        "tune": tunes,
        "llamagen": llamagen,
        "torch": torch.__version__,
        "demo": demo,
        "projection_tau": tau,
        "step_costs": [with_projection(c, tau) for c in costs],
        "window_costs": windows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    text = report(result)
    (args.out / "gpu_check.md").write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
