"""The ``lantern`` command line."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from lantern_rt.errors import OneLineErrors, UserError, reports_errors, warn
from lantern_rt.fileio import check_writable
from lantern_rt.prompt_files import read_prompts
from lantern_rt.settings import (
    BACKENDS,
    CACHE_WINDOWS,
    CPU_DEFAULT_TREE,
    DEFAULT_WINDOW,
    GPU_DEFAULT_TREE,
    MAX_BATCH_SIZE,
    MAX_IMAGES_PER_CLASS,
    MAX_SEED,
    METHODS,
    run_request,
)

SEED = click.IntRange(min=0, max=MAX_SEED)
IMAGES_PER_CLASS = click.IntRange(min=1, max=MAX_IMAGES_PER_CLASS)

if TYPE_CHECKING:  # the command line imports its work lazily, for a fast --help
    pass


def _source(model_path: Path | None, bundle: Path | None, backend: str | None, drafter_path: Path | None):
    """(model info, what to build the pipeline from: a model directory or the opened bundle)."""
    from lantern_rt.generate import open_source

    if bundle is not None and drafter_path is not None:
        raise UserError("--bundle runs an exported bundle with its own drafter: drop --drafter")
    if bundle is not None and backend == "torch":
        raise UserError("a bundle runs on onnxruntime or tensorrt: drop --backend torch or --bundle")
    return open_source(model_path, bundle)


model_option = click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory (config.json + weights). Default: the built-in Fashion-MNIST demo.",
)


def run_options(command: Callable) -> Callable:
    """The options ``generate`` and ``generate-set`` share: what to make and how (classes and
    counts, sampling, method, backend, device, batch size), resolved by ``settings.run_request``."""
    for option in reversed(_RUN_OPTIONS):
        command = option(command)
    return command


_RUN_OPTIONS = [
    click.option(
        "--class",
        "--classes",
        "classes",
        multiple=True,
        help="Class ids or names, comma-separated or repeated. Default: every class.",
    ),
    click.option(
        "--num-images",
        "-n",
        type=IMAGES_PER_CLASS,
        default=4,
        show_default=True,
        help="Images per class.",
    ),
    click.option(
        "--cfg-scale",
        type=float,
        default=None,
        help="Classifier-free guidance scale s in u + s*(c - u). Default: the model's (3.0 for the demo).",
    ),
    click.option(
        "--temperature",
        type=float,
        default=1.0,
        show_default=True,
        help="Sampling temperature; 0 means greedy.",
    ),
    click.option(
        "--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = off)."
    ),
    click.option(
        "--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass in (0, 1]."
    ),
    click.option("--greedy", is_flag=True, help="Greedy decoding (same as --temperature 0)."),
    click.option(
        "--seed",
        type=SEED,
        default=0,
        show_default=True,
        help="Random seed; the same seed and settings give the same tokens.",
    ),
    click.option(
        "--method",
        type=click.Choice(METHODS),
        default=None,
        help="Decoding method: plain autoregressive, exact speculative, or relaxed (LANTERN, LANTERN++); "
        "sjd and sjd++ need no drafter: a Jacobi window drafted from the target's own distributions, exact "
        "or with LANTERN++'s neighbour credit. Default: lantern++ when the model has a drafter, else ar.",
    ),
    click.option(
        "--tree",
        default=None,
        help="Static draft tree: naive_extend_57, mc_sim_7b_63, chain-N, or a JSON file of paths. Default: "
        f"the bundle's first tree with --bundle, else {CPU_DEFAULT_TREE} on a CPU (a tree's cost grows with "
        f"its size there; measured best in BENCHMARKS.md), {GPU_DEFAULT_TREE} on a GPU (tensorrt, or a CUDA --device).",
    ),
    click.option(
        "--window",
        type=int,
        default=None,
        help=f"Draft positions per step of --method sjd or sjd++ (a chain of N; a bundle needs 'lantern export "
        f"--tree chain-N'). Default: {DEFAULT_WINDOW}.",
    ),
    click.option(
        "--lantern-k", type=int, default=10, show_default=True, help="Latent neighbours per drafted token."
    ),
    click.option(
        "--lantern-delta", type=float, default=0.1, show_default=True, help="LANTERN TV budget in [0, 1]."
    ),
    click.option(
        "--lantern-lambda", type=float, default=5.0, show_default=True, help="LANTERN++ cap lambda >= 1."
    ),
    click.option(
        "--backend",
        type=click.Choice(BACKENDS),
        default=None,
        help="Runtime backend. Default on a CPU: onnxruntime (a model directory is exported once into "
        "$LANTERN_CACHE or ~/.cache/lantern-rt); torch for another --device or a --drafter override. "
        "tensorrt runs a bundle's plans from 'lantern build-engines'.",
    ),
    click.option(
        "--cuda-graphs/--no-cuda-graphs",
        default=True,
        show_default=True,
        help="Replay each step from a captured CUDA graph (torch on a CUDA --device, tensorrt).",
    ),
    click.option(
        "--bundle",
        type=click.Path(path_type=Path),
        default=None,
        help="Run an exported bundle (from 'lantern export') on onnxruntime instead of a model directory.",
    ),
    click.option("--device", default="cpu", show_default=True, help="torch device for the torch backend."),
    click.option(
        "--threads",
        type=click.IntRange(min=0),
        default=0,
        help="CPU threads (0: the library default; generate-set: per worker, 1 per Ray actor by default).",
    ),
    click.option(
        "--batch-size",
        type=click.IntRange(min=1, max=MAX_BATCH_SIZE),
        default=1,
        show_default=True,
        help="Images decoded together per step; the tokens do not depend on it (a bundle must hold graphs for it: lantern export --batch-size).",
    ),
]


def prompt_options(command: Callable) -> Callable:
    """``--prompt`` and ``--prompts``, for text-to-image models (read by :func:`_prompts`)."""
    command = click.option(
        "--prompts",
        "prompts_file",
        type=click.Path(path_type=Path),
        default=None,
        help="Text file of prompts, one per line (UTF-8; blank lines skipped), for a text-to-image or Chameleon-family model.",
    )(command)
    return click.option(
        "--prompt",
        "prompt_texts",
        multiple=True,
        help="A prompt for a text-to-image or Chameleon-family model (repeatable). Prompts over the "
        "model's prompt length (120 T5 tokens for LlamaGen, the config's prompt.tokens for Anole "
        "and Lumina-mGPT) are truncated with a warning.",
    )(command)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lantern-rt")
def main() -> None:
    """lantern-rt: fast LANTERN++ speculative decoding for visual autoregressive models."""


@main.command()
@model_option
@run_options
@prompt_options
@click.option(
    "--drafter",
    "drafter_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Drafter folder (EAGLE layout: config.json + weights). Default: the model's own.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="NVTX ranges around prefill, draft, verify (with acceptance), KV compaction and VQ decode, and "
    "cudaProfilerStart/Stop around the images after the first (see README: nsys).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=Path("lantern.png"),
    show_default=True,
    help="PNG grid, one row per class (or prompt).",
)
@click.option(
    "--save-tokens",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the tokens: an int64 .npy array [images, tokens], or a .npz with 'codes' and "
    "'labels' (class ids) or 'prompts', the training data of 'lantern train-drafter --codes'.",
)
@click.option(
    "--stats-json",
    type=click.Path(path_type=Path),
    default=None,
    help="Write timings and acceptance statistics as JSON ('-': to standard output).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@reports_errors
def generate(
    model_path,
    classes,
    prompt_texts,
    prompts_file,
    num_images,
    cfg_scale,
    temperature,
    top_k,
    top_p,
    greedy,
    seed,
    method,
    tree,
    window,
    lantern_k,
    lantern_delta,
    lantern_lambda,
    drafter_path,
    backend,
    cuda_graphs,
    profile,
    bundle,
    device,
    threads,
    output,
    save_tokens,
    stats_json,
    batch_size,
    quiet,
):
    """Generate images and write them as a PNG grid (one row per class, or per prompt for a
    text-to-image model)."""
    t0 = time.perf_counter()

    from lantern_rt.fileio import write_together
    from lantern_rt.generate import generate as run
    from lantern_rt.generate import make_pipeline
    from lantern_rt.images import grid, write_png
    from lantern_rt.training import codes_files

    if threads:
        import torch

        torch.set_num_threads(threads)
    md, source = _source(model_path, bundle, backend, drafter_path)
    stats_out = None if stats_json is None or str(stats_json) == "-" else stats_json  # "-": stdout
    files = [p for p in (output, save_tokens, stats_out) if p is not None]
    if len({p.absolute() for p in files}) < len(files):
        raise UserError("-o, --save-tokens and --stats-json must name different files")
    for path, what in ((output, "image"), (save_tokens, "tokens"), (stats_out, "stats")):
        check_writable(path, what)
    if save_tokens is not None and save_tokens.suffix not in (".npy", ".npz"):
        raise UserError(f"--save-tokens must end in .npy or .npz, got {save_tokens}")
    request = run_request(
        md,
        source,
        classes=classes,
        prompts=read_prompts(prompt_texts, prompts_file),
        cfg_scale=cfg_scale,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        method=method,
        tree=tree,
        window=window,
        backend=backend,
        device=device,
        k=lantern_k,
        delta=lantern_delta,
        lam=lantern_lambda,
        drafter=None if drafter_path is None else str(drafter_path),
    )
    class_ids, sampling, mc = request.conditions, request.sampling, request.method
    labels = [c for c in class_ids for _ in range(num_images)]
    pipe = make_pipeline(
        source, request.settings.backend, mc, device, threads, cuda_graphs, batch_size, sampling.guided
    )
    result = run(pipe, labels, sampling, seed=seed, progress=not quiet, profile=profile)
    image = grid(result.images, rows=len(class_ids), scale=max(1, 64 // md.image_size))
    stats = result.stats
    stats.total_seconds = time.perf_counter() - t0
    stats.extra["output"] = str(output)
    body = json.dumps(stats.to_json(), indent=2) + "\n"
    writes = {output: lambda tmp: write_png(image, tmp)}  # all or none of them (write_together)
    if save_tokens is not None:
        writes[save_tokens] = lambda tmp: codes_files.write_codes_file(
            tmp, result.tokens.numpy(), result.labels
        )
    if stats_out is not None:
        writes[stats_out] = lambda tmp: tmp.write_text(body)
    write_together(writes)
    if stats_json is not None and stats_out is None:
        click.echo(body, nl=False)
    per_image = stats.decode_seconds / max(1, stats.num_images)
    click.echo(
        f"{stats.num_images} images ({mc.method}, {pipe.backend}) in {stats.total_seconds:.1f}s: "
        f"{per_image:.3f}s/image decode, mean accepted length {stats.mean_accepted_length:.2f} -> {output}",
        err=True,
    )


@main.command("generate-set")
@model_option
@run_options
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="Folder for the shards (shard-FIRST-LAST.npz), settings.json and summary.json; rerun to resume.",
)
@click.option(
    "--unit-size",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Images per work unit and shard (within one class).",
)
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    help="Run on Ray: --ray alone starts a local cluster for the run, --ray auto (or an address) "
    "joins one. Default: one local process, no Ray.",
)
@click.option(
    "--actors",
    type=click.IntRange(min=1),
    default=None,
    help="Ray actors, one pipeline each. Default: one per GPU (CUDA device), else one per CPU.",
)
@click.option(
    "--fid-npz",
    type=click.Path(path_type=Path),
    default=None,
    help="Also write every image as one uint8 array 'arr_0' (.npz), as LlamaGen's and ADM's FID evaluators read.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@reports_errors
def generate_set_cmd(
    model_path,
    out,
    classes,
    num_images,
    cfg_scale,
    temperature,
    top_k,
    top_p,
    greedy,
    seed,
    method,
    tree,
    window,
    lantern_k,
    lantern_delta,
    lantern_lambda,
    backend,
    bundle,
    device,
    threads,
    cuda_graphs,
    batch_size,
    unit_size,
    ray_address,
    actors,
    fid_npz,
    quiet,
):
    """Generate a labelled image set as shards, locally or on Ray; image for image what
    'lantern generate' gives with the same classes, -n, seed and settings."""
    from lantern_rt.image_sets import generate_set, import_ray, set_job

    if ray_address is not None:
        import_ray()  # before any work: the install hint, not a traceback
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if fid_npz is not None:
        if fid_npz.suffix != ".npz":
            raise UserError(f"--fid-npz must end in .npz, got {fid_npz}")
        try:
            fid_npz.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create folder {fid_npz.parent} for --fid-npz: {exc.strerror}") from None
        check_writable(fid_npz, "FID images")
    md, source = _source(model_path, bundle, backend, None)
    if md.gpt.takes_prompts:
        raise UserError(
            "generate-set makes class-conditional image sets; for prompts use 'lantern generate --prompts'"
        )
    request = run_request(
        md,
        source,
        classes=classes,
        prompts=(),
        cfg_scale=cfg_scale,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        greedy=greedy,
        method=method,
        tree=tree,
        window=window,
        backend=backend,
        device=device,
        k=lantern_k,
        delta=lantern_delta,
        lam=lantern_lambda,
    )
    job, digest = set_job(model_path, source, request, seed, device, threads, cuda_graphs, batch_size)
    summary = generate_set(
        out, job, digest, request.conditions, num_images, unit_size, ray_address, actors, fid_npz, not quiet
    )
    rate = summary["images_per_second"]
    click.echo(
        f"{summary['images']} images in {summary['shards']} shards ({summary['made_this_run']} made now, "
        f"{summary['mode']}, {summary['workers']} worker(s), "
        f"{'-' if rate is None else f'{rate:.2f}'} images/s, tau {summary['tau']:.2f}) -> {out}",
        err=True,
    )


@main.command("train-drafter")
@model_option
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="Folder for the drafter (config.json + drafter.safetensors) and its resumable training state.",
)
@click.option(
    "--codes",
    type=click.Path(path_type=Path),
    multiple=True,
    help="Training data: .npz with 'codes' [N, tokens] and 'labels' [N] (class ids), or for a "
    "Chameleon-family model 'prompts' [N] (strings) instead of 'labels', as 'lantern generate "
    "--save-tokens' writes them; repeat it to train on several files together. Default: "
    "Fashion-MNIST encoded by the model's tokenizer (class-conditional demo-sized models only).",
)
@click.option("--steps", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--cfg-scale",
    type=click.FloatRange(min=0),
    default=None,
    help="Train on (condition, unconditional) row pairs of every image and score the distribution "
    "mixed at this guidance scale, the one drafts are drawn from (the demo samples at 3.0). "
    "Default: single rows, 10%% of them unconditional (the null class, or the prompt's "
    "unconditional row).",
)
@click.option(
    "--unroll",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Levels the drafter is scored at: 1 is teacher-forced (EAGLE-1); d also feeds it its own "
    "predictions d - 1 levels deep, as it drafts a tree (HASS/EAGLE-3 training-time test; "
    "each level costs about one more drafter forward).",
)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads.")
@reports_errors
def train_drafter_cmd(model_path, out, codes, steps, batch, lr, seed, cfg_scale, unroll, threads):
    """Train the EAGLE drafter of a model (resumes from OUT/train_state.pt).

    A Chameleon-family model (Anole) trains on --codes files of image codes and their prompts
    ('codes' and 'prompts', as 'lantern generate --prompts FILE --save-tokens codes.npz' writes
    them); a LlamaGen text-to-image model is refused.

    To fine-tune a trained drafter on other codes (e.g. the target's own samples from
    'lantern generate --method exact --save-tokens codes.npz': exact speculative decoding draws
    from the target's distribution, faster than --method ar), copy its train_state.pt into OUT
    and give a larger --steps: training resumes at the saved step on the new data, with the
    learning-rate schedule of the new total."""
    import numpy as np
    import torch

    from lantern_rt.families.loading import load_target, open_model_dir
    from lantern_rt.fileio import write_together
    from lantern_rt.models.checkpoint import save_safetensors
    from lantern_rt.models.drafter import Drafter, DrafterConfig
    from lantern_rt.training.codes_files import drafter_training_data
    from lantern_rt.training.drafter import DrafterTraining, train_drafter

    if threads:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    for option, value in (("--lr", lr), ("--cfg-scale", cfg_scale)):
        if value is not None and not math.isfinite(value):
            raise UserError(f"{option} must be a finite number, got {value}")
    md = open_model_dir(model_path)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    # every input checked (the prompts tokenized too) before --out is created
    train_codes, conditions = drafter_training_data(md, codes, warn)
    target = load_target(md)
    config = DrafterConfig.for_target(md.gpt)
    drafter = Drafter(config, md.gpt)
    cfg = DrafterTraining(steps=steps, batch=batch, lr=lr, seed=seed, cfg_scale=cfg_scale, unroll=unroll)
    try:  # only now that every input is checked: a failed run leaves no empty --out behind
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out {out}: {exc.strerror or exc}") from None
    t0 = time.perf_counter()
    losses = train_drafter(target, drafter, train_codes, conditions, cfg, out / "train_state.pt")
    body = json.dumps(dataclasses.asdict(config), indent=2) + "\n"
    write_together(  # the weights and their config, both or neither
        {
            out / "drafter.safetensors": lambda tmp: save_safetensors(drafter, tmp),
            out / "config.json": lambda tmp: tmp.write_text(body),
        }
    )
    tail = np.mean(losses[-50:]) if losses else float("nan")
    click.echo(
        f"drafter trained for {steps} steps in {time.perf_counter() - t0:.0f}s (final loss {tail:.4f}) -> {out}",
        err=True,
    )


@main.command("export")
@model_option
@click.option(
    "--tree",
    "trees",
    multiple=True,
    default=(GPU_DEFAULT_TREE,),
    show_default=True,
    help="Static tree(s) to export verify/draft graphs for (repeatable): preset, chain-N or JSON file.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="Bundle folder to write (written to a temporary folder, then renamed).",
)
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset (17..20).")
@click.option(
    "--batch-size",
    "batch_sizes",
    default="1",
    show_default=True,
    help="Images per call the step graphs are exported for, comma-separated (e.g. 1,8); the "
    "graphs of every size share one weights file.",
)
@click.option(
    "--cache-windows",
    "windows",
    type=int,
    default=CACHE_WINDOWS,
    show_default=True,
    help="Target step graphs per batch size, each reading a window of the KV cache's first slots "
    "(a step reads the smallest that holds the batch's longest image); 1: the whole cache only.",
)
@click.option(
    "--no-guidance",
    is_flag=True,
    help="Graphs of one row per image instead of two (the conditional row alone): half the work, "
    "for --cfg-scale 1 (or below) only.",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@reports_errors
def export_cmd(model_path, trees, out, dtype, opset, batch_sizes, windows, no_guidance, force, quiet):
    """Export fixed-shape ONNX graphs and a manifest (the bundle), each checked against torch."""
    from lantern_rt.export.bundle import export_bundle
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
    from lantern_rt.runtime.tree import load_tree

    t0 = time.perf_counter()
    md = open_model_dir(model_path)
    parsed = [load_tree(t, max_width=MAX_DRAFT_WIDTH) for t in trees]
    sizes = _batch_sizes(batch_sizes)
    export_bundle(
        md,
        out,
        trees=parsed,
        dtype=dtype,
        opset=opset,
        overwrite=force,
        progress=not quiet,
        batch_sizes=sizes,
        windows=windows,
        guided=not no_guidance,
    )
    rows = "one row per image, no guidance" if no_guidance else "two CFG rows per image"
    click.echo(
        f"exported {md.name} ({dtype}, opset {opset}, trees {', '.join(trees)}, batch sizes "
        f"{','.join(map(str, sizes))}, {windows} cache window(s), {rows}) in {time.perf_counter() - t0:.0f}s -> {out}",
        err=True,
    )


def _batch_sizes(text: str) -> list[int]:
    """``--batch-size 1,8`` -> [1, 8]; :class:`UserError` for anything else."""
    from lantern_rt.settings import check_batch_sizes

    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--batch-size takes comma-separated integers such as 1,8, got {text!r}") from None
    return check_batch_sizes(sizes)


@main.command("inspect")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--graph", default=None, help="Also show polygraphy's view of this graph (needs the trt extra)."
)
@reports_errors
def inspect_cmd(bundle, graph):
    """Print a bundle's manifest as a readable table (after verifying its hashes)."""
    from lantern_rt.bundle import FORMAT, MANIFEST
    from lantern_rt.families.loading import open_bundle
    from lantern_rt.families.registry import family_named

    b = open_bundle(bundle)
    entry = b.graph(graph) if graph is not None else None  # before printing: an unknown name fails
    c = b.constants
    click.echo(f"bundle   {bundle}  (format {FORMAT} v{b.format_version})")
    click.echo(
        f"model    {b.model_name}: {c.model_type}, dim {b.gpt.dim}, {b.gpt.n_layer} layers, vocab {c.vocab_size}, {c.block_size} tokens"
    )
    click.echo(
        f"export   {b.dtype}, opset {b.opset}, " + ", ".join(f"{k} {v}" for k, v in b.versions.items())
    )
    files = [b.path / name for name in (*b.files, MANIFEST)]
    size = sum(f.stat().st_size for f in files)
    click.echo(f"size     {size / 2**20:.1f} MiB on disk in {len(files)} files (TensorRT plans not counted)")
    rows = "2 CFG rows per image" if c.guided else "1 row per image (no guidance: --cfg-scale 1 only)"
    click.echo(f"batches  {', '.join(map(str, c.batch_sizes))} image(s) per call, {rows}")
    click.echo(
        f"cache    {c.cache_capacity} slots, read through windows of {', '.join(map(str, c.cache_windows))}"
    )
    for line in family_named(b.family).describe_bundle(b):
        click.echo(line)
    for name, tree in b.trees.items():
        drafted = f", drafted by {tree.graph}" if tree.graph else ""
        drafted += f", verified by {tree.verify}" if tree.verify else ""
        drafted += " (a Jacobi window: --method sjd)" if tree.verify and not tree.graph else ""
        click.echo(f"tree     {name}: {len(tree.paths)} nodes{drafted}")
    click.echo("")
    click.echo(f"{'graph':<22} {'io':<4} {'name':<12} {'dtype':<9} shape")
    for name, g in b.graphs.items():
        for io, specs in (("in", g.inputs), ("out", g.outputs)):
            for spec in specs:
                click.echo(f"{name:<22} {io:<4} {spec.name:<12} {spec.dtype:<9} {list(spec.shape)}")
    if entry is not None:
        _polygraphy_view(b.file(entry))


def _polygraphy_view(path: Path) -> None:
    import shutil
    import subprocess

    exe = shutil.which("polygraphy")
    if exe is None:
        raise UserError("polygraphy is not installed: pip install 'lantern-rt[trt]'")
    subprocess.run([exe, "inspect", "model", str(path)], check=False)


@main.command("bench")
@model_option
@click.option(
    "--bundle", type=click.Path(path_type=Path), default=None, help="Benchmark an exported bundle instead."
)
@click.option(
    "--backend",
    "backends",
    type=click.Choice(["torch", "onnxruntime"]),
    multiple=True,
    help="Backend(s) to measure (repeatable). Default: torch and onnxruntime; onnxruntime for --bundle.",
)
@click.option(
    "--config",
    "configs",
    multiple=True,
    help="METHOD[:key=val,...] (repeatable): ar, exact[:tree=T], lantern[:tree=T,k=K,delta=D], "
    "lantern++[:tree=T,k=K,lambda=L], sjd[:window=N], sjd++[:window=N,k=K,lambda=L] (no drafter: "
    "a Jacobi window; N defaults to 5), e.g. 'lantern++:k=5,lambda=10'. Default: ar, exact, "
    "lantern:k=1000,delta=0.1 and lantern++ with (k, lambda) = (10, 5), (5, 10), (5, 20). "
    "AR on every backend is always run: it is the speedup reference.",
)
@click.option(
    "--tree",
    "trees",
    multiple=True,
    help="Tree(s) for configs that name none (repeatable: every such config runs on each). "
    "Default: the tree 'lantern generate' uses (the bundle's first; else chain-5 on a CPU).",
)
@click.option(
    "--num-images",
    "-n",
    type=IMAGES_PER_CLASS,
    default=4,
    show_default=True,
    help="Images per class and configuration (FD wants many: 50+ per class for figures that mean something).",
)
@click.option("--class", "--classes", "classes", multiple=True, help="Class ids or names. Default: all.")
@prompt_options
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Untimed calls per configuration, run first (each as many images as a timed call).",
)
@click.option(
    "--batch-size",
    "batch_sizes",
    default="1",
    show_default=True,
    help="Images decoded together per step, comma-separated (e.g. 1,4,16): every configuration runs at each.",
)
@click.option(
    "--baseline",
    type=click.Choice(["torch-batched"]),
    default=None,
    help="Add rows for LlamaGen's own sampler loop (plain batched AR, torch eager) at each batch size.",
)
@click.option("--cfg-scale", type=float, default=None, help="CFG scale. Default: the model's.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option(
    "--threads", type=click.IntRange(min=0), default=0, help="CPU threads (0: the library default)."
)
@click.option("--no-quality", is_flag=True, help="Speed only: skip the classifier metrics and calibration.")
@click.option(
    "--ar-seeds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="AR sample sets (seeds SEED, SEED+1, ...) for the seed-noise calibration; 1 = none.",
)
@click.option(
    "--features",
    default=None,
    help="Your feature extractor for FD and precision/recall: path/to/file.py:NAME or package.module:NAME "
    "(NAME() returns an nn.Module or a callable: images [N, C, H, W] in [-1, 1] -> features [N, D]), "
    "or a TorchScript .pt/.ts file. Class accuracy still uses the Fashion-MNIST classifier.",
)
@click.option(
    "--reference",
    type=click.Path(path_type=Path),
    default=None,
    help="Real images to compare against instead of Fashion-MNIST: an .npz with 'images' (uint8 "
    "[N, H, W] or [N, H, W, C]) and 'labels' (int [N]). With --features, scores any model.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="Folder for results.json, results.md, quality_vs_speedup.png and accepted_lengths.png.",
)
@reports_errors
def bench_cmd(
    model_path,
    bundle,
    backends,
    configs,
    trees,
    num_images,
    classes,
    prompt_texts,
    prompts_file,
    seed,
    warmup,
    batch_sizes,
    baseline,
    cfg_scale,
    temperature,
    threads,
    no_quality,
    ar_seeds,
    features,
    reference,
    out,
):
    """Measure decoding methods side by side (speed, acceptance, quality) and write a report."""
    import shlex

    from lantern_rt.eval.bench import DEFAULT_CONFIGS, BenchSettings, run_bench
    from lantern_rt.eval.report import speed_table

    settings = BenchSettings(
        out=out,
        model=model_path,
        bundle=bundle,
        backends=backends,
        configs=configs or DEFAULT_CONFIGS,
        trees=trees,
        num_images=num_images,
        classes=tuple(s for c in classes for s in c.split(",") if s.strip()),
        prompts=tuple(read_prompts(prompt_texts, prompts_file)),
        seed=seed,
        warmup=warmup,
        cfg_scale=cfg_scale,
        temperature=temperature,
        threads=threads,
        quality=not no_quality,
        ar_seeds=ar_seeds,
        features=features,
        reference=reference,
        command=shlex.join(["lantern", *sys.argv[1:]]),
        batch_sizes=tuple(_batch_sizes(batch_sizes)),
        baseline=baseline,
    )
    results = run_bench(settings)
    click.echo(speed_table(results["rows"]))
    if results["quality_note"]:
        click.echo(f"no quality metrics: {results['quality_note']}", err=True)
    click.echo(f"wrote results.json, results.md and plots -> {out}", err=True)


from lantern_rt.calibration.cli import calibrate_cmd  # noqa: E402  (they import lantern_rt.errors)
from lantern_rt.engines.cli import build_engines_cmd  # noqa: E402

main.add_command(build_engines_cmd)
main.add_command(calibrate_cmd)

if __name__ == "__main__":
    main()
