"""``lantern calibrate``: an int8 Q/DQ (or weight-only) bundle from an fp32 bundle, or TensorRT's
weight-only form of an fp16 bundle (see :mod:`.calibrate` and :mod:`.weight_only`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from lantern_rt.calibration.weight_only import DEFAULT_BLOCK, WEIGHT_FORMATS
from lantern_rt.errors import UserError, reports_errors
from lantern_rt.prompt_files import read_prompts
from lantern_rt.settings import MAX_SEED, METHODS, capped_threads


@click.command("calibrate")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--samples",
    type=int,
    default=32,
    show_default=True,
    help="Images generated with BUNDLE per decoding pipeline (AR, and the method on each of the "
    "bundle's trees) to record the graphs' inputs: Q/DQ's calibration data, and what every "
    "quantized graph is compared with BUNDLE's on.",
)
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, help="Folder for the quantized bundle."
)
@click.option(
    "--weights-only",
    "weight_bits",
    type=click.Choice(["4", "8"]),
    default=None,
    help="Quantize only the weights, to 4 or 8 bits (onnxruntime's MatMulNBits, int8 products on "
    "VNNI CPUs) instead of Q/DQ int8: faster AR on a CPU, acceptance close to fp32, no TensorRT.",
)
@click.option(
    "--drafter-only",
    is_flag=True,
    help="With --weights-only: quantize the drafter's graphs alone, its output head included, and keep "
    "the target's fp32. Every token is still tested against the fp32 target and AR is the fp32 "
    "bundle's; drafting gets cheaper, and acceptance moves with the drafter's draws (dtype "
    "int4-drafter or int8-drafter).",
)
@click.option(
    "--weights",
    "weight_format",
    type=click.Choice(list(WEIGHT_FORMATS)),
    default=None,
    help="TensorRT's weight-only form of an fp16 bundle (W4A16 or W8A16, for Jetson Orin and RTX): "
    "each weight MatMul's weight as int4 or int8 blocks behind a block-wise DequantizeLinear "
    "(opset 21), activations fp16; TensorRT builds it, onnxruntime runs it (compared with the "
    "fp16 bundle here).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help=f"Weights per scale along each product's input, with --weights (default {DEFAULT_BLOCK}); "
    "it must divide every quantized weight's input width.",
)
@click.option(
    "--method",
    type=click.Choice(METHODS),
    default=None,
    help="Speculative method that drives the drafter and verify graphs. Default: lantern++ when "
    "the bundle has a drafter, else sjd when it has a chain's verify graph (a Jacobi window), else ar.",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0, max=MAX_SEED),
    default=0,
    show_default=True,
    help="Seed of the calibration images.",
)
@click.option(
    "--validate",
    type=click.IntRange(min=1),
    default=None,
    help="Images per validation run (BUNDLE vs the quantized bundle). Default: one per class (per prompt).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(path_type=Path),
    default=None,
    help="Text file of prompts, one per line, to calibrate and validate a text-to-image or "
    "Chameleon-family bundle on (used in turn).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=0),
    default=0,
    callback=lambda ctx, param, value: capped_threads(value),
    help="CPU threads (0: the library default). More than the CPU cores this process may use (its "
    "CPU affinity) is capped to them, with a warning.",
)
@click.option(
    "--report-json", type=click.Path(path_type=Path), default=None, help="Also write the report as JSON."
)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@reports_errors
def calibrate_cmd(
    bundle,
    samples,
    out,
    weight_bits,
    drafter_only,
    weight_format,
    block_size,
    method,
    seed,
    validate,
    prompts_file,
    threads,
    report_json,
    force,
    quiet,
):
    """Quantize BUNDLE's target and drafter graphs to int8 (Q/DQ), calibrated on the inputs they
    see while generating, or (--weights-only, --weights) their weights alone, and compare the
    result with BUNDLE on onnxruntime."""
    from lantern_rt.calibration.calibrate import calibrate_bundle, markdown_table
    from lantern_rt.calibration.quantization import Quantization
    from lantern_rt.calibration.weight_only import WeightOnly
    from lantern_rt.families.loading import open_bundle
    from lantern_rt.settings import MethodConfig

    t0 = time.perf_counter()
    if report_json is not None and not report_json.resolve().parent.is_dir():
        raise UserError(f"cannot write {report_json}: its folder does not exist")
    if block_size is not None and weight_format is None:
        raise UserError("--block-size sets the blocks of --weights: add --weights int4 or int8, or drop it")
    if drafter_only and weight_bits is None:
        raise UserError(
            "--drafter-only quantizes the drafter's weights: add --weights-only 4 or 8, or drop it"
        )
    quantization = Quantization(
        weight_bits=None if weight_bits is None else int(weight_bits),
        weight_only=None
        if weight_format is None
        else WeightOnly.named(weight_format, block_size or DEFAULT_BLOCK),
        drafter_only=drafter_only,
    )
    config = None if method is None else MethodConfig(method)
    prompts = read_prompts((), prompts_file) if prompts_file is not None else []
    opened = open_bundle(bundle)
    report = calibrate_bundle(
        opened,
        out,
        samples,
        config,
        seed=seed,
        validate=validate,
        threads=threads,
        overwrite=force,
        progress=not quiet,
        prompts=prompts,
        quantization=quantization,
    )
    click.echo(markdown_table(report))
    if report_json is not None:
        report_json.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"calibrated {bundle} in {time.perf_counter() - t0:.0f}s -> {out}", err=True)
