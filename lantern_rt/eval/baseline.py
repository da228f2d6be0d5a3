"""The baseline that ``lantern bench --baseline torch-batched`` times: LlamaGen's own sampler loop.

LlamaGen samples with ``autoregressive/models/generate.py`` (FoundationVision/LlamaGen): torch
eager, a batch of conditional rows followed by their unconditional copies
(``torch.cat([cond, uncond])``), a static KV cache written at each step's position
(``KVCache.update`` with ``input_pos``) under a causal mask over the cache, the two halves of the
logits mixed every step as ``uncond + (cond - uncond) * cfg_scale``, then temperature, top-k and
top-p, a softmax and ``torch.multinomial``. :func:`torch_batched_ar` follows that loop step for
step, written here over our :class:`~lantern_rt.models.target.Transformer` (its pure ``step``);
no LlamaGen code is copied.

Where it differs from LlamaGen: greedy (temperature 0) is the argmax of the mixed softmax;
there is no ``cfg_interval``; top-k and top-p are the runtime's filter (:func:`filtered`), which
keeps every token tied with a threshold.

Randomness: one ``torch.Generator`` per chunk of ``batch_size`` labels, seeded from (seed,
chunk index). Sampled tokens therefore depend on the batch size and do not match the per-image
streams of :func:`lantern_rt.generate.generate` (same law, other draws); greedy tokens equal our
runtime's AR tokens exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lantern_rt.models.config import ConfigError, GPTConfig
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs, filter_logits


@dataclass(frozen=True)
class BaselineRun:
    """Tokens of a baseline run and the wall time of its decode loop."""

    tokens: Tensor  # [N, block_size] int64, in label order
    seconds: float  # decode loop wall time (prefill, steps, cache setup), all chunks
    seconds_per_image: float


def filtered(logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """Sampled logits [B, V] divided by the temperature, then top-k and top-p as the runtime filters
    them (:func:`~lantern_rt.runtime.sampling.filter_logits`: ties at a threshold all stay, where
    LlamaGen's sort may split them). As LlamaGen's ``sample``, no filter runs when both are off;
    the filter sorts the top-k largest logits when top-k is on (which is exact), else all of them."""
    if not sampling.filters:
        return logits / sampling.temperature
    settings = filter_inputs(sampling, logits.device)[1:]  # temperature, top-k, top-p
    width = min(sampling.top_k, logits.shape[-1]) if sampling.top_k > 0 else logits.shape[-1]
    return filter_logits(logits, *settings, width)


def sample(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """One token per row of mixed logits [B, V] -> [B] int64: argmax of the softmax when greedy,
    else :func:`filtered`, softmax and ``torch.multinomial`` (LlamaGen's ``sample``)."""
    if sampling.greedy:
        return logits.softmax(-1).argmax(-1)
    return torch.multinomial(filtered(logits, sampling).softmax(-1), 1, generator=generator).squeeze(1)


def cfg_mixed(logits: Tensor, cfg_scale: float) -> Tensor:
    """Logits [2B, V] of B conditional rows then their B unconditional copies -> mixed [B, V]."""
    cond, uncond = torch.split(logits, len(logits) // 2, dim=0)
    return uncond + (cond - uncond) * cfg_scale


def decode_one_token(
    model: Transformer,
    token: Tensor,
    pos: Tensor,
    cache_k: Tensor,
    cache_v: Tensor,
    step_masks: Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Tensor:
    """One step of LlamaGen's loop (its ``decode_one_token``): the b tokens [b] at position
    ``pos`` ([1] int64, a tensor as LlamaGen's ``input_pos``, so that one compiled graph serves
    every position) over the static caches, their K/V written at ``pos``, and the next b tokens."""
    guided = sampling.guided
    h = model.tok_embeddings(torch.cat([token, token]) if guided else token).unsqueeze(1)
    logits, _, k, v = model.step(h, pos, step_masks[pos].view(1, 1, 1, -1), cache_k, cache_v)
    cache_k.index_copy_(3, pos, k)
    cache_v.index_copy_(3, pos, v)
    last = logits[:, -1]
    return sample(cfg_mixed(last, sampling.cfg_scale) if guided else last, sampling, generator)


def decode_chunk(
    model: Transformer,
    labels: Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    step: LoopStep | None = None,
) -> Tensor:
    """Tokens [b, block_size] for class ids ``labels`` [b]: prefill the condition prefix of 2b
    rows (b when ``cfg_scale <= 1``: LlamaGen runs no unconditional row then), then one token
    per row per step (``step``: :class:`LoopStep`, eager by default, or :class:`CompiledLoopStep`)
    into a static KV cache of cls_token_num + block_size."""
    step = step or LoopStep()
    cfg = model.config
    b, t, n = len(labels), cfg.cls_token_num, cfg.block_size
    guided = sampling.guided
    device, capacity = labels.device, cfg.cls_token_num + cfg.block_size
    shape = (cfg.n_layer, 2 * b if guided else b, cfg.kv_heads, capacity, cfg.head_dim)
    cache_k, cache_v = step.caches(shape, model.output.weight.dtype, device)
    # Row p: the slots committed before position p, then the new token itself (LlamaGen's causal_mask).
    step_masks = torch.ones(capacity, capacity + 1, dtype=torch.bool, device=device).tril(-1)
    step_masks[:, -1] = True
    positions = torch.arange(capacity, device=device)

    cond = torch.cat([labels, torch.full_like(labels, cfg.num_classes)]) if guided else labels
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    mask = torch.cat([torch.zeros(t, capacity, dtype=torch.bool, device=device), causal], dim=1)
    logits, _, k, v = model.step(
        model.embed_condition(cond), positions[:t], mask[None, None], cache_k, cache_v
    )
    cache_k[:, :, :, :t], cache_v[:, :, :, :t] = k, v
    mix = (lambda x: cfg_mixed(x, sampling.cfg_scale)) if guided else (lambda x: x)
    token = sample(mix(logits[:, -1]), sampling, generator)
    tokens = [token]
    pos = torch.tensor([t], device=device)  # LlamaGen's input_pos, advanced in place
    for _ in range(n - 1):
        # a copy: a step compiled with CUDA graphs overwrites its output at the next call
        token = step(model, token, pos, cache_k, cache_v, step_masks, sampling, generator).clone()
        tokens.append(token)
        pos += 1
    return torch.stack(tokens, dim=1)


def chunk_generator(seed: int, chunk: int, device: torch.device) -> torch.Generator:
    """The random stream of chunk ``chunk`` under ``seed``."""
    state = int(np.random.SeedSequence([seed, chunk]).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(state)


def check_runnable(cfg: GPTConfig) -> None:
    """:class:`ConfigError` unless the baseline can run a target of ``cfg``: LlamaGen's loop
    here is its class-conditional one."""
    if cfg.takes_prompts:
        raise ConfigError(
            f"the torch-batched baseline runs class-conditional models (LlamaGen's c2i loop), not {cfg.model_type}"
        )


class LoopStep:
    """:func:`decode_one_token` eager, with fresh zero caches for each chunk."""

    def __call__(self, *args) -> Tensor:
        return decode_one_token(*args)

    def caches(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """The K and V caches of a chunk, zeros."""
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


class CompiledLoopStep(LoopStep):
    """:func:`decode_one_token` compiled as LlamaGen's ``--compile`` compiles its own:
    ``torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)`` (CUDA graphs of
    inductor's kernels on a GPU). As LlamaGen's cache buffers, the caches stay at one address
    (static inputs, which the CUDA graphs may update in place): one pair per shape, zeroed for
    each chunk. Draws come from the global generator, as LlamaGen's do."""

    def __init__(self) -> None:
        self.compiled = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
        self.buffers: dict[tuple, tuple[Tensor, Tensor]] = {}

    def __call__(self, *args) -> Tensor:
        return self.compiled(*args[:-1], None)

    def caches(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, Tensor]:
        pair = self.buffers.get((shape, dtype, device))
        if pair is None:
            pair = self.buffers[shape, dtype, device] = super().caches(shape, dtype, device)
            for t in pair:
                torch._dynamo.mark_static_address(t)
        for t in pair:
            t.zero_()
        return pair


@torch.no_grad()
def torch_batched_ar(
    model: Transformer,
    labels: Sequence[int],
    sampling: SamplingConfig,
    batch_size: int,
    seed: int,
    step: LoopStep | None = None,
) -> BaselineRun:
    """LlamaGen-style batched AR decoding of class ``labels`` (c2i), ``batch_size`` images at a
    time (the last chunk may be smaller); ``seconds`` is the wall time of all chunks' loops.
    ``step``: :class:`LoopStep` (the default) or :class:`CompiledLoopStep` (its first call compiles)."""
    cfg = model.config
    check_runnable(cfg)
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    labels = [int(label) for label in labels]
    bad = sorted({label for label in labels if not 0 <= label < cfg.num_classes})
    if bad:
        raise ValueError(f"class ids must be in 0..{cfg.num_classes - 1}, got {bad}")
    device = model.output.weight.device
    chunks, seconds = [], 0.0
    for index, start in enumerate(range(0, len(labels), batch_size)):
        ids = torch.tensor(labels[start : start + batch_size], dtype=torch.long, device=device)
        generator = None if sampling.greedy else chunk_generator(seed, index, device)
        _synchronize(device)
        t0 = time.perf_counter()
        chunks.append(decode_chunk(model, ids, sampling, generator, step))
        _synchronize(device)
        seconds += time.perf_counter() - t0
    tokens = torch.cat(chunks).cpu() if chunks else torch.zeros(0, cfg.block_size, dtype=torch.long)
    return BaselineRun(tokens, seconds, seconds / len(labels) if labels else 0.0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
