"""The target: a class- or text-conditional GPT in LlamaGen's exact parameter layout.

Parameter names match LlamaGen's ``autoregressive/models/gpt.py`` so its released checkpoints
load strictly. The forward pass is written as a pure step function for the runtime:
(embeddings, rope rows, mask, past K/V) -> (logits, hidden, new K/V); caches live outside.
The Chameleon family runs as this model too (``model_type="chameleon"``: a prompt-token
prefix, 1D RoPE, per-head q/k norms), converted from its Hugging Face layout by
:mod:`lantern_rt.families.chameleon.convert` (docs/method.md §10).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lantern_rt.models.config import ConfigError, GPTConfig

# Rows of zero rotation appended after the image grid so that tree nodes drafted past the last
# image token still index the table (such nodes are never committed).
ROPE_PAD_ROWS = 32


def rope_table_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int) -> Tensor:
    """LlamaGen's 2D RoPE table [cls + grid^2 + pad, head_dim/2, 2] of (cos, sin).

    The condition prefix rows are all zero (LlamaGen zeroes q and k there, it does not use the
    identity rotation); the first half of each head rotates with the row, the second with the
    column.
    """
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    t = torch.arange(grid_size, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    grid = torch.cat(
        [freqs[:, None, :].expand(-1, grid_size, -1), freqs[None, :, :].expand(grid_size, -1, -1)],
        dim=-1,
    )
    cache = torch.stack([torch.cos(grid), torch.sin(grid)], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(cls_token_num, half, 2), cache, torch.zeros(ROPE_PAD_ROWS, half, 2)])


def rope_table_1d(rows: int, head_dim: int, base: float) -> Tensor:
    """1D RoPE [rows + pad, head_dim/2, 2] of (cos, sin) for positions 0.., in the interleaved-pair
    layout of :func:`rope_table_2d` (pair j turns by position * base^(-2j/head_dim)); the
    Chameleon family rotates every position, its prompt included."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(rows + ROPE_PAD_ROWS, dtype=torch.float32), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


# What a forbidden token's logit becomes: finite, so that CFG's u + s (c - u) of two forbidden
# rows stays forbidden (-inf - -inf would be NaN) and a temperature cannot overflow it.
FORBIDDEN = -1e9


def layout_logits(logits: Tensor, positions: Tensor, config: GPTConfig) -> Tensor:
    """fp32 ``logits`` [..., S, V] at ``positions`` [S] or [B, S] under the config's image layout:
    with ``row_end`` (Lumina-mGPT), the token after position p is forced to the end-of-row
    token (the last entry) when it ends a grid row and barred from it otherwise, so it is
    never drawn, drafted or accepted elsewhere (docs/method.md §10); other layouts as they are."""
    if not config.row_end:
        return logits
    g, v = config.grid_size, logits.shape[-1]
    forced = ((positions + 1 - config.cls_token_num) % (g + 1) == g)[..., None]  # [.., S, 1]
    row_end = torch.arange(v, device=logits.device) == v - 1
    return logits.masked_fill(forced != row_end, FORBIDDEN)


def grid_codes(tokens: Tensor, config: GPTConfig) -> Tensor:
    """An image's tokens [N, block_size] -> its VQ codes [N, grid^2] (the row-end tokens dropped)."""
    if not config.row_end:
        return tokens
    g = config.grid_size
    return tokens.reshape(tokens.shape[0], g, g + 1)[:, :, :g].reshape(tokens.shape[0], g * g)


def rope_table(config: GPTConfig) -> Tensor:
    """The RoPE table of a target config (and of its drafter): 1D or LlamaGen's 2D."""
    if config.rope_1d:
        return rope_table_1d(config.cls_token_num + config.block_size, config.head_dim, config.rope_base)
    return rope_table_2d(config.grid_size, config.head_dim, config.rope_base, config.cls_token_num)


