"""The cached model directory of each sized demo: built on first use under
``$LANTERN_CACHE/models`` (or ``~/.cache/lantern-rt/models``), keyed by the demo's files, the size,
the seed and the widening's own source, so a changed recipe builds anew."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from lantern_rt.cache_paths import made_once
from lantern_rt.export_cache import cache_root
from lantern_rt.models.model_dir import DEMO_DIR
from lantern_rt.sized_demo import sizes, widen
from lantern_rt.sized_demo.sizes import DEFAULT_SEED, size_shape


def sized_model_dir(size: str, seed: int = DEFAULT_SEED) -> Path:
    """The model directory of the demo at ``size`` (a :data:`~lantern_rt.sized_demo.sizes.SIZES` name), built on first use
    into the cache and reused after; concurrent first uses build it once (a file lock).
    :class:`ConfigError` for an unknown size, :class:`~lantern_rt.fileio.WriteError` when the
    cache cannot be written."""
    size_shape(size)
    out = cache_root().parent / "models" / f"demo-{size}-{_key(size, seed)}"

    def build() -> None:
        print(f"building the demo at {size} in {out} (once; later runs reuse it)", file=sys.stderr)
        widen.write_widened(out, size, seed)

    return made_once(out, "config.json", build, f"building {out.name}", "model")


def _key(size: str, seed: int) -> str:
    """sha256 over the demo's files, the size, the seed and the source of the sizes and the widening."""
    h = hashlib.sha256(f"{size}/{seed}".encode())
    for file in [Path(sizes.__file__), Path(widen.__file__), *sorted(DEMO_DIR.rglob("*"))]:
        if file.is_file():
            h.update(file.name.encode())
            h.update(file.read_bytes())
    return h.hexdigest()[:16]
