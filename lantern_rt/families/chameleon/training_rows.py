"""A Chameleon-family drafter's training rows: each image's prompt as the runtime's two token
rows (conditional, unconditional), for ``training.drafter`` (docs/method.md §10)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lantern_rt.errors import TextEncoderError, first_line
from lantern_rt.families.chameleon.prompts import PromptLayout, prompt_rows
from lantern_rt.models.config import ConfigError


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
