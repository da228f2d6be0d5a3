"""Model directories, whatever their family: open one, load its target, tokenizer, drafter and
neighbour table. Each asks the directory's family (:mod:`~lantern_rt.families.registry`) for
what only the family knows."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lantern_rt.bundle import Bundle, BundleError
from lantern_rt.errors import option
from lantern_rt.families.registry import DEFAULT_FAMILY, family_named
from lantern_rt.models.checkpoint import CheckpointError, load_strict, read_state_dict
from lantern_rt.models.config import ConfigError, read_json
from lantern_rt.models.drafter import Drafter, DrafterConfig, clean_eagle_state
from lantern_rt.models.model_dir import DEMO_DIR, FORMAT_VERSION, ModelDir, is_int
from lantern_rt.models.neighbors import latent_neighbors, load_neighbors_file
from lantern_rt.models.target import Transformer


def open_model_dir(path: str | Path | None = None) -> ModelDir:
    """Parse ``path``/config.json (the built-in demo when ``path`` is None) by its family's rules;
    every field is checked, and a :class:`ConfigError` names the file and the field."""
    root = DEMO_DIR if path is None else Path(path)
    if not root.is_dir():
        raise ConfigError(f"model directory not found: {root}")
    file = root / "config.json"
    raw = read_json(file)
    version = raw.get("format_version", FORMAT_VERSION)
    if not is_int(version):
        raise ConfigError(f"{file}: format_version must be an integer, got {version!r}"[:300])
    if version != FORMAT_VERSION:
        raise ConfigError(
            f"{root} uses model format version {version}; this lantern-rt reads version {FORMAT_VERSION}"
        )
    name = raw.get("family", DEFAULT_FAMILY)
    try:
        family = family_named(name)
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None
    return family.open_dir(root, file, raw)


def load_target(
    md: ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """The target with its weights, in eval mode, in the runtime's layout."""
    return family_named(md.family).load_target(md, device, dtype)


def load_vq(
    md: ModelDir, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The VQ tokenizer with its weights, in eval mode."""
    return family_named(md.family).load_vq(md, device, dtype)


EAGLE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "drafter.safetensors")


def _drafter_source(md: ModelDir, path: str | Path | None) -> tuple[Path, dict, Path]:
    """(weights file, config dict, the file that config comes from) from an explicit path, or the
    model directory's entry."""
    if path is None:
        if "drafter" not in md.files:
            raise ConfigError(
                f"{md.root} has no drafter; train one with 'lantern train-drafter' or give {option('drafter')}"
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
    try:
        config, state, table = family_named(md.family).drafter_state(md, config, state)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
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


def load_neighbors(md: ModelDir, k: int, vq: nn.Module | None = None) -> torch.Tensor:
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


def open_bundle(path: str | Path) -> Bundle:
    """:meth:`Bundle.open` (schema, hashes, graph I/O) with what its family reads checked too:
    the family's name and its tokenizer config; :class:`BundleError` says what is wrong."""
    return Bundle.open(path, check=bundle_info)


def bundle_info(bundle: Bundle) -> ModelDir:
    """A bundle's names, classes, geometry and sampling defaults, in the shape a model directory
    has them (no weight files; its family's tokenizer config); :class:`BundleError` for a
    family or tokenizer config this lantern-rt cannot read."""
    try:
        family = family_named(bundle.family)
        vq = family.vq_config(bundle.vq_section)
    except ConfigError as exc:
        raise BundleError(f"{bundle.path}: {exc}") from None
    return ModelDir(
        root=bundle.path,
        raw={"name": bundle.model_name, "sampling_defaults": bundle.sampling_defaults},
        gpt=bundle.gpt,
        vq=vq,
        files={},
        image_size=bundle.image_size,
        class_names=list(bundle.class_names),
        family=family.name,
    )
