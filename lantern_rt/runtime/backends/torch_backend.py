"""The reference backend: the torch model itself, eager or compiled (``torch.compile``), and
replayed from CUDA graphs on a GPU (whole decode steps: ``runtime.decode.StepCache``)."""

from __future__ import annotations

import torch
from torch import Tensor

from lantern_rt.models.config import GPTConfig
from lantern_rt.models.drafter import Drafter
from lantern_rt.models.target import Transformer, layout_logits
from lantern_rt.runtime.acceptance import (
    RelaxInputs,
    TreePlan,
    Verified,
    tree_plan,
    tree_step_inputs,
    verify_tree,
)
from lantern_rt.runtime.backends.base import CatchUp, Draft, DraftOutputs, FilterInputs
from lantern_rt.runtime.drafting import (
    Context,
    DraftPlan,
    DraftStep,
    Head,
    TreeDrafter,
    cfg_pairs,
    draft_plan,
    draft_tree,
    prefix_pairs,
    prompt_pairs,
)
from lantern_rt.runtime.kv_cache import KVCache, cache_windows, prefill_mask
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import cfg_rows
from lantern_rt.runtime.tree import ROOT_ONLY, StaticTree

# The most nodes (the root included) of a tree a torch target verifies unless built for another
# count: the scratch slots its cache keeps after each window (the presets have at most 58; a run
# builds its target for its own tree).
SCRATCH_SLOTS = 64
# A torch target's run shape unless given one: one guided image, its cache read whole.
WHOLE_CACHE = RunShape(cache_windows=1)


