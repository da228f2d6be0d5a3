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
from lantern_rt.export.exporter import export_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.config import ConfigError
from lantern_rt.pipeline import build_pipeline
from lantern_rt.runtime import jacobi
from lantern_rt.runtime.acceptance import Relaxation, tree_plan, verify_tree
from lantern_rt.runtime.decode import Condition, Speculation, decode_images
from lantern_rt.runtime.jacobi import JacobiDrafter
from lantern_rt.runtime.kv_cache import KVCache
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from lantern_rt.settings import MethodConfig
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir
from tests.test_baseline import chi_square, chi_square_critical
from tests.test_speculative import GREEDY

CPU = torch.device("cpu")

# ----------------------------------------------------------------------------- lossless sampling

# A Markov target over V = 3 tokens: the first token from MARKOV_START, each next one from the
# row of the one before. Every entry is positive (log-probabilities stay finite under CFG).
MARKOV_START = torch.tensor([0.5, 0.3, 0.2])
MARKOV_P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.35, 0.05, 0.6]])
LENGTH, WINDOW, ROW = 5, 2, 2  # a window of 2 and image rows of 2: carried, spatial and root drafts
SAMPLES, BUG_SAMPLES, BATCH = 12_000, 6_000, 500


class MarkovTarget:
    """A ``TargetBackend`` whose logits at a node are log MARKOV_P[its token] (both CFG rows),
    accepted by the real :func:`verify_tree`; its one-layer cache holds zeros."""

    name = "markov"
    cls_token_num = 1

    def __init__(self, batch: int, length: int = LENGTH):
        self.cache = KVCache(1, batch, 1, length + WINDOW + 2, 1, torch.float32, CPU, prefix=1)

    def prefill(self, cond, prefix=None, fresh=None):
        rows = cond.shape[0]
        zeros = torch.zeros(1, rows, 1, 1, 1)
        self.cache.restart(zeros, zeros, fresh, self.cache.visible(prefix))
        return MARKOV_START.log().expand(rows, -1), torch.zeros(rows, 1, 1)

    def verify(self, tree, draft, noise, bonus_noise, sampling, relax):
        tokens = draft.tokens
        logits = MARKOV_P.log()[torch.cat([tokens, tokens])]  # [2B, N+1, V]
        rows, nodes = logits.shape[:2]
        zeros = torch.zeros(1, rows, 1, nodes, 1)
        hidden = torch.zeros(rows, nodes, 1)
        plan = tree_plan(tree, CPU)
        return verify_tree(
            plan,
            logits,
            hidden,
            zeros,
            zeros,
            tokens,
            draft.valid,
            draft.q,
            noise,
            bonus_noise,
            sampling,
            relax,
        )


def markov_sequences(samples: int, seed: int) -> torch.Tensor:
    """``samples`` sequences of LENGTH tokens from the decode loop with the Jacobi window, BATCH
    images at a time, each from its own generator; LongTensor [samples, LENGTH]."""
    target = MarkovTarget(BATCH)
    tree = load_tree(f"chain-{WINDOW}")
    window = JacobiDrafter(tree, BATCH, 3, target.cache.capacity, 1, ROW, CPU)
    spec = Speculation(window, tree, Relaxation("exact"))
    jobs = [
        (Condition(torch.tensor([0, 0])), torch.Generator().manual_seed(seed * samples + i))
        for i in range(samples)
    ]
    sampling = SamplingConfig(cfg_scale=1.0, temperature=1.0)
    out = torch.zeros(samples, LENGTH, dtype=torch.long)
    for index, result in decode_images(target, jobs, LENGTH, sampling, spec):
        out[index] = result.tokens
    return out


def markov_chi_square(seqs: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """(statistic, critical value at p = 0.9999, the law) of the sequences' counts."""
    vocab = MARKOV_P.shape[0]
    cells = (seqs * vocab ** torch.arange(LENGTH - 1, -1, -1)).sum(1)
    counts = torch.bincount(cells, minlength=vocab**LENGTH)
    law = MARKOV_START.double()
    for _ in range(LENGTH - 1):
        law = law[..., None] * MARKOV_P.double()  # [V] * k: law[..., i, j] = law[..., i] P[i, j]
    law = law.reshape(-1)
    stat, df = chi_square(counts, law, len(seqs))
    return stat, chi_square_critical(df), law


def test_sjd_draws_from_the_markov_chain_distribution():
    seqs = markov_sequences(SAMPLES, seed=0)
    stat, critical, _ = markov_chi_square(seqs)
    print(f"chi-square, sjd: {stat:.1f} (critical {critical:.1f})")
    assert stat < critical


def test_the_window_accepts_drafts():
    """The check above exercised acceptance: fewer verify calls than tokens (tau > 1)."""
    target = MarkovTarget(4, length=20)
    tree = load_tree(f"chain-{WINDOW}")
    spec = Speculation(
        JacobiDrafter(tree, 4, 3, target.cache.capacity, 1, ROW, CPU), tree, Relaxation("exact")
    )
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


def _plant_argmax_drafts(monkeypatch):
    """Draft the most likely token of each carried row but keep the row as its q."""
    carried = jacobi.carried_drafts

    def buggy(probs, ready, accepted, noise, greedy):
        mask, _, q = carried(probs, ready, accepted, noise, greedy)
        return mask, q.argmax(-1), q

    monkeypatch.setattr(jacobi, "carried_drafts", buggy)


def _plant_shifted_rows(monkeypatch):
    """Draw each carried draft from its row but test it against the next node's row."""
    carried = jacobi.carried_drafts

    def buggy(probs, ready, accepted, noise, greedy):
        mask, tokens, _ = carried(probs, ready, accepted, noise, greedy)
        return mask, tokens, carried(probs, ready, accepted + 1, noise, greedy)[2]

    monkeypatch.setattr(jacobi, "carried_drafts", buggy)


@pytest.mark.parametrize("plant", [_plant_argmax_drafts, _plant_shifted_rows])
def test_the_check_catches_a_planted_bug(plant, monkeypatch):
    plant(monkeypatch)
    stat, critical, _ = markov_chi_square(markov_sequences(BUG_SAMPLES, seed=1))
    print(f"chi-square, {plant.__name__}: {stat:.1f} (critical {critical:.1f})")
    assert stat > critical


# ----------------------------------------------------------------------------- greedy and batches

SJD = MethodConfig("sjd", tree="chain-3")
SJD_PP = MethodConfig("sjd++", tree="chain-3", k=4, lam=5.0)
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0)
LABELS = [0, 3, 1, 4, 2]


