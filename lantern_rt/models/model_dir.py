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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lantern_rt.models.chameleon import ROW_END_TOKEN
from lantern_rt.models.chameleon_dir import (
    ChameleonDir,
    load_chameleon_target,
    load_chameleon_vq,
    open_chameleon_dir,
)
from lantern_rt.models.chameleon_runtime import (
    PROMPT_TABLE,
    image_vocabulary,
    runtime_config,
    runtime_drafter,
    runtime_target,
)
from lantern_rt.models.chameleon_vq import ChameleonVQ, ChameleonVQConfig
from lantern_rt.models.checkpoint import CheckpointError, load_strict, read_state_dict
from lantern_rt.models.config import (
    ConfigError,
    GPTConfig,
    VQConfig,
    config_from_dict,
    read_json,
    relative_path,
)
from lantern_rt.models.drafter import Drafter, DrafterConfig, clean_eagle_state
from lantern_rt.models.hf_layout import read_target_state, resolve_gpt_section
from lantern_rt.models.neighbors import latent_neighbors, load_neighbors_file
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_model"
FORMAT_VERSION = 1


@dataclass
class ModelDir:
    """A parsed model directory (nothing loaded yet)."""

    root: Path
    raw: dict[str, Any]
    gpt: GPTConfig
    vq: VQConfig | ChameleonVQConfig
    files: dict[str, str]
    image_size: int
    class_names: list[str] = field(default_factory=list)
    chameleon: ChameleonDir | None = None  # the family's HF folder (a Chameleon model only)
    prompt_layout: str | None = None  # a Chameleon model's prompt rules (chameleon_prompts)

    def path(self, key: str) -> Path:
        if key not in self.files:
            raise ConfigError(f"{self.root / 'config.json'} names no '{key}' file")
        return self.root / self.files[key]

    @property
    def name(self) -> str:
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


def open_model_dir(path: str | Path | None = None) -> ModelDir:
    """Parse ``path``/config.json (the built-in demo when ``path`` is None); every field is
    checked, and a :class:`ConfigError` names the file and the field."""
    root = DEMO_DIR if path is None else Path(path)
    if not root.is_dir():
        raise ConfigError(f"model directory not found: {root}")
    file = root / "config.json"
    raw = read_json(file)
    version = raw.get("format_version", FORMAT_VERSION)
    if not _is_int(version):
        raise ConfigError(f"{file}: format_version must be an integer, got {version!r}"[:300])
    if version != FORMAT_VERSION:
        raise ConfigError(
            f"{root} uses model format version {version}; this lantern-rt reads version {FORMAT_VERSION}"
        )
    if raw.get("family", "llamagen") == "chameleon":
        return _open_chameleon(root, file, raw)
    if raw.get("family", "llamagen") != "llamagen":
        raise ConfigError(
            f"{file}: family must be 'llamagen' or 'chameleon', got {raw.get('family')!r}"[:300]
        )
    for key in ("gpt", "vq", "files"):
        if not isinstance(raw.get(key), dict):
            raise ConfigError(f"{file} lacks a '{key}' object")
    try:
        gpt = config_from_dict(GPTConfig, resolve_gpt_section(root, raw["gpt"]))
        vq = config_from_dict(VQConfig, raw["vq"])
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None
    if gpt.vocab_size != vq.codebook_size:
        raise ConfigError(
            f"{file}: target vocabulary {gpt.vocab_size} != tokenizer codebook {vq.codebook_size}"
        )
    image_size = raw.get("image_size", gpt.grid_size * vq.downsample)
    if not _is_int(image_size):
        raise ConfigError(f"{file}: image_size must be an integer, got {image_size!r}"[:300])
    if image_size != gpt.grid_size * vq.downsample:
        raise ConfigError(
            f"{file}: image_size {image_size} != token grid {gpt.grid_size} x VQ downsampling {vq.downsample}"
        )
    _sampling_defaults(file, raw)
    return ModelDir(root, raw, gpt, vq, _files(file, raw["files"]), image_size, _class_names(file, raw, gpt))


PROMPT_LAYOUTS = ("anole", "lumina")


