"""A decode step's masks and static tables, against element-by-element references: the attention
mask from cache lengths (one comparison of a key row against each row's length) and the
drafter's per-level shortcuts for levels that take every draw and every parent in order."""

from __future__ import annotations

import pytest
import torch

from lantern_rt.runtime.drafting import draft_plan
from lantern_rt.runtime.kv_cache import cache_mask
from lantern_rt.runtime.tree import load_tree


def reference_mask(length, capacity, new_mask, rows, prefix):
    """cache_mask written out entry by entry (docs/method.md §3, §7, §9)."""
    images, s = length.shape[0], new_mask.shape[-1]
    out = torch.zeros(rows, 1, s, capacity + s, dtype=torch.bool)
    for row in range(rows):
        b = row % images
        new = new_mask if new_mask.dim() == 2 else new_mask[b]
        for i in range(s):
            for j in range(capacity + s):
                seen = j < length[b] if j < capacity else bool(new[i, j - capacity])
                hidden = prefix is not None and j < prefix.shape[1] and not prefix[row, j]
                out[row, 0, i, j] = seen and not hidden
    return out


@pytest.mark.parametrize("per_image", [False, True])
@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_cache_mask_matches_entry_by_entry_reference(per_image, guided, with_prefix):
    g = torch.Generator().manual_seed(int(per_image) * 4 + int(guided) * 2 + int(with_prefix))
    for _ in range(5):
        images, s, capacity = 3, 4, 9
        length = torch.randint(0, capacity, (images,), generator=g)
        shape = (images, s, s) if per_image else (s, s)
        new_mask = torch.rand(shape, generator=g) < 0.5
        rows = 2 * images if guided else images
        prefix = torch.rand(rows, 3, generator=g) < 0.6 if with_prefix else None
        got = cache_mask(length, capacity, new_mask, rows, prefix)
        assert got.dtype == torch.bool
        assert torch.equal(got, reference_mask(length, capacity, new_mask, rows, prefix))


@pytest.mark.parametrize("name", ["chain-5", "mc_sim_7b_63", "naive_extend_57"])
def test_draft_levels_skip_gathers_only_where_they_are_the_identity(name):
    tree = load_tree(name)
    plan = draft_plan(tree, torch.device("cpu"))
    for depth, level in enumerate(plan.levels, start=1):
        above = len(tree.levels[depth - 1])
        assert level.every_draw == torch.equal(level.pick, torch.arange(above * tree.width))
        assert level.every_parent == torch.equal(level.parents, torch.arange(above))
    chain = name.startswith("chain")
    assert all(level.every_draw and level.every_parent for level in plan.levels) == chain
