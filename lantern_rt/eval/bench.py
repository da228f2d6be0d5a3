"""``lantern bench``: speed and quality of decoding methods, measured side by side in one run.

Every (backend, method) pipeline generates image i before any generates image i + 1, so drift
of the machine (thermal state, background load) falls on all configurations alike. Speed is the
decode loop per image (``seconds_per_image_end_to_end`` adds VQ decoding); quality compares each
configuration's images with the Fashion-MNIST test set in the feature space of the in-repo
classifier (``lantern_rt/eval/classifier.py``), next to calibration rows that say what a real
sample, the tokenizer and a second AR seed score. ``--features`` and ``--reference`` swap in the
user's feature extractor and real images (``lantern_rt/eval/features.py``), for any model. Each
row has its memory floor beside its speed (:mod:`lantern_rt.eval.memory_floor`, at the bandwidth
a copy loop measures in the run); ``--size`` runs the demo widened to a LlamaGen size
(:mod:`lantern_rt.sized_demo`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from lantern_rt.assembly import Pipeline
from lantern_rt.backends import BACKENDS, cpu_backends
from lantern_rt.bundle import Bundle
from lantern_rt.errors import option
from lantern_rt.eval.classifier import DEFAULT_WEIGHTS, load_classifier
from lantern_rt.eval.features import load_features, load_reference, user_features
from lantern_rt.eval.memory_floor import (
    StepBytes,
    copy_bandwidth,
    floor_fields,
    pipeline_step_bytes,
    torch_step_bytes,
)
from lantern_rt.eval.metrics import (
    FeatureFn,
    class_accuracy,
    extract_features,
    frechet_distance,
    precision_recall,
)
from lantern_rt.families.loading import load_target, load_vq, open_model_dir
from lantern_rt.generate import Generation, generate
from lantern_rt.images import to_uint8
from lantern_rt.models.checkpoint import CheckpointError
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.pipeline import build_pipeline, exported, open_source
from lantern_rt.run_options import RunOptions
from lantern_rt.runtime.acceptance import AcceptanceError
from lantern_rt.runtime.backends.compiled import CompileError
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH
from lantern_rt.runtime.method import JACOBI_METHODS, METHODS, MethodConfig
from lantern_rt.runtime.run_shape import check_batch_sizes, check_stream_counts
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import TreeError, load_tree
from lantern_rt.settings import RunPlan, method_options, requested_conditions, resolve, window_tree
from lantern_rt.sized_demo.cache import sized_model_dir
from lantern_rt.sized_demo.sizes import size_shape
from lantern_rt.stats import GenerationStats
from lantern_rt.training.data import (
    CLASS_NAMES,
    FASHION_MNIST_DIR,
    DatasetMissing,
    load_fashion_mnist,
    to_model_range,
)
from lantern_rt.version import package_version

FORMAT_VERSION = 1
SPEC_KEYS: dict[str, tuple[str, ...]] = {  # the keys each of settings.METHODS takes
    "ar": (),
    "exact": ("tree",),
    "lantern": ("tree", "k", "delta"),
    "lantern++": ("tree", "k", "lambda"),
    "sjd": ("window", "tree", "coupling"),
    "sjd++": ("window", "tree", "coupling", "k", "lambda"),
}
assert tuple(SPEC_KEYS) == METHODS
SPEC_DEFAULTS: dict[str, dict[str, Any]] = {
    "lantern": {"k": 1000, "delta": 0.1},
    "lantern++": {"k": 10, "lambda": 5.0},
    "sjd++": {"k": 10, "lambda": 5.0},
}
KEY_TYPES: dict[str, tuple[type, str]] = {
    "tree": (str, "a tree name or file"),
    "window": (int, "an integer"),
    "coupling": (str, "maximal, gumbel or none"),
    "k": (int, "an integer"),
    "delta": (float, "a number"),
    "lambda": (float, "a number"),
}
MC_FIELDS = {"lambda": "lam"}  # spec key -> MethodConfig field, where they differ
DEFAULT_CONFIGS = (
    "ar",
    "exact",
    "lantern:k=1000,delta=0.1",
    "lantern++:k=10,lambda=5",
    "lantern++:k=5,lambda=10",
    "lantern++:k=5,lambda=20",
)
QUALITY_K = 3  # nearest neighbours of improved precision/recall
QUALITY_FIELDS = ("fd_classifier", "class_accuracy", "precision", "recall")
GenerateFn = Callable[..., Generation]


# --- configuration specs -------------------------------------------------------------------


def _typed(spec: str, key: str, value: str) -> Any:
    kind, wanted = KEY_TYPES[key]
    try:
        if not value:
            raise ValueError(value)
        return kind(value)
    except ValueError:
        raise ConfigError(f"--config {spec!r}: {key} needs {wanted}, got {value!r}") from None


def parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``METHOD[:key=val,...]`` -> (method, the parameters it names, typed)."""
    method, _, rest = spec.strip().partition(":")
    if method not in SPEC_KEYS:
        raise ConfigError(f"--config {spec!r}: unknown method {method!r}; choose from {', '.join(SPEC_KEYS)}")
    allowed, params = SPEC_KEYS[method], {}
    for item in rest.split(",") if rest.strip() else []:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ConfigError(f"--config {spec!r}: {item.strip()!r} is not key=value")
        if key not in allowed:
            takes = f"takes {', '.join(allowed)}" if allowed else "takes no parameters"
            raise ConfigError(f"--config {spec!r}: {key!r} is not a parameter of {method}, which {takes}")
        if key in params:
            raise ConfigError(f"--config {spec!r}: {key} is given twice")
        params[key] = _typed(spec, key, value)
    return method, params


