"""A LlamaGen image's condition: its class id, or its prompt's T5 caption features, with the
unconditional row beside it (docs/method.md §9)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lantern_rt.bundle import TEXT_ENCODER_GRAPH
from lantern_rt.families.base import Conditioner, Warn
from lantern_rt.families.llamagen.captions import left_pad, load_tokenizer, tokenize
from lantern_rt.models.config import ConfigError
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.decode import Condition

if TYPE_CHECKING:
    from lantern_rt.bundle import Bundle
    from lantern_rt.runtime.backends.bundle_graphs import RunnerFactory


def condition_rows(model: Transformer, cond: int | torch.Tensor) -> torch.Tensor:
    """The two CFG rows (conditional, unconditional) for a class id or caption features [T, C]."""
    device = model.output.weight.device
    if model.config.model_type == "c2i":
        return torch.tensor([int(cond), model.config.num_classes], device=device)
    caption = torch.as_tensor(cond, device=device, dtype=model.cls_embedding.uncond_embedding.dtype)
    return torch.stack([caption, model.null_condition])


# prompt token ids [1, L] and attention mask [1, L] -> caption features [1, L, C] (fp32)
TextEncode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def prompt_condition(
    prompt: str, tokenizer: Any, encode: TextEncode, null: torch.Tensor, warn: Warn | None = None
) -> Condition:
    """A prompt's condition as LlamaGen's ``sample_t2i.py`` builds it (docs/method.md §9): the
    cleaned prompt tokenised, right-padded to the T prefix slots of the null caption ``null``
    [T, C], encoded, then rotated so that its valid features come last with the padding zeroed;
    the padding is hidden from every later token, in both CFG rows. A prompt over T tokens
    keeps its first T - 1 and the end-of-sequence token (``warn`` is told)."""
    slots = null.shape[0]
    ids, mask, truncated = tokenize(tokenizer, [prompt], slots)
    if truncated[0] and warn is not None:
        warn(
            f"prompt {prompt[:40]!r}... is over {slots} tokens: its first {slots - 1} and the end token are kept"
        )
    features = encode(ids.to(null.device), mask.to(null.device)).float()
    features, prefix = left_pad(features, mask.to(null.device))
    return Condition(torch.stack([features[0].to(null.dtype), null]), prefix[0])


def class_conditioner(null_id: int) -> Conditioner:
    """Class id -> its condition: the class and the null class ``null_id``."""

    def condition(label: int | str) -> Condition:
        return Condition(torch.tensor([int(label), null_id]))

    return condition


def null_caption(bundle: Bundle) -> np.ndarray:
    """The unconditional caption features [T, C] a text-to-image bundle holds."""
    return np.load(bundle.path / bundle.constants.null_condition["file"])


def bundle_prompts(bundle: Bundle, runner: RunnerFactory, device: torch.device, warn: Warn) -> Conditioner:
    """Prompt -> condition on a bundle's text encoder graph and tokenizer (loaded on first use:
    a bundle exported without a text encoder still decodes conditions built elsewhere)."""

    @functools.cache
    def text_side() -> tuple[Any, TextEncode, torch.Tensor]:
        """(tokenizer, encode, null caption), once."""
        if bundle.text_max_length is None:
            raise ConfigError(
                f"bundle {bundle.path} has no text encoder: export it from a model directory whose "
                "config.json names a T5 folder (files.t5)"
            )
        encoder = runner(bundle, bundle.graph(TEXT_ENCODER_GRAPH))
        null = torch.from_numpy(null_caption(bundle)).to(device)
        return load_tokenizer(bundle.path), lambda i, m: encoder(ids=i, mask=m)["features"], null

    def condition(prompt: int | str) -> Condition:
        return prompt_condition(str(prompt), *text_side(), warn)

    return condition
