"""``lantern train-drafter``."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import click

from lantern_rt.cli.options import (
    SEED,
    model_option,
    threads_option,
)
from lantern_rt.errors import UserError, reports_errors, warn


@click.command("train-drafter")
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
@threads_option("torch CPU threads. Default: the library's.", minimum=1, default=None)
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
