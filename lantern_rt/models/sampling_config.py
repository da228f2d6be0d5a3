"""How the next token is chosen: :class:`SamplingConfig`, the sampling settings of an image
(docs/method.md §2), declared once here with their ranges. What reads the settings by name
(a model directory's ``sampling_defaults``, the graphs' inputs, a request to ``lantern serve``)
takes the names and types from :func:`setting_types`. Torch-free.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, fields

from lantern_rt.errors import LanternError


class SamplingError(LanternError, ValueError):
    """Sampling settings are out of range."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the mixed logits. ``temperature == 0`` means greedy."""

    cfg_scale: float  # no default: see lantern_rt.settings.default_cfg_scale
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.cfg_scale) or self.cfg_scale < 0:
            raise SamplingError(f"CFG scale must be a finite number >= 0, got {self.cfg_scale}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1) or math.isnan(self.top_p):
            raise SamplingError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def guided(self) -> bool:
        """Whether the unconditional rows matter: a CFG scale above 1 (at most 1, the
        conditional rows alone decide, :func:`~lantern_rt.runtime.sampling.cfg_mix`;
        docs/method.md §13)."""
        return self.cfg_scale > 1

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p removes tokens (both off: every token stays)."""
        return self.top_k > 0 or self.top_p < 1.0


@functools.cache
def setting_types() -> dict[str, type]:
    """Each sampling setting's type (float or int) by name, in the order declared."""
    hints = typing.get_type_hints(SamplingConfig)
    return {f.name: hints[f.name] for f in fields(SamplingConfig)}


# The settings of the draw from the mixed logits: all but the CFG scale, which mixes them
DRAW_SETTINGS = tuple(name for name in setting_types() if name != "cfg_scale")
