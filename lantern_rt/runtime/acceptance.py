"""Verification of one drafted tree: exact, LANTERN and LANTERN++ acceptance (docs/method.md §5).

Sampling mode is recursive rejection sampling without replacement over each node's drafted
children, with the target mass of a child optionally relaxed by crediting it the mass of its
nearest latent neighbours. With no relaxation it is lossless. Greedy mode accepts a child iff it
is the argmax of the (relaxed) target. All tensors may live on any device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from lantern_rt.errors import LanternError
from lantern_rt.runtime.sampling import categorical
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

    def cap(self, r_x: float) -> float:
        """Most neighbour mass that may be credited to a token whose own mass is ``r_x``."""
        if self.method == "lantern":
            return self.delta
        if self.method == "lantern++":
            return (self.lam - 1.0) * r_x
        return 0.0


@dataclass
class StepResult:
    """Outcome of verifying one tree."""

    path: list[int]  # accepted node ids (root excluded), root to deepest
    bonus: int  # the token emitted after the accepted path
    credited: list[tuple[float, float, float]]  # per accepted node: (S, pt, r_x) when it was tested
    tokens: list[int]  # the committed tokens: the accepted path's, then the bonus


def _admissible(masses: list[float], cap: float) -> tuple[int, float]:
    """(used, S): the longest prefix of the neighbours' ``masses`` (nearest first) whose sum S
    fits the cap."""
    used, total = 0, 0.0
    for m in masses:
        if total + m > cap:
            break
        used, total = used + 1, total + m
    return used, total


def _credit(r: Tensor, x: int, nbrs: Tensor | None, relax: Relaxation) -> tuple[int, float, float]:
    """(used, S, r_x): x may be credited the mass S of its ``used`` nearest neighbours, the
    longest prefix whose mass fits the cap; pt = r_x + S. Reads ``r`` only."""
    r_x = r[x].item()
    if nbrs is None:
        return 0, 0.0, r_x
    return (*_admissible(r[nbrs[x]].tolist(), relax.cap(r_x)), r_x)


def _relaxed_target(r: Tensor, x: int, nbrs: Tensor | None, used: int, pt: float) -> Tensor:
    """``r`` with x's ``used`` credited neighbours zeroed and x holding pt (``r`` itself when
    nothing is credited; ``r`` is never modified)."""
    if nbrs is None or used == 0:
        return r
    rt = r.clone()
    rt[nbrs[x, :used]] = 0.0
    rt[x] = pt
    return rt


def _normalized(t: Tensor) -> Tensor:
    """``t`` divided by its sum (left as is when the sum is not positive)."""
    total = t.sum()
    return t / total if total.item() > 0 else t


def _residual(rt: Tensor, qq: Tensor) -> Tensor:
    """max(rt - qq, 0), or rt when that has no mass left; not normalised (see _pick_sampled)."""
    res = (rt - qq).clamp_min(0.0)
    return rt if res.sum().item() <= torch.finfo(res.dtype).eps else res


def _drop_drawn(qq: Tensor, x: int) -> Tensor:
    """The drafter distribution of the next sibling: x removed (drawn without replacement)."""
    qq = qq.clone()
    qq[x] = 0.0
    return _normalized(qq)


@dataclass(frozen=True)
class _FirstTest:
    """The test of a child against its parent's target before any sibling was rejected."""

    q_x: float
    used: int
    s: float
    r_x: float
    u: float


@lru_cache(maxsize=32)
def _parents(tree: StaticTree, device: torch.device) -> Tensor:
    """Parent ids of nodes 1..N on ``device``."""
    return tree.parent[1:].to(device)


@lru_cache(maxsize=8)
def _credit_columns(neighbors: Tensor | None, k: int, vocab: int, device: torch.device) -> Tensor:
    """[V, 1 + k] on ``device``: every token, then its first ``k`` neighbours in the table
    ``neighbors`` (none when it is None). Gathering a node's row of p by it reads r(x) and the
    neighbours' mass at once. Cached per table: the decode loop passes the same one each step."""
    tokens = torch.arange(vocab, device=device)[:, None]
    return tokens if neighbors is None else torch.cat([tokens, neighbors[:, :k].to(device)], dim=1)


def _first_tests(
    tree: StaticTree,
    tokens: Tensor,
    p: Tensor,
    q: Tensor,
    columns: Tensor,
    relax: Relaxation,
    generator: torch.Generator | None,
) -> list[_FirstTest | None]:
    """Every node's test against its parent's untouched target: the masses it reads
    (``columns``: see :func:`_credit_columns`) gathered for all nodes at once and read from
    the device once, the admissible prefix then counted on the host. Index 0 (the root) is None."""
    parents, kids = _parents(tree, p.device)[:, None], tokens[1:, None]
    mass = p[parents, columns[kids[:, 0]]]  # [n, 1 + k]: r(x), then its neighbours' mass
    u = torch.rand(kids.shape, generator=generator, device=p.device, dtype=p.dtype)
    tests: list[_FirstTest | None] = [None]
    for q_x, u_x, r_x, *neighbours in torch.cat([q[parents, kids], u, mass], dim=1).tolist():
        tests.append(_FirstTest(q_x, *_admissible(neighbours, relax.cap(r_x)), r_x, u_x))
    return tests


