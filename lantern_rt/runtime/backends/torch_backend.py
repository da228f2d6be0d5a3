"""The reference backend: the torch model itself, eager, or replayed from CUDA graphs on a GPU."""

from __future__ import annotations

import torch
from torch import Tensor

from lantern_rt.models.config import ConfigError
from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.backends.cuda_graphs import CudaGraphed, StepFn
from lantern_rt.runtime.kv_cache import KVCache


def _replayed(fn: StepFn, cuda_graphs: bool, device: torch.device) -> StepFn:
    """``fn`` itself, or ``fn`` captured in CUDA graphs (which need a CUDA device)."""
    if not cuda_graphs:
        return fn
    if device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA device; the model is on {device}")
    return CudaGraphed(fn)


class TorchTarget:
    """``TargetBackend`` over a torch ``Transformer`` (any device and dtype); with
    ``cuda_graphs`` each step size is captured once and replayed."""

    name = "torch"

    def __init__(self, model: Transformer, cuda_graphs: bool = False):
        cfg = model.config
        self.model = model
        self.cls_token_num = cfg.cls_token_num
        weight = model.output.weight
        self.cache = KVCache(
            cfg.n_layer,
            2,
            cfg.kv_heads,
            cfg.cls_token_num + cfg.block_size,
            cfg.head_dim,
            weight.dtype,
            weight.device,
        )
        self._step = _replayed(self._forward, cuda_graphs, weight.device)

    @torch.inference_mode()
    def prefill(self, cond: Tensor) -> tuple[Tensor, Tensor]:
        self.cache.reset()
        h = self.model.embed_condition(cond)
        t = h.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        positions = torch.arange(t, device=h.device)
        logits, hidden, k, v = self.model.step(
            h, positions, self.cache.mask(causal), self.cache.k, self.cache.v
        )
        self.cache.stage(k, v)
        self.cache.commit(list(range(t)))
        return logits[:, -1], hidden[:, -1]

    @torch.inference_mode()
    def step(self, tokens: Tensor, positions: Tensor, tree_mask: Tensor) -> tuple[Tensor, Tensor]:
        logits, hidden, k, v = self._step(tokens, positions, self.cache.mask(tree_mask))
        self.cache.stage(k, v)
        return logits, hidden

    def _forward(self, tokens: Tensor, positions: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
        h = self.model.tok_embeddings(tokens).unsqueeze(0).expand(2, -1, -1)
        return self.model.step(h, positions, mask, self.cache.k, self.cache.v)


class TorchDrafter:
    """``DrafterBackend`` over a torch ``Drafter`` and the target's final LM head (CUDA graphs
    as for :class:`TorchTarget`)."""

    name = "torch"

    def __init__(self, drafter: Drafter, head: torch.nn.Linear, capacity: int, cuda_graphs: bool = False):
        c = drafter.config
        self.drafter, self.head = drafter, head
        weight = drafter.fc.weight
        self.cache = KVCache(
            c.num_hidden_layers, 2, c.kv_heads, capacity, c.head_dim, weight.dtype, weight.device
        )
        self._step = _replayed(self._forward, cuda_graphs, weight.device)

    @torch.inference_mode()
    def step(
        self, tokens: Tensor, hidden: Tensor, positions: Tensor, new_mask: Tensor, scratch: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        logits, h, k, v = self._step(tokens, hidden, positions, self.cache.mask(new_mask, scratch))
        self.cache.stage(k, v)
        return logits, h

    def _forward(self, tokens: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor) -> tuple[Tensor, ...]:
        pairs = tokens.unsqueeze(0).expand(2, -1)
        h, k, v = self.drafter.step(pairs, hidden, positions, mask, self.cache.k, self.cache.v)
        return self.head(h).float(), h, k, v
