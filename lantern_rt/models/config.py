"""Model configurations in LlamaGen's terms: the target GPT, the VQ tokenizer and the presets."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lantern_rt.errors import LanternError


class ConfigError(LanternError, ValueError):
    """A model configuration is invalid or does not match the weights."""


def find_multiple(n: int, k: int) -> int:
    """Round ``n`` up to a multiple of ``k`` (LlamaGen's SwiGLU sizing rule)."""
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTConfig:
    """The target transformer, with LlamaGen's ``ModelArgs`` field names."""

    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.model_type not in ("c2i", "t2i"):
            raise ConfigError(f"model_type must be 'c2i' or 't2i', not {self.model_type!r}")
        if self.dim % self.n_head:
            raise ConfigError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if self.head_dim % 4:
            raise ConfigError(f"head dim {self.head_dim} must be a multiple of 4 for 2D RoPE")
        grid = round(self.block_size**0.5)
        if grid * grid != self.block_size:
            raise ConfigError(f"block_size {self.block_size} is not a square token grid")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"n_head {self.n_head} is not a multiple of n_kv_head")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        return round(self.block_size**0.5)

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return find_multiple(hidden, self.multiple_of)


@dataclass
class VQConfig:
    """The VQ tokenizer, with LlamaGen's ``ModelArgs`` field names plus the image geometry."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    commit_loss_beta: float = 0.25
    entropy_loss_ratio: float = 0.0
    encoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    decoder_ch_mult: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    z_channels: int = 256
    dropout_p: float = 0.0
    ch: int = 128
    num_res_blocks: int = 2
    in_channels: int = 3
    out_channels: int = 3

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.decoder_ch_mult) - 1)


# LlamaGen's published presets (autoregressive/models/gpt.py and tokenizer_image/vq_model.py).
GPT_PRESETS: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}
VQ_PRESETS: dict[str, dict[str, list[int]]] = {
    "VQ-16": dict(encoder_ch_mult=[1, 1, 2, 2, 4], decoder_ch_mult=[1, 1, 2, 2, 4]),
    "VQ-8": dict(encoder_ch_mult=[1, 2, 2, 4], decoder_ch_mult=[1, 2, 2, 4]),
}


def gpt_config(preset: str | None = None, **overrides: Any) -> GPTConfig:
    """A target config from a LlamaGen preset name (or none) plus field overrides."""
    return _build(GPTConfig, _preset_values("GPT", GPT_PRESETS, preset) | overrides)


def vq_config(preset: str | None = None, **overrides: Any) -> VQConfig:
    """A tokenizer config from a LlamaGen preset name (or none) plus field overrides."""
    return _build(VQConfig, _preset_values("VQ", VQ_PRESETS, preset) | overrides)


def _preset_values(kind: str, presets: dict[str, dict[str, Any]], preset: str | None) -> dict[str, Any]:
    if preset is None:
        return {}
    if preset not in presets:
        raise ConfigError(f"unknown {kind} preset {preset!r}; choose from {', '.join(presets)}")
    return dict(presets[preset])


def _is_number(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


# a field's annotation -> whether a JSON value fits it
_FITS = {
    "int": lambda v: _is_number(v, (int,)),
    "int | None": lambda v: v is None or _is_number(v, (int,)),
    "float": lambda v: _is_number(v, (int, float)),
    "float | None": lambda v: v is None or _is_number(v, (int, float)),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list[int]": lambda v: isinstance(v, list) and all(_is_number(x, (int,)) for x in v),
}


def _build(cls: type, values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
    for name, value in values.items():
        annotation = str(fields[name].type)
        if not _FITS[annotation](value):
            raise ConfigError(f"{cls.__name__}.{name} must be {annotation}, got {value!r}"[:300])
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def config_from_dict(cls: type, values: dict[str, Any]) -> Any:
    """Rebuild a config dataclass from its JSON form, resolving an optional ``preset`` key."""
    values = dict(values)
    preset = values.pop("preset", None)
    if cls is GPTConfig:
        return gpt_config(preset, **values)
    return vq_config(preset, **values)


def to_dict(config: GPTConfig | VQConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