def _open_chameleon(root: Path, file: Path, raw: dict[str, Any]) -> ModelDir:
    """A Chameleon-family model directory: ``files.chameleon`` (the HF folder), ``prompt``
    ({layout, tokens}) and the optional ``image_size`` (pixels a side; the VQGAN's resolution by
    default). Lumina-mGPT's layout ends each row of codes with a forced end-of-row token."""
    if not isinstance(raw.get("files"), dict):
        raise ConfigError(f"{file} lacks a 'files' object")
    files = _files(file, raw["files"])
    if "chameleon" not in files:
        raise ConfigError(
            f'{file}: name the Hugging Face folder in "files", e.g. "chameleon": "Anole-7b-v0.1-hf"'
        )
    prompt = raw.get("prompt", {})
    if not isinstance(prompt, dict) or set(prompt) - {"layout", "tokens"}:
        raise ConfigError(
            f'{file}: prompt must be an object with "layout" and "tokens", got {prompt!r}'[:300]
        )
    layout, tokens = prompt.get("layout", "anole"), prompt.get("tokens", 64)
    if layout not in PROMPT_LAYOUTS:
        raise ConfigError(
            f"{file}: prompt.layout must be one of {', '.join(PROMPT_LAYOUTS)}, got {layout!r}"[:300]
        )
    d = open_chameleon_dir(root / files["chameleon"])
    image_size = raw.get("image_size", d.vq.resolution)
    for name, value in (("prompt.tokens", tokens), ("image_size", image_size)):
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{file}: {name} must be an integer >= 1, got {value!r}"[:300])
    if image_size % d.vq.downsample:
        raise ConfigError(
            f"{file}: image_size {image_size} is not a multiple of the VQGAN's {d.vq.downsample} pixels per token"
        )
    row_end = layout == "lumina"
    if row_end and d.config.row_end_token_id is None:
        raise ConfigError(
            f"{d.config_file}: vocabulary_map lacks Lumina-mGPT's end-of-row token {ROW_END_TOKEN}"
        )
    grid = image_size // d.vq.downsample
    try:
        gpt = runtime_config(d.config, tokens, grid * (grid + row_end), row_end)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None
    _sampling_defaults(file, raw)
    return ModelDir(root, raw, gpt, d.vq, files, image_size, [], d, layout)


def _row_end_id(md: ModelDir) -> int | None:
    return md.chameleon.config.row_end_token_id if md.gpt.row_end else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _files(file: Path, files: dict[str, Any]) -> dict[str, str]:
    """The ``files`` section: each entry a path relative to the model directory, inside it."""
    return {key: relative_path(file, f"files.{key}", name) for key, name in files.items()}


SAMPLING_KEYS = {"cfg_scale", "temperature", "top_k", "top_p"}


def _sampling_defaults(file: Path, raw: dict[str, Any]) -> None:
    """The optional ``sampling_defaults``: an object of finite numbers under SAMPLING_KEYS."""
    values = raw.get("sampling_defaults", {})
    if not isinstance(values, dict):
        raise ConfigError(f"{file}: sampling_defaults must be an object, got {values!r}"[:300])
    for key, value in values.items():
        if key not in SAMPLING_KEYS:
            raise ConfigError(
                f"{file}: sampling_defaults.{key} is unknown; use {', '.join(sorted(SAMPLING_KEYS))}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{file}: sampling_defaults.{key} must be a finite number, got {value!r}"[:300])


def _class_names(file: Path, raw: dict[str, Any], gpt: GPTConfig) -> list[str]:
    """The optional ``class_names``: a list of strings, one per class (empty: no names)."""
    names = raw.get("class_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{file}: class_names must be a list of strings, got {names!r}"[:300])
    if names and len(names) != gpt.num_classes:
        raise ConfigError(f"{file}: class_names has {len(names)} names for gpt.num_classes {gpt.num_classes}")
    return names


