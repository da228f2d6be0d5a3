"""Drafter-free speculative Jacobi decoding (--method sjd, sjd++; docs/method.md §11).

- sjd draws from the target's distribution: a chi-square test on a Markov target decoded by the
  real decode loop with the Jacobi window, which fails when a bug is planted in the drafts;
- greedy sjd gives AR's tokens on torch and onnxruntime at batch sizes 1 and 2, and sampled
  tokens do not depend on the batch or the backend;
- model directories with no drafter (LlamaGen c2i and t2i, Anole, Lumina-mGPT) generate with it
  end to end from the command line;
- bad settings are one line, exit code 2.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.bundle import Bundle
from lantern_rt.cli import main
from lantern_rt.eval.bench import method_config
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.config import ConfigError
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime import acceptance, jacobi
from lantern_rt.runtime.acceptance import Accepted, Relaxation, draw, tree_plan, verify_tree
from lantern_rt.runtime.decode import Condition, Speculation, decode_images
from lantern_rt.runtime.jacobi import JacobiDrafter
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from lantern_rt.settings import DEFAULT_COUPLING, MethodConfig, RunPlan
from tests.conftest import exported, tiny_gpt, tiny_vq, write_model_dir
from tests.test_baseline import chi_square, chi_square_critical
from tests.test_speculative import GREEDY

CPU = torch.device("cpu")

# ----------------------------------------------------------------------------- lossless sampling

# A Markov target over V = 3 tokens: the first token from MARKOV_START, the second from the row of
# the first, and (first order) each next one from the row of the one before, or (second order)
# from MARKOV_P2's row of the two before, so that a draft scored after a stale token two back is
# stale too. Every entry is positive (log-probabilities stay finite under CFG).
MARKOV_START = torch.tensor([0.5, 0.3, 0.2])
MARKOV_P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.35, 0.05, 0.6]])
MARKOV_P2 = torch.tensor(
    [
        [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]],
        [[0.1, 0.6, 0.3], [0.5, 0.4, 0.1], [0.05, 0.15, 0.8]],
        [[0.2, 0.1, 0.7], [0.8, 0.1, 0.1], [0.45, 0.45, 0.1]],
    ]
)
LENGTH, ROW = 5, 2  # image rows of 2: carried, spatial and root drafts
SAMPLES, BUG_SAMPLES, BATCH = 12_000, 6_000, 250  # BATCH: images per step, a RunShape batch size
# (coupling, window): each coupling on a chain, and on a pac tree (2 candidates per position
# down to depth 2, then a chain: 7 nodes, 3 positions)
WINDOWS = [("none", "chain-3"), ("maximal", "chain-3"), ("gumbel", "chain-3")]
WINDOWS += [("none", "pac-2-2-7"), ("maximal", "pac-2-2-7"), ("gumbel", "pac-2-2-7")]


class MarkovTarget:
    """A ``TargetBackend`` whose logits at a node are the log of the Markov law's row after the
    node's token (and, ``order`` 2, the token before it: its parent's, or the root's predecessor,
    which the cache holds as token + 1, 0 for the condition slot), accepted by the real
    :func:`verify_tree`; its one-layer cache holds each committed token + 1."""

    name = "markov"
    cls_token_num = 1

    def __init__(self, batch: int, length: int = LENGTH, depth: int = 3, order: int = 1):
        self.batch, self.order = batch, order
        self.cache = KVCache(1, 1, length + depth + 2, 1, torch.float32, CPU, RunShape(batch), prefix=1)

    def prefill(self, cond, prefix=None, fresh=None):
        rows = cond.shape[0]
        zeros = torch.zeros(1, rows, 1, 1, 1)
        self.cache.restart(zeros, zeros, fresh, self.cache.visible(prefix))
        return MARKOV_START.log().expand(rows, -1), torch.zeros(rows, 1, 1)

    def verify(self, tree, draft, noise, bonus_noise, sampling, relax):
        tokens = draft.tokens
        logits = MARKOV_P.log()[tokens]  # [B, N+1, V]
        if self.order == 2:
            last = self.cache.k[0, : self.batch, 0, :, 0].gather(1, (self.cache.length - 1)[:, None])[:, 0]
            before = tokens.index_select(1, tree.parent.clamp_min(0))  # each node's parent's token
            before[:, 0] = last.long() - 1  # the root's predecessor; -1: none
            second = MARKOV_P2.log()[before.clamp_min(0), tokens]
            logits = torch.where((before >= 0)[..., None], second, logits)
        logits = torch.cat([logits, logits])
        rows, nodes = logits.shape[:2]
        committed = torch.cat([tokens, tokens]).float().add(1).view(1, rows, 1, nodes, 1)
        hidden = torch.zeros(rows, nodes, 1)
        plan = tree_plan(tree, CPU)
        return verify_tree(
            plan,
            logits,
            hidden,
            committed,
            committed,
            tokens,
            draft.valid,
            draft.q,
            noise,
            bonus_noise,
            sampling,
            relax,
        )


def markov_sequences(
    samples: int, seed: int, coupling: str = "none", window: str = "chain-3", order: int = 1
) -> torch.Tensor:
    """``samples`` sequences of LENGTH tokens from the decode loop with a Jacobi window of
    ``coupling``, BATCH images at a time, each from its own generator; LongTensor [samples, LENGTH]."""
    tree = load_tree(window)
    target = MarkovTarget(BATCH, depth=tree.max_depth, order=order)
    drafter = JacobiDrafter(tree, BATCH, 3, target.cache.capacity, 1, ROW, CPU, coupling)
    spec = Speculation(drafter, tree, Relaxation("exact"))
    jobs = [
        (Condition(torch.tensor([0, 0])), torch.Generator().manual_seed(seed * samples + i))
        for i in range(samples)
    ]
    sampling = SamplingConfig(cfg_scale=1.0, temperature=1.0)
    out = torch.zeros(samples, LENGTH, dtype=torch.long)
    for index, result in decode_images(target, jobs, LENGTH, sampling, spec):
        out[index] = result.tokens
    return out


def markov_law(order: int) -> torch.Tensor:
    """The target's law of LENGTH tokens, [V ** LENGTH] in base-V order of the sequences."""
    law = MARKOV_START.double()[:, None] * MARKOV_P.double()  # [V, V]
    for _ in range(LENGTH - 2):
        law = law[..., None] * (MARKOV_P if order == 1 else MARKOV_P2).double()  # rows by the last 1 or 2
    return law.reshape(-1)


