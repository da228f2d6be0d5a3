"""The persistent key/value cache the runtime owns; graphs only return the new tokens' K/V.

A cache holds B images' 2B CFG rows (:func:`~lantern_rt.runtime.sampling.cfg_rows`: the
conditional rows, then the unconditional ones), or B rows when guidance is off
(docs/method.md §13), and a committed length per image: images of a
batch advance by different accepted lengths (docs/method.md §7). Graphs read a window of its
first slots that covers the batch's longest image, not the whole cache (docs/method.md §12).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import cfg_rows, guided_rows


def cache_mask(
    length: Tensor, capacity: int, new_mask: Tensor, rows: int, prefix: Tensor | None = None
) -> Tensor:
    """Attention mask [rows, 1, S, capacity + S] (``rows``: 2B, or B without guidance) for S
    new tokens per image after ``length`` [B] committed entries of a cache of ``capacity``
    slots: every committed entry of the row's image is visible, stale entries are not, and the
    new tokens see each other through ``new_mask`` [S, S] (the same for every image) or [B, S,
    S]. ``prefix`` [rows, P] hides the condition slots it marks False in each row (a caption's
    or a prompt's padding, docs/method.md §9). Built on the device (inside a graph, from its
    length input), with no host read.

    One comparison decides every entry: each key column holds a number that is below the
    image's length exactly when the key is visible (a cache slot its index; a new token the
    lowest int64 when ``new_mask`` shows it, the highest when not), so that for a static
    ``new_mask`` the row of numbers is a constant of the graph."""
    bounds = torch.iinfo(torch.long)
    slots = torch.arange(capacity, device=length.device).expand(*new_mask.shape[:-1], capacity)
    new = torch.where(new_mask, bounds.min, bounds.max)
    keys = torch.cat([slots, new], dim=-1).unsqueeze(-3)  # [1, S, capacity + S] or [B, 1, S, ...]
    if keys.dim() == 4:
        keys = cfg_rows(keys, rows)
    mask = keys < cfg_rows(length, rows).view(-1, 1, 1, 1)  # [rows, 1, S, capacity + S]
    return _hide_prefix(mask, prefix)


def written_mask(
    length: Tensor,
    slots: int,
    tree_mask: Tensor,
    rows: int,
    prefix: Tensor | None = None,
    chain: bool = False,
) -> Tensor:
    """Attention mask [rows, 1, S, slots] of a step that has written its S nodes' K/V into the
    cache at each image's ``length`` [B] (slots length..length + S - 1, node order): a node sees
    every committed entry of its image (but the prefix slots ``prefix`` [rows, P] hides) and
    the nodes ``tree_mask`` [S, S] marks its ancestors, nothing past them (stale entries, the
    scratch slots of other nodes). A ``chain`` (node i's ancestors are nodes 0..i, AR's root
    alone included) is one comparison of each slot against length + i."""
    s = tree_mask.shape[0]
    index = torch.arange(slots, device=length.device)
    if chain:
        last = cfg_rows(length, rows)[:, None] + torch.arange(s, device=length.device)  # [rows, S]
        mask = index.view(1, 1, 1, slots) <= last.view(rows, 1, s, 1)
    else:
        relative = index - cfg_rows(length, rows)[:, None]  # [rows, slots]
        ancestors = tree_mask[:, relative.clamp(0, s - 1)].transpose(0, 1)  # [rows, S, slots]
        written = (relative >= 0) & (relative < s)
        mask = ((relative < 0)[:, None] | (ancestors & written[:, None]))[:, None]
    return _hide_prefix(mask, prefix)


def _hide_prefix(mask: Tensor, prefix: Tensor | None) -> Tensor:
    """``mask`` [rows, 1, S, slots] with the condition slots ``prefix`` [rows, P] marks False
    hidden in each row (None: all shown)."""
    if prefix is None:
        return mask
    rows, slots = prefix.shape[0], mask.shape[-1]
    return mask & F.pad(prefix, (0, slots - prefix.shape[1]), value=True).view(rows, 1, 1, slots)


def prefill_mask(prefix: Tensor) -> Tensor:
    """[2B, 1, P, P]: the condition prefix's causal mask, without the slots ``prefix`` [2B, P]
    marks False in each CFG row except for each slot itself (LlamaGen keeps the diagonal so
    that a padding slot, seeing nothing else, has a defined output)."""
    p = prefix.shape[1]
    r = torch.arange(p, device=prefix.device)
    causal = r[None, :] <= r[:, None]
    return ((causal & prefix[:, None, :]) | (r[None, :] == r[:, None]))[:, None]


def gather_rows(t: Tensor, index: Tensor, rows_dim: int, dim: int) -> Tensor:
    """``t`` (its 2B CFG rows along ``rows_dim``, or B without guidance) indexed along ``dim``
    by per-image ``index`` [B, K], the same for an image's two rows: what ``index_select`` is
    for one image."""
    rows = cfg_rows(index, t.shape[rows_dim])  # [2B, K]
    shape, sizes = [1] * t.dim(), list(t.shape)
    shape[rows_dim], shape[dim] = rows.shape
    sizes[dim] = rows.shape[1]
    return t.gather(dim, rows.view(shape).expand(sizes))


WINDOW_ALIGN = 16  # cache windows are multiples of this many slots (or the whole cache)


def cache_windows(capacity: int, count: int) -> tuple[int, ...]:
    """The ``count`` window sizes (slots) a cache of ``capacity`` slots is read through, ascending:
    ``capacity * j / count`` for j = 1..count rounded up to a multiple of :data:`WINDOW_ALIGN`,
    the last one the whole cache (docs/method.md §12)."""
    if count < 1:
        raise ValueError(f"a cache needs at least one window, got {count}")
    sizes = {
        min(capacity, math.ceil(capacity * j / count / WINDOW_ALIGN) * WINDOW_ALIGN) for j in range(1, count)
    }
    return tuple(sorted(sizes | {capacity}))


class KVCache:
    """Fixed-size K/V storage [n_layer, 2B, heads, window, head_dim] plus a committed length
    per image ([B]).

    The storage holds ``capacity`` slots per row; calls read it through one of ``windows``
    (window sizes, the whole cache among them): ``k``/``v`` are the first 2B x heads x window x
    head_dim values of each layer's storage viewed as [2B, heads, window, head_dim], so that a
    window is one contiguous tensor a graph reads in place. :meth:`fit` moves the entries when
    the window changes. The lengths are a tensor on the cache's device, so that a whole decode
    step (its positions, masks and commits) runs there with no host read (docs/method.md §6). Entries past an image's
    length are stale and masked. ``layers_k``/``layers_v`` are per-layer views of the storage
    (graphs take one input per layer). A target cache also keeps ``prefix`` [2B, P], which of
    its first P slots (the condition prefix) each CFG row's later tokens see: all but a
    caption's or a prompt's padding. The run ``shape`` gives B (its ``batch_size``, kept as
    ``images``) and whether the rows are guided (``guided``; False: B rows, one per image,
    docs/method.md §13); ``rows`` is the row count, 2B or B. The shape's ``cache_windows`` and
    ``streams`` are not read here: ``windows`` gives this cache's window sizes.

    ``scratch`` > 0 keeps that many spare slots after every window, for a step that writes its
    new K/V into the cache before attending (the torch target's verify and a bundle's steps
    exported with the cache written in place, docs/method.md §6): :meth:`in_place` gives each
    layer's window and the step's first scratch slots, and :meth:`commit` moves the kept ones
    into place. The torch step writes its nodes at the window's end (the first scratch slots);
    with ``at_length`` a step writes them at each image's length (a bundle's graphs), so that a
    chain's accepted nodes are in place as written. ``layer_tensors`` keeps one tensor per
    layer (``k``/``v`` are then stacked copies): a compiled torch step that writes a view of a
    storage shared by all layers gets that storage copied (functionalization), one per layer
    writes in place. Otherwise all
    layers share one tensor (a commit is one copy for all layers), and each layer's window (with
    its scratch slots) is one contiguous tensor, as the bundles' graphs take it.
    """

    def __init__(
        self,
        n_layer: int,
        heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shape: RunShape,
        *,
        prefix: int = 0,
        windows: Sequence[int] = (),
        scratch: int = 0,
        layer_tensors: bool = False,
        at_length: bool = False,
    ):
        self.images, self.guided = shape.batch_size, shape.guided
        self.rows = guided_rows(self.images, self.guided)
        self._rows = (self.rows, heads)
        self._head_dim, self.scratch, self.at_length = head_dim, scratch, at_length
        size = self.rows * heads * (capacity + scratch) * head_dim
        parts, per_part = (n_layer, 1) if layer_tensors else (1, n_layer)
        self._k = [torch.zeros(per_part, size, dtype=dtype, device=device) for _ in range(parts)]
        self._v = [torch.zeros(per_part, size, dtype=dtype, device=device) for _ in range(parts)]
        # The storage as rows of head_dim values: a commit copies whole rows (see write).
        self._k_rows = [part.view(-1, head_dim) for part in self._k]
        self._v_rows = [part.view(-1, head_dim) for part in self._v]
        self._slots = torch.arange(capacity, device=device)
        self.capacity = capacity
        self.windows = tuple(sorted({w for w in windows if 0 < w < capacity} | {capacity}))
        self._views(capacity)
        self.length = torch.zeros(self.images, dtype=torch.long, device=device)
        self.prefix = torch.ones(self.rows, prefix, dtype=torch.bool, device=device) if prefix else None

    def reset(self) -> None:
        self.length.zero_()

    def _views(self, window: int) -> None:
        self.window = window
        per_part, (rows, heads), device = self._k[0].shape[0], self._rows, self._k[0].device
        width = window + self.scratch
        shape = (per_part, rows, heads, width, self._head_dim)
        count = math.prod(shape[1:])
        wide_k = [part[:, :count].view(shape) for part in self._k]
        wide_v = [part[:, :count].view(shape) for part in self._v]
        self._window_k = [wide[..., :window, :] for wide in wide_k]
        self._window_v = [wide[..., :window, :] for wide in wide_v]
        self.layers_k = tuple(layer for part in self._window_k for layer in part.unbind(0))
        self.layers_v = tuple(layer for part in self._window_v for layer in part.unbind(0))
        # Each layer's rows of window + scratch slots, made here: a compiled step reads each as
        # its own input, which it writes in place (a view it selected itself it would copy).
        self._wide_k = tuple(layer for wide in wide_k for layer in wide.unbind(0))
        self._wide_v = tuple(layer for wide in wide_v for layer in wide.unbind(0))
        # [layers of a part, rows / B, B, heads, 1]: the storage row (of head_dim values) of each
        # layer, CFG row and head's slot 0 in this window; slot s is s rows further.
        per_layer = self._k[0].shape[1] // self._head_dim
        layer = torch.arange(per_part, device=device)[:, None, None, None] * per_layer
        row_head = torch.arange(rows * heads, device=device).view(-1, self.images, heads) * width
        self._slot0 = (layer + row_head)[..., None]

    @property
    def k(self) -> Tensor:
        """K [n_layer, rows, heads, window, head_dim]: a view of the storage, or a stacked copy
        when each layer has its own (a cache with scratch)."""
        return self._window_k[0] if len(self._window_k) == 1 else torch.stack(self.layers_k)

    @property
    def v(self) -> Tensor:
        """V as :attr:`k` holds K."""
        return self._window_v[0] if len(self._window_v) == 1 else torch.stack(self.layers_v)

    def fit(self, needed: int) -> None:
        """Read the cache through its smallest window of at least ``needed`` slots (the whole
        cache when none is that large), keeping every image's first slots. Every image whose
        entries matter must have fewer than the new window's slots committed."""
        window = next((w for w in self.windows if w >= needed), self.capacity)
        if window == self.window:
            return
        keep = min(window, self.window)
        saved = [part[..., :keep, :].clone() for part in (*self._window_k, *self._window_v)]
        self._views(window)
        for part, values in zip((*self._window_k, *self._window_v), saved, strict=True):
            part[..., :keep, :] = values

    def in_place(self, count: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Per layer K and V [rows, heads, window + ``count``, head_dim]: the window, then its
        first ``count`` scratch slots, where a step writes its ``count`` new entries and which it
        attends over in place (views of the storage, keys in the order of the window and the new
        entries joined, as :func:`cache_mask` orders its columns). :meth:`commit` with no new
        K/V then keeps the ones accepted."""
        if count > self.scratch:
            raise ValueError(f"{count} new entries per row, but the cache keeps {self.scratch} scratch slots")
        if count == self.scratch:  # every scratch slot: each layer's whole rows, made once per window
            return self._wide_k, self._wide_v
        end = self.window + count
        return tuple(k[..., :end, :] for k in self._wide_k), tuple(v[..., :end, :] for v in self._wide_v)

    def restart(
        self, new_k: Tensor, new_v: Tensor, fresh: Tensor | None = None, prefix: Tensor | None = None
    ) -> None:
        """The ``fresh`` [B] images (all when None) start over with the S entries ``new_k``/
        ``new_v`` (a prefill's prefix, whose visible slots ``prefix`` [2B, P] marks); the other
        images keep their entries, lengths and prefix."""
        if prefix is not None:
            keep = (
                prefix
                if fresh is None
                else torch.where(cfg_rows(fresh, self.rows)[:, None], prefix, self.prefix)
            )
            self.prefix.copy_(keep)
        if fresh is None:
            self.length.zero_()
            self.write(new_k, new_v, new_k.shape[3])
        else:
            self.length.masked_fill_(fresh, 0)
            self.write(new_k, new_v, new_k.shape[3] * fresh)

    def visible(self, prefix: Tensor | None) -> Tensor:
        """``prefix`` [2B, P], or every prefix slot visible when None."""
        return self.prefix.new_ones(self.prefix.shape) if prefix is None else prefix

    def mask(self, new_mask: Tensor) -> Tensor:
        """:func:`cache_mask` over this cache for new tokens seeing each other through ``new_mask``."""
        return cache_mask(self.length, self.window, new_mask, self.rows, self.prefix)

    def write(self, new_k: Tensor, new_v: Tensor, count: Tensor | int) -> None:
        """Append the first ``count`` [B] (or one int for all) of the S new entries per image
        (``new_k``/``new_v`` [n_layer, 2B, heads, S, head_dim], the kept ones first) after each
        image's length, on the device: all S are copied to slots ``length``.. (clamped to the
        window's last slot), so the ones past ``count`` land in stale slots. The last slot never
        holds a committed entry (capacities have one to spare: a decode commits at most capacity
        - 1, and a window is chosen with :func:`~lantern_rt.bundle.window_needed`), so clamped copies only overwrite
        stale data; a count of 0 leaves an image as it was."""
        rows = self._storage_rows(self.length[:, None] + self._slots[: new_k.shape[3]])  # in new_k's order
        per_part = self._slot0.shape[0]
        for i, (k_rows, v_rows) in enumerate(zip(self._k_rows, self._v_rows, strict=True)):
            layers = slice(i * per_part, (i + 1) * per_part)
            k_rows.index_copy_(0, rows, new_k[layers].reshape(-1, self._head_dim))
            v_rows.index_copy_(0, rows, new_v[layers].reshape(-1, self._head_dim))
        self.length += count

    def commit(
        self, new_k: Tensor | None, new_v: Tensor | None, kept: Tensor, count: Tensor, in_order: bool = False
    ) -> None:
        """Keep a verify's accepted path: :meth:`write` of its kept nodes' K/V ``new_k``/``new_v``
        as a graph returned them, or, when None (a step that wrote its nodes' K/V through
        :meth:`in_place`), a move on the device of the nodes ``kept`` [B, K] (node ids, the root
        first) from the slots they were written to (the window's end, or each image's length:
        ``at_length``) to slots ``length``.. (clamped as :meth:`write` clamps), then ``count``
        [B] more entries per image. ``in_order``: the kept nodes are nodes 0, 1, .. (a chain's),
        which a cache written ``at_length`` already holds in place."""
        if new_k is not None and new_v is not None:
            self.write(new_k, new_v, count)
            return
        if self.at_length and in_order:
            self.length += count
            return
        # an idle image's length may be past the window: its rows (never kept) are read at the window's end
        first = self.length.clamp_max(self.window)[:, None] if self.at_length else self.window
        source = self._storage_rows(first + kept, clamp=False)
        target = self._storage_rows(self.length[:, None] + self._slots[: kept.shape[1]])
        for rows in (*self._k_rows, *self._v_rows):
            rows.index_copy_(0, target, rows.index_select(0, source))
        self.length += count

    def _storage_rows(self, slots: Tensor, clamp: bool = True) -> Tensor:
        """The storage rows (of head_dim values) of each image's ``slots`` [B, S] in every layer
        of a storage part, CFG row and head, flattened in the order of [layers, rows, heads, S];
        ``clamp``: slots past the window's last one go to it."""
        if clamp:
            slots = slots.clamp_max(self.window - 1)
        return (self._slot0 + slots[:, None, :]).view(-1)