def load_target(
    md: ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """The target with its weights, in eval mode (a Chameleon model converted from its HF
    layout: :mod:`~lantern_rt.models.chameleon_runtime`)."""
    if md.chameleon is not None:
        target = load_chameleon_target(md.chameleon, device, dtype)
        return runtime_target(target, md.gpt.cls_token_num, md.gpt.block_size, _row_end_id(md))
    model = Transformer(md.gpt)
    load_strict(
        model, read_target_state(md.path("gpt"), md.gpt.n_layer), f"target checkpoint {md.path('gpt')}"
    )
    return model.to(device=device, dtype=dtype).eval()


def load_vq(
    md: ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> VQModel | ChameleonVQ:
    """The VQ tokenizer with its weights, in eval mode."""
    if md.chameleon is not None:
        return load_chameleon_vq(md.chameleon, device, dtype)
    model = VQModel(md.vq)
    load_strict(model, read_state_dict(md.path("vq")), f"tokenizer checkpoint {md.path('vq')}")
    return model.to(device=device, dtype=dtype).eval()


EMBEDDING_KEY = "model.embed_tokens.weight"  # a Chameleon checkpoint's input embedding


EAGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "drafter.safetensors")


def _drafter_source(md: ModelDir, path: str | Path | None) -> tuple[Path, dict, Path]:
    """(weights file, config dict, the file that config comes from) from an explicit path, or the
    model directory's entry."""
    if path is None:
        if "drafter" not in md.files:
            raise ConfigError(
                f"{md.root} has no drafter; train one with 'lantern train-drafter' or pass --drafter"
            )
        path = md.path("drafter")
        if not Path(path).is_dir():
            return Path(path), md.raw.get("drafter", {}), md.root / "config.json"
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"drafter not found: {path} (give an EAGLE folder with config.json and weights)")
    for name in EAGLE_WEIGHT_FILES:
        if (path / name).is_file():
            return path / name, read_json(path / "config.json"), path / "config.json"
    raise ConfigError(f"{path} holds none of {', '.join(EAGLE_WEIGHT_FILES)}")


def load_drafter(
    md: ModelDir,
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Drafter:
    """The drafter of ``md`` (or the EAGLE-layout folder ``path``), checked against the target."""
    weights, raw, source = _drafter_source(md, path)
    try:
        config = DrafterConfig.from_dict(raw or DrafterConfig.for_target(md.gpt).__dict__)
    except ConfigError as exc:
        raise ConfigError(f"{source}: drafter config: {exc}") from None
    state = clean_eagle_state(read_state_dict(weights))
    table = None
    if md.chameleon is not None:
        try:
            ids = image_vocabulary(md.chameleon.config, _row_end_id(md))
            config, state = runtime_drafter(config, state, md.gpt, ids)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        table = state.pop(PROMPT_TABLE, None)  # the authors' copy of the target's embedding
        if table is None:  # a trained drafter's: the target's own
            table = read_state_dict(md.chameleon.weights, lambda k: k == EMBEDDING_KEY).get(EMBEDDING_KEY)
            if table is None:
                raise CheckpointError(
                    f"{md.chameleon.weights} lacks {EMBEDDING_KEY}, the drafter's prompt embedding"
                )
    model = Drafter(config, md.gpt)
    load_strict(model, state, f"drafter checkpoint {weights}")
    if table is not None:
        if tuple(table.shape) != tuple(model.prompt_table.shape):
            raise CheckpointError(
                f"drafter checkpoint {weights}: its embedding is {list(table.shape)}, the model's "
                f"vocabulary needs {list(model.prompt_table.shape)}"
            )
        model.prompt_table.copy_(table)
    return model.to(device=device, dtype=dtype).eval()


def load_neighbors(md: ModelDir, k: int, vq: VQModel | ChameleonVQ | None = None) -> torch.Tensor:
    """[V, >= k] latent-neighbour table: the stored one when wide enough, else computed; a
    row-end layout's end-of-row token (the last entry) is its own only neighbour (it is
    drawn only where it is forced, and never credited elsewhere: its probability there is 0)."""
    if not 0 <= k < md.vq.codebook_size:
        raise ConfigError(
            f"lantern k must be in 0..{md.vq.codebook_size - 1} (the codebook has {md.vq.codebook_size} codes), got {k}"
        )
    table = None
    if "neighbors" in md.files and md.path("neighbors").is_file():
        table = load_neighbors_file(md.path("neighbors"), md.vq.codebook_size)
    if table is None or table.shape[1] < k:
        vq = vq if vq is not None else load_vq(md)
        table = latent_neighbors(vq.quantize.codebook(), max(k, 1))
    if md.gpt.row_end:
        table = torch.cat([table, torch.full_like(table[:1], md.vq.codebook_size)])
    return table


__all__ = [
    "CheckpointError",
    "ConfigError",
    "ModelDir",
    "open_model_dir",
    "load_target",
    "load_vq",
    "DEMO_DIR",
]
