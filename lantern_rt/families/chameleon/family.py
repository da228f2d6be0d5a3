"""The Chameleon family (docs/architecture.md, docs/method.md §10): a ``config.json`` naming the
model's Hugging Face folder and its prompt layout; the target, the VQGAN and the tokenizer all
come from that folder, and each image is conditioned on prompt token rows."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lantern_rt.errors import TextEncoderError, first_line
from lantern_rt.families.base import Conditioner, Family, Warn
from lantern_rt.families.chameleon.convert import (
    PROMPT_TABLE,
    image_vocabulary,
    runtime_config,
    runtime_drafter,
    runtime_target,
)
from lantern_rt.families.chameleon.folder import (
    ChameleonDir,
    load_chameleon_target,
    load_chameleon_vq,
    open_chameleon_dir,
)
from lantern_rt.families.chameleon.model import ROW_END_TOKEN
from lantern_rt.families.chameleon.prompts import (
    TOKENIZER_FILE,
    load_chameleon_tokenizer,
    prompt_layout,
    prompt_rows,
)
from lantern_rt.families.chameleon.training_rows import PromptConditions, prompt_conditions
from lantern_rt.families.chameleon.vq import ChameleonVQ, ChameleonVQConfig
from lantern_rt.models.checkpoint import CheckpointError, read_state_dict
from lantern_rt.models.config import ConfigError, GPTConfig
from lantern_rt.models.drafter import DrafterConfig
from lantern_rt.models.model_dir import ModelDir, check_sampling_defaults, files_section, is_int
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.decode import Condition

if TYPE_CHECKING:
    from lantern_rt.bundle import Bundle
    from lantern_rt.runtime.backends.bundle_graphs import RunnerFactory

PROMPT_LAYOUTS = ("anole", "lumina")
EMBEDDING_KEY = "model.embed_tokens.weight"  # a Chameleon checkpoint's input embedding


@dataclass(frozen=True)
class ChameleonDetails:
    """What a Chameleon model directory adds (``ModelDir.details``): its Hugging Face folder and
    its prompt layout's name (``prompts.prompt_layout``)."""

    folder: ChameleonDir
    layout: str


def details(md: ModelDir) -> ChameleonDetails:
    """The Chameleon part of ``md`` (opened by this family)."""
    assert isinstance(md.details, ChameleonDetails), md.family
    return md.details


def _row_end_id(md: ModelDir) -> int | None:
    return details(md).folder.config.row_end_token_id if md.gpt.row_end else None


def chameleon_condition(
    prompt: str, tokenizer: Any, slots: int, layout: Any, device: torch.device | str, warn: Warn | None = None
) -> Condition:
    """A Chameleon-family prompt's condition: its conditional and unconditional token rows,
    each left padded to the ``slots`` prefix slots, the padding hidden per row (docs/method.md
    §10). A prompt too long for the slots loses its last words (``warn`` is told)."""
    rows = prompt_rows(tokenizer, prompt, slots, layout)
    if rows.truncated and warn is not None:
        warn(f"prompt {prompt[:40]!r}... is over the {slots} prompt tokens: its end is cut")
    return Condition(rows.ids.to(device), rows.mask.to(device))


def _prompter(
    tokenizer: Any, layout_name: str, image_size: int, slots: int, device, warn: Warn
) -> Conditioner:
    layout = prompt_layout(layout_name, image_size)

    def condition(prompt: int | str) -> Condition:
        return chameleon_condition(str(prompt), tokenizer, slots, layout, device, warn)

    return condition


