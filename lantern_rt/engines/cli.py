"""``lantern build-engines``: TensorRT plans for a bundle, built on the machine that runs them
(TensorRT) or ahead of time on any machine (TensorRT for RTX)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from lantern_rt.engines.compat import DEFAULT_WORKSPACE_MB, FLAVOURS, PRECISIONS, TRT, TRT_RTX
from lantern_rt.errors import reports_errors


def _capabilities(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--compute-capability`` values, repeated or comma-separated, as one tuple."""
    return tuple(cc.strip() for value in values for cc in value.split(",") if cc.strip())


@click.command("build-engines")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--flavour",
    type=click.Choice(list(FLAVOURS)),
    default=None,
    help=f"{TRT.name}: {TRT.label}, built on the GPU that will run the plans; {TRT_RTX.name}: "
    f"{TRT_RTX.label}, built ahead of time on any machine (no GPU needed) for RTX GPUs. Default: "
    "the one installed.",
)
@click.option(
    "--compute-capability",
    "capabilities",
    multiple=True,
    callback=_capabilities,
    metavar="X.Y",
    help=f"{TRT_RTX.name}: a compute capability to build for (repeatable or comma-separated, e.g. "
    "8.6,8.9). Default: every one it builds these graphs for (1.7: 8.0, 8.6, 8.9, 12.0, 12.1; not "
    "Turing's 7.5, which lacks the fp32 products every bundle keeps).",
)
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
    help=f"{TRT.name}: timing cache file, read when it exists, written after the build (speeds up rebuilds).",
)
@reports_errors
def build_engines_cmd(
    bundle: Path,
    flavour: str | None,
    capabilities: tuple[str, ...],
    precision: str | None,
    workspace_mb: int,
    timing_cache: Path | None,
):
    """Build one TensorRT plan per graph of BUNDLE into BUNDLE/engines/."""
    from lantern_rt.engines.plans import build_engines
    from lantern_rt.families.loading import open_bundle

    t0 = time.perf_counter()
    folder = build_engines(
        open_bundle(bundle),
        flavour=flavour,
        capabilities=capabilities,
        precision=precision,
        workspace_mb=workspace_mb,
        timing_cache=timing_cache,
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(f"built TensorRT engines in {time.perf_counter() - t0:.0f}s -> {folder}", err=True)
