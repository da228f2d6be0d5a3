"""Decode streams (runtime/streams.py): batches decoding at once in threads, sharing one job
queue; every image keeps the tokens one stream gives it."""

from __future__ import annotations

import threading

import pytest
import torch

from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.backends.torch_backend import TorchTarget
from lantern_rt.runtime.decode import decode_images
from lantern_rt.runtime.run_shape import AUTO_STREAMS_MAX, RunShape, available_cores
from lantern_rt.runtime.streams import Stream, auto_streams, decode_streams, stream_threads
from tests.test_batching import LABELS, SAMPLED, jobs, torch_spec

MORE_LABELS = LABELS + [4, 1, 3]  # 10 images, all classes, in no order a stream could guess


class Counted:
    """A target backend that counts its verify calls (which stream did work)."""

    def __init__(self, target: TorchTarget):
        self._target, self.calls = target, 0

    def __getattr__(self, name):
        return getattr(self._target, name)

    def verify(self, *args, **kwargs):
        self.calls += 1
        return self._target.verify(*args, **kwargs)


def streams_of(model, drafter, method: str, batch: int, count: int) -> list[Stream]:
    out = []
    for _ in range(count):
        target = Counted(TorchTarget(model, RunShape(batch, cache_windows=1)))
        out.append(Stream(target, torch_spec(model, drafter, batch) if method != "ar" else None))
    return out


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_streams_give_every_image_its_single_stream_tokens(trained_pair, method, batch):
    """Three streams of B images, sampled: each job comes back once, under its own index, with
    the tokens and accepted lengths decode_images gives it alone; every stream decoded."""
    model, drafter = trained_pair
    n = model.config.block_size
    (reference,) = streams_of(model, drafter, method, 1, 1)
    expected = dict(
        decode_images(reference.target, jobs(model, MORE_LABELS), n, SAMPLED, reference.speculation)
    )
    streams = streams_of(model, drafter, method, batch, 3)
    got = list(decode_streams(streams, jobs(model, MORE_LABELS), n, SAMPLED))
    assert sorted(i for i, _ in got) == list(range(len(MORE_LABELS)))
    for index, result in got:
        assert torch.equal(result.tokens, expected[index].tokens), index
        assert result.accepted == expected[index].accepted
    assert all(s.target.calls > 0 for s in streams)


def test_an_error_in_a_stream_reaches_the_caller_and_stops_the_others(trained_pair):
    model, drafter = trained_pair
    bad = jobs(model, [0, 1, 2, 3])
    bad[2] = (torch.tensor([model.config.num_classes + 5, 0]), bad[2][1])  # no such class
    before = threading.active_count()
    with pytest.raises(IndexError):
        list(decode_streams(streams_of(model, drafter, "ar", 1, 2), bad, model.config.block_size, SAMPLED))
    assert threading.active_count() == before


def test_a_caller_that_stops_early_leaves_no_thread_running(trained_pair):
    model, drafter = trained_pair
    before = threading.active_count()
    results = decode_streams(
        streams_of(model, drafter, "ar", 1, 2), jobs(model, MORE_LABELS), model.config.block_size, SAMPLED
    )
    next(results)
    results.close()
    assert threading.active_count() == before


def test_each_stream_gets_its_share_of_the_threads():
    assert [stream_threads(t, s) for t, s in [(0, 1), (2, 1), (2, 2), (5, 2), (0, 2), (1, 1)]] == [
        0,
        2,
        1,
        2,
        1,
        1,
    ]
    for threads, streams in [(2, 0), (1, 2), (2, 3)]:
        with pytest.raises(ConfigError):
            stream_threads(threads, streams)


def test_auto_streams_run_one_per_thread_within_the_batches_and_the_ceiling():
    """``--streams auto``: (threads, batches, cores) -> (streams, threads); the threads handed
    on always give each stream at least one (stream_threads accepts them)."""
    cases = {
        (0, 10, 2): (2, 2),  # the library's threads: every core, one stream each
        (0, 1, 2): (1, 0),  # one batch: one stream on the library's threads, as before
        (1, 10, 2): (1, 1),  # one thread: one stream
        (2, 3, 8): (2, 2),  # the threads asked for, not the cores
        (0, 3, 16): (3, 16),  # no more streams than batches; the cores shared out
        (0, 100, 16): (AUTO_STREAMS_MAX, 16),  # the ceiling
        (6, 100, 2): (AUTO_STREAMS_MAX, 6),
    }
    for (threads, batches, cores), want in cases.items():
        got = auto_streams(threads, batches, cores)
        assert got == want, (threads, batches, cores, got)
        assert stream_threads(got[1], got[0]) >= (1 if got[0] > 1 else 0)
    assert auto_streams(0, 10)[0] == min(available_cores(), AUTO_STREAMS_MAX)
