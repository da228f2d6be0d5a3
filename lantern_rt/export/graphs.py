"""The exported graphs: pure, fixed-shape wrappers around the target and the VQ decoder.

Each wrapper declares its inputs and outputs once, as a :class:`GraphSpec`, and makes random
valid inputs for the numerical check. Shapes follow the runtime's contract: two CFG rows, a
cache of ``cls_token_num + block_size`` slots, and only the new tokens' K/V as outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lantern_rt.models.target import ROPE_PAD_ROWS, Transformer
from lantern_rt.models.vq import VQModel

ROWS = 2  # CFG rows: conditional, unconditional


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output with its fixed shape."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype)}


@dataclass(frozen=True)
class GraphSpec:
    """A graph's name, inputs and outputs (in order) and the dtype it computes in."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    compute_dtype: torch.dtype

    def to_dict(self) -> dict[str, object]:
        return {
            "compute_dtype": dtype_name(self.compute_dtype),
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (numpy's names, which the manifest uses)."""
    return str(dtype).removeprefix("torch.")


def cache_capacity(model: Transformer) -> int:
    """Slots in the runtime's KV cache: the condition prefix plus every image token."""
    return model.config.cls_token_num + model.config.block_size


def _kv_spec(name: str, model: Transformer, length: int, dtype: torch.dtype) -> TensorSpec:
    c = model.config
    return TensorSpec(name, (c.n_layer, ROWS, c.kv_heads, length, c.head_dim), dtype)


class TargetPrefill(nn.Module):
    """Condition rows -> logits and hidden at the last prefix slot, and the prefix K/V."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        c = model.config
        dtype = model.output.weight.dtype
        cond = (
            TensorSpec("cond", (ROWS,), torch.int64)
            if c.model_type == "c2i"
            else TensorSpec("cond", (ROWS, c.cls_token_num, c.caption_dim), torch.float32)
        )
        self.spec = GraphSpec(
            "target_prefill",
            (cond,),
            (
                TensorSpec("logits", (ROWS, c.vocab_size), torch.float32),
                TensorSpec("hidden", (ROWS, c.dim), dtype),
                _kv_spec("new_k", model, c.cls_token_num, dtype),
                _kv_spec("new_v", model, c.cls_token_num, dtype),
            ),
            dtype,
        )

    def forward(self, cond: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if cond.is_floating_point():
            cond = cond.to(self.spec.compute_dtype)
        h = self.model.embed_condition(cond)
        t = h.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()[None, None]
        logits, hidden, k, v = self.model.step(h, torch.arange(t, device=h.device), causal, None, None)
        return logits[:, -1], hidden[:, -1], k, v

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        """A random condition row plus the null condition."""
        c = self.model.config
        if c.model_type == "c2i":
            return (torch.tensor([int(torch.randint(c.num_classes, (), generator=g)), c.num_classes]),)
        caption = torch.randn(c.cls_token_num, c.caption_dim, generator=g)
        return (torch.stack([caption, self.model.null_condition.float().cpu()]),)


class TargetStep(nn.Module):
    """``S`` tokens at their positions under a mask over the cache -> logits, hidden, new K/V."""

    def __init__(self, model: Transformer, s: int):
        super().__init__()
        self.model = model
        c = model.config
        dtype = model.output.weight.dtype
        cap = cache_capacity(model)
        self.spec = GraphSpec(
            f"target_step_{s}",
            (
                TensorSpec("tokens", (s,), torch.int64),
                TensorSpec("positions", (s,), torch.int64),
                TensorSpec("mask", (1, 1, s, cap + s), torch.bool),
                _kv_spec("past_k", model, cap, dtype),
                _kv_spec("past_v", model, cap, dtype),
            ),
            (
                TensorSpec("logits", (ROWS, s, c.vocab_size), torch.float32),
                TensorSpec("hidden", (ROWS, s, c.dim), dtype),
                _kv_spec("new_k", model, s, dtype),
                _kv_spec("new_v", model, s, dtype),
            ),
            dtype,
        )

    def forward(
        self, tokens: Tensor, positions: Tensor, mask: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h = self.model.tok_embeddings(tokens).unsqueeze(0).expand(ROWS, -1, -1)
        return self.model.step(h, positions, mask, past_k, past_v)

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        """Random tokens after a random committed length at sorted depths the RoPE table holds;
        a random tree-like mask (each token sees itself and some earlier ones); random, partly
        stale caches."""
        c = self.model.config
        s = self.spec.inputs[0].shape[0]
        cap = cache_capacity(self.model)
        length = int(torch.randint(c.cls_token_num, cap, (), generator=g))
        depths = torch.randint(min(s, ROPE_PAD_ROWS), (s,), generator=g).sort().values
        new = torch.rand(s, s, generator=g).lt(0.5).tril() | torch.eye(s, dtype=torch.bool)
        past = (torch.arange(cap) < length).expand(s, -1)
        kv = self.spec.inputs[3]
        return (
            torch.randint(c.vocab_size, (s,), generator=g),
            length + depths,
            torch.cat([past, new], dim=1)[None, None],
            torch.randn(kv.shape, generator=g).to(kv.dtype),
            torch.randn(kv.shape, generator=g).to(kv.dtype),
        )


class VQDecode(nn.Module):
    """Codes [B, grid^2] -> images [B, C, H, W] (fp32 in and out)."""

    def __init__(self, vq: VQModel, grid: int, batch: int = 1):
        super().__init__()
        self.vq, self.grid = vq, grid
        c = vq.config
        side = grid * c.downsample
        dtype = vq.post_quant_conv.weight.dtype
        self.spec = GraphSpec(
            "vq_decode",
            (TensorSpec("codes", (batch, grid * grid), torch.int64),),
            (TensorSpec("images", (batch, c.out_channels, side, side), torch.float32),),
            dtype,
        )

    def forward(self, codes: Tensor) -> Tensor:
        return self.vq.decode_code(codes, self.grid).float()

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        return (torch.randint(self.vq.config.codebook_size, self.spec.inputs[0].shape, generator=g),)


GraphModule = TargetPrefill | TargetStep | VQDecode
