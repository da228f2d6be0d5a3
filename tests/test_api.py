"""The Python API (``lantern_rt.load``) and the decode loop's job sources (continuous batching).

The API's images are checked against the decode loop run image by image (each alone in the
batch, from its own random stream), which shares nothing with the API's conditions, counts and
seeds but the pipeline; the job-source tests check the loop against its own iterable path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lantern_rt
from lantern_rt.generate import image_generator
from lantern_rt.models.config import ConfigError
from lantern_rt.runtime.decode import IDLE, decode_images

# exports the demo for batch size 2 with the tree chain-2 into the run's export cache (about 45 s),
# once for tests/test_serve.py too (a drafting graph's export costs about 2 s a level)
pytestmark = pytest.mark.slow
TREE = "chain-2"


@pytest.fixture(scope="module")
def generator() -> lantern_rt.api.Generator:
    return lantern_rt.load(batch_size=2, streams=1, threads=1, tree=TREE, cache_windows=1)


def alone(generator, label: int, seed: int, index: int) -> torch.Tensor:
    """Image ``index`` of a run under ``seed``, decoded alone in the batch."""
    pipe = generator.pipeline
    job = (pipe.condition(label), image_generator(seed, index, pipe.device))
    ((_, result),) = decode_images(
        pipe.target, [job], generator.tokens_per_image, generator.sampling, pipe.speculation
    )
    return result.tokens


def test_a_call_makes_each_condition_n_times_from_the_seed(generator) -> None:
    out = generator([0, "Trouser"], n=2, seed=5)
    assert out.labels == [0, 0, 1, 1] and not out.stopped
    assert len(out.images) == 4 and out.images[0].size == (out.array.shape[2], out.array.shape[1])
    for i, label in enumerate(out.labels):
        assert torch.equal(out.tokens[i], alone(generator, label, 5, i)), i
    assert out.stats.num_images == 4 and out.stats.mean_accepted_length > 1
    assert np.array_equal(np.asarray(out.images[0]), out.array[0][..., 0])  # greyscale PIL images


def test_callback_sees_each_step_and_can_stop(generator) -> None:
    events = []
    full = generator(3, n=4, seed=9, callback=events.append)
    per_image = {}
    for e in events:
        assert e.images == 4 and e.total == generator.tokens_per_image
        assert e.tokens > per_image.get(e.image, 0)  # one event per step, tokens growing
        per_image[e.image] = e.tokens
    assert per_image == {i: generator.tokens_per_image for i in range(4)}

    def stop_at_first_image(event) -> bool:
        return not event.done

    out = generator(3, n=4, seed=9, callback=stop_at_first_image)
    assert out.stopped and 1 <= len(out.images) < 4
    rows = [t.tolist() for t in full.tokens]
    assert all(t.tolist() in rows for t in out.tokens)

    def stop_now(event):
        raise lantern_rt.api.Stop

    out = generator(3, n=2, seed=9, callback=stop_now)
    assert out.stopped and out.images == [] and out.tokens.shape[0] == 0


def test_bad_conditions_and_settings_raise(generator) -> None:
    with pytest.raises(ConfigError, match="out of range"):
        generator(99)
    with pytest.raises(ConfigError, match="unknown backend"):
        lantern_rt.load(backend="nope")


class Arrivals:
    """A job source whose jobs arrive while the loop runs: job k becomes available after
    ``due[k]`` steps (counted in :meth:`keep` calls of the first image) and ``drop`` is cancelled
    after ``drop_after`` of its tokens."""

    def __init__(self, jobs: list, due: list[int], drop: int | None = None, drop_after: int = 0) -> None:
        self.jobs, self.due, self.drop, self.drop_after = jobs, due, drop, drop_after
        self.steps = 0
        self.next = 0
        self.waits = 0
        self.taken_at: dict[int, int] = {}

    def take(self, wait: bool):
        if self.next == len(self.jobs):
            return None
        if self.due[self.next] > self.steps:
            if not wait:
                return IDLE
            self.waits += 1
            self.steps = self.due[self.next]  # waiting lets time pass
        k = self.next
        self.next += 1
        self.taken_at[k] = self.steps
        return k, self.jobs[k]

    def keep(self, key, tokens: int) -> bool:
        if key == 0:
            self.steps += 1
        return not (key == self.drop and tokens >= self.drop_after)


def test_a_job_source_joins_the_running_batch_and_cancels(generator) -> None:
    pipe = generator.pipeline
    jobs = [(pipe.condition(c), image_generator(1, i, pipe.device)) for i, c in enumerate([0, 2, 4, 6])]
    reference = dict(
        decode_images(pipe.target, jobs, generator.tokens_per_image, generator.sampling, pipe.speculation)
    )
    fresh = [(pipe.condition(c), image_generator(1, i, pipe.device)) for i, c in enumerate([0, 2, 4, 6])]
    source = Arrivals(fresh, due=[0, 3, 5, 500], drop=2, drop_after=20)
    got = dict(
        decode_images(pipe.target, source, generator.tokens_per_image, generator.sampling, pipe.speculation)
    )
    assert source.taken_at[1] == 3  # joined at the step it arrived, beside image 0
    assert source.taken_at[2] > 3  # the batch was full: image 2 waited for a slot
    assert source.waits == 1  # waited once, when every slot was idle (job 3, due late)
    assert sorted(got) == [0, 1, 3]  # image 2 was cancelled
    for k in got:
        assert torch.equal(got[k].tokens, reference[k].tokens), k
