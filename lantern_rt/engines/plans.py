"""TensorRT plans for a bundle: built one graph at a time, kept in ``BUNDLE/engines/<key>/``.

The key names what a plan is only valid for: the GPU (name and compute capability), the exact
TensorRT version and the precision. ``engines.json`` beside the plans holds one entry per plan
(graph, file, sha256, the key's fields and the sha256 of the bundle's ``manifest.json``), so a
plan set copied from another machine, built by another TensorRT or for another export of the
bundle is refused with the reason. Precision is never a builder flag: networks are strongly
typed, so an fp16 bundle gives fp16 plans and an int8 (Q/DQ) bundle int8 plans.

The key and refusal logic are pure functions over plain dicts; only :func:`build_engines` needs
TensorRT, and only :func:`device_info` a GPU. Every function over a bundle takes the opened
:class:`~lantern_rt.bundle.Bundle` (its files, graph I/O and dtype were checked when it was opened).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lantern_rt.bundle import WEIGHT_ONLY_DTYPES, Bundle
from lantern_rt.engines import compat
from lantern_rt.engines.compat import DEFAULT_WORKSPACE_MB, PRECISIONS, EngineError
from lantern_rt.fileio import sha256, staged_folder

ENGINES_JSON = "engines.json"
FORMAT = "lantern-rt-engines"
FORMAT_VERSION = 1
KEY_FIELDS = ("gpu", "compute_capability", "tensorrt", "precision")


def device_info(index: int | None = None) -> dict[str, str]:
    """Name and compute capability of a CUDA device (the current one by default)."""
    import torch

    if not torch.cuda.is_available():
        raise EngineError("TensorRT needs a CUDA GPU, and torch sees none (a CPU-only torch build?)")
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    return {"name": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}


def engine_key(device: dict[str, str], tensorrt_version: str, precision: str) -> dict[str, str]:
    """What a plan set is valid for, from :func:`device_info`'s dict and ``tensorrt.__version__``."""
    if precision not in PRECISIONS:
        raise EngineError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return {
        "gpu": device["name"],
        "compute_capability": device["compute_capability"],
        "tensorrt": tensorrt_version,
        "precision": precision,
    }


def key_slug(key: dict[str, str]) -> str:
    """The key as a folder name, e.g. ``nvidia-jetson-orin-nano-sm87-trt10.3.0.30-fp16``."""
    cc = key["compute_capability"].replace(".", "")
    text = f"{key['gpu']}-sm{cc}-trt{key['tensorrt']}-{key['precision']}"
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")


def describe(key: dict[str, Any]) -> str:
    """A key for messages: GPU (compute capability), TensorRT version, precision."""
    return (
        f"{key.get('gpu')} (compute capability {key.get('compute_capability')}), "
        f"TensorRT {key.get('tensorrt')}, {key.get('precision')}"
    )


def mismatches(record: dict[str, Any], key: dict[str, str], manifest_sha256: str) -> list[str]:
    """Why a plan entry of ``engines.json`` cannot run here: [] when it can."""
    reasons = []
    if (record.get("gpu"), record.get("compute_capability")) != (key["gpu"], key["compute_capability"]):
        reasons.append(
            f"built on another GPU: {record.get('gpu')} (compute capability "
            f"{record.get('compute_capability')}), this one is {key['gpu']} ({key['compute_capability']})"
        )
    if record.get("tensorrt") != key["tensorrt"]:
        reasons.append(f"built with TensorRT {record.get('tensorrt')}, this is TensorRT {key['tensorrt']}")
    if record.get("precision") != key["precision"]:
        reasons.append(f"{record.get('precision')} plans, not {key['precision']}")
    if record.get("bundle_manifest_sha256") != manifest_sha256:
        reasons.append("built for another bundle (its manifest.json differs from this bundle's)")
    return reasons


def check_plans(
    records: list[dict[str, Any]], key: dict[str, str], manifest_sha256: str, graphs: Iterable[str]
) -> dict[str, dict[str, Any]]:
    """``engines.json``'s entries by graph, after checking that each one matches ``key`` and the
    bundle and that every graph has one; :class:`EngineError` with the reason otherwise."""
    by_graph = {}
    for record in records:
        reasons = mismatches(record, key, manifest_sha256)
        if reasons:
            raise EngineError(f"the plan for {record.get('graph')} was {'; '.join(reasons)}")
        by_graph[record["graph"]] = record
    missing = [g for g in graphs if g not in by_graph]
    if missing:
        raise EngineError(f"no plan for graph(s) {', '.join(missing)}")
    return by_graph