def _pick_sampled(
    p: Tensor,
    q: Tensor,
    node: int,
    children: list[tuple[int, int]],
    nbrs: Tensor | None,
    relax: Relaxation,
    generator: torch.Generator | None,
    first: list[_FirstTest | None],
) -> tuple[int | None, tuple[float, float, float] | None, Tensor | None]:
    """Test the (node id, token) children of ``node`` in order; returns (accepted node or None,
    credit, final residual: None while it is still ``p[node]``, unnormalised after the last
    child, as only the bonus draw reads it). The first child tested uses its precomputed
    ``first`` test; after a rejection the residual target is built and later siblings are
    tested against it."""
    r: Tensor | None = None
    qq: Tensor | None = None  # q[node] once a child was rejected: until then nothing reads it
    last = children[-1][0] if children else None
    for child, x in children:
        test = first[child]
        if r is None and test is not None:
            q_x, used, s, r_x, u = test.q_x, test.used, test.s, test.r_x, test.u
        else:
            if r is None or qq is None:  # no first test: start from the node's own p and q
                r, qq = p[node], q[node]
            q_x = qq[x].item()
            used, s, r_x = _credit(r, x, nbrs, relax)
            u = torch.rand((), generator=generator, device=p.device).item()
        if q_x <= 0.0:
            continue
        pt = r_x + s
        if u * q_x < pt:
            return child, (s, pt, r_x), r
        qq = q[node] if qq is None else qq
        r = _residual(_relaxed_target(p[node] if r is None else r, x, nbrs, used, pt), qq)
        if child != last:  # a next sibling is tested against r and drawn from qq
            r, qq = _normalized(r), _drop_drawn(qq, x)
    return None, None, r


def _pick_greedy(
    p: Tensor, children: list[tuple[int, int]], nbrs: Tensor | None, relax: Relaxation
) -> tuple[int | None, tuple[float, float, float] | None]:
    """First child whose token is the argmax of the relaxed target built from ``p``."""
    for node, x in children:
        used, s, r_x = _credit(p, x, nbrs, relax)
        if int(torch.argmax(_relaxed_target(p, x, nbrs, used, r_x + s)).item()) == x:
            return node, (s, r_x + s, r_x)
    return None, None


def _neighbour_rows(neighbors: Tensor | None, relax: Relaxation) -> Tensor | None:
    """The first ``k`` neighbours of every token, or None when nothing can be credited."""
    if not relax.relaxed:
        return None
    if neighbors is None:
        raise AcceptanceError(f"{relax.method} needs a latent-neighbour table; pass neighbors=[V, k_max]")
    if neighbors.dim() != 2 or neighbors.shape[1] < relax.k:
        raise AcceptanceError(f"neighbour table {tuple(neighbors.shape)} has fewer than k={relax.k} columns")
    return neighbors[:, : relax.k]


def _check_shapes(tree: StaticTree, tokens: Tensor, valid: Tensor, p: Tensor, q: Tensor) -> None:
    n = tree.num_nodes + 1
    if tokens.shape != (n,) or valid.shape != (n,):
        raise AcceptanceError(
            f"tokens and valid must have shape ({n},), got {tuple(tokens.shape)}, {tuple(valid.shape)}"
        )
    if p.dim() != 2 or p.shape[0] != n or q.shape != p.shape:
        raise AcceptanceError(
            f"p and q must both have shape ({n}, V), got {tuple(p.shape)}, {tuple(q.shape)}"
        )


def _as_float(t: Tensor) -> Tensor:
    """Half-precision probabilities are upcast so residual arithmetic stays accurate."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def verify_tree(
    tree: StaticTree,
    tokens: Tensor,
    valid: Tensor,
    p: Tensor,
    q: Tensor,
    neighbors: Tensor | None,
    relax: Relaxation,
    greedy: bool,
    generator: torch.Generator | None,
) -> StepResult:
    """Walk the tree from the root, accepting at most one child per node, then emit a bonus token.

    tokens [N+1] (tokens[0] the root), valid [N+1] (False: skip that drafted child), p [N+1, V]
    target and q [N+1, V] drafter probabilities at each node, neighbors [V, k_max] nearest-first
    (None for exact). ``generator`` must live on the tensors' device.
    """
    _check_shapes(tree, tokens, valid, p, q)
    nbrs = _neighbour_rows(neighbors, relax)
    p, q = _as_float(p), _as_float(q)
    token_ids, is_valid = tokens.tolist(), valid.tolist()
    first = (
        []
        if greedy or tree.num_nodes == 0
        else _first_tests(
            tree,
            tokens,
            p,
            q,
            _credit_columns(neighbors if relax.relaxed else None, relax.k, p.shape[1], p.device),
            relax,
            generator,
        )
    )
    path: list[int] = []
    credited: list[tuple[float, float, float]] = []
    node, residual = 0, None
    while True:
        children = [(c, token_ids[c]) for c in tree.children[node] if is_valid[c]]
        if greedy:
            child, credit = _pick_greedy(p[node], children, nbrs, relax)
        else:
            child, credit, residual = _pick_sampled(p, q, node, children, nbrs, relax, generator, first)
        if child is None or credit is None:
            break
        path.append(child)
        credited.append(credit)
        node = child
    if greedy:
        bonus = int(torch.argmax(p[node]).item())
    else:
        bonus = int(categorical(p[node] if residual is None else residual, generator).item())
    return StepResult(path, bonus, credited, [*(token_ids[c] for c in path), bonus])
