"""Labelled image sets at scale: ``lantern generate-set``, locally or across a Ray cluster.

A set is N images per class in the class-major order of ``lantern generate --classes ... -n N``
(image ``index`` draws from ``image_generator(seed, index)``), cut into work units of
(label, first index, count). Each unit becomes one shard ``DIR/shard-FIRST-LAST.npz``, written
atomically, so a rerun skips the shards that exist and makes only the missing ones; the same
units give the same tokens in one process, with one Ray actor or with many. ``DIR/settings.json``
(written before any shard) pins what the tokens depend on; a rerun with other settings is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lantern_rt.backends import MODEL, backend_named, runs_on_gpu
from lantern_rt.errors import UserError
from lantern_rt.fileio import atomic_write
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig, RunRequest
from lantern_rt.stats import tau

if TYPE_CHECKING:
    from lantern_rt.bundle import Bundle
    from lantern_rt.models.model_dir import ModelDir

SETTINGS = "settings.json"
SUMMARY = "summary.json"
RAY_HINT = "pip install 'lantern-rt[ray]'"


@dataclass(frozen=True)
class Unit:
    """``count`` images of class ``label`` at class-major indices ``first .. first + count - 1``."""

    label: int
    first: int
    count: int

    @property
    def shard(self) -> str:
        """The shard's file name: its first and last index."""
        return f"shard-{self.first:08d}-{self.first + self.count - 1:08d}.npz"


def plan_units(class_ids: list[int], num_images: int, unit_size: int) -> list[Unit]:
    """The work units of ``num_images`` images per class, at most ``unit_size`` each; a unit
    never spans two classes."""
    return [
        Unit(label, pos * num_images + start, min(unit_size, num_images - start))
        for pos, label in enumerate(class_ids)
        for start in range(0, num_images, unit_size)
    ]


@dataclass(frozen=True)
class SetJob:
    """What every worker needs to build its pipeline and make units (picklable, sent to actors).

    ``model`` is the model directory for the torch backend (None: the built-in demo), ``bundle``
    the bundle for the others (exported by the driver before any worker starts)."""

    model: str | None
    bundle: str | None
    backend: str
    method: MethodConfig
    sampling: SamplingConfig
    seed: int
    device: str = "cpu"
    threads: int = 0
    cuda_graphs: bool = True
    batch_size: int = 1
    compile: bool = False  # torch.compile of each decode step (torch backend)

    def pipeline(self, streams: int | None = 1, images: int | None = None):
        """Build this job's pipeline (loads the model or opens the bundle), decoding ``streams``
        batches at once (None: chosen for ``images`` images per call, as ``lantern generate
        --streams auto``)."""
        from lantern_rt.families.loading import open_bundle, open_model_dir
        from lantern_rt.pipeline import build_pipeline

        if self.bundle is not None:
            source = open_bundle(self.bundle)
        else:
            source = open_model_dir(None if self.model is None else Path(self.model))
        return build_pipeline(
            source,
            self.method,
            RunShape(self.batch_size, self.sampling.guided, streams=streams),
            backend=self.backend,
            device=self.device,
            threads=self.threads,
            cuda_graphs=self.cuda_graphs,
            compile=self.compile,
            images=images,
        )


def set_job(
    model: Path | None,
    source: ModelDir | Bundle,
    request: RunRequest,
    seed: int,
    device: str = "cpu",
    threads: int = 0,
    cuda_graphs: bool = True,
    batch_size: int = 1,
    compile: bool = False,
) -> tuple[SetJob, str]:
    """The job of a set ``request``ed over ``source`` (the model directory ``model``, or an
    opened bundle), and the digest of what it runs. A model directory on a backend other than
    torch is exported (into the cache) now, before any worker starts, and the workers open that
    bundle."""
    from lantern_rt.bundle import Bundle
    from lantern_rt.export_cache import cached_bundle, model_fingerprint
    from lantern_rt.families.loading import open_bundle

    record = backend_named(request.settings.backend)
    if not isinstance(source, Bundle) and MODEL not in record.runs:
        shape = RunShape(batch_size, request.sampling.guided)
        in_place = record.exports_in_place(device)
        source = open_bundle(cached_bundle(source, request.method, shape, in_place=in_place))
    if isinstance(source, Bundle):
        bundle, digest = str(source.path.resolve()), source.manifest_sha256
    else:
        bundle, digest = None, model_fingerprint(source)
    job = SetJob(
        model=None if model is None else str(model.resolve()),
        bundle=bundle,
        backend=request.settings.backend,
        method=request.method,
        sampling=request.sampling,
        seed=seed,
        device=device,
        threads=threads,
        cuda_graphs=cuda_graphs,
        batch_size=batch_size,
        compile=compile,
    )
    return job, digest


