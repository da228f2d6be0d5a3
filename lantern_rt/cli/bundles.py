"""``lantern export`` and ``lantern inspect``."""

from __future__ import annotations

import time
from pathlib import Path

import click

from lantern_rt.cli.options import (
    model_option,
    parse_batch_sizes,
)
from lantern_rt.errors import UserError, reports_errors
from lantern_rt.runtime.run_shape import CACHE_WINDOWS
from lantern_rt.settings import (
    CPU_DEFAULT_TREE,
    DEFAULT_OPSET,
    GPU_DEFAULT_TREE,
)


@click.command("export")
@model_option
@click.option(
    "--tree",
    "trees",
    multiple=True,
    help="Static tree(s) to export verify/draft graphs for (repeatable): preset, chain-N, pac-K-D-N (a Jacobi window of --method sjd), "
    "tuned (the tree 'lantern tune' chose for the model) or JSON file. "
    "Default: the trees this machine's tuning record chose ('lantern tune'), else the tree 'lantern "
    f"generate' chooses on --device: {CPU_DEFAULT_TREE} on a CPU, {GPU_DEFAULT_TREE} on a GPU.",
)
@click.option(
    "--device",
    default=None,
    help="The device the bundle is for (cpu, cuda or cuda:N; this machine need not have it); it "
    "picks the default --tree (the export itself and its checks run on the CPU). Default: this "
    "machine's (cuda when torch sees a CUDA device, else cpu).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    required=True,
    help="Bundle folder to write (written to a temporary folder, then renamed).",
)
@click.option("--dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="ONNX opset (17..20).")
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
@click.option(
    "--cache-in-place",
    is_flag=True,
    help="Target step and drafting graphs that write their K/V into the KV caches where they lie "
    "(opset 24: TensorScatter and Attention) instead of returning them: fewer nodes and no copy "
    "per step, for onnxruntime on the CPU only (TensorRT cannot build them).",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@reports_errors
def export_cmd(
    model_path,
    trees,
    device,
    out,
    dtype,
    opset,
    batch_sizes,
    windows,
    no_guidance,
    cache_in_place,
    force,
    quiet,
):
    """Export fixed-shape ONNX graphs and a manifest (the bundle), each checked against torch."""
    from lantern_rt.backends import backend_named, default_backend
    from lantern_rt.export.exporter import export_bundle
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.graph_spec import IN_PLACE_OPSET
    from lantern_rt.settings import export_tree, machine_device
    from lantern_rt.tune.record import export_trees, named_tree

    t0 = time.perf_counter()
    default_tree = export_tree(device)  # checks --device, given or not a --tree
    md = open_model_dir(model_path)
    runner = backend_named(default_backend(device or machine_device(), bundle=True, drafter_override=False))
    parsed = [named_tree(t, md, runner.name) for t in trees]
    if not parsed:  # the trees this machine's tuning record chose, else the device's default
        parsed = export_trees(md, runner.name, runner.package) or [named_tree(default_tree, md, runner.name)]
    trees = [t.name for t in parsed]
    sizes = parse_batch_sizes(batch_sizes)
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
        in_place=cache_in_place,
    )
    rows = "one row per image, no guidance" if no_guidance else "two CFG rows per image"
    rows += ", the cache written in place" if cache_in_place else ""
    click.echo(
        f"exported {md.name} ({dtype}, opset {opset}{f' ({IN_PLACE_OPSET}: the step and drafting graphs)' if cache_in_place else ''}, trees {', '.join(trees)}, batch sizes "
        f"{','.join(map(str, sizes))}, {windows} cache window(s), {rows}) in {time.perf_counter() - t0:.0f}s -> {out}",
        err=True,
    )


@click.command("inspect")
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
    written = (
        f"; steps write it in place ({c.cache_scratch} scratch slots"
        + (f", the drafter's {c.drafter_scratch}" if c.drafter_scratch else "")
        + ", onnxruntime on the CPU only)"
        if c.cache_scratch
        else ""
    )
    click.echo(
        f"cache    {c.cache_capacity} slots, read through windows of {', '.join(map(str, c.cache_windows))}{written}"
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
