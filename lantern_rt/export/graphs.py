"""The exported graphs: pure, fixed-shape wrappers around the target, the drafter and the VQ decoder.

Each wrapper declares its inputs and outputs once, as a :class:`GraphSpec`, and makes random
valid inputs for the numerical check. Shapes follow the runtime's contract: a fixed batch of B
images in 2B CFG rows (``sampling.cfg_rows``: the conditional rows, then the unconditional
ones; B rows when exported without guidance, docs/method.md §13), per-image lengths and positions, a target cache of ``cls_token_num + block_size`` slots, a drafter cache of ``block_size`` slots
(``drafting.drafter_capacity``), and only the new tokens' K/V as outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lantern_rt.bundle import DRAFTER_PREFILL_GRAPH, PREFILL_GRAPH, VQ_DECODE_GRAPH, batched_name
from lantern_rt.export.graph_forward import Blocks, InPlace, rms_norm
from lantern_rt.graph_spec import PRESENT_PREFIX, GraphSpec, TensorSpec, dtype_name
from lantern_rt.models.config import GPTConfig
from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import ROPE_PAD_ROWS, Transformer, grid_codes, random_prefix
from lantern_rt.models.vq import VQModel
from lantern_rt.runtime.acceptance import RelaxInputs, tree_plan, tree_step_inputs, verify_tree
from lantern_rt.runtime.backends.base import CatchUp
from lantern_rt.runtime.backends.torch_backend import drafter_step, lm_head
from lantern_rt.runtime.drafting import (
    Context,
    DraftStep,
    Scratch,
    catch_up_rows,
    cfg_pairs,
    draft_plan,
    draft_tree,
    noise_rows,
    prefix_pairs,
    prompt_pairs,
    scratch_rows,
)
from lantern_rt.runtime.kv_cache import prefill_mask, written_mask
from lantern_rt.runtime.sampling import FilterInputs, SamplingConfig, SamplingRows, cfg_rows, guided_rows
from lantern_rt.runtime.tree import StaticTree


def sampling_specs(batch: int) -> tuple[TensorSpec, ...]:
    """The sampling settings every drafting and verify graph of ``batch`` images takes: each
    image's :class:`~lantern_rt.runtime.sampling.FilterInputs` [B] (sampling.SamplingRows)."""
    settings = example_sampling(batch)._asdict().items()
    return tuple(TensorSpec(name, (batch,), dtype_name(t.dtype)) for name, t in settings)


def example_sampling(batch: int) -> FilterInputs:
    """The numerical check's sampling settings: CFG 3 without filtering, for every image."""
    rows = SamplingRows(batch, torch.device("cpu"))
    rows.write(list(range(batch)), [SamplingConfig(cfg_scale=3.0)] * batch)
    return rows.filters


def cache_capacity(model: Transformer) -> int:
    """Slots in the runtime's KV cache: the condition prefix plus every image token."""
    return model.config.cls_token_num + model.config.block_size


KVDims = tuple[int, int, int]  # layers, kv heads, head dim


def _kv_spec(name: str, dims: KVDims, rows: int, length: int, dtype: torch.dtype) -> TensorSpec:
    layers, heads, head_dim = dims
    return TensorSpec(name, (layers, rows, heads, length, head_dim), dtype_name(dtype))


