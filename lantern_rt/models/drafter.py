"""The EAGLE-1 style drafter, in the parameter layout of the authors' LlamaGen drafter.

Input fusion ``fc(concat(embed(x_t), f_{t-1}))`` (2H -> H, with bias), then Llama decoder
layers (layer 0 without input RMSNorm, as in EAGLE; with it, and with per-head q/k norms, in the
authors' Chameleon-family drafters), no final norm. It predicts the target's
next final-norm hidden state; the target's frozen LM head turns it into logits. Key names match
the authors' checkpoints (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...), so their
``config.json`` + state dict and our safetensors files load the same way.

Positions follow the target: the pair holding token x_j uses the target's RoPE row of x_j (2D
for LlamaGen, 1D for the Chameleon family, whose drafters are converted on load by
:mod:`lantern_rt.families.chameleon.convert`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.models.config import ConfigError, GPTConfig, build_config, check_ranges
from lantern_rt.models.target import (
    QKNorm,
    RMSNorm,
    attention_bias,
    attention_heads,
    cached_attention,
    join_linears,
    rope_rows,
    rope_table,
)


@dataclass
class DrafterConfig:
    """Field names of the Hugging Face Llama config the authors' drafters ship with.

    ``qk_norm`` and ``first_layer_norm`` (per-head q/k LayerNorms; an input RMSNorm on layer 0
    too) shape the authors' Chameleon-family drafters, whose config is a ``model_type:
    chameleon`` one (:meth:`from_dict` sets both for it)."""

    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int | None = None
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    bias: bool = True
    qk_norm: bool = False
    first_layer_norm: bool = False

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"drafter hidden_size {self.hidden_size} is not divisible by"
                f" num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"drafter num_attention_heads {self.num_attention_heads} is not a multiple of"
                f" num_key_value_heads {self.kv_heads}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        """From our config or an EAGLE/HF ``config.json`` (unknown keys are ignored); each field's
        type and range is checked (a :class:`ConfigError` names it)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"a drafter config is a JSON object, got {type(raw).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in names}
        if raw.get("model_type") == "chameleon":  # the authors' cnets_anole.py layer
            values |= {"qk_norm": True, "first_layer_norm": True}
        return build_config(cls, values)

    @classmethod
    def for_target(cls, target: GPTConfig, num_hidden_layers: int = 1) -> DrafterConfig:
        """A drafter shaped like the target's blocks (what EAGLE prescribes)."""
        return cls(
            hidden_size=target.dim,
            num_attention_heads=target.n_head,
            num_key_value_heads=target.n_kv_head,
            intermediate_size=target.ffn_hidden,
            vocab_size=target.vocab_size,
            num_hidden_layers=num_hidden_layers,
            rms_norm_eps=target.norm_eps,
            qk_norm=target.qk_norm,
            first_layer_norm=target.model_type == "chameleon",  # the authors' Chameleon drafters
        )


def check_compatible(drafter: DrafterConfig, target: GPTConfig) -> None:
    """The drafter must read the target's hidden states and emit its vocabulary."""
    if drafter.hidden_size != target.dim:
        raise ConfigError(f"drafter hidden size {drafter.hidden_size} != target hidden size {target.dim}")
    if drafter.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {target.vocab_size}")
    if drafter.head_dim != target.head_dim:
        raise ConfigError(
            f"drafter head dim {drafter.head_dim} != target head dim {target.head_dim} (RoPE table)"
        )


