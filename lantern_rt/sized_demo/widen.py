"""Function-preserving widening: the demo's weights inside a model and drafter of LlamaGen's shape.

The demo (dim 160, 6 layers, 5 heads of 32, FFN 448) becomes a model of a
:data:`~lantern_rt.sized_demo.sizes.SIZES` shape (LlamaGen's dim, layers, heads of 64 and FFN width)
whose logits are the demo's to fp32 round-off, by these rules (the formulas of
:mod:`lantern_rt.models.target` and :mod:`lantern_rt.models.drafter`):

- Residual stream: the demo's D dims are the first D of the wide D'. Every matrix that writes to it
  (token and class embeddings, attention ``wo``, FFN ``w2``, the drafter's ``fc`` and ``o_proj``/
  ``down_proj``) has zero rows for the extra dims, so they stay exactly 0 in every layer; the
  matrices that read it have random columns there (their inputs are 0).
- Heads keep LlamaGen's count and width; the demo's heads are the first ones. LlamaGen's 2D RoPE
  turns pair j of a head of width d by base^(-4j/d) within each half (rows, then columns), so the
  demo's pair p has exactly the frequency of the wide pair r p (r = wide / demo head width, a
  power of 2): it is placed there (q, k and v alike); q is zero in the other pairs of those heads
  (in the columns of the demo's dims; k and v random) and scaled by sqrt(r) to undo attention's
  wider 1/sqrt(head width). Extra heads are random, their ``wo`` columns zero. (The demo's width
  of 32 kept with more heads is exact too, without zeroed q pairs, but is not LlamaGen's shape:
  twice the heads, half as wide, the same weight and K/V bytes and FLOPs.)
- RMSNorm, x rsqrt(mean(x^2) + eps) w: with the extra dims 0 the mean over D' is D/D' times the
  mean over D, so eps' = eps D/D' and w' = w sqrt(D/D') give the same output (the extra dims'
  weights are random: they multiply 0).
- FFN: the extra hidden units are random in ``w1``/``w3`` and zero in ``w2``'s columns.
- Extra layers (after the demo's): random except the v rows of ``wqkv`` and the up projection
  ``w3``, which are zero, so that the attention's output (a mix of zero values) and the FFN's
  hidden units (``silu(w1 x) * 0``) are exactly 0 and the random ``wo`` and ``w2`` add exactly 0 to
  the residual; they cost a full layer. No whole tensor is zero: a bundle's weights file stores
  identical tensors once, and zero ``wo``/``w2`` shared by every extra layer would be read from
  one cached copy instead of streamed (each v/up block sits inside a fused matrix with random
  rows).
- Output head: random columns for the extra dims. The vocabulary stays the demo's 1024 codes
  (LlamaGen's is 16384): the head is 1024 x D' instead of 16384 x D', 3-5 MB of fp32 instead of
  50-84 MB, so a step streams 12% (GPT-B), 5% (L) or 3% (XL) fewer weight bytes than LlamaGen's.
- The drafter follows the same rules; its ``fc`` reads the token embedding and the target's
  final-norm hidden state, both 0 in the extra dims, and writes zero rows there.

No backend can skip the inert parts: every weight is stored dense at its full shape in fp32, random
(std 0.02, LlamaGen's initialisation) everywhere but the zero blocks named above, and no runtime
here prunes weights or branches on their values (torch, onnxruntime and TensorRT run each product
as a dense GEMM over the stored initializer), so a step costs what a LlamaGen model of that shape
costs. The random parts come from one seeded generator drawn in a fixed order: the files are
the same on every build.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from lantern_rt.families.loading import load_drafter, load_target, open_model_dir
from lantern_rt.fileio import staged_folder
from lantern_rt.models.config import ConfigError, GPTConfig, to_dict
from lantern_rt.models.model_dir import DEMO_DIR
from lantern_rt.sized_demo.sizes import DEFAULT_SEED, MULTIPLE_OF, size_shape

STD = 0.02  # LlamaGen's initialisation of its Linear and Embedding weights
# Deliberate mistakes a test plants to see that the widening's check catches each: RMSNorm's eps
# not rescaled, one RoPE pair of each demo head moved to a pair of another frequency, q not scaled
MISTAKES = ("eps", "rope", "q_scale")


class Widening:
    """Where the demo's weights go in a wide config (and which deliberate ``mistake`` to make)."""

    def __init__(self, demo: GPTConfig, size: str, mistake: str | None = None):
        if mistake is not None and mistake not in MISTAKES:
            raise ValueError(f"unknown mistake {mistake!r}; choose from {', '.join(MISTAKES)}")
        self.demo, self.mistake = demo, mistake
        shape = dataclasses.replace(
            demo, **size_shape(size), multiple_of=MULTIPLE_OF, ffn_dim_multiplier=None
        )
        self.eps_scale = 1.0 if mistake == "eps" else demo.dim / shape.dim
        self.wide = dataclasses.replace(shape, norm_eps=demo.norm_eps * self.eps_scale)
        ratio = self.wide.head_dim // demo.head_dim
        if (
            self.wide.n_head < demo.n_head
            or self.wide.n_layer < demo.n_layer
            or self.wide.ffn_hidden < demo.ffn_hidden
            or self.wide.head_dim != ratio * demo.head_dim
            or ratio & (ratio - 1)
            or demo.kv_heads != demo.n_head
        ):
            raise ConfigError(f"size {size} cannot hold the demo's heads, layers and FFN")
        self.ratio = ratio

    @property
    def norm_scale(self) -> float:
        """The factor on the demo's RMSNorm weights: sqrt(D / D')."""
        return math.sqrt(self.demo.dim / self.wide.dim)

    @functools.cached_property
    def head_rows(self) -> Tensor:
        """The wide rows of q, k and v (and columns of ``wo``) holding the demo's head dims, in
        the demo's order: pair p of head h at the wide head h's pair ``ratio * p``."""
        rows = []
        for head in range(self.demo.n_head):
            for d in range(self.demo.head_dim):
                pair = self.ratio * (d // 2) + (self.mistake == "rope" and d // 2 == 1)
                rows.append(head * self.wide.head_dim + 2 * pair + d % 2)
        return torch.tensor(rows)

    @functools.cached_property
    def blank_rows(self) -> Tensor:
        """The rows of the demo's wide heads outside :attr:`head_rows`, where q is zero."""
        free = torch.ones(self.demo.n_head * self.wide.head_dim, dtype=torch.bool)
        free[self.head_rows] = False
        return free.nonzero().squeeze(1)


class Spec(NamedTuple):
    """A tensor of a weights file: its name, shape, and how to make it (when it is written)."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], Tensor]


Shape = tuple[int, ...]


def _rand(g: torch.Generator, shape: Shape) -> Tensor:
    return torch.randn(shape, generator=g) * STD


# The makers of :class:`Spec` tensors: each takes the tensor's shape last (:func:`_spec` passes it).


def _pad(demo: Tensor, shape: Shape) -> Tensor:
    """``demo`` [..., D] in the first D columns, zeros after (a residual writer)."""
    out = torch.zeros(shape)
    out[..., : demo.shape[-1]] = demo
    return out


def _reads(g: torch.Generator, demo: Tensor | None, rows: Tensor | slice, shape: Shape) -> Tensor:
    """A matrix reading the residual: random, with ``demo`` at ``rows`` and the first D columns."""
    out = _rand(g, shape)
    if demo is not None:
        out[rows, : demo.shape[1]] = demo
    return out


def _writes(demo: Tensor | None, cols: Tensor | slice, shape: Shape) -> Tensor:
    """A matrix writing to the residual: zero, with ``demo`` in the first D rows at ``cols``."""
    out = torch.zeros(shape)
    if demo is not None:
        out[: demo.shape[0], cols] = demo
    return out


def _norm(g: torch.Generator, w: Widening, demo: Tensor | None, shape: Shape) -> Tensor:
    """RMSNorm weights: the demo's times sqrt(D / D'), random around 1 elsewhere."""
    out = 1 + 0.1 * torch.randn(shape, generator=g)
    if demo is not None:
        out[: demo.shape[0]] = demo * w.norm_scale
    return out


def _heads(g: torch.Generator, w: Widening, demo: Tensor | None, query: bool, shape: Shape) -> Tensor:
    """A q, k or v projection [n_head' x 64, D']: the demo's heads at :attr:`Widening.head_rows`
    (q scaled by sqrt(ratio), and zero in the demo's columns of those heads' other rows), random
    elsewhere."""
    if demo is not None and query and w.mistake != "q_scale":
        demo = demo * math.sqrt(w.ratio)
    out = _reads(g, demo, w.head_rows, shape)
    if demo is not None and query:
        out[w.blank_rows, : demo.shape[1]] = 0
    return out


def _qkv(g: torch.Generator, w: Widening, demo: Tensor | None, shape: Shape) -> Tensor:
    """LlamaGen's joined ``wqkv``: the q, k and v projections' rows stacked (an extra layer's
    ``demo`` None: random q and k, zero v)."""
    third = (shape[0] // 3, shape[1])
    if demo is None:  # an extra layer: v zero, so that its attention adds exactly 0
        return torch.cat([_rand(g, third), _rand(g, third), torch.zeros(third)])
    return torch.cat([_heads(g, w, part, i == 0, third) for i, part in enumerate(demo.chunk(3))])


def _fc(g: torch.Generator, w: Widening, demo: Tensor, shape: Shape) -> Tensor:
    """The drafter's input fusion [D', 2D'] over (embedding, hidden): the demo's blocks in the
    first D rows, zero rows after, random columns for the extra input dims."""
    d, wide = w.demo.dim, w.wide.dim
    out = _rand(g, shape)
    out[d:] = 0
    out[:d, :d] = demo[:, :d]
    out[:d, wide : wide + d] = demo[:, d:]
    return out


def _spec(name: str, shape: Shape, make: Callable[..., Tensor], *args: object) -> Spec:
    return Spec(name, shape, functools.partial(make, *args, shape))


def target_specs(w: Widening, demo: dict[str, Tensor], g: torch.Generator) -> list[Spec]:
    """The wide target's tensors in LlamaGen's names, from the demo's state ``demo``."""
    dim, ffn, vocab = w.wide.dim, w.wide.ffn_hidden, w.wide.vocab_size
    qkv = ((w.wide.n_head + 2 * w.wide.kv_heads) * w.wide.head_dim, dim)
    tokens, classes = demo["tok_embeddings.weight"], demo["cls_embedding.embedding_table.weight"]
    specs = [
        _spec("tok_embeddings.weight", (vocab, dim), _pad, tokens),
        _spec("cls_embedding.embedding_table.weight", (classes.shape[0], dim), _pad, classes),
    ]
    units, heads = slice(0, w.demo.ffn_hidden), w.head_rows
    for i in range(w.wide.n_layer):
        p = f"layers.{i}."
        old = {k.removeprefix(p): v for k, v in demo.items() if k.startswith(p)}.get  # None: an extra layer
        if old("attention.wqkv.weight") is None:  # zero v and w3: random wo and w2 add exactly 0
            wo, w3 = _spec(p + "attention.wo.weight", (dim, dim), _rand, g), (torch.zeros, ())
            w2 = _spec(p + "feed_forward.w2.weight", (dim, ffn), _rand, g)
        else:
            wo = _spec(p + "attention.wo.weight", (dim, dim), _writes, old("attention.wo.weight"), heads)
            w3 = (_reads, (g, old("feed_forward.w3.weight"), units))
            w2 = _spec(
                p + "feed_forward.w2.weight", (dim, ffn), _writes, old("feed_forward.w2.weight"), units
            )
        specs += [
            _spec(p + "attention_norm.weight", (dim,), _norm, g, w, old("attention_norm.weight")),
            _spec(p + "attention.wqkv.weight", qkv, _qkv, g, w, old("attention.wqkv.weight")),
            wo,
            _spec(p + "ffn_norm.weight", (dim,), _norm, g, w, old("ffn_norm.weight")),
            _spec(p + "feed_forward.w1.weight", (ffn, dim), _reads, g, old("feed_forward.w1.weight"), units),
            _spec(p + "feed_forward.w3.weight", (ffn, dim), w3[0], *w3[1]),
            w2,
        ]
    return specs + [
        _spec("norm.weight", (dim,), _norm, g, w, demo["norm.weight"]),
        _spec("output.weight", (vocab, dim), _reads, g, demo["output.weight"], slice(None)),
    ]


