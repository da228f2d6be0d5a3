"""Prompts for the Chameleon family (Anole-7b-v0.1-hf, Lumina-mGPT-7B-768): the model's own
tokenizer, and the conditional and unconditional token rows of classifier-free guidance.

Ported from LANTERN (github.com/jadohu/LANTERN):

- Anole: ``models/ea_model_anole.py`` ``EaModel.generate`` (the same lines are in
  ``models/kv_variants/modeling_anole_kv.py`` ``ChameleonForConditionalGeneration.generate``):
  conditional ``<s> text <reserved08706> <racm3:break>`` = ``[0, *text, 8710, 8197]``,
  unconditional ``[0, 8197]``, left padded with ``<pad>`` = 1 and masked.
- Lumina-mGPT: the text ``"Generate an image of 768x768 according to the following prompt:\\n"
  + prompt`` (``entrypoints/generate_images.py``), one human turn ending with the separator
  ``<reserved08706>`` (``models/base_models/lumina_mgpt/conversation.py``) after ``<s>``
  (``xllmx/data/item_processor.py``, ``xllmx/model/tokenizer.py``), then the fixed image start
  ``[8197, 8828, 8828]`` (``models/ea_model_lumina_mgpt.py`` ``generate``: begin of image, h and w
  grid counts ``<reserved08824>``); the unconditional row is that image start alone.

The ids are hard-coded, as in the authors' code; :func:`check_tokenizer` checks them against the
tokenizer's own token names. Both rows are left padded, so the last slot of each row holds the
token that predicts the first image token, and ``cumsum(mask) - 1`` gives the authors' positions.
See docs/method.md §10 and docs/chameleon_sources.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lantern_rt.errors import TextEncoderError, first_line, require

TOKENIZER_FILE = "tokenizer.json"

BOS_ID = 0  # <s>
PAD_ID = 1  # <pad>
END_OF_IMAGE_ID = 8196  # <eoss>
BEGIN_OF_IMAGE_ID = 8197  # <racm3:break>
SEPARATOR_ID = 8710  # <reserved08706>: end of turn (Lumina's sep_token, HF's sep_token_id)
NEWLINE_ID = 8803  # <reserved08799>: Lumina's end of an image row
GRID_BASE_ID = 8804  # <reserved08800>: Lumina's grid count n is GRID_BASE_ID + n
LUMINA_PATCH = 32  # pixels per grid cell (FlexARItemProcessor.patch_size)

_NAMES = {
    BOS_ID: "<s>",
    PAD_ID: "<pad>",
    END_OF_IMAGE_ID: "<eoss>",
    BEGIN_OF_IMAGE_ID: "<racm3:break>",
}
_RESERVED_OFFSET = 4  # <reservedNNNNN> has id NNNNN + 4 (8710, 8803, 8804 + n in the authors' code)


def token_name(token_id: int) -> str:
    """Chameleon's name for one of the layout ids (``<s>``, ``<racm3:break>``, ``<reserved08706>``)."""
    return _NAMES.get(token_id, f"<reserved{token_id - _RESERVED_OFFSET:05d}>")


@dataclass(frozen=True)
class PromptLayout:
    """One family's prompt rules: the conditional row is ``prefix_ids + text + suffix_ids``, with
    text the tokens of ``template`` with ``{prompt}`` replaced; the unconditional row is
    ``uncond_ids``; both are left padded with ``pad_id``. ``named_ids``: (id, token name) pairs
    that :func:`check_tokenizer` checks against the tokenizer."""

    name: str
    template: str
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    uncond_ids: tuple[int, ...]
    pad_id: int = PAD_ID
    named_ids: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if "{prompt}" not in self.template:
            raise TextEncoderError(f"prompt layout {self.name}: the template lacks '{{prompt}}'")
        if not self.uncond_ids:
            raise TextEncoderError(f"prompt layout {self.name}: the unconditional row is empty")

    @property
    def fixed_length(self) -> int:
        """Tokens of the conditional row that are not text."""
        return len(self.prefix_ids) + len(self.suffix_ids)

    def text(self, prompt: str) -> str:
        """The text to tokenize for ``prompt``."""
        return self.template.replace("{prompt}", prompt)


def _named(*ids: int) -> tuple[tuple[int, str], ...]:
    return tuple((i, token_name(i)) for i in dict.fromkeys(ids))


def anole_layout() -> PromptLayout:
    """Anole: ``<s> prompt <reserved08706> <racm3:break>``; unconditional ``<s> <racm3:break>``."""
    prefix, suffix, uncond = (BOS_ID,), (SEPARATOR_ID, BEGIN_OF_IMAGE_ID), (BOS_ID, BEGIN_OF_IMAGE_ID)
    return PromptLayout("anole", "{prompt}", prefix, suffix, uncond, PAD_ID, _named(PAD_ID, *prefix, *suffix))


