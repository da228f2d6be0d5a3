"""Verification of drafted trees: exact, LANTERN and LANTERN++ acceptance (docs/method.md §5).

Sampling mode is recursive rejection sampling without replacement over each node's drafted
children, with the target mass of a child optionally relaxed by crediting it the mass of its
nearest latent neighbours. With no relaxation it is lossless. Greedy mode accepts a child iff it
is the argmax of the (relaxed) target.

:func:`accept_tree` is a pure, static-shape tensor function: the sequential tests over siblings
and levels are unrolled over the static tree, every decision is a ``torch.where``, and the
uniform noise comes in as an input. It reads nothing back to the host, so the same code runs
eagerly in torch, inside an exported ONNX graph (onnxruntime, TensorRT) and under CUDA-graph
capture; the decode loop reads only its small outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor

from lantern_rt.errors import LanternError
from lantern_rt.runtime.tree import StaticTree

RELAXATIONS = ("exact", "lantern", "lantern++")  # the speculative methods of settings.METHODS


class AcceptanceError(LanternError, ValueError):
    """Relaxation settings or verification inputs are invalid."""


@dataclass(frozen=True)
class Relaxation:
    """How much target mass a drafted token may borrow from its ``k`` nearest latent neighbours
    (docs/method.md §5.2 for LANTERN, §5.3 for LANTERN++)."""

    method: str  # "exact" | "lantern" | "lantern++"
    k: int = 0  # neighbours considered (0 for exact)
    delta: float = 0.0  # LANTERN total-variation budget, 0 <= delta <= 1
    lam: float = 1.0  # LANTERN++ lambda >= 1

    def __post_init__(self) -> None:
        if self.method not in RELAXATIONS:
            raise AcceptanceError(
                f"relaxation method must be one of {', '.join(RELAXATIONS)}, got {self.method!r}"
            )
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise AcceptanceError(f"neighbour count k must be an integer >= 0, got {self.k!r}")
        if not 0.0 <= self.delta <= 1.0:
            raise AcceptanceError(f"LANTERN delta must be in [0, 1], got {self.delta}")
        if not (math.isfinite(self.lam) and self.lam >= 1.0):
            raise AcceptanceError(f"LANTERN++ lambda must be a finite number >= 1, got {self.lam}")

    @property
    def relaxed(self) -> bool:
        """Whether any neighbour mass can be credited at all."""
        return self.method != "exact" and self.k > 0

    def cap_coefficients(self) -> tuple[float, float]:
        """(a, b): a token whose own mass is r(x) may borrow at most a + b * r(x) from its
        neighbours: LANTERN's delta, LANTERN++'s (lambda - 1) r(x), exact's nothing."""
        if self.method == "lantern":
            return self.delta, 0.0
        if self.method == "lantern++":
            return 0.0, self.lam - 1.0
        return 0.0, 0.0

    def cap(self, r_x: float) -> float:
        """Most neighbour mass that may be credited to a token whose own mass is ``r_x``."""
        a, b = self.cap_coefficients()
        return a + b * r_x


class RelaxInputs(NamedTuple):
    """A relaxation as tensors, inputs of :func:`accept_tree` (see :func:`relax_inputs`)."""

    neighbors: Tensor  # [V, K] int64: every token's nearest latent neighbours, nearest first
    k: Tensor  # [1] int64: how many of the K columns may be credited (0: none)
    cap_a: Tensor  # [1]: the neighbour mass a token may borrow is at most cap_a + cap_b * r(x)
    cap_b: Tensor  # [1]
    greedy: Tensor  # [1] bool


def relax_inputs(
    relax: Relaxation, neighbors: Tensor | None, vocab: int, greedy: bool, device
) -> RelaxInputs:
    """``relax`` as :class:`RelaxInputs` on ``device`` (its cap as :meth:`Relaxation.cap_coefficients`).
    ``neighbors`` [V, k_max] is passed as it is (an exported acceptance graph takes its bundle's
    whole table); it must hold at least k columns when relaxed (:class:`AcceptanceError`
    otherwise). Without one, a one-column table that nothing reads is passed."""
    if relax.relaxed:
        if neighbors is None:
            raise AcceptanceError(f"{relax.method} needs a latent-neighbour table; pass neighbors=[V, k_max]")
        if neighbors.dim() != 2 or neighbors.shape[1] < relax.k:
            raise AcceptanceError(
                f"neighbour table {tuple(neighbors.shape)} has fewer than k={relax.k} columns"
            )
    if neighbors is None:
        neighbors = torch.zeros(vocab, 1, dtype=torch.long)
    table = neighbors.to(device)
    a, b = relax.cap_coefficients()
    return RelaxInputs(
        table,
        torch.tensor([relax.k if relax.relaxed else 0], device=device),
        torch.tensor([a], device=device),
        torch.tensor([b], device=device),
        torch.tensor([greedy], device=device),
    )


