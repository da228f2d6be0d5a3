"""The LlamaGen family (docs/architecture.md): a ``config.json`` with ``gpt``, ``vq`` and
``files`` sections beside LlamaGen's checkpoints (or the LANTERN authors' Hugging Face
conversion of them), class labels or T5 captions as the condition."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from lantern_rt.bundle import MANIFEST, NULL_CAPTION, BundleError
from lantern_rt.families.base import Conditioner, Family, Warn
from lantern_rt.families.llamagen.captions import load_tokenizer
from lantern_rt.families.llamagen.conditions import (
    bundle_prompts,
    class_conditioner,
    condition_rows,
    prompt_condition,
)
from lantern_rt.families.llamagen.hf_layout import read_target_state, resolve_gpt_section
from lantern_rt.families.llamagen.text_encoder import encode, load_text_encoder
from lantern_rt.families.llamagen.text_encoder_graph import TextEncoderGraph, copy_tokenizer
from lantern_rt.models.checkpoint import load_strict, read_state_dict
from lantern_rt.models.config import ConfigError, GPTConfig, VQConfig, config_from_dict
from lantern_rt.models.model_dir import (
    ModelDir,
    check_sampling_defaults,
    class_names_section,
    files_section,
    is_int,
)
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel
from lantern_rt.runtime.decode import Condition

if TYPE_CHECKING:
    from lantern_rt.bundle import Bundle
    from lantern_rt.runtime.backends.bundle_graphs import RunnerFactory


class LlamaGenFamily(Family):
    """LlamaGen's class-conditional and text-to-image models."""

    name = "llamagen"

    def open_dir(self, root: Path, file: Path, raw: dict[str, Any]) -> ModelDir:
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
        if not is_int(image_size):
            raise ConfigError(f"{file}: image_size must be an integer, got {image_size!r}"[:300])
        if image_size != gpt.grid_size * vq.downsample:
            raise ConfigError(
                f"{file}: image_size {image_size} != token grid {gpt.grid_size} x VQ downsampling {vq.downsample}"
            )
        check_sampling_defaults(file, raw)
        files = files_section(file, raw["files"])
        return ModelDir(root, raw, gpt, vq, files, image_size, class_names_section(file, raw, gpt), self.name)

    def load_target(self, md: ModelDir, device: str | torch.device, dtype: torch.dtype) -> Transformer:
        model = Transformer(md.gpt)
        load_strict(
            model, read_target_state(md.path("gpt"), md.gpt.n_layer), f"target checkpoint {md.path('gpt')}"
        )
        return model.to(device=device, dtype=dtype).eval()

    def load_vq(self, md: ModelDir, device: str | torch.device, dtype: torch.dtype) -> VQModel:
        model = VQModel(md.vq)
        load_strict(model, read_state_dict(md.path("vq")), f"tokenizer checkpoint {md.path('vq')}")
        return model.to(device=device, dtype=dtype).eval()

    def vq_config(self, raw: dict[str, Any]) -> VQConfig:
        return config_from_dict(VQConfig, raw)

    def default_cfg_scale(self, gpt: GPTConfig) -> float:
        return {"c2i": 4.0, "t2i": 7.5}[gpt.model_type]  # LlamaGen's own sampling scripts

    def check_runnable(self, md: ModelDir) -> None:
        if md.gpt.model_type == "t2i" and "t5" not in md.files:
            raise ConfigError(
                f"{md.root / 'config.json'} is a text-to-image model without a text encoder: name its "
                'flan-t5-xl folder in "files", e.g. "t5": "flan-t5-xl"'
            )

    def torch_conditioner(self, md: ModelDir, target: Transformer, device: str, warn: Warn) -> Conditioner:
        if md.gpt.model_type == "c2i":

            def condition(label: int | str) -> Condition:
                return Condition(condition_rows(target, int(label)))

            return condition
        self.check_runnable(md)
        encoder = load_text_encoder(md.path("t5"), device, md.gpt.caption_dim)
        tokenizer = load_tokenizer(md.path("t5"))
        null = target.null_condition

        def prompted(prompt: int | str) -> Condition:
            return prompt_condition(str(prompt), tokenizer, lambda i, m: encode(encoder, i, m), null, warn)

        return prompted

    def bundle_conditioner(
        self, bundle: Bundle, runner: RunnerFactory, device: torch.device, warn: Warn
    ) -> Conditioner:
        if bundle.gpt.model_type == "c2i":
            null = bundle.constants.null_condition.get("class_id")
            if null != bundle.gpt.num_classes:  # the null class is the id after the classes
                raise BundleError(
                    f"{bundle.path}: {MANIFEST} gives the null class as {null}, not the id after its "
                    f"{bundle.gpt.num_classes} classes: re-export the bundle"
                )
            return class_conditioner(null)
        return bundle_prompts(bundle, runner, device, warn)

    def describe_bundle(self, bundle: Bundle) -> list[str]:
        if bundle.text_max_length is None:
            return []
        return [f"text     prompts of {bundle.text_max_length} tokens, encoded by the text_encoder graph"]

    def extra_graphs(self, md: ModelDir, target: Transformer) -> list[nn.Module]:
        """A text-to-image model's T5 encoder (files.t5), always fp32; none for a
        class-conditional model or one without a text encoder (its bundle then decodes caption
        features given through the Python API only)."""
        if md.gpt.model_type != "t2i" or "t5" not in md.files:
            return []
        encoder = load_text_encoder(md.path("t5"), caption_dim=target.config.caption_dim)
        return [TextEncoderGraph(encoder, target.config.cls_token_num)]

    def write_bundle_files(self, md: ModelDir, target: Transformer, folder: Path) -> dict[str, Any]:
        if md.gpt.model_type == "c2i":
            return {"null_condition": {"class_id": md.gpt.num_classes}}
        np.save(folder / NULL_CAPTION, target.null_condition.float().numpy())
        extras: dict[str, Any] = {"null_condition": {"file": NULL_CAPTION}}
        if "t5" in md.files:
            copy_tokenizer(md.path("t5"), folder)
            extras["text_encoder"] = {"max_length": md.gpt.cls_token_num}
        return extras

    def codes_key(self, gpt: GPTConfig) -> str:
        if gpt.model_type == "t2i":
            raise ConfigError(
                "train-drafter trains on class labels; for a text-to-image model use the authors' "
                "released drafters (README: Text-to-image)"
            )
        return "labels"
