"""The transformer forward as the exported graphs compute it: the same function as the models'
``step``, written in fewer, larger ONNX nodes.

On a CPU a small model's step costs about as much per node as per FLOP, so the graphs:
- fuse the q/k/v and gate/up projections into one matmul each;
- rotate q and k together (RoPE as ``x * cos + (x @ swap) * sin``, cos and sin gathered once
  per step);
- lay heads out with reshapes alone where a step has one new row per sequence (an AR step);
- attend over the cache without copying it: scores against the past and against the new keys
  are computed apart and joined (the cache is an input per layer, never split or concatenated);
- write RMSNorm in the pattern onnxruntime fuses into one kernel;
- keep scores and softmax in fp32 whatever the graph's dtype.
Each graph is compared with the torch model's ``step`` before a bundle is written.

A bundle exported with its cache written in place (onnxruntime only, opset 24; docs/method.md §6)
has target steps and drafting calls that write their new K/V into their cache's scratch slots
with ``TensorScatter`` (onnxruntime writes into the bound cache itself) and attend over the
whole cache with one ``Attention`` op and one ``RotaryEmbedding`` per layer (:class:`InPlace`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import QK_NORM_EPS, RMSNorm, Transformer
from lantern_rt.runtime.drafting import Context


def rms_norm(x: Tensor, norm: RMSNorm) -> Tensor:
    """``norm(x)`` as Pow, ReduceMean, Add, Sqrt, Div, Mul: onnxruntime's SimplifiedLayerNorm pattern."""
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight


def heads_first(x: Tensor, *heads: int) -> Tensor:
    """[B, S, prod(heads) * D] -> [B, *heads, S, D]: a reshape and a transpose, or the reshape
    alone when S = 1."""
    b, s, _ = x.shape
    if s == 1:
        return x.reshape(b, *heads, 1, -1)
    return x.reshape(b, s, *heads, -1).movedim(1, -2)


def heads_last(x: Tensor) -> Tensor:
    """[B, H, S, D] -> [B, S, H * D]: a transpose and a reshape, or the reshape alone when S = 1."""
    b, _, s, _ = x.shape
    return x.reshape(b, s, -1) if s == 1 else x.transpose(1, 2).reshape(b, s, -1)


class Rope(nn.Module):
    """Interleaved-pair RoPE from a (cos, sin) table [rows, D/2, 2] (rows of zeros zero x), as
    ``x * cos + (x @ swap) * sin``."""

    def __init__(self, table: Tensor):
        super().__init__()
        rows, d = table.shape[0], table.shape[1] * 2
        # [rows, 2 * D]: each row's cos then sin, each angle repeated for its pair
        cos_sin = table.repeat_interleave(2, dim=1).transpose(1, 2).reshape(rows, 2 * d)
        self.register_buffer("table", cos_sin, persistent=False)
        swap = torch.zeros(d, d)
        even = torch.arange(0, d, 2)
        swap[even + 1, even] = -1.0  # out[2j]   = x[2j] cos - x[2j+1] sin
        swap[even, even + 1] = 1.0  # out[2j+1] = x[2j+1] cos + x[2j] sin
        self.register_buffer("swap", swap, persistent=False)
        self.register_buffer("halves", cos_sin[:, ::2].contiguous(), persistent=False)  # [rows, D]

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin rows [S, D] for ``positions`` [S], or [B, 1, S, D] for [B, S]: one Gather
        per step, laid out for :meth:`rotate` over [B, heads, S, D]."""
        rows = F.embedding(positions, self.table)  # one Gather (table[positions]: Unsqueeze + GatherND)
        if positions.dim() == 2:
            rows = rows.unsqueeze(1)
        cos, sin = rows.chunk(2, dim=-1)
        return cos, sin

    def half_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin [B, S, D/2] (one angle per pair) at ``positions`` [B, S]: one Gather per
        step, for :meth:`rotary`."""
        return F.embedding(positions, self.halves).chunk(2, dim=-1)

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """:meth:`rotate` as ONNX's ``RotaryEmbedding`` (opset 23, interleaved pairs) with
        :meth:`half_tables`' cos and sin."""
        return torch.onnx.ops.rotary_embedding(x, cos, sin, interleaved=True)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x`` [B, heads, S, D] (computed in fp32)."""
        xf = x if x.dtype == torch.float32 else x.float()
        out = xf * cos + torch.matmul(xf, self.swap) * sin
        return out if out.dtype == x.dtype else out.to(x.dtype)


def attention_bias(mask: Tensor, group: int) -> Tensor:
    """Additive fp32 bias [B, 1, group * S, P + S] from a bool mask [B, 1, S, P + S] (rows
    repeated for the ``group`` query heads that share a key head)."""
    bias = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    return bias.repeat(1, 1, group, 1) if group > 1 else bias


def attend(q: Tensor, k: Tensor, v: Tensor, past: list[tuple[Tensor, Tensor]], bias: Tensor) -> Tensor:
    """Attention of q [B, H, S, D] over blocks of past keys and values [B, Hkv, P_b, D] (the
    cache, then any rows computed earlier in the same graph) and the new k, v [B, Hkv, S, D].

    Query heads that share a key head are stacked as rows ([B, Hkv, H/Hkv * S, D]), so neither
    the cache nor the keys are repeated; scores against each block are joined, the blocks never
    are. Returns [B, S, H * D].
    """
    b, h, s, d = q.shape
    kv_heads = k.shape[1]
    qg = (q * d**-0.5).reshape(b, kv_heads, h // kv_heads * s, d)
    keys = [pk for pk, _ in past] + [k]
    scores = torch.cat([torch.matmul(qg, key.transpose(-2, -1)) for key in keys], dim=-1)
    probs = torch.softmax(scores.float() + bias, dim=-1).to(v.dtype)
    out, start = None, 0
    for key, value in [*past, (k, v)]:
        end = start + key.shape[2]
        part = torch.matmul(probs[..., start:end], value)
        out, start = part if out is None else out + part, end
    return heads_last(out.reshape(b, h, s, d))


class InPlace(NamedTuple):
    """A step's cache written in place: per layer K and V [B, Hkv, W + scratch, D] (the window,
    then the scratch slots), the step's new rows written from slot ``start`` (a [B] int64
    tensor, the window's size in every row)."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    start: Tensor


