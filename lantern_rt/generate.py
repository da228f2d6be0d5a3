"""The run loop: a pipeline's images for a list of conditions, each from its own random stream
(pipelines are built by :func:`lantern_rt.pipeline.build_pipeline`)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from lantern_rt.assembly import Pipeline
from lantern_rt.images import to_uint8
from lantern_rt.runtime import profiling
from lantern_rt.runtime.decode import ImageResult, Job, Jobs
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.streams import decode_streams
from lantern_rt.runtime.tree import tree_to_json
from lantern_rt.settings import check_guidance, default_sampling
from lantern_rt.stats import GenerationStats


def image_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The random stream of image ``index`` under ``seed`` (independent of batch composition)."""
    state = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
    return torch.Generator(device=device).manual_seed(state)


def image_job(pipe: Pipeline, label: int | str, seed: int, index: int) -> Job:
    """Image ``index`` of a run under ``seed``: ``label``'s condition and the image's random
    stream (:func:`image_generator`), what the decode loop takes."""
    return pipe.condition(label), image_generator(seed, index, pipe.device)


@dataclass
class Generation:
    labels: list[int | str]  # class ids, or prompts for a text-conditional model
    tokens: torch.Tensor  # [N, T] int64
    images: np.ndarray  # [N, H, W, C] uint8
    stats: GenerationStats


def generate(
    pipe: Pipeline,
    labels: Iterable[int | str],
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    progress: bool = True,
    start_index: int = 0,
    profile: bool = False,
    watch: Callable[[int, int], bool] | None = None,
) -> Generation:
    """Generate one image per entry of ``labels`` (class ids, or prompts for a text-conditional
    model); timings and acceptance stats in ``stats``. ``sampling`` None samples as the model's
    ``sampling_defaults`` say (:func:`~lantern_rt.settings.default_sampling`).

    Image ``i`` draws from the random stream ``(seed, start_index + i)``, so a run split into
    pieces gives the same images as one run. ``profile`` records NVTX ranges (see
    :mod:`lantern_rt.runtime.profiling`) and brackets every image after the first (the warm-up)
    and the VQ decode with cudaProfilerStart/Stop. ``watch(i, tokens)`` is called after each
    decode step for each image decoding (the tokens it has so far; all of them at its last):
    False stops the run, which returns the images finished before it
    (:class:`~lantern_rt.runtime.decode.Jobs`).
    """
    t_start = time.perf_counter()
    sampling = default_sampling(pipe.info) if sampling is None else sampling
    check_guidance(sampling, pipe.guided, "this pipeline")
    labels = list(labels)
    md, method, speculation = pipe.info, pipe.method, pipe.speculation
    n_tokens = md.gpt.block_size
    jobs = (image_job(pipe, label, seed, start_index + i) for i, label in enumerate(labels))
    if watch is not None:
        jobs = Jobs(jobs, watch)
    results: dict[int, ImageResult] = {}
    per_image = []
    compiled_before = pipe.step_graphs.compile_seconds if pipe.step_graphs else 0.0
    desc = f"{method.method}/{pipe.backend}"
    steady = contextlib.ExitStack()
    with (
        profiling.recording(profile),
        steady,
        tqdm(total=len(labels), desc=desc, unit="img", disable=not progress) as bar,
    ):
        t0 = time.perf_counter()
        with profiling.span("decode"):
            for index, result in decode_streams(pipe.streams, jobs, n_tokens, sampling):
                if not results:
                    steady.enter_context(profiling.capture(profile))
                results[index] = result
                per_image.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                bar.update()
        done = sorted(results)  # every image, unless watch stopped the run
        labels = [labels[i] for i in done]
        ordered = [results[i] for i in done]
        accepted = [a for r in ordered for a in r.accepted]
        tokens = (
            torch.stack([r.tokens for r in ordered])
            if ordered
            else torch.zeros(0, n_tokens, dtype=torch.long)
        )
        t_vq = time.perf_counter()
        with profiling.span("vq_decode"):
            images = (
                to_uint8(
                    torch.cat([pipe.decode_codes(tokens[i : i + 64]) for i in range(0, len(tokens), 64)])
                )
                if len(tokens)
                else np.zeros((0, md.image_size, md.image_size, md.vq.out_channels), np.uint8)
            )
    stats = GenerationStats(
        model=md.name,
        method=method.method,
        params=method.params(),
        tree=tree_to_json(speculation.tree) if speculation else None,
        backend=pipe.backend,
        device=pipe.device,
        tokens_per_image=n_tokens,
        accepted=accepted,
        seconds_per_image=per_image,
        vq_decode_seconds=time.perf_counter() - t_vq,
        total_seconds=time.perf_counter() - t_start,
        seed=seed,
        sampling=sampling,
        labels=labels,
        batch_size=pipe.batch_size,
        streams=len(pipe.streams),
    )
    if pipe.step_graphs and pipe.step_graphs.compile:
        compile_seconds = pipe.step_graphs.compile_seconds - compiled_before
        stats.extra["compile_seconds"] = compile_seconds  # 0 when every step was compiled before
        if compile_seconds:
            print(
                f"compiled the decode step in {compile_seconds:.1f} s (torch.compile, inductor); "
                "later images reuse it",
                file=sys.stderr,
            )
    return Generation(labels, tokens, images, stats)