def drafter_specs(w: Widening, demo: dict[str, Tensor], layers: int, g: torch.Generator) -> list[Spec]:
    """The wide drafter's tensors in the EAGLE names, from the demo drafter's state ``demo``."""
    dim, ffn, width = w.wide.dim, w.wide.ffn_hidden, w.wide.n_head * w.wide.head_dim
    embed = demo["embed_tokens.weight"]
    specs = [
        _spec("embed_tokens.weight", (embed.shape[0], dim), _pad, embed),
        _spec("fc.weight", (dim, 2 * dim), _fc, g, w, demo["fc.weight"]),
        _spec("fc.bias", (dim,), _pad, demo["fc.bias"]),
    ]
    units, heads = slice(0, w.demo.ffn_hidden), w.head_rows
    for i in range(layers):
        p = f"layers.{i}."
        old = {k.removeprefix(p): v for k, v in demo.items() if k.startswith(p)}
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            if name in old:  # EAGLE's layer 0 has no input norm
                specs.append(_spec(p + name, (dim,), _norm, g, w, old[name]))
        for x in ("q", "k", "v"):
            name = f"self_attn.{x}_proj.weight"
            specs.append(_spec(p + name, (width, dim), _heads, g, w, old[name], x == "q"))
        o_proj = "self_attn.o_proj.weight"
        specs += [
            _spec(p + o_proj, (dim, width), _writes, old[o_proj], heads),
            _spec(p + "mlp.gate_proj.weight", (ffn, dim), _reads, g, old["mlp.gate_proj.weight"], units),
            _spec(p + "mlp.up_proj.weight", (ffn, dim), _reads, g, old["mlp.up_proj.weight"], units),
            _spec(p + "mlp.down_proj.weight", (dim, ffn), _writes, old["mlp.down_proj.weight"], units),
        ]
    return specs


