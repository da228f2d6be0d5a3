"""The memory floor of a benchmark row: the seconds per image its decode loop would take if each
call did nothing but stream the bytes it must read, at the bandwidth a copy loop measures in the
same run. ``measured / floor`` says how far a row is from the memory bound (1.0: at it).

Per image, for a row of B images per call and R rows per image (2 with CFG, 1 without)::

    bytes/image   = (W_target * C_target + W_draft * C_draft) / B  +  KV * R * L * C_target
    floor s/image = bytes/image / bandwidth

- ``W_target``: the bytes of the target's weights one call reads, at the row's precision: for a
  bundle the initializers of its AR step graph as stored (fp32 4 bytes a weight, fp16 2, Q/DQ
  int8 1 plus its fp32 scales, MatMulNBits' packed blocks), once for each node that reads one
  (a bundle stores equal tensors once: the sized demo's inert layers share one zero ``wo`` and
  one zero ``w2``, which each of those layers reads); for the torch rows the parameters of the
  target's layers, final norm and output head, each once. Embedding tables do not count (a
  call gathers a few of their rows): a ``Gather`` node's table, a torch model's embeddings.
- ``W_draft``: the same for a drafting call, the drafter's weights and the LM head it drafts
  through, each tensor once (0 for AR and the drafter-free Jacobi methods). Counted once a
  call: a tree's levels run the drafter again, so a drafter larger than the last-level cache
  streams it once a level, which the floor leaves out (it stays a lower bound).
- ``C_target``: target calls per image (its verify calls and its prefill); ``C_draft``: drafting
  calls per image (one a verify call). A call's weights serve its B images; calls a batch runs
  while some of its images are done already are not counted (a lower bound again).
- ``KV``: the K and V bytes of one cache entry over all layers and one row, 2 * n_layer *
  kv_heads * head_dim * the cache's element size; ``L`` the entries a call reads on average:
  the condition prefix plus half the image's tokens.
- ``bandwidth``: :func:`copy_bandwidth`, numpy copies between two arrays of 4x the last-level
  cache, split over the run's threads, the best of :data:`REPEATS`: bytes read plus bytes
  written over the seconds (STREAM's "copy" convention).

Left out, each small at LlamaGen's sizes: activations, the drafter's cache, sampling and
acceptance tensors, the VQ decoder (outside the decode loop's time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from lantern_rt.bundle import AR_STEP_GRAPH, Bundle, batched_name
from lantern_rt.models.config import GPTConfig

if TYPE_CHECKING:
    import onnx

    from lantern_rt.assembly import Pipeline
    from lantern_rt.models.model_dir import ModelDir
    from lantern_rt.models.target import Transformer

REPEATS = 5  # copies timed; the fastest one counts
LLC_FALLBACK = 32 << 20  # bytes, when the system does not say
MIN_ARRAY = 64 << 20  # bytes: at least this much is copied whatever the cache says
TORCH_PRECISIONS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class StepBytes:
    """What a row's calls read at least, by part (see the module docstring's formula)."""

    precision: str  # the weights as stored: fp32, fp16, int8 (Q/DQ), int8-weights, int4-weights
    target_weights: int  # W_target
    draft_weights: int  # W_draft (0: no drafter)
    kv_entry: int  # KV: K and V bytes of one cache entry, every layer, one row
    mean_entries: float  # L

    def per_image(self, target_calls: float, draft_calls: float, batch: int, rows: int) -> float:
        """Bytes one image streams: ``target_calls`` and ``draft_calls`` per image, ``batch``
        images per call, ``rows`` cache rows per image."""
        weights = (self.target_weights * target_calls + self.draft_weights * draft_calls) / batch
        return weights + self.kv_entry * rows * self.mean_entries * target_calls


def kv_entry_bytes(gpt: GPTConfig, element: int) -> int:
    """K and V bytes of one cache entry over all of ``gpt``'s layers, for one row."""
    return 2 * gpt.n_layer * gpt.kv_heads * gpt.head_dim * element


def mean_entries(gpt: GPTConfig) -> float:
    """Cache entries a call reads on average over an image: the prefix and half its tokens."""
    return gpt.cls_token_num + gpt.block_size / 2