def markov_chi_square(seqs: torch.Tensor, order: int = 1) -> tuple[float, float]:
    """(statistic, critical value at p = 0.9999) of the sequences' counts against the law."""
    vocab = MARKOV_P.shape[0]
    cells = (seqs * vocab ** torch.arange(LENGTH - 1, -1, -1)).sum(1)
    counts = torch.bincount(cells, minlength=vocab**LENGTH)
    stat, df = chi_square(counts, markov_law(order), len(seqs))
    return stat, chi_square_critical(df)


def test_the_second_order_law_is_a_law_of_its_rows():
    law = markov_law(2).view((3,) * LENGTH)
    assert torch.isclose(law.sum(), torch.tensor(1.0, dtype=law.dtype))
    assert torch.allclose(law[1, 2, 0, 1, 2], torch.tensor(0.3 * 0.6 * 0.05 * 0.1 * 0.8, dtype=law.dtype))
    first = markov_law(1).view((3,) * LENGTH)
    assert torch.allclose(first[1, 2, 0, 1, 2], torch.tensor(0.3 * 0.6 * 0.35 * 0.3 * 0.6, dtype=law.dtype))


@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize(("coupling", "window"), WINDOWS)
def test_sjd_draws_from_the_markov_chain_distribution(coupling, window, order):
    stat, critical = markov_chi_square(markov_sequences(SAMPLES, 0, coupling, window, order), order)
    print(f"chi-square, sjd {coupling} {window} order {order}: {stat:.1f} (critical {critical:.1f})")
    assert stat < critical


