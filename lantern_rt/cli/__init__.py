"""The ``lantern`` command line: each command parses its options, calls the library and prints
what it did; the library decides (docs/architecture.md). Commands import their work lazily, so
that ``--help`` stays fast."""

from __future__ import annotations

import click

from lantern_rt.calibration.cli import calibrate_cmd
from lantern_rt.cli.bench import bench_cmd
from lantern_rt.cli.bundles import export_cmd, inspect_cmd
from lantern_rt.cli.generate import generate, generate_set_cmd
from lantern_rt.cli.info import info_cmd
from lantern_rt.cli.serve import serve_cmd
from lantern_rt.cli.train import train_drafter_cmd
from lantern_rt.cli.tune import tune_cmd
from lantern_rt.cli.widen import widen_cmd
from lantern_rt.engines.cli import build_engines_cmd
from lantern_rt.errors import OneLineErrors


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lantern-rt")
def main() -> None:
    """lantern-rt: fast LANTERN++ speculative decoding for visual autoregressive models."""


for command in (
    generate,
    generate_set_cmd,
    train_drafter_cmd,
    export_cmd,
    inspect_cmd,
    bench_cmd,
    build_engines_cmd,
    info_cmd,
    calibrate_cmd,
    serve_cmd,
    tune_cmd,
    widen_cmd,
):
    main.add_command(command)
