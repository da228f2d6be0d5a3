"""The reference backend: the torch model itself, eager."""

from __future__ import annotations

import torch
from torch import Tensor

from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import Transformer
from lantern_rt.runtime.kv_cache import KVCache


class TorchTarget:
    """``TargetBackend`` over a torch ``Transformer`` (any device and dtype)."""

    name = "torch"

    def __init__(self, model: Transformer):
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
        h = self.model.tok_embeddings(tokens).unsqueeze(0).expand(2, -1, -1)
        logits, hidden, k, v = self.model.step(
            h, positions, self.cache.mask(tree_mask), self.cache.k, self.cache.v
        )
        self.cache.stage(k, v)
        return logits, hidden


class TorchDrafter:
    """``DrafterBackend`` over a torch ``Drafter`` and the target's final LM head."""

    name = "torch"

    def __init__(self, drafter: Drafter, head: torch.nn.Linear, capacity: int):
        c = drafter.config
        self.drafter, self.head = drafter, head
        weight = drafter.fc.weight
        self.cache = KVCache(
            c.num_hidden_layers, 2, c.kv_heads, capacity, c.head_dim, weight.dtype, weight.device
        )

    @torch.inference_mode()
    def step(
        self, tokens: Tensor, hidden: Tensor, positions: Tensor, new_mask: Tensor, scratch: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        mask = self.cache.mask(new_mask, scratch)
        h, k, v = self.drafter.step(
            tokens.unsqueeze(0).expand(2, -1), hidden, positions, mask, self.cache.k, self.cache.v
        )
        self.cache.stage(k, v)
        return self.head(h).float(), h