@pytest.mark.parametrize(("coupling", "window"), WINDOWS)
def test_the_window_accepts_drafts(coupling, window):
    """The check above exercised acceptance: fewer verify calls than tokens (tau > 1), and a pac
    tree's siblings were accepted too."""
    tree = load_tree(window)
    target = MarkovTarget(4, length=20, depth=tree.max_depth, order=2)
    drafter = JacobiDrafter(tree, 4, 3, target.cache.capacity, 1, ROW, CPU, coupling)
    spec = Speculation(drafter, tree, Relaxation("exact"))
    jobs = [(Condition(torch.tensor([0, 0])), torch.Generator().manual_seed(i)) for i in range(200)]
    calls = sum(
        len(r.accepted) for _, r in decode_images(target, jobs, 20, SamplingConfig(cfg_scale=1.0), spec)
    )
    assert calls < 200 * 19 / 1.3


def test_spatial_drafts_read_the_row_above_or_the_root():
    """Positions 5..9 after a root at 4 (prefix 1, rows of 3, history up to the root only, the
    last slots of a 6-slot history: a window longer than a row reads nothing past the root)."""
    history = torch.tensor([[0, 11, 12, 13, 14, 0]])
    got = jacobi.spatial_drafts(history, torch.tensor([14]), torch.tensor([4]), 5, 3, 1)
    assert got.tolist() == [[12, 13, 14, 14, 14]]  # above 5, 6, 7 = 2, 3, 4; 8 and 9: the root


def test_the_continuation_of_a_pac_tree_follows_rank_0():
    """pac-2-2-7: nodes 1, 2 (depth 1), 3..6 (depth 2: children of 1, then of 2), 7 below node 3;
    below a node with no rank-0 child the continuation is the rank-0 path's."""
    tree = load_tree("pac-2-2-7")
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0))
    table = jacobi.descendants(tree)
    assert table[0].tolist() == [0, 1, 3, 7, -1]
    assert table[2].tolist() == [2, 5, 7, -1, -1] and table[6].tolist() == [6, 7, -1, -1, -1]
    assert table[7].tolist() == [7, -1, -1, -1, -1]


def _plant_argmax_drafts(monkeypatch):
    """Draft the most likely token of each position but keep its row as q (no Gumbel noise)."""
    monkeypatch.setattr(jacobi, "gumbel_offsets", torch.zeros_like)


def _plant_coupling_with_q_old(monkeypatch):
    """Maximal coupling whose redraw is from p itself, not the residual max(p - q_old, 0)."""
    coupling = jacobi.maximal_coupling

    def buggy(p, old, q_old, has_old, u, offsets):
        return coupling(p, old, torch.zeros_like(q_old), has_old, u, offsets)

    monkeypatch.setattr(jacobi, "maximal_coupling", buggy)


def _plant_kept_draft_keeping_its_q(monkeypatch):
    """Maximal coupling that tests a kept draft with the q it was drawn from (SCD's Lumina and
    Janus samplers), not p."""
    coupling = jacobi.maximal_coupling

    def buggy(p, old, q_old, has_old, u, offsets):
        tokens, q = coupling(p, old, q_old, has_old, u, offsets)
        kept = has_old & (tokens == old)  # a redraw is never the old token
        return tokens, torch.where(kept[..., None], q_old, q)

    monkeypatch.setattr(jacobi, "maximal_coupling", buggy)


def _plant_unshifted_noise(monkeypatch):
    """Gumbel coupling whose noise stays in its window slot as tokens commit."""
    shifted = jacobi.shifted_noise
    monkeypatch.setattr(
        jacobi, "shifted_noise", lambda kept, fresh, m, ready: shifted(kept, fresh, 0 * m, ready)
    )


