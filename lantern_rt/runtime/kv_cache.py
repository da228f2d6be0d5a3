"""The persistent key/value cache the runtime owns; graphs only return the new tokens' K/V."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Fixed-size K/V storage [n_layer, rows, heads, capacity, head_dim] plus a committed length.

    Entries past ``length`` are stale and masked. ``stage`` keeps the K/V a call just produced;
    ``commit`` copies the chosen ones (the accepted path) to the slots right after ``length``.
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
        self.capacity = capacity
        self._slots = torch.arange(capacity, device=device)
        self.length = 0
        self._staged: tuple[Tensor, Tensor] | None = None

    def reset(self) -> None:
        self.length = 0
        self._staged = None

    def mask(self, new_mask: Tensor, scratch: Tensor | None = None) -> Tensor:
        """Attention mask [1, 1, S, capacity + S] for S new tokens whose mutual visibility is
        ``new_mask`` [S, S]: every committed entry is visible, stale entries are not, except
        that ``scratch`` [S, M] opens the M slots right after ``length`` (see ``place``)."""
        s = new_mask.shape[0]
        past = (self._slots < self.length).expand(s, -1)
        if scratch is not None:
            past = past.clone()
            past[:, self.length : self.length + scratch.shape[1]] = scratch
        return torch.cat([past, new_mask], dim=1)[None, None]

    def stage(self, new_k: Tensor, new_v: Tensor) -> None:
        self._staged = (new_k, new_v)

    def place(self, offsets: Tensor, last: int) -> None:
        """Write every staged entry to slot ``length + offset`` without committing it (drafted
        tree levels that deeper levels attend to; overwritten by later commits). ``last`` is
        the largest offset (checked against the capacity without reading the device)."""
        assert self._staged is not None, "place without a staged call"
        if self.length + last >= self.capacity:
            raise RuntimeError(f"KV cache overflow: slot {self.length + last} >= {self.capacity}")
        new_k, new_v = self._staged
        slots = offsets.to(new_k.device) + self.length
        self.k.index_copy_(3, slots, new_k)
        self.v.index_copy_(3, slots, new_v)

    def commit(self, keep: Tensor | list[int]) -> None:
        """Append staged entries ``keep`` (indices along the new-token axis) after ``length``."""
        assert self._staged is not None, "commit without a staged call"
        new_k, new_v = self._staged
        keep = torch.as_tensor(keep, device=new_k.device, dtype=torch.long)
        n = keep.numel()
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > {self.capacity}")
        self.k[:, :, :, self.length : self.length + n] = new_k.index_select(3, keep)
        self.v[:, :, :, self.length : self.length + n] = new_v.index_select(3, keep)
        self.length += n
        self._staged = None