@pytest.fixture(scope="module")
def no_drafter_bundle(tmp_path_factory) -> Bundle:
    """A random tiny target (no drafter) whose greedy and sampled images Jacobi drafts well enough
    (tau 1.3-1.5: a pattern-trained target, each token fixed by the one before, gives 1.0),
    exported with a chain-3 verify graph at B 1 and 2."""
    target = tiny_gpt(1)
    path = tmp_path_factory.mktemp("jacobi") / "bundle"
    model = write_model_dir(path.with_name("bundle-model"), target, tiny_vq())
    return Bundle.open(
        export_bundle(open_model_dir(model), path, [load_tree("chain-3")], threads=1, batch_sizes=(1, 2))
    )


def run(source, backend: str, method: MethodConfig, sampling: SamplingConfig, batch: int = 1):
    pipe = build_pipeline(source, method, RunShape(batch), backend=backend, threads=1)
    return generate(pipe, LABELS, sampling, seed=5, progress=False)


@pytest.mark.slow
def test_greedy_sjd_gives_ar_tokens_on_every_backend_and_batch(no_drafter_bundle):
    md = open_model_dir(no_drafter_bundle.path.with_name("bundle-model"))
    assert "drafter" not in md.files and not no_drafter_bundle.has_drafter
    ar = run(md, "torch", MethodConfig("ar"), GREEDY)
    for source, backend in ((md, "torch"), (no_drafter_bundle, "onnxruntime")):
        for batch in (1, 2):
            got = run(source, backend, SJD, GREEDY, batch)
            assert torch.equal(got.tokens, ar.tokens), (backend, batch)
            assert got.stats.mean_accepted_length > 1.25  # drafts were accepted
    relaxed = run(md, "torch", SJD_PP, GREEDY)
    assert not torch.equal(relaxed.tokens, ar.tokens)  # sanity: the credit changes greedy tokens


@pytest.mark.slow
@pytest.mark.parametrize("method", [SJD, SJD_PP])
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
    shown = CliRunner().invoke(main, ["inspect", str(no_drafter_bundle.path)])
    assert "tree     chain-3: 3 nodes, verified by target_verify_0 (a Jacobi window" in shown.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--method", "sjd", "--tree", "chain-3"], "give --window N instead of --tree"),
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
def test_a_model_without_a_drafter_generates_with_sjd(
    family,
    request,
    tmp_path,
    monkeypatch,
):
    """On onnxruntime (the model exported on first use, with the window's verify graph) and on
    torch: greedy sjd gives AR's tokens; the stats name the method and its window. The models: the
    tiny c2i model, the t2i one with T5, a tiny Anole, and a Lumina-mGPT whose grid rows end in
    forced row-end tokens (the window's spatial drafts then read the row above through a row end
    of its own)."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    fixture = {"c2i": "tiny_model_dir", "t2i": "prompt_model", "anole": "anole_dir", "lumina": "lumina_dir"}
    model = request.getfixturevalue(fixture[family])
    assert "drafter" not in json.loads((model / "config.json").read_text())["files"]
    what = ["--class", "1"] if family == "c2i" else ["--prompt", "a red cat"]
    ar, _ = cli_tokens(model, tmp_path, "ar", *what, "--backend", "torch")
    for backend in ("onnxruntime", "torch"):
        got, stats = cli_tokens(
            model, tmp_path, f"sjd-{backend}", *what, "--method", "sjd", "--window", "3", "--backend", backend
        )
        assert np.array_equal(got, ar), backend
        assert stats["method"] == "sjd" and stats["params"] == {"window": 3} and stats["backend"] == backend


# ----------------------------------------------------------------------------- bench and calibrate


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("sjd", MethodConfig("sjd", tree="chain-5")),
        ("sjd:window=8", MethodConfig("sjd", tree="chain-8")),
        ("sjd++:window=3,k=4,lambda=2", MethodConfig("sjd++", tree="chain-3", k=4, lam=2.0)),
    ],
)
def test_bench_configs_name_a_window(spec, want):
    assert method_config(spec, "naive_extend_57", image_tokens=16) == want
    assert want.params()["window"] == int(want.tree.removeprefix("chain-"))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("sjd:tree=chain-3", "'tree' is not a parameter of sjd"),
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
def test_an_image_set_with_sjd_equals_generate(tiny_model_dir, tmp_path, monkeypatch):
    """`generate-set --method sjd --window 3` on a model directory without a drafter (exported on
    first use with the window's verify graph): the shards hold `generate`'s tokens."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
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
