"""The demo model at LlamaGen's sizes: their names and shapes.

A sized model is the demo widened to a LlamaGen GPT shape with its function kept
(:mod:`lantern_rt.sized_demo.widen`): the demo's tokens at the cost of a real-sized step
(:mod:`lantern_rt.sized_demo.cache` builds and keeps each). Torch-free at import: the command
line reads :data:`SIZES` for its ``--help``.
"""

from __future__ import annotations

from lantern_rt.models.config import GPT_PRESETS, ConfigError

# LlamaGen's GPT shapes (dim, layers, heads; head dim 64) and ``tiny``, the smallest widening
# that still has an extra head and extra layers (for tests)
SIZES: dict[str, dict[str, int]] = {
    "GPT-B": GPT_PRESETS["GPT-B"],
    "GPT-L": GPT_PRESETS["GPT-L"],
    "GPT-XL": GPT_PRESETS["GPT-XL"],
    "tiny": dict(n_layer=8, n_head=6, dim=384),
}
# LlamaGen's SwiGLU rounding (its ModelArgs default): FFN widths 2048 / 2816 / 3584 for B / L / XL
MULTIPLE_OF = 256
DEFAULT_SEED = 0


def size_shape(size: str) -> dict[str, int]:
    """The GPT fields of ``size`` (``n_layer``, ``n_head``, ``dim``); :class:`ConfigError`
    naming the valid sizes otherwise."""
    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}; choose from {', '.join(SIZES)}")
    return dict(SIZES[size])
