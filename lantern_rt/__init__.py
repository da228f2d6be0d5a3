"""lantern-rt: LANTERN++ speculative decoding for visual autoregressive models.

``lantern_rt.load(...)`` (:func:`lantern_rt.api.load`) is the Python API; it is imported on
first use, so that ``import lantern_rt`` loads nothing else."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "load":
        from lantern_rt.api import load

        return load
    raise AttributeError(f"module 'lantern_rt' has no attribute {name!r}")
