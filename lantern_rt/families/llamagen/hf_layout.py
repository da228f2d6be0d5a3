"""The LANTERN authors' Hugging-Face-style conversion of LlamaGen (``jadohu/LlamaGen-T2I``, ``-T2I-2``).

Their target is ``LlamaForCausalLM`` of ``models/kv_variants/modeling_llamagen_kv.py`` (jadohu/LANTERN):
``model.embed_tokens``, ``model.cls_embedding`` (LlamaGen's CaptionEmbedder/LabelEmbedder, unchanged),
``model.layers.N.self_attn.{q,k,v,o}_proj``, ``model.layers.N.mlp.{gate,up,down}_proj``,
``model.layers.N.{input,post_attention}_layernorm``, ``model.norm`` and ``lm_head``. This module renames
those to LlamaGen's own names (concatenating q, k, v into ``wqkv``) and maps their ``config.json``.

No q/k row permutation is needed, unlike Meta-Llama -> HF conversions: their attention does not use HF's
``rotate_half`` RoPE. In ``LlamaAttention.forward`` (lines 540-544 of that file) the HF call
``apply_rotary_pos_emb`` (rotate_half, lines 372-387) is commented out and q and k are rotated by
``apply_rotary_emb`` (lines 213-223), LlamaGen's interleaved-pair rotation (``reshape(..., -1, 2)``), with
``freqs_cis`` from ``precompute_freqs_cis_2d`` (lines 197-211, LlamaGen's 2D table; built in
``LlamaModel.__init__`` line 998 from ``config.rope_base``, indexed by position at line 1105). ``_init_rope``
is commented out (lines 465-492), so no ``rotary_emb`` module exists. Their own runtime therefore reads the
q/k rows in LlamaGen's order, which is ours; GQA's ``repeat_kv`` (lines 426-435) groups heads like our
``repeat_interleave``. ``rope_theta`` is read (line 450) but unused; ``rope_base`` sets the rotation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import Tensor, cat

from lantern_rt.models.checkpoint import CheckpointError, read_state_dict
from lantern_rt.models.config import ConfigError, find_multiple, read_json, relative_path

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_QKV_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv]_proj)\.weight")
_RENAMES = {
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")
# saved by some transformers versions, never learned: the rotation is recomputed from the config
_DROPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "freqs_cis")


def is_hf_layout(state: dict) -> bool:
    """Whether ``state`` uses the authors' HF names (``model.layers.*``, ``model.embed_tokens.*``, ``lm_head``)."""
    return any(k == "lm_head.weight" or k.startswith(("model.layers.", "model.embed_tokens.")) for k in state)


def _rename(key: str) -> str:
    if key == "lm_head.weight":
        return "output.weight"
    if key.startswith("model.embed_tokens."):
        return "tok_embeddings." + key.removeprefix("model.embed_tokens.")
    if key.startswith(("model.cls_embedding.", "model.norm.")):
        return key.removeprefix("model.")
    found = _LAYER.fullmatch(key)
    if found and found[2] in _RENAMES:
        return f"layers.{found[1]}.{_RENAMES[found[2]]}"
    return key  # unknown: kept, so that strict loading names it


def from_hf_state(state: dict[str, Tensor], n_layer: int) -> dict[str, Tensor]:
    """The authors' HF-layout target state dict in LlamaGen's names (q, k, v -> ``wqkv``)."""
    out: dict[str, Tensor] = {}
    qkv: dict[int, dict[str, Tensor]] = {i: {} for i in range(n_layer)}
    for key, value in state.items():
        if key.endswith(_DROPPED):
            continue
        found = _QKV_KEY.fullmatch(key)
        if found:
            qkv.setdefault(int(found[1]), {})[found[2]] = value
        else:
            out[_rename(key)] = value
    missing = [f"model.layers.{i}.self_attn.{p}.weight" for i in sorted(qkv) for p in _QKV if p not in qkv[i]]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"HF-layout target lacks {', '.join(missing[:3])}{more}")
    for i, parts in qkv.items():
        shapes = [tuple(parts[p].shape) for p in _QKV]
        if len({s[1:] for s in shapes}) != 1:
            raise CheckpointError(
                f"HF-layout target layer {i}: q/k/v_proj shapes {shapes} do not concatenate"
            )
        out[f"layers.{i}.attention.wqkv.weight"] = cat([parts[p] for p in _QKV], dim=0)
    return out


