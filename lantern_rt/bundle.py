"""The bundle: fixed-shape ONNX graphs, ``manifest.json`` and the neighbour table, the contract
between the exporter and every engine.

The exporter (:mod:`lantern_rt.export`) and calibration write bundles through
:func:`staged_bundle` and :func:`write_manifest`; everyone else reads one through
:meth:`Bundle.open`, which checks the manifest against its schema, every file against its sha256,
every graph's declared inputs and outputs against its ONNX file and the dtypes the runtime feeds
and reads, what the manifest states of the model against those graphs, and the manifest against its own digest (``manifest_digest``), once.
The digest catches accidental edits, not deliberate ones: it is not a signature. The :class:`Bundle`
it returns is passed down to backends, engines, calibration and the benchmark, which trust it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from lantern_rt.errors import LanternError
from lantern_rt.fileio import sha256, staged_folder
from lantern_rt.graph_spec import TensorSpec
from lantern_rt.models.config import ConfigError, GPTConfig, config_from_dict
from lantern_rt.models.model_dir import check_sampling_defaults
from lantern_rt.models.neighbors import load_neighbors_file
from lantern_rt.models.sampling_config import setting_types

FORMAT = "lantern-rt-bundle"
# what each version added: docs/bundle-format.md, "Bundle versions"
BUNDLE_VERSION = 16
MANIFEST = "manifest.json"
DIGEST = "manifest_digest"  # sha256 of the manifest's canonical JSON without this key (manifest_digest)
NULL_CAPTION = "null_caption.npy"
NEIGHBORS = "neighbors.npy"
WEIGHTS = "weights.bin"  # every graph's large initializers, once each (export.shared_weights)
ENGINES_DIR = "engines"  # TensorRT plans, per GPU and TensorRT version (not part of the bundle's files)
DRAFT_GRAPH_PREFIX = "draft_tree_"
VERIFY_GRAPH_PREFIX = "target_verify_"
AR_STEP_GRAPH = "target_ar_step"  # AR: one token verified as the root-only tree (its sampling step)
PREFILL_GRAPH = "target_prefill"
DRAFTER_PREFILL_GRAPH = "drafter_prefill"  # the drafter over a multi-slot prefix (captions)
TEXT_ENCODER_GRAPH = "text_encoder"  # prompt token ids -> caption features (text-conditional)
VQ_DECODE_GRAPH = "vq_decode"
# The graphs a decode calls once per image (or prompt), not once per step
PER_IMAGE_GRAPHS = (PREFILL_GRAPH, DRAFTER_PREFILL_GRAPH, TEXT_ENCODER_GRAPH, VQ_DECODE_GRAPH)

# The dtype of each graph input the runtime builds and output it reads, by name, in every bundle
# whatever its precision: a graph declaring another is refused on open (:func:`_check_dtypes`),
# not by the runner at its first call. ``hidden`` and the caches (``past_*``, ``new_*``,
# ``present_*``) are in a graph's compute dtype instead; ``cond`` is in CONDITION_DTYPES.
RUNTIME_DTYPES = {
    **dict.fromkeys(
        ("node_tokens", "tokens", "cache_length", "root_position", "count", "length", "kept"), "int64"
    ),
    **dict.fromkeys(("neighbors", "k", "codes", "ids", "mask"), "int64"),
    **dict.fromkeys(("prefix", "valid", "greedy"), "bool"),
    **dict.fromkeys(("q", "noise", "bonus_noise"), "float32"),
    **{name: "int64" if kind is int else "float32" for name, kind in setting_types().items()},
    **dict.fromkeys(("cap_a", "cap_b", "logits", "probs", "images", "features"), "float32"),
}
# ``cond`` by the model's kind (gpt.model_type): class ids, T5 caption features (fp32 at every precision),
# prompt token ids
CONDITION_DTYPES = {"c2i": "int64", "t2i": "float32", "chameleon": "int64"}


class BundleError(LanternError, ValueError):
    """A bundle is missing, tampered with, malformed, or from another bundle version."""


def batched_name(name: str, batch: int) -> str:
    """The name of graph ``name``'s copy for ``batch`` images per call (batch 1 keeps the name)."""
    return name if batch == 1 else f"{name}_b{batch}"