def _past_specs(dims: KVDims, rows: int, length: int, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
    """One ``past_k_{i}`` input per layer, then one ``past_v_{i}``: [rows, Hkv, length, D] each,
    so that a graph reads each layer's cache in place (a stacked input would be split, a copy)."""
    layers, heads, head_dim = dims
    shape = (rows, heads, length, head_dim)
    return tuple(TensorSpec(f"past_{kv}_{i}", shape, dtype_name(dtype)) for kv in "kv" for i in range(layers))


def _present_specs(past: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """``present_*`` outputs of the ``past_*`` inputs' shapes: the caches a graph writes in
    place (bound to the inputs' memory, onnxruntime only, opset 24)."""
    return tuple(TensorSpec(s.name.replace("past_", PRESENT_PREFIX, 1), s.shape, s.dtype) for s in past)


def _split_past(past: tuple[Tensor, ...]) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer past inputs (all keys, then all values) -> (keys, values)."""
    half = len(past) // 2
    return list(past[:half]), list(past[half:])


def _target_kv(model: Transformer) -> KVDims:
    c = model.config
    return c.n_layer, c.kv_heads, c.head_dim


def _random_cache(g: torch.Generator, specs: tuple[TensorSpec, ...]) -> tuple[Tensor, ...]:
    """Random, partly stale per-layer past K and V of the ``past_*`` specs' shapes and dtype."""
    return tuple(torch.randn(spec.shape, generator=g).to(spec.torch_dtype) for spec in specs)


class TargetPrefill(nn.Module):
    """The 2B condition rows of B images and which prefix slots are visible -> logits at the
    last prefix slot, the hidden states at every prefix slot (the drafter's prefix pairs and
    first catch-up need them) and the prefix K/V (``guided`` False: the B conditional rows
    alone)."""

    def __init__(self, model: Transformer, batch: int = 1, guided: bool = True):
        super().__init__()
        self.model, self.blocks, self.batch = model, Blocks.of_target(model), batch
        c = model.config
        dtype = model.output.weight.dtype
        self.rows = rows = guided_rows(batch, guided)
        t = c.cls_token_num
        cond = TensorSpec("cond", *model.cls_embedding.condition_input(rows, t))
        self.spec = GraphSpec(
            batched_name(PREFILL_GRAPH, batch),
            (cond, TensorSpec("prefix", (rows, t), "bool")),
            (
                TensorSpec("logits", (rows, c.vocab_size), "float32"),
                TensorSpec("hidden", (rows, t, c.dim), dtype_name(dtype)),
                _kv_spec("new_k", _target_kv(model), rows, t, dtype),
                _kv_spec("new_v", _target_kv(model), rows, t, dtype),
            ),
            dtype,
        )

    def forward(self, cond: Tensor, prefix: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if cond.is_floating_point():
            cond = cond.to(self.spec.compute_dtype)
        h = self.model.embed_condition(cond)
        positions = torch.arange(h.shape[1], device=h.device)
        h, k, v = self.blocks(h, positions, prefill_mask(prefix), None)
        hidden = rms_norm(h, self.model.norm)
        return self.model.logits(hidden[:, -1:], positions[-1:])[:, 0], hidden, k, v

    def reference_forward(self, cond: Tensor, prefix: Tensor) -> tuple[Tensor, ...]:
        """The same outputs from the model's own ``step`` (what the graph is checked against)."""
        h = self.model.embed_condition(cond)
        positions = torch.arange(h.shape[1])
        logits, hidden, k, v = self.model.step(h, positions, prefill_mask(prefix), None, None)
        return logits[:, -1], hidden, k, v

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        """Random condition rows plus (guided) the null conditions, and which prefix slots each
        row sees (the condition embedder's :meth:`random_conditions`)."""
        slots = self.model.config.cls_token_num
        return self.model.cls_embedding.random_conditions(g, self.batch, self.rows, slots)


def graph_drafter_step(drafter: Drafter, blocks: Blocks) -> DraftStep:
    """The drafter's step as its graphs compute it: the fused input ``fc(embed(x), h)``, then
    ``blocks`` (its layers written for export); ``drafter_step`` is the torch reference."""

    def step(
        tokens: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor, context: Context | Scratch | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        embedded = drafter.embed(cfg_pairs(tokens, hidden.shape[0]))
        h = drafter.fc(torch.cat([embedded, hidden.to(drafter.fc.weight.dtype)], dim=-1))
        if isinstance(context, Scratch):  # the rows go to the slots after the mask's columns
            written, new = mask.shape[-1], h.shape[1]
            start = torch.full((h.shape[0],), written - new, dtype=torch.long, device=h.device)
            # a Concat with a constant (a Pad costs onnxruntime one node more)
            wide = torch.zeros(*mask.shape[:-1], context.keys[0].shape[2] - written, dtype=torch.bool)
            mask = torch.cat([mask, wide.to(mask.device)], dim=-1)
            return blocks(h, positions, mask, InPlace(context.keys, context.values, start))
        return blocks(h, positions, mask, context)

    return step


class DrafterPrefill(nn.Module):
    """The drafter's K/V over a condition prefix of P > 1 slots
    (:func:`~lantern_rt.runtime.drafting.prefix_pairs`): the target's hidden states at its first
    P - 1 slots -> new K/V for the drafter cache; a prompt-token drafter also takes the prompt
    rows ``cond`` [2B, P] and their visible slots ``prefix`` [2B, P] (the target's inputs);
    ``guided`` False: B rows."""

    def __init__(self, drafter: Drafter, cls_token_num: int, batch: int = 1, guided: bool = True):
        super().__init__()
        self.drafter, self.batch = drafter, batch
        self.blocks = Blocks.of_drafter(drafter)
        c = drafter.config
        dtype = drafter.fc.weight.dtype
        kv = (c.num_hidden_layers, c.kv_heads, c.head_dim)
        count, rows = cls_token_num - 1, guided_rows(batch, guided)
        self.prompt = drafter.takes_prompts
        prompt = (
            (
                TensorSpec("cond", (rows, cls_token_num), "int64"),
                TensorSpec("prefix", (rows, cls_token_num), "bool"),
            )
            if self.prompt
            else ()
        )
        self.spec = GraphSpec(
            batched_name(DRAFTER_PREFILL_GRAPH, batch),
            (TensorSpec("hidden", (rows, count, c.hidden_size), dtype_name(dtype)), *prompt),
            (_kv_spec("new_k", kv, rows, count, dtype), _kv_spec("new_v", kv, rows, count, dtype)),
            dtype,
        )

    def _pairs(self, step: DraftStep, hidden: Tensor, *prompt: Tensor) -> tuple[Tensor, Tensor]:
        if not prompt:
            return prefix_pairs(step, hidden)
        k, v, _ = prompt_pairs(step, hidden, self.drafter.embed_prompt, *prompt)
        return k, v

    def forward(self, hidden: Tensor, *prompt: Tensor) -> tuple[Tensor, Tensor]:
        return self._pairs(graph_drafter_step(self.drafter, self.blocks), hidden, *prompt)

    def reference_forward(self, hidden: Tensor, *prompt: Tensor) -> tuple[Tensor, Tensor]:
        """The same outputs with the drafter's own ``step``."""
        return self._pairs(drafter_step(self.drafter), hidden, *prompt)

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        hidden = torch.randn(self.spec.inputs[0].shape, generator=g).to(self.spec.compute_dtype)
        if not self.prompt:
            return (hidden,)
        rows, slots = self.spec.inputs[1].shape
        cond = torch.randint(self.drafter.prompt_table.shape[0], (rows, slots), generator=g)
        return hidden, cond, random_prefix(g, rows, slots)


class TargetVerify(nn.Module):
    """A target step over a tree's N + 1 nodes followed by its acceptance
    (:func:`~lantern_rt.runtime.acceptance.verify_tree`): the drafted nodes after the committed
    cache length (positions and mask are built in the graph), their valid flags and q, uniform
    noise, the sampling settings and the relaxation -> the accepted length, kept node ids, committed tokens (bonus included),
    the kept nodes' hidden states and K/V, and the logits at every node. The target
    distribution is mixed and filtered in the graph, its top-k/top-p filter behind an If as in
    drafting. ``neighbors`` is the bundle's whole table; ``k`` says how many columns are
    credited. AR's step is this graph over the root-only tree. The graph reads ``window`` slots
    of the cache (default: all of them; docs/method.md §12); ``guided`` False: B rows, no CFG
    mixing (§13).

    ``scratch`` > 0: the graph takes each layer's cache with that many scratch slots after the
    window, writes the nodes' K/V at each image's length (node order; the scratch slots hold
    the ones past the window) and returns the caches (``present_*``, bound to the ``past_*``
    memory: written in place, onnxruntime only, opset 24) instead of the kept nodes' K/V; the
    runtime commits a chain's as written and moves a tree's kept rows (``KVCache.commit``,
    docs/method.md §6)."""

    def __init__(
        self,
        model: Transformer,
        tree: StaticTree,
        neighbors_k: int,
        name: str,
        batch: int = 1,
        window: int | None = None,
        guided: bool = True,
        scratch: int = 0,
    ):
        super().__init__()
        self.model, self.blocks, self.tree, self.batch = model, Blocks.of_target(model), tree, batch
        self.rows = rows = guided_rows(batch, guided)
        self.plan = tree_plan(tree, torch.device("cpu"))
        self.depth, self.tree_mask = tree.depth.clone(), tree.mask.clone()  # built before tracing
        c = model.config
        dtype = model.output.weight.dtype
        self.window = cap = window or cache_capacity(model)
        self.scratch = scratch
        kv = _target_kv(model)
        s, kept, v, b = tree.num_nodes + 1, tree.max_depth + 1, c.vocab_size, batch
        if 0 < scratch < s:
            raise ValueError(
                f"tree {tree.name} has {s} nodes with its root, more than {scratch} scratch slots"
            )
        past = _past_specs(kv, rows, cap + scratch, dtype)
        if scratch:
            kv_out = _present_specs(past)
        else:
            kv_out = (_kv_spec("new_k", kv, rows, kept, dtype), _kv_spec("new_v", kv, rows, kept, dtype))
        self.spec = GraphSpec(
            batched_name(name, batch),
            (
                TensorSpec("node_tokens", (b, s), "int64"),
                TensorSpec("cache_length", (b,), "int64"),
                TensorSpec("prefix", (rows, c.cls_token_num), "bool"),
                TensorSpec("valid", (b, s), "bool"),
                TensorSpec("q", (b, s, v), "float32"),
                TensorSpec("noise", (b, s), "float32"),
                TensorSpec("bonus_noise", (b, v), "float32"),
                *sampling_specs(b),
                TensorSpec("neighbors", (v, neighbors_k), "int64"),
                TensorSpec("k", (1,), "int64"),
                TensorSpec("cap_a", (1,), "float32"),
                TensorSpec("cap_b", (1,), "float32"),
                TensorSpec("greedy", (b,), "bool"),
                *past,
            ),
            (
                TensorSpec("length", (b,), "int64"),
                TensorSpec("kept", (b, kept), "int64"),
                TensorSpec("tokens", (b, kept), "int64"),
                TensorSpec("hidden", (rows, kept, c.dim), dtype_name(dtype)),
                *(() if scratch else kv_out),
                TensorSpec("logits", (rows, s, v), "float32"),
                TensorSpec("probs", (b, s, v), "float32"),
                *(kv_out if scratch else ()),
            ),
            dtype,
        )

    def _inputs(self, inputs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
        """Embedded nodes, positions and mask of the step, and the per-layer past inputs."""
        tokens, length, prefix = inputs[:3]
        positions, mask = tree_step_inputs(self.depth, self.tree_mask, length, self.window, self.rows, prefix)
        return self.model.tok_embeddings(cfg_rows(tokens, self.rows)), positions, mask, inputs[16:]

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        h, positions, mask, past = self._inputs(inputs)
        past_k, past_v = _split_past(past)
        if self.scratch:
            length, prefix = inputs[1], inputs[2]
            width = self.window + self.scratch
            mask = written_mask(length, width, self.tree_mask, self.rows, prefix, self.tree.is_chain)
            start = cfg_rows(length, self.rows)
            h, k, v = self.blocks(h, positions, mask, InPlace(tuple(past_k), tuple(past_v), start))
        else:
            h, k, v = self.blocks(h, positions, mask, Context.of_cache(past_k, past_v))
        hidden = rms_norm(h, self.model.norm)
        return self._accept(self.model.logits(hidden, positions), hidden, k, v, inputs)

    def reference_forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The same outputs from the model's own ``step`` over the window (and, for a graph
        that writes its cache in place, the caches with the new K/V scattered in)."""
        h, positions, mask, past = self._inputs(inputs)
        window = [t[..., : self.window, :] for t in past]
        past_k, past_v = _split_past(tuple(window))
        logits, hidden, k, v = self.model.step(h, positions, mask, past_k, past_v)  # no stacked copy
        if self.scratch:  # the caches with each row's nodes written at its length
            slots = cfg_rows(inputs[1], self.rows)[:, None] + torch.arange(h.shape[1])
            index = slots[:, None, :, None].expand(*k.shape[1:])
            caches = [c.scatter(2, index, new) for c, new in zip(past, (*k, *v), strict=True)]
            return self._accept(logits, hidden, caches[: len(k)], caches[len(k) :], inputs)
        return self._accept(logits, hidden, k, v, inputs)

    def _accept(self, logits: Tensor, hidden: Tensor, k, v, inputs) -> tuple[Tensor, ...]:
        """The graph's outputs: :func:`verify_tree`'s, then (in place) the written caches."""
        tokens, valid, q, noise, bonus_noise = inputs[0], *inputs[3:7]
        sampling, relax = FilterInputs(*inputs[7:11]), RelaxInputs(*inputs[11:16])
        if self.scratch:
            out = verify_tree(
                self.plan, logits, hidden, None, None, tokens, valid, q, noise, bonus_noise, sampling, relax
            )
            return (*out[:4], *out[6:], *k, *v)
        return tuple(
            verify_tree(
                self.plan, logits, hidden, k, v, tokens, valid, q, noise, bonus_noise, sampling, relax
            )
        )

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        """Random nodes after a random committed length per image; random, partly stale caches.
        The noise settles every decision far from a rounding tie, so that the integer outputs
        are compared too: u = 0 accepts every first child (the path of first children is kept)
        and the bonus noise singles out one token per image (a Gumbel score of 16.6 against
        -4.5). LANTERN++ with lambda 3 and CFG 3, sampling without filters."""
        c, tree, b = self.model.config, self.tree, self.batch
        s, v = tree.num_nodes + 1, c.vocab_size
        length = torch.randint(c.cls_token_num, self.window, (b,), generator=g)
        tokens = torch.randint(v, (b, s), generator=g)
        q = torch.softmax(torch.randn(b, s, v, generator=g), dim=-1)
        bonus_noise = torch.zeros(b, v)
        bonus_noise[torch.arange(b), torch.randint(v, (b,), generator=g)] = 1.0 - 2.0**-24
        k = self.spec.inputs[11].shape[1]
        neighbors = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(v)])
        sampling = example_sampling(b)
        relax = (
            torch.tensor([min(k, 10)]),
            torch.tensor([0.0]),
            torch.tensor([2.0]),
            torch.zeros(b, dtype=torch.bool),
        )
        return (
            tokens,
            length,
            random_prefix(g, self.rows, c.cls_token_num),
            torch.ones(b, s, dtype=torch.bool),
            q,
            torch.zeros(b, s),
            bonus_noise,
            *sampling,
            neighbors,
            *relax,
            *_random_cache(g, self.spec.inputs[16:]),
        )


class DrafterTree(nn.Module):
    """``draft_tree`` for one tree as a graph: the catch-up rows, uniform noise and sampling
    settings over the drafter cache -> node tokens, valid, q and the catch-up rows' K/V. The
    drafter's layers and the target's LM head ``head`` are baked in; ``guided`` False: B rows
    (docs/method.md §13).

    ``scratch`` > 0: the graph takes each layer's cache with that many scratch slots after its
    ``capacity``, writes every row it runs the drafter on into them (``drafting.Scratch``:
    catch-up rows, then each level's nodes; at most ``scratch_rows(tree)``) and returns the
    caches (``present_*``, written in place, onnxruntime only, opset 24) instead of the
    catch-up rows' K/V; the runtime moves those rows to each image's length."""

    def __init__(
        self,
        drafter: Drafter,
        head: nn.Linear,
        tree: StaticTree,
        capacity: int,
        name: str,
        batch: int = 1,
        prefix: int = 0,
        layout: GPTConfig | None = None,
        guided: bool = True,
        scratch: int = 0,
    ):
        super().__init__()
        if 0 < scratch < scratch_rows(tree):
            raise ValueError(
                f"drafting tree {tree.name} writes {scratch_rows(tree)} rows, more than {scratch} scratch slots"
            )
        self.drafter, self.head, self.tree, self.batch = drafter, head, tree, batch
        self.capacity, self.scratch = capacity, scratch
        self.rows = guided_rows(batch, guided)
        self.layout = layout or GPTConfig()  # the target's image layout (forced tokens)
        self.prefix = prefix  # the cache's condition-prefix pairs (their visibility is an input)
        self.plan = draft_plan(tree, torch.device("cpu"))
        self.blocks = Blocks.of_drafter(drafter)
        c = drafter.config
        dtype = drafter.fc.weight.dtype
        kv = (c.num_hidden_layers, c.kv_heads, c.head_dim)
        rows, n, b = catch_up_rows(tree), tree.num_nodes + 1, batch
        self.spec = GraphSpec(
            batched_name(name, batch),
            (
                TensorSpec("tokens", (b, rows), "int64"),
                TensorSpec("hidden", (self.rows, rows, c.hidden_size), dtype_name(dtype)),
                TensorSpec("count", (b,), "int64"),
                TensorSpec("root_position", (b,), "int64"),
                TensorSpec("cache_length", (b,), "int64"),
                *((TensorSpec("prefix", (self.rows, prefix), "bool"),) if prefix else ()),
                TensorSpec("noise", (b, noise_rows(tree), c.vocab_size), "float32"),
                *sampling_specs(b),
                *(past := _past_specs(kv, self.rows, capacity + scratch, dtype)),
            ),
            (
                TensorSpec("node_tokens", (b, n), "int64"),
                TensorSpec("valid", (b, n), "bool"),
                TensorSpec("q", (b, n, c.vocab_size), "float32"),
                *(
                    _present_specs(past)
                    if scratch
                    else (
                        _kv_spec("new_k", kv, self.rows, rows, dtype),
                        _kv_spec("new_v", kv, self.rows, rows, dtype),
                    )
                ),
            ),
            dtype,
        )

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        step = graph_drafter_step(self.drafter, self.blocks)
        if not self.scratch:
            return self._draft(step, inputs)
        keys, values = _split_past(inputs[self._past :])
        tokens, valid, q, keys, values = self._draft(
            step, inputs, Scratch(tuple(keys), tuple(values), self.capacity)
        )
        return tokens, valid, q, *keys, *values

    def reference_forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """The same outputs with the drafter's own ``step`` (the torch backend's); for a graph
        that writes its cache in place, the caches with every row the drafter ran on (their K/V
        as that step returned them) in the scratch slots."""
        step = drafter_step(self.drafter)
        if not self.scratch:
            return self._draft(step, inputs)
        rows: list[tuple[Tensor, Tensor]] = []

        def recorded(*args: Tensor | Context | None) -> tuple[Tensor, Tensor, Tensor]:
            h, k, v = step(*args)
            rows.append((k, v))
            return h, k, v

        past = inputs[self._past :]
        window = tuple(t[..., : self.capacity, :] for t in past)
        tokens, valid, q, _, _ = self._draft(recorded, (*inputs[: self._past], *window))
        new_k, new_v = torch.cat([k for k, _ in rows], dim=3), torch.cat([v for _, v in rows], dim=3)
        end = self.capacity + new_k.shape[3]
        caches = [cache.clone() for cache in past]
        for cache, written in zip(caches, (*new_k, *new_v), strict=True):
            cache[..., self.capacity : end, :] = written
        return tokens, valid, q, *caches

    @property
    def _past(self) -> int:
        """The index of the first ``past_*`` input (the sampling settings come before it)."""
        return self._noise + 1 + len(FilterInputs._fields)

    @property
    def _noise(self) -> int:
        """The index of the ``noise`` input (the catch-up rows come before it)."""
        return next(i for i, spec in enumerate(self.spec.inputs) if spec.name == "noise")

    def _draft(
        self, step: DraftStep, inputs: tuple[Tensor, ...], context: Context | Scratch | None = None
    ) -> tuple[Tensor, ...]:
        first = self._noise
        rows = CatchUp(*inputs[:5], inputs[5] if self.prefix else None)
        noise, sampling = inputs[first], FilterInputs(*inputs[first + 1 : self._past])
        if context is None:
            context = Context.of_cache(*_split_past(inputs[self._past :]))
        return draft_tree(step, lm_head(self.head, self.layout), self.plan, rows, context, noise, sampling)

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        """m random pending pairs (left-aligned) after a random committed length, the root at a
        position the RoPE table holds; noise that forces which children are drawn (a large score
        for ``width`` random tokens per node), so that rounding cannot change the path and every
        output is compared; CFG 3 without filtering; random caches."""
        c, b = self.drafter.config, self.batch
        rows = catch_up_rows(self.tree)
        first = self._noise
        length = torch.randint(self.capacity - rows, (b,), generator=g)
        m = torch.randint(1, rows + 1, (b,), generator=g)
        top = self.drafter.freqs_cis.shape[0] - ROPE_PAD_ROWS - 1
        root = torch.randint(rows, top, (b,), generator=g)
        tokens = torch.randint(c.vocab_size, (b, rows), generator=g)
        hidden = torch.randn(self.spec.inputs[1].shape, generator=g).to(self.spec.compute_dtype)
        noise = torch.zeros(self.spec.inputs[first].shape)  # a Gumbel score of -3.8 (clamped)
        forced = 1.0 - 2.0**-24 * torch.arange(1, self.tree.width + 1, dtype=torch.float32)  # 16.6, 15.9, ...
        for row in noise.flatten(0, 1):
            row[torch.randperm(c.vocab_size, generator=g)[: self.tree.width]] = forced
        sampling = example_sampling(b)
        counts = (m, root, length, *((random_prefix(g, self.rows, self.prefix),) if self.prefix else ()))
        past = _random_cache(g, self.spec.inputs[self._past :])
        return (tokens, hidden, *counts, noise, *sampling, *past)


class VQDecode(nn.Module):
    """An image's tokens [B, block_size] -> images [B, C, H, W] (fp32 in and out): the VQ codes
    of the target config ``layout``'s grid (its row-end tokens dropped:
    :func:`~lantern_rt.models.target.grid_codes`), decoded."""

    def __init__(self, vq: VQModel, layout: GPTConfig, batch: int = 1):
        super().__init__()
        self.vq, self.layout, self.grid = vq, layout, layout.grid_size
        c = vq.config
        side = self.grid * c.downsample
        dtype = vq.post_quant_conv.weight.dtype
        self.spec = GraphSpec(
            VQ_DECODE_GRAPH,
            (TensorSpec("codes", (batch, layout.block_size), "int64"),),
            (TensorSpec("images", (batch, c.out_channels, side, side), "float32"),),
            dtype,
        )

    def forward(self, codes: Tensor) -> Tensor:
        return self.vq.decode_code(grid_codes(codes, self.layout), self.grid).float()

    reference_forward = forward

    def example_inputs(self, g: torch.Generator) -> tuple[Tensor, ...]:
        return (torch.randint(self.vq.config.codebook_size, self.spec.inputs[0].shape, generator=g),)


GraphModule = TargetPrefill | TargetVerify | DrafterPrefill | DrafterTree | VQDecode  # and TextEncoderGraph
