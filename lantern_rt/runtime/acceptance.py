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
from lantern_rt.runtime.kv_cache import cache_mask, gather_rows
from lantern_rt.runtime.sampling import FilterInputs, cfg_mix, cfg_rows, filtered_softmax, per_row
from lantern_rt.runtime.tree import StaticTree

RELAXATIONS = ("exact", "lantern", "lantern++")  # the speculative methods of runtime.method.METHODS


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
    greedy: Tensor  # [B] bool: each image's (or [1]: every image's; sampling.SamplingRows)


@lru_cache(maxsize=8)
def relax_inputs(
    relax: Relaxation, neighbors: Tensor | None, vocab: int, greedy: bool, device: torch.device
) -> RelaxInputs:
    """``relax`` as :class:`RelaxInputs` on ``device`` (its cap as :meth:`Relaxation.cap_coefficients`),
    the same tensors for the same arguments (a CUDA graph reads them where they lie).
    ``neighbors`` [V, k_max] is passed as it is (an exported acceptance graph takes its bundle's
    whole table); it must hold at least k columns when relaxed (:class:`AcceptanceError`
    otherwise). Without one, a one-column table that nothing reads is passed. ``greedy`` is
    every image's flag ([1]); a decode of images sampled each their own way replaces it by
    their :class:`~lantern_rt.runtime.sampling.SamplingRows` flags [B]."""
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


def _row(t: Tensor, index: Tensor) -> Tensor:
    """``t[b, index[b]]`` for t [B, N, V] and index [B] -> [B, V] (one Gather over the flat rows)."""
    batch, n = t.shape[:2]
    return t.flatten(0, 1).index_select(0, index + n * torch.arange(batch, device=t.device))


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
    """A copy of ``t`` [B, V, ...] with ``t[b, index[b, j]] = values[b, j]`` (indices unique per row).
    ``index_put`` exports as a ScatterND without a ``reduction`` attribute, which TensorRT 10.3
    (JetPack 6) requires; ``scatter`` would write one."""
    rows = torch.arange(t.shape[0], device=t.device)[:, None].expand_as(index)
    return t.index_put((rows, index), values)


def _drop_drawn(qq: Tensor, x: Tensor) -> Tensor:
    """The drafter distribution of the next sibling: x removed (drawn without replacement), for
    rows ``qq`` [..., V] and tokens ``x`` [...]."""
    flat = qq.reshape(-1, qq.shape[-1])
    dropped = _put(flat, x.reshape(-1, 1), flat.new_zeros(flat.shape[0], 1))
    return _normalized(dropped).view(qq.shape)


