"""The Chameleon family (Anole, Lumina-mGPT) as the runtime's target and drafter.

A Chameleon decoder is a Llama block stack with per-head q/k LayerNorms, 1D RoPE in the
rotate-half convention and a 65536-word vocabulary whose image tokens are 8192 VQ codes.
lantern-rt runs it as its own :class:`~lantern_rt.models.target.Transformer` (``model_type
"chameleon"``), converted here once at load (docs/method.md §10):

- the vocabulary the runtime samples is the image codes alone: the output head keeps the LM
  head's rows of the image tokens, in code order, and ``tok_embeddings`` their embedding rows
  (softmax over those rows is the authors' masking of every other token to -inf);
- the prompt is embedded with the full table (``cls_embedding``);
- q and k rows are permuted within each head from rotate-half pairs (j, j + D/2) to the
  interleaved pairs (2j, 2j + 1) the runtime rotates: a common permutation of q and k leaves
  every attention score unchanged, so the graphs keep one RoPE implementation;
- q/k/v and gate/up are fused as LlamaGen's ``wqkv`` and ``w1``/``w3``.

The authors' drafters for these models (a Llama layer over the same 65536-word vocabulary and
rotate-half RoPE, ``jadohu/anole_drafter``) are converted the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lantern_rt.families.chameleon.model import ChameleonConfig, ChameleonTarget
from lantern_rt.models.config import ConfigError, GPTConfig, gpt_config
from lantern_rt.models.drafter import DrafterConfig
from lantern_rt.models.target import Transformer, rope_table


def runtime_config(
    config: ChameleonConfig, prompt_tokens: int, image_tokens: int, row_end: bool = False
) -> GPTConfig:
    """The runtime target's config: prompts of ``prompt_tokens`` slots (left padded), then
    ``image_tokens`` image tokens (with ``row_end``, Lumina-mGPT's layout, grid x (grid + 1):
    each row's codes and its end-of-row token, the vocabulary's last entry); a one-line
    :class:`ConfigError` for what it cannot run."""
    if not config.image_token_ids:
        raise ConfigError("the Chameleon config has no vocabulary_map, so its image tokens are unknown")
    for name in ("swin_norm", "attention_bias", "mlp_bias"):
        if getattr(config, name):
            raise ConfigError(
                f"Chameleon {name}=true is not supported by the runtime (Anole and Lumina-mGPT 7B use false)"
            )
    if prompt_tokens + image_tokens > config.max_position_embeddings:
        raise ConfigError(
            f"{prompt_tokens} prompt + {image_tokens} image tokens exceed the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    return gpt_config(
        None,
        model_type="chameleon",
        dim=config.hidden_size,
        n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads,
        n_kv_head=config.num_key_value_heads,
        ffn_hidden_size=config.intermediate_size,
        rope_base=float(config.rope_theta),
        norm_eps=float(config.rms_norm_eps),
        vocab_size=len(config.image_token_ids) + row_end,
        row_end=row_end,
        text_vocab_size=config.vocab_size,
        cls_token_num=prompt_tokens,
        block_size=image_tokens,
        qk_norm=config.qk_layernorm,
        token_dropout_p=0.0,
        resid_dropout_p=0.0,
        ffn_dropout_p=0.0,
    )


def image_vocabulary(config: ChameleonConfig, row_end_id: int | None = None) -> tuple[int, ...]:
    """The vocabulary ids of the runtime's tokens: the image tokens in code order, then the
    end-of-row token of a row-end layout."""
    return (*config.image_token_ids, *(() if row_end_id is None else (row_end_id,)))


def _interleaved(head_dim: int) -> Tensor:
    """The order that takes rotate-half pairs (j, j + D/2) to interleaved pairs (2j, 2j + 1)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()


def interleave_rope_rows(weight: Tensor, heads: int, head_dim: int) -> Tensor:
    """A q or k projection [heads * head_dim, dim] with each head's rows in interleaved order."""
    return weight.view(heads, head_dim, -1)[:, _interleaved(head_dim)].reshape(weight.shape)


def interleave_norm(param: Tensor) -> Tensor:
    """A per-head q/k norm weight or bias [rows, head_dim] with its columns in interleaved order
    (any rows: per head, or Lumina-mGPT's per shard)."""
    return param[..., _interleaved(param.shape[-1])]


