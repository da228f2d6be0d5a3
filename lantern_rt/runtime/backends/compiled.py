"""A pure torch step function compiled with ``torch.compile`` (inductor, ``fullgraph=True``).

The whole decode step (``runtime.decode.DecodeStep``: draft, verify, accept, commit) is one
graph: a graph break is an error (``torch._dynamo.exc.Unsupported``), never a silent eager
fallback. Inductor writes C++ on a CPU (it needs a C++ compiler) and Triton on a GPU (it needs
Triton); on CUDA the compiled step is then captured in a CUDA graph as the eager one is
(:class:`~lantern_rt.runtime.backends.cuda_graphs.CudaGraphed` around :class:`Compiled`).
"""

from __future__ import annotations

import shutil
import time

import torch
from torch import Tensor

from lantern_rt.errors import LanternError, option
from lantern_rt.runtime.backends.cuda_graphs import StepFn, restored, shape_key

# Settings, windows and batch shapes a run may compile a step for, with room to spare: past
# this, dynamo would fall back to eager; it raises instead (fail_on_recompile_limit_hit).
RECOMPILE_LIMIT = 64


class CompileError(LanternError, RuntimeError):
    """The ``compile`` option cannot run here; the message names the missing piece and how to turn
    it off."""


def missing_compiler(device: torch.device | str) -> str | None:
    """What inductor lacks to compile for ``device`` (None: nothing): Triton on a GPU, the C++
    compiler it calls (``torch._inductor.config.cpp.cxx``) on a CPU."""
    if torch.device(device).type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton (the GPU code inductor writes), which is not installed"
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    names = tuple(name for name in names if name)
    if any(shutil.which(name) for name in names):
        return None
    return f"a C++ compiler ({' or '.join(names) or 'none configured'}: inductor's CPU code), which is not on PATH"


def require_compiler(device: torch.device | str) -> None:
    """:class:`CompileError` when ``torch.compile`` cannot build for ``device``."""
    missing = missing_compiler(device)
    if missing:
        raise CompileError(
            f"{option('compile')} needs {missing}: install it or use {option('compile', False)}"
        )


class Compiled:
    """``fn`` compiled with ``torch.compile(fullgraph=True)``; one graph per tuple of argument
    shapes and dtypes (no recompile for later calls of the same shapes).

    The first call of each shape runs ``fn`` once eagerly first, so that the tables a backend
    builds on first use (a tree's plans) exist before the trace reads them; ``state``, the
    tensors ``fn`` updates in place (a cache's length), is restored after it, as
    :class:`~lantern_rt.runtime.backends.cuda_graphs.CudaGraphed` does around its warm-ups.
    ``seconds``: the time spent compiling (each shape's first compiled call)."""

    def __init__(self, fn: StepFn, state: tuple[Tensor, ...] = ()):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self.fn, self.state = fn, state
        self.compiled = torch.compile(fn, fullgraph=True, backend="inductor", dynamic=False)
        self.shapes: set[tuple] = set()
        self.seconds = 0.0

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        key = shape_key(args)
        if key in self.shapes:
            return self.compiled(*args)
        with restored(self.state):
            self.fn(*args)
        start = time.perf_counter()
        outputs = self.compiled(*args)
        self.seconds += time.perf_counter() - start
        self.shapes.add(key)
        return outputs