def _credit(r: Tensor, x: Tensor, neighbours: Tensor, relax: RelaxInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(used [B, K] bool, S [B], r(x) [B]): of its nearest neighbours ``neighbours`` [B, K], x
    may borrow the mass S of those ``used``, the longest prefix of the first k whose mass fits
    the cap (docs/method.md §5.2)."""
    r_x = _at(r, x)
    mass = r.gather(1, neighbours)
    columns = torch.arange(neighbours.shape[1], device=r.device) < relax.k
    cap = relax.cap_a + relax.cap_b * r_x
    # a prefix: the masses are >= 0, and a column past the first k counts as infinite mass
    used = torch.where(columns, mass, math.inf).cumsum(-1) <= cap[:, None]
    return used, torch.where(used, mass, 0.0).sum(-1), r_x


def _relaxed_target(r: Tensor, x: Tensor, neighbours: Tensor, used: Tensor, pt: Tensor) -> Tensor:
    """``r`` with x's ``used`` neighbours zeroed and x holding pt (rows [B, V])."""
    lent = _put(r, neighbours, torch.where(used, 0.0, r.gather(1, neighbours)))
    return _put(lent, x[:, None], pt[:, None])


class _Tests(NamedTuple):
    """Tests of children [M] (credit [M, 3], relaxed targets [M, V])."""

    tested: Tensor  # the child was tested: valid, and (sampling) the drafter gave it mass
    accepted: Tensor
    rejected: Tensor  # tested and not accepted, in sampling mode (greedy keeps no residual)
    rt: Tensor  # the relaxed target its test built (a residual starts from it)
    credit: Tensor  # (S, pt, r(x))


def _test(r: Tensor, qq: Tensor, x: Tensor, valid: Tensor, u: Tensor, relax: RelaxInputs) -> _Tests:
    """Tests of tokens ``x`` [M] against running targets ``r`` and drafter distributions ``qq``
    [M, V] (docs/method.md §5.1-5.4): greedy accepts x when it is the argmax of the relaxed
    target, sampling when u * q(x) < pt (``relax.greedy``: each test's [M], or [1] for all)."""
    neighbours = relax.neighbors.index_select(0, x)  # [M, K]; indexing exports as two nodes
    used, s, r_x = _credit(r, x, neighbours, relax)
    pt = r_x + s
    rt = _relaxed_target(r, x, neighbours, used, pt)
    q_x = _at(qq, x)
    greedy = relax.greedy
    tested = valid & (greedy | (q_x > 0))  # sampling skips a child the drafter gave no mass
    drawn = u * q_x < pt
    ok = (greedy & (rt.argmax(-1) == x)) | (~greedy & drawn)  # (ORT has no bool Where)
    return _Tests(tested, tested & ok, tested & ~(greedy | drawn), rt, torch.stack([s, pt, r_x], -1))


@dataclass(frozen=True)
class TreePlan:
    """A tree's static tables for :func:`accept_tree`, over its P inner nodes (those with
    children), in node order."""

    inner: Tensor  # [P] the inner nodes
    children: Tensor  # [P, W] each inner node's children in test order, -1 past its last
    parent_row: Tensor  # [N] each drafted node's parent's row (nodes 1..N)
    above: Tensor  # [N, N] float: 1 where node a (row) is node v (column) or one of its drafted
    # ancestors, else 0
    depths: Tensor  # [N] float: each drafted node's depth, the sum of its column of ``above``
    level_ids: Tensor  # [N, D] float: node v's id (v + 1) in the column of its depth (d + 1), else 0
    depth: int


@lru_cache(maxsize=32)
def tree_plan(tree: StaticTree, device: torch.device) -> TreePlan:
    """The :class:`TreePlan` of ``tree`` on ``device`` (the root-only tree has one inner row
    with no children, so that every tree has P >= 1)."""
    inner = [v for v, kids in enumerate(tree.children) if kids] or [0]
    width = max(1, max((len(c) for c in tree.children), default=0))
    children = torch.full((len(inner), width), -1, dtype=torch.long)
    row = torch.full((tree.num_nodes + 1,), -1, dtype=torch.long)
    for i, v in enumerate(inner):
        kids = tree.children[v]
        children[i, : len(kids)] = torch.tensor(kids, dtype=torch.long)
        row[v] = i
    n = tree.num_nodes
    above = torch.zeros(n, n)
    for v in range(1, n + 1):
        for a in tree.ancestors[v]:  # v and its drafted ancestors (the root is not listed)
            above[a - 1, v - 1] = 1.0
    depths = torch.tensor(tree.depths[1:], dtype=torch.long)
    levels = depths[:, None] == torch.arange(1, tree.max_depth + 1)[None, :]
    level_ids = levels * torch.arange(1, n + 1, dtype=torch.float32)[:, None]
    parent_row = row[torch.tensor(tree.parents[1:], dtype=torch.long)] if n else row[:0]
    tables = (children, parent_row, above, depths.float(), level_ids)
    return TreePlan(torch.tensor(inner).to(device), *(t.to(device) for t in tables), tree.max_depth)


class _Parents(NamedTuple):
    """Every inner node's sibling tests so far, for B trees: [B, P, ...]."""

    r: Tensor  # [B, P, V] the running target (p, then the residual after each rejection)
    qq: Tensor  # [B, P, V] the drafter distribution the next sibling was drawn from
    chosen: Tensor  # [B, P] the first accepted child, -1 while none
    credit: Tensor  # [B, P, 3] its test's (S, pt, r(x))


def _slot(
    state: _Parents, slot: int, last: bool, plan: TreePlan, tokens, valid, relax: RelaxInputs, noise
) -> _Parents:
    """Test, at every inner node of every tree at once, the child in sibling ``slot`` against the
    node's running target, unless a sibling before it was accepted. A rejection turns the running
    target into the normalised residual max(rt - qq, 0) and drops the child from qq for the next
    sibling (docs/method.md §5.1); after the ``last`` slot qq is not needed any more."""
    batch, rows, vocab = state.r.shape
    child = plan.children[:, slot]  # [P], static
    c = child.clamp_min(0)
    x = tokens.index_select(1, c)  # [B, P]; index_select exports as one Gather, [:, c] as three nodes
    t = _test(
        state.r.reshape(-1, vocab),
        state.qq.reshape(-1, vocab),
        x.reshape(-1),
        valid.index_select(1, c).reshape(-1),
        noise.index_select(1, c).reshape(-1),
        relax,
    )
    accepted, rejected = t.accepted.view(batch, rows), t.rejected.view(batch, rows)
    if slot:  # in slot 0 every inner node has a child and none is chosen yet
        open_ = (child >= 0) & (state.chosen < 0)  # [B, P]
        accepted, rejected = open_ & accepted, open_ & rejected
    rejected = rejected[..., None]
    residual = _residual(t.rt.view(batch, rows, vocab), state.qq)
    # after the last slot r only feeds the bonus draw, which takes unnormalised rows
    r = torch.where(rejected, residual if last else _normalized(residual), state.r)
    qq = state.qq if last else torch.where(rejected, _drop_drawn(state.qq, x), state.qq)
    return _Parents(
        r,
        qq,
        torch.where(accepted, child, state.chosen),
        torch.where(accepted[..., None], t.credit.view(batch, rows, 3), state.credit),
    )


def draw(r: Tensor, u: Tensor, greedy: Tensor) -> Tensor:
    """One token per row of r [..., V]: argmax when ``greedy``, else a draw from r (unnormalised
    is fine) by the Gumbel-max trick over uniform noise ``u`` [..., V]. The bonus token of every
    step and the first token after the prefill are drawn so (docs/method.md §2). Unlike
    inverting the CDF, the draw is decided by a gap between two scores, never by a cumulative
    sum whose rounding differs between engines: torch and a graph on onnxruntime or TensorRT
    draw the same token. ``greedy``: each row's [B] (r [B, ..., V]), or [1] for all."""
    offsets = torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))  # minus the Gumbel noise
    return torch.where(per_row(greedy, r), r, torch.log(r) - offsets).argmax(-1)


