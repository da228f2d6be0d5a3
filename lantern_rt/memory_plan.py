"""What a bundle needs in memory on a device (``lantern info``), from the bundle itself or from
a model's configuration alone (the bundle ``lantern export`` would write).

For each precision and batch size it counts:

- **plans**: one TensorRT plan per graph the runtime loads for that batch size (every graph of
  the batch size: each tree's, each cache window's), each with its own copy of the weights it
  reads (:mod:`lantern_rt.plan_sizes`: predicted; the built size where ``lantern build-engines``
  left a plan set beside the bundle);
- **KV caches**: the target's and the drafter's, allocated once at the cache's capacity for the
  batch's rows (2 per image with guidance); the cache windows are views of it;
- **neighbour table**: the latent neighbours of every code (int64), read by acceptance;
- **activations**: each graph's execution context keeps its own (an estimate: the widest
  tensors of a call alive at once; TensorRT reports its own figure only on a GPU).

The builder needs more than the plan it writes: :func:`build_peak` (host memory of a TensorRT
for RTX build, measured here; a TensorRT build on a Jetson also takes ``--workspace-mb`` of the
same memory). Devices and what of their memory counts as usable: :mod:`lantern_rt.devices`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lantern_rt.bundle import (
    AR_STEP_GRAPH,
    DRAFTER_PREFILL_GRAPH,
    PREFILL_GRAPH,
    TEXT_ENCODER_GRAPH,
    VQ_DECODE_GRAPH,
    WEIGHT_ONLY_DTYPES,
    Bundle,
    batched_name,
    draft_graph_name,
    paths_depth,
    step_windows,
    verify_graph_name,
    windowed_name,
)
from lantern_rt.devices import Device
from lantern_rt.models.config import GPTConfig
from lantern_rt.plan_sizes import built_plans, graph_weights, kernels, plan_bytes

# a TensorRT for RTX build's peak host memory (the process, the ONNX graph, the parsed network,
# the plan): BUILD_BASE plus BUILD_PER_PLAN_BYTE x the plan's size, measured on fp32, fp16 and
# int8 plans of 4 to 182 MB within 5%; an int4-weight plan's build peaked up to 14% above it
BUILD_BASE = 470_000_000
BUILD_PER_PLAN_BYTE = 3.6
INDEX_BYTES = 8  # the neighbour table is int64
EXPORT_NEIGHBORS_K = 1000  # latent neighbours a bundle keeps per code: the exporter's NEIGHBORS_K
VQ_LIVE_TENSORS = 3  # a VQ decoder's block at full resolution: its input, its output, the residual


@dataclass(frozen=True)
class Precision:
    """How a bundle of one dtype stores its weights and runs: ``element`` bytes per activation,
    cache entry and unquantized weight; product weights (MatMul/Gemm but the output head) in
    ``bits`` with one scale per ``block`` inputs (None: per output channel, fp32 scale and int8
    zero point); its drafter's graphs in ``drafter`` precision (never quantized: Q/DQ's kept in
    fp32, the weight-only forms' drafting graph reads each weight once per tree level, which
    stays fp16); ``kernels`` the row of the kernel table its products run in
    (:data:`~lantern_rt.plan_sizes.LAYER_KERNELS`)."""

    name: str
    element: int
    bits: int | None
    block: int | None
    drafter: str
    kernels: str


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4, None, None, "fp32", "fp32"),
        Precision("fp16", 2, None, None, "fp16", "fp16"),
        Precision("int8", 4, 8, None, "fp32", "int8"),
        Precision("w8a16", 2, 8, 128, "fp16", "w8a16"),
        Precision("w4a16", 2, 4, 128, "fp16", "w4a16"),
    )
}
PER_CHANNEL_SCALE_BYTES = 5  # a Q/DQ weight's fp32 scale and int8 zero point per output channel


@dataclass(frozen=True)
class Weight:
    """One weight tensor: its elements, and (inputs, outputs) when it is a product's weight that
    quantization stores in low bits (not the output head's: the logits stay exact)."""

    numel: int
    product: tuple[int, int] | None = None


def stored_bytes(weights: Sequence[Weight], precision: Precision) -> int:
    """Bytes of ``weights`` as a graph of ``precision`` stores them."""
    total = 0
    for w in weights:
        if w.product is None or precision.bits is None:
            total += w.numel * precision.element
            continue
        inputs, outputs = w.product
        per_output = (
            PER_CHANNEL_SCALE_BYTES
            if precision.block is None
            else -(-inputs // precision.block) * precision.element
        )
        total += -(-w.numel * precision.bits // 8) + outputs * per_output
    return total


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its target, tokenizer (the family's VQ config), drafter
    layers (0: none) and the parameters of a text encoder (0: none, always fp32)."""

    name: str
    family: str
    gpt: GPTConfig
    vq: Any
    image_size: int
    drafter_layers: int
    text_encoder_params: int = 0


def model_weights(model: ModelShape) -> dict[str, list[Weight]]:
    """The model's weights by the part of it a graph holds: the target's ``layers``, ``norm``,
    ``head``, ``tok_embeddings``, ``cls_embedding`` and ``rope`` table; the drafter's layers and
    ``fc`` (``drafter``), its ``drafter_embed`` and ``prompt_table``; the ``vq_decoder``; the
    ``text_encoder``. Counted on modules built on torch's meta device (no memory, no weights)."""
    import torch

    from lantern_rt.models.drafter import Drafter, DrafterConfig
    from lantern_rt.models.target import Transformer

    vocab = model.gpt.vocab_size
    with torch.device("meta"):
        target = Transformer(model.gpt)
        vq = _vq_module(model.vq)
        drafter = (
            Drafter(DrafterConfig.for_target(model.gpt, model.drafter_layers), model.gpt)
            if model.drafter_layers
            else None
        )
    parts = {
        name: _weights(getattr(target, module), vocab)
        for name, module in (
            ("layers", "layers"),
            ("norm", "norm"),
            ("head", "output"),
            ("tok_embeddings", "tok_embeddings"),
            ("cls_embedding", "cls_embedding"),
        )
    }
    parts["rope"] = [Weight(target.freqs_cis.numel())]
    parts["vq_decoder"] = [
        w for m in (vq.decoder, vq.post_quant_conv, vq.quantize) for w in _weights(m, vocab)
    ]
    parts["text_encoder"] = [Weight(model.text_encoder_params)] if model.text_encoder_params else []
    parts["drafter"] = (
        [] if drafter is None else _weights(drafter.layers, vocab) + _weights(drafter.fc, vocab)
    )
    parts["drafter_embed"] = [] if drafter is None else _weights(drafter.embed_tokens, vocab)
    table = None if drafter is None else getattr(drafter, "prompt_table", None)
    parts["prompt_table"] = [] if table is None else [Weight(table.numel())]
    return parts


def _weights(module: Any, vocab: int) -> list[Weight]:
    from torch import nn

    found = []
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            product = isinstance(sub, nn.Linear) and name == "weight" and sub.out_features != vocab
            found.append(Weight(p.numel(), (sub.in_features, sub.out_features) if product else None))
    return found


def _vq_module(vq: Any) -> Any:
    """The family's VQ model for tokenizer config ``vq`` (built where the caller says: meta)."""
    from lantern_rt.families.chameleon.vq import ChameleonVQ, ChameleonVQConfig
    from lantern_rt.models.vq import VQModel

    return ChameleonVQ(vq) if isinstance(vq, ChameleonVQConfig) else VQModel(vq)


def _vq_full_channels(vq: Any) -> int:
    """Channels of the VQ decoder's blocks at full resolution."""
    from lantern_rt.families.chameleon.vq import ChameleonVQConfig

    if isinstance(vq, ChameleonVQConfig):
        return vq.base_channels * vq.channel_multiplier[0]
    return vq.ch * vq.decoder_ch_mult[0]


# the parts each kind of graph holds
GRAPH_PARTS: dict[str, tuple[str, ...]] = {
    "prefill": ("layers", "norm", "head", "cls_embedding", "rope"),
    "step": ("layers", "norm", "head", "tok_embeddings", "rope"),
    "verify": ("layers", "norm", "head", "tok_embeddings", "rope"),
    "draft": ("drafter", "drafter_embed", "head", "rope"),
    "drafter_prefill": ("drafter", "drafter_embed", "prompt_table", "rope"),
    "vq_decode": ("vq_decoder",),
    "text_encoder": ("text_encoder",),
}
TARGET_KINDS = ("prefill", "step", "verify")
DRAFTER_KINDS = ("draft", "drafter_prefill")


def graph_precision(kind: str, precision: Precision) -> Precision:
    """The precision a graph of ``kind`` runs in within a bundle of ``precision``: the target's
    graphs in it, the drafter's in its ``drafter`` precision, the VQ decoder and text encoder
    in fp32."""
    if kind in TARGET_KINDS:
        return precision
    return PRECISIONS[precision.drafter] if kind in DRAFTER_KINDS else PRECISIONS["fp32"]


@dataclass(frozen=True)
class TreeShape:
    """A tree of the export: nodes with the root, depth, levels of more than one node, and its
    drafting and verify graphs' names (None: the bundle has none)."""

    name: str
    nodes: int
    depth: int
    wide: int
    draft: str | None
    verify: str | None

    @classmethod
    def of(
        cls, name: str, paths: Sequence[Sequence[int]], draft: str | None, verify: str | None
    ) -> TreeShape:
        """The shape of the tree of these ``paths`` (each node's path from the root)."""
        depths = [len(path) for path in paths]
        wide = sum(depths.count(d) > 1 for d in set(depths))
        return cls(name, len(paths) + 1, paths_depth(paths), wide, draft, verify)


@dataclass(frozen=True)
class ExportLayout:
    """What shapes a bundle's graph set: its batch sizes, cache (capacity, windows, the
    condition prefix), CFG rows, trees, drafter and text encoder."""

    batch_sizes: tuple[int, ...]
    capacity: int
    windows: tuple[int, ...]
    cls_token_num: int
    drafter_capacity: int
    guided: bool
    trees: tuple[TreeShape, ...]
    drafter: bool
    text_encoder: bool

    def rows(self, batch: int) -> int:
        """Rows a call of ``batch`` images runs: two per image with guidance."""
        return 2 * batch if self.guided else batch


@dataclass(frozen=True)
class GraphShape:
    """One graph of the bundle: its kind, batch size (None: run once per image, any batch),
    query tokens per row and the cache slots it reads (``window``; ``full``: all of them)."""

    name: str
    kind: str
    batch: int | None
    tokens: int
    window: int
    full: bool = True
    tree: TreeShape | None = None


def graph_shapes(layout: ExportLayout) -> list[GraphShape]:
    """Every graph a bundle of ``layout`` holds (the exporter's set, which the bundle's manifest
    must list): per batch size the prefill, AR's step and each verified tree's step once per
    cache window they can read, the drafter's prefill (a multi-slot prefix) and each tree's
    drafting graph; once, the VQ decoder and the text encoder."""
    found = []
    cap, cls, drafted = layout.capacity, layout.cls_token_num, layout.drafter_capacity
    for b in layout.batch_sizes:
        found.append(GraphShape(batched_name(PREFILL_GRAPH, b), "prefill", b, cls, cls))
        steps: list[tuple[str, str, int, TreeShape | None]] = [(AR_STEP_GRAPH, "step", 1, None)]
        steps += [(t.verify, "verify", t.nodes, t) for t in layout.trees if t.verify]
        for name, kind, tokens, tree in steps:
            for w in step_windows(layout.windows, cls, tree.depth if tree else 0):
                step = batched_name(windowed_name(name, w, cap), b)
                found.append(GraphShape(step, kind, b, tokens, w, w == cap, tree))
        if layout.drafter and cls > 1:
            found.append(
                GraphShape(batched_name(DRAFTER_PREFILL_GRAPH, b), "drafter_prefill", b, cls, drafted)
            )
        for t in layout.trees:
            if t.draft:
                found.append(GraphShape(batched_name(t.draft, b), "draft", b, t.nodes, drafted, True, t))
    found.append(GraphShape(VQ_DECODE_GRAPH, "vq_decode", None, 0, 0))
    if layout.text_encoder:
        found.append(GraphShape(TEXT_ENCODER_GRAPH, "text_encoder", None, cls, cls))
    return found


def activation_bytes(g: GraphShape, model: ModelShape, layout: ExportLayout, element: int, batch: int) -> int:
    """An estimate of the activations one call of graph ``g`` keeps alive at once, with
    ``element`` bytes per activation, at ``batch`` images: the residual stream, a normed copy and
    the widest projection of each query token; the attention scores over the cache slots it
    reads (fp32, one layer at a time); the K/V it returns for every layer; and the fp32
    vocabulary-sized tensors of sampling and acceptance (logits, target and draft probabilities,
    noise). The VQ decoder: its widest blocks at full resolution, fp32."""
    if g.kind == "vq_decode":
        return VQ_LIVE_TENSORS * 4 * batch * _vq_full_channels(model.vq) * model.image_size**2
    c = model.gpt
    if g.kind == "text_encoder":
        return 4 * g.tokens * (2 * c.caption_dim + 4 * c.caption_dim)  # T5's widest: a 2.5x FFN pair
    rows, layers = layout.rows(batch), c.n_layer
    if g.kind in DRAFTER_KINDS:
        layers = model.drafter_layers
    query = rows * g.tokens
    widest = max((c.n_head + 2 * c.kv_heads) * c.head_dim, 2 * c.ffn_hidden)
    hidden = element * query * (2 * c.dim + widest)
    scores = 4 * rows * c.n_head * g.tokens * g.window
    new_kv = element * 2 * layers * query * c.kv_heads * c.head_dim
    positions = 1 if g.kind == "prefill" else g.tokens
    vocab = 4 * c.vocab_size * positions * (rows + 3 * batch) if g.kind != "drafter_prefill" else 0
    return hidden + scores + new_kv + vocab


def kv_bytes(
    model: ModelShape, layout: ExportLayout, batch: int, element: int, drafter_element: int
) -> tuple[int, int]:
    """The target's and the drafter's KV caches at ``batch`` images: K and V of every layer, for
    each row, at the cache's full capacity."""
    c, rows = model.gpt, layout.rows(batch)
    per_slot = 2 * rows * c.kv_heads * c.head_dim
    target = per_slot * c.n_layer * layout.capacity * element
    drafter = per_slot * model.drafter_layers * layout.drafter_capacity * drafter_element
    return target, drafter


@dataclass
class GraphPlan:
    """One graph's plan: its weights, kernels, predicted and built size, and activations."""

    shape: GraphShape
    weights: int
    kernels: int
    predicted: int
    built: int | None
    activations: int

    @property
    def size(self) -> int:
        """The plan's size: as built where it was, else as predicted."""
        return self.predicted if self.built is None else self.built


@dataclass
class PrecisionPlan:
    """A bundle of one precision: its graphs' plans, KV caches per batch size and the
    neighbour table; ``refused`` says why TensorRT cannot build it (then there are no plans)."""

    precision: str
    graphs: list[GraphPlan]
    kv: dict[int, tuple[int, int]]
    neighbours: int
    refused: str | None = None

    def loaded(self, batch: int) -> list[GraphPlan]:
        """The plans a run at ``batch`` images per call loads: that batch size's and the shared ones."""
        return [g for g in self.graphs if g.shape.batch in (None, batch)]

    def need(self, batch: int) -> int | None:
        """Device memory a run at ``batch`` images per call takes (None: no plans)."""
        if self.refused is not None:
            return None
        graphs = self.loaded(batch)
        return sum(g.size + g.activations for g in graphs) + sum(self.kv[batch]) + self.neighbours

    def build_peak(self) -> int | None:
        """Host memory the largest plan's TensorRT for RTX build peaks at."""
        return None if self.refused is not None else build_peak(max(g.size for g in self.graphs))


def build_peak(plan: int) -> int:
    """Peak host memory of a TensorRT for RTX build that writes a plan of ``plan`` bytes."""
    return BUILD_BASE + round(BUILD_PER_PLAN_BYTE * plan)


@dataclass
class MemoryPlan:
    """What a model or bundle needs, per precision and batch size (see the module docstring)."""

    source: str  # "bundle", "model directory" or "published shapes"
    where: str
    model: ModelShape
    layout: ExportLayout
    parameters: dict[str, int]
    weights: dict[str, int]  # bytes of one copy of every weight, per precision
    precisions: dict[str, PrecisionPlan]
    built_from: str | None = None
    notes: list[str] = field(default_factory=list)

    def fits(self, device: Device, precision: str, batch: int) -> bool | None:
        """Whether a run fits ``device``'s usable memory (None: no plans to run)."""
        need = self.precisions[precision].need(batch)
        return None if need is None else need <= device.usable


PARAMETER_PARTS = {
    "target": ("layers", "norm", "head", "tok_embeddings", "cls_embedding"),
    "drafter": ("drafter", "drafter_embed"),
    "vq_decoder": ("vq_decoder",),
    "text_encoder": ("text_encoder",),
}


def weight_summary(parts: dict[str, list[Weight]]) -> tuple[dict[str, int], dict[str, int]]:
    """(parameters by model part, bytes of one copy of them per precision: the target's and
    drafter's in it, the VQ decoder and text encoder in fp32)."""
    params = {k: sum(w.numel for name in names for w in parts[name]) for k, names in PARAMETER_PARTS.items()}
    fp32 = PRECISIONS["fp32"]
    per_precision = {}
    for p in PRECISIONS.values():
        target = stored_bytes([w for name in PARAMETER_PARTS["target"] for w in parts[name]], p)
        drafter = stored_bytes(
            [w for name in PARAMETER_PARTS["drafter"] for w in parts[name]], PRECISIONS[p.drafter]
        )
        rest = stored_bytes(parts["vq_decoder"] + parts["text_encoder"], fp32)
        per_precision[p.name] = target + drafter + rest
    return params, per_precision


def precision_plan(
    model: ModelShape,
    layout: ExportLayout,
    precision: Precision,
    parts: dict[str, list[Weight]],
    neighbours: int,
    measured: dict[str, int] | None = None,
    built: dict[str, int] | None = None,
) -> PrecisionPlan:
    """The plan of a bundle of ``layout`` in ``precision``: each graph's weights (``measured``
    from its ONNX file where given, else counted from ``parts``), kernels, predicted size,
    ``built`` size where known, and activations; the KV caches per batch size."""
    graphs = []
    for g in graph_shapes(layout):
        p = graph_precision(g.kind, precision)
        if measured is not None:
            weights = measured[g.name]
        else:
            weights = sum(stored_bytes(parts[name], p) for name in GRAPH_PARTS[g.kind])
        tree = (g.tree.depth, g.tree.wide) if g.tree else (0, 0)
        count = kernels(g.kind, p.kernels, model.gpt.n_layer, g.full, *tree)
        batch = g.batch or 1  # the VQ decoder and the text encoder take one image or prompt a call
        graphs.append(
            GraphPlan(
                g,
                weights,
                count,
                plan_bytes(weights, count),
                None if built is None else built.get(g.name),
                activation_bytes(g, model, layout, p.element, batch),
            )
        )
    drafter_element = PRECISIONS[precision.drafter].element
    kv = {b: kv_bytes(model, layout, b, precision.element, drafter_element) for b in layout.batch_sizes}
    return PrecisionPlan(precision.name, graphs, kv, neighbours)


# -- from a bundle ------------------------------------------------------------------------------


def bundle_plan(bundle: Bundle) -> MemoryPlan:
    """The memory plan of an opened bundle: its graphs' weights read from their ONNX files, its
    built plans' sizes where ``engines.json`` lists them."""
    from lantern_rt.families.loading import bundle_info

    c = bundle.constants
    trees = tuple(TreeShape.of(t.name, t.paths, t.graph, t.verify) for t in bundle.trees.values())
    layout = ExportLayout(
        c.batch_sizes,
        c.cache_capacity,
        c.cache_windows,
        c.cls_token_num,
        c.drafter_capacity,
        c.guided,
        trees,
        c.drafter,
        TEXT_ENCODER_GRAPH in bundle.graphs,
    )
    shapes = graph_shapes(layout)
    drafts = [bundle.graph(g.name) for g in shapes if g.kind == "draft"]
    layers = sum(spec.name.startswith("past_k_") for spec in drafts[0].inputs) if drafts else 0
    measured = {g.name: graph_weights(bundle.file(bundle.graph(g.name))) for g in shapes}
    text = measured.get(TEXT_ENCODER_GRAPH, 0) // 4
    md = bundle_info(bundle)
    model = ModelShape(bundle.model_name, bundle.family, bundle.gpt, md.vq, bundle.image_size, layers, text)
    parts = model_weights(model)
    params, weights = weight_summary(parts)
    neighbours = c.vocab_size * c.neighbors_k * INDEX_BYTES
    sets = built_plans(bundle)
    built_from, built = (sets[0][0], sets[0][1]) if sets else (None, None)
    notes = [f"also built: {name}" for name, _ in sets[1:]]
    precision = PRECISIONS.get(bundle.dtype)
    if precision is None or bundle.dtype in WEIGHT_ONLY_DTYPES or c.cache_scratch:
        why = (
            "its steps write the KV cache in place (onnxruntime only)"
            if c.cache_scratch
            else f"its graphs are {bundle.dtype} (onnxruntime's MatMulNBits)"
        )
        plan = PrecisionPlan(bundle.dtype, [], {}, neighbours, f"TensorRT cannot build this bundle: {why}")
    else:
        plan = precision_plan(model, layout, precision, parts, neighbours, measured, built)
    return MemoryPlan(
        "bundle", str(bundle.path), model, layout, params, weights, {bundle.dtype: plan}, built_from, notes
    )


# -- from a model's configuration ------------------------------------------------------------


def model_layout(
    model: ModelShape, trees: Sequence[str], batch_sizes: Sequence[int], windows: int, guided: bool = True
) -> ExportLayout:
    """The layout of the bundle ``lantern export`` writes for ``model`` with these trees, batch
    sizes and cache windows (every tree drafted and verified with a drafter; without one, only
    Jacobi windows are verified: the exporter's ``verified``, which only the command line may
    import)."""
    from lantern_rt.runtime.drafting import MAX_DRAFT_WIDTH, drafter_capacity
    from lantern_rt.runtime.jacobi import is_window
    from lantern_rt.runtime.kv_cache import cache_windows
    from lantern_rt.runtime.tree import load_tree

    c = model.gpt
    capacity = c.cls_token_num + c.block_size
    shapes = []
    for i, name in enumerate(trees):
        tree = load_tree(name, max_width=MAX_DRAFT_WIDTH)
        draft = draft_graph_name(i) if model.drafter_layers else None
        verify = verify_graph_name(i) if model.drafter_layers or is_window(tree) else None
        shapes.append(TreeShape.of(name, tree.paths, draft, verify))
    return ExportLayout(
        tuple(batch_sizes),
        capacity,
        cache_windows(capacity, windows),
        c.cls_token_num,
        drafter_capacity(c.cls_token_num, c.block_size),
        guided,
        tuple(shapes),
        model.drafter_layers > 0,
        model.text_encoder_params > 0,
    )


def model_plan(
    model: ModelShape,
    layout: ExportLayout,
    source: str,
    where: str,
    precisions: Sequence[str] = tuple(PRECISIONS),
) -> MemoryPlan:
    """The memory plan of the bundles of ``layout`` that ``model`` would export, one per
    precision, every weight counted from its shapes."""
    parts = model_weights(model)
    params, weights = weight_summary(parts)
    k = min(EXPORT_NEIGHBORS_K, model.gpt.vocab_size - 1)
    neighbours = model.gpt.vocab_size * k * INDEX_BYTES
    plans = {p: precision_plan(model, layout, PRECISIONS[p], parts, neighbours) for p in precisions}
    return MemoryPlan(source, where, model, layout, params, weights, plans)


def dir_model(path: Path) -> ModelShape:
    """A model directory's shape from its configuration (no weights are read): the target, its
    tokenizer, the drafter's layers when it has one, a text-to-image model's T5 encoder."""
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.models.config import read_json

    md = open_model_dir(path)
    layers = 0
    if "drafter" in md.files:
        folder = md.path("drafter")
        raw = read_json(folder / "config.json") if folder.is_dir() else md.raw.get("drafter", {})
        layers = int(raw.get("num_hidden_layers", 1))
    text = 0
    if md.gpt.model_type == "t2i" and "t5" in md.files:
        text = t5_encoder_params(read_json(md.path("t5") / "config.json"))
    return ModelShape(md.name, md.family, md.gpt, md.vq, md.image_size, layers, text)


def t5_encoder_params(config: dict[str, Any]) -> int:
    """Parameters of a T5 encoder from its Hugging Face ``config.json``: the shared embedding, per
    layer attention (q, k, v, o), the feed-forward (gated: two input matrices) and two norms,
    the relative position buckets and the final norm."""
    d, heads = config["d_model"], config["num_heads"]
    inner = heads * config.get("d_kv", d // heads)
    gated = str(config.get("feed_forward_proj", "relu")).startswith("gated")
    layer = 4 * d * inner + (3 if gated else 2) * d * config["d_ff"] + 2 * d
    buckets = config.get("relative_attention_num_buckets", 32) * heads
    return config["vocab_size"] * d + config["num_layers"] * layer + buckets + d
