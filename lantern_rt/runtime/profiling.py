"""NVTX ranges around the decode stages, for Nsight Systems; no-ops unless switched on.

``lantern generate --profile`` switches them on. Ranges come from the ``nvtx`` package (the
``profile`` extra) or, without it, from torch's NVTX bindings when CUDA is present; otherwise
they cost one function call. :func:`capture` brackets the steady state with
cudaProfilerStart/Stop so that ``nsys profile --capture-range=cudaProfilerApi`` records only it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

DOMAIN = "lantern-rt"
_NULL = contextlib.nullcontext()
_range: Callable[[str], contextlib.AbstractContextManager] | None = None


def _nvtx_range() -> Callable[[str], contextlib.AbstractContextManager] | None:
    """The best available NVTX range factory, or None when nothing can record ranges."""
    try:
        import nvtx
    except ImportError:
        nvtx = None
    if nvtx is not None:
        return lambda name: nvtx.annotate(name, domain=DOMAIN)
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range
    return None


@contextlib.contextmanager
def recording(on: bool) -> Iterator[bool]:
    """Ranges on (when ``on``) inside the block; yields whether they are actually recorded."""
    global _range
    previous = _range
    _range = _nvtx_range() if on else None
    try:
        yield _range is not None
    finally:
        _range = previous


def span(name: str) -> contextlib.AbstractContextManager:
    """An NVTX range named ``name`` (a shared no-op context when profiling is off)."""
    return _range(name) if _range is not None else _NULL


@contextlib.contextmanager
def capture(on: bool) -> Iterator[None]:
    """cudaProfilerStart/Stop around the block when ``on`` and CUDA is present."""
    active = on and torch.cuda.is_available()
    if active:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    try:
        yield
    finally:
        if active:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