def runtime_target(
    target: ChameleonTarget, prompt_tokens: int, image_tokens: int, row_end_id: int | None = None
) -> Transformer:
    """The runtime :class:`Transformer` holding ``target``'s weights (same dtype and device; the
    fused and permuted matrices are new tensors, the rest is shared), in eval mode; with
    ``row_end_id`` (the end-of-row token's vocabulary id), Lumina-mGPT's row-end layout."""
    c = target.config
    config = runtime_config(c, prompt_tokens, image_tokens, row_end_id is not None)
    ids = torch.tensor(image_vocabulary(c, row_end_id), device=target.lm_head.weight.device)
    hd, kv = c.head_dim, c.kv_heads
    state: dict[str, Tensor] = {
        "cls_embedding.weight": target.model.embed_tokens.weight,
        "tok_embeddings.weight": target.model.embed_tokens.weight[ids],
        "output.weight": target.lm_head.weight[ids],
        "norm.weight": target.model.norm.weight,
    }
    for i, layer in enumerate(target.model.layers):
        a, m, out = layer.self_attn, layer.mlp, f"layers.{i}."
        q = interleave_rope_rows(a.q_proj.weight, c.num_attention_heads, hd)
        k = interleave_rope_rows(a.k_proj.weight, kv, hd)
        state |= {
            out + "attention.wqkv.weight": torch.cat([q, k, a.v_proj.weight]),
            out + "attention.wo.weight": a.o_proj.weight,
            out + "feed_forward.w1.weight": m.gate_proj.weight,
            out + "feed_forward.w3.weight": m.up_proj.weight,
            out + "feed_forward.w2.weight": m.down_proj.weight,
            out + "attention_norm.weight": layer.input_layernorm.weight,
            out + "ffn_norm.weight": layer.post_attention_layernorm.weight,
        }
        if c.qk_layernorm:
            for name, norm in (("q_norm", a.q_norm), ("k_norm", a.k_norm)):
                for p in ("weight", "bias"):
                    state[f"{out}attention.{name}.{p}"] = interleave_norm(getattr(norm, p))
    with torch.device("meta"):  # no second copy of the weights, not even a random one
        model = Transformer(config)
    model.load_state_dict({k: v.detach() for k, v in state.items()}, strict=True, assign=True)
    model.register_buffer("freqs_cis", rope_table(config).to(ids.device), persistent=False)
    return model.eval()


PROMPT_TABLE = "prompt_table"  # the drafter's frozen prompt embedding (not in its state dict)


def runtime_drafter(
    config: DrafterConfig, state: dict[str, Tensor], target: GPTConfig, image_token_ids: tuple[int, ...]
) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """A drafter in the authors' Chameleon layout (vocabulary = the model's ``text_vocab_size``
    words, rotate-half RoPE) as the runtime's: its embedding as ``prompt_table`` and, in
    code order, the image tokens' rows as ``embed_tokens``; q/k rows and norms interleaved. A
    drafter already over the image codes (``lantern train-drafter``'s) is returned as it is.
    ``image_token_ids``: :func:`image_vocabulary`, the ids of the runtime's tokens."""
    if config.vocab_size == target.vocab_size:
        return config, state
    if config.vocab_size != target.text_vocab_size:
        raise ConfigError(
            f"drafter vocabulary {config.vocab_size} is neither the model's {target.text_vocab_size} "
            f"words nor its {target.vocab_size} image codes"
        )
    out = dict(state)
    key = "embed_tokens.weight"
    if key in out:
        out[PROMPT_TABLE] = out[key]
        out[key] = out[key][torch.tensor(image_token_ids)]
    for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.kv_heads)):
        for k in [k for k in out if k.endswith(f"self_attn.{name}.weight")]:
            out[k] = interleave_rope_rows(out[k], heads, config.head_dim)
    for k in [k for k in out if ".self_attn.q_norm." in k or ".self_attn.k_norm." in k]:
        out[k] = interleave_norm(out[k])
    return DrafterConfig(**{**config.__dict__, "vocab_size": target.vocab_size}), out
