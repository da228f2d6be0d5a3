"""The demo target's layers in standard ONNX (as the bundles export them) against the same layers
written with onnxruntime's CPU contrib operators or with the cache written in place, timed alternately in
onnxruntime (one thread unless told).

    .venv/bin/python scripts/ort_contrib_layers.py [--rounds 40] [--calls 20] [--cache 128] [--cache-windows 4] [--threads 1]

Standard: ``export.graph_forward.Blocks`` of the demo target (every layer, no embedding or head)
exported as a bundle exports it (dynamo, opset 18), reading each layer's cache [B, Hkv, P, D]
as an input and returning the new rows' K/V [n_layer, B, Hkv, S, D].

The same function built node by node three ways, per layer SkipSimplifiedLayerNormalization
(the residual add and RMSNorm in one), the q/k/v MatMul, the attention, the wo MatMul,
SkipSimplifiedLayerNormalization, the gate/up MatMul, the SwiGLU glue and the w2 MatMul, with
the attention as:
- "contrib": a Split, one RotaryEmbedding over q and k (interleaved pairs, the model's own
  cos/sin table), a Split, MultiHeadAttention (past_key/past_value = the cache,
  attention_bias = the step's additive mask);
- "gqa" (AR step only: GroupQueryAttention refuses more than one new row over a past at B > 1):
  GroupQueryAttention on the packed q/k/v, rotary inside, the new K/V sliced from its presents;
- "rope+norm": the bundles' own layout and attention (heads first, scores against the cache and
  the new keys apart, then joined: the cache is never copied), RoPE as one RotaryEmbedding.
- "in-place" (opset 24): q, k, v as in "contrib", k and v written into each layer's cache
  [B, P, H * D] at the rows' length by TensorScatter, the cache bound as its own output (so
  onnxruntime writes it in place), then one Attention over the whole cache.
On the CPU both contrib attention operators ignore ``past_key``/``past_value`` unless they also write
``present_key``/``present_value``, the cache and the new rows joined: a copy of each layer's
cache every call. Every variant's outputs are compared with torch before timing.

Calls: an AR step (1 new row) and a chain-5 verify (6 new rows, causal among them), 2 CFG rows,
over a cache of ``--cache`` committed entries, in the cache window that holds them (of the
default ``--cache-windows``; 144 slots for 128 entries).
Each round times every variant in turn; a ratio is the median over rounds of variant / standard in
the same round, so load that drifts between rounds cancels.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import Tensor, nn

from lantern_rt.export.graph_forward import Blocks
from lantern_rt.export.graphs import cache_capacity
from lantern_rt.families.loading import load_target, open_model_dir
from lantern_rt.runtime.drafting import Context
from lantern_rt.runtime.kv_cache import cache_windows
from lantern_rt.runtime.run_shape import CACHE_WINDOWS

ROWS = 2  # CFG: conditional and unconditional rows
TOLERANCE = 1e-4  # largest fp32 difference from torch allowed before timing
VARIANTS = {"standard": None, "contrib": "mha", "rope+norm": "split", "gqa": "gqa", "in-place": "inplace"}


class StandardLayers(nn.Module):
    """The layers as the bundles' graphs compute them: h, positions [B, S], mask, per-layer caches."""

    def __init__(self, blocks: Blocks):
        super().__init__()
        self.blocks = blocks

    def forward(self, h: Tensor, positions: Tensor, mask: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        return self.blocks(h, positions, mask, Context.of_cache(list(past[0::2]), list(past[1::2])))


def input_names(n_layer: int) -> list[str]:
    return ["h", "positions", "mask"] + [f"past_{kv}_{i}" for i in range(n_layer) for kv in "kv"]


def export_standard(blocks: Blocks, inputs: tuple[Tensor, ...], path: Path) -> None:
    torch.onnx.export(
        StandardLayers(blocks).eval(),
        inputs,
        str(path),
        input_names=input_names(len(blocks.blocks)),
        output_names=["h_out", "new_k", "new_v"],
        opset_version=18,
        dynamo=True,
        external_data=False,
        verbose=False,
    )


def build_contrib(
    blocks: Blocks, table: Tensor, shapes: dict[str, list[int]], path: Path, attention: str
) -> None:
    """The contrib-operator graph of ``blocks`` (``table``: the model's RoPE table [rows, D/2, 2]);
    ``attention``: "mha" (MultiHeadAttention), "gqa" (GroupQueryAttention, RoPE inside it) or
    "split" (standard ops as the bundles write it, RoPE by RotaryEmbedding)."""
    first = blocks.blocks[0]
    n_head, n_kv, d = first.n_head, first.n_kv, first.head_dim
    if n_kv != n_head:
        raise SystemExit("this measurement builds MultiHeadAttention: the demo has as many kv heads as heads")
    dim = n_head * d
    nodes, inits = [], []

    def const(name: str, value: Tensor | np.ndarray) -> str:
        array = value.detach().numpy() if isinstance(value, Tensor) else value
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, ins: list[str], outs: list[str], domain: str = "", **attrs) -> list[str]:
        nodes.append(helper.make_node(op, ins, outs, domain=domain, name=f"{op}_{len(nodes)}", **attrs))
        return [o for o in outs if o]

    const("cos", table[..., 0].contiguous())
    const("sin", table[..., 1].contiguous())
    const("zero", np.zeros((), np.float32))
    const("lowest", np.array(np.finfo(np.float32).min, np.float32))
    b, s = shapes["h"][:2]
    n_layer = len(blocks.blocks)
    const("qk_v", np.array([2 * dim, dim], np.int64))
    const("q_k", np.array([dim, dim], np.int64))
    const("kv_bshd", np.array([n_layer, b, s, n_kv, d], np.int64))
    const("kv_bhsd", np.array([n_layer, b, n_kv, s, d], np.int64))
    const("scale", np.array(d**-0.5, np.float32))
    const(
        "qkv_heads",
        np.array([b, n_head + 2 * n_kv, 1, d] if s == 1 else [b, s, n_head + 2 * n_kv, d], np.int64),
    )
    const("qk_v_heads", np.array([n_head + n_kv, n_kv], np.int64))
    const("q_k_heads", np.array([n_head, n_kv], np.int64))
    const("rows", np.array([b, s, dim], np.int64))
    past = shapes["past_k_0"][2] if "past_k_0" in shapes else 0
    const("p_s", np.array([past, s], np.int64))
    const("seqlens", np.full(b, past + s - 1, np.int32))
    const("total", np.array(past + s, np.int32))
    const("new_rows_start", np.array([past], np.int64))
    const("new_rows_end", np.array([past + s], np.int64))
    const("axis_2", np.array([2], np.int64))

    def rotated(p: str, qkv: str) -> None:
        """q, k, v [B, S, H * D] (names p + "q", "k", "v") from the packed qkv, q and k rotated."""
        node("Split", [qkv, "qk_v"], [p + "qk", p + "v"], axis=-1)
        node(
            "RotaryEmbedding",
            [p + "qk", "positions", "cos", "sin"],
            [p + "qk_r"],
            domain="com.microsoft",
            interleaved=1,
        )
        node("Split", [p + "qk_r", "q_k"], [p + "q", p + "k"], axis=-1)

    def qkv_mha(p: str, qkv: str, i: int) -> tuple[str, str, str]:
        """q, k, v [B, S, H * D], k rotated; MultiHeadAttention over the cache -> [B, S, H * D]."""
        rotated(p, qkv)
        # it reads the past only when it also writes the presents (the cache and the new rows)
        node(
            "MultiHeadAttention",
            [p + "q", p + "k", p + "v", "", "", "bias", f"past_k_{i}", f"past_v_{i}"],
            [p + "attn", p + "present_k", p + "present_v"],
            domain="com.microsoft",
            num_heads=n_head,
        )
        return p + "attn", p + "k", p + "v"

    def qkv_gqa(p: str, qkv: str, i: int) -> tuple[str, str, str]:
        """Packed q/k/v into GroupQueryAttention (rotary inside, bias as the mask, not causal);
        the new k, v [B, H, S, D] sliced from its presents (the cache and the new rows joined)."""
        node(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                f"past_k_{i}",
                f"past_v_{i}",
                "seqlens",
                "total",
                "cos",
                "sin",
                "positions",
                "bias",
            ],
            [p + "attn", p + "present_k", p + "present_v"],
            domain="com.microsoft",
            num_heads=n_head,
            kv_num_heads=n_kv,
            do_rotary=1,
            rotary_interleaved=1,
            causal=0,
        )
        for t in ("k", "v"):
            node("Slice", [p + "present_" + t, "new_rows_start", "new_rows_end", "axis_2"], [p + t])
        return p + "attn", p + "k", p + "v"

    def qkv_split(p: str, qkv: str, i: int) -> tuple[str, str, str]:
        """The bundles' layout and attention (heads first; scores against the cache and the new
        keys apart, joined), with RoPE as one RotaryEmbedding -> [B, S, H * D], k, v [B, H, S, D]."""
        node("Reshape", [qkv, "qkv_heads"], [p + "qkv_h"])
        if s > 1:
            node("Transpose", [p + "qkv_h"], [p + "qkv_t"], perm=[0, 2, 1, 3])
        node("Split", [p + ("qkv_t" if s > 1 else "qkv_h"), "qk_v_heads"], [p + "qk", p + "v"], axis=1)
        node(
            "RotaryEmbedding",
            [p + "qk", "positions", "cos", "sin"],
            [p + "qk_r"],
            domain="com.microsoft",
            interleaved=1,
        )
        node("Split", [p + "qk_r", "q_k_heads"], [p + "q", p + "k"], axis=1)
        node("Mul", [p + "q", "scale"], [p + "qs"])
        node("Transpose", [f"past_k_{i}"], [p + "pkt"], perm=[0, 1, 3, 2])
        node("Transpose", [p + "k"], [p + "kt"], perm=[0, 1, 3, 2])
        node("MatMul", [p + "qs", p + "pkt"], [p + "s_past"])
        node("MatMul", [p + "qs", p + "kt"], [p + "s_new"])
        node("Concat", [p + "s_past", p + "s_new"], [p + "scores"], axis=-1)
        node("Add", [p + "scores", "bias"], [p + "biased"])
        node("Softmax", [p + "biased"], [p + "probs"], axis=-1)
        node("Split", [p + "probs", "p_s"], [p + "p_past", p + "p_new"], axis=-1)
        node("MatMul", [p + "p_past", f"past_v_{i}"], [p + "o_past"])
        node("MatMul", [p + "p_new", p + "v"], [p + "o_new"])
        node("Add", [p + "o_past", p + "o_new"], [p + "o_h"])
        if s > 1:
            node("Transpose", [p + "o_h"], [p + "o_t"], perm=[0, 2, 1, 3])
        node("Reshape", [p + ("o_t" if s > 1 else "o_h"), "rows"], [p + "attn"])
        return p + "attn", p + "k", p + "v"

    def qkv_inplace(p: str, qkv: str, i: int) -> tuple[str, str, str]:
        """q, k, v [B, S, H * D], k rotated; k and v written into the layer's cache [B, P, H * D]
        at each row's length by TensorScatter (in place: the cache is bound as its output too),
        then the opset-24 Attention over the whole cache -> [B, S, H * D]."""
        rotated(p, qkv)
        node("TensorScatter", [f"cache_k_{i}", p + "k", "lengths"], [f"cache_k_{i}_out"], axis=1)
        node("TensorScatter", [f"cache_v_{i}", p + "v", "lengths"], [f"cache_v_{i}_out"], axis=1)
        node(
            "Attention",
            [p + "q", f"cache_k_{i}_out", f"cache_v_{i}_out", "mask"],
            [p + "attn"],
            q_num_heads=n_head,
            kv_num_heads=n_kv,
        )
        return p + "attn", p + "k", p + "v"

    if attention != "inplace":
        node("Where", ["mask", "zero", "lowest"], ["bias"])  # [B, 1, S, P + S], once per step
    x, mlp, new_k, new_v = "h", None, [], []
    for i, block in enumerate(blocks.blocks):
        p = f"l{i}_"
        if mlp is None:
            (h,) = node(
                "SimplifiedLayerNormalization",
                [x, const(p + "attn_g", block.attn_norm.weight)],
                [p + "h"],
                axis=-1,
                epsilon=block.attn_norm.eps,
                stash_type=1,
            )
        else:
            h, x = node(
                "SkipSimplifiedLayerNormalization",
                [mlp, x, const(p + "attn_g", block.attn_norm.weight)],
                [p + "h", "", "", p + "x"],
                domain="com.microsoft",
                epsilon=block.attn_norm.eps,
            )
        (qkv,) = node("MatMul", [h, const(p + "wqkv", block.wqkv.T)], [p + "qkv"])
        attend = {"mha": qkv_mha, "gqa": qkv_gqa, "split": qkv_split, "inplace": qkv_inplace}[attention]
        attn, k, v = attend(p, qkv, i)
        node("MatMul", [attn, const(p + "wo", block.wo.weight.T)], [p + "o"])
        node(
            "SkipSimplifiedLayerNormalization",
            [p + "o", x, const(p + "ffn_g", block.ffn_norm.weight)],
            [p + "h2", "", "", p + "x2"],
            domain="com.microsoft",
            epsilon=block.ffn_norm.eps,
        )
        x = p + "x2"
        node("MatMul", [p + "h2", const(p + "w13", block.w13.T)], [p + "gu"])
        node("Split", [p + "gu"], [p + "gate", p + "up"], axis=-1, num_outputs=2)
        node("Sigmoid", [p + "gate"], [p + "sig"])
        node("Mul", [p + "gate", p + "sig"], [p + "silu"])
        node("Mul", [p + "silu", p + "up"], [p + "m"])
        (mlp,) = node("MatMul", [p + "m", const(p + "w2", block.w2.weight.T)], [p + "mlp"])
        new_k.append(k)
        new_v.append(v)
    node("Add", [mlp, x], ["h_out"])
    if attention == "inplace":
        outputs = ["h_out"] + [f"cache_{kv}_{i}_out" for i in range(n_layer) for kv in "kv"]
        save(nodes, inits, shapes, outputs, path, opset=24)
        return
    for name, rows in (("new_k", new_k), ("new_v", new_v)):
        node("Concat", rows, [name + "_rows"], axis=0)  # [L * B, S, H * D] or [L * B, H, S, D]
        if attention == "mha":
            node("Reshape", [name + "_rows", "kv_bshd"], [name + "_5d"])
            node("Transpose", [name + "_5d"], [name], perm=[0, 1, 3, 2, 4])
        else:
            node("Reshape", [name + "_rows", "kv_bhsd"], [name])
    save(nodes, inits, shapes, ["h_out", "new_k", "new_v"], path, opset=18)


