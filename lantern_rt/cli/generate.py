"""``lantern generate`` and ``lantern generate-set``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from lantern_rt.cli.options import (
    StreamCount,
    load_options,
    model_option,
    open_run_source,
    prompt_options,
    requested_run,
    run_options,
)
from lantern_rt.errors import UserError, reports_errors
from lantern_rt.fileio import check_writable
from lantern_rt.prompt_files import read_prompts
from lantern_rt.runtime.run_shape import AUTO_STREAMS_MAX


@click.command("generate")
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
@click.option(
    "--streams",
    type=StreamCount(),
    default="auto",
    show_default=True,
    help="Batches decoded at once on the CPU (onnxruntime), each on its share of --threads: more "
    "images per second when there are several to make; one image's time is unchanged. auto: one "
    f"per thread (--threads 0: per core), at most {AUTO_STREAMS_MAX} and the batches to make; one "
    "on a GPU or another backend.",
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
    coupling,
    lantern_k,
    lantern_delta,
    lantern_lambda,
    drafter_path,
    backend,
    cuda_graphs,
    compile_step,
    profile,
    bundle,
    device,
    threads,
    output,
    save_tokens,
    stats_json,
    batch_size,
    streams,
    quiet,
):
    """Generate images and write them as a PNG grid (one row per class, or per prompt for a
    text-to-image model)."""
    t0 = time.perf_counter()

    from lantern_rt.api import load
    from lantern_rt.fileio import write_together
    from lantern_rt.images import grid, write_png
    from lantern_rt.training import codes_files

    md, source = open_run_source(model_path, bundle, backend, drafter_path)
    stats_out = None if stats_json is None or str(stats_json) == "-" else stats_json  # "-": stdout
    files = [p for p in (output, save_tokens, stats_out) if p is not None]
    if len({p.absolute() for p in files}) < len(files):
        raise UserError("-o, --save-tokens and --stats-json must name different files")
    for path, what in ((output, "image"), (save_tokens, "tokens"), (stats_out, "stats")):
        check_writable(path, what)
    if save_tokens is not None and save_tokens.suffix not in (".npy", ".npz"):
        raise UserError(f"--save-tokens must end in .npy or .npz, got {save_tokens}")
    prompts = read_prompts(prompt_texts, prompts_file)
    request = requested_run(md, source, prompts, None if drafter_path is None else str(drafter_path))
    class_ids, mc = request.conditions, request.method
    generator = load(
        source,
        **load_options(click.get_current_context().params),
        drafter=drafter_path,
        images=len(class_ids) * num_images,
    )
    pipe = generator.pipeline
    result = generator(class_ids, n=num_images, seed=seed, progress=not quiet, profile=profile)
    image = grid(result.array, rows=len(class_ids), scale=max(1, 64 // md.image_size))
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
    streams_note = f", {len(pipe.streams)} streams" if len(pipe.streams) > 1 else ""
    click.echo(
        f"{stats.num_images} images ({mc.method}, {pipe.backend}{streams_note}) in {stats.total_seconds:.1f}s: "
        f"{per_image:.3f}s/image decode, mean accepted length {stats.mean_accepted_length:.2f} -> {output}",
        err=True,
    )


@click.command("generate-set")
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
    coupling,
    lantern_k,
    lantern_delta,
    lantern_lambda,
    backend,
    bundle,
    device,
    threads,
    cuda_graphs,
    compile_step,
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
    md, source = open_run_source(model_path, bundle, backend, None)
    if md.gpt.takes_prompts:
        raise UserError(
            "generate-set makes class-conditional image sets; for prompts use 'lantern generate --prompts'"
        )
    request = requested_run(md, source, ())
    job, digest = set_job(
        model_path, source, request, seed, device, threads, cuda_graphs, batch_size, compile_step
    )
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