def method_config(spec: str, tree: str, image_tokens: int | None = None) -> MethodConfig:
    """The validated method config of ``spec`` (running on ``tree`` unless the spec names one; a
    Jacobi method on the chain of its window or the chain or pac tree it names, of at most
    ``image_tokens`` - 1 nodes when given)."""
    method, params = parse_config(spec)
    if method == "ar":
        return MethodConfig("ar")
    if method in JACOBI_METHODS:
        try:
            tree = window_tree(method, params.pop("tree", None), params.pop("window", None), image_tokens)
        except ConfigError as exc:
            raise ConfigError(f"--config {spec!r}: {exc}") from None
    merged = {**SPEC_DEFAULTS.get(method, {}), "tree": tree, **params}
    mc = MethodConfig(method, **{MC_FIELDS.get(k, k): v for k, v in merged.items()})
    try:
        mc.relaxation()
        load_tree(mc.tree, MAX_DRAFT_WIDTH)
    except (AcceptanceError, TreeError) as exc:
        raise ConfigError(f"--config {spec!r}: {exc}") from None
    return mc


def expand_configs(
    specs: Sequence[str], trees: Sequence[str], image_tokens: int | None = None
) -> list[MethodConfig]:
    """AR first (on the first tree's bundle: every bundle holds AR's step graph), then every spec
    on each of ``trees`` (a spec naming its tree, or a Jacobi window: that one); no repeats."""
    ar = MethodConfig("ar", tree=trees[0])
    configs = [method_config(s, t, image_tokens) for s in specs for t in trees]
    return list(dict.fromkeys([ar] + [ar if mc.method == "ar" else mc for mc in configs]))


# --- statistics ----------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linearly interpolated (numpy's default)."""
    return float(np.percentile(values, q))


def speedup(reference: Sequence[float], values: Sequence[float]) -> float:
    """Median of ``reference`` seconds over the median of ``values`` seconds."""
    return median(reference) / median(values)


def mean_accepted_length(histogram: Mapping[int, int]) -> float:
    """Tokens committed per verify call, from {accepted length: number of calls}."""
    calls = sum(histogram.values())
    return sum(n * c for n, c in histogram.items()) / calls if calls else 0.0


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


# --- the interleaved run -------------------------------------------------------------------


# A configuration as the interleaved run calls it: (labels, index of the first image) -> its
# generation of those images.
Runner = Callable[[Sequence[int], int], Generation]