def _plant_siblings_from_the_residual(monkeypatch):
    """A pac tree whose siblings are drawn from maximal coupling's residual max(p - q_old, 0) but
    tested as if drawn without replacement from p (SJD-PAC's code)."""
    coupling, ranked, seen = jacobi.maximal_coupling, jacobi.ranked_candidates, {}

    def remember(p, old, q_old, has_old, u, offsets):
        seen["residual"] = torch.where(has_old[..., None], (p - q_old).clamp_min(0.0), p)
        return coupling(p, old, q_old, has_old, u, offsets)

    def buggy(p, first, offsets, width):
        tokens, _ = ranked(seen["residual"], first, offsets, width)
        return tokens, p.gather(-1, tokens) > 0

    monkeypatch.setattr(jacobi, "maximal_coupling", remember)
    monkeypatch.setattr(jacobi, "ranked_candidates", buggy)


def _plant_longest_row(monkeypatch):
    """Tree acceptance that tests every root-to-leaf row on its own (each node against its
    parent's p) and commits the longest accepted prefix of any row (SJD-PAC's code), with the
    bonus from the residual where that row failed. On a chain it is the real acceptance."""

    def longest_row(plan, tokens, valid, p, q, relax, noise, bonus_noise):
        batch, depth, nodes = tokens.shape[0], plan.depth, tokens.shape[1]
        parents = [0, *plan.inner[plan.parent_row].tolist()]  # node v's parent at index v (v >= 1)
        leaves = [v for v in range(1, nodes) if v not in plan.inner.tolist()]
        best = torch.zeros(batch, dtype=torch.long)
        kept = torch.zeros(batch, depth + 1, dtype=torch.long)
        for leaf in leaves:
            row = [a + 1 for a in range(nodes - 1) if plan.above[a, leaf - 1] > 0]  # by depth
            ok, length = torch.ones(batch, dtype=torch.bool), torch.zeros(batch, dtype=torch.long)
            for v in row:
                x, parent = tokens[:, v : v + 1], parents[v]
                ok = ok & (noise[:, v] * q[:, parent].gather(1, x)[:, 0] < p[:, parent].gather(1, x)[:, 0])
                length += ok
            longer = length > best
            ids = torch.tensor([0, *row] + [0] * (depth - len(row)))
            kept = torch.where(
                longer[:, None], torch.where(torch.arange(depth + 1) <= length[:, None], ids, 0), kept
            )
            best = torch.where(longer, length, best)
        node = kept.gather(1, best[:, None])[:, 0]
        whole = ~torch.isin(node, plan.inner)  # the row was accepted to its leaf
        pn, qn = p[torch.arange(batch), node], q[torch.arange(batch), node]
        bonus = draw(torch.where(whole[:, None], pn, (pn - qn).clamp_min(0.0)), bonus_noise, relax.greedy)
        out = torch.cat([tokens.gather(1, kept[:, 1:]), bonus[:, None]], 1).scatter(
            1, best[:, None], bonus[:, None]
        )
        return Accepted(best, kept, out, None)

    monkeypatch.setattr(acceptance, "accept_tree", longest_row)


@pytest.mark.parametrize(
    ("plant", "coupling", "window"),
    [
        (_plant_argmax_drafts, "gumbel", "chain-3"),
        (_plant_argmax_drafts, "none", "pac-2-2-7"),
        (_plant_coupling_with_q_old, "maximal", "chain-3"),
        (_plant_kept_draft_keeping_its_q, "maximal", "chain-3"),
        (_plant_kept_draft_keeping_its_q, "maximal", "pac-2-2-7"),
        (_plant_unshifted_noise, "gumbel", "chain-3"),
        (_plant_unshifted_noise, "gumbel", "pac-2-2-7"),
        (_plant_siblings_from_the_residual, "maximal", "pac-2-2-7"),
        (_plant_longest_row, "none", "pac-2-2-7"),
        (_plant_longest_row, "maximal", "pac-2-2-7"),
    ],
)
def test_the_check_catches_a_planted_bug(plant, coupling, window, monkeypatch):
    plant(monkeypatch)
    stat, critical = markov_chi_square(markov_sequences(BUG_SAMPLES, 1, coupling, window, 2), 2)
    print(f"chi-square, {plant.__name__} {coupling} {window}: {stat:.1f} (critical {critical:.1f})")
    assert stat > critical


