"""The one decode loop: prefill, then (draft, verify and accept the tree, compact) until done.

Plain autoregressive decoding is the same loop without a drafter: the tree holds only the
root, each target call scores one token and the "bonus" token is an ordinary sample.
The steps are described in docs/method.md (§4 drafting, §5 acceptance, §6 KV compaction).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern_rt.bundle import window_needed
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.acceptance import Relaxation, RelaxInputs, draw, relax_inputs, target_probabilities
from lantern_rt.runtime.backends.base import Draft, Drafter, FilterInputs, Pending, TargetBackend
from lantern_rt.runtime.backends.compiled import Compiled
from lantern_rt.runtime.backends.cuda_graphs import CudaGraphed
from lantern_rt.runtime.profiling import span
from lantern_rt.runtime.sampling import SamplingConfig, SamplingRows, cfg_rows, check_filterable, draw_noise
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree


@dataclass(frozen=True)
class Speculation:
    """What speculative decoding adds to plain decoding: a drafter (a drafter backend, or the
    Jacobi window that drafts from the target's own distributions, docs/method.md §11)."""

    drafter: Drafter
    tree: StaticTree
    relax: Relaxation
    neighbors: Tensor | None = None  # [V, k_max] latent neighbours, needed when relaxed


@dataclass
class ImageResult:
    """The tokens of one image and the tokens committed by each verify call (bonus included)."""

    tokens: Tensor
    accepted: list[int]


EXACT = Relaxation("exact")


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of B images as a function of device tensors alone: draft (speculative
    methods), verify and accept, commit both caches (docs/method.md §4-7). It reads nothing
    back to the host, so a CUDA graph can capture it whole
    (:class:`~lantern_rt.runtime.backends.cuda_graphs.CudaGraphed`).

    Called with each image's pending pairs (tokens [B, R] left-aligned, the target's hidden
    states before them [2B, R, D], their count m [B]), which images are ``active`` [B] (an
    inactive one, a slot with no image, commits nothing), the drafter's noise [B, noise_rows,
    V] and the verify noise [B, N+1] and bonus noise [B, V]; returns the count of tokens
    committed [B] (the accepted ones and the bonus), the committed tokens [B, R] and their hidden
    states [2B, R, D]: the next step's pending pairs."""

    target: TargetBackend
    speculation: Speculation | None
    tree: StaticTree
    filters: FilterInputs
    relax: RelaxInputs
    ar_valid: Tensor  # [B, 1] True: AR's root-only "draft"
    ar_q: Tensor  # [B, 1, V] zeros, never read

    def __call__(
        self,
        pending: Tensor,
        hidden: Tensor,
        m: Tensor,
        active: Tensor,
        draft_noise: Tensor,
        noise: Tensor,
        bonus_noise: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        target, spec = self.target, self.speculation
        if spec is None:
            drafted = Draft(pending[:, :1], self.ar_valid, self.ar_q)  # AR's one pending token (m = 1)
        else:  # propose, verify and accept, record
            with span("draft"):
                rows = Pending(pending, hidden, m, target.cache.length, active)
                drafted = spec.drafter.propose(self.tree, rows, draft_noise, self.filters, self.relax.greedy)
        with span("verify"):
            out = target.verify(self.tree, drafted, noise, bonus_noise, self.filters, self.relax)
        if spec is not None:
            with span("draft"):
                spec.drafter.record(out, active)
        with span("kv_compaction"):
            committed = out.length + 1  # the accepted tokens and the bonus
            target.cache.commit(out.new_k, out.new_v, out.kept, committed * active, self.tree.is_chain)
        return committed, out.tokens, out.hidden


@dataclass
class StepCache:
    """Whole decode steps kept across images and calls (by backends, settings and cache window):
    compiled with ``torch.compile`` (``compile``: :class:`~lantern_rt.runtime.backends.compiled.Compiled`)
    and/or replayed from captured CUDA graphs (``cuda_graphs``, on a CUDA device); a compiled
    step is compiled, then captured."""

    cuda_graphs: bool = False
    compile: bool = False
    steps: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)  # the sampling rows its steps read, by batch and device

    def sampling_rows(self, images: int, device: torch.device) -> SamplingRows:
        """The :class:`SamplingRows` of ``images`` on ``device`` that every step kept here reads
        (a decode writes its images' settings into them)."""
        return self.rows.setdefault((images, device), SamplingRows(images, device))

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling steps so far (0 without ``compile``)."""
        return sum(c.seconds for c in self.compiled)

    @property
    def compiled(self) -> list[Compiled]:
        """The compiled steps held."""
        found = [s.fn if isinstance(s, CudaGraphed) else s for s in self.steps.values()]
        return [s for s in found if isinstance(s, Compiled)]


class Condition(NamedTuple):
    """One image's condition: its two CFG rows (conditional, unconditional: class ids [2],
    caption features [2, T, C] or prompt token ids [2, T]; a target without guidance runs the
    first alone, docs/method.md §13) and which of the T prefix slots its
    tokens see (``prefix`` bool [T], the same for both rows, or [2, T], one per row: a caption's
    or a left-padded prompt's padding is hidden, docs/method.md §9; None: all)."""

    rows: Tensor
    prefix: Tensor | None = None


class Job(NamedTuple):
    """One image to decode: its condition (or just its two condition rows), its random stream
    and how it samples (None: as the decode's ``sampling`` says). A plain (condition, generator)
    pair is a job too."""

    cond: Condition | Tensor
    generator: torch.Generator | None
    sampling: SamplingConfig | None = None


IDLE = object()  # JobSource.take: no job waiting now, more may come


@runtime_checkable
class JobSource(Protocol):
    """Where :func:`decode_images` takes jobs while it runs (continuous batching): it polls
    :meth:`take` whenever a slot is free, and waits in it only when every slot is idle."""

    def take(self, wait: bool) -> tuple[Hashable, Job] | object | None:
        """The next job with its key, :data:`IDLE` when none is waiting (only when not ``wait``),
        or None when no more will come."""

    def keep(self, key: Hashable, tokens: int) -> bool:
        """Called after each step for each image decoding, with its tokens so far (the last call
        has them all); False frees an unfinished image's slot at once (the image is dropped)."""


class Jobs:
    """The :class:`JobSource` of an iterable of jobs, keyed by their index; ``watch(index,
    tokens)`` (:meth:`JobSource.keep`) returning False stops the run: no further job is
    taken and every image still decoding is dropped. Safe to share between streams."""

    def __init__(self, jobs: Iterable[Job], watch: Callable[[int, int], bool] | None = None) -> None:
        self._jobs = enumerate(jobs)
        self._watch = watch
        self._lock = threading.Lock()
        self.stopped = False

    def take(self, wait: bool) -> tuple[int, Job] | None:
        with self._lock:
            return None if self.stopped else next(self._jobs, None)

    def keep(self, key: Hashable, tokens: int) -> bool:
        if self._watch is not None and not self.stopped and not self._watch(key, tokens):
            self.stopped = True
        return not self.stopped


@dataclass
class _Slot:
    """An image being decoded in one of the batch's B slots."""

    index: int
    cond: Condition
    generator: torch.Generator | None
    sampling: SamplingConfig
    tokens: list[int]
    accepted: list[int]


def decode_image(
    target: TargetBackend,
    cond: Tensor,
    num_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    speculation: Speculation | None = None,
    step_graphs: StepCache | None = None,
) -> ImageResult:
    """One image: :func:`decode_images` of the single job (``cond``, ``generator``)."""
    ((_, result),) = decode_images(
        target, [(cond, generator)], num_tokens, sampling, speculation, step_graphs
    )
    return result


def decode_images(
    target: TargetBackend,
    jobs: Iterable[Job] | JobSource,
    num_tokens: int,
    sampling: SamplingConfig,
    speculation: Speculation | None = None,
    step_graphs: StepCache | None = None,
) -> Iterator[tuple[int, ImageResult]]:
    """Generate ``num_tokens`` image tokens for each job, B at a time (the target's batch:
    ``target.cache.images``), yielding (job index, result) as each image finishes. Each image
    samples as its job says (:attr:`Job.sampling`), else as ``sampling`` says: its settings are
    its slot's in every step's filters, noise and acceptance (:class:`SamplingRows`).

    Every image holds one of the B slots of each call from its prefill to its last token: each
    step (:class:`DecodeStep`) drafts, verifies and accepts the trees of all of them and commits
    on the device, from uniform noise drawn from each image's own generator in the order a
    batch of one draws it, so an image's tokens do not depend on its batch or slot. The host
    then reads one small tensor, the accepted lengths and tokens. Each step reads the smallest
    cache window that holds the batch's longest image (docs/method.md §12). A finished image's
    slot takes the next job at once (its prefill runs with the other slots' rows untouched);
    slots with no job left are inactive until the batch drains (docs/method.md §7). ``jobs`` may
    be a :class:`JobSource` instead, polled for jobs that arrive while the batch runs: a new job
    joins at the next step, the loop waits only when every slot is idle, it yields each result
    under the job's key, and an image the source no longer keeps frees its slot before the next
    step. With ``step_graphs``
    (a :class:`StepCache` the caller keeps across calls) each step is compiled and/or replayed
    from one captured CUDA graph, as it says.
    """
    tree = speculation.tree if speculation else ROOT_ONLY
    cache = target.cache
    batch = cache.images
    source = jobs if isinstance(jobs, JobSource) else Jobs(jobs)
    slots: list[_Slot | None] = [None] * batch
    exhausted = False
    state: _State | None = None
    steps: dict[int, DecodeStep | Compiled | CudaGraphed] = {}  # by cache window
    while True:
        fresh = []
        for b in range(batch):
            if slots[b] is None and not exhausted:
                job = source.take(wait=not fresh and all(slot is None for slot in slots))
                if job is IDLE:
                    break
                if job is None:
                    exhausted = True
                else:
                    index, (cond, generator, chosen) = job[0], Job(*job[1])
                    cond = cond if isinstance(cond, Condition) else Condition(cond)
                    slots[b] = _Slot(index, cond, generator, chosen or sampling, [], [])
                    fresh.append(b)
        longest = max((len(slot.tokens) for slot in slots if slot is not None), default=0)
        cache.fit(window_needed(target.cls_token_num, longest, tree.max_depth))
        if fresh:
            state = _prefill(target, speculation, slots, fresh, tree, state, step_graphs)
        finished = [b for b, slot in enumerate(slots) if slot is not None and len(slot.tokens) >= num_tokens]
        for b in finished:
            slot = slots[b]
            yield (
                slot.index,
                ImageResult(torch.tensor(slot.tokens[:num_tokens], dtype=torch.long), slot.accepted),
            )
            slots[b] = None
        if finished and not exhausted:
            continue  # the freed slots take the next jobs before the next step
        if all(slot is None for slot in slots):
            return
        draft_noise, noise, bonus_noise = _step_noise(slots, tree, _draft_rows(speculation), state)
        step = steps.get(cache.window) or steps.setdefault(
            cache.window, _step(target, speculation, tree, state, step_graphs)
        )
        m, pending, hidden = step(
            state.pending, state.hidden, state.m, state.active(slots), draft_noise, noise, bonus_noise
        )
        state.pending, state.hidden, state.m = pending, hidden, m
        read = torch.cat([m[:, None], pending], 1).tolist()  # the step's one read
        for b, (n, *committed) in enumerate(read):
            slot = slots[b]
            if slot is not None:
                emitted = committed[: min(n, num_tokens - len(slot.tokens))]
                slot.tokens.extend(emitted)
                slot.accepted.append(len(emitted))
                if not source.keep(slot.index, len(slot.tokens)) and len(slot.tokens) < num_tokens:
                    slots[b] = None


@dataclass
class _State:
    """The batch's device state between steps: each image's pending pairs (see
    :class:`DecodeStep`), and the settings as tensors (``relax``'s greedy flags are the
    ``sampling`` rows')."""

    pending: Tensor  # [B, R]
    hidden: Tensor  # [2B, R, D]
    m: Tensor  # [B]
    sampling: SamplingRows
    relax: RelaxInputs
    vocab: int
    device: torch.device
    _active: tuple[tuple[bool, ...], Tensor] | None = None

    @property
    def filters(self) -> FilterInputs:
        return self.sampling.filters

    def active(self, slots: list[_Slot | None]) -> Tensor:
        """[B] bool on the device: which slots hold an image (copied when that changes)."""
        flags = tuple(slot is not None for slot in slots)
        if self._active is None or self._active[0] != flags:
            self._active = (flags, torch.tensor(flags, device=self.device))
        return self._active[1]


def _prefill(
    target: TargetBackend,
    speculation: Speculation | None,
    slots: list[_Slot | None],
    fresh: list[int],
    tree: StaticTree,
    state: _State | None,
    step_graphs: StepCache | None,
) -> _State:
    """Prefill the ``fresh`` slots' images (the other slots' caches are kept), write their
    sampling settings into the state's rows, draw each one's first token from its generator and
    make it its pending pair; -> the updated state (its sampling rows ``step_graphs``' when
    given, where its kept steps read them)."""
    some = next(slot for slot in slots if slot is not None)
    conds = [(slot or some).cond for slot in slots]
    batch, rows = len(slots), target.cache.rows
    kinds = range(rows // batch)  # the conditional rows, then (guided) the unconditional ones
    cond = torch.cat([torch.stack([c.rows[i] for c in conds]) for i in kinds])
    flags = [b in fresh for b in range(batch)]
    device = target.cache.length.device
    is_fresh = torch.tensor(flags, device=device)
    everything = torch.ones(2, target.cls_token_num, dtype=torch.bool)
    visible = [everything if c.prefix is None else c.prefix.cpu().expand(2, -1) for c in conds]
    prefix = torch.cat([torch.stack([v[i] for v in visible]) for i in kinds])
    prefix, cond = prefix.to(device), cond.to(device)
    with span("prefill"):
        logits, hidden = target.prefill(cond, prefix, is_fresh)
        if speculation:
            speculation.drafter.prefill(hidden[:, :-1], is_fresh, cond, prefix)
    hidden = hidden[:, -1]
    vocab = logits.shape[-1]
    for b in fresh:
        check_filterable(slots[b].sampling, vocab)
    if state is None:
        sampling = (
            SamplingRows(batch, device) if step_graphs is None else step_graphs.sampling_rows(batch, device)
        )
        relax = relax_inputs(
            speculation.relax if speculation else EXACT,
            speculation.neighbors if speculation else None,
            vocab,
            False,
            device,
        )
        pending = tree.max_depth + 1
        state = _State(
            torch.zeros(batch, pending, dtype=torch.long, device=device),
            hidden.new_zeros(rows, pending, hidden.shape[-1]),
            torch.ones(batch, dtype=torch.long, device=device),
            sampling,
            relax._replace(greedy=sampling.greedy),
            vocab,
            device,
        )
    state.sampling.write(fresh, [slots[b].sampling for b in fresh])
    uniform = torch.stack(
        [
            _uniform(vocab, slot.sampling.greedy, slot.generator, device) if flag else _zeros(vocab, device)
            for slot, flag in zip(slots, flags, strict=True)
        ]
    )
    first = draw(target_probabilities(logits, state.filters, batch), uniform, state.relax.greedy)
    pending = state.pending.shape[1]
    state.pending = torch.where(is_fresh[:, None], F.pad(first[:, None], (0, pending - 1)), state.pending)
    state.hidden = torch.where(
        cfg_rows(is_fresh, rows)[:, None, None], F.pad(hidden[:, None], (0, 0, 0, pending - 1)), state.hidden
    )
    state.m = torch.where(is_fresh, 1, state.m)
    for b, token in zip(fresh, first[fresh].tolist(), strict=True):
        slots[b].tokens.append(token)
    return state


def _draft_rows(spec: Speculation | None) -> int:
    """Rows of V uniforms a step's drafting takes (:meth:`Drafter.noise_rows`); 0 without
    speculation."""
    return spec.drafter.noise_rows(spec.tree) if spec else 0


def _step_noise(
    slots: list[_Slot | None], tree: StaticTree, rows: int, state: _State
) -> tuple[Tensor, Tensor, Tensor]:
    """A step's uniform noise: the drafter's [B, ``rows``, V] (drafting methods: ``rows`` > 0),
    the tests' [B, N+1] and the bonus draws' [B, V], each sampled image's drawn from its own
    generator in the order one image alone draws them; a greedy image's are constants, no draw
    (:func:`draw_noise`, :func:`_uniform`); an empty slot's zeros."""
    vocab, device, batch = state.vocab, state.device, len(slots)
    noises = tree.num_nodes + 1
    drafting = rows > 0
    rows = rows or 1
    if all(slot is None or slot.sampling.greedy for slot in slots):  # nothing drawn: the constants whole
        draft_noise = draw_noise(batch * rows, vocab, True, None, device).view(batch, rows, vocab)
        uniform = _zeros(batch * (noises + vocab), device).view(batch, -1)
        return draft_noise, uniform[:, :noises], uniform[:, noises:]
    drafts, uniforms = [], []  # per slot, the drafter's draw first (one image's order)
    for slot in slots:
        if drafting:
            drafts.append(
                _zeros(rows * vocab, device).view(rows, vocab)
                if slot is None
                else draw_noise(rows, vocab, slot.sampling.greedy, slot.generator, device)
            )
        uniforms.append(
            _zeros(noises + vocab, device)
            if slot is None
            else _uniform(noises + vocab, slot.sampling.greedy, slot.generator, device)
        )
    uniform = torch.stack(uniforms)
    # AR's drafter noise is never read: one zero tensor, no draw
    draft_noise = torch.stack(drafts) if drafting else _zeros(batch * vocab, device).view(batch, 1, vocab)
    return draft_noise, uniform[:, :noises], uniform[:, noises:]


def _step(
    target: TargetBackend,
    speculation: Speculation | None,
    tree: StaticTree,
    state: _State,
    cache: StepCache | None,
) -> DecodeStep | Compiled | CudaGraphed:
    """The step of these backends and settings, compiled and/or captured once in ``cache``
    when given."""
    filters, relax, device = state.filters, state.relax, state.device
    key = (id(target), id(speculation), tree.paths, target.cache.window, *map(id, filters), *map(id, relax))
    if cache is not None and key in cache.steps:
        return cache.steps[key]
    batch = target.cache.images
    step = DecodeStep(
        target,
        speculation,
        tree,
        filters,
        relax,
        torch.ones(batch, 1, dtype=torch.bool, device=device),
        torch.zeros(batch, 1, state.vocab, device=device),
    )
    if cache is None or not (cache.compile or cache.cuda_graphs):
        return step
    if cache.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA device; the model is on {device}")
    state_tensors = (target.cache.length, *(speculation.drafter.state if speculation else ()))
    run = Compiled(step, state_tensors) if cache.compile else step
    cache.steps[key] = CudaGraphed(run, state_tensors) if cache.cuda_graphs else run
    return cache.steps[key]


def _uniform(count: int, greedy: bool, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """``count`` uniform values from ``generator`` for a step's tests and draws; for a ``greedy``
    image zeros, which nothing reads (greedy decisions are argmaxes) and which cost no draw."""
    if greedy:
        return _zeros(count, device)
    return torch.rand(count, generator=generator, device=device)


@lru_cache(maxsize=16)
def _zeros(count: int, device: torch.device) -> Tensor:
    return torch.zeros(count, device=device)