@dataclass
class Measurement:
    """What one configuration produced over the timed images."""

    runner: Runner
    method: MethodConfig
    backend: str
    batch_size: int
    pipe: Pipeline | None = None  # None for the baseline
    streams: int = 1  # batches decoded at once (docs/method.md §15)
    seconds: list[float] = field(default_factory=list)  # decode loop per image, one per chunk
    end_to_end: list[float] = field(default_factory=list)  # with VQ decoding, per image, per chunk
    histogram: Counter[int] = field(default_factory=Counter)
    images: list[np.ndarray] = field(default_factory=list)  # uint8 [n, H, W, C] per chunk
    peak_mb: float = 0.0
    step_bytes: StepBytes | None = None  # what its calls read at least (None: unknown, no floor)

    @classmethod
    def of_pipeline(
        cls,
        pipe: Pipeline,
        sampling: SamplingConfig,
        seed: int,
        generate_fn: GenerateFn,
        step_bytes: StepBytes | None = None,
    ) -> Measurement:
        def run(labels: Sequence[int], start: int) -> Generation:
            return generate_fn(pipe, labels, sampling, seed=seed, progress=False, start_index=start)

        return cls(
            run, pipe.method, pipe.backend, pipe.batch_size, pipe, len(pipe.streams), step_bytes=step_bytes
        )

    def add(self, gen: Generation) -> None:
        stats = gen.stats
        n = max(1, stats.num_images)
        self.seconds.append(stats.decode_seconds / n)
        self.end_to_end.append(stats.total_seconds / n)
        self.histogram.update(stats.histogram)
        self.images.append(gen.images)
        self.peak_mb = peak_rss_mb()

    def all_images(self) -> np.ndarray:
        return np.concatenate(self.images)


def run_order(num_images: int, warmup: int, chunk: int = 1) -> list[tuple[int, int, bool]]:
    """(first image index, image count, timed) in run order: ``warmup`` untimed chunks past the
    timed range first, then the timed images in chunks of ``chunk``."""
    warm = [(num_images + i * chunk, chunk, False) for i in range(warmup)]
    return warm + [(i, min(chunk, num_images - i), True) for i in range(0, num_images, chunk)]


CHUNK_BATCHES = 4  # batches of the largest batch size per interleaved call


def chunk_size(batch_sizes: Sequence[int], num_images: int, streams: Sequence[int] = (1,)) -> int:
    """Images per interleaved call: four batches of the largest batch size for each stream of
    the largest stream count, at most all the images. A call ends by draining its batch (the
    last images decode with slots empty), so the fewer images per call, the more of that tail
    a speculative row pays (AR images finish together): at 16 images per batch, 32 images per
    call cost 30% more steps than full batches would."""
    return max(1, min(num_images, CHUNK_BATCHES * max(batch_sizes) * max(streams)))


def run_interleaved(
    runs: Sequence[Measurement], labels: Sequence[int], warmup: int, chunk: int = 1
) -> list[Measurement]:
    """Every configuration generates chunk i (one call each, ``chunk`` images) before any
    generates chunk i + 1, so that drift of the machine falls on all of them alike."""
    order = run_order(len(labels), warmup, chunk)
    total = len(runs) * sum(count for _, count, _ in order)
    with tqdm(total=total, desc="bench", unit="img", file=sys.stderr) as bar:
        for start, count, timed in order:
            part = [labels[(start + j) % len(labels)] for j in range(count)]
            for run in runs:
                gen = run.runner(part, start)
                if timed:
                    run.add(gen)
                bar.update(count)
    return runs


# --- rows ----------------------------------------------------------------------------------


def speed_row(m: Measurement, rows_per_image: int, bandwidth: float) -> dict[str, Any]:
    """The result row of a measurement, with its memory floor at ``bandwidth`` bytes/s for
    ``rows_per_image`` cache rows per image (:func:`~lantern_rt.eval.memory_floor.floor_fields`);
    quality fields still empty and no speedup yet."""
    mc = m.method
    row = {
        "method": mc.method,
        "backend": m.backend,
        "tree": None if mc.method == "ar" else mc.tree,
        "params": mc.params(),
        "batch_size": m.batch_size,
        "streams": m.streams,
        "num_images": sum(len(x) for x in m.images),
        "mean_accepted_length": mean_accepted_length(m.histogram),
        "verify_calls": sum(m.histogram.values()),
        "seconds_per_image": median(m.seconds),
        "images_per_second": 1.0 / median(m.seconds),
        "seconds_per_image_p90": percentile(m.seconds, 90),
        "seconds_per_image_end_to_end": median(m.end_to_end),
    }
    return {
        **row,
        **floor_fields(m.step_bytes, row, rows_per_image, bandwidth),
        "ar_seconds_per_image": None,
        "speedup_vs_ar": None,
        **dict.fromkeys(QUALITY_FIELDS),
        "quality_note": None,
        "peak_memory_mb": m.peak_mb,
        "accepted_length_histogram": {str(n): m.histogram[n] for n in sorted(m.histogram)},
        "seconds_per_image_all": m.seconds,
    }


