"""A model directory: ``config.json`` naming the target, tokenizer (and drafter) weight files.

The built-in demo is such a directory inside the package. A user with LlamaGen's released
checkpoints writes a ``config.json`` beside them, for example::

    {"gpt": {"preset": "GPT-B", "num_classes": 1000, "vocab_size": 16384, "block_size": 256},
     "vq": {"preset": "VQ-16", "codebook_size": 16384, "codebook_embed_dim": 8},
     "files": {"gpt": "c2i_B_256.pt", "vq": "vq_ds16_c2i.pt"}, "image_size": 256}

A Chameleon-family model (Anole, Lumina-mGPT) is named by its Hugging Face folder instead::

    {"family": "chameleon", "files": {"chameleon": "Anole-7b-v0.1-hf"},
     "prompt": {"layout": "anole", "tokens": 64}}

(the target, the VQGAN and the tokenizer all come from that folder; ``image_size`` defaults to
the VQGAN's resolution, 512 px: 32 x 32 tokens for Anole; Lumina-mGPT-7B-768 takes
``"prompt": {"layout": "lumina", ...}, "image_size": 768``).

Each family reads its own sections (``lantern_rt.families``); this module holds what they
share: the parsed directory and the checks of the common sections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lantern_rt.models.config import ConfigError, GPTConfig, relative_path
from lantern_rt.models.sampling_config import setting_types

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_model"
FORMAT_VERSION = 1


@dataclass
class ModelDir:
    """A parsed model directory (nothing loaded yet): what every family has, plus ``details``,
    what its family parsed beyond that (only the family reads it). Open one with
    :func:`lantern_rt.families.loading.open_model_dir`."""

    root: Path
    raw: dict[str, Any]
    gpt: GPTConfig
    vq: Any  # the family's tokenizer config (``codebook_size``, ``downsample``, ``out_channels``)
    files: dict[str, str]
    image_size: int
    class_names: list[str]
    family: str  # its name in the registry (lantern_rt.families.registry)
    details: Any = None

    def path(self, key: str) -> Path:
        """The file or folder ``files[key]`` names; :class:`ConfigError` when it names none."""
        if key not in self.files:
            raise ConfigError(f"{self.root / 'config.json'} names no '{key}' file")
        return self.root / self.files[key]

    @property
    def name(self) -> str:
        """The model's name: ``config.json``'s ``name``, else its folder's."""
        return str(self.raw.get("name", self.root.name))

    def class_id(self, spec: str | int) -> int:
        """A class id from an integer or a class name (case-insensitive); validated."""
        text = str(spec).strip()
        lowered = [n.lower() for n in self.class_names]
        if text.lower() in lowered:
            return lowered.index(text.lower())
        try:
            cid = int(text)
        except ValueError:
            raise ConfigError(
                f"unknown class {text!r}; use an id 0..{self.gpt.num_classes - 1} or one of: {', '.join(self.class_names)}"
            ) from None
        if not 0 <= cid < self.gpt.num_classes:
            raise ConfigError(f"class id {cid} is out of range 0..{self.gpt.num_classes - 1}")
        return cid


def is_int(value: Any) -> bool:
    """Whether a JSON value is an integer (``true`` is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def files_section(file: Path, files: dict[str, Any]) -> dict[str, str]:
    """The ``files`` section: each entry a path relative to the model directory, inside it."""
    return {key: relative_path(file, f"files.{key}", name) for key, name in files.items()}


def check_sampling_defaults(file: Path | str, raw: dict[str, Any]) -> None:
    """The optional ``sampling_defaults``: an object of finite numbers, each named by a setting of
    :class:`~lantern_rt.models.sampling_config.SamplingConfig` and an integer where that is one;
    their ranges are the config's."""
    values = raw.get("sampling_defaults", {})
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: sampling_defaults must be an object, got {values!r}"[:300])
    for key, value in values.items():
        if key not in setting_types():
            raise ConfigError(
                f"{file}: sampling_defaults.{key} is unknown; use {', '.join(sorted(setting_types()))}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{file}: sampling_defaults.{key} must be a finite number, got {value!r}"[:300])
        if setting_types()[key] is int and not is_int(value):
            raise ConfigError(f"{file}: sampling_defaults.{key} must be an integer, got {value!r}"[:300])


def class_names_section(file: Path, raw: dict[str, Any], gpt: GPTConfig) -> list[str]:
    """The optional ``class_names``: a list of strings, one per class (empty: no names)."""
    names = raw.get("class_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{file}: class_names must be a list of strings, got {names!r}"[:300])
    if names and len(names) != gpt.num_classes:
        raise ConfigError(f"{file}: class_names has {len(names)} names for gpt.num_classes {gpt.num_classes}")
    return names