def save(
    nodes: list, inits: list, shapes: dict[str, list[int]], outputs: list[str], path: Path, opset: int
) -> None:
    types = {"positions": TensorProto.INT64, "lengths": TensorProto.INT64, "mask": TensorProto.BOOL}
    graph = helper.make_graph(
        nodes,
        "contrib_layers",
        [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), s) for n, s in shapes.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    onnx.save(model, str(path))


def session(path: Path, optimized: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def call_inputs(model, new: int, cache: int, windows: int) -> tuple[Tensor, ...]:
    """Inputs of a call of ``new`` rows after ``cache`` committed entries, the cache as long as
    the first of ``windows`` cache windows that holds them and the new rows."""
    c = model.config
    capacity = next(w for w in cache_windows(cache_capacity(model), windows) if w >= cache + new)
    g = torch.Generator().manual_seed(new)
    h = torch.randn(ROWS, new, c.dim, generator=g)
    positions = torch.arange(cache, cache + new).expand(ROWS, -1).contiguous()
    past = (torch.arange(capacity) < cache).expand(new, -1)
    mask = torch.cat([past, torch.ones(new, new, dtype=torch.bool).tril()], dim=-1)[None, None]
    mask = mask.expand(ROWS, -1, -1, -1).contiguous()
    caches = [torch.randn(ROWS, c.kv_heads, capacity, c.head_dim, generator=g) for _ in range(2 * c.n_layer)]
    return (h, positions, mask, *caches)


def in_place_inputs(inputs: tuple[Tensor, ...], cache: int) -> dict[str, np.ndarray]:
    """The in-place variant's feeds for the same call: each layer's cache [B, P, H * D] holding
    the same committed entries, the new rows' slots at ``cache``.., the mask over the cache."""
    h, positions, mask, *past = inputs
    b, new = positions.shape
    capacity = past[0].shape[2]
    slots = torch.arange(capacity)
    own = (slots[None] >= cache) & (slots[None] <= positions[0][:, None])  # causal among the new rows
    rows = (slots < cache)[None] | own
    feeds = {
        "h": h.numpy(),
        "positions": positions.numpy(),
        "mask": rows[None, None].expand(b, -1, -1, -1).contiguous().numpy(),
        "lengths": np.full(b, cache, np.int64),
    }
    for i, t in enumerate(past):
        feeds[f"cache_{'kv'[i % 2]}_{i // 2}"] = (
            t.transpose(1, 2).reshape(b, capacity, -1).contiguous().numpy()
        )
    return feeds


def bound_in_place(
    s: ort.InferenceSession, feeds: dict[str, np.ndarray], cache: int, heads: int
) -> tuple[object, list[np.ndarray]]:
    """A call of ``s`` with every cache bound as its own output (written in place), and the
    first call's outputs in the standard variant's layout: h_out, new_k and new_v [L, B, H, S, D]."""
    binding = s.io_binding()
    caches = {}
    for name, array in feeds.items():
        if name.startswith("cache_"):
            caches[name] = ort.OrtValue.ortvalue_from_numpy(array.copy())
            binding.bind_ortvalue_input(name, caches[name])
            binding.bind_ortvalue_output(name + "_out", caches[name])
        else:
            binding.bind_cpu_input(name, array)
    binding.bind_output("h_out")
    s.run_with_iobinding(binding)
    h_out = binding.get_outputs()[-1].numpy()  # outputs come in the order they were bound
    b, new = feeds["positions"].shape

    def rows(kv: str) -> np.ndarray:
        layers = [
            v.numpy()[:, cache : cache + new] for n, v in caches.items() if n.startswith(f"cache_{kv}_")
        ]
        return np.stack([r.reshape(b, new, heads, -1).transpose(0, 2, 1, 3) for r in layers])

    return (lambda: s.run_with_iobinding(binding)), [h_out, rows("k"), rows("v")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="rounds, the variants alternated in each")
    parser.add_argument("--calls", type=int, default=20, help="calls of each variant per round")
    parser.add_argument("--cache", type=int, default=128, help="committed cache entries")
    parser.add_argument("--cache-windows", type=int, default=CACHE_WINDOWS)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_target(open_model_dir())
    blocks = Blocks.of_target(model).eval()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for label, new in (("AR step", 1), ("chain-5 verify", 6)):
            inputs = call_inputs(model, new, args.cache, args.cache_windows)
            names = input_names(model.config.n_layer)
            feeds = {n: t.numpy() for n, t in zip(names, inputs, strict=True)}
            shapes = {n: list(t.shape) for n, t in zip(names, inputs, strict=True)}
            # GroupQueryAttention: "batch_size must be 1 when sequence_length > 1 and past context is given"
            variants = [v for v in VARIANTS if v != "gqa" or new == 1]
            paths = {v: Path(tmp) / f"{v}_{new}.onnx" for v in variants}
            export_standard(blocks, inputs, paths["standard"])
            in_place = in_place_inputs(inputs, args.cache)
            in_place_shapes = {n: list(a.shape) for n, a in in_place.items()}
            for v in variants[1:]:
                build_contrib(
                    blocks,
                    model.freqs_cis,
                    in_place_shapes if v == "in-place" else shapes,
                    paths[v],
                    VARIANTS[v],
                )
            sessions = {
                v: session(p, Path(tmp) / f"{v}_{new}_opt.onnx", args.threads) for v, p in paths.items()
            }
            reference = [t.numpy() for t in StandardLayers(blocks)(*inputs)]
            calls = {v: (lambda s=s, feeds=feeds: s.run(None, feeds)) for v, s in sessions.items()}
            for v, s in sessions.items():
                if v == "in-place":
                    calls[v], outs = bound_in_place(s, in_place, args.cache, model.config.kv_heads)
                else:
                    outs = s.run(None, feeds)
                worst = max(float(np.abs(o - r).max()) for o, r in zip(outs, reference, strict=True))
                graph = onnx.load(str(Path(tmp) / f"{v}_{new}_opt.onnx"), load_external_data=False).graph
                ops = collections.Counter(n.op_type for n in graph.node)
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common())
                print(f"{label} {v}: {len(graph.node)} nodes, max |diff| vs torch {worst:.2e} ({top})")
                if not worst < TOLERANCE:
                    raise SystemExit(f"{label} {v}: outputs differ from torch by {worst:.2e}")
            times = {v: [] for v in sessions}
            for r in range(args.rounds):
                turn = r % len(variants)
                for v in variants[turn:] + variants[:turn]:  # each first in turn
                    call = calls[v]
                    call()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    times[v].append((time.perf_counter() - start) / args.calls * 1e3)
            med = {v: float(np.median(t)) for v, t in times.items()}
            ratio = {v: float(np.median(np.divide(t, times["standard"]))) for v, t in times.items()}
            parts = ", ".join(f"{v} {med[v]:.3f} ms ({ratio[v]:.2f})" for v in sessions)
            print(
                f"{label}: {parts}; medians over {args.rounds} rounds of {args.calls} calls each, {args.threads} thread(s)"
            )


if __name__ == "__main__":
    main()
