"""Decode streams: several batches decoding at once on one CPU, one thread each (docs/method.md §15).

A stream is what :func:`~lantern_rt.runtime.decode.decode_images` needs (a target with its own
cache, its speculation, its captured steps). Streams take their images from one shared queue,
so the whole run is one list of jobs however it is split; an image's tokens depend only on its
job (its condition and its random stream), never on the stream that decodes it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from lantern_rt.errors import option
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.backends.base import TargetBackend
from lantern_rt.runtime.decode import ImageResult, Job, JobSource, Speculation, StepCache, decode_images
from lantern_rt.runtime.run_shape import AUTO_STREAMS_MAX, RunShape, available_cores
from lantern_rt.runtime.sampling import SamplingConfig


@dataclass(frozen=True)
class Stream:
    """One decode stream: a target (its KV cache is the stream's own), its speculation (with
    the drafter's own cache) and where its compiled or captured steps are kept (None: eager)."""

    target: TargetBackend
    speculation: Speculation | None = None
    step_graphs: StepCache | None = None


_DONE = object()  # a stream's last message


def auto_streams(threads: int, batches: int, cores: int | None = None) -> tuple[int, int]:
    """``--streams auto`` on the CPU: (streams, threads) for a run of ``batches`` batches on
    ``threads`` CPU threads (0: the library's choice, i.e. every one of ``cores``, default
    :func:`available_cores`). One stream per thread, at most :data:`AUTO_STREAMS_MAX` and
    ``batches``; with several streams, threads 0 becomes the cores, shared out among them. On
    two cores two one-thread streams made 1.4-2.2x the images/s of one two-thread stream at
    every batch size measured (BENCHMARKS.md, "Decode streams")."""
    budget = threads or (cores or available_cores())
    streams = max(1, min(budget, batches, AUTO_STREAMS_MAX))
    return streams, threads if streams == 1 else budget


def cpu_streams(shape: RunShape, threads: int, images: int | None) -> tuple[int, int]:
    """(streams, threads) of a run in ``shape`` on the CPU: its streams as given, or for streams
    None :func:`auto_streams` for a run of ``images`` images (None: a run of any length)."""
    if shape.streams is not None:
        return shape.streams, threads
    batches = AUTO_STREAMS_MAX if images is None else -(-images // shape.batch_size)
    return auto_streams(threads, batches)


def decode_streams(
    streams: Iterable[Stream], jobs: Iterable[Job] | JobSource, num_tokens: int, sampling: SamplingConfig
) -> Iterator[tuple[int, ImageResult]]:
    """:func:`~lantern_rt.runtime.decode.decode_images` of ``jobs`` over ``streams``, each in its
    own thread, yielding (job index, result) as images finish in any stream.

    A stream takes the next job whenever one of its slots frees, so the jobs are shared out as
    the streams go; a single stream runs in the caller's thread. The first error in a stream
    stops the others (each at its next finished image) and is raised here; so is a caller
    that stops early. The threads overlap where the graphs release Python's lock (onnxruntime
    does while it runs a graph). A :class:`~lantern_rt.runtime.decode.JobSource` is shared as
    it is (results under its keys): every stream polls it."""
    streams = list(streams)
    if len(streams) == 1:
        s = streams[0]
        yield from decode_images(s.target, jobs, num_tokens, sampling, s.speculation, s.step_graphs)
        return
    sourced = isinstance(jobs, JobSource)
    shared = enumerate(() if sourced else jobs)
    lock = threading.Lock()
    stop = threading.Event()
    results: queue.Queue = queue.Queue()

    def taken(numbers: list[int]) -> Iterator[Job]:
        """The shared jobs, one at a time, remembering each one's index in ``numbers``."""
        while not stop.is_set():
            with lock:
                item = next(shared, None)
            if item is None:
                return
            numbers.append(item[0])
            yield item[1]

    def run(stream: Stream) -> None:
        numbers: list[int] = []
        try:
            decoded = decode_images(
                stream.target,
                jobs if sourced else taken(numbers),
                num_tokens,
                sampling,
                stream.speculation,
                stream.step_graphs,
            )
            for key, result in decoded:
                results.put((key if sourced else numbers[key], result))
                if stop.is_set():
                    break
        except BaseException as error:  # re-raised in the caller's thread
            stop.set()
            results.put(error)
        finally:
            results.put(_DONE)

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    running = len(threads)
    try:
        while running:
            item = results.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def stream_threads(threads: int, streams: int) -> int:
    """Each stream's share of ``threads`` CPU threads (0, the library's choice, stays 0 for a
    single stream and is one per stream for several); :class:`ConfigError` for fewer threads
    than streams."""
    if streams < 1:
        raise ConfigError(f"at least one stream, got {streams}")
    if 0 < threads < streams:
        raise ConfigError(
            f"{streams} streams need a thread each and have {threads} to share ({option('threads')}, "
            f"at most the cores this process may use): use {option('streams', threads)} or fewer, or "
            f"{option('threads', 0)}"
        )
    return threads if streams == 1 else max(1, threads // streams)
