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

from lantern_rt.errors import UserError
from lantern_rt.fileio import atomic_write
from lantern_rt.settings import RunPlan
from lantern_rt.stats import tau

if TYPE_CHECKING:
    from lantern_rt.assembly import Pipeline

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
    """What every worker needs to build its pipeline and make units: the set's plan and seed
    (picklable, sent to Ray's actors with its source: a model directory, or the bundle that
    :func:`exported_job` exported before any worker starts)."""

    plan: RunPlan
    seed: int

    def pipeline(self, streams: int | None = 1, images: int | None = None) -> Pipeline:
        """Build this job's pipeline (loads the model or the bundle's graphs), decoding ``streams``
        batches at once (None: chosen for ``images`` images per call, as ``lantern generate
        --streams auto``)."""
        from lantern_rt.pipeline import build_pipeline

        shape = dataclasses.replace(self.plan.shape, streams=streams)
        return build_pipeline(dataclasses.replace(self.plan, shape=shape, images=images))


def exported_job(plan: RunPlan, seed: int) -> tuple[SetJob, str]:
    """The job of a set of ``plan`` under ``seed``, and the digest of what it runs. A model
    directory that a backend of bundles runs is exported (into the cache) now, before any worker
    starts, and the workers run that bundle."""
    from lantern_rt.export_cache import model_fingerprint
    from lantern_rt.pipeline import exported

    plan = exported(plan)
    digest = model_fingerprint(plan.source) if plan.source_is_model else plan.source.manifest_sha256  # type: ignore[arg-type,union-attr]
    return SetJob(plan, seed), digest


def fingerprint(job: SetJob, digest: str, class_ids: list[int], num_images: int, unit_size: int) -> dict:
    """The settings a set's tokens (and shard layout) depend on; a resume must match them.
    The batch size, device threads and the number of workers are not among them."""
    return {
        "model_digest": digest,
        "backend": job.plan.backend,
        "method": job.plan.method.method,
        "method_params": job.plan.method.params(),
        "drafter": job.plan.method.drafter,
        "sampling": dataclasses.asdict(job.plan.sampling),
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
        pipe,
        [unit.label] * unit.count,
        job.plan.sampling,
        seed=job.seed,
        progress=False,
        start_index=unit.first,
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

        plan = job.plan
        if not plan.runs_on_gpu:
            torch.set_num_threads(max(1, plan.threads))
            job = dataclasses.replace(job, plan=dataclasses.replace(plan, threads=max(1, plan.threads)))
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
    if job.plan.threads:
        import torch

        torch.set_num_threads(job.plan.threads)
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
    gpu = job.plan.runs_on_gpu
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