# ----------------------------------------------------------------------------- greedy and batches

SJD = MethodConfig("sjd", tree="chain-3")
SJD_PP = MethodConfig("sjd++", tree="chain-3", k=4, lam=5.0)
PAC = "pac-2-2-7"
COUPLED = [
    MethodConfig("sjd", tree=t, coupling=c) for t in ("chain-3", PAC) for c in ("maximal", "gumbel", "none")
]
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
LABELS = [0, 3, 1, 4, 2]


@pytest.fixture(scope="module")
def no_drafter_bundle(tmp_path_factory) -> Bundle:
    """A random tiny target (no drafter) whose greedy and sampled images Jacobi drafts well enough
    (tau 1.3-1.5: a pattern-trained target, each token fixed by the one before, gives 1.0),
    exported with the verify graphs of chain-3 and pac-2-2-7 at B 1 and 2 (one cache window: the
    tokens do not depend on the windows, tests/test_cache_windows.py)."""
    target = tiny_gpt(1)
    path = tmp_path_factory.mktemp("jacobi") / "bundle"
    model = write_model_dir(path.with_name("bundle-model"), target, tiny_vq())
    trees = [load_tree("chain-3"), load_tree(PAC)]
    return Bundle.open(exported(open_model_dir(model), path, trees, batch_sizes=(1, 2), windows=1))


def run(source, backend: str, method: MethodConfig, sampling: SamplingConfig, batch: int = 1):
    pipe = build_pipeline(RunPlan(source, backend, method, sampling, RunShape(batch), threads=1))
    return generate(pipe, LABELS, sampling, seed=5, progress=False)


@pytest.mark.slow
def test_greedy_sjd_gives_ar_tokens_on_every_backend_and_batch(no_drafter_bundle):
    md = open_model_dir(no_drafter_bundle.path.with_name("bundle-model"))
    assert "drafter" not in md.files and not no_drafter_bundle.has_drafter
    ar = run(md, "torch", MethodConfig("ar"), GREEDY)
    for source, backend in ((md, "torch"), (no_drafter_bundle, "onnxruntime")):
        for batch in (1, 2):
            for method in COUPLED:
                got = run(source, backend, method, GREEDY, batch)
                assert torch.equal(got.tokens, ar.tokens), (backend, batch, method)
                assert got.stats.mean_accepted_length > 1.25  # drafts were accepted
    relaxed = run(md, "torch", SJD_PP, GREEDY)
    assert not torch.equal(relaxed.tokens, ar.tokens)  # sanity: the credit changes greedy tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", [SJD_PP, *COUPLED])
def test_sampled_tokens_depend_on_neither_batch_nor_backend(no_drafter_bundle, method):
    md = open_model_dir(no_drafter_bundle.path.with_name("bundle-model"))
    reference = run(md, "torch", method, SAMPLED)
    assert reference.stats.mean_accepted_length > 1.2
    for source, backend, batch in (
        (md, "torch", 2),
        (no_drafter_bundle, "onnxruntime", 1),
        (no_drafter_bundle, "onnxruntime", 2),
    ):
        got = run(source, backend, method, SAMPLED, batch)
        assert torch.equal(got.tokens, reference.tokens), (backend, batch)


