"""The persistent key/value cache the runtime owns; graphs only return the new tokens' K/V."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Fixed-size K/V storage [n_layer, rows, heads, capacity, head_dim] plus a committed length.

    Entries past ``length`` are stale and masked. ``stage`` keeps the K/V a call just produced;
    ``commit`` copies a run of them (the accepted path, gathered first) to the slots right after
    ``length``.
    ``layers_k``/``layers_v`` are per-layer views of the storage (graphs take one input per layer).
    """

    def __init__(
        self,
        n_layer: int,
        rows: int,
        heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_layer, rows, heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers_k, self.layers_v = tuple(self.k.unbind(0)), tuple(self.v.unbind(0))
        self.capacity = capacity
        slots = torch.arange(capacity, device=device)
        self._visible = slots[None, :] < torch.arange(capacity + 1, device=device)[:, None]  # [length, slot]
        self.length = 0
        self._staged: tuple[Tensor, Tensor] | None = None

    def reset(self) -> None:
        self.length = 0
        self._staged = None

    def mask(self, new_mask: Tensor) -> Tensor:
        """Attention mask [1, 1, S, capacity + S] for S new tokens whose mutual visibility is
        ``new_mask`` [S, S]: every committed entry is visible, stale entries are not."""
        s = new_mask.shape[0]
        return torch.cat([self._visible[self.length].expand(s, -1), new_mask], dim=1)[None, None]

    def stage(self, new_k: Tensor, new_v: Tensor) -> None:
        self._staged = (new_k, new_v)

    def commit(self, count: int, start: int = 0) -> None:
        """Append ``count`` staged entries after ``length``: those from ``start`` on along the
        new-token axis (callers stage the kept entries first: a verify graph gathers them by the
        accepted node ids on the device), copied as one contiguous run."""
        assert self._staged is not None, "commit without a staged call"
        if self.length + count > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {count} > {self.capacity}")
        new_k, new_v = self._staged
        self.k[:, :, :, self.length : self.length + count] = new_k.narrow(3, start, count)
        self.v[:, :, :, self.length : self.length + count] = new_v.narrow(3, start, count)
        self.length += count
        self._staged = None
