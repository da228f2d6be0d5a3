"""Replaying a pure torch step function from captured CUDA graphs, one per input shape.

The function must read only its arguments and state that never moves (model weights, a KV
cache written in place between calls); it must not sync with the host. Arguments are copied
into static buffers before each replay, and the outputs are the graph's static buffers: valid
until the next call with the same shapes. The decode loop captures a whole step so
(``runtime.decode.DecodeStep``): its settings, such as the neighbour table, are state of the
step, read where they lie, and only the step's small inputs are copied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

StepFn = Callable[..., tuple[Tensor, ...]]
WARMUP_CALLS = 2  # eager runs on a side stream before capture (cuBLAS/cuDNN workspaces, autotuning)


def shape_key(args: tuple[Tensor, ...]) -> tuple:
    """The shapes and dtypes of a step's arguments: one captured or compiled graph per key."""
    return tuple((tuple(a.shape), a.dtype) for a in args)


@contextmanager
def restored(state: tuple[Tensor, ...]) -> Iterator[None]:
    """Put the tensors ``state`` back as they were on entry when the block ends (after the
    warm-up calls a capture or a compile runs for real)."""
    saved = [t.clone() for t in state]
    yield
    for t, value in zip(state, saved, strict=True):
        t.copy_(value)


class CudaGraphed:
    """``fn`` captured on first use for each tuple of argument shapes and dtypes, then replayed.

    ``state``: tensors ``fn`` updates in place (a cache's length): the warm-up runs before a
    capture really execute ``fn``, so these are restored after them, and the capture changes
    nothing (what the warm-ups wrote elsewhere must be harmless: a cache's stale slots)."""

    def __init__(self, fn: StepFn, state: tuple[Tensor, ...] = ()):
        self.fn, self.state = fn, state
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], tuple[Tensor, ...]]] = {}

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        key = shape_key(args)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(args)
        graph, static, outputs = entry
        for buffer, arg in zip(static, args, strict=True):
            buffer.copy_(arg, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(
        self, args: tuple[Tensor, ...]
    ) -> tuple[torch.cuda.CUDAGraph, list[Tensor], tuple[Tensor, ...]]:
        static = [a.clone() for a in args]
        with restored(self.state):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    self.fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.fn(*static)
        return graph, static, outputs
