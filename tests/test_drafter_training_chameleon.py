"""Drafter training for the Chameleon family (Anole layout): the training pairs are the runtime's,
training lowers the loss and writes a drafter that ``lantern generate`` runs, and bad --codes
files are one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.families.chameleon.family import details
from lantern_rt.families.chameleon.training_rows import PromptConditions, prompt_conditions
from lantern_rt.families.loading import load_drafter, load_target, open_model_dir
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.runtime.acceptance import tree_step_inputs
from lantern_rt.runtime.backends.base import CatchUp
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget, drafter_step
from lantern_rt.runtime.drafting import Context, catch_up_inputs, drafter_capacity, left_aligned
from lantern_rt.runtime.sampling import SamplingConfig, cfg_rows
from lantern_rt.settings import MethodConfig
from lantern_rt.training.drafter import (
    DrafterTraining,
    batch_predictions,
    drafter_batch,
    eagle_loss,
    train_drafter,
)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from lantern_rt.families.chameleon.prompts import load_chameleon_tokenizer, prompt_layout  # noqa: E402
from lantern_rt.runtime.run_shape import RunShape
from tests.chameleon_fixtures import WORDS  # noqa: E402

PROMPTS = ["a red cat", "blue dog runs fast under green sky"]  # 4 and 0 padding slots of 10


@pytest.fixture(scope="module")
def model_dir(anole_dir):
    return anole_dir


@pytest.fixture(scope="module")
def md(model_dir):
    return open_model_dir(model_dir)


def conditions(md, prompts) -> PromptConditions:
    tokenizer = load_chameleon_tokenizer(details(md).folder.root)
    return prompt_conditions(
        tokenizer, prompts, md.gpt.cls_token_num, prompt_layout(details(md).layout, md.image_size)
    )


def runtime_hidden(target, conds: PromptConditions, codes):
    """The runtime target's hidden states [2B, P + N, D] over B images' CFG rows (conditional
    rows, then unconditional): TorchTarget's prefill, then the image tokens as one verified chain
    over its cache (tree_step_inputs); and the prefill's (rows, visible slots)."""
    n = codes.shape[1]
    tt = TorchTarget(target, RunShape(len(codes), cache_windows=1))
    rows = torch.cat([conds.ids[:, 0], conds.ids[:, 1]])
    prefix = torch.cat([conds.mask[:, 0], conds.mask[:, 1]])
    _, prefix_hidden = tt.prefill(rows, prefix)  # [2B, P, D]
    cache = tt.cache
    chain = torch.ones(n, n, dtype=torch.bool).tril()
    at, mask = tree_step_inputs(
        torch.arange(n), chain, cache.length, cache.capacity, cache.rows, cache.prefix
    )
    _, image_hidden, _, _ = target.step(
        target.tok_embeddings(cfg_rows(codes, cache.rows)), at, mask, cache.k, cache.v
    )
    return torch.cat([prefix_hidden, image_hidden], dim=1), rows, prefix


def runtime_drafter(drafter, head, hidden, rows, prefix, p: int, n: int):
    """A TorchDrafter over B images after its prefill (the prefix pairs, drafting.prefix_pairs)."""
    b = len(rows) // 2
    td = TorchDrafter(drafter, head, drafter_capacity(p, n), RunShape(b), prefix=p - 1)
    td.prefill(hidden[:, : p - 1], torch.ones(b, dtype=torch.bool), rows, prefix)
    assert td.cache.length.tolist() == [p - 1] * b
    return td


def catch_up(td, drafter, codes, hidden, p: int, lo: int, hi: int):
    """Catch up on (and commit) image pairs lo..hi-1, (x_i, the target state before it), as a
    decode step does; -> the drafter's predictions at them [2B, hi - lo, D]."""
    b = len(codes)
    m = torch.full((b,), hi - lo)
    pending = CatchUp(
        codes[:, lo:hi],
        hidden[:, p - 1 + lo : p - 1 + hi],
        m,
        torch.full((b,), p + hi - 1),  # the root's target position
        td.cache.length,
        td.cache.prefix,
    )
    context = Context.of_cache(td.cache.layers_k, td.cache.layers_v)
    out, k, v = drafter_step(drafter)(*catch_up_inputs(pending, td.cache.capacity), context)
    td.cache.write(left_aligned(k, m), left_aligned(v, m), m)
    return out


