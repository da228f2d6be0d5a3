"""The exporter: writes a model directory's bundle (its format: :mod:`lantern_rt.bundle`).

:func:`export_bundle` exports, lints and numerically checks every graph against the torch model
in a temporary folder beside ``out`` and renames it into place only when all of them pass
(:func:`lantern_rt.bundle.staged_bundle`); the format itself lives in :mod:`lantern_rt.bundle`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from tqdm import tqdm

from lantern_rt.bundle import (
    AR_STEP_GRAPH,
    NEIGHBORS,
    VQ_DECODE_GRAPH,
    WEIGHTS,
    check_bundle_out,
    draft_graph_name,
    staged_bundle,
    step_windows,
    verify_graph_name,
    windowed_name,
    write_manifest,
)
from lantern_rt.errors import LanternError, first_line
from lantern_rt.export.graphs import (
    DrafterPrefill,
    DrafterTree,
    GraphModule,
    TargetPrefill,
    TargetVerify,
    VQDecode,
    cache_capacity,
)
from lantern_rt.families.loading import load_drafter, load_neighbors, load_target, load_vq
from lantern_rt.families.registry import family_named
from lantern_rt.graph_rules import MAX_OPSET, MIN_OPSET, check_graph, tensorrt_problems
from lantern_rt.graph_spec import IN_PLACE_OPSET, GraphSpec
from lantern_rt.models.config import to_dict
from lantern_rt.models.drafter import Drafter
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.models.neighbors import save_neighbors
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH, drafter_capacity, scratch_rows
from lantern_rt.runtime.jacobi import is_window
from lantern_rt.runtime.kv_cache import cache_windows
from lantern_rt.runtime.run_shape import CACHE_WINDOWS, check_batch_sizes, check_cache_windows
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree, tree_to_json
from lantern_rt.settings import DEFAULT_OPSET
from lantern_rt.shared_weights import GraphByGraph
from lantern_rt.version import package_version

NEIGHBORS_K = 1000  # latent neighbours kept per code (fewer for a smaller codebook)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# compute dtype -> (atol, rtol against the largest reference value), on one random input
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2)}
# The VQ decoder's check (docs/architecture.md, "The export's check"): its pixels become 8-bit
# levels 1/127.5 apart in [-1, 1] (a level grows with an output beyond that range); over
# IMAGE_CHECK_INPUTS random code grids no pixel may move by a level, and the mean error is at most
# IMAGE_MEAN_LEVELS of one (about as many pixels change their 8-bit value).
IMAGE_CHECK_INPUTS = 4
IMAGE_LEVEL = 1 / 127.5
IMAGE_MEAN_LEVELS = 1 / 8


@dataclass(frozen=True)
class Differences:
    """How one output of an ONNX graph differs from torch's over the check's inputs."""

    max_abs: float  # the largest absolute difference
    mean_abs: float  # the mean absolute difference
    peak: float  # the largest absolute reference value


def check_inputs(spec: GraphSpec) -> int:
    """How many random inputs the check against torch runs ``spec``'s graph on."""
    return IMAGE_CHECK_INPUTS if spec.name == VQ_DECODE_GRAPH else 1


def disagreement(spec: GraphSpec, d: Differences) -> str | None:
    """Why an output of ``spec``'s graph that differs from torch's by ``d`` is refused, or None
    when it is not. An image must keep within one 8-bit level at every pixel and within
    :data:`IMAGE_MEAN_LEVELS` of one on average; any other output within :data:`TOLERANCE` of its
    compute dtype. NaN is refused."""
    if spec.name == VQ_DECODE_GRAPH:
        level = IMAGE_LEVEL * max(1.0, d.peak)
        if not d.max_abs < level:
            return f"differs from torch by {d.max_abs:.3g} (tolerance {level:.3g}, one 8-bit level)"
        if not d.mean_abs <= IMAGE_MEAN_LEVELS * level:
            return (
                f"differs from torch by {d.mean_abs:.3g} on average "
                f"(tolerance {IMAGE_MEAN_LEVELS * level:.3g}, {IMAGE_MEAN_LEVELS:.3g} of an 8-bit level)"
            )
        return None
    atol, rtol = TOLERANCE[spec.compute_dtype]
    if not d.max_abs <= atol + rtol * d.peak:
        return f"differs from torch by {d.max_abs:.3g} (tolerance {atol + rtol * d.peak:.3g})"
    return None


