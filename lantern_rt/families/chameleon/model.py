"""The Chameleon target family (Anole-7B, Lumina-mGPT) in Hugging Face ``transformers``' layout.

Parameter names match ``ChameleonForConditionalGeneration``'s checkpoint keys (less the VQ model's
``model.vqmodel.*``), so its state dicts load strictly. As in :mod:`lantern_rt.models.target`,
the forward pass is a pure step function with the K/V caches outside:
(embeddings, positions, mask, past K/V) -> (fp32 logits, final-norm hidden, new K/V).

Unlike ``transformers``, the logits are not masked: HF sets the image tokens' logits to the
dtype's minimum for text generation, and image generation needs exactly those tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.models.config import ConfigError, build_config, check_ranges
from lantern_rt.models.target import (  # HF's ChameleonRMSNorm is the same formula
    QKNorm,
    RMSNorm,
    cached_attention,
)

IMAGE_TOKEN_PREFIX = "IMGIMG"
ROW_END_TOKEN = "<reserved08799>"  # Lumina-mGPT's end of an image row (id 8803 in Chameleon's vocabulary)


@dataclass
class ChameleonConfig:
    """The Chameleon decoder, with the HF ``ChameleonConfig`` field names that shape it.

    ``image_token_ids[c]`` is the vocabulary id of VQ code ``c`` (from ``vocabulary_map``; empty
    when the config has none); ``image_token_id`` is the ``<image>`` placeholder's id and
    ``row_end_token_id`` Lumina-mGPT's end-of-row token's.
    """

    vocab_size: int = 65536
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    qk_layernorm: bool = True
    swin_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_parallel_size: int = 1
    image_token_id: int | None = None
    image_token_ids: tuple[int, ...] = ()
    row_end_token_id: int | None = None

    def __post_init__(self) -> None:
        check_ranges(self)
        if not self.rope_theta > 0:
            raise ConfigError(f"ChameleonConfig.rope_theta must be a number > 0, got {self.rope_theta!r}")
        if self.max_position_embeddings < 1 or self.model_parallel_size < 1:
            raise ConfigError("ChameleonConfig.max_position_embeddings and model_parallel_size must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} must be even for RoPE")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads "
                f"{self.kv_heads}"
            )
        bad = [i for i in self.image_token_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError(f"image token id {bad[0]} is outside the vocabulary of {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ChameleonConfig:
        """The config in an HF ``config.json`` dict (4.x or 5.x layout); unknown keys are ignored,
        an unsupported or ill-typed value is a one-line :class:`ConfigError`."""
        if not isinstance(raw, dict):
            raise ConfigError(f"a Chameleon config must be a JSON object, not {type(raw).__name__}")
        if raw.get("model_type", "chameleon") != "chameleon":
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not 'chameleon'")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
        if raw.get("tie_word_embeddings", False) is not False:
            raise ConfigError("tie_word_embeddings is not supported for Chameleon targets")
        skip = ("image_token_id", "image_token_ids", "row_end_token_id", "rope_theta")
        values = {
            f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw and f.name not in skip
        }
        config = build_config(cls, {**values, "rope_theta": _rope_theta(raw)})
        return dataclasses.replace(config, **_image_tokens(raw.get("vocabulary_map")))


def _rope_theta(raw: dict[str, Any]) -> float:
    """rope_theta from 5.x ``rope_parameters`` or 4.x ``rope_theta``; only default RoPE is supported."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"rope_parameters must be an object, got {params!r}"[:300])
        kind = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = raw.get("rope_scaling")
        kind = scaling  # 4.x: None (default RoPE) or {"type": ..., "factor": ...}
        if scaling is None:
            kind = "default"
        elif isinstance(scaling, dict):
            kind = scaling.get("rope_type", scaling.get("type"))
        theta = raw.get("rope_theta", 10000.0)
    if kind != "default":
        raise ConfigError(f"RoPE type {kind!r} is not supported (only the default RoPE)"[:300])
    return theta  # build_config checks its type


