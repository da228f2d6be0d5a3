"""Writing files and folders so that a failure never leaves a partial one behind.

Every temporary file or folder is ``.NAME.XXXXXXXX<suffix>`` beside its destination and held
with an ``flock`` while its writer lives, so a later writer of the same destination removes the
ones a killed run left (:func:`remove_stale`) and never a live run's. A run stopped by SIGTERM or
Ctrl-C removes its own first (:func:`sigterm_raises`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from lantern_rt.errors import Interrupted, LanternError


class WriteError(LanternError, OSError):
    """A file could not be written (a full disk, a file system that refuses it): one line;
    ``reason`` is the OS's word for why."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


def check_writable(path: Path | None, what: str) -> None:
    """:class:`WriteError` unless ``path`` can take a new regular file (written atomically at the
    end): its folder exists and takes files, and it is not a folder, a link or a device."""
    if path is None:
        return
    parent = path.absolute().parent
    if not parent.is_dir():
        raise WriteError(f"cannot write {what} {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise WriteError(f"cannot write {what} {path}: permission denied")
    if path.is_dir():
        raise WriteError(f"cannot write {what} {path}: it is a folder")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise WriteError(
            f"cannot write {what} {path}: it is a link or a device, not a file; choose another path"
        )
    try:  # a file system that refuses new files (/proc, a read-only mount) says so now
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.")
    except OSError as exc:
        raise WriteError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: no partial file on failure; an OS
    error (no space left, a file system that refuses the file) is a :class:`WriteError`."""
    write_together({Path(path): write})


def write_together(writes: Mapping[Path, Callable[[Path], object]]) -> None:
    """Call each ``write(tmp)`` on a temporary file beside its path, then rename them all into
    place: when any write or rename fails, none of the new files is left (those already renamed
    are removed) nor any temporary file; an OS error is a :class:`WriteError` naming the file."""
    staged: list[tuple[Path, Path, int]] = []  # (tmp, path, fd holding its lock)
    done: list[Path] = []
    path = Path()
    with sigterm_raises():
        try:
            for path, write in writes.items():
                remove_stale(path, path.suffix)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
                staged.append((Path(tmp), path, fd))
                fcntl.flock(fd, fcntl.LOCK_EX)
                write(Path(tmp))
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
            for tmp, path, _ in staged:
                os.replace(tmp, path)
                done.append(path)
        except BaseException as exc:
            for new in done:
                new.unlink(missing_ok=True)
            for tmp, _, _ in staged:
                tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):  # a nested atomic write names its own temporary file: name ours
                reason = exc.reason if isinstance(exc, WriteError) else str(exc.strerror or exc)
                raise WriteError(f"cannot write {path}: {reason}", reason) from None
            raise
        finally:
            for _, _, fd in staged:
                os.close(fd)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """For the block: SIGTERM raises :class:`~lantern_rt.errors.Interrupted` where the process
    is, as Ctrl-C raises KeyboardInterrupt, so that the block removes what it was writing before
    the process ends (SIGTERM's default action ends it at once); another SIGTERM is ignored until
    the block ends. Only in the main thread (where Python runs signal handlers) and only in place
    of the default action: a handler of the process's own is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs to its end
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def held(path: Path, create: bool = False, waiting: Callable[[], object] | None = None) -> Iterator[None]:
    """An exclusive ``flock`` on the file or folder ``path`` (``create``: a lock file, made when
    missing) for the block; ``waiting()`` is called first when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666) if create else os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_stale(dest: Path, suffix: str) -> None:
    """Remove the temporary files and folders ``.NAME.XXXXXXXX<suffix>`` beside ``dest`` that no
    live writer holds locked (left by a killed run); those it cannot remove stay."""
    dest = Path(dest)
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.[a-z0-9_]{{8}}{re.escape(suffix)}")
    with contextlib.suppress(OSError):
        entries = [p for p in dest.parent.iterdir() if pattern.fullmatch(p.name)]
        for entry in entries:
            with contextlib.suppress(OSError):
                fd = os.open(entry, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live writer
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink()
                finally:
                    os.close(fd)


@contextlib.contextmanager
def staged_folder(dest: Path, what: str, error: type[LanternError] = WriteError) -> Iterator[Path]:
    """A temporary folder ``.NAME.XXXXXXXX.tmp`` beside ``dest`` to write a whole folder into
    (held locked while it lives; the ones killed runs left are removed first; SIGTERM removes
    it too, :func:`sigterm_raises`), renamed to
    ``dest`` (replacing an existing one, :func:`replace_folder`) when the block succeeds and
    removed when it fails: readers see the old folder or the new one, never a part. An OS
    error making it is ``error``, one line naming ``what`` (the user's word for it) and
    ``dest``."""
    dest = Path(dest)
    with sigterm_raises():
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(dest, ".tmp")
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
        except OSError as err:
            raise error(f"cannot write {what} {dest}: {err.strerror or err}") from None
        try:
            with held(tmp):
                yield tmp
                tmp.chmod(0o755)  # mkdtemp made it private
                replace_folder(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def replace_folder(tmp: Path, dest: Path) -> None:
    """Rename the finished folder ``tmp`` to ``dest``; an existing ``dest`` is removed only after
    that succeeds (and put back when it fails)."""
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)  # a killed run's
    if dest.exists():
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