class ExportError(LanternError, ValueError):
    """A graph could not be exported, broke a rule, or disagrees with the torch model."""


def export_bundle(
    model_dir: ModelDir,
    out: Path,
    trees: Sequence[StaticTree] = (),
    dtype: str = "fp32",
    opset: int = DEFAULT_OPSET,
    threads: int = 0,
    overwrite: bool = False,
    progress: bool = False,
    batch_sizes: Sequence[int] = (1,),
    on_start: Callable[[], object] | None = None,
    windows: int = CACHE_WINDOWS,
    guided: bool = True,
    models: ExportModels | None = None,
    in_place: bool = False,
) -> Path:
    """Export the target (prefill, the AR step and the verify step of each tree; without a
    drafter, of each chain, for the Jacobi window of its length), the VQ decoder, the neighbour
    table and, when ``model_dir`` has a drafter, the drafting graph of each tree; the step
    graphs once per batch size in ``batch_sizes`` (images per call), the target's steps once per
    cache window (``windows`` of them, :func:`~lantern_rt.runtime.kv_cache.cache_windows`).
    ``guided`` False exports graphs of one row per image, for CFG scales of at most 1 alone
    (half the work of the 2B CFG rows; docs/method.md §13). ``in_place``: the target's step
    and the drafting graphs write their K/V into their caches (scratch slots after each window,
    opset 24; onnxruntime on the CPU only, TensorRT cannot build them; docs/method.md §6).

    ``threads`` sizes the onnxruntime sessions of the numerical check (0: onnxruntime's default);
    ``progress`` shows a progress bar over the graphs; ``on_start()`` is called once the models
    have loaded, before the first graph (a model that fails to load is the only message);
    ``models``: ``model_dir``'s, already loaded by :func:`load_export_models`.
    """
    out = Path(out)
    trees = _check_args(out, trees, dtype, opset, overwrite)
    sizes = check_batch_sizes(list(batch_sizes))
    check_cache_windows(windows)
    models = models or load_export_models(model_dir)
    target, drafter, neighbors = models.target, models.drafter, models.neighbors
    k = neighbors_k(model_dir)
    spans = cache_windows(cache_capacity(target), windows)
    scratch = scratch_slots(trees, drafter is not None) if in_place else ScratchSlots(0, 0)
    graphs = graph_pairs(models, trees, dtype, k, sizes, spans, guided, scratch)
    family = family_named(model_dir.family)
    if on_start is not None:
        on_start()
    with staged_bundle(out) as tmp:
        entries = {}
        with GraphByGraph(tmp / WEIGHTS) as shared:  # each graph's weights join the file once it passes
            for module, reference in tqdm(graphs, desc="export", unit="graph", disable=not progress):
                entries[module.spec.name] = entry = export_graph(module, reference, tmp, opset, threads)
                shared.add(tmp / entry["file"])
        extras = family.write_bundle_files(model_dir, target, tmp)
        save_neighbors(neighbors, tmp / NEIGHBORS)
        manifest = _manifest(
            model_dir,
            target,
            trees,
            drafter is not None,
            dtype,
            opset,
            entries,
            sizes,
            spans,
            guided,
            scratch,
        )
        manifest["constants"]["null_condition"] = extras.pop("null_condition")
        manifest.update(extras)
        write_manifest(tmp, manifest)
    return out


class ExportModels(NamedTuple):
    """What an export reads of a model directory, loaded and checked."""

    target: Transformer
    vq: nn.Module
    drafter: Drafter | None
    neighbors: torch.Tensor  # [V, neighbors_k] int64
    extra: list[nn.Module]  # its family's graphs beside the target's, drafter's and VQ decoder's