def fingerprint(job: SetJob, digest: str, class_ids: list[int], num_images: int, unit_size: int) -> dict:
    """The settings a set's tokens (and shard layout) depend on; a resume must match them.
    The batch size, device threads and the number of workers are not among them."""
    return {
        "model_digest": digest,
        "backend": job.backend,
        "method": job.method.method,
        "method_params": job.method.params(),
        "drafter": job.method.drafter,
        "sampling": dataclasses.asdict(job.sampling),
        "seed": job.seed,
        "classes": list(class_ids),
        "num_images": num_images,
        "unit_size": unit_size,
    }


def prepare_dir(out: Path, settings: dict) -> None:
    """Create ``out`` and record ``settings`` in it, or check a resumed set's against them."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    path = out / SETTINGS
    if path.is_file():
        old = json.loads(path.read_text())
        differ = sorted(k for k in settings.keys() | old.keys() if settings.get(k) != old.get(k))
        if differ:
            raise UserError(
                f"{out} holds a set made with other settings ({', '.join(differ)}): use another --out "
                "or the same settings to resume it"
            )
        return
    body = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(body))


def make_unit(pipe, job: SetJob, unit: Unit, out: Path) -> dict[str, int]:
    """Generate ``unit`` and write its shard atomically; its image and acceptance counts."""
    from lantern_rt.generate import generate

    result = generate(
        pipe, [unit.label] * unit.count, job.sampling, seed=job.seed, progress=False, start_index=unit.first
    )
    stats = result.stats
    arrays = {
        "codes": result.tokens.numpy(),
        "labels": np.full(unit.count, unit.label, np.int64),
        "index": np.arange(unit.first, unit.first + unit.count, dtype=np.int64),
        "images": result.images,
        "accepted_tokens": np.int64(sum(stats.accepted)),
        "verify_calls": np.int64(stats.verify_calls),
    }
    atomic_write(out / unit.shard, lambda tmp: np.savez(tmp, **arrays))
    return {"first": unit.first, "count": unit.count}


class ShardWriter:
    """A Ray Data actor: builds one pipeline, then turns each batch of units into shards.

    ``fail_once`` (fault injection for tests) names a marker file: the first actor to create it
    exits its process abruptly before writing its unit, which Ray restarts and retries."""

    def __init__(self, job: SetJob, out: str, fail_once: str | None = None) -> None:
        import torch

        if not runs_on_gpu(job.backend, job.device):
            torch.set_num_threads(max(1, job.threads))
            job = dataclasses.replace(job, threads=max(1, job.threads))
        self.job, self.out, self.fail_once = job, Path(out), fail_once
        self.pipe = job.pipeline()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        done = []
        for label, first, count in zip(batch["label"], batch["first"], batch["count"], strict=True):
            if self.fail_once is not None and _claim(Path(self.fail_once)):
                os._exit(1)
            done.append(make_unit(self.pipe, self.job, Unit(int(label), int(first), int(count)), self.out))
        return {key: np.array([d[key] for d in done], np.int64) for key in ("first", "count")}


def _claim(marker: Path) -> bool:
    """Create ``marker`` if it does not exist yet; whether this call created it."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_local(job: SetJob, units: list[Unit], out: Path, advance: Callable[[int], object]) -> None:
    """Make ``units`` in this process, one pipeline for all (on ``job.threads`` CPU threads
    when set, as ``lantern generate --threads``), in the decode streams ``lantern generate``
    would choose for the largest unit."""
    if not units:
        return
    if job.threads:
        import torch

        torch.set_num_threads(job.threads)
    pipe = job.pipeline(streams=None, images=max(unit.count for unit in units))
    for unit in units:
        make_unit(pipe, job, unit, out)
        advance(unit.count)


def import_ray():
    """The ``ray`` module, or a one-line :class:`UserError` with the install hint."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise UserError(f"--ray needs Ray (with Ray Data): {RAY_HINT}") from None
    return ray


def run_ray(
    job: SetJob,
    units: list[Unit],
    out: Path,
    advance: Callable[[int], object],
    actors: int | None = None,
    fail_once: Path | None = None,
) -> int:
    """Make ``units`` on the connected Ray cluster: Ray Data's ``map_batches`` over a pool of
    ``actors`` :class:`ShardWriter` actors (default: one per GPU with a CUDA device, else one per
    CPU; never more than there are units), one unit per call; Ray restarts a dead actor and
    retries its unit. The pool's size."""
    ray = import_ray()
    gpu = runs_on_gpu(job.backend, job.device)
    resources = ray.cluster_resources()
    size = min(len(units), actors or max(1, int(resources.get("GPU" if gpu else "CPU", 1))))
    if not size:
        return 0
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    rows = [{"label": u.label, "first": u.first, "count": u.count} for u in units]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ShardWriter,
        fn_constructor_kwargs={
            "job": job,
            "out": str(out.resolve()),
            "fail_once": None if fail_once is None else str(fail_once),
        },
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=size),
        **({"num_gpus": 1} if gpu else {"num_cpus": 1}),
    )
    for row in ds.iter_rows():
        advance(int(row["count"]))
    return size