def add_speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with ``ar_seconds_per_image``, the median seconds of the AR row of its setting
    (:func:`_setting`), and ``speedup_vs_ar``, that over its own (both None where the setting
    has no AR row)."""
    ar = {_setting(r): r["seconds_per_image_all"] for r in rows if r["method"] == "ar"}
    return [
        {
            **r,
            "ar_seconds_per_image": median(ar[key]) if (key := _setting(r)) in ar else None,
            "speedup_vs_ar": speedup(ar[key], r["seconds_per_image_all"]) if key in ar else None,
        }
        for r in rows
    ]


def _setting(row: dict[str, Any]) -> tuple[str, str | None, int, int]:
    """What a row's AR reference shares with it: backend, weight precision, batch size, streams."""
    return row["backend"], row.get("weight_precision"), row["batch_size"], row.get("streams", 1)


# --- quality -------------------------------------------------------------------------------


FASHION_REAL_ROW = ("real train subset", "Fashion-MNIST train images, same classes and counts")
USER_REAL_ROW = ("real reference subset", "--reference images, same classes and counts (an optimistic floor)")


def image_features(
    classifier: nn.Module | None, feature_fn: FeatureFn | None, images: np.ndarray
) -> np.ndarray:
    """Features of uint8 images: the user's extractor's when there is one, else the classifier's."""
    if feature_fn is not None:
        return user_features(feature_fn, images)
    assert classifier is not None  # quality_reference never pairs two Nones
    return extract_features(classifier, images)[0]


@dataclass
class QualityReference:
    """The feature extractor, the metric classifier and the real images quality is measured against."""

    classifier: nn.Module | None  # Fashion-MNIST classifier (class accuracy); None for other models
    feature_fn: FeatureFn | None  # the --features extractor; None: the classifier's features
    features: np.ndarray  # reference (test-set) features of the benchmarked classes
    train_images: np.ndarray  # uint8 [N, H, W] or [N, H, W, C]
    train_labels: np.ndarray
    real_row: tuple[str, str] = FASHION_REAL_ROW  # name and description of the real calibration row

    def features_of(self, images: np.ndarray) -> np.ndarray:
        return image_features(self.classifier, self.feature_fn, images)


def fashion_mismatch(info: ModelDir) -> str | None:
    """Why the Fashion-MNIST classifier cannot score this model's images (None when it can)."""
    shape = (info.image_size, info.vq.out_channels, info.gpt.num_classes)
    names = [n.lower() for n in info.class_names]
    if shape == (32, 1, len(CLASS_NAMES)) and names in ([], list(CLASS_NAMES)):
        return None
    return (
        f"the metric classifier scores Fashion-MNIST (10 classes of 32x32 greyscale images); "
        f"this model makes {info.gpt.num_classes} classes of {info.image_size}x{info.image_size}"
        f"x{info.vq.out_channels} images"
    )