def load_export_models(model_dir: ModelDir) -> ExportModels:
    """Load every model and table an export of ``model_dir`` reads, each checked by its
    loader (the error names the file); nothing is written."""
    target, vq = load_target(model_dir), load_vq(model_dir)
    drafter = load_drafter(model_dir) if "drafter" in model_dir.files else None
    k = neighbors_k(model_dir)
    neighbors = load_neighbors(model_dir, k, vq)[:, :k]
    extra = family_named(model_dir.family).extra_graphs(model_dir, target)
    return ExportModels(target, vq, drafter, neighbors, extra)


def neighbors_k(md: ModelDir) -> int:
    """Latent neighbours per code in the bundle's table."""
    return min(NEIGHBORS_K, md.vq.codebook_size - 1)


def _check_args(
    out: Path, trees: Sequence[StaticTree], dtype: str, opset: int, overwrite: bool
) -> list[StaticTree]:
    """The trees without repeats, after checking every argument."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset must be in {MIN_OPSET}..{MAX_OPSET} (TensorRT 10.3), not {opset}")
    by_name: dict[str, StaticTree] = {}
    for tree in trees:
        if not isinstance(tree, StaticTree) or tree.num_nodes == 0:
            raise ExportError(f"trees must be StaticTrees with at least one node (load_tree), got {tree!r}")
        if tree.width > MAX_DRAFT_WIDTH:
            raise ExportError(
                f"tree {tree.name} drafts {tree.width} children per node; at most {MAX_DRAFT_WIDTH}"
            )
        if by_name.setdefault(tree.name, tree) != tree:
            raise ExportError(f"two different trees are named {tree.name}; give each a unique name")
    if out.is_dir() and not out.is_symlink() and not overwrite:
        raise ExportError(f"{out} already exists; choose another folder or overwrite it")
    check_bundle_out(out)  # a file, a folder of the user's, an unwritable place: refused now
    return list(by_name.values())


class ScratchSlots(NamedTuple):
    """Scratch slots after the window of the target's cache and of the drafter's (0: its graphs
    do not write it in place)."""

    target: int
    drafter: int


def scratch_slots(trees: Sequence[StaticTree], has_drafter: bool) -> ScratchSlots:
    """Scratch slots of caches the graphs write into: the target's, the most nodes (the root
    included) of a tree the bundle verifies, 1 for AR's step alone; the drafter's, the most
    rows a drafting call runs the drafter on (``drafting.scratch_rows``)."""
    return ScratchSlots(
        max([t.num_nodes + 1 for t in trees if verified(t, has_drafter)], default=1),
        max((scratch_rows(t) for t in trees), default=0) if has_drafter else 0,
    )


def graph_pairs(
    models: ExportModels,
    trees: list[StaticTree],
    dtype: str,
    neighbors_k: int,
    batch_sizes: list[int],
    windows: tuple[int, ...],
    guided: bool,
    scratch: ScratchSlots,
) -> list[tuple[GraphModule, GraphModule]]:
    """(graph to export, fp32 reference) pairs of a bundle, in export order: the step graphs of
    each batch size (:func:`_graphs`), the VQ decoder, the family's extra graphs. The modules
    read the models' weights; the models in ``dtype`` are one copy for every batch size (none
    in fp32)."""
    target, vq, drafter, _, extra = models
    cast = DTYPES[dtype]
    low = (_cast(target, cast), None if drafter is None else _cast(drafter, cast))
    pairs = [
        pair
        for b in batch_sizes
        for pair in _graphs(target, drafter, low, trees, neighbors_k, b, windows, guided, scratch)
    ]
    decode = VQDecode(vq, target.config)
    return [*pairs, (decode, decode), *((module, module) for module in extra)]


def _graphs(
    target: Transformer,
    drafter: Drafter | None,
    low_models: tuple[Transformer, Drafter | None],
    trees: list[StaticTree],
    neighbors_k: int,
    batch: int,
    windows: tuple[int, ...],
    guided: bool,
    scratch: ScratchSlots = ScratchSlots(0, 0),
) -> list[tuple[GraphModule, GraphModule]]:
    """(graph to export, fp32 reference) pairs of the step graphs for ``batch`` images per call
    (2B CFG rows, or B when not ``guided``), ``low_models`` the target and drafter in the graphs'
    dtype, the target's steps once per cache window in ``windows`` a step over its tree can read
    (:func:`~lantern_rt.bundle.step_windows`; the VQ decoder always runs in fp32:
    its softmax and GroupNorms are not fp16-safe, and it runs once per image). AR's step
    verifies the root-only tree and credits no neighbours: its table is one column nothing
    reads. ``scratch``: the target's steps and the drafting calls write their K/V into that
    many scratch slots of their caches (:class:`TargetVerify`, :class:`DrafterTree`; 0: not)."""
    low, low_drafter = low_models
    pairs: list[tuple[GraphModule, GraphModule]] = [
        (TargetPrefill(low, batch, guided), TargetPrefill(target, batch, guided))
    ]
    steps = [(ROOT_ONLY, 1, AR_STEP_GRAPH)]
    steps += [
        (tree, neighbors_k, verify_graph_name(i))
        for i, tree in enumerate(trees)
        if verified(tree, drafter is not None)
    ]
    capacity, prefix = cache_capacity(target), target.config.cls_token_num
    for tree, k, name in steps:
        for window in step_windows(windows, prefix, tree.max_depth):
            step = (tree, k, windowed_name(name, window, capacity), batch, window, guided, scratch.target)
            pairs.append((TargetVerify(low, *step), TargetVerify(target, *step)))
    if drafter is not None:
        c = target.config
        cap = drafter_capacity(c.cls_token_num, c.block_size)
        if c.cls_token_num > 1:
            prefill = (c.cls_token_num, batch, guided)
            pairs.append((DrafterPrefill(low_drafter, *prefill), DrafterPrefill(drafter, *prefill)))
        for i, tree in enumerate(trees):
            drafting = (tree, cap, draft_graph_name(i), batch, c.cls_token_num - 1)
            pairs.append(
                (
                    DrafterTree(low_drafter, low.output, *drafting, c, guided, scratch.drafter),
                    DrafterTree(drafter, target.output, *drafting, c, guided, scratch.drafter),
                )
            )
    return pairs


def verified(tree: StaticTree, has_drafter: bool) -> bool:
    """Whether a bundle holds ``tree``'s verify graph: with a drafter, every tree's; without one,
    a chain's or a pac tree's alone, which serves a Jacobi window (docs/method.md §11)."""
    return has_drafter or is_window(tree)


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` itself in fp32, else a copy in ``dtype``."""
    return module if dtype == torch.float32 else copy.deepcopy(module).to(dtype)


