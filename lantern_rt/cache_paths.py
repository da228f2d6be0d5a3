"""Where lantern-rt keeps what it derives from a model: its cache folder (``$LANTERN_CACHE`` or
``~/.cache/lantern-rt``: exported bundles, widened demos, tuning records) and a model directory's
fingerprint, which names what it derived from that model's content."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lantern_rt.fileio import WriteError, held

if TYPE_CHECKING:
    from lantern_rt.models.model_dir import ModelDir


def cache_folder() -> Path:
    """``$LANTERN_CACHE``, else ``~/.cache/lantern-rt``."""
    return Path(os.environ.get("LANTERN_CACHE", Path.home() / ".cache" / "lantern-rt"))


def made_once(out: Path, ready: str, make: Callable[[], object], doing: str, cache: str) -> Path:
    """``out``, a folder of the ``cache`` folder, made by ``make()`` unless its file ``ready``
    exists: concurrent first uses make it once, the others waiting (``doing`` says for what) on the
    lock file beside it. The empty lock file stays, after a stopped or killed run too: no lock is
    left held, and removing it would let a third run lock a new file while a waiting one holds
    this one. :class:`~lantern_rt.fileio.WriteError` when the folder cannot be written."""
    if (out / ready).is_file():
        return out
    root = out.parent
    with contextlib.ExitStack() as stack:
        try:
            root.mkdir(parents=True, exist_ok=True)
            waiting = functools.partial(print, f"waiting for another run {doing}", file=sys.stderr)
            stack.enter_context(held(root / f".{out.name}.lock", create=True, waiting=waiting))
        except OSError as exc:
            raise WriteError(
                f"cannot write the {cache} cache {root}: {exc.strerror or exc} (set LANTERN_CACHE to a "
                "writable folder)"
            ) from None
        if not (out / ready).is_file():
            make()
    return out


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