def module_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters of ``modules`` but their embedding tables, each tensor once."""
    seen: dict[int, int] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Embedding):
                continue
            for p in sub.parameters(recurse=False):
                seen[id(p)] = p.numel() * p.element_size()
    return sum(seen.values())


def target_weight_bytes(model: Transformer) -> int:
    """W_target of a torch target: its layers, final norm and output head."""
    return module_bytes([model.layers, model.norm, model.output])


def torch_step_bytes(model: Transformer, drafter: tuple[nn.Module, nn.Module] | None = None) -> StepBytes:
    """The :class:`StepBytes` of torch rows over ``model``, drafting with (drafter, LM head)."""
    element = model.output.weight.element_size()
    return StepBytes(
        precision=TORCH_PRECISIONS.get(model.output.weight.dtype, str(model.output.weight.dtype)),
        target_weights=target_weight_bytes(model),
        draft_weights=0 if drafter is None else module_bytes(drafter),
        kv_entry=kv_entry_bytes(model.config, element),
        mean_entries=mean_entries(model.config),
    )


def graph_weight_bytes(path: Path, per_reader: bool = True) -> int:
    """Bytes of an ONNX graph's initializers as stored (subgraphs' included) that its nodes read:
    ``per_reader``, once for each node that reads one (a tensor that several layers share is
    read by each); else each once (an external one by file and offset). Reads by ``Gather``
    nodes of their table (embeddings: a few rows) are left out, and so are unread initializers."""
    import onnx  # only where a graph file is read

    from lantern_rt.graph_rules import with_subgraphs

    graphs = list(with_subgraphs(onnx.load(str(path), load_external_data=False).graph))
    reads: dict[str, int] = {}  # initializer name -> nodes that read it, but as a Gather's table
    for graph in graphs:
        for node in graph.node:
            for i, name in enumerate(dict.fromkeys(node.input)):
                if not (node.op_type == "Gather" and i == 0):
                    reads[name] = reads.get(name, 0) + 1
    total, seen = 0, set()
    for graph in graphs:
        for t in graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            key = (ext["location"], ext.get("offset", "0")) if "location" in ext else (graph.name, t.name)
            if not reads.get(t.name) or (not per_reader and key in seen):
                continue
            seen.add(key)
            total += _stored_bytes(t, ext) * (reads[t.name] if per_reader else 1)
    return total


def _stored_bytes(t: onnx.TensorProto, external: dict[str, str]) -> int:
    """Bytes of initializer ``t``'s data: its external length, its raw bytes, else its shape
    and type (4-bit types two to a byte)."""
    import onnx

    if "length" in external:
        return int(external["length"])
    if t.raw_data:
        return len(t.raw_data)
    numel = math.prod(t.dims)
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (numel + 1) // 2
    return numel * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def bundle_step_bytes(bundle: Bundle, draft_tree: str | None = None) -> StepBytes:
    """The :class:`StepBytes` of rows on ``bundle``: W_target from its AR step graph (per
    reading node), W_draft from the drafting graph of ``draft_tree`` (each tensor once; None: no
    drafter), the cache's element size from the AR step's ``past_k_0`` input."""
    size = bundle.constants.batch_sizes[0]  # every batch size's graphs hold the same weights
    step = bundle.graph(batched_name(AR_STEP_GRAPH, size))
    draft = None if draft_tree is None else bundle.trees[draft_tree].graph
    draft_file = None if draft is None else bundle.file(bundle.graph(batched_name(draft, size)))
    element = np.dtype(step.input("past_k_0").dtype).itemsize
    return StepBytes(
        precision=bundle.dtype,
        target_weights=graph_weight_bytes(bundle.file(step)),
        draft_weights=0 if draft_file is None else graph_weight_bytes(draft_file, per_reader=False),
        kv_entry=kv_entry_bytes(bundle.gpt, element),
        mean_entries=mean_entries(bundle.gpt),
    )


def pipeline_step_bytes(pipe: Pipeline, source: ModelDir | Bundle) -> StepBytes | None:
    """The :class:`StepBytes` of a pipeline built from ``source`` (a bundle, or the model
    directory the torch backend runs); None for a target this module cannot read."""
    from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget

    drafts = pipe.method.method != "ar" and not pipe.method.jacobi
    if isinstance(source, Bundle):
        return bundle_step_bytes(source, pipe.method.tree if drafts else None)
    if not isinstance(pipe.target, TorchTarget):
        return None
    drafter = pipe.speculation.drafter if drafts and pipe.speculation is not None else None
    pair = (drafter.drafter, drafter.head) if isinstance(drafter, TorchDrafter) else None
    return torch_step_bytes(pipe.target.model, pair)


def floor_fields(step: StepBytes | None, row: dict[str, Any], rows: int, bandwidth: float) -> dict[str, Any]:
    """A result row's floor: ``weight_precision``, ``floor_bytes_per_image``,
    ``floor_seconds_per_image`` and ``measured_over_floor`` (Nones without ``step``), from its
    ``num_images``, ``verify_calls``, ``batch_size`` and ``seconds_per_image``."""
    if step is None:
        return dict.fromkeys(
            ("weight_precision", "floor_bytes_per_image", "floor_seconds_per_image", "measured_over_floor")
        )
    verify = row["verify_calls"] / max(1, row["num_images"])
    streamed = step.per_image(verify + 1, verify, row["batch_size"], rows)
    floor = streamed / bandwidth
    return {
        "weight_precision": step.precision,
        "floor_bytes_per_image": streamed,
        "floor_seconds_per_image": floor,
        "measured_over_floor": row["seconds_per_image"] / floor,
    }


# --- the copy loop -------------------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidth:
    """What :func:`copy_bandwidth` measured."""

    bytes_per_s: float
    array_bytes: int  # each of the two arrays
    threads: int
    repeats: int

    def as_json(self) -> dict[str, Any]:
        return {
            "bytes_per_s": self.bytes_per_s,
            "array_bytes": self.array_bytes,
            "threads": self.threads,
            "repeats": self.repeats,
        }


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The size of CPU 0's highest cache level (Linux sysfs), or :data:`LLC_FALLBACK`."""
    best: tuple[int, int] | None = None
    for index in root.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return best[1] if best else LLC_FALLBACK


def copy_bandwidth(threads: int, array_bytes: int | None = None, repeats: int = REPEATS) -> Bandwidth:
    """Memory bandwidth by a copy loop: one array copied into another ``repeats`` times, each
    copy split in ``threads`` contiguous parts copied at once (numpy releases the GIL),
    2 x ``array_bytes`` over the fastest copy. ``array_bytes`` defaults to 4x the last-level
    cache, at least :data:`MIN_ARRAY`."""
    threads = max(1, threads)
    size = array_bytes or max(MIN_ARRAY, 4 * last_level_cache_bytes())
    src = np.ones(size, np.uint8)
    dst = np.zeros_like(src)
    bounds = np.linspace(0, size, threads + 1).astype(int)
    parts = [(src[a:b], dst[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(lambda part: np.copyto(part[1], part[0]), parts))
            best = min(best, time.perf_counter() - start)
    return Bandwidth(2 * size / best, size, threads, repeats)