def rope_rows(table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of a RoPE ``table`` [rows, D/2, 2] at ``positions`` [S] or [B, S], gathered once
    per step for every layer: (cos [.., S, 1, D/2, 1], signed sin [.., S, 1, D/2, 2]) in the
    layout :func:`apply_rope` broadcasts over the heads. Per pair (x0, x1) the rotation is
    (x0 c - x1 s, x1 c + x0 s) = x c + flip(x) (-s, s)."""
    rows = table[positions].unsqueeze(-3)
    sin = rows[..., 1:]
    return rows[..., :1], torch.cat([-sin, sin], dim=-1)  # no host tensor: CUDA graphs capture it


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate interleaved pairs of ``x`` [B, S, H, D] by :func:`rope_rows`' (cos, sin), in fp32:
    the same products and sums as LlamaGen's complex rotation, in four kernels."""
    cos, sin = rope
    xf = x if x.dtype == torch.float32 else x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    out = (pairs * cos + pairs.flip(-1) * sin).flatten(-2)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def attention_heads(
    module: nn.Module, qkv: Tensor, n_head: int, n_kv: int, rope: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """The output of an attention ``module``'s fused q/k/v product, [B, S, (n_head + 2 n_kv) *
    head_dim], as q [B, n_head, S, D], k and v [B, n_kv, S, D]: q and k through the module's
    ``q_norm``/``k_norm`` when it has them, then rotated by ``rope``."""
    b, s, width = qkv.shape
    heads = n_head + 2 * n_kv
    qk, v = qkv.view(b, s, heads, width // heads).split([n_head + n_kv, n_kv], dim=2)
    if hasattr(module, "q_norm"):
        q, k = qk.split([n_head, n_kv], dim=2)
        qk = torch.cat([module.q_norm(q), module.k_norm(k)], dim=2)
    q, k = apply_rope(qk, rope).transpose(1, 2).split([n_head, n_kv], dim=1)
    return q, k, v.transpose(1, 2)


def attention_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool attention ``mask`` (True: attend) as the additive bias scaled dot-product attention
    makes of it (0 or -inf), built once per step instead of once per layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        if xf.is_cuda:  # one fused kernel there; on the CPU rms_norm runs more kernels than this
            out = F.rms_norm(xf, xf.shape[-1:], eps=self.eps)
        else:
            out = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return (out if out.dtype == x.dtype else out.to(x.dtype)) * self.weight


# Chameleon's per-head q/k LayerNorm uses a fixed epsilon, not the model's norm epsilon.
QK_NORM_EPS = 1e-5


class QKNorm(nn.Module):
    """Chameleon's per-head LayerNorm: statistics over head_dim, then a per-head weight and bias
    [H, D]. Also loads Lumina-mGPT's per-shard layout [model_parallel_size, D] (shard ``s``
    covering heads ``s * H/mp ...``) by repeating each shard's row."""

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, head_dim))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        n_heads = self.weight.shape[0]
        for name in ("weight", "bias"):
            value = state_dict.get(prefix + name)
            if isinstance(value, Tensor) and value.dim() == 2 and value.shape[0] != n_heads:
                if value.shape[0] >= 1 and n_heads % value.shape[0] == 0:
                    state_dict[prefix + name] = value.repeat_interleave(n_heads // value.shape[0], dim=0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [..., H, D] -> normalised per head."""
        return F.layer_norm(x, x.shape[-1:], None, None, eps=QK_NORM_EPS) * self.weight + self.bias


def join_linears(module: nn.Module, joined: str, parts: dict[str, int]) -> None:
    """Save and load ``module``'s Linear ``joined`` as the checkpoint's Linears ``parts`` (name ->
    output features, in the order their rows are stacked): one product at run time, the files
    and their keys unchanged (the parts are concatenated once as a state dict loads, split as
    one is saved), so the loaders' strict key and shape checks still name the parts."""
    names, sizes = list(parts), list(parts.values())

    def save(_module: nn.Module, state: dict[str, Tensor], prefix: str, _metadata: object) -> None:
        for kind in ("weight", "bias"):
            value = state.pop(f"{prefix}{joined}.{kind}", None)
            if value is not None:
                for name, piece in zip(names, value.split(sizes), strict=True):
                    state[f"{prefix}{name}.{kind}"] = piece

    def load(_module: nn.Module, state: dict[str, Tensor], prefix: str, *_args: object) -> None:
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in names]
            if all(key in state for key in keys):
                state[f"{prefix}{joined}.{kind}"] = torch.cat([state.pop(key) for key in keys])

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


class FeedForward(nn.Module):
    """SwiGLU; the gate and up projections (LlamaGen's ``w1`` and ``w3``) are one product."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.ffn_dropout = nn.Dropout(dropout)
        join_linears(self, "w13", {"w1": hidden, "w3": hidden})

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.ffn_dropout(self.w2(F.silu(gate) * up))


def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past_k: Tensor | None,
    past_v: Tensor | None,
    mask: Tensor | None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Queries ``q`` [B, H, S, D] over the past K/V [B, Hkv, P, D] (None: P = 0) then the new
    ``k``/``v`` [B, Hkv, S, D], key heads shared by H / Hkv query heads; ``mask`` [B or 1, 1, S,
    P + S], bool (True where attention is allowed) or its :func:`attention_bias` (None: causal
    over the new tokens alone).
    Returns [B, S, H * D]. The one attention of the torch models (target, drafter, Chameleon)."""
    keys = k if past_k is None else torch.cat([past_k, k], dim=2)
    values = v if past_v is None else torch.cat([past_v, v], dim=2)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p
    )
    b, _, s, _ = q.shape
    return out.transpose(1, 2).reshape(b, s, -1)


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        n_head: int,
        n_kv_head: int,
        attn_dropout: float,
        resid_dropout: float,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.dim, self.n_head, self.n_kv_head = dim, n_head, n_kv_head
        self.head_dim = dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        if qk_norm:
            self.q_norm = QKNorm(n_head, self.head_dim)
            self.k_norm = QKNorm(n_kv_head, self.head_dim)
        self.attn_dropout_p = attn_dropout
        self.resid_dropout = nn.Dropout(resid_dropout)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor | None = None,
        past_k: Tensor | None = None,
        past_v: Tensor | None = None,
        cache: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attend ``x`` [B, S, dim] over past K/V [B, Hkv, P, D] plus itself.

        ``rope``: :func:`rope_rows` at the positions of ``x``; ``mask`` [B or 1, 1, S, P + S] is
        True (or 0 in an additive bias) where attention is allowed; None means causal over ``x``
        alone (training). ``cache``: instead of ``past_k``/``past_v``, the layer's K and V [B,
        Hkv, P + S, D] with the past in the first P slots: the new k/v are written into the last
        S slots in place and attention reads the keys and values where they lie (no join).
        Returns (output, k, v) with k/v of the new positions only.
        """
        s = x.shape[1]
        q, k, v = attention_heads(self, self.wqkv(x), self.n_head, self.n_kv_head, rope)
        dropout = self.attn_dropout_p if self.training else 0.0
        if cache is None:
            out = cached_attention(q, k, v, past_k, past_v, mask, dropout)
        else:
            keys, values = cache
            keys[:, :, -s:].copy_(k)
            values[:, :, -s:].copy_(v)
            out = cached_attention(q, keys, values, None, None, mask, dropout)
        return self.resid_dropout(self.wo(out)), k, v


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention = Attention(
            config.dim,
            config.n_head,
            config.kv_heads,
            config.attn_dropout_p,
            config.resid_dropout_p,
            config.qk_norm,
        )
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden, config.ffn_dropout_p)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, rope, mask=None, past_k=None, past_v=None, cache=None):
        a, k, v = self.attention(self.attention_norm(x), rope, mask, past_k, past_v, cache)
        h = x + a
        return h + self.feed_forward(self.ffn_norm(h)), k, v


def random_prefix(g: torch.Generator, rows: int, slots: int) -> Tensor:
    """[rows, slots] bool: per CFG row a random number of leading False (padding) slots, the
    last one always visible (a caption or a prompt has at least its last token)."""
    padding = torch.randint(slots, (rows, 1), generator=g)
    return torch.arange(slots)[None, :] >= padding


class LabelEmbedder(nn.Module):
    """Class id -> one prefix embedding; id ``num_classes`` is the null (unconditional) class."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: Tensor, train: bool = False) -> Tensor:
        if train and self.dropout_prob > 0:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels).unsqueeze(1)

    def condition_input(self, rows: int, slots: int) -> tuple[tuple[int, ...], str]:
        """The shape and dtype of ``rows`` conditions as a graph takes them: one class id each."""
        return (rows,), "int64"

    def random_conditions(
        self, g: torch.Generator, images: int, rows: int, slots: int
    ) -> tuple[Tensor, Tensor]:
        """Random class ids for ``images`` images and (``rows`` = 2 x images) the null class,
        with their prefix visibility [rows, 1] (all visible)."""
        cond = torch.cat(
            [torch.randint(self.num_classes, (images,), generator=g), torch.full((images,), self.num_classes)]
        )
        return cond[:rows], torch.ones(rows, 1, dtype=torch.bool)


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Caption features [B, T, C] -> prefix embeddings; a learned null caption for CFG."""

    def __init__(self, in_channels: int, dim: int, uncond_prob: float, token_num: int):
        super().__init__()
        self.cap_proj = MLP(in_channels, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, in_channels) / in_channels**0.5)
        self.uncond_prob = uncond_prob

    def forward(self, caption: Tensor, train: bool = False) -> Tensor:
        if train and self.uncond_prob > 0:
            drop = torch.rand(caption.shape[0], device=caption.device) < self.uncond_prob
            caption = torch.where(drop[:, None, None], self.uncond_embedding, caption)
        return self.cap_proj(caption)

    def condition_input(self, rows: int, slots: int) -> tuple[tuple[int, ...], str]:
        """The shape and dtype of ``rows`` conditions as a graph takes them: caption features."""
        return (rows, slots, self.uncond_embedding.shape[1]), "float32"

    def random_conditions(
        self, g: torch.Generator, images: int, rows: int, slots: int
    ) -> tuple[Tensor, Tensor]:
        """Random caption features for ``images`` images and (``rows`` = 2 x images) the null
        caption, each row with a random left padding (:func:`random_prefix`)."""
        captions = torch.randn(images, slots, self.uncond_embedding.shape[1], generator=g)
        null = self.uncond_embedding.float().cpu().expand(images, -1, -1)
        return torch.cat([captions, null])[:rows], random_prefix(g, rows, slots)


class PromptEmbedder(nn.Embedding):
    """Prompt token ids [B, T] -> prefix embeddings [B, T, dim] (the Chameleon family's prefix:
    its full text-and-image vocabulary; the image tokens' own rows are ``tok_embeddings``)."""

    def forward(self, ids: Tensor, train: bool = False) -> Tensor:  # type: ignore[override]
        return super().forward(ids)

    def condition_input(self, rows: int, slots: int) -> tuple[tuple[int, ...], str]:
        """The shape and dtype of ``rows`` conditions as a graph takes them: prompt token ids."""
        return (rows, slots), "int64"

    def random_conditions(
        self, g: torch.Generator, images: int, rows: int, slots: int
    ) -> tuple[Tensor, Tensor]:
        """Random prompt rows (an unconditional row is a prompt too), each with a random left
        padding (:func:`random_prefix`)."""
        return torch.randint(self.num_embeddings, (rows, slots), generator=g), random_prefix(g, rows, slots)


class Transformer(nn.Module):
    """LlamaGen's GPT (c2i or t2i), or a converted Chameleon-family model, with a pure,
    cache-external step function."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        if config.model_type == "c2i":
            self.cls_embedding: nn.Module = LabelEmbedder(
                config.num_classes, config.dim, config.class_dropout_prob
            )
        elif config.model_type == "chameleon":
            self.cls_embedding = PromptEmbedder(config.text_vocab_size, config.dim)
        else:
            self.cls_embedding = CaptionEmbedder(
                config.caption_dim, config.dim, config.class_dropout_prob, config.cls_token_num
            )
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.tok_dropout = nn.Dropout(config.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("freqs_cis", rope_table(config), persistent=False)
        self.apply(self._init_weights)
        nn.init.zeros_(self.output.weight)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()

    @property
    def null_condition(self) -> Tensor:
        """The unconditional condition for one row: the null class id or the null caption (a
        Chameleon model's unconditional row is a prompt: :mod:`lantern_rt.families.chameleon.prompts`)."""
        if self.config.model_type == "chameleon":
            raise ConfigError(
                "a Chameleon-family model's unconditional row is a prompt, not a null condition"
            )
        if self.config.model_type == "c2i":
            return torch.tensor(self.config.num_classes, device=self.output.weight.device)
        return self.cls_embedding.uncond_embedding

    def embed_condition(self, cond: Tensor) -> Tensor:
        """Class ids [B], caption features [B, T, C] or prompt token ids [B, T] -> prefix
        embeddings [B, cls_token_num, dim]."""
        return self.cls_embedding(cond, train=False)[:, : self.config.cls_token_num]

    def step(
        self,
        h: Tensor,
        positions: Tensor,
        mask: Tensor,
        past_k: Tensor | Sequence[Tensor] | None,
        past_v: Tensor | Sequence[Tensor] | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One decode call over new embeddings ``h`` [B, S, dim] at ``positions`` [S] or [B, S].

        ``past_k``/``past_v``: [n_layer, B, Hkv, P, D] (or each layer's [B, Hkv, P, D] in a
        sequence: no stacked copy of a large cache), or None for an empty cache (P = 0);
        ``mask``: bool [B or 1, 1, S, P + S]. Returns fp32 logits [B, S, V], the final-norm
        hidden state [B, S, dim] and the new keys/values [n_layer, B, Hkv, S, D] of these S
        positions.
        """
        rope, bias = rope_rows(self.freqs_cis, positions), attention_bias(mask, h.dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            past = (None, None) if past_k is None or past_v is None else (past_k[i], past_v[i])
            h, k, v = layer(h, rope, bias, *past)
            new_k.append(k)
            new_v.append(v)
        hidden = self.norm(h)
        return self.logits(hidden, positions), hidden, torch.stack(new_k), torch.stack(new_v)

    def step_in_place(
        self,
        h: Tensor,
        positions: Tensor,
        mask: Tensor,
        cache_k: tuple[Tensor, ...],
        cache_v: tuple[Tensor, ...],
    ) -> tuple[Tensor, Tensor]:
        """:meth:`step` over a cache the new keys/values are written into: ``cache_k``/``cache_v``
        hold per layer [B, Hkv, P + S, D] (views of the runtime's cache: the window, then S
        free slots); each layer writes its S new K/V into the last S slots before attending over
        all P + S in place (docs/method.md §6). Same numbers as :meth:`step` (keys in the same
        order); returns the fp32 logits [B, S, V] and the final-norm hidden state [B, S, dim]."""
        rope, bias = rope_rows(self.freqs_cis, positions), attention_bias(mask, h.dtype)
        for layer, k, v in zip(self.layers, cache_k, cache_v, strict=True):
            h, _, _ = layer(h, rope, bias, cache=(k, v))
        hidden = self.norm(h)
        return self.logits(hidden, positions), hidden

    def logits(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """fp32 logits of final-norm ``hidden`` [B, S, dim] at ``positions`` [S] or [B, S],
        under the image layout (:func:`layout_logits`)."""
        return layout_logits(self.output(hidden).float(), positions, self.config)

    def forward(self, idx: Tensor, cond: Tensor, train: bool = False) -> Tensor:
        """Teacher-forced logits as LlamaGen computes them in training.

        ``idx`` [B, T] image tokens (usually all but the last), ``cond`` class ids or captions.
        Returns logits [B, T + 1, V] for the positions that predict image tokens 0..T.
        """
        hidden = self.hidden_states(idx, cond, train)
        return self.output(hidden).float()[:, self.config.cls_token_num - 1 :]

    def hidden_states(self, idx: Tensor, cond: Tensor, train: bool = False) -> Tensor:
        """Final-norm hidden states [B, cls + T, dim] of a full causal forward."""
        prefix = self.cls_embedding(cond, train=train)[:, : self.config.cls_token_num]
        h = self.tok_dropout(torch.cat([prefix, self.tok_embeddings(idx)], dim=1))
        rope = rope_rows(self.freqs_cis, torch.arange(h.shape[1], device=h.device))
        for layer in self.layers:
            h, _, _ = layer(h, rope)
        return self.norm(h)
