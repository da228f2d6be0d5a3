"""The engine: one thread that runs the decode loop over the requests' images (continuous
batching) while the event loop only queues requests and waits for them.

The engine is the loop's :class:`~lantern_rt.runtime.decode.JobSource`: a free slot takes the
next image at the next step, from the waiting requests in turn (a request that arrives while a
long one runs starts at the next free slot, not after it), and the loop waits only when every
slot is idle. A cancelled request (its client left, its deadline passed) is dropped from the
queue and its images free their slots after the step that is running.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from lantern_rt.api import Generator
from lantern_rt.errors import LanternError, first_line
from lantern_rt.runtime.decode import IDLE, ImageResult, Job
from lantern_rt.runtime.sampling import SamplingConfig, check_filterable
from lantern_rt.serve.metrics import Metrics
from lantern_rt.settings import check_guidance

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingConfig))  # a request may set each


class QueueFull(LanternError):
    """The queue holds too many images: try again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyImages(LanternError):
    """A request of more images than the queue holds: it could never be taken."""


class Closed(LanternError):
    """The engine takes no more requests (it is stopping, or its model failed to load)."""


class BadSetting(LanternError):
    """A request's sampling setting ``field`` that this engine cannot decode with."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Served:
    """What the engine makes, as a client sees it: images of ``image_size`` pixels a side from
    prompts (``takes_prompts``) or class ids, by ``method`` (its draft ``tree``; None for AR)."""

    image_size: int
    takes_prompts: bool
    method: str
    tree: str | None


class EngineClient(Protocol):
    """What the HTTP app asks of the engine (vLLM's ``EngineClient``): health and readiness, what
    it serves, a request's conditions and sampling checked, its images submitted or cancelled,
    and its tokens as images. The app holds nothing else of the model."""

    metrics: Metrics
    ready: threading.Event
    failed: str | None

    @property
    def served(self) -> Served: ...

    def start(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...

    def conditions(self, prompt: str) -> list[int | str]: ...

    def sampling(self, asked: Mapping[str, float | int | None]) -> SamplingConfig: ...

    def submit(self, request: ImageRequest) -> None: ...

    def cancel(self, request: ImageRequest) -> None: ...

    def to_uint8(self, tokens: torch.Tensor) -> np.ndarray: ...


@dataclass(eq=False)
class ImageRequest:
    """One request's images: condition ``labels`` (one per image) drawn under ``seed`` with
    ``sampling`` (:meth:`Engine.sampling`) as ``lantern generate`` draws them (image i from the
    stream (seed, i)). ``on_done`` is called (in the engine's thread) once the images, an error
    or a cancellation end it."""

    labels: list[int | str]
    seed: int
    sampling: SamplingConfig
    on_done: Callable[[], None] = lambda: None
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # its first image entered a slot
    taken: int = 0  # images handed to the loop
    results: dict[int, ImageResult] = field(default_factory=dict)
    error: str | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def n(self) -> int:
        return len(self.labels)

    @property
    def tokens(self) -> torch.Tensor:
        """The tokens [n, T] of a complete request."""
        return torch.stack([self.results[i].tokens for i in range(self.n)])

    def finish(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.on_done()


class Engine:
    """The decode loop of the generator ``load()`` returns, in a thread of its own, fed from a
    queue of at most ``max_queue_images`` images waiting for a slot. The thread loads (a model
    directory is exported into the cache on first use) and warms up first, then sets
    :attr:`ready`; a failure sets :attr:`failed` and calls ``on_failure``."""

    def __init__(
        self,
        load: Callable[[], Generator],
        max_queue_images: int,
        metrics: Metrics,
        on_failure: Callable[[str], None] = lambda message: None,
    ) -> None:
        self._load = load
        self.generator: Generator | None = None
        self.max_queue_images = max_queue_images
        self.metrics = metrics
        self.slots = 1
        self.ready = threading.Event()
        self.failed: str | None = None
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._waiting: deque[ImageRequest] = deque()  # requests with images not yet taken
        self._queued = 0  # their images not yet taken
        self._busy: dict[tuple[ImageRequest, int], float] = {}  # image -> when it took its slot
        self._closed = False
        self._image_seconds = 0.0  # running mean of an image's slot time, for Retry-After
        self._thread = threading.Thread(target=self._run, name="lantern-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def served(self) -> Served:
        gen = self._loaded
        return Served(gen.info.image_size, gen.info.gpt.takes_prompts, gen.method.method, gen.tree)

    def conditions(self, prompt: str) -> list[int | str]:
        """The condition ``prompt`` names: a class id (from its id or name) or the prompt;
        :class:`LanternError` for one the model does not take."""
        return self._loaded.conditions(prompt)

    def sampling(self, asked: Mapping[str, float | int | None]) -> SamplingConfig:
        """The sampling of a request that ``asked`` for these settings (by
        :data:`SAMPLING_FIELDS`; None or absent: the server's, from its flags);
        :class:`BadSetting` naming the first this engine cannot decode with: out of range, a top-k
        or top-p the runtime cannot filter at its vocabulary, or a CFG scale that needs the
        unconditional rows a server without guidance does not run. The settings are checked
        together once all are set (a request may turn one filter off as it turns another on);
        a combination is blamed on the first of its fields the request set."""
        gen = self._loaded
        given = {name: asked[name] for name in SAMPLING_FIELDS if asked.get(name) is not None}
        chosen = gen.sampling
        for name, value in given.items():
            try:
                chosen = dataclasses.replace(chosen, **{name: value})
            except LanternError as exc:
                raise BadSetting(first_line(exc), name) from None
        combined = (
            (lambda: check_filterable(chosen, gen.info.gpt.vocab_size), ("top_k", "top_p", "temperature")),
            (lambda: check_guidance(chosen, gen.pipeline.guided, "this server"), ("cfg_scale",)),
        )
        for check, fields in combined:  # the server's own settings pass both: a field given fails
            try:
                check()
            except LanternError as exc:
                raise BadSetting(first_line(exc), next(f for f in fields if f in given)) from None
        return chosen

    def to_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """Tokens [N, T] -> uint8 images [N, H, W, C] (the VQ decoder)."""
        return self._loaded.to_uint8(tokens)

    @property
    def _loaded(self) -> Generator:
        if self.generator is None:
            raise Closed(self.failed or "loading: exporting or warming up the model")
        return self.generator

    def submit(self, request: ImageRequest) -> None:
        """Queue ``request``'s images; :class:`TooManyImages` when they could never fit,
        :class:`QueueFull` (with a Retry-After) when they do not fit now, :class:`Closed` when
        the engine is stopping."""
        with self._cond:
            if self._closed or self.failed:
                raise Closed(self.failed or "the server is shutting down")
            if request.n > self.max_queue_images:
                raise TooManyImages(
                    f"n {request.n} is over the {self.max_queue_images} images the queue holds "
                    "(lantern serve --max-queue-images): ask for fewer"
                )
            if self._queued + request.n > self.max_queue_images:
                wait = self._queued * (self._image_seconds or 1.0) / self.slots
                raise QueueFull(
                    f"the queue holds {self._queued} images (at most {self.max_queue_images}): retry later",
                    max(1, math.ceil(wait)),
                )
            self._waiting.append(request)
            self._queued += request.n
            self.metrics.images_waiting.set(self._queued)
            self._cond.notify()

    def cancel(self, request: ImageRequest) -> None:
        """Drop ``request``: its waiting images leave the queue, the ones decoding free their
        slots after the running step."""
        with self._cond:
            if request.cancelled or request.done.is_set():
                return
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self._queued -= request.n - request.taken
                self.metrics.images_waiting.set(self._queued)
            self.metrics.images_cancelled.inc(request.n - len(request.results))
        request.finish()

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests, finish the queued ones, and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # the decode loop's JobSource

    def take(self, wait: bool) -> tuple[tuple[ImageRequest, int], Job] | object | None:
        with self._cond:
            while not self._waiting:
                if self._closed:
                    return None
                if not wait:
                    return IDLE
                self._cond.wait()
            request = self._waiting.popleft()
            index = request.taken
            request.taken += 1
            if request.taken < request.n:
                self._waiting.append(request)  # the waiting requests take turns
            self._queued -= 1
            now = time.monotonic()
            if request.started is None:
                request.started = now
                self.metrics.queue_seconds.observe(now - request.arrived)
            self._busy[request, index] = now
            self.metrics.images_waiting.set(self._queued)
            self.metrics.slots_busy.set(len(self._busy))
        job = self.generator.job(request.labels[index], request.seed, index)
        return (request, index), Job(*job, request.sampling)

    def keep(self, key: tuple[ImageRequest, int], tokens: int) -> bool:
        if not key[0].cancelled:
            return True
        self._free(key)
        return False

    def _free(self, key: tuple[ImageRequest, int]) -> float:
        with self._cond:
            started = self._busy.pop(key, None)
            self.metrics.slots_busy.set(len(self._busy))
        return 0.0 if started is None else time.monotonic() - started

    def _finished(self, key: tuple[ImageRequest, int], result: ImageResult) -> None:
        request, index = key
        seconds = self._free(key)
        self._image_seconds = (
            seconds if not self._image_seconds else 0.9 * self._image_seconds + 0.1 * seconds
        )
        m = self.metrics
        m.target_calls.inc(1 + len(result.accepted))
        m.accepted_tokens.inc(sum(result.accepted))
        if request.cancelled:  # counted as cancelled
            return
        m.images.inc()
        m.image_seconds.observe(seconds)
        request.results[index] = result
        if len(request.results) == request.n:
            request.finish()

    def _run(self) -> None:
        try:
            generator = self._load()
            generator("" if generator.info.gpt.takes_prompts else 0, n=1)  # warm-up: first calls, caches
        except Exception as exc:
            message = first_line(exc)
            self._fail(message)
            self._on_failure(message)
            return
        self.generator = generator
        self.slots = generator.batch_size * len(generator.pipeline.streams)
        self.metrics.slots.set(self.slots)
        self.ready.set()
        try:
            for key, result in generator.decode(self):
                self._finished(key, result)
        except Exception as exc:  # every request waiting gets the error, as JSON (never a traceback)
            self._fail(f"decoding failed: {first_line(exc)}")

    def _fail(self, message: str) -> None:
        with self._cond:
            self.failed = message
            requests = {*self._waiting, *(r for r, _ in self._busy)}
            self._waiting.clear()
            self._busy.clear()
            self._queued = 0
        for request in requests:
            request.error = message
            request.finish()
