"""Speculative decoding end to end on tiny models: greedy equality with AR, cache compaction."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.runtime.acceptance import Relaxation
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Speculation, decode_image
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from tests.conftest import verify_step

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)
TREES = ["naive_extend_57", "mc_sim_7b_63", "chain-3"]


def spec_for(target, drafter, tree: str, relax: Relaxation) -> Speculation:
    t = load_tree(tree)
    capacity = target.config.block_size + t.num_nodes + 1
    return Speculation(TorchDrafter(drafter, target.output, capacity), t, relax, None)


def decode(target, label: int, spec=None, sampling=GREEDY, seed=0):
    backend = TorchTarget(target)
    cond = torch.tensor([label, target.config.num_classes])
    g = torch.Generator().manual_seed(seed)
    return backend, decode_image(backend, cond, target.config.block_size, sampling, g, spec)


EXACT_EQUIVALENTS = [
    Relaxation("exact"),
    Relaxation("lantern++", k=5, lam=1.0),
    Relaxation("lantern", k=5, delta=0.0),
]


@pytest.mark.parametrize("tree", TREES)
def test_greedy_speculative_equals_greedy_ar(trained_pair, tree):
    target, drafter = trained_pair
    neighbors = torch.stack([torch.roll(torch.arange(64), -i) for i in range(1, 6)], dim=1)
    accepted = []
    for label in (0, 3):
        _, ar = decode(target, label)
        for relax in EXACT_EQUIVALENTS:
            spec = spec_for(target, drafter, tree, relax)
            spec = Speculation(spec.drafter, spec.tree, relax, neighbors)
            _, out = decode(target, label, spec)
            assert torch.equal(out.tokens, ar.tokens), (tree, relax, label)
            assert sum(out.accepted) == target.config.block_size - 1
            accepted.extend(out.accepted)
    # the drafter is good enough that multi-token steps are exercised
    assert sum(accepted) / len(accepted) > 1.3 and max(accepted) >= 3, accepted


def test_compacted_cache_equals_ar_cache(trained_pair):
    target, drafter = trained_pair
    backend, out = decode(target, 2, spec_for(target, drafter, "naive_extend_57", Relaxation("exact")))
    assert max(out.accepted) > 2
    reference = TorchTarget(target)
    reference.prefill(torch.tensor([2, target.config.num_classes]))
    for tok in out.tokens[:-1]:  # every token but the last has its K/V cached
        verify_step(reference, tok.view(1), target.config.vocab_size)
    n = target.config.cls_token_num + len(out.tokens) - 1
    assert int(reference.cache.length) == n <= int(backend.cache.length)  # the last step may overshoot
    torch.testing.assert_close(
        backend.cache.k[:, :, :, :n], reference.cache.k[:, :, :, :n], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        backend.cache.v[:, :, :, :n], reference.cache.v[:, :, :, :n], atol=1e-5, rtol=1e-5
    )


def test_drafter_cache_equals_teacher_forced_drafter(trained_pair):
    """The drafter's committed cache holds exactly the pairs (x_j, f_{j-1}) of the image."""
    target, drafter = trained_pair
    spec = spec_for(target, drafter, "mc_sim_7b_63", Relaxation("exact"))
    _, out = decode(target, 1, spec)
    cache = spec.drafter.cache
    n = int(cache.length)
    cond = torch.tensor([1, target.config.num_classes])
    with torch.no_grad():
        hidden = target.hidden_states(out.tokens[None].expand(2, -1), cond)
        cls = target.config.cls_token_num
        tokens = out.tokens[:n][None].expand(2, -1)
        positions = torch.arange(cls, cls + n)
        empty = torch.zeros(1, 2, drafter.config.kv_heads, 0, drafter.config.head_dim)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        _, k, v = drafter.step(tokens, hidden[:, cls - 1 : cls - 1 + n], positions, causal, empty, empty)
    torch.testing.assert_close(cache.k[:, :, :, :n], k, atol=1e-4, rtol=1e-4)


def test_relaxed_decoding_accepts_more(trained_pair):
    target, drafter = trained_pair
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)
    neighbors = torch.stack([torch.roll(torch.arange(64), -i) for i in range(1, 11)], dim=1)
    mean = {}
    for name, relax in {
        "exact": Relaxation("exact"),
        "lantern++": Relaxation("lantern++", k=10, lam=20.0),
    }.items():
        spec = Speculation(
            spec_for(target, drafter, "naive_extend_57", relax).drafter,
            load_tree("naive_extend_57"),
            relax,
            neighbors,
        )
        acc = []
        for seed in range(32):  # 16-token images: 8 seeds gave equal means (1.71) by chance
            acc += decode(target, seed % target.config.num_classes, spec, sampling, seed)[1].accepted
        mean[name] = sum(acc) / len(acc)
    assert mean["lantern++"] > mean["exact"], mean
