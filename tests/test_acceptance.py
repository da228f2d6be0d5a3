"""Tree acceptance (accept_tree, one static-shape tensor function): greedy equals AR, sampling is
lossless, relaxation caps hold, and planted bugs make the lossless test fail."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

from lantern_rt.runtime import acceptance
from lantern_rt.runtime.acceptance import (
    AcceptanceError,
    Relaxation,
    accept_tree,
    relax_inputs,
    tree_plan,
)
from lantern_rt.runtime.sampling import draw_distinct, draw_noise
from lantern_rt.runtime.tree import StaticTree, build_tree, load_tree

EXACT = Relaxation("exact")
CPU = torch.device("cpu")


class Step(NamedTuple):
    """One tree's acceptance, as lists."""

    path: list[int]  # accepted node ids, root excluded
    bonus: int
    credited: list[tuple[float, float, float]]  # (S, pt, r_x) per accepted node
    tokens: list[int]  # the committed tokens: the path's, then the bonus


def verify(
    tree: StaticTree,
    tokens: Tensor,
    valid: Tensor,
    p: Tensor,
    q: Tensor,
    neighbors: Tensor | None,
    relax: Relaxation,
    greedy: bool,
    generator: torch.Generator | None,
) -> Step:
    """accept_tree on one tree, its noise drawn from ``generator`` (none when greedy)."""
    n = tree.num_nodes + 1
    vocab = p.shape[-1]
    noise = torch.zeros(n + vocab) if greedy else torch.rand(n + vocab, generator=generator)
    out = accept_tree(
        tree_plan(tree, CPU),
        tokens[None],
        valid[None],
        p[None],
        q[None],
        relax_inputs(relax, neighbors, vocab, greedy, CPU),
        noise[None, :n],
        noise[None, n:],
    )
    length = int(out.length[0])
    committed = out.tokens[0, : length + 1].tolist()
    credit = [tuple(c) for c in out.credit[0, :length].tolist()]
    return Step(out.kept[0, 1 : length + 1].tolist(), committed[-1], credit, committed)


