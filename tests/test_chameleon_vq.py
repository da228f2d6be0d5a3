"""Chameleon's VQGAN: HF's encoder half, a taming-formula decoder reference, checkpoint keys, ONNX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.errors import LanternError
from lantern_rt.families.chameleon.vq import ChameleonVQ, ChameleonVQConfig
from lantern_rt.models.config import ConfigError

TINY = dict(
    embed_dim=8,
    num_embeddings=64,
    latent_channels=16,
    resolution=32,
    in_channels=3,
    base_channels=32,
    channel_multiplier=[1, 2],
    num_res_blocks=1,
    attn_resolutions=[16],
    dropout=0.0,
    attn_type="vanilla",
)
GRID = 16


def _tiny(seed: int = 0, **overrides) -> ChameleonVQ:
    torch.manual_seed(seed)
    model = ChameleonVQ(ChameleonVQConfig(**(TINY | overrides))).eval()
    with torch.no_grad():  # non-trivial norms, biases and codebook
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _hf_vqvae(seed: int = 0):
    from transformers.models.chameleon.configuration_chameleon import ChameleonVQVAEConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonVQVAE

    torch.manual_seed(seed)
    hf = ChameleonVQVAE(ChameleonVQVAEConfig(**TINY)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return hf


# --- an independent reference: taming-transformers' VQGAN decoder, as functions of a state dict ---


def _conv(sd: dict[str, Tensor], name: str, x: Tensor, padding: int) -> Tensor:
    return F.conv2d(x, sd[f"{name}.weight"], sd[f"{name}.bias"], padding=padding)


def _gn(sd: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    # GroupNorm(32, eps 1e-6) spelled out: statistics over each group of channels and all pixels
    n, c, h, w = x.shape
    g = x.reshape(n, 32, c // 32, h, w)
    mean = g.mean(dim=(2, 3, 4), keepdim=True)
    var = g.var(dim=(2, 3, 4), keepdim=True, unbiased=False)
    y = ((g - mean) / torch.sqrt(var + 1e-6)).reshape(n, c, h, w)
    return y * sd[f"{name}.weight"].view(1, c, 1, 1) + sd[f"{name}.bias"].view(1, c, 1, 1)


def _swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def _ref_resnet(sd: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    h = _conv(sd, f"{name}.conv1", _swish(_gn(sd, f"{name}.norm1", x)), 1)
    h = _conv(sd, f"{name}.conv2", _swish(_gn(sd, f"{name}.norm2", h)), 1)
    if f"{name}.nin_shortcut.weight" in sd:
        x = _conv(sd, f"{name}.nin_shortcut", x, 0)
    return x + h


def _ref_attn(sd: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    h = _gn(sd, f"{name}.norm", x)
    n, c, hh, ww = h.shape
    q, k, v = (_conv(sd, f"{name}.{p}", h, 0).reshape(n, c, hh * ww) for p in "qkv")
    w = torch.softmax(torch.einsum("nci,ncj->nij", q, k) / c**0.5, dim=-1)  # query i attends to key j
    out = torch.einsum("nij,ncj->nci", w, v).reshape(n, c, hh, ww)
    return x + _conv(sd, f"{name}.proj_out", out, 0)


def _ref_decode(model: ChameleonVQ, codes: Tensor, grid: int) -> Tensor:
    c, sd = model.config, {k: v.double() for k, v in model.state_dict().items()}
    z = sd["quantize.embedding.weight"][codes].reshape(codes.shape[0], grid, grid, -1).permute(0, 3, 1, 2)
    h = _conv(sd, "decoder.conv_in", _conv(sd, "post_quant_conv", z, 0), 1)
    h = _ref_resnet(sd, "decoder.mid.block_1", h)
    h = _ref_attn(sd, "decoder.mid.attn_1", h)
    h = _ref_resnet(sd, "decoder.mid.block_2", h)
    for level in reversed(range(len(c.channel_multiplier))):
        for i in range(c.num_res_blocks + 1):
            h = _ref_resnet(sd, f"decoder.up.{level}.block.{i}", h)
            if f"decoder.up.{level}.attn.{i}.q.weight" in sd:
                h = _ref_attn(sd, f"decoder.up.{level}.attn.{i}", h)
        if level != 0:
            h = h.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)  # nearest x2
            h = _conv(sd, f"decoder.up.{level}.upsample.conv", h, 1)
    return _conv(sd, "decoder.conv_out", _swish(_gn(sd, "decoder.norm_out", h)), 1).float()


# --- tests ---


def test_decode_code_equals_taming_reference():
    model = _tiny(1)
    codes = torch.randint(0, 64, (2, GRID * GRID), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.decode_code(codes, GRID)
    assert out.shape == (2, 3, 32, 32) and out.dtype == torch.float32
    torch.testing.assert_close(out, _ref_decode(model, codes, GRID), atol=1e-4, rtol=1e-4)
    assert any(k.startswith("decoder.up.1.attn.0.") for k in model.state_dict())  # attention exercised


def test_decode_code_any_grid_and_bad_shape():
    model = _tiny(3, attn_resolutions=[])
    codes = torch.randint(0, 64, (1, 8 * 8))
    with torch.no_grad():
        assert model.decode_code(codes, 8).shape == (1, 3, 16, 16)
        torch.testing.assert_close(
            model.decode_code(codes, 8), _ref_decode(model, codes, 8), atol=1e-4, rtol=1e-4
        )
    with pytest.raises(LanternError, match=r"\[N, 49\] for grid 7, got \[1, 64\]"):
        model.decode_code(codes, 7)


def test_encoder_half_equals_hf_and_round_trip_shapes():
    hf = _hf_vqvae(4)
    ours = ChameleonVQ(ChameleonVQConfig.from_hf(hf.config.to_dict())).eval()
    hf_keys = set(hf.state_dict())
    assert {k for k in ours.state_dict() if not k.startswith("decoder.")} == hf_keys
    ours.load_state_dict(hf.state_dict(), strict=False)
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        hf_out = hf.encode(images)
        codes = ours.encode(images)
        torch.testing.assert_close(ours.encoder(images), hf_out.last_hidden_state, atol=1e-4, rtol=1e-4)
        assert torch.equal(codes, hf_out.image_tokens.view(2, -1))
        decoded = ours.decode_code(codes, GRID)
    assert codes.shape == (2, GRID * GRID) and codes.dtype == torch.int64
    assert decoded.shape == images.shape and torch.isfinite(decoded).all()


def test_checkpoint_layout_loads_strictly_and_names_missing_key():
    src = _tiny(5)
    state = {f"model.vqmodel.{k}": v for k, v in src.state_dict().items()}
    state["model.embed_tokens.weight"] = torch.zeros(4, 4)  # the language model's keys are skipped
    for key in (
        "model.vqmodel.quantize.embedding.weight",
        "model.vqmodel.decoder.mid.attn_1.proj_out.weight",
        "model.vqmodel.decoder.up.0.block.1.conv2.weight",
        "model.vqmodel.decoder.up.1.upsample.conv.weight",
        "model.vqmodel.decoder.up.0.block.0.nin_shortcut.weight",
        "model.vqmodel.encoder.down.0.downsample.conv.weight",
    ):
        assert key in state, key
    dst = _tiny(6)
    dst.load_checkpoint_state(state)
    codes = torch.randint(0, 64, (1, GRID * GRID))
    with torch.no_grad():
        assert torch.equal(dst.decode_code(codes, GRID), src.decode_code(codes, GRID))
    del state["model.vqmodel.decoder.up.1.upsample.conv.bias"]
    with pytest.raises(ConfigError, match=r"lacks model\.vqmodel\.decoder\.up\.1\.upsample\.conv\.bias$"):
        dst.load_checkpoint_state(state)
    state["model.vqmodel.decoder.up.1.upsample.conv.bias"] = torch.zeros(7)
    with pytest.raises(ConfigError, match="has shape"):
        dst.load_checkpoint_state(state)


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"base_channels": 48}, "multiple of 32"),
        ({"channel_multiplier": []}, "must not be empty"),
        ({"num_embeddings": 0}, "num_embeddings must be an integer"),
        ({"double_latent": True}, "double_latent must be false"),
        ({"attn_type": "linear"}, "attn_type"),
        ({"dropout": 2.0}, "dropout"),
        ({"resolution": 33}, "resolution 33"),
        ({"embed_dim": "8"}, "embed_dim"),
    ],
)
def test_bad_config_is_one_line_config_error(bad, words):
    with pytest.raises(ConfigError, match=words) as err:
        ChameleonVQConfig.from_hf(TINY | bad)
    assert "\n" not in str(err.value)


def test_from_hf_reads_taming_aliases_and_ignores_bookkeeping():
    c = ChameleonVQConfig.from_hf(
        {"ch": 64, "ch_mult": [1, 1, 2], "n_embed": 16, "z_channels": 4, "model_type": "x"}
    )
    assert (c.base_channels, c.channel_multiplier, c.num_embeddings, c.latent_channels) == (
        64,
        [1, 1, 2],
        16,
        4,
    )
    assert c.grid == 128 and ChameleonVQConfig.from_hf({"attn_resolutions": None}).attn_resolutions == []


def test_onnx_export_of_decode_code_matches_torch(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = _tiny(7)

    class DecodeCode(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vq = model

        def forward(self, codes: Tensor) -> Tensor:
            return self.vq.decode_code(codes, GRID)

    codes = torch.randint(0, 64, (2, GRID * GRID), generator=torch.Generator().manual_seed(8))
    path = tmp_path / "decode.onnx"
    torch.onnx.export(
        DecodeCode().eval(), (codes,), str(path), input_names=["codes"], output_names=["images"], dynamo=True
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"codes": codes.numpy()})
    with torch.no_grad():
        expected = model.decode_code(codes, GRID)
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-4, rtol=1e-4)
