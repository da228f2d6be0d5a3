"""The Chameleon target (lantern_rt.families.chameleon.model) against HF transformers' Chameleon."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.families.chameleon.model import ChameleonConfig, ChameleonTarget
from lantern_rt.models.config import ConfigError
from tests.chameleon_fixtures import TINY_DECODER, code_name

transformers = pytest.importorskip("transformers")

VOCAB = 300
N_IMAGE = 16  # IMGIMG tokens at ids 100..115 (codes 0..15)
ATOL = 1e-4


def _vocabulary_map() -> dict[str, int]:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<image>": 3}
    vocab.update({code_name(c): 100 + c for c in range(N_IMAGE)})
    return vocab


def _hf_config(**overrides) -> dict:
    values = dict(
        TINY_DECODER,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        vocabulary_map=_vocabulary_map(),
        vq_config=dict(
            embed_dim=32,
            num_embeddings=N_IMAGE,
            latent_channels=32,
            resolution=32,
            base_channels=32,
            channel_multiplier=[1, 2],
            num_res_blocks=1,
        ),
    )
    return values | overrides


@pytest.fixture(scope="module", params=[False, True], ids=["pre_norm", "swin_norm"])
def pair(request):
    """(HF model, our model) with the same random weights, in eval mode."""
    torch.manual_seed(0)
    hf = transformers.ChameleonForConditionalGeneration(
        transformers.ChameleonConfig(**_hf_config(swin_norm=request.param))
    )
    hf.config._attn_implementation = "eager"
    with torch.no_grad():  # random q/k norm affine parameters, so that a wrong layout shows
        for name, p in hf.named_parameters():
            if "_norm." in name or "layernorm" in name or name == "model.norm.weight":
                p.add_(0.3 * torch.randn_like(p))
    hf.eval()
    config = ChameleonConfig.from_hf(hf.config.to_dict())
    ours = ChameleonTarget(config).eval()
    ours.load_state_dict(_state_dict(hf), strict=True)
    return hf, ours


def _state_dict(hf) -> dict[str, torch.Tensor]:
    return {k: v for k, v in hf.state_dict().items() if not k.startswith("model.vqmodel.")}


def _hf_logits(hf, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return hf.lm_head(hf.model(input_ids=ids, **kwargs).last_hidden_state).float()


def _causal(s: int, p: int = 0) -> torch.Tensor:
    return torch.ones(s, p + s, dtype=torch.bool).tril(p)[None, None]


def test_config_from_hf(pair):
    hf, ours = pair
    c = ours.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.rope_theta, c.qk_layernorm) == (2, 2, 500.0, True)
    assert c.swin_norm == hf.config.swin_norm
    assert c.image_token_ids == tuple(range(100, 100 + N_IMAGE)) and c.image_token_id == 3
    assert c.image_token_ids == tuple(hf.model.vocabulary_mapping.img2bpe[i] for i in range(N_IMAGE))
    legacy = ChameleonConfig.from_hf(
        {"rope_theta": 10000.0, "rope_scaling": None, "swin_norm": True, "extra": 1}
    )
    assert legacy.rope_theta == 10000.0 and legacy.swin_norm


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"hidden_size": "64"}, "hidden_size must be int"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1"),
        ({"hidden_size": 60, "num_attention_heads": 8}, "not divisible"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 64}, "not a multiple"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_theta"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"vocabulary_map": {"IMGIMGBZ": 5}}, "do not cover codes"),
    ],
)
def test_config_errors(raw, words):
    with pytest.raises(ConfigError, match=words) as info:
        ChameleonConfig.from_hf(raw)
    assert "\n" not in str(info.value)


def test_full_forward_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(ids)
        hf_out = hf(input_ids=ids).logits
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ATOL, rtol=0)
    text = torch.ones(VOCAB, dtype=torch.bool)
    text[list(ours.config.image_token_ids)] = False  # HF masks image logits; ours does not
    torch.testing.assert_close(logits[..., text], hf_out[..., text], atol=ATOL, rtol=0)


def test_step_with_external_cache_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    want = _hf_logits(hf, ids)
    p = 6
    with torch.no_grad():
        logits, hidden, k, v = ours.step(ours.embed(ids[:, :p]), torch.arange(p), _causal(p), None, None)
        assert k.shape == (2, 1, 2, p, 16) and hidden.shape == (1, p, 64)
        torch.testing.assert_close(logits, want[:, :p], atol=ATOL, rtol=0)
        for t in range(p, ids.shape[1]):
            mask = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
            logits, _, nk, nv = ours.step(ours.embed(ids[:, t : t + 1]), torch.tensor([t]), mask, k, v)
            k, v = torch.cat([k, nk], dim=3), torch.cat([v, nv], dim=3)
            torch.testing.assert_close(logits, want[:, t : t + 1], atol=ATOL, rtol=0)


def test_tree_step_matches_hf(pair):
    """A tree of 4 new tokens: a root, two siblings at the same position, a grandchild."""
    hf, ours = pair
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=gen)
    nodes = torch.randint(0, VOCAB, (1, 4), generator=gen)
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    p = prompt.shape[1]
    tree = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parents[j]
    mask = torch.cat([torch.ones(4, p, dtype=torch.bool), tree], dim=1)[None, None]
    with torch.no_grad():
        _, _, k, v = ours.step(ours.embed(prompt), torch.arange(p), _causal(p), None, None)
        logits, _, _, _ = ours.step(ours.embed(nodes), torch.tensor(depth) + p, mask, k, v)
    for i in range(4):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        want = _hf_logits(hf, torch.cat([prompt, nodes[:, path]], dim=1))[:, -1]
        torch.testing.assert_close(logits[:, i], want, atol=ATOL, rtol=0)


def test_per_row_positions_with_left_padding_match_hf(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(4)
    lengths, width = [5, 3], 5
    ids = torch.randint(4, VOCAB, (2, width), generator=gen)
    nxt = torch.randint(4, VOCAB, (2, 1), generator=gen)
    valid = torch.tensor([[i >= width - n for i in range(width)] for n in lengths])
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    eye = torch.eye(width, dtype=torch.bool)
    mask = ((_causal(width)[0, 0] & valid[:, None, :]) | eye)[:, None]  # a pad row sees itself only
    with torch.no_grad():
        logits, _, k, v = ours.step(ours.embed(ids), positions, mask, None, None)
        step_mask = torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], dim=1)[:, None, None]
        logits2, _, _, _ = ours.step(ours.embed(nxt), torch.tensor(lengths)[:, None], step_mask, k, v)
        hf_padded = _hf_logits(hf, ids, attention_mask=valid.long(), position_ids=positions)
    for row, n in enumerate(lengths):
        alone = _hf_logits(hf, torch.cat([ids[row : row + 1, width - n :], nxt[row : row + 1]], dim=1))
        torch.testing.assert_close(logits[row, width - n :], alone[0, :n], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[row, width - n :], hf_padded[row, width - n :], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits2[row, 0], alone[0, n], atol=ATOL, rtol=0)


def test_strict_loading_names_a_missing_key(pair):
    hf, ours = pair
    state = _state_dict(hf)
    del state["model.layers.1.self_attn.k_norm.bias"]
    fresh = ChameleonTarget(ours.config)
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn\.k_norm\.bias"):
        fresh.load_state_dict(state, strict=True)
    state = _state_dict(hf) | {"model.vqmodel.quant_conv.weight": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="model.vqmodel.quant_conv.weight"):
        fresh.load_state_dict(state, strict=True)


def test_per_shard_qk_norm_layout_loads(pair):
    """Lumina-mGPT's q/k norm parameters are [model_parallel_size, D], one row per shard of heads."""
    hf, ours = pair
    state = _state_dict(hf)
    for name in [k for k in state if "_norm." in k]:
        shards = state[name][::2]  # q: 2 shards of 2 heads; k: 1 shard of 2 heads
        state[name] = shards
        with torch.no_grad():
            hf.get_parameter(name).copy_(_expand(shards, hf.get_parameter(name).shape[0]))
    fresh = ChameleonTarget(ours.config).eval()
    fresh.load_state_dict(state, strict=True)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)
    ours.load_state_dict(_state_dict(hf), strict=True)  # keep the shared fixture consistent


