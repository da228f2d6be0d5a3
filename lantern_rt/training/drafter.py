"""Training the EAGLE drafter against a frozen target (EAGLE-1 loss).

Data: image codes (VQ-encoded real images, or the target's own samples from ``lantern generate
--save-tokens codes.npz``) with their class labels; the target runs teacher-forced on them and
its final-norm hidden states are the drafter's inputs and regression targets. Loss:
SmoothL1(predicted hidden, next target hidden) + 0.1 x cross-entropy between the frozen LM
head's distributions of the two.

With ``unroll`` d > 1 the drafter is also scored on its own predictions, as it drafts: level e
(2 <= e <= d) of every row takes the hidden state it predicted one row earlier at level e - 1
and attends to the teacher-forced rows up to its root, its ancestors' rows and itself, exactly
the context of a tree node e - 1 levels below a root at run time (the "training-time test" of
HASS and EAGLE-3); the levels' losses are averaged.

Rows are either single (10% of them with the null condition, for CFG's unconditional row) or,
with ``cfg_scale`` set, pairs: every image once with its class and once with the null
condition, and the cross-entropy is taken between the CFG-mixed distributions, the ones the
runtime draws drafts from (it mixes the drafter's two rows the same way).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from lantern_rt.errors import LanternError, first_line
from lantern_rt.models.checkpoint import load_strict, torch_load
from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.sampling import cfg_mix


@dataclass(frozen=True)
class DrafterTraining:
    steps: int = 2000
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 50
    uncond_fraction: float = 0.1
    p_weight: float = 0.1
    noise: float = 0.05  # uniform input noise on target hidden states, relative to their RMS
    seed: int = 0
    save_every: int = 100
    cfg_scale: float | None = None  # set: train on (cond, null) row pairs, score the mixed distribution
    unroll: int = 1  # levels the drafter is scored at (1: teacher-forced only, EAGLE-1)


def drafter_batch(target: Transformer, codes: torch.Tensor, labels: torch.Tensor, uncond: torch.Tensor):
    """(tokens [B, T], input hidden [B, T, D], positions [T], target hidden [B, T, D]).

    Pair j holds token x_j with the target hidden state of the position before it and must
    predict the target hidden state at x_j's own position.
    """
    cfg = target.config
    cond = torch.where(uncond, torch.full_like(labels, cfg.num_classes), labels)
    with torch.no_grad():
        hidden = target.hidden_states(codes, cond)  # [B, cls + T, D]
    t = codes.shape[1]
    positions = torch.arange(cfg.cls_token_num, cfg.cls_token_num + t)
    return codes, hidden[:, cfg.cls_token_num - 1 : -1], positions, hidden[:, cfg.cls_token_num :]


def unroll_mask(rows: int, level: int) -> torch.Tensor:
    """Bool [1, 1, rows, level * rows]: what row t sees at ``level`` over the rows of levels
    1..level-1 (the keys of earlier passes) and its own level. Level 1 is causal
    (teacher-forced); at level d > 1 row t drafts d - 1 levels below the root t - d + 1: it sees
    level 1 up to the root, its ancestor t - d + e at each level e in 2..d-1, and itself."""
    t = torch.arange(rows)
    if level == 1:
        return (t[None, :] <= t[:, None])[None, None]
    blocks = [t[None, :] <= t[:, None] - (level - 1)]
    blocks += [t[None, :] == t[:, None] - (level - e) for e in range(2, level)]
    blocks.append(torch.eye(rows, dtype=torch.bool))
    return torch.cat(blocks, dim=1)[None, None]


def unrolled_predictions(
    drafter: Drafter, tokens: torch.Tensor, h_in: torch.Tensor, positions: torch.Tensor, levels: int
) -> list[torch.Tensor]:
    """The drafter's predicted hidden states [B, T, D] at levels 1..``levels`` (see
    :func:`unroll_mask`); rows t < d - 1 of level d have no root and carry no meaning."""
    if levels == 1:
        return [drafter(tokens, h_in, positions)]
    c, (b, rows, _) = drafter.config, h_in.shape
    keys = values = h_in.new_zeros(c.num_hidden_layers, b, c.kv_heads, 0, c.head_dim)
    hidden, preds = h_in, []
    for level in range(1, levels + 1):
        pred, k, v = drafter.step(tokens, hidden, positions, unroll_mask(rows, level), keys, values)
        preds.append(pred)
        keys, values = torch.cat([keys, k], dim=3), torch.cat([values, v], dim=3)
        hidden = torch.cat([h_in[:, :1], pred[:, :-1].detach()], dim=1)  # the parent's prediction
    return preds


def eagle_loss(
    drafter: Drafter,
    head: torch.nn.Linear,
    batch,
    noise: float,
    p_weight: float,
    generator=None,
    cfg_scale: float | None = None,
    unroll: int = 1,
):
    """EAGLE-1 loss on one batch, averaged over ``unroll`` levels (see :func:`unroll_mask`);
    returns (loss, regression loss, classification loss).

    With ``cfg_scale`` the batch's rows are all conditional rows, then the same images'
    unconditional rows, and the classification loss compares the CFG-mixed distributions.
    """
    tokens, h_in, positions, h_target = batch
    if noise > 0:
        rms = h_in.pow(2).mean().sqrt()
        h_in = h_in + (torch.rand(h_in.shape, generator=generator) - 0.5) * 2 * noise * rms
    vlosses, plosses = [], []
    for level, pred in enumerate(unrolled_predictions(drafter, tokens, h_in, positions, unroll), start=1):
        pred, target = pred[:, level - 1 :], h_target[:, level - 1 :]
        vlosses.append(F.smooth_l1_loss(pred, target))
        if cfg_scale is not None:  # the head is affine: mixing hidden states mixes the logits
            pred, target = (cfg_mix(h, cfg_scale) for h in (pred, target))
        with torch.no_grad():
            p_target = torch.softmax(head(target).float(), dim=-1)
        plosses.append(-(p_target * torch.log_softmax(head(pred).float(), dim=-1)).sum(-1).mean())
    vloss, ploss = torch.stack(vlosses).mean(), torch.stack(plosses).mean()
    return vloss + p_weight * ploss, vloss, ploss


def _lr(step: int, cfg: DrafterTraining) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainStateError(LanternError, ValueError):
    """A saved training state cannot be resumed from."""


def resume(path: Path, drafter: Drafter, opt: torch.optim.Optimizer) -> int:
    """Load the training state at ``path`` (written by :func:`train_drafter`) into ``drafter`` and
    ``opt`` and return its step; a file that is not such a state, does not fit this drafter or
    holds NaN or infinite values is a one-line :class:`LanternError` naming the file."""
    what = f"training state {path}"
    state = torch_load(path)
    if not isinstance(state, dict) or not {"model", "optim", "step"} <= state.keys():
        raise TrainStateError(f"{what} is not a drafter training state (a dict of model, optim and step)")
    step, model = state["step"], state["model"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TrainStateError(f"{what}: step must be an integer >= 0, got {step!r}"[:300])
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise TrainStateError(f"{what}: model is not a state dict of tensors")
    load_strict(drafter, model, what)
    try:
        opt.load_state_dict(state["optim"])
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as exc:
        raise TrainStateError(f"{what}: optim does not fit this drafter ({first_line(exc)})") from None
    for p in (p for group in opt.param_groups for p in group["params"]):
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor) and ((v.dim() and v.shape != p.shape) or not v.isfinite().all()):
                raise TrainStateError(f"{what}: optim holds moments of the wrong shape, or NaN or inf")
    return step


def train_drafter(
    target: Transformer,
    drafter: Drafter,
    codes: np.ndarray,
    labels: np.ndarray,
    cfg: DrafterTraining,
    state_path: Path | None = None,
    progress: bool = True,
) -> list[float]:
    """Train ``drafter`` in place; resumes from and saves to ``state_path`` atomically.

    Returns the per-step losses of this run.
    """
    target.eval().requires_grad_(False)
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight.data)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0 if state_path is None or not state_path.exists() else resume(state_path, drafter, opt)
    gen = torch.Generator().manual_seed(cfg.seed)
    all_codes = torch.from_numpy(codes.astype(np.int64))
    all_labels = torch.from_numpy(labels.astype(np.int64))
    order = torch.cat(
        [
            torch.randperm(len(all_codes), generator=gen)
            for _ in range(1 + cfg.steps * cfg.batch // len(all_codes))
        ]
    )
    drafter.train()
    losses = []
    bar = tqdm(
        range(start, cfg.steps),
        initial=start,
        total=cfg.steps,
        desc="drafter",
        disable=not progress,
        mininterval=5,
    )
    for step in bar:
        step_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        sel = order[step * cfg.batch : (step + 1) * cfg.batch]
        if cfg.cfg_scale is None:
            uncond = torch.rand(len(sel), generator=step_gen) < cfg.uncond_fraction
        else:
            uncond = torch.arange(2 * len(sel)) >= len(sel)
            sel = sel.repeat(2)
        batch = drafter_batch(target, all_codes[sel], all_labels[sel], uncond)
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        loss, vloss, ploss = eagle_loss(
            drafter, target.output, batch, cfg.noise, cfg.p_weight, step_gen, cfg.cfg_scale, cfg.unroll
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(params, 0.5)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(v=f"{vloss.item():.4f}", p=f"{ploss.item():.3f}")
        if state_path is not None and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": drafter.state_dict(), "optim": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, state_path)
    drafter.eval()
    return losses
