"""Test-only reference: greedy classifier-free-guided image-token decoding with transformers' own
Chameleon and its own KV cache, independent of lantern_rt's runtime.

The HF model is driven as ``generate`` drives a left-padded batch: a 2-D ``attention_mask`` that
masks the pad slots, and per-row ``position_ids = cumsum(mask) - 1``, each new token at its row's
last position + 1 (RoPE makes a constant per-row offset invisible; a jump between the prompt and
the generated tokens is not). The logits are computed as
``model.lm_head(model.model(...).last_hidden_state)``: ``ChameleonForConditionalGeneration.forward``
sets every image token's logit to the dtype's minimum (it is made for text generation).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor


def _cache_keyword(decoder: torch.nn.Module) -> str:
    """transformers 5.x renames ``past_key_values`` to ``cache`` (the old name still works)."""
    names = inspect.signature(type(decoder).forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def _returned_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def hf_greedy_cfg(
    model: torch.nn.Module,
    ids: Tensor,
    mask: Tensor,
    num_tokens: int,
    cfg_scale: float,
    image_token_ids: Sequence[int],
    row_end: tuple[int, int] | None = None,
) -> Tensor:
    """``num_tokens`` VQ codes (indices into ``image_token_ids``), int64 [num_tokens].

    ``ids`` int64 [2, T] (row 0 conditional, row 1 unconditional, each row's last slot real),
    ``mask`` bool [2, T] (True on real tokens). Each step: the logits of the image tokens only
    (every other id is -inf, so left out), ``uncond + cfg_scale * (cond - uncond)`` when
    ``cfg_scale > 1`` else the conditional row's, argmax; the chosen code's vocabulary id is fed
    to both rows. With ``row_end`` (end-of-row id, grid), Lumina-mGPT's layout: every
    (grid + 1)-th token is that id, fed without a choice, and returned as code
    ``len(image_token_ids)``.
    """
    if ids.dim() != 2 or ids.shape[0] != 2 or mask.shape != ids.shape:
        raise ValueError(f"ids and mask must both be [2, T], got {tuple(ids.shape)} and {tuple(mask.shape)}")
    if not bool(mask[:, -1].all()):
        raise ValueError("the last slot of each row must be a real token (left padding)")
    decoder, head = model.model, model.lm_head
    device = head.weight.device
    image = torch.as_tensor(list(image_token_ids), dtype=torch.int64, device=device)
    keyword = _cache_keyword(decoder)
    attention = mask.to(device=device, dtype=torch.int64)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    step_ids, step_positions, cache = ids.to(device), positions, None
    codes = []
    for i in range(num_tokens):
        out = decoder(
            input_ids=step_ids,
            attention_mask=attention,
            position_ids=step_positions,
            use_cache=True,
            **{keyword: cache},
        )
        cache = _returned_cache(out)
        logits = head(out.last_hidden_state[:, -1]).float()[:, image]  # [2, n_image]
        cond, uncond = logits[0], logits[1]
        guided = uncond + cfg_scale * (cond - uncond) if cfg_scale > 1 else cond
        code = int(guided.argmax())
        token = image[code]
        if row_end is not None and i % (row_end[1] + 1) == row_end[1]:
            code, token = len(image), torch.tensor(row_end[0], device=device)
        codes.append(code)
        step_ids = token.view(1, 1).expand(2, 1)
        step_positions = step_positions[:, -1:] + 1
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
    return torch.tensor(codes, dtype=torch.int64)