def plan_record(
    graph: str, file: str, digest: str, key: dict[str, str], manifest_sha256: str
) -> dict[str, Any]:
    """One ``engines.json`` entry."""
    return {"graph": graph, "file": file, "sha256": digest, **key, "bundle_manifest_sha256": manifest_sha256}


def write_engines_json(folder: Path, records: list[dict[str, Any]]) -> None:
    """Write ``folder/engines.json`` with these plan entries."""
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, "plans": records}
    (folder / ENGINES_JSON).write_text(json.dumps(body, indent=1) + "\n")


def read_engines_json(folder: Path) -> list[dict[str, Any]]:
    """The plan entries of ``folder/engines.json``; :class:`EngineError` when it is malformed."""
    path = folder / ENGINES_JSON
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise EngineError(f"cannot read {path}: {err}") from None
    if not isinstance(body, dict):
        body = {}
    plans = body.get("plans")
    if (
        body.get("format") != FORMAT
        or body.get("format_version") != FORMAT_VERSION
        or not isinstance(plans, list)
    ):
        raise EngineError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} file: rebuild the engines")
    if not all(isinstance(p, dict) and {"graph", "file", "sha256", *KEY_FIELDS} <= p.keys() for p in plans):
        raise EngineError(f"{path} has an incomplete plan entry: rebuild the engines")
    return plans


def engines_folder(bundle: Bundle, key: dict[str, str]) -> Path:
    """Where the plans of ``key`` live in ``bundle``."""
    return bundle.engines_dir / key_slug(key)


def plan_sets(bundle: Bundle) -> list[Path]:
    """The finished plan sets in ``bundle`` (folders with an ``engines.json``; not temporary ones)."""
    root = bundle.engines_dir
    if not root.is_dir():
        return []
    return sorted(p.parent for p in root.glob(f"*/{ENGINES_JSON}") if not p.parent.name.startswith("."))


def find_engines(bundle: Bundle, key: dict[str, str]) -> dict[str, Path]:
    """The plan of every graph of ``bundle`` (by graph name) for ``key``, each checked against its
    sha256; :class:`EngineError` saying why when there is no matching, complete, untouched set."""
    rebuild = f"build them on this machine with `lantern build-engines {bundle.path}`"
    folder = engines_folder(bundle, key)
    if not (folder / ENGINES_JSON).is_file():
        others = []
        for other in plan_sets(bundle):
            try:
                records = read_engines_json(other)
            except EngineError:
                records = []
            reasons = mismatches(records[0], key, bundle.manifest_sha256) if records else ["unreadable"]
            others.append(f"{other.name} ({'; '.join(reasons)})")
        found = f"; it only has {', '.join(others)}" if others else ""
        raise EngineError(f"{bundle.path} has no TensorRT engines for {describe(key)}{found}: {rebuild}")
    try:
        by_graph = check_plans(read_engines_json(folder), key, bundle.manifest_sha256, bundle.graphs)
    except EngineError as err:
        raise EngineError(f"{folder}: {err}: {rebuild}") from None
    plans = {}
    for graph, record in by_graph.items():
        path = folder / record["file"]
        if not path.is_file() or sha256(path) != record["sha256"]:
            raise EngineError(f"{path} is missing or does not match its sha256 in {ENGINES_JSON}: {rebuild}")
        plans[graph] = path
    return plans