def check_set(out: Path, units: Iterable[Unit]) -> dict[str, Any]:
    """Check that every unit's shard is there and holds exactly the unit's indices and class
    (the images are not read); the set's image counts per class and tau."""
    per_class: dict[str, int] = {}
    accepted = calls = 0
    for unit in units:
        path = out / unit.shard
        if not path.is_file():
            raise UserError(f"{path} is missing: run the command again to make it")
        with np.load(path) as shard:
            expected = np.arange(unit.first, unit.first + unit.count)
            if not np.array_equal(shard["index"], expected) or not (shard["labels"] == unit.label).all():
                raise UserError(
                    f"{path} does not hold images {unit.first}..{expected[-1]} of class {unit.label}"
                )
            accepted += int(shard["accepted_tokens"])
            calls += int(shard["verify_calls"])
        per_class[str(unit.label)] = per_class.get(str(unit.label), 0) + unit.count
    return {"images_per_class": per_class, "tau": tau(accepted, calls)}


def write_fid_npz(path: Path, shards: list[Path], total: int) -> None:
    """The ``total`` images of ``shards``, in order, as one uint8 array ``arr_0`` in an .npz (the
    format LlamaGen's and ADM's FID evaluators read), streamed one shard at a time."""

    def write(tmp: Path) -> None:
        with np.load(shards[0]) as first:
            shape = first["images"].shape[1:]
        header = {"descr": "|u1", "fortran_order": False, "shape": (total, *shape)}
        with (
            zipfile.ZipFile(tmp, "w", allowZip64=True) as zf,
            zf.open("arr_0.npy", "w", force_zip64=True) as f,
        ):
            np.lib.format.write_array_header_2_0(f, header)
            for shard in shards:
                with np.load(shard) as data:
                    f.write(np.ascontiguousarray(data["images"], dtype=np.uint8).tobytes())

    atomic_write(path, write)


def generate_set(
    out: Path,
    job: SetJob,
    digest: str,
    class_ids: list[int],
    num_images: int,
    unit_size: int = 32,
    ray_address: str | None = None,
    actors: int | None = None,
    fid_npz: Path | None = None,
    progress: bool = True,
    fail_once: Path | None = None,
) -> dict[str, Any]:
    """Make (or resume) the set of ``num_images`` images per class of ``class_ids`` in ``out``:
    in this process, or with ``ray_address`` on Ray (``"local"``: a local cluster started for
    the run; else ``ray.init``'s address, e.g. ``"auto"``; an initialised Ray is used as it is).
    ``digest`` identifies the model or bundle. Writes ``summary.json`` (and ``fid_npz``: every
    image as ``arr_0``) and returns the summary."""
    from tqdm import tqdm

    settings = fingerprint(job, digest, class_ids, num_images, unit_size)
    prepare_dir(out, settings)
    units = plan_units(class_ids, num_images, unit_size)
    pending = [u for u in units if not (out / u.shard).is_file()]
    total = len(class_ids) * num_images
    made = sum(u.count for u in pending)
    t0 = time.perf_counter()
    with tqdm(total=total, initial=total - made, unit="img", desc="set", disable=not progress) as bar:
        if ray_address is None:
            run_local(job, pending, out, bar.update)
            mode, workers = "local", 1
        else:
            ray = import_ray()
            started = not ray.is_initialized()
            if started:
                ray.init(
                    address=ray_address,  # "local": a new cluster even where RAY_ADDRESS names one
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
            try:
                workers = run_ray(job, pending, out, bar.update, actors, fail_once)
            finally:
                if started:
                    ray.shutdown()
            mode = "ray"
    seconds = time.perf_counter() - t0
    summary = {
        "settings": settings,
        "images": total,
        **check_set(out, units),
        "shards": len(units),
        "made_this_run": made,
        "resumed": made < total,
        "mode": mode,
        "workers": workers,
        "seconds": seconds,
        "images_per_second": made / seconds if made and seconds > 0 else None,
    }
    atomic_write(out / SUMMARY, lambda tmp: tmp.write_text(json.dumps(summary, indent=2) + "\n"))
    if fid_npz is not None:
        write_fid_npz(fid_npz, [out / u.shard for u in units], total)
    return summary