@pytest.mark.slow
def test_a_bundle_without_the_window_names_the_export(no_drafter_bundle, tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "-q",
            "--bundle",
            str(no_drafter_bundle.path),
            "--method",
            "sjd",
            "--window",
            "4",
            "-o",
            str(tmp_path / "x.png"),
        ],
    )
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert (
        "no verify graph for --window 4" in r.output
        and "lantern export" in r.output
        and "--tree chain-4" in r.output
    )
    assert not (tmp_path / "x.png").exists()
    args = [
        "generate",
        "-q",
        "--bundle",
        str(no_drafter_bundle.path),
        "--method",
        "sjd",
        "--tree",
        "pac-2-1-4",
    ]
    r = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "no verify graph for --tree pac-2-1-4" in r.output and "lantern export" in r.output
    shown = CliRunner().invoke(main, ["inspect", str(no_drafter_bundle.path)])
    assert "tree     chain-3: 3 nodes, verified by target_verify_0 (a Jacobi window" in shown.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--method", "sjd", "--tree", "mc_sim_7b_63"], "--tree takes chain-N or pac-K-D-N"),
        (["--method", "sjd", "--tree", "pac-2-2-16"], "at most 15 (the image has 16 tokens)"),
        (["--method", "sjd", "--tree", "pac-1-2-8"], "needs 2 <= K <= 10"),
        (["--method", "sjd", "--tree", "pac-2-0-8"], "D must be >= 1"),
        (["--method", "sjd", "--tree", "pac-3-2-8"], "has 12 nodes"),
        (["--method", "sjd", "--tree", "chain-3", "--window", "3"], "give --window N or --tree, not both"),
        (["--method", "lantern++", "--coupling", "gumbel"], "--coupling sets how --method sjd or sjd++"),
        (["--coupling", "maximal"], "--coupling sets how"),
        (["--method", "lantern++", "--window", "3"], "--window sets the Jacobi window"),
        (["--window", "2"], "--window sets the Jacobi window"),  # the default method, ar
        (["--method", "sjd", "--window", "16"], "--window must be at most 15 (the image has 16 tokens)"),
        (["--method", "sjd", "--window", "0"], "--window must be an integer >= 1, not 0"),
        (["--method", "sjd++", "--lantern-lambda", "0.5"], "lambda"),
    ],
)
def test_bad_window_settings_are_one_line_exit_2(tiny_model_dir, tmp_path, args, says):
    out = tmp_path / "x.png"
    r = CliRunner().invoke(main, ["generate", "-q", "--model", str(tiny_model_dir), *args, "-o", str(out)])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


# ----------------------------------------------------------------------------- no drafter, end to end


def cli_tokens(model, tmp_path, name: str, *args: str) -> tuple[np.ndarray, dict]:
    """`lantern generate` greedy on a model directory -> (tokens, stats JSON)."""
    tokens, stats = tmp_path / f"{name}.npy", tmp_path / f"{name}.json"
    r = CliRunner().invoke(
        main,
        [
            "generate",
            "-q",
            "--model",
            str(model),
            "--greedy",
            "-o",
            str(tmp_path / f"{name}.png"),
            "--save-tokens",
            str(tokens),
            "--stats-json",
            str(stats),
            *args,
        ],
    )
    assert r.exit_code == 0, r.output
    return np.load(tokens), json.loads(stats.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["c2i", "t2i", "anole", "lumina"])
def test_a_model_without_a_drafter_generates_with_sjd(family, request, tmp_path):
    """On onnxruntime (the model exported on first use, with the window's verify graph) and on
    torch: greedy sjd gives AR's tokens; the stats name the method and its window. The models: the
    tiny c2i model, the t2i one with T5, a tiny Anole, and a Lumina-mGPT whose grid rows end in
    forced row-end tokens (the window's spatial drafts then read the row above through a row end
    of its own)."""
    fixture = {"c2i": "tiny_model_dir", "t2i": "prompt_model", "anole": "anole_dir", "lumina": "lumina_dir"}
    model = request.getfixturevalue(fixture[family])
    assert "drafter" not in json.loads((model / "config.json").read_text())["files"]
    what = ["--class", "1"] if family == "c2i" else ["--prompt", "a red cat"]
    what += ["--cache-windows", "1"]  # the quickest first-use export (windows: tests/test_cache_windows.py)
    ar, _ = cli_tokens(model, tmp_path, "ar", *what, "--backend", "torch")
    for backend in ("onnxruntime", "torch"):
        got, stats = cli_tokens(
            model, tmp_path, f"sjd-{backend}", *what, "--method", "sjd", "--window", "3", "--backend", backend
        )
        assert np.array_equal(got, ar), backend
        assert (
            stats["method"] == "sjd"
            and stats["params"] == {"window": 3, "coupling": DEFAULT_COUPLING}
            and stats["backend"] == backend
        )