class Accepted(NamedTuple):
    """What :func:`accept_tree` returns for a batch of B trees of depth D."""

    length: Tensor  # [B] int64: accepted drafted nodes (0..D); length + 1 tokens are committed
    kept: Tensor  # [B, D + 1] int64: the root (0), then the accepted nodes; 0 past length + 1
    tokens: Tensor  # [B, D + 1] int64: the accepted nodes' tokens, then the bonus at index length
    credit: Tensor | None  # [B, D, 3]: (S, pt, r(x)) of each accepted test; 0 past length (None
    # from a graph, which does not return it)


@lru_cache(maxsize=32)
def children_table(tree: StaticTree, device: torch.device) -> Tensor:
    """[N + 1, W] int64: each node's children in test order, -1 past its last (W >= 1)."""
    width = max(1, max((len(c) for c in tree.children), default=0))
    table = torch.full((tree.num_nodes + 1, width), -1, dtype=torch.long)
    for node, kids in enumerate(tree.children):
        table[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    return table.to(device)


def _row(t: Tensor, index: Tensor) -> Tensor:
    """``t[b, index[b]]`` for t [B, N, V] and index [B] -> [B, V]."""
    return t.gather(1, index[:, None, None].expand(-1, 1, t.shape[-1])).squeeze(1)


def _at(t: Tensor, index: Tensor) -> Tensor:
    """``t[b, index[b]]`` for t [B, N] and index [B] -> [B]."""
    return t.gather(1, index[:, None]).squeeze(1)


def _normalized(t: Tensor) -> Tensor:
    """Each row of ``t`` [B, V] divided by its sum (left as is where the sum is not positive)."""
    total = t.sum(-1, keepdim=True)
    return torch.where(total > 0, t / torch.where(total > 0, total, 1.0), t)


def _residual(rt: Tensor, qq: Tensor) -> Tensor:
    """max(rt - qq, 0), or rt where that has no mass left (rows [B, V]); not normalised."""
    res = (rt - qq).clamp_min(0.0)
    return torch.where(res.sum(-1, keepdim=True) <= torch.finfo(res.dtype).eps, rt, res)


def _put(t: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """A copy of ``t`` [B, V] with ``t[b, index[b, j]] = values[b, j]`` (indices unique per row).
    ``index_put`` exports as a ScatterND without a ``reduction`` attribute, which TensorRT 10.3
    (JetPack 6) requires; ``scatter`` would write one."""
    rows = torch.arange(t.shape[0], device=t.device)[:, None].expand_as(index)
    return t.index_put((rows, index), values)


def _drop_drawn(qq: Tensor, x: Tensor) -> Tensor:
    """The drafter distribution of the next sibling: x [B] removed (drawn without replacement)."""
    return _normalized(_put(qq, x[:, None], qq.new_zeros(x.shape[0], 1)))


def _credit(r: Tensor, x: Tensor, relax: RelaxInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(used [B, K] bool, S [B], r(x) [B]): x may borrow the mass S of its nearest neighbours
    ``used``, the longest prefix of the first k whose mass fits the cap (docs/method.md §5.2)."""
    r_x = _at(r, x)
    neighbours = relax.neighbors[x]  # [B, K]
    columns = torch.arange(neighbours.shape[1], device=r.device) < relax.k
    mass = r.gather(1, neighbours) * columns
    cap = relax.cap_a + relax.cap_b * r_x
    used = (mass.cumsum(-1) <= cap[:, None]) & columns  # a prefix: the masses are >= 0
    return used, (mass * used).sum(-1), r_x


def _relaxed_target(r: Tensor, x: Tensor, neighbours: Tensor, used: Tensor, pt: Tensor) -> Tensor:
    """``r`` with x's ``used`` neighbours zeroed and x holding pt (rows [B, V])."""
    zeroed = _put(torch.zeros_like(r), neighbours, used.to(r.dtype))
    return _put(r * (1.0 - zeroed), x[:, None], pt[:, None])


class _Walk(NamedTuple):
    """The state of the walk down a batch of trees."""

    node: Tensor  # [B] the current node
    alive: Tensor  # [B] still descending
    r: Tensor  # [B, V] the running target at the node (p, then residuals after rejections)
    qq: Tensor  # [B, V] the drafter distribution the next sibling was drawn from
    taken: Tensor  # [B] a child of the node was accepted at this level


def _test_sibling(
    walk: _Walk,
    slot: int,
    kids: Tensor,
    tokens: Tensor,
    valid: Tensor,
    q: Tensor,
    p: Tensor,
    relax: RelaxInputs,
    noise: Tensor,
) -> tuple[_Walk, Tensor, Tensor]:
    """Test each tree's child in sibling ``slot`` of its node against the running target:
    (the walk after it, accepted [B], credit [B, 3])."""
    child = kids[:, slot]
    c = child.clamp_min(0)
    x = _at(tokens, c)
    tested = (child >= 0) & walk.alive & ~walk.taken & _at(valid, c)
    q_x = _at(walk.qq, x)
    used, s, r_x = _credit(walk.r, x, relax)
    pt = r_x + s
    rt = _relaxed_target(walk.r, x, relax.neighbors[x], used, pt)
    greedy = relax.greedy
    sampled_ok = _at(noise, c) * q_x < pt
    greedy_ok = rt.argmax(-1) == x
    tested = tested & (greedy | (q_x > 0))  # a child the drafter gave no mass is skipped
    accepted = tested & ((greedy & greedy_ok) | (~greedy & sampled_ok))  # (ORT has no bool Where)
    rejected = (tested & ~accepted & ~greedy)[:, None]  # greedy tests every child against p
    r = torch.where(rejected, _normalized(_residual(rt, walk.qq)), walk.r)
    qq = torch.where(rejected, _drop_drawn(walk.qq, x), walk.qq)
    take = accepted[:, None]
    walk = _Walk(
        torch.where(accepted, c, walk.node),
        walk.alive,
        torch.where(take, _row(p, c), r),
        torch.where(take, _row(q, c), qq),
        walk.taken | accepted,
    )
    return walk, accepted, torch.stack([s, pt, r_x], -1)


def _bonus(r: Tensor, u: Tensor, greedy: Tensor) -> Tensor:
    """The token after the accepted path [B]: argmax of r when greedy, else a draw from r
    (unnormalised is fine) by the Gumbel-max trick over uniform noise ``u`` [B, V]. Unlike
    inverting the CDF, the draw is decided by a gap between two scores, never by a cumulative
    sum whose rounding differs between engines: torch and a graph on onnxruntime or TensorRT
    draw the same token."""
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
    return torch.where(greedy, r.argmax(-1), (torch.log(r) + gumbel).argmax(-1))


def accept_tree(
    children: Tensor,
    depth: int,
    tokens: Tensor,
    valid: Tensor,
    p: Tensor,
    q: Tensor,
    relax: RelaxInputs,
    noise: Tensor,
    bonus_noise: Tensor,
) -> Accepted:
    """Walk B drafted trees from the root, accepting at most one child per node, then draw a
    bonus token, with no data-dependent control flow (docs/method.md §5).

    ``children`` [N+1, W] is :func:`children_table` and ``depth`` the tree's depth. tokens
    [B, N+1] (tokens[:, 0] the roots), valid [B, N+1] (False: skip that drafted child), p and q
    [B, N+1, V] the target and drafter probabilities at every node (q[:, i] is what node i's
    children were drawn from), ``relax`` the relaxation and greedy flag, ``noise`` [B, N+1]
    uniform in [0, 1) (noise[:, i] for node i's test; noise[:, 0] is not read) and
    ``bonus_noise`` [B, V] uniform, for the bonus draw.
    """
    p, q = p.float(), q.float()
    batch = p.shape[0]
    zero = torch.zeros(batch, dtype=torch.long, device=p.device)
    walk = _Walk(zero, torch.ones(batch, dtype=torch.bool, device=p.device), p[:, 0], q[:, 0], zero > 0)
    kept, credits = [zero], []
    for _ in range(depth):
        kids = children[walk.node]  # [B, W]
        walk = walk._replace(taken=zero > 0)
        credit = p.new_zeros(batch, 3)
        for slot in range(children.shape[1]):
            walk, accepted, c = _test_sibling(walk, slot, kids, tokens, valid, q, p, relax, noise)
            credit = torch.where(accepted[:, None], c, credit)
        walk = walk._replace(alive=walk.alive & walk.taken)
        kept.append(torch.where(walk.alive, walk.node, 0))
        credits.append(credit)
    length = sum((k > 0).long() for k in kept[1:]) if depth else zero
    kept_t = torch.stack(kept, 1)
    bonus = _bonus(walk.r, bonus_noise, relax.greedy)
    out = tokens.gather(1, kept_t[:, 1:])  # the accepted nodes' tokens
    out = _put(torch.cat([out, bonus[:, None]], 1), length[:, None], bonus[:, None])
    credit_t = torch.stack(credits, 1) if depth else p.new_zeros(batch, 0, 3)
    return Accepted(length, kept_t, out, credit_t)


def accept_one(
    tree: StaticTree,
    p: Tensor,
    tokens: Tensor,
    valid: Tensor,
    q: Tensor,
    relax: RelaxInputs,
    noise: Tensor,
    bonus_noise: Tensor,
) -> Accepted:
    """:func:`accept_tree` for one tree: p and q [N+1, V], tokens, valid and noise [N+1],
    bonus_noise [V]."""
    children = children_table(tree, p.device)
    one = (t[None] for t in (tokens, valid, p, q))
    return accept_tree(children, tree.max_depth, *one, relax, noise[None], bonus_noise[None])
