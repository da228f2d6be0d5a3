"""A local Hugging Face folder of a Chameleon-family model (Anole-7b-v0.1-hf, Lumina-mGPT-7B-768).

The folder holds ``config.json`` (``model_type: chameleon`` with a ``vq_config``), the weights of
``ChameleonForConditionalGeneration`` as ``model.safetensors``, a sharded
``model.safetensors.index.json``, or ``pytorch_model.bin`` (optionally sharded), and tokenizer files.
The target's keys are the checkpoint's keys outside ``model.vqmodel.*``; the VQ tokenizer's are the
``model.vqmodel.*`` keys with that prefix removed. Image generation needs the VQ decoder, which only
conversions such as Anole's keep (``transformers``' own conversion drops ``model.vqmodel.decoder.*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern_rt.families.chameleon.model import ChameleonConfig, ChameleonTarget, rope_frequencies
from lantern_rt.families.chameleon.vq import CHECKPOINT_PREFIX, ChameleonVQ, ChameleonVQConfig
from lantern_rt.models.checkpoint import CheckpointError, load_strict, read_state_dict
from lantern_rt.models.config import ConfigError, read_json

# transformers' own order of preference (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, ...)
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DECODER_PREFIX = CHECKPOINT_PREFIX + "decoder."


@dataclass
class ChameleonDir:
    """A parsed Chameleon folder (nothing loaded yet); ``weights`` is the file to read (an index
    for a sharded checkpoint)."""

    root: Path
    raw: dict[str, Any]
    config: ChameleonConfig
    vq: ChameleonVQConfig
    weights: Path

    @property
    def config_file(self) -> Path:
        return self.root / "config.json"

    @property
    def tokenizer_files(self) -> list[Path]:
        """The tokenizer files present in the folder (``tokenizer.json`` first)."""
        return [self.root / name for name in TOKENIZER_FILES if (self.root / name).is_file()]


def open_chameleon_dir(path: str | Path) -> ChameleonDir:
    """Parse ``path``/config.json and find the weights; a one-line :class:`ConfigError` names the
    folder or file at fault."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"Chameleon model folder not found: {root}")
    file = root / "config.json"
    raw = read_json(file)
    if raw.get("model_type") != "chameleon":
        raise ConfigError(
            f"{file} is not a Chameleon config: model_type is {raw.get('model_type')!r}, not 'chameleon'"[
                :300
            ]
        )
    if not isinstance(raw.get("vq_config"), dict):
        raise ConfigError(f"{file} lacks a 'vq_config' object (the VQ image tokenizer's config)")
    try:
        config = ChameleonConfig.from_hf(raw)
        vq = ChameleonVQConfig.from_hf(raw["vq_config"])
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from None
    if config.image_token_ids and len(config.image_token_ids) != vq.num_embeddings:
        raise ConfigError(
            f"{file}: vocabulary_map has {len(config.image_token_ids)} image tokens for the VQ codebook "
            f"of {vq.num_embeddings} (vq_config.num_embeddings)"
        )
    weights = next((root / name for name in WEIGHT_FILES if (root / name).is_file()), None)
    if weights is None:
        raise ConfigError(f"no weights found in {root}: looked for {', '.join(WEIGHT_FILES)}")
    return ChameleonDir(root.resolve(), raw, config, vq, weights.resolve())


def read_chameleon_state(d: ChameleonDir) -> dict[str, Tensor]:
    """Every tensor of the folder's checkpoint (all shards), as stored; pass it to both loaders to
    read a large checkpoint once."""
    return read_state_dict(d.weights)


def load_chameleon_target(
    d: ChameleonDir,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    state: dict[str, Tensor] | None = None,
) -> ChameleonTarget:
    """The target decoder with the checkpoint's non-``model.vqmodel.*`` weights, in eval mode.

    ``state``: the checkpoint already read with :func:`read_chameleon_state` (default: read its
    target keys alone). The model is built on the meta device and takes the checkpoint's own
    tensors (no fp32 random copy of 7B weights first), then moves to ``device`` and ``dtype``.
    The RoPE frequencies stay fp32 whatever ``dtype`` is, as in ``transformers``.
    """
    state = (
        read_state_dict(d.weights, lambda k: not k.startswith(CHECKPOINT_PREFIX)) if state is None else state
    )
    with torch.device("meta"):
        model = ChameleonTarget(d.config)
    picked = {k: v for k, v in state.items() if not k.startswith(CHECKPOINT_PREFIX)}
    load_strict(
        model, _expand_qk_norms(model, picked), f"Chameleon target checkpoint {d.weights}", assign=True
    )
    model.model.inv_freq = rope_frequencies(d.config)
    model = model.to(device=device, dtype=dtype).eval()
    model.model.inv_freq = model.model.inv_freq.float()
    return model


def load_chameleon_vq(
    d: ChameleonDir,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    state: dict[str, Tensor] | None = None,
) -> ChameleonVQ:
    """The VQ image tokenizer (encoder and decoder) from the checkpoint's ``model.vqmodel.*``
    weights, in eval mode (``state``: as for :func:`load_chameleon_target`; default: read those
    keys alone); a checkpoint without the decoder is a one-line :class:`CheckpointError`."""
    state = read_state_dict(d.weights, lambda k: k.startswith(CHECKPOINT_PREFIX)) if state is None else state
    picked = {k[len(CHECKPOINT_PREFIX) :]: v for k, v in state.items() if k.startswith(CHECKPOINT_PREFIX)}
    if not picked:
        raise CheckpointError(
            f"{d.weights} holds no VQ tokenizer weights ({CHECKPOINT_PREFIX}*): this folder has the "
            "language model only"
        )
    if not any(k.startswith(DECODER_PREFIX) for k in state):
        raise CheckpointError(
            f"{d.weights} lacks the VQ decoder ({DECODER_PREFIX}*), which image generation needs: "
            "transformers' Chameleon conversion drops it; use a checkpoint from Anole's conversion "
            "(e.g. GAIR/Anole-7b-v0.1-hf), which keeps it"
        )
    model = ChameleonVQ(d.vq)
    load_strict(model, picked, f"Chameleon VQ tokenizer ({CHECKPOINT_PREFIX}*) in {d.weights}")
    return model.to(device=device, dtype=dtype).eval()


def _expand_qk_norms(model: ChameleonTarget, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Lumina-mGPT's per-shard q/k norm rows [model_parallel_size, D] repeated to one row per head
    [H, D] (what :class:`~lantern_rt.families.chameleon.model.QKNorm` does on load), so that the strict
    shape check sees the per-head layout."""
    own = model.state_dict()
    out = dict(state)
    for key, value in state.items():
        if not (".q_norm." in key or ".k_norm." in key) or key not in own or value.dim() != 2:
            continue
        heads = own[key].shape[0]
        if value.shape[0] != heads and value.shape[0] >= 1 and heads % value.shape[0] == 0:
            out[key] = value.repeat_interleave(heads // value.shape[0], dim=0)
    return out