def write_safetensors(path: Path, specs: list[Spec]) -> int:
    """Write fp32 tensors as a safetensors file, each made as it is written, so that memory holds
    one tensor rather than the file; returns the bytes written."""
    header, offset = {}, 0
    for spec in specs:
        size = 4 * math.prod(spec.shape)
        header[spec.name] = {
            "dtype": "F32",
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for spec in specs:
            tensor = spec.make().contiguous()
            assert tensor.dtype == torch.float32 and tuple(tensor.shape) == spec.shape, spec.name
            f.write(tensor.numpy().data)
    return 8 + len(head) + offset


def write_widened(out: Path, size: str, seed: int = DEFAULT_SEED, mistake: str | None = None) -> Path:
    """Write the demo widened to ``size`` (a :data:`~lantern_rt.sized_demo.sizes.SIZES` name) as a
    model directory at ``out`` (whole or not at all; one there is replaced): the wide target
    and drafter in fp32, the demo's tokenizer and neighbour table, its config with the GPT
    shape changed. ``mistake`` (tests only) plants one of :data:`MISTAKES`."""
    md = open_model_dir(DEMO_DIR)
    w = Widening(md.gpt, size, mistake)
    target = load_target(md).state_dict()
    drafter = load_drafter(md)
    drafter_config = dataclasses.replace(
        drafter.config,
        hidden_size=w.wide.dim,
        num_attention_heads=w.wide.n_head,
        num_key_value_heads=None,
        intermediate_size=w.wide.ffn_hidden,
        rms_norm_eps=drafter.config.rms_norm_eps * w.eps_scale,
    )
    files = {
        "gpt": "gpt.safetensors",
        "vq": "vq.safetensors",
        "neighbors": "neighbors.npy",
        "drafter": "drafter",
    }
    config = md.raw | {
        "name": f"{md.name}-{size}",
        "gpt": to_dict(w.wide),
        "files": files,
        "widened": {"from": md.name, "size": size, "seed": seed},
    }
    g = torch.Generator().manual_seed(seed)
    with staged_folder(Path(out), "the model directory") as tmp:
        (tmp / files["drafter"]).mkdir()
        write_safetensors(tmp / files["gpt"], target_specs(w, target, g))
        specs = drafter_specs(w, drafter.state_dict(), drafter_config.num_hidden_layers, g)
        write_safetensors(tmp / files["drafter"] / "drafter.safetensors", specs)
        body = json.dumps(dataclasses.asdict(drafter_config), indent=2) + "\n"
        (tmp / files["drafter"] / "config.json").write_text(body)
        shutil.copyfile(md.path("vq"), tmp / files["vq"])
        shutil.copyfile(md.path("neighbors"), tmp / files["neighbors"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)