def scatter_rows(cache: Tensor, rows: Tensor, start: Tensor) -> Tensor:
    """``cache`` [B, H, P, D] with ``rows`` [B, H, S, D] written at slots ``start`` [B]..
    (modulo P: an idle row's length may be past its window): ONNX's ``TensorScatter`` (opset
    24, circular) in a graph, which onnxruntime runs in place on a cache bound as its own
    output; a new tensor in torch."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            "TensorScatter",
            (cache, rows, start),
            {"axis": 2, "mode": "circular"},
            dtype=cache.dtype,
            shape=cache.shape,
            version=24,
        )
    slots = (start[:, None] + torch.arange(rows.shape[2], device=rows.device)) % cache.shape[2]
    index = slots[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3])
    return cache.scatter(2, index, rows)


class Block(nn.Module):
    """A pre-norm Llama block (LlamaGen's, a Chameleon model's or the drafter's) with fused
    projections; ``qk_norm``, the per-head q and k LayerNorms' weights and biases stacked
    [H + Hkv, D] (Chameleon's), normalise q and k in one op."""

    def __init__(
        self,
        attn_norm: RMSNorm | None,
        wqkv: Tensor,
        wo: nn.Linear,
        ffn_norm: RMSNorm,
        w13: Tensor,
        w2: nn.Linear,
        heads: tuple[int, int, int],
        qk_norm: tuple[Tensor, Tensor] | None = None,
    ):
        super().__init__()
        self.attn_norm, self.wo, self.ffn_norm, self.w2 = attn_norm, wo, ffn_norm, w2
        # the model's own fused weights (an export holds many graphs of one model: no copies)
        self.register_buffer("wqkv", wqkv.detach(), persistent=False)
        self.register_buffer("w13", w13.detach(), persistent=False)
        self.n_head, self.n_kv, self.head_dim = heads
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:  # [H + Hkv, 1, D]: over q and k as [B, H + Hkv, S, D]
            self.register_buffer("qk_weight", qk_norm[0].detach()[:, None].clone(), persistent=False)
            self.register_buffer("qk_bias", qk_norm[1].detach()[:, None].clone(), persistent=False)

    def forward(
        self,
        x: Tensor,
        rope: Rope,
        cos: Tensor,
        sin: Tensor,
        bias: Tensor,
        past: list[tuple[Tensor, Tensor]],
        cache: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The block's output and its new K, V [B, Hkv, S, D]; with ``cache`` (K, V [B, Hkv,
        P, D] and the first new slot, :class:`InPlace`) the new K/V are written into it, the
        attention reads it whole under ``bias`` (a bool mask [B, 1, S, P]), and the cache is
        returned in their place."""
        h = x if self.attn_norm is None else rms_norm(x, self.attn_norm)
        qkv = heads_first(F.linear(h, self.wqkv), self.n_head + 2 * self.n_kv)
        qk, v = qkv.split([self.n_head + self.n_kv, self.n_kv], dim=1)
        if self.qk_norm:
            qk = F.layer_norm(qk, qk.shape[-1:], None, None, QK_NORM_EPS) * self.qk_weight + self.qk_bias
        if cache is None:
            q, k = rope.rotate(qk, cos, sin).split([self.n_head, self.n_kv], dim=1)
            attn = attend(q, k, v, past, bias)
        else:
            q, k = rope.rotary(qk, cos, sin).split([self.n_head, self.n_kv], dim=1)
            keys, values = scatter_rows(cache[0], k, cache[2]), scatter_rows(cache[1], v, cache[2])
            attn = heads_last(torch.onnx.ops.attention(q, keys, values, attn_mask=bias)[0])
            k, v = keys, values
        x = x + self.wo(attn)
        gate, up = F.linear(rms_norm(x, self.ffn_norm), self.w13).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up), k, v


def _qk_norm(attention: nn.Module) -> tuple[Tensor, Tensor]:
    q, k = attention.q_norm, attention.k_norm
    return torch.cat([q.weight, k.weight]), torch.cat([q.bias, k.bias])


class Blocks(nn.Module):
    """The layers of a target or drafter and its RoPE table, as one step function."""

    def __init__(self, blocks: list[Block], table: Tensor):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.rope = Rope(table)
        self.group = blocks[0].n_head // blocks[0].n_kv

    @classmethod
    def of_target(cls, model: Transformer) -> Blocks:
        c = model.config
        heads = (c.n_head, c.kv_heads, c.head_dim)
        blocks = [
            Block(
                layer.attention_norm,
                layer.attention.wqkv.weight,
                layer.attention.wo,
                layer.ffn_norm,
                layer.feed_forward.w13.weight,
                layer.feed_forward.w2,
                heads,
                _qk_norm(layer.attention) if c.qk_norm else None,
            )
            for layer in model.layers
        ]
        return cls(blocks, model.freqs_cis)

    @classmethod
    def of_drafter(cls, drafter: Drafter) -> Blocks:
        c = drafter.config
        heads = (c.num_attention_heads, c.kv_heads, c.head_dim)
        blocks = []
        for layer in drafter.layers:
            attn, mlp = layer.self_attn, layer.mlp
            blocks.append(
                Block(
                    getattr(layer, "input_layernorm", None),
                    attn.qkv_proj.weight,
                    attn.o_proj,
                    layer.post_attention_layernorm,
                    mlp.gate_up_proj.weight,
                    mlp.down_proj,
                    heads,
                    _qk_norm(attn) if c.qk_norm else None,
                )
            )
        return cls(blocks, drafter.freqs_cis)

    def forward(
        self, h: Tensor, positions: Tensor, mask: Tensor, context: Context | InPlace | None
    ) -> tuple[Tensor, Tensor | tuple[Tensor, ...], Tensor | tuple[Tensor, ...]]:
        """h [B, S, dim] at ``positions`` [S] or [B, S] under ``mask`` [B or 1, 1, S, P + S] over the ``context``
        blocks (P slots in all; None: nothing before the new rows) -> h and the new K/V
        [n_layer, B, Hkv, S, D]. With an :class:`InPlace` cache (positions [B, S], ``mask``
        [B, 1, S, P] over its P slots) -> h and the caches, per layer, with the new K/V written."""
        if isinstance(context, InPlace):
            cos, sin = self.rope.half_tables(positions)
            caches = zip(context.keys, context.values, strict=True)
            keys, values = [], []
            for block, (k, v) in zip(self.blocks, caches, strict=True):
                h, k, v = block(h, self.rope, cos, sin, mask, [], (k, v, context.start))
                keys.append(k)
                values.append(v)
            return h, tuple(keys), tuple(values)
        cos, sin = self.rope.tables(positions)
        bias = attention_bias(mask, self.group)
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks):
            past = [] if context is None else list(zip(context.keys[i], context.values[i], strict=True))
            h, k, v = block(h, self.rope, cos, sin, bias, past)
            new_k.append(k)
            new_v.append(v)
        return h, stack(new_k), stack(new_v)


def stack(layers: list[Tensor]) -> Tensor:
    """``torch.stack(layers)`` as one Concat and one Reshape (stack is an Unsqueeze per layer)."""
    return torch.cat(layers).reshape(len(layers), *layers[0].shape)