def windowed_name(name: str, window: int, capacity: int) -> str:
    """The name of target step graph ``name``'s copy reading ``window`` of the cache's
    ``capacity`` slots (the whole cache keeps the name; docs/method.md §12)."""
    return name if window == capacity else f"{name}_w{window}"


def window_needed(cls_token_num: int, tokens: int, max_depth: int) -> int:
    """The slots a step must see (and may write) for an image with ``tokens`` image tokens
    committed: its condition prefix, those tokens (the last one, pending, is written by the
    step), the accepted path of a tree of ``max_depth`` and the spare last slot
    (:meth:`~lantern_rt.runtime.kv_cache.KVCache.write`)."""
    return cls_token_num + max(tokens, 1) + max_depth + 1


def paths_depth(paths: Sequence[Sequence[int]]) -> int:
    """A tree's depth from its paths as a manifest lists them (0: the root alone, AR's step)."""
    return max((len(path) for path in paths), default=0)


def step_windows(windows: Sequence[int], cls_token_num: int, max_depth: int) -> tuple[int, ...]:
    """The ``windows`` a step over a tree of ``max_depth`` can read (a bundle holds its graph for
    these alone): those that fit its first step (:func:`window_needed`), and the whole cache."""
    first = window_needed(cls_token_num, 1, max_depth)
    return tuple(w for w in windows if w >= first or w == windows[-1])


def draft_graph_name(index: int) -> str:
    """The name of the drafting graph of a bundle's ``index``-th tree."""
    return f"{DRAFT_GRAPH_PREFIX}{index}"


