"""The T5 text encoder of text-to-image models (LlamaGen: flan-t5-xl, 120 tokens x 2048 features).

A Hugging Face folder (``config.json``, ``model.safetensors`` or ``pytorch_model.bin``, possibly
sharded with an index, and the tokenizer files) loaded as ``transformers.T5EncoderModel`` in fp32
(T5 overflows in fp16) with eager attention: T5's original code path, and the one that exports to
ONNX (:mod:`lantern_rt.families.llamagen.text_encoder_graph`). transformers is imported only when a model is loaded
(``pip install 'lantern-rt[t2i]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lantern_rt.errors import TextEncoderError, first_line, require
from lantern_rt.families.llamagen.captions import INSTALL_HINT


def load_text_encoder(
    folder: Path, device: str | torch.device = "cpu", caption_dim: int | None = None
) -> Any:
    """The ``T5EncoderModel`` in ``folder``, fp32, eval mode, on ``device``. Raises
    :class:`TextEncoderError` for a missing folder or config, for weights that do not load
    (missing tensors included: transformers would leave them random) and for features of
    another width than the target's ``caption_dim`` (when given)."""
    folder = Path(folder)
    transformers = require("transformers", INSTALL_HINT)
    if not folder.is_dir():
        raise TextEncoderError(f"{folder}: no such text encoder folder")
    if not (folder / "config.json").is_file():
        raise TextEncoderError(f"{folder}: no config.json (a T5 encoder in the Hugging Face layout)")
    transformers.utils.logging.disable_progress_bar()  # its per-load bars say nothing to our users
    try:
        model, info = transformers.T5EncoderModel.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
    except Exception as err:  # transformers raises many types; report one line
        raise TextEncoderError(f"{folder}: the T5 encoder does not load: {first_line(err)}") from err
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise TextEncoderError(f"{folder}: the T5 weights lack {missing[0]}{more}")
    if caption_dim is not None and model.config.d_model != caption_dim:
        raise TextEncoderError(
            f"text encoder {folder} makes {model.config.d_model}-wide features; the target reads "
            f"caption_dim {caption_dim}"
        )
    return model.to(device).eval()


def encode(model: Any, ids: Tensor, mask: Tensor) -> Tensor:
    """T5 features [N, L, C], fp32: ``last_hidden_state`` of ``ids`` and ``mask`` [N, L]."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    return out.float()