def _expand(shards: torch.Tensor, n_heads: int) -> torch.Tensor:
    return shards.repeat_interleave(n_heads // shards.shape[0], dim=0)


class _Step(torch.nn.Module):
    def __init__(self, target: ChameleonTarget):
        super().__init__()
        self.target = target

    def forward(self, ids, positions, mask, past_k, past_v):
        return self.target.step(self.target.embed(ids), positions, mask, past_k, past_v)


def test_step_exports_to_onnx(pair, tmp_path):
    """step() with per-row positions and a tree mask exports with torch.onnx dynamo and matches."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    _, ours = pair
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, VOCAB, (2, 3), generator=gen)
    positions = torch.tensor([[5, 6, 6], [3, 4, 4]])
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1).expand(2, 1, 3, 8).clone()
    mask[1, :, :, :2] = False  # row 1 is left-padded by two slots
    past = [torch.randn(2, 2, 2, 5, 16, generator=gen) for _ in range(2)]
    inputs = (ids, positions, mask, *past)
    path = tmp_path / "step.onnx"
    names = ["ids", "positions", "mask", "past_k", "past_v"]
    torch.onnx.export(_Step(ours).eval(), inputs, str(path), input_names=names, dynamo=True, verbose=False)
    got = ort.InferenceSession(str(path)).run(
        None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)}
    )
    with torch.no_grad():
        want = _Step(ours)(*inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), w, atol=ATOL, rtol=0)