def quality_reference(
    info: ModelDir,
    classes: Sequence[int],
    num_images: int,
    enabled: bool,
    weights: Path = DEFAULT_WEIGHTS,
    data_root: Path = FASHION_MNIST_DIR,
    feature_fn: FeatureFn | None = None,
    reference: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[QualityReference | None, str | None]:
    """The reference for quality metrics, or None and why there is none.

    ``reference`` (the user's images and labels) replaces Fashion-MNIST as the real images; with
    ``feature_fn`` as well, models the classifier cannot score get FD and precision/recall.
    """
    if not enabled:
        return None, "speed only (--no-quality)"
    if info.gpt.takes_prompts:
        return None, "the quality metrics score class-conditional images; a text-to-image run is speed only"
    mismatch = fashion_mismatch(info)
    if mismatch is not None and (feature_fn is None or reference is None):
        return None, f"{mismatch} (--features with --reference scores any model)"
    if num_images <= QUALITY_K:
        return None, f"quality needs more than {QUALITY_K} images per configuration, got {num_images}"
    try:
        classifier = None if mismatch else load_classifier(weights)
        if reference is None:
            test_images, test_labels = load_fashion_mnist("test", data_root)
            train_images, train_labels = load_fashion_mnist("train", data_root)
        else:
            test_images, test_labels = train_images, train_labels = reference
    except (CheckpointError, DatasetMissing) as exc:
        return None, str(exc)
    features = image_features(classifier, feature_fn, test_images[np.isin(test_labels, classes)])
    real_row = FASHION_REAL_ROW if reference is None else USER_REAL_ROW
    return QualityReference(classifier, feature_fn, features, train_images, train_labels, real_row), None


def quality_fields(
    ref: QualityReference, images: np.ndarray, feats: np.ndarray, labels: Sequence[int]
) -> dict[str, float | None]:
    """FD, class accuracy (None without the classifier), precision and recall of ``images``
    (whose features are ``feats``, from ``ref.features_of``) against the reference features."""
    precision, recall = precision_recall(ref.features, feats, QUALITY_K)
    accuracy = (
        None
        if ref.classifier is None
        else class_accuracy(extract_features(ref.classifier, images)[1], np.asarray(labels))
    )
    return {
        "fd_classifier": frechet_distance(ref.features, feats),
        "class_accuracy": accuracy,
        "precision": precision,
        "recall": recall,
    }


def matched_subset(train_labels: np.ndarray, labels: Sequence[int], seed: int) -> np.ndarray:
    """Indices of distinct train images with the classes of ``labels``, in that order."""
    rng = np.random.default_rng(seed)
    pools = {c: iter(rng.permutation(np.flatnonzero(train_labels == c))) for c in sorted(set(labels))}
    return np.array([next(pools[c]) for c in labels])


@torch.inference_mode()
def vq_reconstructions(md: ModelDir, images: np.ndarray, batch: int = 256) -> np.ndarray:
    """uint8 images [N, H, W] or [N, H, W, C] encoded to codes and decoded by the model's tokenizer."""
    vq = load_vq(md)
    x = torch.from_numpy(to_model_range(images))
    codes = torch.cat([vq.encode(x[i : i + batch])[1].flatten(1) for i in range(0, len(x), batch)])
    return to_uint8(
        torch.cat(
            [vq.decode_code(codes[i : i + batch], md.gpt.grid_size) for i in range(0, len(codes), batch)]
        )
    )


def calibration_row(
    ref: QualityReference,
    name: str,
    description: str,
    images: np.ndarray,
    labels: Sequence[int],
    feats: np.ndarray | None = None,
) -> dict[str, Any]:
    feats = ref.features_of(images) if feats is None else feats
    return {
        "name": name,
        "description": description,
        "num_images": len(images),
        **quality_fields(ref, images, feats, labels),
        "fd_vs_ar": None,
    }


def calibration_rows(
    ref: QualityReference,
    labels: Sequence[int],
    seed: int,
    md: ModelDir | None,
    ar_sets: Sequence[tuple[str, np.ndarray]],
) -> list[dict[str, Any]]:
    """Real train images (the floor), VQ reconstructions (the tokenizer's ceiling; model
    directories only) and AR sample sets of other seeds (seed noise), all vs the test set."""
    real = ref.train_images[matched_subset(ref.train_labels, labels, seed)]
    rows = [calibration_row(ref, *ref.real_row, real, labels)]
    if md is not None:
        recon = vq_reconstructions(md, real)
        rows.append(
            calibration_row(
                ref, "VQ reconstruction", "those train images through the tokenizer", recon, labels
            )
        )
    (base_name, base), *others = ar_sets
    base_features = ref.features_of(base)
    rows.append(calibration_row(ref, base_name, "the AR row's images", base, labels, base_features))
    for name, images in others:
        feats = ref.features_of(images)
        row = calibration_row(
            ref, name, f"another seed; FD vs AR: against {base_name}", images, labels, feats
        )
        rows.append({**row, "fd_vs_ar": frechet_distance(base_features, feats)})
    return rows


# --- the whole benchmark -------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """Everything ``lantern bench`` takes (see ``lantern bench --help``)."""

    out: Path
    model: Path | None = None
    bundle: Path | None = None
    size: str | None = None  # the demo widened to this sized_demo.SIZES name, instead of model/bundle
    backends: tuple[str, ...] = ()  # () = the CPU backends (backends.cpu_backends): torch and onnxruntime
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    trees: tuple[str, ...] = ()  # () = the tree `lantern generate` would use (settings.resolve)
    num_images: int = 4  # per class
    classes: tuple[str, ...] = ()  # ids or names; () = every class
    prompts: tuple[str, ...] = ()  # a text-to-image model's prompts (instead of classes)
    seed: int = 0
    warmup: int = 1
    # every row's run options: its sampling, device, threads, CUDA graphs, compiled steps (the
    # torch rows') and cache windows; the backends, configs, trees, batch sizes and streams above
    # and below set the rest
    options: RunOptions = RunOptions()
    quality: bool = True
    ar_seeds: int = 2
    command: str = ""
    classifier: Path = DEFAULT_WEIGHTS
    data_root: Path = FASHION_MNIST_DIR
    features: str | None = None  # --features spec: the user's extractor for FD and precision/recall
    reference: Path | None = None  # --reference .npz: the user's real images
    batch_sizes: tuple[int, ...] = (1,)  # images per decode step; every configuration runs at each
    streams: tuple[int, ...] = (1,)  # batches decoded at once (onnxruntime rows; others run one)
    baseline: str | None = None  # "torch-batched": LlamaGen's sampler loop (eval.baseline) as rows


def bench_plans(source: ModelDir | Bundle, s: BenchSettings) -> list[RunPlan]:
    """Every row's plan, each resolved from the settings' options (:func:`~lantern_rt.settings.resolve`:
    its refusals before any work): AR and every configuration on each backend (default: the
    CPU ones), at each batch size, at each stream count on the backends that decode in streams
    (the others at one); a configuration naming no tree runs on each of ``s.trees`` (default:
    the tree a run of each backend chooses)."""
    backends = tuple(dict.fromkeys(s.backends)) or cpu_backends(isinstance(source, Bundle))
    first = dataclasses.replace(s.options, batch_size=s.batch_sizes[0], compile=False)
    plan = {b: resolve(source, dataclasses.replace(first, backend=b)) for b in backends}
    trees = s.trees or tuple(dict.fromkeys(plan[b].method.tree for b in backends))
    configs = expand_configs(s.configs, trees, plan[backends[0]].info.gpt.block_size)
    streaming = [b for b in backends if plan[b].record.streams]
    if max(s.streams) > 1 and not streaming:
        names = " or ".join(name for name, b in BACKENDS.items() if b.streams)
        raise ConfigError(
            f"{option('streams')} above 1 runs on {names}: add {option('backend')} with one of them"
        )
    compiling = s.options.compile and any(plan[b].record.compiles for b in backends)
    if s.options.compile and not compiling:
        raise CompileError(
            f"{option('compile')} compiles the torch rows' decode steps: add {option('backend', 'torch')} "
            f"or use {option('compile', False)}"
        )
    return [
        resolve(
            source,
            dataclasses.replace(
                s.options,
                **method_options(mc),
                backend=b,
                batch_size=size,
                streams=streams,
                compile=s.options.compile and plan[b].record.compiles,
            ),
        )
        for size in s.batch_sizes
        for streams in s.streams
        for b in backends
        for mc in (configs if streams == 1 or b in streaming else ())
    ]


def output_dir(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": _version("onnxruntime", "onnxruntime-gpu"),
        "openvino": _version("openvino"),
        "lantern_rt": package_version(),
    }


def with_quality(
    rows: Sequence[dict[str, Any]],
    runs: Sequence[Measurement],
    ref: QualityReference | None,
    note: str | None,
    labels: Sequence[int],
) -> list[dict[str, Any]]:
    """Each row with its quality metrics, or with the note saying why there are none.

    ``fd_vs_ar``: the FD between a row's images and the AR row's of the same backend (same
    labels): compare it with the calibration's AR-vs-AR seed noise.
    """
    if ref is None:
        return [{**r, "quality_note": note} for r in rows]
    images = [m.all_images() for m in runs]
    features = [ref.features_of(x) for x in images]
    ar = {_setting(r): f for r, f in zip(rows, features, strict=True) if r["method"] == "ar"}
    return [
        {
            **r,
            **quality_fields(ref, x, f, labels),
            "fd_vs_ar": None if r["method"] == "ar" else frechet_distance(ar[_setting(r)], f),
        }
        for r, x, f in zip(rows, images, features, strict=True)
    ]


def ar_seed_sets(
    ar: Measurement, labels: Sequence[int], sampling: SamplingConfig, seed: int, count: int
) -> list[tuple[str, np.ndarray]]:
    """The AR row's images and ``count - 1`` more AR sample sets (seeds ``seed + 1``, ...), named."""

    def name(s: int) -> str:
        return f"AR seed {s} ({ar.backend})"

    extra = [
        (name(s), generate(ar.pipe, labels, sampling, seed=s).images) for s in range(seed + 1, seed + count)
    ]
    return [(name(seed), ar.all_images()), *extra]


BASELINES = ("torch-batched",)


def baseline_model(name: str, source: ModelDir | Bundle, model: Path | None) -> ModelDir:
    """The model directory the ``name`` baseline runs: ``source`` itself, or beside a bundle
    ``model`` (default: the demo), which must be the model the bundle was exported from (its
    name and architecture); :class:`ConfigError` unless the baseline can run it."""
    if name not in BASELINES:
        raise ConfigError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
    md = source if isinstance(source, ModelDir) else open_model_dir(model)
    if isinstance(source, Bundle) and (md.name != source.model_name or md.gpt != source.gpt):
        raise ConfigError(
            f"the {name} baseline runs --model (default: the demo), and {md.name} is not the model "
            f"{source.path} was exported from ({source.model_name}): give that model with --model"
        )
    from lantern_rt.eval.baseline import check_runnable

    check_runnable(md.gpt)
    return md


def baseline_measurement(
    name: str, source: ModelDir, sampling: SamplingConfig, seed: int, batch_size: int
) -> Measurement:
    """The ``name`` baseline (``torch-batched``: LlamaGen's sampler loop over the model
    directory's target in torch eager, :func:`~lantern_rt.eval.baseline.torch_batched_ar`) at
    ``batch_size``, as a configuration of the interleaved run."""
    from lantern_rt.eval.baseline import torch_batched_ar

    model, vq = load_target(source), load_vq(source)
    grid, tokens = source.gpt.grid_size, source.gpt.block_size

    def run(labels: Sequence[int], start: int) -> Generation:
        t0 = time.perf_counter()
        out = torch_batched_ar(model, labels, sampling, batch_size, seed + start)
        t_vq = time.perf_counter()
        with torch.inference_mode():
            images = to_uint8(vq.decode_code(out.tokens, grid))
        stats = GenerationStats(
            model=source.name,
            method="ar",
            params={},
            tree=None,
            backend=name,
            device="cpu",
            tokens_per_image=tokens,
            accepted=[1] * ((tokens - 1) * len(labels)),
            seconds_per_image=[out.seconds_per_image] * len(labels),
            vq_decode_seconds=time.perf_counter() - t_vq,
            total_seconds=time.perf_counter() - t0,
            seed=seed,
            sampling=sampling,
            labels=list(labels),
            batch_size=batch_size,
        )
        return Generation(list(labels), out.tokens, images, stats)

    return Measurement(run, MethodConfig("ar"), name, batch_size, step_bytes=torch_step_bytes(model))


def sized_model(size: str | None, model: Path | None, bundle: Path | None) -> Path | None:
    """The model directory of ``--size`` (built into the cache on first use), or ``model``
    when no size is given; :class:`ConfigError` for an unknown size or a size beside ``model``
    or ``bundle``, before anything is built."""
    if size is None:
        return model
    size_shape(size)
    if model is not None or bundle is not None:
        raise ConfigError(f"--size {size} runs the demo widened to {size}: drop --model and --bundle")
    return sized_model_dir(size)


def run_bench(s: BenchSettings) -> dict[str, Any]:
    """Run the benchmark and write results.json, results.md and the plots into ``s.out``."""
    from lantern_rt.eval.report import write_report

    model = sized_model(s.size, s.model, s.bundle)
    if s.bundle is not None and s.model is not None and s.baseline is None:
        raise ConfigError("--bundle runs an exported bundle: drop --model (it names a --baseline's model)")
    # beside a bundle, --model names what the baseline runs
    info, source = open_source(None if s.bundle and s.baseline else model, s.bundle)
    md = source if isinstance(source, ModelDir) else None
    sizes = check_batch_sizes(list(s.batch_sizes))
    stream_counts = check_stream_counts(list(s.streams))
    plans = bench_plans(
        source, dataclasses.replace(s, batch_sizes=tuple(sizes), streams=tuple(stream_counts))
    )
    backends = tuple(dict.fromkeys(plan.backend for plan in plans))
    classes = requested_conditions(info, s.classes, s.prompts)
    labels = [c for c in classes for _ in range(s.num_images)]
    sampling = plans[0].sampling  # every row's: the same options
    shape = (info.vq.out_channels, info.image_size, info.image_size)
    feature_fn = None if s.features is None else load_features(s.features, shape)
    reference = None if s.reference is None else load_reference(s.reference, shape, classes, s.num_images)
    baseline = None if s.baseline is None else baseline_model(s.baseline, source, model)
    out = output_dir(s.out)
    threads = s.options.threads
    if threads:
        torch.set_num_threads(threads)
    started, load_start = datetime.now(timezone.utc), os.getloadavg()
    sources: dict[tuple[str, str], ModelDir | Bundle] = {}  # one export (every batch size) per tree
    step_bytes: dict[tuple[str, MethodConfig], StepBytes | None] = {}  # read once per source and method
    runs = []
    for plan in plans:
        b, mc = plan.backend, plan.method
        if (b, mc.tree) not in sources:
            sources[b, mc.tree] = exported(plan, sizes).source
        pipe = build_pipeline(dataclasses.replace(plan, source=sources[b, mc.tree]))
        if (b, mc) not in step_bytes:
            step_bytes[b, mc] = pipeline_step_bytes(pipe, sources[b, mc.tree])
        runs.append(Measurement.of_pipeline(pipe, sampling, s.seed, generate, step_bytes[b, mc]))
    if s.baseline is not None:
        runs += [baseline_measurement(s.baseline, baseline, sampling, s.seed, size) for size in sizes]
    bandwidth = copy_bandwidth(threads or torch.get_num_threads())
    runs = run_interleaved(runs, labels, s.warmup, chunk_size(sizes, len(labels), stream_counts))
    ref, note = quality_reference(
        info, classes, len(labels), s.quality, s.classifier, s.data_root, feature_fn, reference
    )
    rows_per_image = 2 if sampling.guided else 1
    speed = [speed_row(m, rows_per_image, bandwidth.bytes_per_s) for m in runs]
    rows = with_quality(add_speedups(speed), runs, ref, note, labels)
    calibration = (
        []
        if ref is None
        else calibration_rows(
            ref, labels, s.seed, md, ar_seed_sets(runs[0], labels, sampling, s.seed, s.ar_seeds)
        )
    )
    results = {
        "format_version": FORMAT_VERSION,
        "date": started.isoformat(timespec="seconds"),
        "command": s.command,
        "machine": {
            **machine_info(),
            "load_average_start": load_start,
            "load_average_end": os.getloadavg(),
            "copy_bandwidth": bandwidth.as_json(),
        },
        "settings": {
            "model": info.name,
            "size": s.size,
            "source": str(source.root if md is not None else source.path),
            "backends": list(backends),
            "classes": classes,
            "num_images_per_class": s.num_images,
            "seed": s.seed,
            "warmup": s.warmup,
            "ar_seeds": s.ar_seeds,
            "threads": threads,
            "batch_sizes": sizes,
            "streams": stream_counts,
            "images_per_call": chunk_size(sizes, len(labels), stream_counts),
            "baseline": s.baseline,
            "baseline_model": None if baseline is None else str(baseline.root),
            "sampling": dataclasses.asdict(sampling),
            # 2: CFG rows; 1: one row per image (guidance off, docs/method.md §13)
            "rows_per_image": sorted({2 if r.pipe.guided else 1 for r in runs if r.pipe is not None}),
            "features": s.features,
            "reference": None if s.reference is None else str(s.reference),
        },
        "quality_note": note,
        "rows": rows,
        "calibration": calibration,
    }
    write_report(out, results)
    return results
