"""The VQ tokenizer: LlamaGen's layout, l2-normalised lookup, code decoding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lantern_rt.models.config import vq_config
from lantern_rt.models.vq import VQModel
from tests.conftest import tiny_vq


def test_vq16_layout_keys():
    with torch.device("meta"):
        model = VQModel(vq_config("VQ-16", ch=32, z_channels=32))
    keys = set(model.state_dict())
    for key in (
        "encoder.conv_in.weight",
        "encoder.conv_blocks.0.res.0.norm1.weight",
        "encoder.conv_blocks.0.downsample.conv.weight",
        "encoder.conv_blocks.2.res.0.nin_shortcut.weight",
        "encoder.conv_blocks.4.attn.1.q.weight",
        "encoder.mid.1.proj_out.weight",
        "encoder.conv_out.weight",
        "decoder.conv_blocks.0.res.2.conv2.weight",
        "decoder.conv_blocks.0.attn.2.k.weight",
        "decoder.conv_blocks.3.upsample.conv.weight",
        "decoder.norm_out.bias",
        "quantize.embedding.weight",
        "quantize.codebook_used",
        "quant_conv.weight",
        "post_quant_conv.weight",
    ):
        assert key in keys, key
    assert not any(k.startswith("encoder.conv_blocks.4.downsample") for k in keys)
    assert not any(k.startswith("decoder.conv_blocks.4.upsample") for k in keys)


def test_vq16_parameter_count_matches_llamagen():
    """LlamaGen reports 72M parameters for VQ-16 (ch 128, z 256, codebook 16384 x 8)."""
    with torch.device("meta"):
        model = VQModel(vq_config("VQ-16"))
    n = sum(p.numel() for p in model.parameters()) / 1e6
    assert 70 < n < 74, n


def test_decode_code_looks_up_normalised_vectors():
    vq = tiny_vq(1)
    with torch.no_grad():
        vq.quantize.embedding.weight.mul_(3.0)  # stored vectors not unit length
        codes = torch.randint(0, 64, (2, 16))
        emb = F.normalize(vq.quantize.embedding.weight, dim=-1)[codes]  # [2, 16, 4]
        expected = vq.decode(emb.view(2, 4, 4, 4).permute(0, 3, 1, 2))
        torch.testing.assert_close(vq.decode_code(codes, 4), expected)


def test_encode_picks_nearest_normalised_code():
    vq = tiny_vq(2)
    x = torch.rand(3, 1, 8, 8) * 2 - 1
    with torch.no_grad():
        z = F.normalize(vq.quant_conv(vq.encoder(x)).permute(0, 2, 3, 1), dim=-1)
        _, codes, _ = vq.encode(x)
        emb = F.normalize(vq.quantize.embedding.weight, dim=-1)
        brute = torch.cdist(z.reshape(-1, 4), emb).argmin(1).view(codes.shape)
    assert torch.equal(codes, brute)
