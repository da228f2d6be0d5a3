"""TensorRT plans for a bundle: built one graph at a time, kept in ``BUNDLE/engines/<key>/``.

The key names what a plan set is only valid for: the flavour (TensorRT or TensorRT for RTX,
:mod:`lantern_rt.engines.compat`) and its exact version, the precision, and where it runs: the
compute capabilities it was built for and, for TensorRT (which builds on the GPU that runs the
plans), that GPU's name; TensorRT for RTX builds ahead of time for a list of compute
capabilities, on any machine, and its plans run on any GPU of one of them. ``engines.json``
beside the plans holds one entry per plan (graph, file, sha256, the key's fields and the sha256
of the bundle's ``manifest.json``), so a plan set copied from another machine, built by another
flavour or version or for another export of the bundle is refused with the reason. Precision is
never a builder flag: networks are strongly typed, so an fp16 bundle gives fp16 plans and an int8
(Q/DQ) bundle int8 plans.

The key and refusal logic are pure functions over plain dicts; only :class:`PlanBuilder` needs a
TensorRT module, and only :func:`device_info` a GPU. Every function over a bundle takes the
opened :class:`~lantern_rt.bundle.Bundle` (its files, graph I/O and dtype were checked when it
was opened).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lantern_rt.bundle import WEIGHT_ONLY_DTYPES, Bundle
from lantern_rt.engines import compat
from lantern_rt.engines.compat import DEFAULT_WORKSPACE_MB, FLAVOURS, PRECISIONS, EngineError, Flavour
from lantern_rt.fileio import sha256, staged_folder

ENGINES_JSON = "engines.json"
FORMAT = "lantern-rt-engines"
FORMAT_VERSION = 2
KEY_FIELDS = ("flavour", "version", "precision", "gpu", "compute_capabilities")


def device_info(index: int | None = None) -> dict[str, str]:
    """Name and compute capability of a CUDA device (the current one by default)."""
    import torch

    if not torch.cuda.is_available():
        raise EngineError("TensorRT needs a CUDA GPU, and torch sees none (a CPU-only torch build?)")
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    return {"name": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}


def engine_key(
    flavour: str, version: str, precision: str, capabilities: Sequence[str], gpu: str | None = None
) -> dict[str, Any]:
    """What a plan set is valid for: built by ``flavour`` ``version`` from graphs of
    ``precision``, for GPUs of these compute ``capabilities`` (and only the GPU named ``gpu``,
    when given: TensorRT's plans)."""
    if precision not in PRECISIONS:
        raise EngineError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return {
        "flavour": flavour,
        "version": version,
        "precision": precision,
        "gpu": gpu,
        "compute_capabilities": list(capabilities),
    }


def machine(flavour: str, version: str, device: dict[str, str], precision: str) -> dict[str, str]:
    """What runs plans here: ``flavour`` ``version`` on ``device`` (:func:`device_info`'s dict),
    for a bundle of ``precision``."""
    return {
        "flavour": flavour,
        "version": version,
        "gpu": device["name"],
        "compute_capability": device["compute_capability"],
        "precision": precision,
    }


def key_slug(key: dict[str, Any]) -> str:
    """The key as a folder name, e.g. ``nvidia-jetson-orin-nano-sm87-trt10.3.0.30-fp16`` or
    ``sm86-sm89-trt-rtx1.7.1.116-int8``."""
    parts = [key["gpu"]] if key["gpu"] else []
    parts += [f"sm{cc.replace('.', '')}" for cc in key["compute_capabilities"]]
    parts += [f"{key['flavour']}{key['version']}", key["precision"]]
    return re.sub(r"[^a-z0-9.]+", "-", "-".join(parts).lower()).strip("-.")


def label(flavour: Any) -> str:
    """A flavour's name for messages (its own name when unknown)."""
    return FLAVOURS[flavour].label if flavour in FLAVOURS else f"TensorRT flavour {flavour!r}"


def describe(key: dict[str, Any]) -> str:
    """A plan set's key for messages: flavour and version, precision, where it runs."""
    ccs = ", ".join(map(str, key.get("compute_capabilities") or [])) or "?"
    where = f"{key['gpu']} (compute capability {ccs})" if key.get("gpu") else f"compute capability {ccs}"
    return f"{label(key.get('flavour'))} {key.get('version')}, {key.get('precision')}, for {where}"


def describe_machine(here: dict[str, str]) -> str:
    """:func:`machine`'s dict for messages."""
    return (
        f"{label(here['flavour'])} {here['version']} on {here['gpu']} (compute capability "
        f"{here['compute_capability']}), {here['precision']}"
    )


def mismatches(record: dict[str, Any], here: dict[str, str], manifest_sha256: str) -> list[str]:
    """Why a plan entry of ``engines.json`` cannot run ``here`` (:func:`machine`): [] when it can."""
    reasons = []
    built = f"{label(record.get('flavour'))} {record.get('version')}"
    if (record.get("flavour"), record.get("version")) != (here["flavour"], here["version"]):
        reasons.append(f"built with {built}, this is {label(here['flavour'])} {here['version']}")
    ccs = ", ".join(map(str, record.get("compute_capabilities") or []))
    this = f"{here['gpu']} ({here['compute_capability']})"
    if record.get("gpu") is not None and (record.get("gpu"), ccs) != (
        here["gpu"],
        here["compute_capability"],
    ):
        reasons.append(
            f"built on another GPU: {record.get('gpu')} (compute capability {ccs}), this one is {this}"
        )
    elif here["compute_capability"] not in (record.get("compute_capabilities") or []):
        reasons.append(f"built for compute capability {ccs or '?'}, and this GPU is {this}")
    if record.get("precision") != here["precision"]:
        reasons.append(f"{record.get('precision')} plans, not {here['precision']}")
    if record.get("bundle_manifest_sha256") != manifest_sha256:
        reasons.append("built for another bundle (its manifest.json differs from this bundle's)")
    return reasons


def check_plans(
    records: list[dict[str, Any]], here: dict[str, str], manifest_sha256: str, graphs: Iterable[str]
) -> dict[str, dict[str, Any]]:
    """``engines.json``'s entries by graph, after checking that each one can run ``here`` for
    this bundle and that every graph has one; :class:`EngineError` with the reason otherwise."""
    by_graph = {}
    for record in records:
        reasons = mismatches(record, here, manifest_sha256)
        if reasons:
            raise EngineError(f"the plan for {record.get('graph')} was {'; '.join(reasons)}")
        by_graph[record["graph"]] = record
    missing = [g for g in graphs if g not in by_graph]
    if missing:
        raise EngineError(f"no plan for graph(s) {', '.join(missing)}")
    return by_graph


def plan_record(
    graph: str, file: str, digest: str, key: dict[str, Any], manifest_sha256: str
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
    if not all(
        isinstance(p, dict)
        and {"graph", "file", "sha256", *KEY_FIELDS} <= p.keys()
        and isinstance(p["compute_capabilities"], list)
        for p in plans
    ):
        raise EngineError(f"{path} has an incomplete plan entry: rebuild the engines")
    return plans


def engines_folder(bundle: Bundle, key: dict[str, Any]) -> Path:
    """Where the plans of ``key`` live in ``bundle``."""
    return bundle.engines_dir / key_slug(key)


def plan_sets(bundle: Bundle) -> list[Path]:
    """The finished plan sets in ``bundle`` (folders with an ``engines.json``; not temporary ones)."""
    root = bundle.engines_dir
    if not root.is_dir():
        return []
    return sorted(p.parent for p in root.glob(f"*/{ENGINES_JSON}") if not p.parent.name.startswith("."))


def find_engines(bundle: Bundle, here: dict[str, str]) -> dict[str, Path]:
    """The plan of every graph of ``bundle`` (by graph name) in the first of its plan sets that
    runs ``here`` (:func:`machine`), each checked against its sha256; :class:`EngineError` saying
    why when there is no matching, complete, untouched set."""
    rebuild = f"build them on this machine with `lantern build-engines {bundle.path}`"
    others = []
    for folder in plan_sets(bundle):
        try:
            records = read_engines_json(folder)
        except EngineError as err:
            others.append(f"{folder.name} ({err})")
            continue
        reasons = mismatches(records[0], here, bundle.manifest_sha256) if records else ["empty"]
        if reasons:
            others.append(f"{folder.name} ({'; '.join(reasons)})")
            continue
        try:
            by_graph = check_plans(records, here, bundle.manifest_sha256, bundle.graphs)
        except EngineError as err:
            raise EngineError(f"{folder}: {err}: {rebuild}") from None
        plans = {}
        for graph, record in by_graph.items():
            path = folder / record["file"]
            if not path.is_file() or sha256(path) != record["sha256"]:
                raise EngineError(
                    f"{path} is missing or does not match its sha256 in {ENGINES_JSON}: {rebuild}"
                )
            plans[graph] = path
        return plans
    found = f"; it only has {', '.join(others)}" if others else ""
    raise EngineError(f"{bundle.path} has no engines for {describe_machine(here)}{found}: {rebuild}")


def choose_precision(bundle_prec: str, requested: str | None) -> str:
    """The precision to build: the bundle's. Asking for another is refused, since TensorRT takes
    precision from the graphs (strongly typed) and never converts them."""
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


def check_buildable(bundle: Bundle) -> None:
    """:class:`EngineError` naming the fix when TensorRT cannot build ``bundle``: its step graphs
    write the KV cache in place, its weights are onnxruntime's ``MatMulNBits``, or a graph holds
    what TensorRT's ONNX parser rejects (:func:`lantern_rt.graph_rules.tensorrt_problems`: the
    first graph's, in the parser's words)."""
    from lantern_rt.graph_rules import tensorrt_problems  # onnx: only for a build

    if bundle.constants.cache_scratch:
        what = "step graphs write the KV cache in place (opset 24, onnxruntime on the CPU)"
        fix = "export the model again without --cache-in-place"
    elif bundle.dtype in WEIGHT_ONLY_DTYPES:
        what = f"graphs are {bundle.dtype} (onnxruntime's MatMulNBits)"
        fix = (
            "build engines from the fp32 or fp16 bundle, or its Q/DQ int8 copy (lantern calibrate "
            "without --weights-only)"
        )
    else:
        what, fix = "", "export the model again"
    for name, entry in bundle.graphs.items():
        problems = tensorrt_problems(bundle.file(entry))
        if problems:
            what = what or "graphs hold what TensorRT's ONNX parser rejects"
            raise EngineError(
                f"this bundle's {what}, which TensorRT cannot build ({name}: {problems[0]}): {fix}"
            )
    if what:
        raise EngineError(f"this bundle's {what}, which TensorRT cannot build: {fix}")


class PlanBuilder:
    """Builds serialized plans from ONNX graphs with one flavour's builder: strongly typed
    networks, each graph's Ifs replaced by their then-branches (see
    :mod:`lantern_rt.engines.conditionals`), for ``capabilities`` (an ahead-of-time flavour:
    :func:`~lantern_rt.engines.compat.target_capabilities`'s list), with ``workspace_mb`` MiB of
    builder scratch and, for a flavour that takes one, a timing cache read from and written to
    ``timing_cache``."""

    def __init__(
        self,
        flavour: Flavour,
        capabilities: Sequence[str] = (),
        workspace_mb: int = DEFAULT_WORKSPACE_MB,
        timing_cache: Path | None = None,
    ):
        if workspace_mb < 1:
            raise EngineError(f"the workspace must be at least 1 MiB, not {workspace_mb}")
        if timing_cache is not None and not flavour.timing_cache:
            raise EngineError(
                f"{flavour.label} takes no timing cache (it builds ahead of time): drop --timing-cache"
            )
        self.flavour, self.trt = flavour, compat.require(flavour)
        self.capabilities = compat.target_capabilities(self.trt, flavour, capabilities)
        self.workspace_mb = workspace_mb
        self.logger = compat.make_logger(self.trt)
        self.builder = self.trt.Builder(self.logger)
        self.timing_cache = timing_cache
        self._cache = compat.open_timing_cache(self.builder, timing_cache) if flavour.timing_cache else None

    @property
    def version(self) -> str:
        return self.trt.__version__

    def build(self, onnx_path: Path) -> memoryview:
        """One serialized plan from the graph at ``onnx_path``; every parser error, or the
        builder's logged errors, in the :class:`EngineError` when it fails."""
        from lantern_rt.engines.conditionals import without_conditionals  # onnx: only for a build

        trt = self.trt
        network = self.builder.create_network(compat.network_flags(trt, self.flavour))
        parser = trt.OnnxParser(network, self.logger)
        with without_conditionals(onnx_path) as path:
            parsed = parser.parse_from_file(str(path))
        if not parsed:
            errors = [compat.parser_error_text(parser.get_error(i)) for i in range(parser.num_errors)]
            listed = "; ".join(f"({n}) {e}" for n, e in enumerate(errors, 1)) or "no error reported"
            raise EngineError(
                f"{self.flavour.label}'s ONNX parser rejected {onnx_path.name} ({len(errors)} errors): {listed}"
            )
        config = self.builder.create_builder_config()
        compat.set_workspace(trt, config, self.workspace_mb)
        if self.capabilities:
            compat.set_capabilities(trt, config, self.capabilities)
        if self._cache is not None:
            config.set_timing_cache(self._cache, False)
        self.logger.errors.clear()
        plan = self.builder.build_serialized_network(network, config)
        if plan is None:
            reason = (
                "; ".join(self.logger.errors)
                or "no reason logged (out of memory? try a smaller --workspace-mb)"
            )
            raise EngineError(f"{self.flavour.label} could not build {onnx_path.name}: {reason}")
        return memoryview(plan)

    def save_timing_cache(self) -> None:
        """Write the timing cache to its file, when there is one."""
        if self._cache is None or self.timing_cache is None:
            return
        try:
            compat.save_timing_cache(self._cache, self.timing_cache)
        except OSError as err:
            raise EngineError(
                f"cannot write the timing cache {self.timing_cache}: {err.strerror or err}"
            ) from None


def build_plan(
    onnx_path: Path,
    flavour: str = compat.TRT_RTX.name,
    capabilities: Sequence[str] = (),
    workspace_mb: int = DEFAULT_WORKSPACE_MB,
) -> bytes:
    """The serialized plan of one ONNX graph, built by ``flavour``'s real builder (TensorRT for
    RTX by default: ahead of time, no GPU needed, for ``capabilities``, default every one it
    builds lantern-rt's graphs for); :class:`EngineError` with the parser's or builder's
    reasons when it fails. See :class:`PlanBuilder` for the options."""
    builder = PlanBuilder(compat.flavour_named(flavour), capabilities, workspace_mb)
    return bytes(builder.build(Path(onnx_path)))


def build_engines(
    bundle: Bundle,
    flavour: str | None = None,
    capabilities: Sequence[str] = (),
    precision: str | None = None,
    workspace_mb: int = DEFAULT_WORKSPACE_MB,
    timing_cache: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Build one plan per graph of ``bundle`` into ``engines/<key>/`` and return that folder:
    with ``flavour`` (default: the one installed), on this GPU for TensorRT, ahead of time for
    ``capabilities`` for TensorRT for RTX (see :class:`PlanBuilder` for the other options).
    ``precision`` (default: the bundle's) must be the bundle's. Graphs are built one at a time
    in a temporary folder, renamed into place only when all succeed (replacing an older set of
    the same key); nothing is written when any check or build fails."""
    check_buildable(bundle)
    precision = choose_precision(bundle.dtype, precision)
    chosen = compat.choose_flavour(flavour)
    builder = PlanBuilder(chosen, capabilities, workspace_mb, timing_cache)
    if chosen.ahead_of_time:
        key = engine_key(chosen.name, builder.version, precision, builder.capabilities)
    else:
        device = device_info()
        key = engine_key(
            chosen.name, builder.version, precision, [device["compute_capability"]], device["name"]
        )
    root = bundle.engines_dir
    made_root = not root.exists()
    try:
        with staged_folder(engines_folder(bundle, key), "TensorRT plans", EngineError) as tmp:
            records = []
            for i, (graph, entry) in enumerate(bundle.graphs.items(), 1):
                if progress is not None:
                    progress(f"building {graph} ({i}/{len(bundle.graphs)}, {describe(key)})")
                plan = tmp / f"{graph}.plan"
                plan.write_bytes(builder.build(bundle.file(entry)))
                records.append(plan_record(graph, plan.name, sha256(plan), key, bundle.manifest_sha256))
            write_engines_json(tmp, records)
            builder.save_timing_cache()
    except BaseException:
        if made_root and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise
    return engines_folder(bundle, key)