# ----------------------------------------------------------------------------- bench and calibrate


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("sjd", MethodConfig("sjd", tree="chain-5")),
        ("sjd:window=8", MethodConfig("sjd", tree="chain-8")),
        ("sjd++:window=3,k=4,lambda=2", MethodConfig("sjd++", tree="chain-3", k=4, lam=2.0)),
        ("sjd:tree=pac-2-2-7,coupling=maximal", MethodConfig("sjd", tree="pac-2-2-7", coupling="maximal")),
        ("sjd:tree=chain-4,coupling=none", MethodConfig("sjd", tree="chain-4", coupling="none")),
    ],
)
def test_bench_configs_name_a_window(spec, want):
    assert method_config(spec, "naive_extend_57", image_tokens=16) == want
    named = {"window": int(want.tree[6:])} if want.tree.startswith("chain-") else {"tree": want.tree}
    window = {k: v for k, v in want.params().items() if k not in ("k", "lambda")}
    assert window == named | {"coupling": want.coupling or DEFAULT_COUPLING}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("sjd:tree=mc_sim_7b_63", "takes chain-N or pac-K-D-N"),
        ("sjd:tree=pac-2-2-16", "at most 15"),
        ("sjd:coupling=best", "unknown coupling 'best'"),
        ("exact:coupling=gumbel", "'coupling' is not a parameter of exact"),
        ("sjd:window=16", "at most 15"),
        ("sjd++:k=x", "an integer"),
    ],
)
def test_bad_bench_configs_are_refused(spec, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        method_config(spec, "chain-5", image_tokens=16)


@pytest.mark.slow
def test_calibrating_a_bundle_without_a_drafter_drives_its_window(no_drafter_bundle, tmp_path):
    """Its default method is sjd, whose calls reach the chain's verify graph; the int8 bundle then
    runs sjd."""
    out, report = tmp_path / "int8", tmp_path / "report.json"
    args = ["calibrate", str(no_drafter_bundle.path), "--samples", "2", "--validate", "2", "--out", str(out)]
    r = CliRunner().invoke(main, [*args, "--threads", "1", "--report-json", str(report), "-q"])
    assert r.exit_code == 0, r.output
    graphs = json.loads(report.read_text())["graphs"]
    assert graphs["target_verify_0"]["calls"] > 0 and graphs["target_verify_0"]["samples"] > 0
    int8 = Bundle.open(out)
    assert int8.manifest()["calibration"]["method"] == "sjd"
    assert run(int8, "onnxruntime", SJD, SAMPLED).stats.mean_accepted_length > 1.0


@pytest.mark.slow
def test_an_image_set_with_sjd_equals_generate(tiny_model_dir, tmp_path):
    """`generate-set --method sjd --window 3` on a model directory without a drafter (exported on
    first use with the window's verify graph): the shards hold `generate`'s tokens."""
    same = [
        "-q",
        "--model",
        str(tiny_model_dir),
        "--class",
        "2",
        "-n",
        "3",
        "--method",
        "sjd",
        "--window",
        "3",
    ]
    tokens = tmp_path / "tokens.npy"
    r = CliRunner().invoke(
        main, ["generate", *same, "-o", str(tmp_path / "g.png"), "--save-tokens", str(tokens)]
    )
    assert r.exit_code == 0, r.output
    out = tmp_path / "set"
    r = CliRunner().invoke(main, ["generate-set", *same, "--out", str(out)])
    assert r.exit_code == 0, r.output
    codes = np.concatenate([np.load(f)["codes"] for f in sorted(out.glob("shard-*.npz"))])
    assert np.array_equal(codes, np.load(tokens))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["method"] == "sjd" and summary["tau"] > 1.0
