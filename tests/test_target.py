"""The target: LlamaGen numerics, KV-cache decoding, checkpoint layout."""

from __future__ import annotations

import collections

import pytest
import torch

from lantern_rt.eval.kernel_count import eager_kernels
from lantern_rt.families.loading import load_target, open_model_dir
from lantern_rt.models.checkpoint import CheckpointError, load_strict
from lantern_rt.models.config import GPTConfig, gpt_config
from lantern_rt.models.target import Transformer, apply_rope, rope_rows
from lantern_rt.runtime.acceptance import Relaxation, relax_inputs, tree_step_inputs
from lantern_rt.runtime.backends.base import Draft
from lantern_rt.runtime.backends.torch_backend import TorchTarget
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig, cfg_rows, filter_inputs
from lantern_rt.runtime.tree import ROOT_ONLY, build_tree
from tests.conftest import TINY_GPT, tiny_gpt, tiny_vq, verify_step, write_model_dir
from tests.llamagen_reference import apply_rotary_emb, reference_logits

VARIANTS = {
    "c2i": {},
    "c2i-gqa": {"n_head": 4, "n_kv_head": 2},
    "t2i": {"model_type": "t2i", "cls_token_num": 3, "caption_dim": 12},
}


def condition(model: Transformer, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if cfg.model_type == "c2i":
        return torch.randint(0, cfg.num_classes + 1, (batch,), generator=g)
    return torch.randn(batch, cfg.cls_token_num, cfg.caption_dim, generator=g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_forward_matches_llamagen_reference(variant):
    model = tiny_gpt(1, **VARIANTS[variant])
    cfg = model.config
    idx = torch.randint(
        0, cfg.vocab_size, (3, cfg.block_size - 1), generator=torch.Generator().manual_seed(2)
    )
    cond = condition(model, 3)
    ours = model(idx, cond)
    ref = reference_logits(model.state_dict(), cfg, idx, cond)[:, cfg.cls_token_num - 1 :]
    assert ours.shape == (3, cfg.block_size, cfg.vocab_size)
    torch.testing.assert_close(ours.double(), ref, atol=2e-4, rtol=1e-4)


def test_reference_sees_a_rope_change():
    """The reference is sensitive to the prefix rotation: identity rotation there differs."""
    model = tiny_gpt(1)
    idx = torch.randint(0, 64, (2, 15))
    cond = torch.tensor([0, 5])
    base = model(idx, cond)
    model.freqs_cis[: model.config.cls_token_num, :, 0] = 1.0  # cos = 1: identity, not LlamaGen's zero
    assert not torch.allclose(model(idx, cond), base, atol=1e-3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_decoding_matches_full_forward(variant):
    model = tiny_gpt(3, **VARIANTS[variant])
    cfg = model.config
    cond_row = condition(model, 1)[0]
    null = model.null_condition
    rows = (
        torch.stack([cond_row, null]) if cfg.model_type == "t2i" else torch.stack([cond_row, null.view(())])
    )
    tokens = torch.randint(
        0, cfg.vocab_size, (cfg.block_size - 1,), generator=torch.Generator().manual_seed(4)
    )
    full = model(tokens.expand(2, -1), rows)  # [2, T, V]
    target = TorchTarget(model)
    logits, _ = target.prefill(rows)
    stepped = [logits]
    for t in tokens:
        stepped.append(verify_step(target, t.view(1), cfg.vocab_size).logits[:, 0])
    torch.testing.assert_close(torch.stack(stepped, dim=1), full, atol=1e-4, rtol=1e-4)


def test_cache_ignores_stale_entries():
    """Entries past the committed length (a rejected branch) must not change the logits."""
    model = tiny_gpt(5)
    target = TorchTarget(model)
    rows = torch.tensor([1, 5])
    target.prefill(rows)
    vocab = model.config.vocab_size
    before = verify_step(target, torch.tensor([7]), vocab, commit=False)
    for k, v in zip(target.cache.layers_k, target.cache.layers_v, strict=True):  # views of the cache
        k[:, :, 5:] = 123.0
        v[:, :, 5:] = -77.0
    after = verify_step(target, torch.tensor([7]), vocab, commit=False)
    for got, want in zip(after, before, strict=True):
        torch.testing.assert_close(got, want)


def test_a_tree_verified_in_the_cache_matches_a_full_forward_and_commits_the_kept_rows():
    """The torch target writes a tree's new K/V into its cache's scratch slots and attends there
    (``KVCache.in_place``): for two images at different lengths every node's logits must be a
    full causal forward's over the image's committed tokens and the node's path, and the
    model's own step's (the cache and the new K/V joined), and a commit must put exactly the
    kept nodes' K/V after each image's length, leaving the entries before it as they were."""
    model = tiny_gpt(6)
    cfg, vocab = model.config, model.config.vocab_size
    target = TorchTarget(model, RunShape(2, cache_windows=1))
    cache = target.cache
    rows = torch.tensor([1, 4, cfg.num_classes, cfg.num_classes])  # 2 images, then their null rows
    target.prefill(rows)
    filters = filter_inputs(SamplingConfig(cfg_scale=2.0, temperature=0.0), "cpu")
    relax = relax_inputs(Relaxation("exact"), None, vocab, True, "cpu")

    def verify(tree, tokens):
        n = tokens.shape[1]
        draft = Draft(tokens, torch.ones(2, n, dtype=torch.bool), torch.zeros(2, n, vocab))
        return target.verify(tree, draft, torch.zeros(2, n), torch.zeros(2, vocab), filters, relax)

    history = torch.randint(vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    for t in range(6):  # image 0 commits every step, image 1 every other one
        out = verify(ROOT_ONLY, history[:, t : t + 1])
        cache.commit(out.new_k, out.new_v, out.kept, torch.tensor([1, 1 - t % 2]))
    committed = [history[0], history[1, ::2]]
    assert cache.length.tolist() == [cfg.cls_token_num + 6, cfg.cls_token_num + 3]

    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    tokens = torch.randint(vocab, (2, tree.num_nodes + 1), generator=torch.Generator().manual_seed(2))
    positions, mask = tree_step_inputs(
        tree.depth, tree.mask, cache.length, cache.window, cache.rows, cache.prefix
    )
    h = model.tok_embeddings(cfg_rows(tokens, cache.rows))
    with torch.no_grad():
        own, _, own_k, own_v = model.step(h, positions, mask, cache.k, cache.v)
    before = cache.k.clone(), cache.v.clone()
    out = verify(tree, tokens)
    torch.testing.assert_close(out.logits, own, atol=1e-6, rtol=1e-6)
    for b in range(2):
        for node in range(tree.num_nodes + 1):
            path = tokens[b, tree.mask[node]]  # the root, then the node's ancestors by depth, the node
            seq = torch.cat([committed[b], path])[None].expand(2, -1)
            with torch.no_grad():
                full = model(seq, rows[[b, b + 2]])[:, seq.shape[1]]
            torch.testing.assert_close(out.logits[[b, b + 2], node], full, atol=1e-4, rtol=1e-4)

    kept, count = torch.tensor([[0, 3, 6], [0, 2, 5]]), torch.tensor([3, 2])
    lengths = cache.length.tolist()
    cache.commit(out.new_k, out.new_v, kept, count)
    assert cache.length.tolist() == [lengths[0] + 3, lengths[1] + 2]
    for b, length in enumerate(lengths):
        for mine, old, new in ((cache.k, before[0], own_k), (cache.v, before[1], own_v)):
            torch.testing.assert_close(mine[:, [b, b + 2], :, :length], old[:, [b, b + 2], :, :length])
            want = new[:, [b, b + 2]][:, :, :, kept[b, : count[b]]]
            torch.testing.assert_close(mine[:, [b, b + 2], :, length : length + count[b]], want)


LLAMAGEN_C2I_KEYS = {
    "cls_embedding.embedding_table.weight",
    "tok_embeddings.weight",
    "norm.weight",
    "output.weight",
} | {
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in (
        "attention.wqkv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
        "attention_norm",
        "ffn_norm",
    )
}


def test_state_dict_has_llamagen_keys():
    assert set(tiny_gpt().state_dict()) == LLAMAGEN_C2I_KEYS
    t2i = set(tiny_gpt(model_type="t2i", cls_token_num=3, caption_dim=12).state_dict())
    assert t2i == (LLAMAGEN_C2I_KEYS - {"cls_embedding.embedding_table.weight"}) | {
        "cls_embedding.cap_proj.fc1.weight",
        "cls_embedding.cap_proj.fc2.weight",
        "cls_embedding.uncond_embedding",
    }


@pytest.mark.parametrize("wrapper", ["model", "module", "state_dict", None])
def test_llamagen_pt_checkpoint_reproduces_the_model(tmp_path, wrapper):
    model = tiny_gpt(7)
    state = model.state_dict()
    md = write_model_dir(tmp_path / "m", tiny_gpt(8), tiny_vq(), gpt_file="ck.pt")
    torch.save(state if wrapper is None else {wrapper: state, "steps": 10}, md / "ck.pt")
    loaded = load_target(open_model_dir(md))
    idx = torch.randint(0, 64, (2, 15))
    cond = torch.tensor([1, 2])
    torch.testing.assert_close(loaded(idx, cond), model(idx, cond))


def test_missing_and_unexpected_keys_are_named(tmp_path):
    model = tiny_gpt()
    state = model.state_dict()
    state.pop("layers.1.attention.wo.weight")
    state["extra.weight"] = torch.zeros(1)
    md = write_model_dir(tmp_path / "m", model, tiny_vq(), gpt_file="ck.pt")
    torch.save({"model": state}, md / "ck.pt")
    with pytest.raises(
        CheckpointError,
        match=r"missing keys: layers\.1\.attention\.wo\.weight.*unexpected keys: extra\.weight",
    ):
        load_target(open_model_dir(md))


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    md = write_model_dir(tmp_path / "m", tiny_gpt(dim=48, n_head=3), tiny_vq())
    import json

    cfg = json.loads((md / "config.json").read_text())
    cfg["gpt"] = dict(TINY_GPT)
    (md / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatches"):
        load_target(open_model_dir(md))


@pytest.mark.parametrize(
    "preset,millions",
    [("GPT-B", 111), ("GPT-L", 343), ("GPT-XL", 775), ("GPT-XXL", 1400)],
)
def test_presets_have_llamagen_sizes(preset, millions):
    cfg = gpt_config(preset, num_classes=1000, vocab_size=16384, block_size=256)
    with torch.device("meta"):
        model = Transformer(cfg)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(n - millions) / millions < 0.03, n


def test_config_validation():
    from lantern_rt.models.config import ConfigError

    with pytest.raises(ConfigError):
        GPTConfig(block_size=15)
    with pytest.raises(ConfigError):
        gpt_config("GPT-Z")


def step_kernels(model: Transformer, new: int = 1) -> collections.Counter[str]:
    """The kernels one ``model.step_in_place`` (the torch target's step) over ``new`` tokens
    after 5 cached ones runs on the CPU."""
    c = model.config
    cache = tuple(torch.randn(2, c.kv_heads, 8 + new, c.head_dim) for _ in range(c.n_layer))
    mask = torch.ones(1, 1, new, 8 + new, dtype=torch.bool)
    mask[..., 5:8] = False
    args = (
        torch.randn(2, new, c.dim),
        torch.arange(5, 5 + new),
        mask,
        cache,
        tuple(t.clone() for t in cache),
    )
    with torch.inference_mode():
        return eager_kernels(lambda: model.step_in_place(*args))


def test_a_decode_step_runs_each_layer_in_few_kernels():
    """Per layer: one product for q/k/v and one for gate/up (4 in all), no RoPE gather and no
    mask conversion (each made once per step), the rotation of q and k together."""
    per_layer = step_kernels(tiny_gpt(0, n_layer=2)) - step_kernels(tiny_gpt(0, n_layer=1))
    assert per_layer["aten::mm"] == 4
    assert per_layer["aten::index"] == 0  # the RoPE rows
    assert per_layer["aten::where"] == per_layer["aten::scalar_tensor"] == 0  # the bool mask as a bias
    assert per_layer["aten::mul"] <= 9
    assert per_layer["aten::cat"] == 0  # no join of the cache and the new K/V: written in place
    assert per_layer.total() <= 30, per_layer  # 43 before issue 47


def test_rotation_is_llamagens_to_the_bit():
    """The rotation (products and sums of interleaved pairs) against LlamaGen's complex one."""
    model = tiny_gpt(3)
    x = torch.randn(2, 7, 4, model.config.head_dim)
    positions = torch.arange(3, 10)
    ours = apply_rope(x, rope_rows(model.freqs_cis, positions))
    assert torch.equal(ours, apply_rotary_emb(x, model.freqs_cis[positions]))


def test_gate_and_up_load_as_one_product_under_their_own_keys():
    """LlamaGen's w1 and w3 are stacked once as a checkpoint loads; a missing part is named."""
    state = tiny_gpt(4).state_dict()
    model = tiny_gpt(5)
    load_strict(model, state, "the target")
    w13 = model.layers[1].feed_forward.w13.weight
    want = torch.cat([state["layers.1.feed_forward.w1.weight"], state["layers.1.feed_forward.w3.weight"]])
    assert torch.equal(w13, want)
    del state["layers.1.feed_forward.w3.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys: layers\.1\.feed_forward\.w3\.weight$"):
        load_strict(model, state, "the target")
