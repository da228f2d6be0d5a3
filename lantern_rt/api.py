"""The Python API: ``lantern_rt.load(...)`` opens a model or a bundle once and returns a
:class:`Generator`, called with classes or prompts (README, "Python API").

A generator holds a run's plan (:func:`lantern_rt.settings.resolve`) and its pipeline
(:func:`lantern_rt.pipeline.build_pipeline`), run through :mod:`lantern_rt.generate`, so a call
gives the images ``lantern generate`` gives with the same conditions, ``-n``, seed and options
(the command runs a generator itself); ``lantern serve`` feeds the same pipeline from a
:class:`~lantern_rt.runtime.decode.JobSource`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from lantern_rt.bundle import MANIFEST, Bundle
from lantern_rt.generate import generate, image_job
from lantern_rt.images import pil_image, to_uint8
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.pipeline import build_pipeline, open_source
from lantern_rt.run_options import RunOptions, option_types
from lantern_rt.runtime.decode import ImageResult, Job, JobSource
from lantern_rt.runtime.method import MethodConfig
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.streams import decode_streams
from lantern_rt.settings import RunPlan, requested_conditions, resolve
from lantern_rt.stats import GenerationStats


class Stop(Exception):
    """Raised by a callback to stop the run, as returning False does."""


@dataclass(frozen=True)
class Progress:
    """A callback's event, after each decode step for each image decoding: image ``image`` of
    the call's ``images`` has ``tokens`` of its ``total``; the last event of an image has them
    all (:attr:`done`)."""

    image: int
    images: int
    tokens: int
    total: int

    @property
    def done(self) -> bool:
        return self.tokens >= self.total


@dataclass
class Output:
    """What a call made: ``images`` (PIL) and ``array`` (uint8 [N, H, W, C]) in the order of its
    ``labels`` (each condition ``n`` times), the ``tokens`` [N, T], the run's ``stats`` and
    whether a callback ``stopped`` it (then only the images finished before that)."""

    images: list[Image.Image]
    array: np.ndarray
    tokens: torch.Tensor
    labels: list[int | str]
    stats: GenerationStats
    stopped: bool = False


class Generator:
    """A run's plan and its pipeline (built here: a model directory on a backend of bundles is
    exported into the cache first): call it to make images (:meth:`__call__`); :meth:`job`,
    :meth:`decode` and :meth:`to_uint8` are what a server feeding the decode loop itself needs."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        if plan.threads:
            torch.set_num_threads(plan.threads)
        self.pipeline = build_pipeline(plan)

    @property
    def info(self) -> ModelDir:
        return self.plan.info

    @property
    def sampling(self) -> SamplingConfig:
        return self.plan.sampling

    @property
    def method(self) -> MethodConfig:
        return self.pipeline.method

    @property
    def tree(self) -> str | None:
        """The draft tree's (or Jacobi window's) name; None for AR."""
        return None if self.pipeline.speculation is None else self.method.tree

    @property
    def batch_size(self) -> int:
        return self.pipeline.batch_size

    @property
    def tokens_per_image(self) -> int:
        return self.info.gpt.block_size

    def conditions(self, classes_or_prompts: int | str | Sequence[int | str] | None) -> list[int | str]:
        """Class ids (from ids or names; None: every class) for a class-conditional model, or
        prompts for a text-conditional one; :class:`~lantern_rt.models.config.ConfigError`
        for what the model does not take."""
        given = [classes_or_prompts] if isinstance(classes_or_prompts, int | str) else classes_or_prompts
        given = [str(x) for x in given or ()]
        if self.info.gpt.takes_prompts:
            return requested_conditions(self.info, [], given)
        return requested_conditions(self.info, given, [])

    def __call__(
        self,
        classes_or_prompts: int | str | Sequence[int | str] | None = None,
        n: int = 1,
        seed: int = 0,
        callback: Callable[[Progress], bool | None] | None = None,
        progress: bool = False,
        profile: bool = False,
    ) -> Output:
        """``n`` images of each condition, image ``i`` of the call drawing from the random stream
        ``(seed, i)`` (as ``lantern generate`` does). ``callback(event)`` (a :class:`Progress`)
        returning False or raising :class:`Stop` stops the run."""
        labels = [c for c in self.conditions(classes_or_prompts) for _ in range(n)]
        stopped = False

        def watch(image: int, tokens: int) -> bool:
            nonlocal stopped
            try:
                stopped = callback(Progress(image, len(labels), tokens, self.tokens_per_image)) is False
            except Stop:
                stopped = True
            return not stopped

        run = generate(
            self.pipeline,
            labels,
            self.sampling,
            seed=seed,
            progress=progress,
            profile=profile,
            watch=None if callback is None else watch,
        )
        images = [pil_image(a) for a in run.images]
        return Output(images, run.images, run.tokens, run.labels, run.stats, stopped)

    def job(self, label: int | str, seed: int, index: int) -> Job:
        """Image ``index`` of a run under ``seed`` of condition ``label``, for :meth:`decode`."""
        return image_job(self.pipeline, label, seed, index)

    def decode(self, source: JobSource) -> Iterator[tuple[Hashable, ImageResult]]:
        """The decode loop over ``source`` (continuous batching), on every stream."""
        return decode_streams(self.pipeline.streams, source, self.tokens_per_image, self.sampling)

    def to_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """Tokens [N, T] -> uint8 images [N, H, W, C] (the VQ decoder)."""
        with torch.inference_mode():
            return to_uint8(self.pipeline.decode_codes(tokens))


def load(
    model_or_bundle: str | Path | ModelDir | Bundle | None = None,
    *,
    images: int | None = None,
    **options: Any,
) -> Generator:
    """A :class:`Generator` for a model directory or a bundle (a folder with a manifest.json;
    None: the built-in demo), with the run ``options`` of ``lantern generate`` as keywords
    (:class:`~lantern_rt.run_options.RunOptions`: each one's type, default and help), resolved
    into a plan (:func:`~lantern_rt.settings.resolve`: what is None gets its default). A model
    directory on onnxruntime or tensorrt is exported into the cache on first use. ``streams``
    None chooses for a run of ``images`` images; ``threads`` sets torch's threads too. Bad
    options raise :class:`~lantern_rt.errors.LanternError` subclasses naming them."""
    if isinstance(model_or_bundle, ModelDir | Bundle):
        source = model_or_bundle
    elif model_or_bundle is not None and (Path(model_or_bundle) / MANIFEST).is_file():
        _, source = open_source(None, Path(model_or_bundle))
    else:
        _, source = open_source(None if model_or_bundle is None else Path(model_or_bundle), None)
    plan = resolve(source, RunOptions(**_known(options)), images)
    return Generator(plan)


def _known(options: dict[str, Any]) -> dict[str, Any]:
    """``options``, each a run option; :class:`ConfigError` naming the first that is not."""
    unknown = [name for name in options if name not in option_types()]
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; the options are {', '.join(option_types())}")
    return options


# the keywords of load as help() and editors show them: every run option, with its default
load.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        *list(inspect.signature(load).parameters.values())[:2],
        *(
            inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in dataclasses.fields(RunOptions)
        ),
    ],
    return_annotation=Generator,
)
