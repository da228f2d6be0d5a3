"""The T5 text encoder as a bundle graph, and the tokenizer files that go beside it.

One prompt of ``L`` token ids and its attention mask -> ``last_hidden_state`` [1, L, C], always
fp32 (T5's activations overflow fp16). The model runs with eager attention: transformers' SDPA
path does not get through the dynamo exporter (a ``reshape`` of SDPA's transposed output is
decomposed into an invalid ``view``); the numbers are the same. The relative position bias
depends only on ``L``, so the exporter folds it into a constant.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lantern_rt.bundle import TEXT_ENCODER_GRAPH
from lantern_rt.errors import TextEncoderError
from lantern_rt.graph_spec import GraphSpec, TensorSpec

TOKENIZER_FILES = (
    "tokenizer.json",
    "spiece.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


class TextEncoderGraph(nn.Module):
    """``ids``, ``mask`` int64 [1, L] -> ``features`` fp32 [1, L, C] of a ``T5EncoderModel``
    (switched to fp32 and eager attention in place: its config object too)."""

    def __init__(self, model: Any, length: int):
        super().__init__()
        if length < 1:
            raise TextEncoderError(f"the text encoder graph needs at least one token, not {length}")
        if model.config._attn_implementation != "eager":
            model.set_attn_implementation("eager")
        self.model, self.length = model.float().eval(), length
        c = model.config
        self.spec = GraphSpec(
            TEXT_ENCODER_GRAPH,
            (TensorSpec("ids", (1, length), "int64"), TensorSpec("mask", (1, length), "int64")),
            (TensorSpec("features", (1, length, c.d_model), "float32"),),
            torch.float32,
        )

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()

    def reference_forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """The same features from the transformers model itself."""
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random ids in the vocabulary, right padded after a random number of valid tokens
        (some padding when ``L > 1``): ``</s>`` last, then ``<pad>``, as the tokenizer writes."""
        c, length = self.model.config, self.length
        valid = int(torch.randint(1, max(length, 2), (), generator=g))  # 1 .. L-1 (L when L == 1)
        ids = torch.randint(c.vocab_size, (1, length), generator=g)
        ids[0, valid - 1] = c.eos_token_id if c.eos_token_id is not None else 1
        ids[0, valid:] = c.pad_token_id if c.pad_token_id is not None else 0
        mask = (torch.arange(length) < valid).to(torch.int64)[None]
        return ids, mask


def copy_tokenizer(folder: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files of ``folder`` that exist (:data:`TOKENIZER_FILES`) into ``dest``;
    their names. Raises :class:`TextEncoderError` when ``folder`` has neither ``tokenizer.json``
    nor ``spiece.model``."""
    folder, dest = Path(folder), Path(dest)
    names = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not {"tokenizer.json", "spiece.model"} & set(names):
        raise TextEncoderError(f"{folder}: no tokenizer.json or spiece.model to copy")
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(folder / name, dest / name)
    return names
