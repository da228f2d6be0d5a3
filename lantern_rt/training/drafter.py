"""Training the EAGLE drafter against a frozen target (EAGLE-1 loss).

Data: image codes (VQ-encoded real images, or the target's own samples from ``lantern generate
--save-tokens codes.npz``) with their conditions: class labels for a class-conditional LlamaGen,
prompts (their conditional and unconditional token rows, :class:`PromptConditions`) for a
Chameleon-family model. The target runs teacher-forced on them (a prompt's padding hidden, as the
runtime's prefill and verify hide it) and its final-norm hidden states are the drafter's inputs
and regression targets. Loss, on the image positions only: SmoothL1(predicted hidden, next target
hidden) + 0.1 x cross-entropy between the frozen LM head's distributions of the two.

The drafter sees its pairs exactly as the runtime feeds them (docs/method.md §4, §9, §10):
for a prefix of P condition slots, first the P - 1 prefix pairs (target hidden at slot j, with
the token of slot j + 1) at positions 1..P-1 (``drafting.prefix_pairs``), then image pair i
(x_i, the target hidden state before it) at x_i's position P + i, causal. A prompt prefix's
pairs carry the row's next prompt token, embedded by the drafter's ``prompt_table``, and
the pairs of its padding slots are hidden from every other pair (each still sees itself); a
class prefix (P = 1) has no prefix pairs.

With ``unroll`` d > 1 the drafter is also scored on its own predictions, as it drafts: level e
(2 <= e <= d) of every row takes the hidden state it predicted one row earlier at level e - 1
and attends to the teacher-forced rows up to its root, its ancestors' rows and itself, exactly
the context of a tree node e - 1 levels below a root at run time (the "training-time test" of
HASS and EAGLE-3); the levels' losses are averaged.

Rows are either single (10% of them unconditional: the null class, or the prompt's
unconditional row) or, with ``cfg_scale`` set, pairs: every image once with its condition and
once unconditional, and the cross-entropy is taken between the CFG-mixed distributions, the ones
the runtime draws drafts from (it mixes the drafter's two rows the same way).
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
from lantern_rt.families.base import ClassRows, TrainingRows
from lantern_rt.models.checkpoint import load_strict, torch_load
from lantern_rt.models.config import GPTConfig
from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import Transformer, layout_logits
from lantern_rt.runtime.kv_cache import prefill_mask
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


class DrafterDataError(LanternError, ValueError):
    """Training data that does not fit the target (its conditions, their count)."""


def training_rows(conds: torch.Tensor | np.ndarray | TrainingRows) -> TrainingRows:
    """``conds`` as :class:`TrainingRows`: class ids [N] (a tensor or an array) become
    :class:`ClassRows`; a family's rows (e.g. :class:`PromptConditions`) are kept."""
    if isinstance(conds, np.ndarray | torch.Tensor):
        return ClassRows(torch.as_tensor(conds, dtype=torch.int64))
    return conds


def drafter_batch(
    target: Transformer, codes: torch.Tensor, conds: torch.Tensor | TrainingRows, uncond: torch.Tensor
):
    """(tokens [B, S], input hidden [B, S, D], positions [S], target hidden [B, T, D]) for T
    image tokens ``codes`` [B, T] under a prefix of P condition slots (``conds``: class ids [B]
    or a family's :class:`TrainingRows`, e.g. :class:`PromptConditions`; the hidden states are
    their ``teacher_forced_hidden``), S = P - 1 + T; with prefix pairs also (5th) which pairs
    the others see, ``visible`` [B, S].

    The S pairs are the drafter's sequence as the runtime feeds it: the P - 1 prefix pairs
    (hidden at slot j, with slot j + 1's prompt token id: tokens of the whole vocabulary, for
    the drafter's ``prompt_table``) at positions 1..P-1, visible where slot j is, then pair
    P - 1 + i holding image code x_i with the target hidden state of the position before it, at
    x_i's position P + i; it must predict the target hidden state at x_i's own position (target
    hidden row i). Prefix pairs are scored nowhere: the last T rows of the drafter's output are
    the predictions (:func:`batch_predictions`).
    """
    p, t = target.config.cls_token_num, codes.shape[1]
    rows = training_rows(conds)
    with torch.no_grad():
        hidden = rows.teacher_forced_hidden(target, codes, uncond)  # [B, P + T, D]
    positions = torch.arange(1, p + t)
    pairs = rows.prefix_pairs(uncond)
    if pairs is None:  # a class prefix: no prefix pairs
        return codes, hidden[:, :-1], positions, hidden[:, p:]
    tokens, visible = pairs
    return (
        torch.cat([tokens, codes], dim=1),
        hidden[:, :-1],
        positions,
        hidden[:, p:],
        F.pad(visible, (0, t), value=True),
    )


def batch_predictions(drafter: Drafter, batch, levels: int = 1, hidden: torch.Tensor | None = None):
    """The drafter's predicted hidden states [B, S, D] at levels 1..``levels`` over a
    :func:`drafter_batch` (its input hidden states replaced by ``hidden`` when given): a prompt
    prefix's pairs embedded by ``prompt_table``, its padding pairs hidden."""
    tokens, h_in, positions, h_target, *visible = batch
    h_in = h_in if hidden is None else hidden
    if not visible:
        return unrolled_predictions(drafter, tokens, h_in, positions, levels)
    prompt = h_in.shape[1] - h_target.shape[1]
    pairs = torch.cat(
        [drafter.embed_prompt(tokens[:, :prompt]), drafter.embed_tokens(tokens[:, prompt:])], dim=1
    )
    return unrolled_predictions(drafter, pairs, h_in, positions, levels, visible[0])


