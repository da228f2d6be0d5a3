"""Per-image sampling (issue 60 item 8): every image of a batch samples with its own settings
(sampling.SamplingRows), as it would decoded alone; rows with different settings each draw from
their own filtered distribution; acceptance with a greedy flag per row."""

from __future__ import annotations

import torch
from test_baseline import chi_square, chi_square_critical, reference_probs

from lantern_rt.runtime.acceptance import (
    Relaxation,
    accept_tree,
    draw,
    relax_inputs,
    target_probabilities,
    tree_plan,
)
from lantern_rt.runtime.backends.torch_backend import TorchTarget
from lantern_rt.runtime.decode import Job, decode_images
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig, SamplingRows, cfg_mix
from lantern_rt.runtime.tree import load_tree
from tests.test_batching import torch_spec

CPU = torch.device("cpu")
# four settings a batch mixes: guidance off and on at three scales, each filter, greedy
MIXED = [
    SamplingConfig(cfg_scale=1.0, temperature=1.0),
    SamplingConfig(cfg_scale=3.0, temperature=0.7, top_k=20),
    SamplingConfig(cfg_scale=2.0, temperature=1.3, top_p=0.8),
    SamplingConfig(cfg_scale=1.5, temperature=0.0),
]


def rows_of(configs: list[SamplingConfig]) -> SamplingRows:
    rows = SamplingRows(len(configs), CPU)
    rows.write(list(range(len(configs))), configs)
    return rows


def test_rows_with_different_settings_each_draw_from_their_own_distribution() -> None:
    """One batch of 4 x 3000 rows cycling through MIXED, drawn as the prefill and every AR
    step draw (target_probabilities, then draw): each setting's draws fit its own CFG-mixed,
    filtered softmax (chi-square) and not its neighbour's; filtered tokens never come; the
    greedy rows take the argmax."""
    g = torch.Generator().manual_seed(0)
    vocab, draws, kinds = 48, 3000, len(MIXED)
    cond, uncond = 0.5 * torch.randn(kinds, vocab, generator=g), 0.5 * torch.randn(kinds, vocab, generator=g)
    rows = rows_of(MIXED * draws)  # image i samples as MIXED[i % 4]
    logits = torch.cat([cond.repeat(draws, 1), uncond.repeat(draws, 1)])
    probs = target_probabilities(logits, rows.filters, kinds * draws)
    tokens = draw(probs, torch.rand(kinds * draws, vocab, generator=g), rows.greedy)
    laws = []
    for kind, cfg in enumerate(MIXED):
        mixed = cfg_mix(torch.stack([cond[kind], uncond[kind]]), cfg.cfg_scale, 1)[0]
        if cfg.greedy:
            assert (tokens[kind::kinds] == mixed.argmax()).all()
            laws.append(None)
            continue
        laws.append(reference_probs(mixed, cfg.temperature, cfg.top_k, cfg.top_p))
    for kind, law in enumerate(laws):
        if law is None:
            continue
        counts = torch.bincount(tokens[kind::kinds], minlength=vocab)
        assert int(counts[law == 0].sum()) == 0  # filtered tokens are never drawn
        stat, df = chi_square(counts, law, draws)
        assert df >= 5 and stat < chi_square_critical(df), (kind, stat, df)
        other = laws[(kind + 1) % 3]  # the test has power: another setting's law is rejected
        wrong, wrong_df = chi_square(counts, other, draws)
        assert wrong > chi_square_critical(wrong_df), kind


def test_acceptance_with_a_greedy_flag_per_row_is_each_rows_alone() -> None:
    """accept_tree over images greedy and sampled in one batch: each image's outcome is the one
    of a call where every image is as it is."""
    g = torch.Generator().manual_seed(3)
    tree, vocab, batch = load_tree("chain-3"), 12, 6
    n = tree.num_nodes + 1
    plan = tree_plan(tree, CPU)
    tokens = torch.randint(vocab, (batch, n), generator=g)
    valid = torch.ones(batch, n, dtype=torch.bool)
    p = torch.softmax(torch.randn(batch, n, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g), -1)
    noise, bonus = torch.rand(batch, n, generator=g), torch.rand(batch, vocab, generator=g)
    greedy = torch.tensor([True, False, False, True, False, True])
    relax = relax_inputs(Relaxation("exact"), None, vocab, False, CPU)
    mixed = accept_tree(plan, tokens, valid, p, q, relax._replace(greedy=greedy), noise, bonus)
    for flag in (True, False):
        alone = accept_tree(
            plan, tokens, valid, p, q, relax_inputs(Relaxation("exact"), None, vocab, flag, CPU), noise, bonus
        )
        rows = greedy == flag
        for field in ("length", "kept", "tokens"):
            assert torch.equal(getattr(mixed, field)[rows], getattr(alone, field)[rows]), (flag, field)
    assert not torch.equal(mixed.tokens, alone.tokens)  # the flags matter here


def test_each_image_decodes_as_alone_among_other_settings(trained_pair) -> None:
    """Eight jobs, each with its own settings (MIXED and four more temperatures), on four slots
    (refills included) with LANTERN++ and AR: each image's tokens and accepted lengths are those
    of its job decoded alone at batch size 1."""
    target, drafter = trained_pair
    null = target.config.num_classes
    configs = MIXED + [
        SamplingConfig(cfg_scale=2.5, temperature=t, top_k=k)
        for t, k in ((0.5, 0), (0.9, 8), (1.1, 0), (1.6, 30))
    ]

    def job(i: int) -> Job:
        return Job(torch.tensor([i % null, null]), torch.Generator().manual_seed(40 + i), configs[i])

    for method in ("ar", "lantern++"):
        runs = []
        for batch, jobs in ((4, [job(i) for i in range(8)]), *((1, [job(i)]) for i in range(8))):
            spec = torch_spec(target, drafter, batch) if method != "ar" else None
            shape = RunShape(batch, cache_windows=1)
            default = SamplingConfig(cfg_scale=9.0)  # every job names its own
            out = decode_images(TorchTarget(target, shape), jobs, target.config.block_size, default, spec)
            runs.append([r for _, r in sorted(out, key=lambda x: x[0])])
        together, alone = runs[0], [run[0] for run in runs[1:]]
        for i, (a, b) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(a.tokens, b.tokens) and a.accepted == b.accepted, (method, i)
