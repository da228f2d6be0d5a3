"""An independent, formula-level forward of LlamaGen's GPT, computed from a state dict.

Written from the model's definition (not from our module): complex-number 2D RoPE with zero
rotation on the condition prefix, explicit softmax attention, RMSNorm, SwiGLU. Used to check
that our ``Transformer`` computes what LlamaGen computes on the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rope_2d_complex(cfg, seq_len: int) -> torch.Tensor:
    """Complex rotations [seq_len, head_dim/2]; zero (not one) on the prefix, as LlamaGen."""
    hd = cfg.dim // cfg.n_head
    half = hd // 2
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, half, 2, dtype=torch.float64) / half))
    rows = []
    for t in range(seq_len):
        if t < cfg.cls_token_num:
            rows.append(torch.zeros(hd // 2, dtype=torch.complex128))
            continue
        cell = t - cfg.cls_token_num
        r, c = divmod(cell, cfg.grid_size)
        angles = torch.cat([r * inv, c * inv])
        rows.append(torch.polar(torch.ones_like(angles), angles))
    return torch.stack(rows)


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(-2)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """LlamaGen's fp32 rotation as its ``gpt.py`` writes it: ``x`` [B, S, H, D], ``freqs_cis``
    [S, D/2, 2] of (cos, sin)."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        dim=-1,
    )
    return x_out2.flatten(3).type_as(x)


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def reference_logits(
    sd: dict, cfg, idx: torch.Tensor, cond: torch.Tensor, emb_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [B, cls + T, V] (float64) of a causal forward over prefix + ``idx``; with
    ``emb_mask`` [B, cls] (LlamaGen's ``generate``): the prefix columns it zeroes are masked for
    every query, then the diagonal is put back (``causal_mask * (1 - eye) + eye``)."""
    sd = {k: v.double() for k, v in sd.items()}
    if cfg.model_type == "c2i":
        prefix = sd["cls_embedding.embedding_table.weight"][cond][:, None]
    else:
        h = cond.double() @ sd["cls_embedding.cap_proj.fc1.weight"].T
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        prefix = h @ sd["cls_embedding.cap_proj.fc2.weight"].T
    x = torch.cat([prefix, sd["tok_embeddings.weight"][idx]], dim=1)
    b, s, _ = x.shape
    hd = cfg.dim // cfg.n_head
    kvh = cfg.n_kv_head or cfg.n_head
    rot = rope_2d_complex(cfg, s)
    allowed = torch.ones(s, s).tril()[None].repeat(b, 1, 1)
    if emb_mask is not None:
        allowed[:, :, : cfg.cls_token_num] *= emb_mask[:, None, :].double()
        eye = torch.eye(s)[None]
        allowed = allowed * (1 - eye) + eye
    causal = torch.zeros(b, 1, s, s, dtype=torch.float64).masked_fill(allowed[:, None] == 0, float("-inf"))
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        a = rms(x, sd[p + "attention_norm.weight"], cfg.norm_eps)
        qkv = a @ sd[p + "attention.wqkv.weight"].T
        q, k, v = qkv.split([cfg.dim, kvh * hd, kvh * hd], dim=-1)
        q = rotate(q.reshape(b, s, cfg.n_head, hd), rot)
        k = rotate(k.reshape(b, s, kvh, hd), rot)
        v = v.reshape(b, s, kvh, hd)
        rep = cfg.n_head // kvh
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd) + causal
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, cfg.dim)
        x = x + out @ sd[p + "attention.wo.weight"].T
        f = rms(x, sd[p + "ffn_norm.weight"], cfg.norm_eps)
        g = F.silu(f @ sd[p + "feed_forward.w1.weight"].T) * (f @ sd[p + "feed_forward.w3.weight"].T)
        x = x + g @ sd[p + "feed_forward.w2.weight"].T
    return rms(x, sd["norm.weight"], cfg.norm_eps) @ sd["output.weight"].T
