"""The registry of model families: a model directory names its family in ``config.json``
(``"family"``, LlamaGen's by default), and a bundle in its manifest. Adding a family is one
line here (docs/architecture.md)."""

from __future__ import annotations

from lantern_rt.families.base import Family
from lantern_rt.families.chameleon.family import ChameleonFamily
from lantern_rt.families.llamagen.family import LlamaGenFamily
from lantern_rt.models.config import ConfigError

FAMILIES: dict[str, Family] = {family.name: family for family in (LlamaGenFamily(), ChameleonFamily())}
DEFAULT_FAMILY = "llamagen"


def family_named(name: str) -> Family:
    """The family called ``name``; :class:`ConfigError` listing the known ones."""
    if name not in FAMILIES:
        raise ConfigError(f"family must be one of {', '.join(map(repr, FAMILIES))}, got {name!r}"[:300])
    return FAMILIES[name]
