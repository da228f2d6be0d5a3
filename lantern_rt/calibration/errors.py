"""The error every calibration step raises for a bundle it cannot quantize."""

from __future__ import annotations

from lantern_rt.errors import LanternError


class CalibrationError(LanternError, ValueError):
    """The bundle cannot be calibrated, or a quantized graph breaks a rule."""
