"""The contract between the decode loop and a backend."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import Tensor

from lantern_rt.runtime.acceptance import RelaxInputs, Verified
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.tree import StaticTree

# The sampling settings as tensors (cfg_scale, temperature, top_k, top_p): sampling.filter_inputs.
FilterInputs = tuple[Tensor, Tensor, Tensor, Tensor]


class CatchUp(NamedTuple):
    """The catch-up rows of a drafting call (see :func:`lantern_rt.runtime.drafting.catch_up_inputs`)."""

    tokens: Tensor  # [R]
    hidden: Tensor  # [2, R, D]
    positions: Tensor  # [R]
    mask: Tensor  # [1, 1, R, capacity + R]


# What a drafting call returns: node tokens [N+1], valid [N+1], q [N+1, V], and the catch-up
# rows' new K and V [n_layer, 2, Hkv, R, D].
DraftOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


class TargetBackend(Protocol):
    """Runs the target's prefill and step graphs over two CFG rows and owns its KV cache.

    Returned tensors may be the backend's own buffers: valid until its next call.
    """

    name: str
    cache: KVCache
    cls_token_num: int

    def prefill(self, cond: Tensor) -> tuple[Tensor, Tensor]:
        """Condition rows (class ids [2] or captions [2, T, C]) -> logits [2, V] and hidden
        [2, D] at the last prefix slot; the prefix K/V are committed to the cache."""
        ...

    def verify(
        self,
        tree: StaticTree,
        tokens: Tensor,
        positions: Tensor,
        mask: Tensor,
        valid: Tensor,
        q: Tensor,
        noise: Tensor,
        bonus_noise: Tensor,
        sampling: FilterInputs,
        relax: RelaxInputs,
    ) -> Verified:
        """One target step over ``tree``'s drafted ``tokens`` [N+1] (the root first; the
        root-only tree for AR) at ``positions`` [N+1] under ``mask`` [1, 1, N+1, capacity + N+1]
        (``cache.mask`` of the tree's mask), then their acceptance on this backend's device
        (:func:`~lantern_rt.runtime.acceptance.verify_tree`, from ``valid`` [N+1], the drafter's
        ``q`` [N+1, V], uniform ``noise`` [N+1] and ``bonus_noise`` [V]). The kept nodes' K/V
        come first in ``new_k``/``new_v``: ``cache.write(new_k, new_v, length + 1)`` commits
        the accepted path. Nothing is read back to the host."""
        ...


class DrafterBackend(Protocol):
    """Runs the drafter (with the target's LM head) over two CFG rows; owns the drafter cache."""

    name: str
    cache: KVCache
    vocab_size: int

    def draft(self, tree: StaticTree, rows: CatchUp, noise: Tensor, sampling: FilterInputs) -> DraftOutputs:
        """``runtime.drafting.draft_tree`` over this backend's cache: catch-up ``rows``, uniform
        draw noise and the sampling settings. Returned tensors may be the backend's own buffers:
        valid until its next call."""
        ...
