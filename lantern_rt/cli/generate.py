"""``lantern generate`` and ``lantern generate-set``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from lantern_rt.cli.options import (
    RUN,
    classes_option,
    model_option,
    num_images_option,
    open_run_source,
    prompt_options,
    run_bundle_option,
    run_options,
    seed_option,
)
from lantern_rt.errors import UserError, reports_errors
from lantern_rt.fileio import check_writable
from lantern_rt.prompt_files import read_prompts
from lantern_rt.run_options import RunOptions


@click.command("generate")
@model_option
@classes_option
@num_images_option
@seed_option
@run_options(*RUN, streams=None)
@run_bundle_option
@prompt_options
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
    num_images,
    seed,
    bundle,
    prompt_texts,
    prompts_file,
    profile,
    output,
    save_tokens,
    stats_json,
    quiet,
    **options,
):
    """Generate images and write them as a PNG grid (one row per class, or per prompt for a
    text-to-image model)."""
    t0 = time.perf_counter()

    from lantern_rt.api import Generator
    from lantern_rt.fileio import write_together
    from lantern_rt.images import grid, write_png
    from lantern_rt.settings import requested_conditions, resolve
    from lantern_rt.training import codes_files

    md, source = open_run_source(model_path, bundle)
    stats_out = None if stats_json is None or str(stats_json) == "-" else stats_json  # "-": stdout
    files = [p for p in (output, save_tokens, stats_out) if p is not None]
    if len({p.absolute() for p in files}) < len(files):
        raise UserError("-o, --save-tokens and --stats-json must name different files")
    for path, what in ((output, "image"), (save_tokens, "tokens"), (stats_out, "stats")):
        check_writable(path, what)
    if save_tokens is not None and save_tokens.suffix not in (".npy", ".npz"):
        raise UserError(f"--save-tokens must end in .npy or .npz, got {save_tokens}")
    class_ids = requested_conditions(md, classes, read_prompts(prompt_texts, prompts_file))
    plan = resolve(source, RunOptions(**options), images=len(class_ids) * num_images)
    generator = Generator(plan)
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
        f"{stats.num_images} images ({plan.method.method}, {pipe.backend}{streams_note}) in "
        f"{stats.total_seconds:.1f}s: {per_image:.3f}s/image decode, mean accepted length "
        f"{stats.mean_accepted_length:.2f} -> {output}",
        err=True,
    )


@click.command("generate-set")
@model_option
@classes_option
@num_images_option
@seed_option
@run_options(*(name for name in RUN if name not in ("drafter", "streams")))
@run_bundle_option
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
    classes,
    num_images,
    seed,
    bundle,
    out,
    unit_size,
    ray_address,
    actors,
    fid_npz,
    quiet,
    **options,
):
    """Generate a labelled image set as shards, locally or on Ray; image for image what
    'lantern generate' gives with the same classes, -n, seed and settings."""
    from lantern_rt.image_sets import exported_job, generate_set, import_ray
    from lantern_rt.settings import requested_conditions, resolve

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
    md, source = open_run_source(model_path, bundle)
    if md.gpt.takes_prompts:
        raise UserError(
            "generate-set makes class-conditional image sets; for prompts use 'lantern generate --prompts'"
        )
    class_ids = requested_conditions(md, classes, ())
    job, digest = exported_job(resolve(source, RunOptions(**options)), seed)
    summary = generate_set(
        out, job, digest, class_ids, num_images, unit_size, ray_address, actors, fid_npz, not quiet
    )
    rate = summary["images_per_second"]
    click.echo(
        f"{summary['images']} images in {summary['shards']} shards ({summary['made_this_run']} made now, "
        f"{summary['mode']}, {summary['workers']} worker(s), "
        f"{'-' if rate is None else f'{rate:.2f}'} images/s, tau {summary['tau']:.2f}) -> {out}",
        err=True,
    )