def test_training_pairs_are_the_runtime_pairs(md):
    """The training forward (teacher-forced target, then the drafter over prefix pairs + image
    pairs in one pass) predicts at every image position what the runtime's drafter does:
    TorchTarget's prefill and a verify-shaped step over the image tokens, TorchDrafter's prefill
    (the prefix pairs: next prompt tokens, padding hidden) and the image pairs caught up in two
    calls, committed in between. Unrolled level 2 is a depth-1 node drafted below each root."""
    target = load_target(md)
    cfg = md.gpt
    p, n, b = cfg.cls_token_num, cfg.block_size, len(PROMPTS)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(cfg), cfg).eval()  # its own random embeddings
    conds = conditions(md, PROMPTS)
    assert not conds.mask.all() and not torch.equal(conds.mask[0], conds.mask[1])  # padding, per row
    codes = torch.randint(cfg.vocab_size, (b, n), generator=torch.Generator().manual_seed(1))

    # training: every image's conditional row, then its unconditional row (the runtime's 2B rows)
    uncond = torch.arange(2 * b) >= b
    batch = drafter_batch(target, codes.repeat(2, 1), conds[torch.arange(b).repeat(2)], uncond)
    tokens, h_in, positions, h_target, visible = batch
    assert tokens.shape == visible.shape == (2 * b, p - 1 + n) and h_target.shape[1] == n
    with torch.no_grad():
        level1, level2 = (pred[:, p - 1 :] for pred in batch_predictions(drafter, batch, 2))

    with torch.inference_mode():
        hidden, rows, prefix = runtime_hidden(target, conds, codes)
        td = runtime_drafter(drafter, target.output, hidden, rows, prefix, p, n)
        runtime = torch.cat(
            [catch_up(td, drafter, codes, hidden, p, lo, hi) for lo, hi in ((0, 5), (5, n))], 1
        )
        below = {}
        for root in (0, 6, n - 2):  # the child x_{root+1} paired with the root's prediction
            td = runtime_drafter(drafter, target.output, hidden, rows, prefix, p, n)
            out = catch_up(td, drafter, codes, hidden, p, 0, root + 1)
            context = Context.of_cache(td.cache.layers_k, td.cache.layers_v)
            at = torch.full((2 * b, 1), p + root + 1)
            node = codes[:, root + 1 : root + 2]
            mask = td.cache.mask(torch.ones(1, 1, dtype=torch.bool))
            below[root + 1] = drafter_step(drafter)(node, out[:, -1:], at, mask, context)[0][:, 0]

    torch.testing.assert_close(h_in, hidden[:, :-1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h_target, hidden[:, p:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(level1, runtime, rtol=1e-4, atol=1e-5)
    for i, want in below.items():
        torch.testing.assert_close(level2[:, i], want, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the loss scores the image rows alone, the runtime's predictions
        _, vloss, _ = eagle_loss(drafter, target.output, batch, 0.0, 0.1)
    torch.testing.assert_close(vloss, F.smooth_l1_loss(runtime, h_target), rtol=1e-4, atol=1e-6)


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def samples(model_dir, tmp_path_factory):
    """The target's own samples: 'lantern generate --save-tokens' over 40 prompts (some cut to the
    prompt slots), 2 images each; train.npz holds the first 64 images."""
    folder = tmp_path_factory.mktemp("samples")
    rng = np.random.default_rng(0)
    prompts = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(40)]
    (folder / "prompts.txt").write_text("\n".join(prompts) + "\n")
    path = folder / "all.npz"
    r = _cli(
        "generate", "-q", "--backend", "torch", "--model", str(model_dir), "--prompts", str(folder / "prompts.txt"),
        "-n", "2", "--cfg-scale", "3", "-o", str(folder / "all.png"), "--save-tokens", str(path),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    with np.load(path, allow_pickle=False) as data:
        codes, saved = data["codes"], data["prompts"]
    assert saved.dtype.kind == "U" and saved.tolist() == [q for q in prompts for _ in range(2)]
    assert codes.shape == (80, 16) and codes.dtype.kind == "i"
    np.savez(folder / "train.npz", codes=codes[:64], prompts=saved[:64])
    return folder, codes, saved


def test_training_lowers_the_loss_and_generate_runs_the_drafter(md, model_dir, samples, tmp_path):
    """train-drafter on generate's own --save-tokens file: the held-out CFG-mixed loss falls, the
    folder loads with load_drafter, and greedy exact decoding with it gives AR's tokens."""
    from lantern_rt.assembly import torch_pipeline
    from lantern_rt.generate import generate

    folder, codes, prompts = samples
    target = load_target(md)
    cfg = md.gpt
    held = torch.arange(64, 80)
    batch = drafter_batch(
        target,
        torch.from_numpy(codes[held.repeat(2)]).long(),
        conditions(md, prompts[held.repeat(2)].tolist()),
        torch.arange(32) >= 16,
    )

    def held_out_loss(drafter) -> float:
        with torch.no_grad():
            return eagle_loss(drafter.eval(), target.output, batch, 0.0, 0.1, cfg_scale=3.0)[0].item()

    torch.manual_seed(0)
    fresh = Drafter(DrafterConfig.for_target(cfg), cfg)
    fresh.embed_tokens.weight.data.copy_(target.tok_embeddings.weight.data)  # as training starts
    fresh.prompt_table.copy_(target.cls_embedding.weight.data)
    out = tmp_path / "drafter"
    r = _cli(
        "train-drafter", "--model", str(model_dir), "--codes", str(folder / "train.npz"), "--out", str(out),
        "--steps", "80", "--batch", "8", "--lr", "3e-3", "--cfg-scale", "3",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert {f.name for f in out.iterdir()} >= {"drafter.safetensors", "config.json", "train_state.pt"}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == cfg.vocab_size
    trained = load_drafter(md, out)
    from safetensors.torch import load_file

    assert not any("prompt" in k for k in load_file(str(out / "drafter.safetensors")))  # not saved
    assert torch.equal(trained.prompt_table, target.cls_embedding.weight)  # the target's, at load
    before, after = held_out_loss(fresh), held_out_loss(trained)
    assert after < 0.6 * before, (before, after)  # measured 0.49-0.52 of it over four seeds

    greedy = SamplingConfig(3.0, temperature=0)
    ar = generate(torch_pipeline(md, MethodConfig()), PROMPTS, greedy, progress=False)
    pipe = torch_pipeline(md, MethodConfig(method="exact", drafter=str(out)))
    exact = generate(pipe, PROMPTS, greedy, progress=False)
    assert exact.tokens.tolist() == ar.tokens.tolist()
    # sampled, its drafts are taken: mean accepted length 1.26-1.52 over four training seeds,
    # 1.06-1.10 with the untrained drafters
    assert generate(pipe, PROMPTS * 4, SamplingConfig(3.0), progress=False).stats.mean_accepted_length > 1.2


def test_single_rows_use_the_prompts_unconditional_row(md):
    """Without --cfg-scale an unconditional row is the prompt's row 1 (Anole: <s> <racm3:break>),
    the same for every prompt: two prompts' unconditional rows give the same target states; such
    single rows train (unrolled too)."""
    target = load_target(md)
    conds = conditions(md, PROMPTS)
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(md.gpt.vocab_size, (1, md.gpt.block_size), generator=g).repeat(2, 1)
    cond = drafter_batch(target, codes, conds, torch.tensor([False, False]))[3]
    null = drafter_batch(target, codes, conds, torch.tensor([True, True]))[3]
    torch.testing.assert_close(null[0], null[1])
    assert not torch.allclose(cond[0], cond[1], atol=1e-3)
    losses = train_drafter(
        target,
        Drafter(DrafterConfig.for_target(md.gpt), md.gpt),
        codes.numpy(),
        conds,
        DrafterTraining(steps=2, batch=2, uncond_fraction=0.5, unroll=2),
        progress=False,
    )
    assert len(losses) == 2 and all(np.isfinite(losses))


def _bad_files(codes, prompts):
    """(name, arrays, words of the error) for each malformed --codes file."""
    return [
        ("no_prompts", {"codes": codes, "labels": np.zeros(len(codes), dtype=np.int64)}, "'prompts'"),
        ("short", {"codes": codes[:, :9], "prompts": prompts}, "9 tokens; this model's are 16"),
        ("count", {"codes": codes, "prompts": prompts[:-1]}, "hold 16 and 15 images"),
        ("range", {"codes": codes + 64, "prompts": prompts}, "outside 0..31"),
        ("bytes", {"codes": codes, "prompts": prompts.astype(bytes)}, "'prompts' must be strings [N]"),
        ("objects", {"codes": codes, "prompts": prompts.astype(object)}, "Python objects"),
    ]


def test_bad_codes_files_are_one_line_errors(model_dir, samples, tmp_path):
    folder, codes, prompts = samples
    codes, prompts = codes[:16], prompts[:16]
    for name, arrays, words in _bad_files(codes, prompts):
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        out = tmp_path / f"out_{name}"
        r = _cli(
            "train-drafter",
            "--model",
            str(model_dir),
            "--codes",
            str(path),
            "--out",
            str(out),
            "--steps",
            "1",
        )
        assert r.exit_code == 2, (name, r.output)
        assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (name, r.stderr)
        assert words in r.stderr and "Traceback" not in r.output, (name, r.stderr)
        assert not out.exists(), name
    r = _cli("train-drafter", "--model", str(model_dir), "--out", str(tmp_path / "none"), "--steps", "1")
    assert r.exit_code == 2 and "'codes' and 'prompts'" in r.stderr and not (tmp_path / "none").exists()


def test_lumina_training_scores_the_distributions_the_runtime_drafts_from(lumina_dir):
    """With Lumina-mGPT's row ends, the classification loss compares the head's distributions
    under the layout rule, as drafts are drawn from them: certain at every row end (zero loss
    there), the row end impossible elsewhere; the raw head would score other distributions."""
    from lantern_rt.models.target import layout_logits

    md = open_model_dir(lumina_dir)
    target = load_target(md)
    g, n, start = md.gpt.grid_size, md.gpt.block_size, md.gpt.cls_token_num
    codes = torch.randint(md.gpt.vocab_size - 1, (2, n), generator=torch.Generator().manual_seed(3))
    codes[:, g :: g + 1] = md.gpt.vocab_size - 1  # every row ends with its row end
    batch = drafter_batch(target, codes, conditions(md, PROMPTS), torch.tensor([False, False]))
    drafter, head = Drafter(DrafterConfig.for_target(md.gpt), md.gpt), target.output
    with torch.no_grad():
        _, _, ploss = eagle_loss(drafter, head, batch, 0.0, 0.1, layout=md.gpt)
        _, _, raw = eagle_loss(drafter, head, batch, 0.0, 0.1)
        pred = batch_predictions(drafter, batch, 1, batch[1])[0][:, -n:]
    positions = torch.arange(start, start + n)
    p = torch.softmax(layout_logits(head(batch[3]).float(), positions, md.gpt), -1)
    log_q = torch.log_softmax(layout_logits(head(pred).float(), positions, md.gpt), -1)
    per_row = -(p * log_q).sum(-1)
    forced = (positions + 1 - start) % (g + 1) == g
    torch.testing.assert_close(ploss, per_row.mean())
    assert torch.all(per_row[:, forced] < 1e-6) and torch.all(p[:, ~forced, -1] < 1e-6)
    assert abs(float(raw - ploss)) > 1e-3
