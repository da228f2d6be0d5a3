"""Training of the built-in demo model on Fashion-MNIST: the VQ tokenizer, then the target GPT.

Reproducible (fixed seeds, fixed step counts) and sized for two CPU cores:

    python -m lantern_rt.training.demo --work runs/demo all

Each stage saves resumable state under ``--work`` every few hundred steps; ``package`` copies
the final weights (fp16 safetensors) and ``config.json`` into ``lantern_rt/demo_model/``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import click
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.config import GPTConfig, VQConfig, to_dict
from lantern_rt.models.neighbors import latent_neighbors, save_neighbors
from lantern_rt.models.sampling_config import SamplingConfig
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel
from lantern_rt.training.data import CLASS_NAMES, load_fashion_mnist, to_model_range

DEMO_VQ = VQConfig(
    codebook_size=1024,
    codebook_embed_dim=8,
    codebook_show_usage=False,
    encoder_ch_mult=[1, 1],
    decoder_ch_mult=[1, 1],
    z_channels=32,
    ch=32,
    num_res_blocks=1,
    in_channels=1,
    out_channels=1,
)
DEMO_GPT = GPTConfig(
    dim=160,
    n_layer=6,
    n_head=5,
    multiple_of=64,
    token_dropout_p=0.0,
    resid_dropout_p=0.0,
    ffn_dropout_p=0.0,
    num_classes=10,
    class_dropout_prob=0.1,
    vocab_size=1024,
    block_size=256,
)
# The tokenizer follows a 1600-step cosine schedule stopped at 1200 steps (CPU budget).
VQ_STEPS, VQ_SCHEDULE, VQ_BATCH = 1200, 1600, 32
GPT_STEPS, BATCH = 1600, 32
NEIGHBORS_K = 1000  # LANTERN's default k; LANTERN++ uses far fewer
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "demo_model"


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _save_state(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """Everything a resumed run needs, written atomically."""
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _resume(path: Path, model, opt) -> int:
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def train_vq(work: Path, steps: int = VQ_STEPS, seed: int = 0) -> VQModel:
    """Train the tokenizer (MSE reconstruction + VQ/commitment loss) and return it."""
    torch.manual_seed(seed)
    x, _ = load_fashion_mnist("train")
    data = torch.from_numpy(to_model_range(x))
    model = VQModel(DEMO_VQ)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.0)
    state_path = work / "vq_state.pt"
    start = _resume(state_path, model, opt)
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat(
        [torch.randperm(len(data), generator=gen) for _ in range(1 + steps * VQ_BATCH // len(data))]
    )
    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="vq", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, VQ_SCHEDULE, 5e-4, 100)
        batch = data[order[step * VQ_BATCH : (step + 1) * VQ_BATCH]]
        recon, vq_loss = model(batch)
        rec = F.mse_loss(recon, batch)
        loss = rec + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            bar.set_postfix(rec=f"{rec.item():.4f}", vq=f"{vq_loss.item():.4f}")
        if (step + 1) % 250 == 0 or step + 1 == steps:
            _save_state(state_path, model, opt, step + 1)
    model.eval()
    return model


@torch.no_grad()
def encode_dataset(vq: VQModel, split: str) -> tuple[np.ndarray, np.ndarray]:
    """All images of a split as codes int16 [N, 256] and labels."""
    x, y = load_fashion_mnist(split)
    data = torch.from_numpy(to_model_range(x))
    codes = [vq.encode(data[i : i + 500])[1].flatten(1) for i in range(0, len(data), 500)]
    return torch.cat(codes).numpy().astype(np.int16), y


def train_gpt(
    work: Path, tokens: np.ndarray, labels: np.ndarray, steps: int = GPT_STEPS, seed: int = 0
) -> Transformer:
    """Train the class-conditional target on cached codes (fp32) and return it."""
    torch.manual_seed(seed)
    model = Transformer(DEMO_GPT)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
    )
    state_path = work / "gpt_state.pt"
    start = _resume(state_path, model, opt)
    codes = torch.from_numpy(tokens.astype(np.int64))
    cls = torch.from_numpy(labels.astype(np.int64))
    gen = torch.Generator().manual_seed(seed + 1)
    order = torch.cat(
        [torch.randperm(len(codes), generator=gen) for _ in range(1 + steps * BATCH // len(codes))]
    )
    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="gpt", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, 1e-3, 60)
        sel = order[step * BATCH : (step + 1) * BATCH]
        z, c = codes[sel], cls[sel]
        logits = model(z[:, :-1], c, train=True)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), z.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if (step + 1) % 100 == 0 or step + 1 == steps:
            _save_state(state_path, model, opt, step + 1)
    model.eval()
    return model


def package(vq: VQModel, gpt: Transformer, out: Path = PACKAGE_DIR) -> None:
    """Write the shipped demo: fp16 safetensors and a config.json."""
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(vq, out / "vq.safetensors", torch.float16)
    save_safetensors(gpt, out / "gpt.safetensors", torch.float16)
    # neighbours of the codebook as shipped (fp16), which is what the decoder will look up
    codebook = torch.nn.functional.normalize(vq.quantize.embedding.weight.detach().half().float(), dim=-1)
    save_neighbors(
        latent_neighbors(codebook, min(NEIGHBORS_K, DEMO_VQ.codebook_size - 1)), out / "neighbors.npy"
    )
    config = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    config.update(
        {
            "format": "lantern-rt-model",
            "format_version": 1,
            "name": "fashion-mnist-demo",
            "gpt": to_dict(DEMO_GPT),
            "vq": to_dict(DEMO_VQ),
            "files": {
                **config.get("files", {}),
                "gpt": "gpt.safetensors",
                "vq": "vq.safetensors",
                "neighbors": "neighbors.npy",
            },
            "class_names": list(CLASS_NAMES),
            "image_size": 32,
            "sampling_defaults": asdict(SamplingConfig(cfg_scale=3.0)),
        }
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@click.group()
@click.option("--work", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True)
@click.pass_context
def main(ctx: click.Context, work: Path) -> None:
    """Train the built-in demo model (VQ tokenizer, then target GPT)."""
    # Subnormal floats slow CPU training several-fold. Set before the thread pool starts:
    # worker threads inherit the flag only when created after it.
    torch.set_flush_denormal(True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work.mkdir(parents=True, exist_ok=True)
    ctx.obj = work


def _load_vq(work: Path) -> VQModel:
    vq = VQModel(DEMO_VQ)
    vq.load_state_dict(torch.load(work / "vq_state.pt", map_location="cpu", weights_only=True)["model"])
    return vq.eval()


@main.command()
@click.pass_obj
def vq(work: Path) -> None:
    """Stage 1: the tokenizer."""
    t = time.time()
    train_vq(work)
    click.echo(f"vq done in {time.time() - t:.0f}s")


@main.command()
@click.pass_obj
def gpt(work: Path) -> None:
    """Stage 2: encode the training set with the tokenizer, then train the target."""
    t = time.time()
    tok_path = work / "train_codes.npz"
    if not tok_path.exists():
        codes, labels = encode_dataset(_load_vq(work), "train")
        np.savez(tok_path, codes=codes, labels=labels)
    data = np.load(tok_path)
    click.echo(f"codebook usage: {len(np.unique(data['codes']))} of {DEMO_VQ.codebook_size} codes")
    train_gpt(work, data["codes"], data["labels"])
    click.echo(f"gpt done in {time.time() - t:.0f}s")


@main.command("package")
@click.option(
    "--drafter",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A folder written by 'lantern train-drafter' to ship with the demo.",
)
@click.pass_obj
def package_cmd(work: Path, drafter: Path | None) -> None:
    """Stage 3: copy the final weights (and optionally a trained drafter) into the package."""
    g = Transformer(DEMO_GPT)
    g.load_state_dict(torch.load(work / "gpt_state.pt", map_location="cpu", weights_only=True)["model"])
    package(_load_vq(work), g.eval())
    if drafter is not None:
        ship_drafter(drafter)
    click.echo(f"wrote {PACKAGE_DIR}")


def ship_drafter(folder: Path, out: Path = PACKAGE_DIR) -> None:
    """Copy a trained drafter folder (config.json + drafter.safetensors) into the demo."""
    target = out / "drafter"
    target.mkdir(exist_ok=True)
    for name in ("config.json", "drafter.safetensors"):
        shutil.copyfile(folder / name, target / name)
    config = json.loads((out / "config.json").read_text())
    config["files"]["drafter"] = "drafter"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@main.command("all")
@click.pass_context
def all_stages(ctx: click.Context) -> None:
    """All stages in order."""
    ctx.invoke(vq)
    ctx.invoke(gpt)
    ctx.invoke(package_cmd)


if __name__ == "__main__":
    main()
