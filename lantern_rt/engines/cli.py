"""``lantern build-engines``: TensorRT plans for a bundle, built on the machine that runs them."""

from __future__ import annotations

import time
from pathlib import Path

import click

from lantern_rt.engines.compat import DEFAULT_WORKSPACE_MB, PRECISIONS
from lantern_rt.errors import reports_errors


@click.command("build-engines")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    default=None,
    help="Check that the bundle's graphs are of this precision (default: whatever they are). "
    "TensorRT builds strongly typed: precision comes from the graphs, never from a flag.",
)
@click.option(
    "--workspace-mb",
    type=click.IntRange(min=1),
    default=DEFAULT_WORKSPACE_MB,
    show_default=True,
    help="Builder scratch memory (MiB); lower it on an 8 GB Jetson if a build runs out of memory.",
)
@click.option(
    "--timing-cache",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Timing cache file: read when it exists, written after the build (speeds up rebuilds).",
)
@reports_errors
def build_engines_cmd(bundle: Path, precision: str | None, workspace_mb: int, timing_cache: Path | None):
    """Build one TensorRT plan per graph of BUNDLE for this GPU, into BUNDLE/engines/."""
    from lantern_rt.engines.plans import build_engines
    from lantern_rt.families.loading import open_bundle

    t0 = time.perf_counter()
    folder = build_engines(
        open_bundle(bundle),
        precision=precision,
        workspace_mb=workspace_mb,
        timing_cache=timing_cache,
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(f"built TensorRT engines in {time.perf_counter() - t0:.0f}s -> {folder}", err=True)
