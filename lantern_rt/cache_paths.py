"""Where lantern-rt keeps what it derives from a model: its cache folder (``$LANTERN_CACHE`` or
``~/.cache/lantern-rt``: exported bundles, widened demos, tuning records) and a model directory's
fingerprint, which names what it derived from that model's content."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lantern_rt.models.model_dir import ModelDir


def cache_folder() -> Path:
    """``$LANTERN_CACHE``, else ``~/.cache/lantern-rt``."""
    return Path(os.environ.get("LANTERN_CACHE", Path.home() / ".cache" / "lantern-rt"))


def model_fingerprint(md: ModelDir) -> str:
    """sha256 over the model's config and every weight file it names (folders included)."""
    h = hashlib.sha256((md.root / "config.json").read_bytes())
    for key in sorted(md.files):
        path = md.path(key)
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and file.name != "train_state.pt":
                h.update(file.name.encode())
                h.update(file.read_bytes())
    return h.hexdigest()
