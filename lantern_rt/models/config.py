"""Model configurations in LlamaGen's terms: the target GPT, the VQ tokenizer and the presets."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from lantern_rt.errors import LanternError


class ConfigError(LanternError, ValueError):
    """A model configuration is invalid or does not match the weights."""


def find_multiple(n: int, k: int) -> int:
    """Round ``n`` up to a multiple of ``k`` (LlamaGen's SwiGLU sizing rule)."""
    return n if n % k == 0 else n + k - (n % k)


MODEL_TYPES = ("c2i", "t2i", "chameleon")


@dataclass
class GPTConfig:
    """The target transformer, with LlamaGen's ``ModelArgs`` field names.

    ``model_type`` names the condition: ``c2i`` a class id, ``t2i`` T5 caption features,
    ``chameleon`` a prompt of ``text_vocab_size``-word token ids (the Chameleon family, converted
    by :mod:`lantern_rt.families.chameleon.convert`: 1D RoPE over every position, per-head q/k
    LayerNorm with ``qk_norm``, an explicit ``ffn_hidden_size``, image codes as the vocabulary).
    With ``row_end`` (Lumina-mGPT) every row of the grid ends with a forced end-of-row token, the
    vocabulary's last entry: ``block_size`` is grid x (grid + 1) (:func:`~lantern_rt.models.target.layout_logits`).
    """

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
    text_vocab_size: int | None = None
    qk_norm: bool = False
    ffn_hidden_size: int | None = None
    row_end: bool = False

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type must be one of {', '.join(MODEL_TYPES)}, not {self.model_type!r}")
        if (self.model_type == "chameleon") != (self.text_vocab_size is not None):
            raise ConfigError("text_vocab_size is set for (and only for) model_type 'chameleon'")
        if self.dim % self.n_head:
            raise ConfigError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if self.head_dim % (2 if self.rope_1d else 4):
            raise ConfigError(
                f"head dim {self.head_dim} must be a multiple of {2 if self.rope_1d else 4} for "
                f"{'1D' if self.rope_1d else '2D'} RoPE"
            )
        if self.row_end and self.model_type != "chameleon":
            raise ConfigError("row_end is a Chameleon-family (Lumina-mGPT) layout")
        grid = self.grid_size
        if grid * (grid + self.row_end) != self.block_size:
            shape = (
                "grid x (grid + 1) tokens (a row-end token per row)"
                if self.row_end
                else "a square token grid"
            )
            raise ConfigError(f"block_size {self.block_size} is not {shape}")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")
        if self.ffn_hidden < 1:
            raise ConfigError(f"ffn_dim_multiplier {self.ffn_dim_multiplier} leaves no FFN hidden units")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def grid_size(self) -> int:
        """Codes along each side of the image (the row-end tokens not counted)."""
        return int((self.block_size + 0.25) ** 0.5 - 0.5) if self.row_end else round(self.block_size**0.5)

    @property
    def takes_prompts(self) -> bool:
        """Whether images are conditioned on text prompts (T5 captions or prompt tokens)."""
        return self.model_type != "c2i"

    @property
    def rope_1d(self) -> bool:
        """Whether positions rotate by one index (Chameleon) rather than LlamaGen's (row, column)."""
        return self.model_type == "chameleon"

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
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

    def __post_init__(self) -> None:
        check_ranges(self)

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
    return build_config(GPTConfig, _preset_values("GPT", GPT_PRESETS, preset) | overrides)


def vq_config(preset: str | None = None, **overrides: Any) -> VQConfig:
    """A tokenizer config from a LlamaGen preset name (or none) plus field overrides."""
    return build_config(VQConfig, _preset_values("VQ", VQ_PRESETS, preset) | overrides)


def _preset_values(kind: str, presets: dict[str, dict[str, Any]], preset: str | None) -> dict[str, Any]:
    if preset is None:
        return {}
    if not isinstance(preset, str) or preset not in presets:
        raise ConfigError(f"unknown {kind} preset {preset!r}; choose from {', '.join(presets)}")
    return dict(presets[preset])


def _is_number(value: Any, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return _is_number(value, (int, float)) and math.isfinite(value)


# a field's annotation -> whether a JSON value fits it (a float is finite: JSON's NaN is refused)
_FITS = {
    "int": lambda v: _is_number(v, (int,)),
    "int | None": lambda v: v is None or _is_number(v, (int,)),
    "float": _is_real,
    "float | None": lambda v: v is None or _is_real(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list[int]": lambda v: isinstance(v, list) and all(_is_number(x, (int,)) for x in v),
}


_AT_LEAST_1 = ("an integer >= 1", lambda v: v >= 1)
_POSITIVE = ("a number > 0", lambda v: v > 0)
_NON_NEGATIVE = ("a number >= 0", lambda v: v >= 0)
_PROBABILITY = ("a probability in 0..1", lambda v: 0 <= v <= 1)
_FACTORS = ("a non-empty list of integers >= 1", lambda v: len(v) > 0 and min(v) >= 1)

# fields that count or size something (in GPTConfig, VQConfig and DrafterConfig)
_SIZES = (
    *("dim", "n_layer", "n_head", "n_kv_head", "multiple_of", "num_classes", "caption_dim", "vocab_size"),
    *("cls_token_num", "block_size", "codebook_size", "codebook_embed_dim", "z_channels", "ch"),
    *("num_res_blocks", "in_channels", "out_channels", "hidden_size", "num_attention_heads"),
    *("num_key_value_heads", "intermediate_size", "num_hidden_layers", "text_vocab_size"),
    "ffn_hidden_size",
)
# the range of every numeric config field, by field name: (what it must be, whether a value is);
# a None value (a field's "unset") is not checked
_RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **dict.fromkeys(_SIZES, _AT_LEAST_1),
    **dict.fromkeys(("ffn_dim_multiplier", "rope_base"), _POSITIVE),
    **dict.fromkeys(("norm_eps", "rms_norm_eps", "commit_loss_beta", "entropy_loss_ratio"), _NON_NEGATIVE),
    **dict.fromkeys(("token_dropout_p", "attn_dropout_p", "resid_dropout_p", "ffn_dropout_p"), _PROBABILITY),
    **dict.fromkeys(("class_dropout_prob", "dropout_p"), _PROBABILITY),
    **dict.fromkeys(("encoder_ch_mult", "decoder_ch_mult"), _FACTORS),
}


def check_ranges(config: Any) -> None:
    """:class:`ConfigError` naming the first field of the dataclass ``config`` out of its range."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in _RANGES and value is not None and not _RANGES[f.name][1](value):
            what = _RANGES[f.name][0]
            raise ConfigError(f"{type(config).__name__}.{f.name} must be {what}, got {value!r}"[:300])


def build_config(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` for a config dataclass, each value checked against its field's type
    (:data:`_FITS`), then its range (:data:`_RANGES`): a :class:`ConfigError` names the field."""
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


def relative_path(file: Path, field: str, name: Any) -> str:
    """``name`` (the ``field`` of config ``file``) as a path inside the file's folder: a
    non-empty string, neither absolute nor with '..'; :class:`ConfigError` otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{file}: {field} must be a file name, got {name!r}"[:300])
    if PurePath(name).is_absolute() or ".." in PurePath(name).parts:
        raise ConfigError(
            f"{file}: {field} {name!r} is outside the model directory; give a path relative to it, without '..'"
        )
    return name


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
    """The JSON object in the config file ``path``; anything else is a :class:`ConfigError`."""
    try:
        raw = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a JSON file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not text (not UTF-8): is it a JSON file?") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        why = exc if isinstance(exc, json.JSONDecodeError) else "it nests too deeply"
        raise ConfigError(f"config file {path} is not valid JSON: {why}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} holds a JSON {type(raw).__name__}, not an object {{...}}")
    return raw
