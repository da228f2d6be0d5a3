"""The persistent key/value cache the runtime owns; graphs only return the new tokens' K/V."""

from __future__ import annotations

import torch
from torch import Tensor


def take(t: Tensor, dim: int, keep: list[int]) -> Tensor:
    """``t``'s entries ``keep`` along ``dim``: a view when they are one contiguous run (a chain's
    accepted path always is), else a gather."""
    first, n = keep[0], len(keep)
    if keep[-1] - first == n - 1 and keep == list(range(first, first + n)):
        return t.narrow(dim, first, n)
    return t.index_select(dim, torch.tensor(keep, device=t.device))


class KVCache:
    """Fixed-size K/V storage [n_layer, rows, heads, capacity, head_dim] plus a committed length.

    Entries past ``length`` are stale and masked. ``stage`` keeps the K/V a call just produced;
    ``commit`` copies the chosen ones (the accepted path) to the slots right after ``length``.
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

    def commit(self, keep: list[int] | Tensor, count: int | None = None) -> None:
        """Append staged entries after ``length``: the first ``count`` (default: all) of ``keep``,
        indices along the new-token axis. A tensor ``keep`` (the accepted node ids, fixed size,
        on the cache's device) is gathered whole on the device, with no host-built index list;
        the slots past the first ``count`` stay stale (masked) until overwritten."""
        assert self._staged is not None, "commit without a staged call"
        new_k, new_v = self._staged
        count = len(keep) if count is None else count
        if self.length + count > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {count} > {self.capacity}")
        if isinstance(keep, Tensor):
            n = min(len(keep), self.capacity - self.length)
            k, v = new_k.index_select(3, keep[:n]), new_v.index_select(3, keep[:n])
        else:
            n = count
            k, v = take(new_k, 3, keep[:n]), take(new_v, 3, keep[:n])
        self.k[:, :, :, self.length : self.length + n] = k
        self.v[:, :, :, self.length : self.length + n] = v
        self.length += count
        self._staged = None
