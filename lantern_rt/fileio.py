"""Writing files and folders so that a failure never leaves a partial one behind."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: no partial file on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_folder(tmp: Path, dest: Path) -> None:
    """Rename the finished folder ``tmp`` to ``dest``; an existing ``dest`` is removed only after
    that succeeds (and put back when it fails)."""
    old = dest.with_name(f".{dest.name}.old")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
    try:
        tmp.rename(dest)
    except OSError:
        if old.exists():
            old.rename(dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def sha256(path: Path) -> str:
    """The file's sha256 as hex."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