def _walk(plan: TreePlan, state: _Parents, nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """The walk from the root over every tree at once, with no loop over depths: a drafted node
    is on the accepted path when it is its parent's chosen child and so is each of its drafted
    ancestors; the path holds at most one node per depth. -> the accepted length [B], the path's
    node ids [B, D] (0 past its end) and each accepted test's credit [B, D, 3].
    The counts and ids are sums of small integers by matrix products (exact in float32): one
    product each instead of an ``any`` over [B, N, N] and [B, D, N]."""
    device = state.chosen.device
    hit = state.chosen.index_select(1, plan.parent_row) == torch.arange(1, nodes, device=device)  # [B, N]
    on_path = (hit.float() @ plan.above == plan.depths).float()  # [B, N]: a hit at v and above it
    path = (on_path @ plan.level_ids).long()  # [B, D]: the node on the path at each depth, 0 if none
    accepted = path > 0  # a prefix
    parent_rows = plan.parent_row[(path - 1).clamp_min(0)]  # [B, D]
    credits = state.credit.gather(1, parent_rows[..., None].expand(-1, -1, 3))
    return on_path.sum(-1).long(), path, torch.where(accepted[..., None], credits, 0.0)


def accept_tree(
    plan: TreePlan,
    tokens: Tensor,
    valid: Tensor,
    p: Tensor,
    q: Tensor,
    relax: RelaxInputs,
    noise: Tensor,
    bonus_noise: Tensor,
) -> Accepted:
    """Accept the longest path of B drafted trees, at most one child per node, then draw a bonus
    token, with no data-dependent control flow (docs/method.md §5).

    The sibling tests run slot by slot at every inner node at once (W steps); the walk from the
    root then only follows each node's first accepted child (D gathers). ``plan`` is
    :func:`tree_plan`; tokens [B, N+1] (tokens[:, 0] the roots), valid [B, N+1] (False: skip
    that drafted child), p and q [B, N+1, V] the target and drafter probabilities at every node
    (q[:, i] is what node i's children were drawn from), ``relax`` the relaxation and greedy
    flags (each image's [B], or [1] for all), ``noise`` [B, N+1] uniform in [0, 1)
    (noise[:, i] for node i's test; noise[:, 0] is not read) and ``bonus_noise`` [B, V]
    uniform, for the bonus draw.
    """
    p, q = p.float(), q.float()
    batch, rows = p.shape[0], plan.children.shape[0]
    if not plan.depth:  # the root-only tree (AR): nothing is tested, the bonus is drawn from p at the root
        length = torch.zeros(batch, dtype=torch.long, device=p.device)
        bonus = draw(p.select(1, 0), bonus_noise, relax.greedy)
        return Accepted(length, length[:, None], bonus[:, None], p.new_zeros(batch, 0, 3))
    state = _Parents(
        p.index_select(1, plan.inner),
        q.index_select(1, plan.inner),
        torch.full((batch, rows), -1, dtype=torch.long, device=p.device),
        p.new_zeros(batch, rows, 3),
    )
    width = plan.children.shape[1]
    # each image's greedy flag at each of its P tests of a slot ([B * P], as _slot flattens them;
    # one flag for every image ([1]) broadcasts as it is)
    greedy = relax.greedy
    tests = relax._replace(
        greedy=greedy if greedy.shape[0] == 1 else greedy[:, None].expand(batch, rows).reshape(-1)
    )
    for slot in range(width):
        state = _slot(state, slot, slot == width - 1, plan, tokens, valid, tests, noise)
    length, path, credit = _walk(plan, state, tokens.shape[1])
    none = torch.zeros_like(path[:, :1])
    kept = torch.cat([none, path], 1)
    node = kept.gather(1, length[:, None]).squeeze(1)  # the path's last node (the root if none)
    # every node's running target: an inner node's after its tests, a leaf's p
    final = _row(_put(p, plan.inner.expand(p.shape[0], -1), state.r), node)
    bonus = draw(final, bonus_noise, relax.greedy)
    at_bonus = torch.arange(plan.depth + 1, device=p.device) == length[:, None]
    out = torch.where(at_bonus, bonus[:, None], tokens.gather(1, torch.cat([path, none], 1)))
    return Accepted(length, kept, out, credit)


def target_probabilities(logits: Tensor, sampling: FilterInputs, images: int) -> Tensor:
    """The target distribution acceptance compares against: the CFG rows of ``logits``
    [2B, ..., V] of B ``images`` mixed (-> [B, ..., V]; B rows, guidance off, as they are),
    then temperature, top-k and top-p (``sampling``: each image's settings [B] as
    :class:`~lantern_rt.runtime.sampling.SamplingRows` holds them, or [1] for all as
    :func:`~lantern_rt.runtime.sampling.filter_inputs` gives them), then a softmax."""
    return filtered_softmax(cfg_mix(logits, sampling.cfg_scale, images), sampling)


def tree_step_inputs(
    depth: Tensor, tree_mask: Tensor, length: Tensor, capacity: int, rows: int, prefix: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Positions [rows, N+1] and mask [rows, 1, N+1, capacity + N+1] (``rows``: 2B, or B without
    guidance) of a verify step over a tree
    (its ``depth`` and ``tree_mask``, on the device) after ``length`` [B] committed cache
    entries per image (of ``capacity``): each node at its image's length + its depth, seeing
    every committed entry of its image but the prefix slots ``prefix`` [2B, P] hides, and its
    ancestors (docs/method.md §3, §7, §9)."""
    positions = cfg_rows(length, rows)[:, None] + depth  # the rows' lengths, as the mask reads them
    return positions, cache_mask(length, capacity, tree_mask, rows, prefix)


class Verified(NamedTuple):
    """B verified and accepted trees of depth D, with what the next step needs, gathered by the
    kept node ids (root first) so that each image's first ``length + 1`` entries are the
    committed ones."""

    length: Tensor  # [B] int64: accepted drafted nodes
    kept: Tensor  # [B, D + 1] int64: the root, then the accepted nodes (0 past length + 1)
    tokens: Tensor  # [B, D + 1] int64: the accepted nodes' tokens, then the bonus at index length
    hidden: Tensor  # [2B, D + 1, dim]: the target's hidden states at the kept nodes
    new_k: Tensor | None  # [n_layer, 2B, Hkv, D + 1, head_dim]: their K, to commit to the cache
    new_v: Tensor | None  # (None: the step wrote every node's K/V into the cache: KVCache.commit)
    logits: Tensor  # [2B, N + 1, V] fp32: the target's logits at every node
    probs: Tensor  # [B, N + 1, V] fp32: the target distribution at every node (target_probabilities),
    # what a Jacobi window drafts the next positions from (docs/method.md §11)


def verify_tree(
    plan: TreePlan,
    logits: Tensor,
    hidden: Tensor,
    new_k: Tensor | None,
    new_v: Tensor | None,
    tokens: Tensor,
    valid: Tensor,
    q: Tensor,
    noise: Tensor,
    bonus_noise: Tensor,
    sampling: FilterInputs,
    relax: RelaxInputs,
) -> Verified:
    """Acceptance of B trees from the target's outputs over them (``logits`` [2B, N+1, V],
    ``hidden`` [2B, N+1, dim], ``new_k``/``new_v`` [n_layer, 2B, Hkv, N+1, head_dim]): the
    target distribution (:func:`target_probabilities`), :func:`accept_tree` over the drafted
    ``tokens``/``valid`` [B, N+1] and ``q`` [B, N+1, V] with ``noise`` [B, N+1] and
    ``bonus_noise`` [B, V], and the kept nodes' hidden states and K/V gathered on the device
    (no K/V when ``new_k``/``new_v`` are None: the torch target wrote them into its cache).
    Every verify graph of a bundle is the target's step followed by this function; the torch
    backend runs it eagerly."""
    p = target_probabilities(logits, sampling, tokens.shape[0])
    out = accept_tree(plan, tokens, valid, p, q, relax, noise, bonus_noise)
    if plan.depth:  # the root-only tree's one node is kept as it is
        hidden = gather_rows(hidden, out.kept, 0, 1)
        if new_k is not None and new_v is not None:
            new_k, new_v = (gather_rows(t, out.kept, 1, 3) for t in (new_k, new_v))
    return Verified(out.length, out.kept, out.tokens, hidden, new_k, new_v, logits, p)