class ChameleonFamily(Family):
    """Anole and Lumina-mGPT."""

    name = "chameleon"

    def open_dir(self, root: Path, file: Path, raw: dict[str, Any]) -> ModelDir:
        """``files.chameleon`` (the HF folder), ``prompt`` ({layout, tokens}) and the optional
        ``image_size`` (pixels a side; the VQGAN's resolution by default). Lumina-mGPT's layout
        ends each row of codes with a forced end-of-row token."""
        if not isinstance(raw.get("files"), dict):
            raise ConfigError(f"{file} lacks a 'files' object")
        files = files_section(file, raw["files"])
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
            if not is_int(value) or value < 1:
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
        check_sampling_defaults(file, raw)
        return ModelDir(root, raw, gpt, d.vq, files, image_size, [], self.name, ChameleonDetails(d, layout))

    def load_target(self, md: ModelDir, device: str | torch.device, dtype: torch.dtype) -> Transformer:
        """The HF checkpoint converted to the runtime's layout (``convert.runtime_target``)."""
        target = load_chameleon_target(details(md).folder, device, dtype)
        return runtime_target(target, md.gpt.cls_token_num, md.gpt.block_size, _row_end_id(md))

    def load_vq(self, md: ModelDir, device: str | torch.device, dtype: torch.dtype) -> ChameleonVQ:
        return load_chameleon_vq(details(md).folder, device, dtype)

    def drafter_state(
        self, md: ModelDir, config: DrafterConfig, state: dict[str, Tensor]
    ) -> tuple[DrafterConfig, dict[str, Tensor], Tensor | None]:
        """The drafter over the image vocabulary; its prompt embedding is the authors' copy of
        the target's, or (a drafter trained here) the target's own."""
        folder = details(md).folder
        ids = image_vocabulary(folder.config, _row_end_id(md))
        config, state = runtime_drafter(config, state, md.gpt, ids)
        table = state.pop(PROMPT_TABLE, None)
        if table is None:
            table = read_state_dict(folder.weights, lambda k: k == EMBEDDING_KEY).get(EMBEDDING_KEY)
            if table is None:
                raise CheckpointError(
                    f"{folder.weights} lacks {EMBEDDING_KEY}, the drafter's prompt embedding"
                )
        return config, state, table

    def vq_config(self, raw: dict[str, Any]) -> ChameleonVQConfig:
        return ChameleonVQConfig.from_hf(raw)

    def default_cfg_scale(self, gpt: GPTConfig) -> float:
        return 3.0  # LANTERN's Anole and Lumina-mGPT scripts

    def torch_conditioner(self, md: ModelDir, target: Transformer, device: str, warn: Warn) -> Conditioner:
        tokenizer = load_chameleon_tokenizer(details(md).folder.root)
        return _prompter(tokenizer, details(md).layout, md.image_size, md.gpt.cls_token_num, device, warn)

    def bundle_conditioner(
        self, bundle: Bundle, runner: RunnerFactory, device: torch.device, warn: Warn
    ) -> Conditioner:
        tokenizer = load_chameleon_tokenizer(bundle.path)
        return _prompter(
            tokenizer,
            bundle.constants.null_condition["prompt_layout"],
            bundle.image_size,
            bundle.gpt.cls_token_num,
            device,
            warn,
        )

    def write_bundle_files(self, md: ModelDir, target: Transformer, folder: Path) -> dict[str, Any]:
        """The prompts' tokenizer, as the model folder has it; the unconditional row is a prompt
        of the layout."""
        shutil.copyfile(details(md).folder.root / TOKENIZER_FILE, folder / TOKENIZER_FILE)
        return {"null_condition": {"prompt_layout": details(md).layout}}

    def describe_bundle(self, bundle: Bundle) -> list[str]:
        layout, slots = bundle.constants.null_condition["prompt_layout"], bundle.gpt.cls_token_num
        return [f"prompts  {layout} layout, {slots} slots per row, tokenized by {TOKENIZER_FILE}"]

    def codes_key(self, gpt: GPTConfig) -> str:
        return "prompts"

    def training_conditions(
        self, md: ModelDir, files: list[tuple[Path, np.ndarray]], warn: Warn
    ) -> PromptConditions:
        """The prompts' token rows as the runtime builds them (``PromptConditions``), checked
        now: a prompt that gives no rows is a :class:`ConfigError` naming the file and index."""
        tokenizer = load_chameleon_tokenizer(details(md).folder.root)
        layout, slots = prompt_layout(details(md).layout, md.image_size), md.gpt.cls_token_num
        cut: list[int] = []
        rows = []
        for path, prompts in files:
            try:
                rows.append(prompt_conditions(tokenizer, prompts.tolist(), slots, layout, cut.append))
            except TextEncoderError as exc:
                raise ConfigError(f"{path}: {first_line(exc)}"[:300]) from None
        if cut:
            warn(f"{len(cut)} of the --codes prompts are over the {slots} prompt tokens: their ends are cut")
        return PromptConditions(torch.cat([r.ids for r in rows]), torch.cat([r.mask for r in rows]))
