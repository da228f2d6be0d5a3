"""``lantern widen``."""

from __future__ import annotations

import time
from pathlib import Path

import click

from lantern_rt.errors import UserError, reports_errors
from lantern_rt.sized_demo.sizes import SIZES


@click.command("widen")
@click.option(
    "--size",
    required=True,
    help=f"LlamaGen's GPT shape to widen the demo to: {', '.join(SIZES)} (tiny: for tests).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Write the model directory here (a new folder, or one this command wrote: replaced). "
    "Default: the cache, $LANTERN_CACHE/models (built once, reused after).",
)
@reports_errors
def widen_cmd(size: str, out: Path | None) -> None:
    """Build the demo model at a LlamaGen size with the demo's exact behaviour.

    The demo's weights are placed in the wider tensors and the rest made inert but dense (random
    weights, zero only where a product must not change), so the model gives the demo's tokens
    at the cost of a real LlamaGen step. Prints the model directory; run it with --model DIR."""
    from lantern_rt.sized_demo.cache import sized_model_dir
    from lantern_rt.sized_demo.sizes import size_shape
    from lantern_rt.sized_demo.widen import write_widened

    size_shape(size)
    if out is not None and not _replaceable(out):
        raise UserError(
            f"--out {out} exists and is not a model directory 'lantern widen' wrote; give a new folder"
        )
    t0 = time.perf_counter()
    path = sized_model_dir(size) if out is None else write_widened(out, size)
    weights = sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    click.echo(f"{size}: {weights / 1e6:.0f} MB of weights in {time.perf_counter() - t0:.1f}s", err=True)
    click.echo(path)


def _replaceable(out: Path) -> bool:
    """Whether ``--out`` may be (re)written: absent, an empty folder, or a widened model's."""
    from lantern_rt.models.config import ConfigError, read_json

    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return True
    try:
        return out.is_dir() and "widened" in read_json(out / "config.json")
    except ConfigError:
        return False
