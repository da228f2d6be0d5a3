"""The cache's one rule for what it derives from a model (cache_paths.made_once): a folder is made
once, concurrent first uses wait for it, and a cache that cannot be written is one error naming
it. The export cache and the sized demos' model cache both go through it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from lantern_rt.cache_paths import made_once
from lantern_rt.fileio import WriteError


def maker(out: Path, calls: list[str], pause: float = 0.0):
    def make() -> None:
        calls.append(threading.current_thread().name)
        time.sleep(pause)
        out.mkdir()
        (out / "ready.json").write_text("{}")

    return make


def test_a_folder_is_made_once_by_concurrent_first_uses(tmp_path):
    out, calls = tmp_path / "cache" / "thing", []
    threads = [
        threading.Thread(target=made_once, args=(out, "ready.json", maker(out, calls, 0.3), "making", "test"))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (out / "ready.json").is_file()
    assert made_once(out, "ready.json", maker(out, calls), "making", "test") == out
    assert len(calls) == 1
    lock = tmp_path / "cache" / ".thing.lock"
    assert lock.is_file() and lock.stat().st_size == 0  # the empty lock stays (made_once says why)


def test_a_failed_make_leaves_the_folder_unmade_for_the_next_run(tmp_path):
    out = tmp_path / "thing"

    def fail() -> None:
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        made_once(out, "ready.json", fail, "making", "test")
    calls: list[str] = []
    made_once(out, "ready.json", maker(out, calls), "making", "test")
    assert len(calls) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_cache_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(
            WriteError, match=r"cannot write the model cache .*ro/models: .*set LANTERN_CACHE"
        ):
            made_once(parent / "models" / "thing", "ready.json", lambda: None, "making", "model")
    finally:
        parent.chmod(0o700)


def test_a_cache_under_a_file_is_one_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(WriteError, match=r"cannot write the export cache .*file/bundles: "):
        made_once(blocker / "bundles" / "thing", "ready.json", lambda: None, "making", "export")