def _draft(
    tree: StaticTree,
    roots: Tensor,
    q_of: Callable[[Tensor], Tensor],
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Draft trees for a batch of roots, level by level; ``q_of`` maps node tokens [M] to q [M, V]."""
    batch = roots.shape[0]
    tokens = torch.zeros(batch, tree.num_nodes + 1, dtype=torch.long)
    valid = torch.ones(batch, tree.num_nodes + 1, dtype=torch.bool)
    tokens[:, 0] = roots
    for level in tree.levels[:-1]:
        probs = q_of(tokens[:, list(level)].reshape(-1))
        noise = draw_noise(probs.shape[0], probs.shape[1], greedy, generator, probs.device)
        drawn, ok = draw_distinct(probs, noise, tree.width)
        drawn, ok = drawn.view(batch, len(level), -1), ok.view(batch, len(level), -1)
        for j, node in enumerate(level):
            kids = list(tree.children[node])
            tokens[:, kids] = drawn[:, j, : len(kids)]
            valid[:, kids] = ok[:, j, : len(kids)]
    return tokens, valid


# ----------------------------------------------------------------------------- Relaxation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "eagle"}, "must be one of"),
        ({"method": "lantern", "k": -1}, "k must be"),
        ({"method": "lantern", "delta": 1.5}, r"delta must be in \[0, 1\]"),
        ({"method": "lantern", "delta": -0.1}, r"delta must be in \[0, 1\]"),
        ({"method": "lantern", "delta": math.nan}, r"delta must be in \[0, 1\]"),
        ({"method": "lantern++", "lam": 0.5}, "lambda must be"),
        ({"method": "lantern++", "lam": math.inf}, "lambda must be"),
    ],
)
def test_relaxation_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(AcceptanceError, match=match) as err:
        Relaxation(**kwargs)
    assert "\n" not in str(err.value)


def test_caps() -> None:
    assert Relaxation("exact").cap(0.2) == 0.0
    assert Relaxation("lantern", k=3, delta=0.1).cap(0.2) == pytest.approx(0.1)
    assert Relaxation("lantern++", k=3, lam=5.0).cap(0.2) == pytest.approx(0.8)


# ----------------------------------------------------------------------------- hand-checked credit

# V = 5; token 0 has neighbours 3, 1, 2, 4 (nearest first). p = [0.1, 0.2, 0.3, 0.15, 0.25].
HAND_P = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
HAND_NBRS = torch.tensor([[3, 1, 2, 4], [0, 2, 3, 4], [1, 3, 0, 4], [0, 1, 2, 4], [2, 3, 1, 0]])


def _hand_step(relax: Relaxation) -> Step:
    """Root with one drafted child, token 0, verified greedily."""
    tree = build_tree([[0]])
    p = torch.stack([HAND_P, torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1], dtype=torch.float64)])
    return verify(
        tree, torch.tensor([4, 0]), torch.ones(2, dtype=torch.bool), p, p, HAND_NBRS, relax, True, None
    )


@pytest.mark.parametrize(
    ("relax", "accepted", "credit"),
    [
        (EXACT, False, None),
        # cumsum over (3, 1, 2, 4) = 0.15, 0.35, 0.65, 0.9: the longest prefix within 0.36 is (3, 1)
        (Relaxation("lantern", k=4, delta=0.36), True, 0.35),
        (Relaxation("lantern", k=1, delta=0.36), False, None),  # only 0.15 within reach: 0.25 < 0.3
        (Relaxation("lantern++", k=4, lam=5.0), True, 0.35),  # cap 0.4
        (Relaxation("lantern++", k=4, lam=2.0), False, None),  # cap 0.1 < 0.15: nothing credited
    ],
)
def test_greedy_credit_by_hand(relax: Relaxation, accepted: bool, credit: float | None) -> None:
    result = _hand_step(relax)
    assert result.path == ([1] if accepted else [])
    if accepted:
        s, pt, r_x = result.credited[0]
        assert (s, pt, r_x) == pytest.approx((credit, 0.1 + credit, 0.1))
        assert result.bonus == 1  # argmax of the accepted node's row
    else:
        assert result.bonus == 2  # argmax of p at the root


def test_input_errors() -> None:
    with pytest.raises(AcceptanceError, match="neighbour table"):
        relax_inputs(Relaxation("lantern", k=2, delta=0.1), None, 5, True, CPU)
    with pytest.raises(AcceptanceError, match="fewer than k=9"):
        relax_inputs(Relaxation("lantern++", k=9, lam=2.0), HAND_NBRS, 5, True, CPU)


# ----------------------------------------------------------------------------- greedy == AR

GREEDY_V = 16


def _logits(context: tuple[int, ...], salt: int) -> Tensor:
    """A fixed pseudo-random function of the whole prefix."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((salt, context)).encode()))
    return 2.0 * torch.randn(GREEDY_V, generator=gen, dtype=torch.float64)


def _target(context: tuple[int, ...]) -> Tensor:
    return torch.softmax(_logits(context, 0), dim=-1)


def _drafter(context: tuple[int, ...]) -> Tensor:
    """Shares the target's logits plus noise: its top-w often, not always, holds the target's argmax."""
    return torch.softmax(_logits(context, 0) + 1.5 * _logits(context, 1), dim=-1)


def _greedy_ar(prefix: list[int], length: int) -> list[int]:
    seq = list(prefix)
    while len(seq) < len(prefix) + length:
        seq.append(int(torch.argmax(_target(tuple(seq)))))
    return seq


def _greedy_step(tree: StaticTree, seq: list[int], relax: Relaxation, nbrs: Tensor) -> list[int]:
    """Draft a tree after ``seq`` with top-w of q, verify it greedily; returns the committed tokens."""
    size = tree.num_nodes + 1
    contexts = {0: tuple(seq)}
    tokens = torch.full((size,), seq[-1], dtype=torch.long)
    valid = torch.ones(size, dtype=torch.bool)
    q = torch.zeros(size, GREEDY_V, dtype=torch.float64)  # leaves' rows stay unused
    for level in tree.levels[:-1]:
        for node in level:
            q[node] = _drafter(contexts[node])
        noise = draw_noise(len(level), GREEDY_V, True, None, q.device)
        drawn, ok = draw_distinct(q[list(level)], noise, tree.width)
        for j, node in enumerate(level):
            for rank, kid in enumerate(tree.children[node]):
                tokens[kid], valid[kid] = drawn[j, rank], ok[j, rank]
                contexts[kid] = (*contexts[node], int(drawn[j, rank]))
    p = torch.stack([_target(contexts[i]) for i in range(size)])
    return verify(tree, tokens, valid, p, q, nbrs, relax, True, None).tokens


def _random_neighbours(vocab: int, k: int, seed: int) -> Tensor:
    """k distinct other tokens per token, in a random 'nearest-first' order."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for x in range(vocab):
        others = torch.tensor([t for t in range(vocab) if t != x])
        rows.append(others[torch.randperm(vocab - 1, generator=gen)[:k]])
    return torch.stack(rows)


@pytest.mark.parametrize(
    "relax",
    [EXACT, Relaxation("lantern++", k=4, lam=1.0), Relaxation("lantern", k=4, delta=0.0)],
    ids=["exact", "lantern++-lam1", "lantern-delta0"],
)
@pytest.mark.parametrize("tree_spec", ["naive_extend_57", "chain-3"])
def test_greedy_matches_autoregressive(tree_spec: str, relax: Relaxation) -> None:
    tree, prefix, length = load_tree(tree_spec), [3, 7], 30
    nbrs = _random_neighbours(GREEDY_V, 4, seed=1)
    seq, calls = list(prefix), 0
    while len(seq) < len(prefix) + length:
        seq += _greedy_step(tree, seq, relax, nbrs)
        calls += 1
    assert seq[: len(prefix) + length] == _greedy_ar(prefix, length)
    assert calls < length * 0.8  # drafts were accepted, so the comparison exercised acceptance


def test_greedy_relaxation_changes_output() -> None:
    """Sanity for the test above: a real budget does change greedy output."""
    tree, prefix = load_tree("naive_extend_57"), [3, 7]
    nbrs = _random_neighbours(GREEDY_V, 4, seed=1)
    seq = list(prefix)
    while len(seq) < len(prefix) + 30:
        seq += _greedy_step(tree, seq, Relaxation("lantern", k=4, delta=0.3), nbrs)
    assert seq[: len(prefix) + 30] != _greedy_ar(prefix, 30)


# ----------------------------------------------------------------------------- sampling is lossless

# A Markov target P[prev, next] and a drafter Q that disagrees with it. Q's row 1 has support 3 < the
# tree width 4 (invalid children), and Q drafts token 1 after 2, which the target forbids.
MARKOV_P = torch.tensor(
    [
        [0.40, 0.25, 0.15, 0.12, 0.08],
        [0.10, 0.30, 0.30, 0.20, 0.10],
        [0.25, 0.00, 0.25, 0.25, 0.25],
        [0.15, 0.15, 0.20, 0.10, 0.40],
        [0.30, 0.20, 0.10, 0.20, 0.20],
    ],
    dtype=torch.float64,
)
MARKOV_Q = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.20, 0.50],
        [0.50, 0.00, 0.00, 0.20, 0.30],
        [0.10, 0.60, 0.10, 0.10, 0.10],
        [0.30, 0.30, 0.10, 0.25, 0.05],
        [0.20, 0.20, 0.20, 0.20, 0.20],
    ],
    dtype=torch.float64,
)
START, LENGTH = 0, 3
SAMPLES, BUG_SAMPLES = 20_000, 6_000  # a planted bug must show even with fewer samples
# mc_sim_7b_63 cut at depth 2 (width 4): deeper nodes would only be truncated away at LENGTH 3.
LOSSLESS_TREE = build_tree([path for path in load_tree("mc_sim_7b_63").paths if len(path) <= 2])
CHI2_Z = 3.0902  # standard normal 0.999 quantile: the test's false-alarm rate is 1e-3


def _markov_sequences(tree: StaticTree, samples: int, seed: int) -> Tensor:
    """``samples`` speculative generations of LENGTH tokens after START, every step of all of
    them one batched accept_tree call; LongTensor [samples, LENGTH]."""
    gen = torch.Generator().manual_seed(seed)
    seqs: list[list[int]] = [[] for _ in range(samples)]
    active = list(range(samples))
    plan = tree_plan(tree, CPU)
    relax = relax_inputs(EXACT, None, MARKOV_P.shape[0], False, CPU)
    while active:
        roots = torch.tensor([seqs[i][-1] if seqs[i] else START for i in active])
        tokens, valid = _draft(tree, roots, lambda t: MARKOV_Q[t], False, gen)
        noise = torch.rand(
            len(roots), tokens.shape[1] + MARKOV_P.shape[0], generator=gen, dtype=torch.float64
        )
        noise, bonus = noise.split([tokens.shape[1], MARKOV_P.shape[0]], dim=1)
        p, q = MARKOV_P[tokens], MARKOV_Q[tokens]
        out = accept_tree(plan, tokens, valid, p, q, relax, noise, bonus)
        for row, (i, length) in enumerate(zip(active, out.length.tolist(), strict=True)):
            seqs[i] += out.tokens[row, : length + 1].tolist()
        active = [i for i in active if len(seqs[i]) < LENGTH]
    return torch.tensor([s[:LENGTH] for s in seqs])


def _chi_square(seqs: Tensor) -> tuple[float, float]:
    """(statistic, 0.999 critical value) of the sequence counts against the exact Markov law.

    The critical value uses the Wilson-Hilferty approximation: 166.5 at the 114 degrees of
    freedom here, against scipy's exact 166.4. Cells the target forbids must stay empty.
    """
    vocab = MARKOV_P.shape[0]
    cells = (seqs * torch.tensor([vocab**2, vocab, 1])).sum(dim=1)
    observed = torch.bincount(cells, minlength=vocab**LENGTH).double()
    law = MARKOV_P[START][:, None, None] * MARKOV_P[:, :, None] * MARKOV_P[None, :, :]
    expected = law.reshape(-1) * seqs.shape[0]
    allowed = expected > 0
    assert observed[~allowed].sum() == 0, "a sequence the target forbids was generated"
    assert expected[allowed].min() >= 5  # the chi-square approximation holds
    stat = ((observed - expected)[allowed] ** 2 / expected[allowed]).sum().item()
    dof = int(allowed.sum()) - 1
    critical = dof * (1 - 2 / (9 * dof) + CHI2_Z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, critical


def test_sampling_is_lossless() -> None:
    stat, critical = _chi_square(_markov_sequences(LOSSLESS_TREE, SAMPLES, seed=0))
    print(f"chi-square, correct: {stat:.1f} (critical {critical:.1f})")
    assert stat < critical


def _drop_unnormalised(qq: Tensor, x: Tensor) -> Tensor:
    return qq.scatter(-1, x[..., None], 0.0)


def _plant_no_renormalisation(monkeypatch) -> None:
    """Zero the rejected token in qq but forget to renormalise (in exact mode this is the same
    law as verifying as if the children had been drawn with replacement)."""
    monkeypatch.setattr(acceptance, "_drop_drawn", _drop_unnormalised)


def _plant_unnormalised_residual(monkeypatch) -> None:
    """Test later siblings against the residual max(rt - qq, 0) without renormalising it."""
    normalized = acceptance._normalized
    monkeypatch.setattr(acceptance, "_normalized", lambda t: t)
    monkeypatch.setattr(acceptance, "_drop_drawn", lambda qq, x: normalized(_drop_unnormalised(qq, x)))


def _plant_no_subtraction(monkeypatch) -> None:
    """Keep the relaxed target as the residual instead of max(rt - qq, 0)."""
    monkeypatch.setattr(acceptance, "_residual", lambda rt, qq: rt)


def _plant_residual_from_p(monkeypatch) -> None:
    """Test every sibling against the node's original p instead of the running residual."""
    slot_test = acceptance._slot

    def buggy(state, slot, last, plan, tokens, valid, relax, noise):
        p = state.r if slot == 0 else buggy.p
        buggy.p = p
        return slot_test(state._replace(r=p), slot, last, plan, tokens, valid, relax, noise)

    monkeypatch.setattr(acceptance, "_slot", buggy)


def _plant_skipped_sibling(monkeypatch) -> None:
    """Never test a node's second drafted child (the walk stops after the first rejection)."""
    slot_test = acceptance._slot
    monkeypatch.setattr(
        acceptance, "_slot", lambda state, slot, *rest: state if slot == 1 else slot_test(state, slot, *rest)
    )


def _plant_wrong_bonus(monkeypatch) -> None:
    """Emit the most likely token of the running target as the bonus instead of drawing it."""
    monkeypatch.setattr(acceptance, "draw", lambda r, u, greedy: r.argmax(-1))


PLANTS = [
    _plant_no_renormalisation,
    _plant_unnormalised_residual,
    _plant_no_subtraction,
    _plant_residual_from_p,
    _plant_skipped_sibling,
    _plant_wrong_bonus,
]


@pytest.mark.parametrize("plant", PLANTS)
def test_lossless_check_catches_planted_bug(plant, monkeypatch) -> None:
    plant(monkeypatch)
    stat, critical = _chi_square(_markov_sequences(LOSSLESS_TREE, BUG_SAMPLES, seed=0))
    print(f"chi-square, {plant.__name__}: {stat:.1f} (critical {critical:.1f})")
    assert stat > critical


# ----------------------------------------------------------------------------- relaxation caps

CAP_V, CAP_K, CAP_TRIALS = 32, 8, 300
LANTERN = Relaxation("lantern", k=CAP_K, delta=0.2)
LANTERN_PP = Relaxation("lantern++", k=CAP_K, lam=5.0)


@pytest.fixture(scope="module")
def trials() -> tuple[StaticTree, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Random Markov p/q tables, drafted mc_sim_7b_63 trees and a neighbour table."""
    gen = torch.Generator().manual_seed(7)
    p_tab = torch.softmax(2.0 * torch.randn(CAP_V, CAP_V, generator=gen, dtype=torch.float64), dim=-1)
    q_tab = torch.softmax(2.0 * torch.randn(CAP_V, CAP_V, generator=gen, dtype=torch.float64), dim=-1)
    tree = load_tree("mc_sim_7b_63")
    roots = torch.randint(CAP_V, (CAP_TRIALS,), generator=gen)
    tokens, valid = _draft(tree, roots, lambda t: q_tab[t], False, gen)
    return tree, tokens, valid, p_tab[tokens], q_tab[tokens], _random_neighbours(CAP_V, CAP_K, seed=3)


def _run(trials: tuple, trial: int, relax: Relaxation, greedy: bool = False) -> Step:
    tree, tokens, valid, p, q, nbrs = trials
    gen = torch.Generator().manual_seed(trial)  # the same uniforms for every relaxation
    return verify(tree, tokens[trial], valid[trial], p[trial], q[trial], nbrs, relax, greedy, gen)


def test_caps_hold(trials: tuple) -> None:
    for trial in range(CAP_TRIALS):
        for greedy in (False, True):
            for s, pt, r_x in _run(trials, trial, LANTERN, greedy).credited:
                assert 0.0 <= s <= LANTERN.delta + 1e-6
                assert pt == pytest.approx(r_x + s)
            for s, pt, r_x in _run(trials, trial, LANTERN_PP, greedy).credited:
                assert pt <= LANTERN_PP.lam * r_x + 1e-6
                assert pt == pytest.approx(r_x + s)


def test_relaxation_accepts_more(trials: tuple) -> None:
    first_child = 1  # q_tab has full support, so the root's first drafted child is always valid
    accepted = dict.fromkeys(("exact", "lantern", "lantern++"), 0)
    for trial in range(CAP_TRIALS):
        exact = _run(trials, trial, EXACT)
        accepted["exact"] += len(exact.path)
        for relax in (LANTERN, LANTERN_PP):
            relaxed = _run(trials, trial, relax)
            accepted[relax.method] += len(relaxed.path)
            if exact.path[:1] == [first_child]:  # same uniform, pt >= r_x: relaxed accepts it too
                assert relaxed.path[:1] == [first_child]
    assert accepted["lantern"] > 1.2 * accepted["exact"]
    assert accepted["lantern++"] > 1.2 * accepted["exact"]


@pytest.mark.parametrize(
    "relax", [Relaxation("lantern", k=CAP_K, delta=0.0), Relaxation("lantern++", k=CAP_K, lam=1.0)]
)
def test_zero_budget_is_exact(trials: tuple, relax: Relaxation) -> None:
    for trial in range(0, CAP_TRIALS, 3):
        assert _run(trials, trial, relax) == _run(trials, trial, EXACT)


def test_inputs_not_modified(trials: tuple) -> None:
    _, _, _, p, q, _ = trials
    before = p[0].clone(), q[0].clone()
    _run(trials, 0, LANTERN)
    _run(trials, 0, LANTERN_PP, greedy=True)
    assert torch.equal(p[0], before[0]) and torch.equal(q[0], before[1])


def test_gumbel_max_draws_follow_the_law_and_never_a_zero() -> None:
    """acceptance.draw (the bonus and first-token draw): chi-square against an unnormalised law
    with zero cells over batched rows; greedy is the argmax whatever the noise."""
    from lantern_rt.runtime.acceptance import draw

    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 3.0])  # sums to 10
    u = torch.rand(20000, 8, generator=torch.Generator().manual_seed(0))
    draws = draw(weights.expand(20000, -1), u, torch.tensor([False]))
    observed = torch.bincount(draws, minlength=8).double()
    assert observed[weights == 0].sum() == 0
    expected = weights.double() / weights.sum() * draws.numel()
    allowed = expected > 0
    stat = ((observed - expected)[allowed] ** 2 / expected[allowed]).sum().item()
    assert stat < 20.5  # chi-square, 4 degrees of freedom, p = 0.9996
    assert (
        draw(torch.tensor([0.0, 0.0, 1e-30]), torch.tensor([1e-9, 0.5, 0.99]), torch.tensor([False])).item()
        == 2
    )
    assert draw(weights, u[0], torch.tensor([True])).item() == 1  # the first largest