def export_graph(
    module: GraphModule, reference: GraphModule, folder: Path, opset: int = DEFAULT_OPSET, threads: int = 0
) -> dict[str, Any]:
    """Export ``module`` to ``folder``/<name>.onnx, lint it and compare it with ``reference``
    (fp32 torch); its manifest entry. Raises :class:`ExportError`."""
    spec = module.spec
    path = folder / f"{spec.name}.onnx"
    try:
        with _quiet_exporter():
            torch.onnx.export(
                module.eval(),
                module.example_inputs(torch.Generator().manual_seed(0)),
                str(path),
                input_names=[t.name for t in spec.inputs],
                output_names=[t.name for t in spec.outputs],
                opset_version=IN_PLACE_OPSET if spec.writes_cache else opset,
                dynamo=True,
                external_data=True,  # moved into the bundle's one weights file (GraphByGraph)
                verbose=False,
            )
    except Exception as err:  # the exporter raises many types; report one line
        raise ExportError(f"{spec.name}: torch.onnx.export failed: {first_line(err)}") from err
    problems = check_graph(path, spec) + ([] if spec.writes_cache else tensorrt_problems(path))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ExportError(f"{spec.name}: {problems[0]}{more}")
    seeds = range(1, 1 + check_inputs(spec))
    differences = compare_with_torch(path, module, reference, threads, seeds)
    for name, d in differences.items():
        if (why := disagreement(spec, d)) is not None:
            raise ExportError(f"{spec.name}: output {name} {why}")
    entry = {"file": path.name, **spec.to_dict()}
    entry["max_abs_err"] = {name: d.max_abs for name, d in differences.items()}
    return entry


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's notes that concern no user (missing torchvision ops, deprecations)."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnx_ir")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            # constant folding of T5's relative-position buckets takes log(0) behind a Where
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="onnx.reference")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def compare_with_torch(
    path: Path, module: GraphModule, reference: GraphModule, threads: int = 0, seeds: Sequence[int] = (1,)
) -> dict[str, Differences]:
    """Run the ONNX graph (onnxruntime CPU) and ``reference``'s model (its own step function,
    torch, fp32) on random valid inputs, one drawn from each of ``seeds``: output name -> how
    they differ over all of them."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = (
        3  # a graph writing its cache in place copies it here (not bound): said each call
    )
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [t.name for t in module.spec.outputs]
    sums = {name: np.zeros(4) for name in names}  # largest difference (NaN kept), sum, count, peak
    for seed in seeds:
        inputs = module.example_inputs(torch.Generator().manual_seed(seed))
        feed = {t.name: x.numpy() for t, x in zip(module.spec.inputs, inputs, strict=True)}
        got = session.run(None, feed)
        with torch.inference_mode():
            want = reference.reference_forward(*(x.float() if x.is_floating_point() else x for x in inputs))
        want = want if isinstance(want, tuple) else (want,)
        for name, g, w in zip(names, got, want, strict=True):
            w = w.double().numpy()
            err = np.abs(g.astype(np.float64) - w)
            s = sums[name]
            s[:] = (
                np.maximum(s[0], err.max()),
                s[1] + err.sum(),
                s[2] + err.size,
                np.maximum(s[3], np.abs(w).max()),
            )
    return {name: Differences(float(s[0]), float(s[1] / s[2]), float(s[3])) for name, s in sums.items()}


def _manifest(
    md: ModelDir,
    target: Transformer,
    trees: list[StaticTree],
    has_drafter: bool,
    dtype: str,
    opset: int,
    graphs: dict,
    batch_sizes: list[int],
    windows: tuple[int, ...],
    guided: bool,
    scratch: ScratchSlots,
) -> dict[str, Any]:
    c = target.config
    constants = {
        "model_type": c.model_type,
        "cls_token_num": c.cls_token_num,
        "block_size": c.block_size,
        "grid_size": c.grid_size,
        "cache_capacity": cache_capacity(target),
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "drafter": has_drafter,
        "drafter_capacity": drafter_capacity(c.cls_token_num, c.block_size),
        "max_draft_width": MAX_DRAFT_WIDTH,
        "batch_sizes": batch_sizes,
        "cache_windows": list(windows),
        "guided": guided,
        "cache_scratch": scratch.target,
        "drafter_scratch": scratch.drafter,
        "neighbors": {"file": NEIGHBORS, "k": neighbors_k(md)},
    }
    return {
        "versions": {
            "lantern_rt": package_version(),
            "torch": torch.__version__,
            "onnx": onnx.__version__,
        },
        "opset": opset,
        "dtype": dtype,
        "model_name": md.name,
        "family": md.family,
        "gpt": to_dict(md.gpt),
        "vq": to_dict(md.vq),
        "class_names": md.class_names,
        "image_size": md.image_size,
        "constants": constants,
        "sampling_defaults": md.raw.get("sampling_defaults", {}),
        "trees": {
            tree.name: {
                **tree_to_json(tree),
                "graph": draft_graph_name(i) if has_drafter else None,
                "verify": verify_graph_name(i) if verified(tree, has_drafter) else None,
            }
            for i, tree in enumerate(trees)
        },
        "graphs": graphs,
    }