def read_target_state(path: str | Path, n_layer: int) -> dict[str, Tensor]:
    """A target checkpoint in LlamaGen's names, whether it is LlamaGen's own file or the authors' HF one."""
    state = read_state_dict(path)
    return from_hf_state(state, n_layer) if is_hf_layout(state) else state


_REQUIRED = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "vocab_size": "vocab_size",
    "block_size": "block_size",
    "cls_token_num": "cls_token_num",
    "intermediate_size": None,
    "input_type": None,
}
_OPTIONAL = {
    "class_dropout_p": "class_dropout_prob",
    "token_dropout_p": "token_dropout_p",
    "resid_dropout_p": "resid_dropout_p",
    "ffn_dropout_p": "ffn_dropout_p",
}


def _ffn_sizing(dim: int, size: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """``multiple_of``/``ffn_dim_multiplier`` for which LlamaGen's SwiGLU rule gives ``size``."""
    for name, value in (("hidden_size", dim), ("intermediate_size", size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"HF target config {name} must be a positive integer, got {value!r}")
    base = int(2 * 4 * dim / 3)
    if "multiple_of" in raw or "ffn_dim_multiplier" in raw:  # LlamaGen's own fields, carried over: obey them
        tries = [
            {"multiple_of": raw.get("multiple_of", 256), "ffn_dim_multiplier": raw.get("ffn_dim_multiplier")}
        ]
    else:
        tries = [{"multiple_of": 2**p, "ffn_dim_multiplier": None} for p in range(8, -1, -1)]
        tries += [{"multiple_of": 1, "ffn_dim_multiplier": m} for m in (size / base, (size + 0.5) / base)]
    for t in tries:
        hidden = base if t["ffn_dim_multiplier"] is None else int(t["ffn_dim_multiplier"] * base)
        if find_multiple(hidden, t["multiple_of"]) == size:
            return t
    raise ConfigError(
        f"HF target config intermediate_size {size} does not match LlamaGen's FFN size for hidden_size {dim}"
        f" with multiple_of={tries[0]['multiple_of']}, ffn_dim_multiplier={tries[0]['ffn_dim_multiplier']}"
    )


def gpt_config_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig overrides from the authors' HF ``config.json``; unknown fields are ignored."""
    missing = [k for k in _REQUIRED if k not in raw]
    kind = raw.get("input_type")
    missing += [
        k for k, needs in (("caption_dim", "t2i"), ("num_classes", "c2i")) if kind == needs and k not in raw
    ]
    if missing:
        raise ConfigError(f"HF target config lacks {', '.join(missing)}")
    if kind not in ("c2i", "t2i"):
        raise ConfigError(f"HF target config input_type must be 'c2i' or 't2i', not {kind!r}")
    for flag in ("attention_bias", "tie_word_embeddings"):
        if raw.get(flag):
            raise ConfigError(f"HF target config sets {flag}, which LlamaGen's target never has")
    out = {ours: raw[theirs] for theirs, ours in _REQUIRED.items() if ours}
    out |= {ours: raw[theirs] for theirs, ours in _OPTIONAL.items() if theirs in raw}
    out["model_type"] = kind
    out["norm_eps"] = raw.get("rms_norm_eps", 1e-6)  # transformers' LlamaConfig default, which they run with
    cond = "caption_dim" if kind == "t2i" else "num_classes"
    out[cond] = raw[cond]
    if raw.get("num_key_value_heads") not in (None, raw["num_attention_heads"]):
        out["n_kv_head"] = raw["num_key_value_heads"]
    if "rope_base" in raw or "rope_theta" in raw:  # their code rotates with rope_base (line 998)
        out["rope_base"] = raw.get("rope_base", raw.get("rope_theta"))
    return out | _ffn_sizing(raw["hidden_size"], raw["intermediate_size"], raw)


def resolve_gpt_section(root: Path, section: dict[str, Any]) -> dict[str, Any]:
    """A model-dir ``gpt`` section with ``hf_config`` (a path below ``root``) expanded; its own keys win."""
    section = dict(section)
    name = section.pop("hf_config", None)
    if name is None:
        return section
    name = relative_path(root / "config.json", "gpt.hf_config", name)
    return gpt_config_from_hf(read_json(root / name)) | section
