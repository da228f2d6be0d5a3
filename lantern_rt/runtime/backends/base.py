"""The contract between the decode loop and a backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from torch import Tensor

from lantern_rt.runtime.acceptance import RelaxInputs, Verified
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.tree import StaticTree

# The sampling settings as tensors (cfg_scale, temperature, top_k, top_p): sampling.filter_inputs.
FilterInputs = tuple[Tensor, Tensor, Tensor, Tensor]


class CatchUp(NamedTuple):
    """What a drafting call catches up on: the pairs committed since the last call (see
    :func:`lantern_rt.runtime.drafting.catch_up_inputs`), all on the device."""

    tokens: Tensor  # [R] int64: the m pending tokens, left-aligned (the m-th is the root)
    hidden: Tensor  # [2, R, D]: the target's hidden state before each of them
    count: Tensor  # [1] int64: m, 1..R
    root_position: Tensor  # [1] int64: the root's target position
    cache_length: Tensor  # [1] int64: the drafter cache's committed length


# What a drafting call returns: node tokens [N+1], valid [N+1], q [N+1, V], and the catch-up
# rows' new K and V [n_layer, 2, Hkv, R, D], the m real rows first.
DraftOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


@dataclass
class Draft:
    """A drafted tree: tokens [N+1] (root first), valid [N+1], drafter probabilities q [N+1, V]
    (rows of nodes at the tree's last level are zero: nothing is drawn below them)."""

    tokens: Tensor
    valid: Tensor
    q: Tensor


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
        draft: Draft,
        noise: Tensor,
        bonus_noise: Tensor,
        sampling: FilterInputs,
        relax: RelaxInputs,
    ) -> Verified:
        """One target step over the ``draft`` of ``tree`` (its tokens [N+1], the root first; the
        root-only tree for AR) after the committed cache (positions and mask from
        ``cache.length``: :func:`~lantern_rt.runtime.acceptance.tree_step_inputs`), then their
        acceptance on this backend's device
        (:func:`~lantern_rt.runtime.acceptance.verify_tree`, from the draft's valid flags and q,
        uniform ``noise`` [N+1] and ``bonus_noise`` [V]). The kept nodes' K/V
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
