"""A Chameleon-family drafter's training rows: each image's prompt as the runtime's two token
rows (conditional, unconditional), for ``training.drafter`` (docs/method.md §10)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lantern_rt.errors import TextEncoderError, first_line
from lantern_rt.families.chameleon.prompts import PromptLayout, prompt_rows
from lantern_rt.models.config import ConfigError
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.kv_cache import prefill_mask


@dataclass(frozen=True)
class PromptConditions:
    """N images' prompt conditions (a Chameleon-family target): ``ids`` int64 [N, 2, P], each
    image's conditional row then its unconditional row, left padded to the P prefix slots, and
    ``mask`` bool [N, 2, P], True on the slots later tokens see (``prompts.prompt_rows``).
    Indexing selects images, as a label array's does."""

    ids: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 3 or self.ids.shape[1] != 2 or self.mask.shape != self.ids.shape:
            raise ConfigError(
                f"prompt conditions are ids and mask [N, 2, P], got {list(self.ids.shape)} and "
                f"{list(self.mask.shape)}"
            )

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index) -> PromptConditions:
        return PromptConditions(self.ids[index], self.mask[index])

    def rows(self, uncond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per image its unconditional row where ``uncond`` [N] is True, else its conditional one:
        (ids [N, P], visible slots [N, P])."""
        image, row = torch.arange(len(self)), uncond.long()
        return self.ids[image, row], self.mask[image, row]

    def teacher_forced_hidden(
        self, target: Transformer, codes: torch.Tensor, uncond: torch.Tensor
    ) -> torch.Tensor:
        """The target's hidden states over the prompt rows and ``codes`` (``TrainingRows``), under
        the runtime's masks: the prefill hides the padding slots but each slot sees itself, image
        tokens see every visible slot and the earlier image tokens (``kv_cache.prefill_mask``,
        ``cache_mask``), at positions 0..P+T-1."""
        cfg = target.config
        if cfg.model_type != "chameleon":
            raise ConfigError(
                f"prompt rows train a Chameleon-family target's drafter, not a {cfg.model_type} one"
            )
        if self.ids.shape[2] != cfg.cls_token_num:
            raise ConfigError(
                f"prompt rows of {self.ids.shape[2]} slots; this model's prompts have {cfg.cls_token_num}"
            )
        ids, visible = self.rows(uncond)
        h = torch.cat([target.embed_condition(ids), target.tok_embeddings(codes)], dim=1)
        # the image tokens are visible slots past the prefix: prefill_mask's rule is the whole mask
        mask = prefill_mask(F.pad(visible, (0, codes.shape[1]), value=True))
        _, hidden, _, _ = target.step(h, torch.arange(h.shape[1]), mask, None, None)
        return hidden

    def prefix_pairs(self, uncond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots 1..P-1's prompt token ids (each pair carries the row's next prompt token) and
        which pairs are seen: the slots before them that are not padding (``TrainingRows``)."""
        ids, visible = self.rows(uncond)
        return ids[:, 1:], visible[:, :-1]


def prompt_conditions(
    tokenizer: Any,
    prompts: Sequence[str],
    slots: int,
    layout: PromptLayout,
    warn: Callable[[int], None] | None = None,
) -> PromptConditions:
    """The prompt rows of ``prompts`` as the runtime builds them (``prompts.prompt_rows``
    in ``layout``, ``slots`` prefix slots); ``warn`` is told the index of each prompt whose end
    is cut. A prompt that gives no rows raises a one-line ``TextEncoderError`` naming its index."""
    ids, masks = [], []
    for i, prompt in enumerate(prompts):
        try:
            rows = prompt_rows(tokenizer, str(prompt), slots, layout)
        except TextEncoderError as exc:
            raise TextEncoderError(f"prompt {i} ({str(prompt)[:40]!r}): {first_line(exc)}") from None
        if rows.truncated and warn is not None:
            warn(i)
        ids.append(rows.ids)
        masks.append(rows.mask)
    return PromptConditions(torch.stack(ids), torch.stack(masks))