class TorchTarget:
    """``TargetBackend`` over a torch ``Transformer`` (any device and dtype): the model's
    ``step_in_place``, which writes the tree's new K/V into the cache's scratch slots and
    attends over the cache where it lies, then :func:`~lantern_rt.runtime.acceptance.verify_tree`
    (``torch.compile`` and CUDA graphs take whole decode steps: ``runtime.decode.StepCache``);
    the commit copies the kept nodes' rows from the scratch slots into place (docs/method.md §6).
    Its cache holds the run ``shape``'s images, each in its two CFG rows or (``guided`` False)
    one (docs/method.md §13), read through ``cache_windows`` windows
    (:func:`~lantern_rt.runtime.kv_cache.cache_windows`; default: the whole cache alone), and
    keeps ``scratch`` slots after each: trees of at most that many nodes, the root included."""

    name = "torch"

    def __init__(
        self,
        model: Transformer,
        shape: RunShape = WHOLE_CACHE,
        *,
        scratch: int = SCRATCH_SLOTS,
    ):
        cfg = model.config
        capacity = cfg.cls_token_num + cfg.block_size
        self.model = model
        self.cls_token_num = cfg.cls_token_num
        weight = model.output.weight
        self.cache = KVCache(
            cfg.n_layer,
            cfg.kv_heads,
            capacity,
            cfg.head_dim,
            weight.dtype,
            weight.device,
            shape,
            prefix=cfg.cls_token_num,
            windows=cache_windows(capacity, shape.cache_windows),
            scratch=scratch,
            layer_tensors=True,
        )
        self._tables: dict[tuple, tuple[TreePlan, Tensor, Tensor]] = {}  # by paths: plan, depth, mask
        self.tables(ROOT_ONLY)

    def tables(self, tree: StaticTree) -> tuple[TreePlan, Tensor, Tensor]:
        """``tree``'s plan, depths and mask on the cache's device, built on first use; a compiled
        step reads them built (the root-only tree's are built with the target, a drafting tree's
        by the step's eager first run: ``runtime.backends.compiled``)."""
        tables = self._tables.get(tree.paths)
        if tables is None:
            device = self.cache.length.device
            tables = self._tables[tree.paths] = (
                tree_plan(tree, device),
                tree.depth.to(device),
                tree.mask.to(device),
            )
        return tables

    @torch.no_grad()
    def prefill(
        self, cond: Tensor, prefix: Tensor | None = None, fresh: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        h = self.model.embed_condition(cond)
        prefix = self.cache.visible(prefix)
        positions = torch.arange(h.shape[1], device=h.device)
        logits, hidden, k, v = self.model.step(h, positions, prefill_mask(prefix), None, None)
        self.cache.restart(k, v, fresh, prefix)
        return logits[:, -1], hidden

    @torch.no_grad()
    def verify(
        self,
        tree: StaticTree,
        draft: Draft,
        noise: Tensor,
        bonus_noise: Tensor,
        sampling: FilterInputs,
        relax: RelaxInputs,
    ) -> Verified:
        plan, depth, tree_mask = self.tables(tree)
        cache = self.cache
        positions, mask = tree_step_inputs(
            depth, tree_mask, cache.length, cache.window, cache.rows, cache.prefix
        )
        h = self.model.tok_embeddings(cfg_rows(draft.tokens, cache.rows))
        logits, hidden = self.model.step_in_place(h, positions, mask, *cache.in_place(h.shape[1]))
        return verify_tree(
            plan,
            logits,
            hidden,
            None,
            None,
            draft.tokens,
            draft.valid,
            draft.q,
            noise,
            bonus_noise,
            sampling,
            relax,
        )


def drafter_step(drafter: Drafter) -> DraftStep:
    """The drafter's own ``step`` as a ``DraftStep``; the context blocks are joined (copies:
    this is the reference the graphs are checked against)."""

    def step(
        tokens: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor, context: Context | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        pairs = cfg_pairs(tokens, hidden.shape[0])
        if context is None:
            return drafter.step(pairs, hidden, positions, mask, None, None)
        past_k = torch.stack([torch.cat(blocks, dim=2) for blocks in context.keys])
        past_v = torch.stack([torch.cat(blocks, dim=2) for blocks in context.values])
        return drafter.step(pairs, hidden, positions, mask, past_k, past_v)

    return step


def lm_head(head: torch.nn.Linear, layout: GPTConfig) -> Head:
    """The target's LM head with fp32 logits under the image layout of the target config
    ``layout`` (:func:`~lantern_rt.models.target.layout_logits`), as ``draft_tree`` takes it."""
    return lambda hidden, positions: layout_logits(head(hidden).float(), positions, layout)


class TorchDrafter(TreeDrafter):
    """A :class:`TreeDrafter` over a torch ``Drafter`` and the target's final LM head:
    ``draft_tree`` run eagerly with the drafter's own ``step``; its cache keeps which of
    its first ``prefix`` slots (the condition prefix's pairs) each row sees; ``layout`` is the
    target's config when its image layout forces tokens
    (:func:`~lantern_rt.models.target.layout_logits`); the cache holds the run ``shape``'s
    images, one row each when not ``guided`` (docs/method.md §13)."""

    name = "torch"

    def __init__(
        self,
        drafter: Drafter,
        head: torch.nn.Linear,
        capacity: int,
        shape: RunShape = RunShape(),
        *,
        prefix: int = 0,
        layout: GPTConfig | None = None,
    ):
        c = drafter.config
        self.drafter, self.head = drafter, head
        self.vocab_size = head.out_features
        weight = drafter.fc.weight
        self.cache = KVCache(
            c.num_hidden_layers,
            c.kv_heads,
            capacity,
            c.head_dim,
            weight.dtype,
            weight.device,
            shape,
            prefix=prefix,
        )
        self._step, self._head = drafter_step(drafter), lm_head(head, layout or GPTConfig())
        self._plans: dict[tuple, DraftPlan] = {}  # by tree paths, built on first use

    def plan(self, tree: StaticTree) -> DraftPlan:
        """``tree``'s drafting tables on the cache's device (a compiled step reads them built:
        ``runtime.backends.compiled``)."""
        found = self._plans.get(tree.paths)
        if found is None:
            found = self._plans[tree.paths] = draft_plan(tree, self.cache.k.device)
        return found

    @torch.no_grad()
    def prefill(self, hidden: Tensor, fresh: Tensor, cond: Tensor, prefix: Tensor) -> None:
        if not hidden.shape[1]:
            self.cache.length.masked_fill_(fresh, 0)
        elif not self.drafter.takes_prompts:
            self.cache.restart(*prefix_pairs(self._step, hidden), fresh)
        else:
            k, v, visible = prompt_pairs(self._step, hidden, self.drafter.embed_prompt, cond, prefix)
            self.cache.restart(k, v, fresh, visible)

    @torch.no_grad()
    def draft(self, tree: StaticTree, rows: CatchUp, noise: Tensor, sampling: FilterInputs) -> DraftOutputs:
        context = Context.of_cache(self.cache.layers_k, self.cache.layers_v)
        return draft_tree(self._step, self._head, self.plan(tree), rows, context, noise, sampling)