def verify_graph_name(index: int) -> str:
    """The name of the verify graph (target step and acceptance) of a bundle's ``index``-th tree."""
    return f"{VERIFY_GRAPH_PREFIX}{index}"


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the bundle: its ONNX file and its inputs and outputs, in call order."""

    name: str
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        """The declared input called ``name``."""
        return next(spec for spec in self.inputs if spec.name == name)

    @property
    def drafting(self) -> bool:
        """Whether this is a drafting graph (the drafter's catch-up and every tree level)."""
        return self.name.startswith(DRAFT_GRAPH_PREFIX)

    @property
    def per_image(self) -> bool:
        """Whether a decode calls it once per image, not per step (:data:`PER_IMAGE_GRAPHS`, at
        any batch size)."""
        return re.sub(r"_b\d+$", "", self.name) in PER_IMAGE_GRAPHS


@dataclass(frozen=True)
class TreeEntry:
    """A tree the bundle was exported for: its paths, the graph that drafts it and the graph that
    verifies and accepts it (``graph`` None when the model has no drafter: a chain's verify graph
    still serves a Jacobi window, docs/method.md §11)."""

    name: str
    paths: tuple[tuple[int, ...], ...]
    graph: str | None
    verify: str | None


@dataclass(frozen=True)
class Constants:
    """The fixed sizes every runtime needs (the manifest's ``constants``)."""

    model_type: str
    cls_token_num: int
    block_size: int
    grid_size: int
    cache_capacity: int
    vocab_size: int
    hidden_size: int
    drafter: bool
    drafter_capacity: int
    max_draft_width: int
    batch_sizes: tuple[int, ...]  # images per call the graphs were exported for
    cache_windows: tuple[int, ...]  # the target cache windows its step graphs read (slots, ascending)
    guided: bool  # 2B CFG rows per call; False: B rows, CFG scales of at most 1 only (method.md §13)
    cache_scratch: int  # > 0: the target's steps write their K/V into the cache in place (method.md §6)
    drafter_scratch: int  # > 0: the drafting calls write theirs into the drafter's cache in place
    neighbors_file: str
    neighbors_k: int
    null_condition: dict[str, Any]  # what a run's unconditional row is, as the model's family writes it


class Bundle:
    """An opened, verified bundle. Build one with :meth:`Bundle.open`."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        """``manifest`` must have passed :func:`parse_manifest`'s checks (use :meth:`open`)."""
        self.path = path
        self._manifest = manifest
        self.format_version: int = manifest["bundle_version"]
        self.dtype: str = manifest["dtype"]
        self.opset: int = manifest["opset"]
        self.versions: dict[str, str] = dict(manifest["versions"])
        self.model_name: str = manifest["model_name"]
        self.class_names: list[str] = list(manifest["class_names"])
        self.image_size: int = manifest["image_size"]
        self.sampling_defaults: dict[str, Any] = dict(manifest["sampling_defaults"])
        self.files: dict[str, str] = dict(manifest["files"])
        self.constants = _constants(manifest["constants"])
        self.graphs: dict[str, GraphEntry] = {
            name: GraphEntry(
                name,
                entry["file"],
                tuple(_io_spec(s) for s in entry["inputs"]),
                tuple(_io_spec(s) for s in entry["outputs"]),
            )
            for name, entry in manifest["graphs"].items()
        }
        self.trees: dict[str, TreeEntry] = {
            name: TreeEntry(tree["name"], tuple(map(tuple, tree["paths"])), tree["graph"], tree["verify"])
            for name, tree in manifest["trees"].items()
        }
        self.gpt: GPTConfig = config_from_dict(GPTConfig, manifest["gpt"])
        self.vq_section: dict[str, Any] = dict(manifest["vq"])  # its family reads it (families.loading)
        self.family: str = manifest["family"]  # the model family that wrote it (lantern_rt.families)
        text = manifest.get("text_encoder")
        self.text_max_length: int | None = text["max_length"] if text else None
        self.manifest_sha256 = sha256(path / MANIFEST)
        self._neighbors: Tensor | None = None

    @classmethod
    def open(cls, path: str | Path, check: Callable[[Bundle], Any] | None = None) -> Bundle:
        """Open the bundle at ``path`` after checking its manifest's schema and version, every
        file's sha256, every graph's declared I/O against its ONNX file and the dtypes the runtime feeds and reads
        (:func:`_check_dtypes`), the sizes, trees and classes the manifest states against those
        graphs (:func:`_check_sizes`), then ``check(bundle)``
        (what a reader above this layer reads: ``families.loading.open_bundle``), and last the
        manifest's own digest; :class:`BundleError` says what is wrong."""
        path = Path(path).resolve()
        raw = _read_manifest(path)
        edited = isinstance(raw, dict) and raw.get(DIGEST) != manifest_digest(raw)
        manifest = parse_manifest(raw, path)
        _check_files(path, manifest)
        try:
            bundle = cls(path, manifest)
        except ConfigError as err:  # gpt fields the config refuses
            raise BundleError(f"{path}: {err}") from None
        _check_dtypes(bundle)
        _check_sizes(bundle)
        if check is not None:
            check(bundle)
        if edited:  # last: an edit the checks above catch is named by them
            raise BundleError(f"{path}: {MANIFEST} was edited (its {DIGEST} does not match): re-export")
        return bundle

    def manifest(self) -> dict[str, Any]:
        """A copy of the manifest as JSON data (for writers that derive a new bundle from this one)."""
        return copy.deepcopy(self._manifest)

    @property
    def has_drafter(self) -> bool:
        return self.constants.drafter

    @property
    def engines_dir(self) -> Path:
        """Where TensorRT plans for this bundle live (see :mod:`lantern_rt.engines.plans`)."""
        return self.path / ENGINES_DIR

    def batch(self, size: int) -> BatchGraphs:
        """Its graphs for ``size`` images per call; :class:`BundleError` naming the export command
        when the graphs were not exported for that batch size (the one check of a bundle's batch
        size: runtimes take the :class:`BatchGraphs` it returns)."""
        sizes = self.constants.batch_sizes
        if size not in sizes:
            listed = ",".join(map(str, sorted({*sizes, size})))
            hint = f": re-export it with `lantern export --batch-size {listed}`" if size >= 1 else ""
            raise BundleError(
                f"bundle {self.path} has graphs for batch sizes {', '.join(map(str, sizes))}, not {size}{hint}"
            )
        return BatchGraphs(self, size)

    def graph(self, name: str) -> GraphEntry:
        """The graph called ``name``; :class:`BundleError` naming the ones it has otherwise."""
        entry = self.graphs.get(name)
        if entry is None:
            raise BundleError(f"{self.path} has no graph {name!r}; it has {', '.join(self.graphs)}")
        return entry

    def file(self, entry: GraphEntry) -> Path:
        """The ONNX file of a graph."""
        return self.path / entry.file

    def neighbors(self, k: int | None = None) -> Tensor:
        """The latent-neighbour table [V, k] as int64 on the CPU: all its columns, or the first
        ``k`` (:class:`BundleError` when it stores fewer). Read once."""
        if self._neighbors is None:
            file = self.path / self.constants.neighbors_file
            self._neighbors = load_neighbors_file(file, self.constants.vocab_size)
        table = self._neighbors
        if k is None:
            return table
        if table.shape[1] < k:
            raise BundleError(
                f"bundle {self.path} stores {table.shape[1]} neighbours per code, fewer than k={k}"
            )
        return table[:, :k]


@dataclass(frozen=True)
class BatchGraphs:
    """A bundle's graphs for ``size`` images per call, a batch size it was exported for (made
    by :meth:`Bundle.batch`, which checks that)."""

    bundle: Bundle
    size: int

    def graph(self, name: str) -> GraphEntry:
        """The ``size``-image variant of graph ``name`` (see :func:`batched_name`)."""
        return self.bundle.graph(batched_name(name, self.size))


def _read_manifest(path: Path) -> Any:
    file = path / MANIFEST
    if not file.is_file():
        raise BundleError(f"{path} is not a lantern-rt bundle: no {MANIFEST}")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BundleError(f"{file} is not valid JSON: {err}") from None
    except OSError as err:
        raise BundleError(f"cannot read {file}: {err.strerror or err}") from None


def _check_files(path: Path, manifest: dict[str, Any]) -> None:
    """Every listed file present and matching its sha256; every graph's I/O as its ONNX file declares."""
    for name, digest in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise BundleError(f"{path}: {name} is missing")
        if sha256(file) != digest:
            raise BundleError(f"{path}: {name} does not match its sha256 in {MANIFEST} (modified?)")
    for name, graph in manifest["graphs"].items():
        inputs, outputs = io_specs(path / graph["file"])
        if inputs != graph["inputs"] or outputs != graph["outputs"]:
            raise BundleError(f"{path}: graph {name}'s inputs/outputs differ from {MANIFEST}")


def _check_dtypes(bundle: Bundle) -> None:
    """Every graph input and output the runtime feeds or reads (:data:`RUNTIME_DTYPES`,
    :data:`CONDITION_DTYPES`) declared in the dtype it has there."""
    condition = CONDITION_DTYPES[bundle.gpt.model_type]
    for entry in bundle.graphs.values():
        for io, specs, verb in (("input", entry.inputs, "feeds"), ("output", entry.outputs, "reads")):
            for spec in specs:
                wanted = condition if spec.name == "cond" else RUNTIME_DTYPES.get(spec.name)
                if wanted is not None and spec.dtype != wanted:
                    raise BundleError(
                        f"{bundle.path}: graph {entry.name} declares {io} {spec.name} as {spec.dtype}, "
                        f"and the runtime {verb} it as {wanted}: re-export the bundle"
                    )


def _check_sizes(bundle: Bundle) -> None:
    """What the manifest states of the model (its sizes, trees, batch sizes and classes) against
    what its graphs declare: their inputs and outputs (checked against their ONNX files) and the
    class table a class-conditional prefill reads. A manifest edited and its digest recomputed
    is refused here in one line, not by a graph call or an engine's out-of-bounds read."""
    c, gpt = bundle.constants, bundle.gpt
    rows = 2 if c.guided else 1  # CFG rows per image
    # (what the manifest states, its value, graph, "inputs"/"outputs", tensor, axis)
    sizes: list[tuple[str, int, str, str, str, int]] = [
        ("constants.block_size", c.block_size, VQ_DECODE_GRAPH, "inputs", "codes", 1),
        ("image_size", bundle.image_size, VQ_DECODE_GRAPH, "outputs", "images", 2),
        ("image_size", bundle.image_size, VQ_DECODE_GRAPH, "outputs", "images", 3),
    ]
    for b in c.batch_sizes:
        prefill, step = batched_name(PREFILL_GRAPH, b), batched_name(AR_STEP_GRAPH, b)
        sizes += [
            ("rows per call (constants.batch_sizes, guided)", rows * b, prefill, "inputs", "prefix", 0),
            ("constants.cls_token_num", c.cls_token_num, prefill, "inputs", "prefix", 1),
            ("constants.vocab_size", c.vocab_size, prefill, "outputs", "logits", 1),
            ("constants.hidden_size", c.hidden_size, prefill, "outputs", "hidden", 2),
            (
                "constants.cache_capacity + cache_scratch",
                c.cache_capacity + c.cache_scratch,
                step,
                "inputs",
                "past_k_0",
                2,
            ),
        ]
        for tree in bundle.trees.values():
            nodes, depth = len(tree.paths) + 1, paths_depth(tree.paths)
            named = f"trees.{tree.name}"
            if tree.graph is not None:
                draft = batched_name(tree.graph, b)
                inner = 1 + sum(len(p) < depth for p in tree.paths)  # nodes that draw children
                sizes += [
                    (f"{named}'s nodes", nodes, draft, "outputs", "node_tokens", 1),
                    (f"{named}'s depth + 1", depth + 1, draft, "inputs", "tokens", 1),
                    (f"{named}'s nodes above its last level", inner, draft, "inputs", "noise", 1),
                    (
                        "constants.drafter_capacity + drafter_scratch",
                        c.drafter_capacity + c.drafter_scratch,
                        draft,
                        "inputs",
                        "past_k_0",
                        2,
                    ),
                ]
            if tree.verify is not None:
                verify = batched_name(tree.verify, b)
                sizes += [
                    (f"{named}'s nodes", nodes, verify, "inputs", "node_tokens", 1),
                    (f"{named}'s depth + 1", depth + 1, verify, "outputs", "kept", 1),
                ]
    for field, value, graph, io, tensor, axis in sizes:
        entry = bundle.graph(graph)
        spec = next((t for t in getattr(entry, io) if t.name == tensor), None)
        declared = None if spec is None or axis >= len(spec.shape) else spec.shape[axis]
        if declared != value:
            raise BundleError(
                f"{bundle.path}: {MANIFEST} gives {field} as {value}, and graph {graph} declares "
                f"{declared} ({tensor}, axis {axis}): re-export the bundle"
            )
    for field in ("model_type", "vocab_size", "block_size", "grid_size", "cls_token_num"):
        if getattr(gpt, field) != getattr(c, field):
            raise BundleError(
                f"{bundle.path}: {MANIFEST} gives gpt.{field} as {getattr(gpt, field)!r} and "
                f"constants.{field} as {getattr(c, field)!r}: re-export the bundle"
            )
    _check_classes(bundle)


def _check_classes(bundle: Bundle) -> None:
    """A class-conditional bundle's ``gpt.num_classes`` against the rows of the class table its
    prefill graph reads: the classes, then the null class when ``class_dropout_prob`` is above 0
    (:class:`~lantern_rt.models.target.LabelEmbedder`). Which id a run's unconditional row uses
    is the family's to check, where it reads its own ``null_condition``."""
    prefill = bundle.graph(batched_name(PREFILL_GRAPH, bundle.constants.batch_sizes[0]))
    cond = next((spec for spec in prefill.inputs if spec.name == "cond"), None)
    table = class_table_rows(bundle.file(prefill)) if cond is not None and len(cond.shape) == 1 else None
    if table is None:  # not class ids, or no table read straight from them
        return
    gpt = bundle.gpt
    if table != gpt.num_classes + int(gpt.class_dropout_prob > 0):
        raise BundleError(
            f"{bundle.path}: {MANIFEST} gives gpt.num_classes as {gpt.num_classes} (class_dropout_prob "
            f"{gpt.class_dropout_prob}), and graph {prefill.name}'s class table has {table} rows: "
            "re-export the bundle"
        )


def class_table_rows(path: Path) -> int | None:
    """Rows of the table an ONNX prefill graph gathers its ``cond`` input's ids from (an
    initializer; its data is not read), or None when no Gather reads ``cond`` so."""
    import onnx  # only where a graph file is read

    graph = onnx.load(str(path), load_external_data=False).graph
    tables = {t.name: t.dims for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Gather" and list(node.input[1:2]) == ["cond"] and node.input[0] in tables:
            return int(tables[node.input[0]][0])
    return None


def io_specs(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An ONNX graph's declared inputs and outputs in the manifest's form (name, shape, dtype)."""
    import onnx  # only where a graph file is read

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as err:  # onnx raises DecodeError and others for a corrupt file
        raise BundleError(f"{path} is not a readable ONNX graph ({type(err).__name__})") from None

    def as_dict(value: Any) -> dict[str, Any]:
        t = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        return {"name": value.name, "shape": [d.dim_value for d in t.shape.dim], "dtype": dtype}

    return [as_dict(v) for v in graph.input], [as_dict(v) for v in graph.output]


# -- the schema ---------------------------------------------------------------------------------

_INT, _STR, _BOOL, _DICT, _LIST = int, str, bool, dict, list
_TOP = {
    "format": _STR,
    "bundle_version": _INT,
    "versions": _DICT,
    "opset": _INT,
    "dtype": _STR,
    "model_name": _STR,
    "family": _STR,
    "gpt": _DICT,
    "vq": _DICT,
    "class_names": _LIST,
    "image_size": _INT,
    "constants": _DICT,
    "sampling_defaults": _DICT,
    "trees": _DICT,
    "graphs": _DICT,
    "files": _DICT,
}
_CONSTANTS = {
    "model_type": _STR,
    "cls_token_num": _INT,
    "block_size": _INT,
    "grid_size": _INT,
    "cache_capacity": _INT,
    "vocab_size": _INT,
    "hidden_size": _INT,
    "drafter": _BOOL,
    "drafter_capacity": _INT,
    "max_draft_width": _INT,
    "batch_sizes": _LIST,
    "cache_windows": _LIST,
    "guided": _BOOL,
    "cache_scratch": _INT,
    "drafter_scratch": _INT,
    "neighbors": _DICT,
    "null_condition": _DICT,
}
_GRAPH = {"file": _STR, "inputs": _LIST, "outputs": _LIST}
_IO = {"name": _STR, "shape": _LIST, "dtype": _STR}
_TREE = {"name": _STR, "paths": _LIST}
# onnxruntime's MatMulNBits, no TensorRT engines: every weight product's weights, or the
# drafter's alone (its target fp32)
WEIGHT_ONLY_DTYPES = ("int8-weights", "int4-weights", "int8-drafter", "int4-drafter")
# TensorRT's weight-only form: int8/int4 weights behind block-wise DequantizeLinear, fp16 activations
TENSORRT_WEIGHT_ONLY_DTYPES = ("w8a16", "w4a16")
DTYPES = ("fp32", "fp16", "int8", *WEIGHT_ONLY_DTYPES, *TENSORRT_WEIGHT_ONLY_DTYPES)
_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", dict: "an object", list: "a list"}


def parse_manifest(manifest: Any, where: Path | str = "the manifest") -> dict[str, Any]:
    """``manifest`` after checking it against the bundle schema (every field every reader
    uses, with its type): :class:`BundleError` naming the first field that is wrong."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{where} is not a {FORMAT} manifest")
    if manifest.get("bundle_version") != BUNDLE_VERSION:
        raise BundleError(
            f"{where} is bundle version {manifest.get('bundle_version')}; this lantern-rt reads "
            f"version {BUNDLE_VERSION}: re-export it"
        )
    check = _checker(where)
    check(manifest, _TOP, "")
    if manifest["dtype"] not in DTYPES:
        raise BundleError(f"{where}: dtype {manifest['dtype']!r} is none of {', '.join(DTYPES)}")
    try:
        check_sampling_defaults(where, manifest)
    except ConfigError as exc:
        raise BundleError(str(exc)) from None
    check(manifest["constants"], _CONSTANTS, "constants.")
    c = manifest["constants"]
    check(c["neighbors"], {"file": _STR, "k": _INT}, "constants.neighbors.")
    if not c["null_condition"]:
        raise BundleError(f"{where}: constants.null_condition is empty (its family says what a null row is)")
    for name, digest in manifest["files"].items():
        if not isinstance(digest, str) or "/" in name or name.startswith("."):
            raise BundleError(f"{where}: files.{name} is not a plain file name with a sha256")
    for name, graph in manifest["graphs"].items():
        check(graph, _GRAPH, f"graphs.{name}.")
        if graph["file"] not in manifest["files"]:
            raise BundleError(f"{where}: graph {name} names an unlisted file {graph['file']!r}")
        for io in ("inputs", "outputs"):
            for i, spec in enumerate(graph[io]):
                check(spec, _IO, f"graphs.{name}.{io}[{i}].")
                _ints(spec["shape"], f"graphs.{name}.{io}[{i}].shape", where)
    for name, tree in manifest["trees"].items():
        check(tree, _TREE, f"trees.{name}.")
        if not all(isinstance(p, list) for p in tree["paths"]):
            raise BundleError(f"{where}: trees.{name}.paths must be lists of child indices")
        for p in tree["paths"]:
            _ints(p, f"trees.{name}.paths", where)
        for key in ("graph", "verify"):
            graph = tree.setdefault(key, None)
            if graph is not None and not isinstance(graph, str):
                raise BundleError(
                    f"{where}: trees.{name}.{key} must be a graph name or null, got {graph!r}"[:300]
                )
    sizes = c["batch_sizes"]
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
        raise BundleError(f"{where}: constants.batch_sizes must list batch sizes >= 1")
    windows, capacity = c["cache_windows"], c["cache_capacity"]
    if (
        not windows
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in windows)
        or windows != sorted(set(windows))
        or windows[-1] != capacity
    ):
        raise BundleError(
            f"{where}: constants.cache_windows must list ascending window sizes ending with cache_capacity"
        )
    cls = c["cls_token_num"]
    steps = [windowed_name(AR_STEP_GRAPH, w, capacity) for w in step_windows(windows, cls, 0)]
    per_batch = [PREFILL_GRAPH, *steps]
    if c["drafter"] and c["cls_token_num"] > 1:
        per_batch.append(DRAFTER_PREFILL_GRAPH)
    needed = [VQ_DECODE_GRAPH] + [batched_name(g, b) for g in per_batch for b in sizes]
    text = manifest.get("text_encoder")
    if text is not None:
        check(text, {"max_length": _INT}, "text_encoder.")
        needed.append(TEXT_ENCODER_GRAPH)
    for tree in manifest["trees"].values():
        needed += [batched_name(tree["graph"], b) for b in sizes if tree["graph"]]
        needed += [
            batched_name(windowed_name(tree["verify"], w, capacity), b)
            for b in sizes
            for w in step_windows(windows, cls, paths_depth(tree["paths"]))
            if tree["verify"]
        ]
    for graph in needed:
        if graph not in manifest["graphs"]:
            raise BundleError(f"{where}: the bundle lacks its {graph} graph")
    return manifest


def _checker(where: Path | str) -> Callable[[dict, dict, str], None]:
    def check(obj: Any, fields: dict[str, type], prefix: str) -> None:
        if not isinstance(obj, dict):
            raise BundleError(f"{where}: {prefix.rstrip('.') or 'the manifest'} must be an object")
        for key, kind in fields.items():
            value = obj.get(key)
            # bool is an int in Python: an int field must not hold true/false, nor the reverse
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise BundleError(f"{where}: {prefix}{key} must be {_KIND_NAMES[kind]}, got {value!r}"[:300])

    return check


def _ints(values: list, field: str, where: Path | str) -> None:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise BundleError(f"{where}: {field} must hold non-negative integers")


def _io_spec(spec: dict[str, Any]) -> TensorSpec:
    return TensorSpec(spec["name"], tuple(spec["shape"]), spec["dtype"])


def _constants(c: dict[str, Any]) -> Constants:
    return Constants(
        model_type=c["model_type"],
        cls_token_num=c["cls_token_num"],
        block_size=c["block_size"],
        grid_size=c["grid_size"],
        cache_capacity=c["cache_capacity"],
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        drafter=c["drafter"],
        drafter_capacity=c["drafter_capacity"],
        max_draft_width=c["max_draft_width"],
        batch_sizes=tuple(c["batch_sizes"]),
        cache_windows=tuple(c["cache_windows"]),
        guided=c["guided"],
        cache_scratch=c["cache_scratch"],
        drafter_scratch=c["drafter_scratch"],
        neighbors_file=c["neighbors"]["file"],
        neighbors_k=c["neighbors"]["k"],
        null_condition=dict(c["null_condition"]),
    )


# -- writing ------------------------------------------------------------------------------------


@contextlib.contextmanager
def staged_bundle(out: Path) -> Iterator[Path]:
    """A temporary folder to write a bundle into, renamed to ``out`` (replacing an existing
    bundle, never anything else: :func:`check_bundle_out`) when the block succeeds
    (:func:`~lantern_rt.fileio.staged_folder`)."""
    check_bundle_out(out)
    with staged_folder(Path(out), "bundle", BundleError) as tmp:
        yield tmp


def is_bundle(path: Path) -> bool:
    """Whether the folder ``path`` holds a ``manifest.json`` of this format (any version)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def check_bundle_out(out: Path) -> None:
    """:class:`BundleError` unless a bundle can be written at ``out``: a new folder in a
    writable one, or an existing bundle to replace (never a file nor a folder of the user's)."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BundleError(f"cannot write bundle {out}: it is a file or a link, not a bundle folder")
    if out.exists() and not is_bundle(out):
        raise BundleError(
            f"refusing to replace {out}: it is not a lantern-rt bundle (no {MANIFEST} of format {FORMAT}); "
            "remove it yourself or choose another folder"
        )
    parent = next(p for p in out.absolute().parents if p.exists())
    probe = None
    try:
        if not parent.is_dir():
            raise NotADirectoryError(f"{parent} is not a folder")
        try:
            probe = tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=parent)
        finally:  # a signal arriving here still removes the probe
            if probe is not None:
                os.rmdir(probe)
    except OSError as err:
        raise BundleError(f"cannot write bundle {out}: {err.strerror or err}") from None


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` into the bundle ``folder`` with the sha256 of every other file in it
    and its own digest, after checking it against the schema (a writer's mistake fails here,
    not in a reader)."""
    manifest = json.loads(json.dumps({**manifest, "format": FORMAT, "bundle_version": BUNDLE_VERSION}))
    manifest["files"] = {
        p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    parse_manifest(copy.deepcopy(manifest), folder / MANIFEST)
    manifest[DIGEST] = manifest_digest(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The sha256 of ``manifest``'s canonical JSON (sorted keys, no spaces) without its digest."""
    body = {key: value for key, value in manifest.items() if key != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