def unroll_mask(rows: int, level: int, visible: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [1 or B, 1, rows, level * rows]: what row t sees at ``level`` over the rows of levels
    1..level-1 (the keys of earlier passes) and its own level. Level 1 is causal
    (teacher-forced); at level d > 1 row t drafts d - 1 levels below the root t - d + 1: it sees
    level 1 up to the root, its ancestor t - d + e at each level e in 2..d-1, and itself.
    ``visible`` [B, rows] hides the level-1 rows it marks False (a prompt's padding pairs, hidden
    in the drafter's cache) except from themselves: level 1 is then ``kv_cache.prefill_mask``."""
    t = torch.arange(rows)
    if level == 1:
        if visible is not None:
            return prefill_mask(visible)
        return (t[None, :] <= t[:, None])[None, None]
    blocks = [t[None, :] <= t[:, None] - (level - 1)]
    blocks += [t[None, :] == t[:, None] - (level - e) for e in range(2, level)]
    blocks.append(torch.eye(rows, dtype=torch.bool))
    if visible is not None:
        blocks = [blocks[0] & visible[:, None, :], *(b.expand(len(visible), -1, -1) for b in blocks[1:])]
        return torch.cat(blocks, dim=-1)[:, None]
    return torch.cat(blocks, dim=1)[None, None]


def unrolled_predictions(
    drafter: Drafter,
    tokens: torch.Tensor,
    h_in: torch.Tensor,
    positions: torch.Tensor,
    levels: int,
    visible: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The drafter's predicted hidden states [B, S, D] at levels 1..``levels`` (see
    :func:`unroll_mask`, ``visible`` included) from pairs of ``tokens`` [B, S] (or their
    embeddings [B, S, H]) and ``h_in``; rows t < d - 1 of level d have no root and carry no
    meaning (nor do rows whose root would be a prefix pair: :func:`eagle_loss` scores image rows
    only)."""
    if levels == 1 and visible is None:
        return [drafter(tokens, h_in, positions)]
    c, (b, rows, _) = drafter.config, h_in.shape
    keys = values = h_in.new_zeros(c.num_hidden_layers, b, c.kv_heads, 0, c.head_dim)
    hidden, preds = h_in, []
    for level in range(1, levels + 1):
        pred, k, v = drafter.step(tokens, hidden, positions, unroll_mask(rows, level, visible), keys, values)
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
    layout: GPTConfig | None = None,
):
    """EAGLE-1 loss on one batch, averaged over ``unroll`` levels (see :func:`unroll_mask`);
    returns (loss, regression loss, classification loss). The distributions are the head's
    under the target config ``layout``'s image layout (Lumina-mGPT's forced row ends:
    :func:`~lantern_rt.models.target.layout_logits`), as the runtime draws drafts from them.

    With ``cfg_scale`` the batch's rows are all conditional rows, then the same images'
    unconditional rows, and the classification loss compares the CFG-mixed distributions. Only
    the last T rows (the image pairs; ``h_target`` has T) are scored, at level d those whose
    root is an image pair.
    """
    h_in, h_target = batch[1], batch[3]
    if noise > 0:
        rms = h_in.pow(2).mean().sqrt()
        h_in = h_in + (torch.rand(h_in.shape, generator=generator) - 0.5) * 2 * noise * rms
    vlosses, plosses = [], []
    prefix = h_in.shape[1] - h_target.shape[1]  # the prefix pairs, scored nowhere
    layout = layout or GPTConfig()
    start = max(layout.cls_token_num, 1)  # h_target[:, k]: the target's state at position start + k

    def logits(h: torch.Tensor, level: int) -> torch.Tensor:
        positions = torch.arange(start + level - 1, start + h_target.shape[1], device=h.device)
        return layout_logits(head(h).float(), positions, layout)

    for level, pred in enumerate(batch_predictions(drafter, batch, unroll, h_in), start=1):
        pred, target = pred[:, prefix + level - 1 :], h_target[:, level - 1 :]
        vlosses.append(F.smooth_l1_loss(pred, target))
        if cfg_scale is not None:  # the head is affine: mixing hidden states mixes the logits
            pred, target = (cfg_mix(h, cfg_scale, h.shape[0] // 2) for h in (pred, target))
        with torch.no_grad():
            p_target = torch.softmax(logits(target, level), dim=-1)
        plosses.append(-(p_target * torch.log_softmax(logits(pred, level), dim=-1)).sum(-1).mean())
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
    labels: np.ndarray | TrainingRows,
    cfg: DrafterTraining,
    state_path: Path | None = None,
    progress: bool = True,
) -> list[float]:
    """Train ``drafter`` in place on ``codes`` [N, T] and their conditions ``labels``: class ids
    [N], or the rows its family's ``training_conditions`` makes (:class:`PromptConditions` for
    a Chameleon-family target); resumes from and saves to ``state_path`` atomically.

    Returns the per-step losses of this run.
    """
    target.eval().requires_grad_(False)
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight.data)
    if drafter.takes_prompts:  # the target's whole vocabulary, frozen (not saved with the drafter)
        drafter.prompt_table.copy_(target.cls_embedding.weight.data)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0 if state_path is None or not state_path.exists() else resume(state_path, drafter, opt)
    gen = torch.Generator().manual_seed(cfg.seed)
    all_codes = torch.from_numpy(codes.astype(np.int64))
    all_labels = training_rows(labels)
    if len(all_labels) != len(all_codes):
        raise DrafterDataError(f"{len(all_codes)} images of codes but {len(all_labels)} conditions")
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
            drafter,
            target.output,
            batch,
            cfg.noise,
            cfg.p_weight,
            step_gen,
            cfg.cfg_scale,
            cfg.unroll,
            target.config,
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
