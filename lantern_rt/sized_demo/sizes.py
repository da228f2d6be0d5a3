"""The demo model at LlamaGen's sizes: the names, and the cached model directory of each.

A sized model is the demo widened to a LlamaGen GPT shape with its function kept
(:mod:`lantern_rt.sized_demo.widen`): the demo's tokens at the cost of a real-sized step. Each is
built on first use under ``$LANTERN_CACHE/models`` (or ``~/.cache/lantern-rt/models``), keyed
by the demo's files, the size, the seed and the widening's own source, so a changed recipe
builds anew. Torch-free at import: the command line reads :data:`SIZES` for its ``--help``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
from pathlib import Path

from lantern_rt.models.config import GPT_PRESETS, ConfigError
from lantern_rt.models.model_dir import DEMO_DIR

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


def sized_model_dir(size: str, seed: int = DEFAULT_SEED) -> Path:
    """The model directory of the demo at ``size`` (a :data:`SIZES` name), built on first use
    into the cache and reused after; concurrent first uses build it once (a file lock).
    :class:`ConfigError` for an unknown size, :class:`~lantern_rt.fileio.WriteError` when the
    cache cannot be written."""
    from lantern_rt.export_cache import cache_root
    from lantern_rt.fileio import WriteError, held
    from lantern_rt.sized_demo import widen

    size_shape(size)
    root = cache_root().parent / "models"
    out = root / f"demo-{size}-{_key(size, seed)}"
    if (out / "config.json").is_file():
        return out
    with contextlib.ExitStack() as stack:
        try:
            root.mkdir(parents=True, exist_ok=True)
            waiting = functools.partial(
                print, f"waiting for another run building {out.name}", file=sys.stderr
            )
            stack.enter_context(held(root / f".{out.name}.lock", create=True, waiting=waiting))
        except OSError as exc:
            raise WriteError(
                f"cannot write the model cache {root}: {exc.strerror or exc} (set LANTERN_CACHE to a "
                "writable folder)"
            ) from None
        if not (out / "config.json").is_file():
            print(f"building the demo at {size} in {out} (once; later runs reuse it)", file=sys.stderr)
            widen.write_widened(out, size, seed)
    return out


def _key(size: str, seed: int) -> str:
    """sha256 over the demo's files, the size, the seed and the source of the sizes and the widening."""
    h = hashlib.sha256(f"{size}/{seed}".encode())
    for file in [Path(__file__), Path(__file__).with_name("widen.py"), *sorted(DEMO_DIR.rglob("*"))]:
        if file.is_file():
            h.update(file.name.encode())
            h.update(file.read_bytes())
    return h.hexdigest()[:16]