class DrafterAttention(nn.Module):
    """Llama attention; ``q_proj``, ``k_proj`` and ``v_proj`` are one product (``qkv_proj``)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = c.num_attention_heads, c.kv_heads, c.head_dim
        q, kv = self.n_head * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = QKNorm(self.n_head, self.head_dim)
            self.k_norm = QKNorm(self.n_kv, self.head_dim)
        join_linears(self, "qkv_proj", {"q_proj": q, "k_proj": kv, "v_proj": kv})

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor | None,
        past_k: Tensor | None,
        past_v: Tensor | None,
    ):
        q, k, v = attention_heads(self, self.qkv_proj(x), self.n_head, self.n_kv, rope)
        return self.o_proj(cached_attention(q, k, v, past_k, past_v, mask)), k, v


class DrafterMLP(nn.Module):
    """SwiGLU; ``gate_proj`` and ``up_proj`` are one product (``gate_up_proj``)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        join_linears(self, "gate_up_proj", {"gate_proj": c.intermediate_size, "up_proj": c.intermediate_size})

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig, index: int):
        super().__init__()
        self.self_attn = DrafterAttention(c)
        self.mlp = DrafterMLP(c)
        if index != 0 or c.first_layer_norm:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, rope, mask=None, past_k=None, past_v=None):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        a, k, v = self.self_attn(h, rope, mask, past_k, past_v)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Drafter(nn.Module):
    """EAGLE-1 drafter over a target of config ``target``; the LM head is the target's.

    For a prompt-token target (the Chameleon family) it also reads ``prompt_table``, the
    embedding of the whole vocabulary: the prefix pairs carry the prompt's next token, as the
    authors' Anole drafter is fed (docs/method.md §10); ``embed_tokens`` holds the image codes'
    rows. The table is frozen and equals the target's (the authors' drafters keep a copy of it,
    trained ones take it from the target: ``model_dir.load_drafter``), so it is not part of the
    drafter's saved state."""

    def __init__(self, config: DrafterConfig, target: GPTConfig):
        super().__init__()
        check_compatible(config, target)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if target.model_type == "chameleon":
            table = torch.zeros(target.text_vocab_size, config.hidden_size)
            self.register_buffer("prompt_table", table, persistent=False)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.register_buffer("freqs_cis", rope_table(target), persistent=False)

    def step(
        self,
        tokens: Tensor,
        hidden: Tensor,
        positions: Tensor,
        mask: Tensor,
        past_k: Tensor | None,
        past_v: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Pairs (token [B, S], or its embedding [B, S, H], previous target hidden [B, S, H]) at
        ``positions`` [S].

        ``past_k``/``past_v`` [n_layer, B, Hkv, P, D] (None: P = 0), ``mask`` bool [B or 1, 1,
        S, P + S].
        Returns the predicted hidden states [B, S, H] and the new K/V [n_layer, B, Hkv, S, D].
        """
        h = self.fc(torch.cat([self.embed(tokens), hidden.to(self.fc.weight.dtype)], dim=-1))
        rope, bias = rope_rows(self.freqs_cis, positions), attention_bias(mask, h.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            past = (None, None) if past_k is None or past_v is None else (past_k[i], past_v[i])
            h, k, v = layer(h, rope, bias, *past)
            new_k.append(k)
            new_v.append(v)
        return h, torch.stack(new_k), torch.stack(new_v)

    @property
    def takes_prompts(self) -> bool:
        """Whether the prefix pairs carry prompt tokens (:meth:`embed_prompt`)."""
        return hasattr(self, "prompt_table")

    def embed_prompt(self, ids: Tensor) -> Tensor:
        """Prompt token ids of the whole vocabulary [B, S] -> embeddings [B, S, H]."""
        return F.embedding(ids, self.prompt_table)

    def embed(self, tokens: Tensor) -> Tensor:
        """Image codes [B, S] -> their embeddings; embeddings (a prompt's) pass through."""
        return tokens.to(self.fc.weight.dtype) if tokens.is_floating_point() else self.embed_tokens(tokens)

    def forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        """Causal training forward over whole sequences of pairs: [B, S] and [B, S, H] -> [B, S, H]."""
        h = self.fc(torch.cat([self.embed(tokens), hidden], dim=-1))
        rope = rope_rows(self.freqs_cis, positions)
        for layer in self.layers:
            h, _, _ = layer(h, rope)
        return h


# Keys older transformers versions saved with a drafter; they carry no learned state.
IGNORED_EAGLE_KEYS = ("rotary_emb.inv_freq",)


def clean_eagle_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop keys that do not belong to the drafter's learned state."""
    return {k: v for k, v in state.items() if not k.endswith(IGNORED_EAGLE_KEYS)}