def choose_precision(bundle_prec: str, requested: str | None) -> str:
    """The precision to build: the bundle's. Asking for another is refused, since TensorRT takes
    precision from the graphs (strongly typed) and never converts them."""
    if bundle_prec in WEIGHT_ONLY_DTYPES:
        raise EngineError(
            f"this bundle's graphs are {bundle_prec} (onnxruntime's MatMulNBits), which TensorRT "
            "cannot build: build engines from the fp32 bundle, or its Q/DQ int8 copy (lantern "
            "calibrate without --weights-only)"
        )
    if requested is None or requested == bundle_prec:
        return bundle_prec
    how = {
        "fp32": "export it with --dtype fp32",
        "fp16": "export it with --dtype fp16",
        "int8": "quantize it to Q/DQ (int8) graphs",
    }.get(requested, f"choose one of {', '.join(PRECISIONS)}")
    raise EngineError(
        f"this bundle's graphs are {bundle_prec}, so its engines are {bundle_prec} (TensorRT builds "
        f"strongly typed, precision comes from the graphs): for {requested} engines, {how}"
    )


def build_engines(
    bundle: Bundle,
    precision: str | None = None,
    workspace_mb: int = DEFAULT_WORKSPACE_MB,
    timing_cache: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Build one plan per graph of ``bundle`` on this GPU into ``engines/<key>/`` and return that
    folder. ``precision`` (default: the bundle's) must be the bundle's. Graphs are built one at a
    time in a temporary folder, renamed into place only when all succeed (replacing an older set
    of the same key); ``timing_cache`` is read when it exists and written after the build."""
    if bundle.constants.cache_scratch:
        raise EngineError(
            "this bundle's step graphs write the KV cache in place (opset 24, onnxruntime on the "
            "CPU), which TensorRT cannot build: export the model again without --cache-in-place"
        )
    precision = choose_precision(bundle.dtype, precision)
    if workspace_mb < 1:
        raise EngineError(f"the workspace must be at least 1 MiB, not {workspace_mb}")
    trt = compat.require_tensorrt()
    key = engine_key(device_info(), trt.__version__, precision)
    root = bundle.engines_dir
    made_root = not root.exists()
    try:
        with staged_folder(engines_folder(bundle, key), "TensorRT plans", EngineError) as tmp:
            logger = compat.make_logger(trt)
            builder = trt.Builder(logger)
            cache = compat.open_timing_cache(builder, timing_cache)
            records = []
            for i, (graph, entry) in enumerate(bundle.graphs.items(), 1):
                if progress is not None:
                    progress(f"building {graph} ({i}/{len(bundle.graphs)}, {describe(key)})")
                plan = tmp / f"{graph}.plan"
                plan.write_bytes(build_plan(trt, builder, logger, bundle.file(entry), workspace_mb, cache))
                records.append(plan_record(graph, plan.name, sha256(plan), key, bundle.manifest_sha256))
            write_engines_json(tmp, records)
            if timing_cache is not None:
                _save_timing_cache(cache, timing_cache)
    except BaseException:
        if made_root and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise
    return engines_folder(bundle, key)


def build_plan(
    trt: Any, builder: Any, logger: Any, onnx_path: Path, workspace_mb: int, cache: Any
) -> memoryview:
    """One serialized plan from one ONNX graph, strongly typed, its Ifs replaced by their
    then-branches (see :mod:`lantern_rt.engines.conditionals`); every parser error, or the
    builder's logged errors, in the :class:`EngineError` when it fails."""
    from lantern_rt.engines.conditionals import without_conditionals  # onnx: only for a build

    network = builder.create_network(compat.network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    with without_conditionals(onnx_path) as path:
        parsed = parser.parse_from_file(str(path))
    if not parsed:
        errors = [compat.parser_error_text(parser.get_error(i)) for i in range(parser.num_errors)]
        listed = "; ".join(f"({n}) {e}" for n, e in enumerate(errors, 1)) or "no error reported"
        raise EngineError(
            f"TensorRT's ONNX parser rejected {onnx_path.name} ({len(errors)} errors): {listed}"
        )
    config = builder.create_builder_config()
    compat.set_workspace(trt, config, workspace_mb)
    config.set_timing_cache(cache, False)
    logger.errors.clear()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        reason = "; ".join(logger.errors) or "no reason logged"
        raise EngineError(
            f"TensorRT could not build {onnx_path.name}: {reason} (out of memory? try a smaller --workspace-mb)"
        )
    return memoryview(plan)


def _save_timing_cache(cache: Any, path: Path) -> None:
    try:
        compat.save_timing_cache(cache, path)
    except OSError as err:
        raise EngineError(f"cannot write the timing cache {path}: {err.strerror or err}") from None
