"""A run's shape: how many images a pipeline decodes per step, in how many rows each, through how
many cache windows, in how many streams at once; the limits of each and the CPU cores a run
may share out (torch-free: the command line reads them for its --help)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lantern_rt.models.config import ConfigError

MAX_BATCH_SIZE = 256  # images per decode step
MAX_STREAMS = 64  # batches decoded at once, one thread each at least (docs/method.md §15)
# --streams auto's ceiling: each stream holds its own KV caches, and beyond it the streams' host
# work queues on Python's interpreter lock (16 cores: 4 streams made the most images/s, 8 fewer)
AUTO_STREAMS_MAX = 4
# Target step graphs per batch size, each reading a window of the KV cache's first slots
# (docs/method.md §12); measured on the demo (BENCHMARKS.md, issue 27): an AR step at B = 16
# reading 80 of 257 slots costs half the whole cache's step. 1 reads the whole cache only.
CACHE_WINDOWS = 4
MAX_CACHE_WINDOWS = 16


def check_batch_sizes(sizes: list[int] | tuple[int, ...]) -> list[int]:
    """``sizes`` (images per decode step) sorted without repeats; :class:`ConfigError` unless
    each is an integer in 1..MAX_BATCH_SIZE."""
    if not sizes or not all(
        isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_BATCH_SIZE for b in sizes
    ):
        raise ConfigError(f"batch sizes must be integers in 1..{MAX_BATCH_SIZE}, got {list(sizes)}")
    return sorted(set(sizes))


def check_stream_counts(counts: list[int] | tuple[int, ...]) -> list[int]:
    """``counts`` (decode streams) sorted without repeats; :class:`ConfigError` unless each is
    an integer in 1..MAX_STREAMS."""
    if not counts or not all(
        isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_STREAMS for n in counts
    ):
        raise ConfigError(f"stream counts must be integers in 1..{MAX_STREAMS}, got {list(counts)}")
    return sorted(set(counts))


def check_cache_windows(count: int) -> int:
    """``count`` (cache windows per step graph); :class:`ConfigError` unless in 1..MAX_CACHE_WINDOWS."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_CACHE_WINDOWS:
        raise ConfigError(f"--cache-windows must be an integer in 1..{MAX_CACHE_WINDOWS}, got {count!r}")
    return count


def available_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class RunShape:
    """How a pipeline decodes (every field checked):

    - ``batch_size`` images per decode step (the tokens do not depend on it);
    - ``guided``: each image's two CFG rows, or (False) its conditional row alone, for CFG scales
      of at most 1 (docs/method.md §13); a bundle runs the rows it was exported with;
    - ``cache_windows``: the target's step reads one of that many windows of its KV cache
      (docs/method.md §12): the torch backend's, and what a model directory's export holds (a
      bundle holds its own);
    - ``streams`` batches decoded at once, each on its share of the CPU threads (docs/method.md
      §15); None: chosen for the run (``--streams auto``, :func:`lantern_rt.runtime.streams.auto_streams`).
    """

    batch_size: int = 1
    guided: bool = True
    cache_windows: int = CACHE_WINDOWS
    streams: int | None = 1

    def __post_init__(self) -> None:
        check_batch_sizes([self.batch_size])
        check_cache_windows(self.cache_windows)
        if self.streams is not None:
            check_stream_counts([self.streams])
