"""The contract between the decode loop and a backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from torch import Tensor

from lantern_rt.runtime.acceptance import RelaxInputs, Verified
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.sampling import FilterInputs
from lantern_rt.runtime.tree import StaticTree


class CatchUp(NamedTuple):
    """What a drafting call catches up on: the pairs committed since the last call (see
    :func:`lantern_rt.runtime.drafting.catch_up_inputs`), all on the device."""

    tokens: Tensor  # [B, R] int64: each image's m pending tokens, left-aligned (the m-th is the root)
    hidden: Tensor  # [2B, R, D]: the target's hidden state before each of them (CFG rows)
    count: Tensor  # [B] int64: m, 1..R
    root_position: Tensor  # [B] int64: the root's target position
    cache_length: Tensor  # [B] int64: the drafter cache's committed length
    prefix: Tensor | None = None  # [2B, P] bool: the cache's prefix pairs each row sees (None: all)


# What a drafting call returns: node tokens [B, N+1], valid [B, N+1], q [B, N+1, V], and the
# catch-up rows' new K and V [n_layer, 2B, Hkv, R, D], each image's m real rows first; None and
# None from a call that wrote them into its cache's scratch slots (``drafting.Scratch``).
DraftOutputs = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]


@dataclass
class Draft:
    """B drafted trees: tokens [B, N+1] (roots first), valid [B, N+1], drafter probabilities q
    [B, N+1, V] (rows of nodes at the tree's last level are zero: nothing is drawn below them)."""

    tokens: Tensor
    valid: Tensor
    q: Tensor


class Pending(NamedTuple):
    """What a step drafts from: each image's pairs committed since its last step, all on the
    device (:class:`~lantern_rt.runtime.decode.DecodeStep`)."""

    tokens: Tensor  # [B, R] int64: each image's m pending tokens, left-aligned (the m-th is the root)
    hidden: Tensor  # [2B, R, D]: the target's hidden state before each of them (CFG rows)
    count: Tensor  # [B] int64: m, 1..R
    root_position: Tensor  # [B] int64: the root's target position (the target cache's length)
    active: Tensor  # [B] bool: the slots that hold an image (an inactive one commits nothing)


class Drafter(Protocol):
    """What drafts a speculative step's trees: the decode loop's one drafting interface
    (onnxruntime-genai's speculative strategy: propose, verify, accept and commit). Each step
    :meth:`propose` drafts below every image's root, the target verifies and accepts, and
    :meth:`record` gives the drafter that verification. A drafter model (EAGLE:
    :class:`~lantern_rt.runtime.drafting.TreeDrafter`, the base of the drafter backends) and the
    Jacobi window (:class:`~lantern_rt.runtime.jacobi.JacobiDrafter`) implement it. Both work on
    device tensors, their state updated in place with no host read, so that a step compiles and
    a CUDA graph captures it whole."""

    name: str

    @property
    def state(self) -> tuple[Tensor, ...]:
        """The tensors a step updates in place (restored after the warm-up calls of a compile
        or a CUDA graph capture)."""
        ...

    def noise_rows(self, tree: StaticTree) -> int:
        """Rows of V uniforms a step's :meth:`propose` takes for ``tree``."""
        ...

    def prefill(self, hidden: Tensor, fresh: Tensor, cond: Tensor, prefix: Tensor) -> None:
        """The ``fresh`` [B] images start over (the arguments of
        :meth:`~lantern_rt.runtime.drafting.TreeDrafter.prefill`: the target's hidden states at all
        but the prefix's last slot, its condition rows and their visible slots)."""
        ...

    def propose(
        self, tree: StaticTree, pending: Pending, noise: Tensor, sampling: FilterInputs, greedy: Tensor
    ) -> Draft:
        """B drafts of ``tree`` below each image's root, the last of its ``pending`` tokens, from
        the uniform ``noise`` [B, :meth:`noise_rows`, V] under the ``sampling`` settings
        (``greedy`` [B] bool, or [1] for all: the relaxation's, argmax drafts)."""
        ...

    def record(self, verified: Verified, active: Tensor) -> None:
        """After the target verified and accepted this step's drafts: keep what the next
        :meth:`propose` of the ``active`` [B] images needs of it."""
        ...


class TargetBackend(Protocol):
    """Runs the target's prefill and step graphs over the 2B CFG rows of B images
    (:func:`~lantern_rt.runtime.sampling.cfg_rows`) and owns their KV cache.

    Returned tensors may be the backend's own buffers: valid until its next call.
    """

    name: str
    cache: KVCache
    cls_token_num: int

    def prefill(
        self, cond: Tensor, prefix: Tensor | None = None, fresh: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Condition rows (class ids [2B], captions [2B, T, C] or prompt token ids [2B, T]) and
        the prefix slots each CFG row's tokens see (``prefix`` [2B, T] bool: all but a caption's
        or a prompt's padding; None: all) -> logits
        [2B, V] at the last prefix slot and the hidden states [2B, T, D] at every one; the
        ``fresh`` [B] images' caches (all when None) restart with their prefix K/V and
        visibility, the others keep theirs."""
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
        """One target step over the B ``draft``s of ``tree`` (tokens [B, N+1], the roots first;
        the root-only tree for AR) after each image's committed cache (positions and masks from
        ``cache.length``: :func:`~lantern_rt.runtime.acceptance.tree_step_inputs`), then their
        acceptance on this backend's device
        (:func:`~lantern_rt.runtime.acceptance.verify_tree`, from the draft's valid flags and q,
        uniform ``noise`` [B, N+1] and ``bonus_noise`` [B, V]). The kept nodes' K/V come first
        in ``new_k``/``new_v`` (or, None there, the step wrote every node's K/V into the cache's
        scratch slots): ``cache.commit(new_k, new_v, kept, length + 1)`` commits the accepted
        paths. Nothing is read back to the host."""
        ...