def lumina_layout(size: int = 768) -> PromptLayout:
    """Lumina-mGPT for ``size`` x ``size`` images: ``<s> Generate an image of {size}x{size}
    according to the following prompt:\\n{prompt} <reserved08706> <racm3:break> h w`` with h = w the
    grid count token of ``size // 32``; unconditional ``<racm3:break> h w`` (no ``<s>``)."""
    if not isinstance(size, int) or size < LUMINA_PATCH or size % LUMINA_PATCH:
        raise TextEncoderError(f"Lumina-mGPT image size must be a multiple of {LUMINA_PATCH}, not {size!r}")
    grid = GRID_BASE_ID + size // LUMINA_PATCH
    start = (BEGIN_OF_IMAGE_ID, grid, grid)
    template = f"Generate an image of {size}x{size} according to the following prompt:\n{{prompt}}"
    prefix, suffix = (BOS_ID,), (SEPARATOR_ID, *start)
    return PromptLayout("lumina", template, prefix, suffix, start, PAD_ID, _named(PAD_ID, *prefix, *suffix))


ANOLE = anole_layout()
LUMINA = lumina_layout(768)


def prompt_layout(name: str, image_size: int) -> PromptLayout:
    """A model directory's ``prompt.layout`` for images of ``image_size`` pixels a side."""
    if name == "anole":
        return ANOLE
    if name == "lumina":
        return lumina_layout(image_size)
    raise TextEncoderError(f"unknown prompt layout {name!r}; choose anole or lumina")


def load_chameleon_tokenizer(folder: Path) -> Any:
    """The model's own tokenizer, ``folder``/tokenizer.json, as a ``tokenizers.Tokenizer``.

    A missing or unreadable file is a one-line :class:`TextEncoderError` naming it; a missing
    ``tokenizers`` package gives the install hint.
    """
    folder = Path(folder)
    tokenizer_cls = require("tokenizers", "pip install 'lantern-rt[chameleon]'").Tokenizer
    file = folder / TOKENIZER_FILE
    if not folder.is_dir():
        raise TextEncoderError(f"{folder}: no such tokenizer folder")
    if not file.is_file():
        raise TextEncoderError(f"{file}: no such file (the Chameleon tokenizer)")
    try:
        return tokenizer_cls.from_file(str(file))
    except Exception as err:  # tokenizers raises Exception for bad JSON or an unknown model
        raise TextEncoderError(f"{file}: the tokenizer does not load: {first_line(err)}"[:300]) from err


def _backend(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer``; a transformers fast tokenizer is unwrapped."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def check_tokenizer(tokenizer: Any, layout: PromptLayout) -> None:
    """A one-line :class:`TextEncoderError` unless each of ``layout.named_ids`` is the id of that
    token name in ``tokenizer``."""
    backend = _backend(tokenizer)
    for token_id, name in layout.named_ids:
        found = backend.token_to_id(name)
        if found != token_id:
            where = "absent" if found is None else f"id {found}"
            raise TextEncoderError(
                f"the tokenizer does not fit {layout.name}: {name} is {where}, not id {token_id}"
            )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text`` without the tokenizer's own special tokens (an HF ``tokenizer.json``
    adds ``<s>``; the layout adds it instead)."""
    return list(_backend(tokenizer).encode(text, add_special_tokens=False).ids)


class PromptRows(NamedTuple):
    """``ids`` int64 [2, length] (row 0 conditional, row 1 unconditional), left padded;
    ``mask`` bool [2, length], True on real tokens; ``truncated``: the prompt's text was cut."""

    ids: Tensor
    mask: Tensor
    truncated: bool


def prompt_rows(tokenizer: Any, prompt: str, length: int, layout: PromptLayout) -> PromptRows:
    """The conditional and unconditional rows of ``prompt`` in ``layout``, both left padded to
    ``length`` with ``layout.pad_id``.

    Text longer than ``length - layout.fixed_length`` tokens is cut at the end (the prefix and
    suffix ids are kept) and ``truncated`` is True. An empty prompt is the layout with no
    text (Anole: ``<s> <reserved08706> <racm3:break>``), not the unconditional row. A ``length``
    without room for the fixed ids and one text token is a one-line :class:`TextEncoderError`.
    """
    if not isinstance(prompt, str):
        raise TextEncoderError(f"a prompt must be a string, not {type(prompt).__name__}")
    need = max(layout.fixed_length + 1, len(layout.uncond_ids))
    if isinstance(length, bool) or not isinstance(length, int) or length < need:
        raise TextEncoderError(
            f"prompt length {length!r} is too small for {layout.name}: it needs at least {need} tokens "
            f"({layout.fixed_length} fixed and one of text)"
        )
    check_tokenizer(tokenizer, layout)
    text = encode_text(tokenizer, layout.text(prompt))
    room = length - layout.fixed_length
    truncated = len(text) > room
    cond = [*layout.prefix_ids, *text[:room], *layout.suffix_ids]
    ids = torch.full((2, length), layout.pad_id, dtype=torch.int64)
    mask = torch.zeros((2, length), dtype=torch.bool)
    for row, tokens in enumerate((cond, layout.uncond_ids)):
        ids[row, length - len(tokens) :] = torch.tensor(tokens, dtype=torch.int64)
        mask[row, length - len(tokens) :] = True
    return PromptRows(ids, mask, truncated)