def _image_tokens(vocab: Any) -> dict[str, Any]:
    """``<image>``'s id and the ids of the ``IMGIMG...`` tokens ordered by VQ code.

    Chameleon spells code ``c`` as ``IMGIMG`` + the decimal digits of ``c`` written with the
    letters A..J + one trailing character (HF's ``ChameleonImageVocabularyMapping.bpe2img``).
    """
    if vocab is None:
        return {}
    if not isinstance(vocab, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in vocab.items()
    ):
        raise ConfigError("vocabulary_map must map token names to integer ids")
    digits = {chr(ord("A") + i): str(i) for i in range(10)}
    by_code: dict[int, int] = {}
    for name, token in vocab.items():
        if not name.startswith(IMAGE_TOKEN_PREFIX):
            continue
        code = "".join(digits.get(c, c) for c in name[len(IMAGE_TOKEN_PREFIX) : -1])
        if not code.isdigit():
            raise ConfigError(f"vocabulary_map image token {name!r} does not spell a VQ code"[:300])
        by_code[int(code)] = token
    if sorted(by_code) != list(range(len(by_code))):
        raise ConfigError(
            f"vocabulary_map's {len(by_code)} image tokens do not cover codes 0..{len(by_code) - 1}"
        )
    return {
        "image_token_id": vocab.get("<image>"),
        "image_token_ids": tuple(by_code[c] for c in range(len(by_code))),
        "row_end_token_id": vocab.get(ROW_END_TOKEN),
    }


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class ChameleonAttention(nn.Module):
    def __init__(self, config: ChameleonConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = (
            config.num_attention_heads,
            config.kv_heads,
            config.head_dim,
        )
        dim, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(dim, dim, bias=bias)
        self.q_norm = QKNorm(self.n_head, self.head_dim) if config.qk_layernorm else None
        self.k_norm = QKNorm(self.n_kv_head, self.head_dim) if config.qk_layernorm else None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        past_k: Tensor | None = None,
        past_v: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attend ``x`` [B, S, dim] over past K/V [B, Hkv, P, D] plus itself; ``cos``/``sin``
        [S, D] or [B, 1, S, D]; ``mask`` bool [B or 1, 1, S, P + S] (None: causal over ``x``).
        Returns (output, k, v) with k/v [B, Hkv, S, D] of the new positions only."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_head, self.head_dim)
        k = self.k_proj(x).view(b, s, self.n_kv_head, self.head_dim)
        v = self.v_proj(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return self.o_proj(cached_attention(q, k, v, past_k, past_v, mask)), k, v


class ChameleonMLP(nn.Module):
    def __init__(self, config: ChameleonConfig):
        super().__init__()
        dim, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ChameleonDecoderLayer(nn.Module):
    """Pre-norm block, or with ``swin_norm`` the Swin order: the norms follow attention and MLP."""

    def __init__(self, config: ChameleonConfig):
        super().__init__()
        self.swin_norm = config.swin_norm
        self.self_attn = ChameleonAttention(config)
        self.mlp = ChameleonMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, past_k=None, past_v=None):
        if self.swin_norm:
            a, k, v = self.self_attn(x, cos, sin, mask, past_k, past_v)
            h = x + self.input_layernorm(a)
            return h + self.post_attention_layernorm(self.mlp(h)), k, v
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


def rope_frequencies(config: ChameleonConfig) -> Tensor:
    """The rotate-half RoPE's inverse frequencies [head_dim / 2], fp32."""
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


class ChameleonBody(nn.Module):
    """HF's ``ChameleonModel`` without the VQ model: embeddings, decoder layers, final norm."""

    def __init__(self, config: ChameleonConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ChameleonDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)


class ChameleonTarget(nn.Module):
    """``ChameleonForConditionalGeneration``'s decoder with a pure, cache-external step function."""

    def __init__(self, config: ChameleonConfig):
        super().__init__()
        self.config = config
        self.model = ChameleonBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids [B, S] -> embeddings [B, S, dim], the ``h`` that :meth:`step` takes."""
        return self.model.embed_tokens(ids)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) of 1D RoPE at ``positions`` [S] -> [S, D] or [B, S] -> [B, 1, S, D]."""
        freqs = positions.unsqueeze(-1).float() * self.model.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def step(
        self, h: Tensor, positions: Tensor, mask: Tensor, past_k: Tensor | None, past_v: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One decode call over new embeddings ``h`` [B, S, dim] at ``positions`` [S] or [B, S].

        ``past_k``/``past_v``: [n_layer, B, Hkv, P, D], or None for an empty cache (P = 0);
        ``mask``: bool [B or 1, 1, S, P + S], True where attention is allowed. Returns fp32
        logits [B, S, V], the final-norm hidden state [B, S, dim] and the new keys/values
        [n_layer, B, Hkv, S, D] of these S positions.
        """
        cos, sin = self.rope(positions, h.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.model.layers):
            past = (None, None) if past_k is None or past_v is None else (past_k[i], past_v[i])
            h, k, v = layer(h, cos, sin, mask, *past)
            new_k.append(k)
            new_v.append(v)
        hidden = self.model.norm(h)
        return self.lm_head(hidden).float(), hidden, torch.stack(new_k), torch.stack(new_v)

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """Final-norm hidden states [B, T, dim] of a full causal pass from position 0."""
        h = self.embed(input_ids)
        cos, sin = self.rope(torch.arange(input_ids.shape[1], device=input_ids.device), h.dtype)
        for layer in self.model.layers:
            h, _, _ = layer(h, cos, sin)
        return self.model.norm(h)

    def forward(self, input_ids: Tensor) -> Tensor:
        """fp32 logits [B, T, V] of a full causal pass over ``input_ids`` [B, T] (unmasked)."""
        return self.lm_head(self.hidden_states(input_ids)).float()
