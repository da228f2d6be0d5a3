"""The key of the suite's store of exported graphs (tests/conftest.py ``graph_store``): equal for
two graph modules that export the same graph, different where the graph differs. A false match
would hand a test another graph's file; a missed one only costs an export."""

from __future__ import annotations

import torch

from lantern_rt.export.graphs import TargetPrefill
from tests.conftest import _fingerprint, tiny_gpt


def key(module: torch.nn.Module) -> str:
    return repr(_fingerprint(module))


def test_two_loads_of_one_model_give_one_key():
    """Two instances of one model (their state-dict hooks keyed by a global count differ, as do
    the ids of every object) give one key, each time it is asked."""
    a, b = TargetPrefill(tiny_gpt(3)), TargetPrefill(tiny_gpt(3))
    assert key(a) == key(b) == key(a)


def test_a_weight_batch_or_model_that_differs_changes_the_key():
    model = tiny_gpt(3)
    base = key(TargetPrefill(model))
    assert key(TargetPrefill(model, batch=2)) != base
    assert key(TargetPrefill(model, guided=False)) != base
    assert key(TargetPrefill(tiny_gpt(4))) != base
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    assert key(TargetPrefill(model)) != base
