"""The persistent key/value cache the runtime owns; graphs only return the new tokens' K/V."""

from __future__ import annotations

import torch
from torch import Tensor


def cache_mask(length: Tensor, capacity: int, new_mask: Tensor) -> Tensor:
    """Attention mask [1, 1, S, capacity + S] for S new tokens after ``length`` [1] committed
    entries of a cache of ``capacity`` slots: every committed entry is visible, stale entries
    are not, and the new tokens see each other through ``new_mask`` [S, S]. Built on the
    device (inside a graph, from its length input), with no host read."""
    seen = (torch.arange(capacity, device=length.device) < length).expand(new_mask.shape[0], -1)
    return torch.cat([seen, new_mask], dim=1)[None, None]


class KVCache:
    """Fixed-size K/V storage [n_layer, rows, heads, capacity, head_dim] plus a committed length.

    The length is a one-element tensor on the cache's device, so that a whole decode step (its
    positions, masks and commits) runs there with no host read (docs/method.md §6). Entries past
    ``length`` are stale and masked. ``layers_k``/``layers_v`` are per-layer views of the storage
    (graphs take one input per layer).
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
        self._slots = torch.arange(capacity, device=device)  # for write
        self.length = torch.zeros(1, dtype=torch.long, device=device)

    def reset(self) -> None:
        self.length.zero_()

    def mask(self, new_mask: Tensor) -> Tensor:
        """:func:`cache_mask` over this cache for new tokens seeing each other through ``new_mask``."""
        return cache_mask(self.length, self.capacity, new_mask)

    def write(self, new_k: Tensor, new_v: Tensor, count: Tensor | int) -> None:
        """Append the first ``count`` of the S new entries (``new_k``/``new_v`` [n_layer, rows,
        heads, S, head_dim], the kept ones first) after ``length``, on the device: all S are
        copied to slots ``length``.. (clamped to the last slot), so the ones past ``count`` land
        in stale slots. The last slot never holds a committed entry (capacities have one to
        spare: a decode commits at most capacity - 1), so clamped copies only overwrite stale data.
        """
        slots = (self.length + self._slots[: new_k.shape[3]]).clamp_max(self.capacity - 1)
        self.k.index_copy_(3, slots, new_k)
        self.v.index_copy_(3, slots, new_v)
        self.length += count
