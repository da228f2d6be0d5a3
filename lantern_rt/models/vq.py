"""The VQ tokenizer in LlamaGen's exact parameter layout (``tokenizer/tokenizer_image/vq_model.py``).

Encoder and decoder are conv stacks with GroupNorm(32) residual blocks and attention at the
lowest resolution; the codebook is looked up l2-normalised when ``codebook_l2_norm`` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.models.config import VQConfig


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, 1, 1)
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1, 1, 0)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        if self.in_channels != self.out_channels:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        b, c, hh, ww = h.shape
        q = self.q(h).reshape(b, c, hh * ww).transpose(1, 2)
        k = self.k(h).reshape(b, c, hh * ww)
        v = self.v(h).reshape(b, c, hh * ww)
        w = torch.softmax(torch.bmm(q, k) * (int(c) ** -0.5), dim=2)
        out = torch.bmm(v, w.transpose(1, 2)).reshape(b, c, hh, ww)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 2, 0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Encoder(nn.Module):
    def __init__(self, c: VQConfig):
        super().__init__()
        ch, mult = c.ch, c.encoder_ch_mult
        self.num_res_blocks = c.num_res_blocks
        self.conv_in = nn.Conv2d(c.in_channels, ch, 3, 1, 1)
        in_mult = (1, *mult)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level, m in enumerate(mult):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            block_in, block_out = ch * in_mult[level], ch * m
            for _ in range(c.num_res_blocks):
                block.res.append(ResnetBlock(block_in, block_out, c.dropout_p))
                block_in = block_out
                if level == len(mult) - 1:
                    block.attn.append(AttnBlock(block_in))
            if level != len(mult) - 1:
                block.downsample = Downsample(block_in)
            self.conv_blocks.append(block)
        self.mid = nn.ModuleList(
            [
                ResnetBlock(block_in, block_in, c.dropout_p),
                AttnBlock(block_in),
                ResnetBlock(block_in, block_in, c.dropout_p),
            ]
        )
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.z_channels, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level, block in enumerate(self.conv_blocks):
            for i in range(self.num_res_blocks):
                h = block.res[i](h)
                if len(block.attn) > 0:
                    h = block.attn[i](h)
            if level != len(self.conv_blocks) - 1:
                h = block.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, c: VQConfig):
        super().__init__()
        ch, mult = c.ch, c.decoder_ch_mult
        self.num_res_blocks = c.num_res_blocks
        block_in = ch * mult[-1]
        self.conv_in = nn.Conv2d(c.z_channels, block_in, 3, 1, 1)
        self.mid = nn.ModuleList(
            [
                ResnetBlock(block_in, block_in, c.dropout_p),
                AttnBlock(block_in),
                ResnetBlock(block_in, block_in, c.dropout_p),
            ]
        )
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(len(mult))):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            block_out = ch * mult[level]
            for _ in range(c.num_res_blocks + 1):
                block.res.append(ResnetBlock(block_in, block_out, c.dropout_p))
                block_in = block_out
                if level == len(mult) - 1:
                    block.attn.append(AttnBlock(block_in))
            if level != 0:
                block.upsample = Upsample(block_in)
            self.conv_blocks.append(block)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.out_channels, 3, 1, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for level, block in enumerate(self.conv_blocks):
            for i in range(self.num_res_blocks + 1):
                h = block.res[i](h)
                if len(block.attn) > 0:
                    h = block.attn[i](h)
            if level != len(self.conv_blocks) - 1:
                h = block.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, c: VQConfig):
        super().__init__()
        self.n_e, self.e_dim, self.beta = c.codebook_size, c.codebook_embed_dim, c.commit_loss_beta
        self.l2_norm = c.codebook_l2_norm
        self.embedding = nn.Embedding(self.n_e, self.e_dim)
        self.embedding.weight.data.uniform_(-1.0 / self.n_e, 1.0 / self.n_e)
        if self.l2_norm:
            self.embedding.weight.data = F.normalize(self.embedding.weight.data, p=2, dim=-1)
        if c.codebook_show_usage:
            self.register_buffer("codebook_used", torch.zeros(65536))

    def codebook(self) -> Tensor:
        """The vectors lookups actually return: l2-normalised when the quantizer normalises."""
        w = self.embedding.weight
        return F.normalize(w, p=2, dim=-1) if self.l2_norm else w

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Quantise z [B, C, H, W] -> (z_q with straight-through gradient, indices [B, H, W], loss)."""
        z = z.permute(0, 2, 3, 1)
        if self.l2_norm:
            z = F.normalize(z, p=2, dim=-1)
        emb = self.codebook()
        flat = z.reshape(-1, self.e_dim)
        d = flat.pow(2).sum(1, keepdim=True) + emb.pow(2).sum(1) - 2 * flat @ emb.t()
        idx = d.argmin(dim=1)
        z_q = emb[idx].view(z.shape)
        loss = torch.mean((z_q - z.detach()) ** 2) + self.beta * torch.mean((z_q.detach() - z) ** 2)
        z_q = z + (z_q - z).detach()
        return z_q.permute(0, 3, 1, 2), idx.view(z.shape[:-1]), loss

    def get_codebook_entry(self, indices: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
        """Codes -> quantised latents [B, C, H, W] (``shape`` is (B, C, H, W))."""
        z_q = self.codebook()[indices].reshape(shape[0], shape[2], shape[3], shape[1])
        return z_q.permute(0, 3, 1, 2).contiguous()


class VQModel(nn.Module):
    def __init__(self, config: VQConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = VectorQuantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, 1)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Images [B, C, H, W] in [-1, 1] -> (quantised latents, codes [B, h, w], VQ loss)."""
        return self.quantize(self.quant_conv(self.encoder(x)))

    def decode(self, quant: Tensor) -> Tensor:
        return self.decoder(self.post_quant_conv(quant))

    def decode_code(self, codes: Tensor, grid: int) -> Tensor:
        """Codes [B, grid*grid] -> images [B, C, H, W] in about [-1, 1]."""
        shape = (codes.shape[0], self.config.codebook_embed_dim, grid, grid)
        return self.decode(self.quantize.get_codebook_entry(codes, shape))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        quant, _, loss = self.encode(x)
        return self.decode(quant), loss
