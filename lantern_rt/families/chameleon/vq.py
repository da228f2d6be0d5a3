"""The Chameleon family's VQGAN image tokenizer (Anole-7B, Lumina-mGPT) in the checkpoint's layout.

Hugging Face ``transformers`` ships only the encoder half (``ChameleonVQVAE``: encoder, quantizer,
``quant_conv``, ``post_quant_conv``); its conversion script drops every ``decoder`` key because
Chameleon's image generation was disabled. Anole's conversion keeps them under
``model.vqmodel.decoder.*``: the taming-transformers VQGAN decoder (``conv_in``, ``mid`` with
attention, ``up`` levels of ResnetBlocks and nearest-neighbour Upsample, ``norm_out``, ``conv_out``),
written here. Parameter names equal the checkpoint's ``model.vqmodel.*`` keys with the prefix removed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.errors import LanternError
from lantern_rt.models.config import ConfigError
from lantern_rt.models.vq import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm

CHECKPOINT_PREFIX = "model.vqmodel."
# taming-transformers' names that Chameleon's conversion also leaves in ``vq_config``: new <- old
_ALIASES = {
    "base_channels": "ch",
    "out_channels": "out_ch",
    "num_embeddings": "n_embed",
    "channel_multiplier": "ch_mult",
    "double_latent": "double_z",
    "latent_channels": "z_channels",
}


@dataclass
class ChameleonVQConfig:
    """The HF ``vq_config`` of a Chameleon checkpoint (``ChameleonVQVAEConfig`` field names)."""

    embed_dim: int = 256
    num_embeddings: int = 8192
    double_latent: bool = False
    latent_channels: int = 256
    resolution: int = 512
    in_channels: int = 3
    out_channels: int = 3
    base_channels: int = 128
    channel_multiplier: list[int] = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    attn_resolutions: list[int] = field(default_factory=list)
    dropout: float = 0.0
    attn_type: str = "vanilla"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.channel_multiplier, tuple):
            self.channel_multiplier = list(self.channel_multiplier)
        if self.attn_resolutions is None:
            self.attn_resolutions = []
        if self.attn_type is None:
            self.attn_type = "none"
        for f in ("embed_dim", "num_embeddings", "latent_channels", "resolution", "in_channels"):
            _check_int(name, f, getattr(self, f))
        for f in ("out_channels", "base_channels", "num_res_blocks"):
            _check_int(name, f, getattr(self, f))
        for f in ("channel_multiplier", "attn_resolutions"):
            values = getattr(self, f)
            if not isinstance(values, list) or not all(_is_int(v) and v >= 1 for v in values):
                raise ConfigError(f"{name}.{f} must be a list of integers >= 1, got {values!r}"[:300])
        if not self.channel_multiplier:
            raise ConfigError(f"{name}.channel_multiplier must not be empty")
        if not isinstance(self.double_latent, bool):
            raise ConfigError(f"{name}.double_latent must be a bool, got {self.double_latent!r}"[:300])
        if self.double_latent:
            raise ConfigError(
                f"{name}.double_latent must be false for a VQ model (quant_conv takes latent_channels)"
            )
        dropout_ok = isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
        if not (dropout_ok and 0 <= self.dropout <= 1):
            raise ConfigError(f"{name}.dropout must be a probability in 0..1, got {self.dropout!r}"[:300])
        if self.attn_type not in ("vanilla", "none"):
            raise ConfigError(f"{name}.attn_type must be 'vanilla' or 'none', got {self.attn_type!r}"[:300])
        for m in self.channel_multiplier:
            if (self.base_channels * m) % 32:
                raise ConfigError(
                    f"{name}: base_channels {self.base_channels} x multiplier {m} is not a multiple of 32 "
                    "(GroupNorm has 32 groups)"
                )
        if self.resolution % self.downsample:
            raise ConfigError(f"{name}.resolution {self.resolution} is not a multiple of {self.downsample}")

    @property
    def codebook_size(self) -> int:
        """Codes in the codebook (the runtime's vocabulary), by the name LlamaGen's config uses."""
        return self.num_embeddings

    @property
    def downsample(self) -> int:
        """Image pixels per token along each side."""
        return 2 ** (len(self.channel_multiplier) - 1)

    @property
    def grid(self) -> int:
        """Tokens along each side of a ``resolution`` image."""
        return self.resolution // self.downsample

    @classmethod
    def from_hf(cls, values: dict[str, Any]) -> ChameleonVQConfig:
        """From an HF ``vq_config`` dict: known fields (or their taming aliases); other keys ignored."""
        if not isinstance(values, dict):
            raise ConfigError(f"vq_config must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        picked = {k: v for k, v in values.items() if k in known}
        for new, old in _ALIASES.items():
            if new not in picked and old in values:
                picked[new] = values[old]
        try:
            return cls(**picked)
        except TypeError as exc:  # a comparison of a wrong-typed value inside the checks
            raise ConfigError(f"{cls.__name__}: {exc}") from exc


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, f: str, value: Any) -> None:
    if not (_is_int(value) and value >= 1):
        raise ConfigError(f"{name}.{f} must be an integer >= 1, got {value!r}"[:300])


def _mid(channels: int, c: ChameleonVQConfig) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels, c.dropout)
    mid.attn_1 = AttnBlock(channels) if c.attn_type == "vanilla" else nn.Identity()
    mid.block_2 = ResnetBlock(channels, channels, c.dropout)
    return mid


def _run_mid(mid: nn.Module, h: Tensor) -> Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h)))


def _attends(c: ChameleonVQConfig, resolution: int) -> bool:
    return c.attn_type == "vanilla" and resolution in c.attn_resolutions


class Encoder(nn.Module):
    """Images [N, in_channels, R, R] -> latents [N, latent_channels, R/d, R/d] (HF's encoder)."""

    def __init__(self, c: ChameleonVQConfig):
        super().__init__()
        ch, mult = c.base_channels, c.channel_multiplier
        self.num_res_blocks = c.num_res_blocks
        self.conv_in = nn.Conv2d(c.in_channels, ch, 3, 1, 1)
        in_mult = (1, *mult)
        self.down = nn.ModuleList()
        res, block_in = c.resolution, ch
        for level, m in enumerate(mult):
            down = nn.Module()
            down.block, down.attn = nn.ModuleList(), nn.ModuleList()
            block_in, block_out = ch * in_mult[level], ch * m
            for _ in range(c.num_res_blocks):
                down.block.append(ResnetBlock(block_in, block_out, c.dropout))
                block_in = block_out
                if _attends(c, res):
                    down.attn.append(AttnBlock(block_in))
            if level != len(mult) - 1:
                down.downsample = Downsample(block_in)
                res //= 2
            self.down.append(down)
        self.mid = _mid(block_in, c)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.latent_channels, 3, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level, down in enumerate(self.down):
            for i in range(self.num_res_blocks):
                h = down.block[i](h)
                if len(down.attn) > 0:
                    h = down.attn[i](h)
            if level != len(self.down) - 1:
                h = down.downsample(h)
        return self.conv_out(F.silu(self.norm_out(_run_mid(self.mid, h))))


class Decoder(nn.Module):
    """Latents [N, latent_channels, g, g] -> images [N, out_channels, g*d, g*d] (taming's decoder;
    ``up[i]`` is level ``i``, run from the deepest level up)."""

    def __init__(self, c: ChameleonVQConfig):
        super().__init__()
        ch, mult = c.base_channels, c.channel_multiplier
        self.num_res_blocks = c.num_res_blocks
        block_in, res = ch * mult[-1], c.grid
        self.conv_in = nn.Conv2d(c.latent_channels, block_in, 3, 1, 1)
        self.mid = _mid(block_in, c)
        self.up = nn.ModuleList()
        for level in reversed(range(len(mult))):
            up = nn.Module()
            up.block, up.attn = nn.ModuleList(), nn.ModuleList()
            block_out = ch * mult[level]
            for _ in range(c.num_res_blocks + 1):
                up.block.append(ResnetBlock(block_in, block_out, c.dropout))
                block_in = block_out
                if _attends(c, res):
                    up.attn.append(AttnBlock(block_in))
            if level != 0:
                up.upsample = Upsample(block_in)
                res *= 2
            self.up.insert(0, up)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, c.out_channels, 3, 1, 1)

    def forward(self, z: Tensor) -> Tensor:
        h = _run_mid(self.mid, self.conv_in(z))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for i in range(self.num_res_blocks + 1):
                h = up.block[i](h)
                if len(up.attn) > 0:
                    h = up.attn[i](h)
            if level != 0:
                h = up.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, c: ChameleonVQConfig):
        super().__init__()
        self.embedding = nn.Embedding(c.num_embeddings, c.embed_dim)

    def codebook(self) -> Tensor:
        """The code vectors [V, dim] (the latent space the neighbour table is computed in)."""
        return self.embedding.weight

    def forward(self, z: Tensor) -> Tensor:
        """Latents [N, dim, h, w] -> nearest codes [N, h*w] (squared l2, as HF's quantizer)."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        w = self.embedding.weight
        d = flat.pow(2).sum(1, keepdim=True) + w.pow(2).sum(1) - 2 * flat @ w.t()
        return d.argmin(dim=1).view(z.shape[0], -1)


class ChameleonVQ(nn.Module):
    """Chameleon's VQGAN: ``encode`` images to codes, ``decode_code`` codes to images."""

    def __init__(self, config: ChameleonVQConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = VectorQuantizer(config)
        self.quant_conv = nn.Conv2d(config.latent_channels, config.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.latent_channels, 1)

    def encode(self, images: Tensor) -> Tensor:
        """Images [N, C, H, W] in [-1, 1] -> codes [N, (H/d) * (W/d)] int64."""
        return self.quantize(self.quant_conv(self.encoder(images)))

    def decode_code(self, codes: Tensor, grid: int) -> Tensor:
        """Codes [N, grid*grid] int64 -> images fp32 [N, out_channels, grid*d, grid*d] in about [-1, 1]."""
        if codes.dim() != 2 or codes.shape[1] != grid * grid:
            raise LanternError(f"codes must be [N, {grid * grid}] for grid {grid}, got {list(codes.shape)}")
        z = self.quantize.embedding(codes).view(codes.shape[0], grid, grid, self.config.embed_dim)
        return self.decoder(self.post_quant_conv(z.permute(0, 3, 1, 2))).float()

    def load_checkpoint_state(self, state: dict[str, Tensor], prefix: str = CHECKPOINT_PREFIX) -> None:
        """Strictly load the ``prefix``* entries of a checkpoint state dict (other keys are skipped);
        a :class:`ConfigError` names the first missing, unexpected or mis-shaped key."""
        ours = self.state_dict()
        picked = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        missing = [k for k in ours if k not in picked]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ConfigError(f"checkpoint lacks {prefix}{missing[0]}{more}")
        unexpected = [k for k in picked if k not in ours]
        if unexpected:
            raise ConfigError(f"checkpoint has unexpected key {prefix}{unexpected[0]} for this vq_config")
        for k, v in picked.items():
            if tuple(v.shape) != tuple(ours[k].shape):
                raise ConfigError(
                    f"checkpoint {prefix}{k} has shape {list(v.shape)}, the vq_config needs {list(ours[k].shape)}"
                )
        self.load_state_dict(picked, strict=True)
