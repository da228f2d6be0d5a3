"""The size of a TensorRT for RTX plan, predicted from what its graph holds.

A plan that TensorRT for RTX 1.7 builds ahead of time (no GPU) holds every weight its graph
reads once, as the graph stores it (fp32, fp16, int8; int4 two to a byte), and, for each kernel
its optimizer generates (the element-wise, normalisation and softmax work fused between the
library's matrix products), that kernel's CUDA source, which the GPU compiles when the plan
loads: 138.4 KB a kernel, all but a few percent of it a header each kernel repeats. So::

    plan bytes = weights + kernels x KERNEL_BYTES

Weights are read from the ONNX graph (a bundle) or counted from the model's shapes (a model
directory). Kernels are counted by :func:`kernels`: a target graph generates a fixed number per
layer and per graph, by kind and precision, and per level of its tree, counted in plans of 2, 6
and 8 layers and checked on 12 (BENCHMARKS.md, "Issue 59: the memory plan"); the drafting graph
per tree level, the VQ decoder as the demo's. Plans of TensorRT proper (10.x/11.x, e.g.
JetPack's) hold the same weights and compiled kernels instead of their sources: their size is
not measured here.
"""

from __future__ import annotations

from pathlib import Path

from lantern_rt.bundle import Bundle

KERNEL_BYTES = 138_400  # least squares over 61 built plans, weights and kernels counted
PLAN_MODEL = "TensorRT for RTX 1.7: weights as stored + 138.4 KB per generated kernel"
# kernels of a target graph: (per layer, per graph), by its kind and the precision of its products
# (a verify graph's before its tree's: TREE_KERNELS)
LAYER_KERNELS: dict[str, dict[str, tuple[float, float]]] = {
    "prefill": {"fp32": (5, 5), "fp16": (4, 7), "int8": (5.86, 4.4), "w8a16": (4, 11), "w4a16": (6, 4)},
    "step": {"fp32": (5, 24), "fp16": (3, 25), "int8": (6.86, 21.4), "w8a16": (3, 29), "w4a16": (5, 23)},
    "verify": {
        "fp32": (4, 28.2),
        "fp16": (2, 29.2),
        "int8": (5.71, 27.1),
        "w8a16": (2, 33.2),
        "w4a16": (4, 27.2),
    },
}
# a step graph that reads a window of the cache, not all of it, has these many more
PARTIAL_WINDOW_KERNELS = {"step": 2, "verify": -4}
# a tree's kernels: (per level below the root, per level of more than one node) in its verify
# graph and in its drafting graph (a one-layer drafter), the latter's base by precision (fp32, or
# fp16: the drafter's graphs are never quantized, :data:`lantern_rt.memory_plan.PRECISIONS`)
TREE_KERNELS = {"verify": (0.16, 5.6), "draft": (10, 5)}
DRAFT_BASE_KERNELS = {"fp32": 10, "fp16": 13}
# graphs of other kinds: the VQ decoder as the demo's (16 x 16 codes; 14 kernels at 4 x 4); not
# fitted: the drafter's prefill and the text encoder, counted as a drafting graph of depth 2
OTHER_KERNELS = {"drafter_prefill": 30, "vq_decode": 24, "text_encoder": 30}


def kernels(
    kind: str, precision: str, layers: int, full_window: bool = True, depth: int = 0, wide: int = 0
) -> int:
    """Kernels TensorRT for RTX generates for a graph of ``kind`` (prefill, step, verify, draft,
    drafter_prefill, vq_decode, text_encoder) whose products run in ``precision`` (a row of
    :data:`LAYER_KERNELS`) over ``layers`` target layers; a step or verify graph not
    ``full_window`` reads a window of the cache; a verify or drafting graph's tree has ``depth``
    levels below its root, ``wide`` of them with more than one node."""
    per_level, per_wide = TREE_KERNELS.get(kind, (0, 0))
    tree = per_level * depth + per_wide * wide
    if kind == "draft":
        return round(DRAFT_BASE_KERNELS[precision] + tree)
    if kind not in LAYER_KERNELS:
        return OTHER_KERNELS[kind]
    per_layer, base = LAYER_KERNELS[kind][precision]
    extra = 0 if full_window else PARTIAL_WINDOW_KERNELS[kind]
    return round(per_layer * layers + base + tree) + extra


def plan_bytes(weights: int, kernel_count: int) -> int:
    """A plan's predicted size: its weights and its kernels' sources."""
    return weights + kernel_count * KERNEL_BYTES


def graph_weights(path: Path) -> int:
    """Bytes of the initializers an ONNX graph's nodes read (its subgraphs' too), each once (an
    external one by file and offset), as stored."""
    import onnx  # only where a graph file is read

    from lantern_rt.eval.memory_floor import _stored_bytes
    from lantern_rt.graph_rules import with_subgraphs

    graphs = list(with_subgraphs(onnx.load(str(path), load_external_data=False).graph))
    read = {name for graph in graphs for node in graph.node for name in node.input}
    total, seen = 0, set()
    for graph in graphs:
        for t in graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            key = (ext["location"], ext.get("offset", "0")) if "location" in ext else (graph.name, t.name)
            if t.name in read and key not in seen:
                seen.add(key)
                total += _stored_bytes(t, ext)
    return total


def built_plans(bundle: Bundle) -> list[tuple[str, dict[str, int]]]:
    """Each plan set built for ``bundle`` (its folder under ``engines/``, TensorRT for RTX's
    first) with the size of each graph's plan file; sets whose ``engines.json`` is unreadable
    or whose files are missing are left out."""
    from lantern_rt.engines.plans import EngineError, plan_sets, read_engines_json

    sets = []
    for folder in plan_sets(bundle):
        try:
            records = read_engines_json(folder)
        except EngineError:
            continue
        files = {r["graph"]: folder / r["file"] for r in records}
        if all(path.is_file() for path in files.values()):
            rtx = any(r.get("flavour") == "trt-rtx" for r in records)
            sets.append((not rtx, folder.name, {g: p.stat().st_size for g, p in files.items()}))
    return [(name, sizes) for _, name, sizes in sorted(sets)]
