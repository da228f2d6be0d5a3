"""``lantern bench``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from lantern_rt.cli.options import (
    IMAGES_PER_CLASS,
    bundle_option,
    classes_option,
    model_option,
    parse_batch_sizes,
    parse_stream_counts,
    prompt_options,
    run_option,
    run_options,
    seed_option,
)
from lantern_rt.errors import reports_errors
from lantern_rt.prompt_files import read_prompts
from lantern_rt.run_options import RunOptions, sampling_options
from lantern_rt.sized_demo.sizes import SIZES


@click.command("bench")
@model_option
@bundle_option("Benchmark an exported bundle instead.")
@click.option(
    "--size",
    default=None,
    help=f"Benchmark the demo widened to a LlamaGen shape: {', '.join(SIZES)} (tiny: for tests). The "
    "demo's tokens at a real model's step cost, built into the cache on first use ('lantern widen'). "
    "Not with --model or --bundle.",
)
@run_option(
    "backend",
    multiple=True,
    help="Backend(s) to measure (repeatable). Default: torch and onnxruntime; onnxruntime for --bundle.",
)
@click.option(
    "--config",
    "configs",
    multiple=True,
    help="METHOD[:key=val,...] (repeatable): ar, exact[:tree=T], lantern[:tree=T,k=K,delta=D], "
    "lantern++[:tree=T,k=K,lambda=L], sjd[:window=N|tree=T,coupling=C], "
    "sjd++[:window=N|tree=T,coupling=C,k=K,lambda=L] (no drafter: a Jacobi window, a chain of N, 5 by "
    "default, or T = chain-N or pac-K-D-N; C = maximal, gumbel or none), e.g. 'lantern++:k=5,lambda=10', "
    "'sjd:tree=pac-2-1-33,coupling=maximal'. Default: ar, exact, "
    "lantern:k=1000,delta=0.1 and lantern++ with (k, lambda) = (10, 5), (5, 10), (5, 20). "
    "AR on every backend is always run: it is the speedup reference.",
)
@run_option(
    "tree",
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
@classes_option
@prompt_options
@seed_option
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
    "--streams",
    "stream_counts",
    default="1",
    show_default=True,
    help="Batches decoded at once, comma-separated (e.g. 1,2): the rows of backends that decode in streams "
    "(onnxruntime, openvino) run at each, each "
    "stream on its share of --threads; the other rows run one stream.",
)
@click.option(
    "--baseline",
    type=click.Choice(["torch-batched"]),
    default=None,
    help="Add rows for LlamaGen's own sampler loop (plain batched AR, torch eager) at each batch size. "
    "With --bundle it runs --model (default: the demo), the model the bundle was exported from.",
)
@run_options(*sampling_options(), "device", "threads", "cuda_graphs", "compile", "cache_windows")
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
    size,
    backend,
    configs,
    tree,
    num_images,
    classes,
    prompt_texts,
    prompts_file,
    seed,
    warmup,
    batch_sizes,
    stream_counts,
    baseline,
    no_quality,
    ar_seeds,
    features,
    reference,
    out,
    **options,
):
    """Measure decoding methods side by side (speed, acceptance, quality) and write a report."""
    import shlex

    from lantern_rt.eval.bench import DEFAULT_CONFIGS, BenchSettings, run_bench
    from lantern_rt.eval.report import bandwidth_line, speed_table

    settings = BenchSettings(
        out=out,
        model=model_path,
        bundle=bundle,
        size=size,
        backends=backend,
        configs=configs or DEFAULT_CONFIGS,
        trees=tree,
        num_images=num_images,
        classes=tuple(s for c in classes for s in c.split(",") if s.strip()),
        prompts=tuple(read_prompts(prompt_texts, prompts_file)),
        seed=seed,
        warmup=warmup,
        options=RunOptions(**options),
        quality=not no_quality,
        ar_seeds=ar_seeds,
        features=features,
        reference=reference,
        command=shlex.join(["lantern", *sys.argv[1:]]),
        batch_sizes=tuple(parse_batch_sizes(batch_sizes)),
        streams=tuple(parse_stream_counts(stream_counts)),
        baseline=baseline,
    )
    results = run_bench(settings)
    click.echo(speed_table(results["rows"]))
    click.echo(bandwidth_line(results["machine"]), err=True)
    if results["quality_note"]:
        click.echo(f"no quality metrics: {results['quality_note']}", err=True)
    click.echo(f"wrote results.json, results.md and plots -> {out}", err=True)
