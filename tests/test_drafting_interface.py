"""The decode loop drafts through one interface, ``runtime.backends.base.Drafter`` (propose,
verify and accept, record): the drafter models (``drafting.TreeDrafter``, the base of the drafter
backends) and the Jacobi window implement it, and the loop never tells one from another."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from lantern_rt.runtime import decode
from lantern_rt.runtime.backends.base import Drafter
from lantern_rt.runtime.drafting import TreeDrafter
from lantern_rt.runtime.jacobi import JacobiDrafter

# what decode.py may test with isinstance: its step wrappers, a job source, a condition
NOT_DRAFTERS = {"CudaGraphed", "Compiled", "JobSource", "Condition"}
DRAFTER_MODULES = {"lantern_rt.runtime.jacobi", "lantern_rt.runtime.drafting"}
MEMBERS = ("state", "noise_rows", "prefill", "propose", "record")


def test_the_decode_loop_tells_no_drafter_apart():
    """decode.py imports no drafter module and tests no drafter's type: every ``isinstance`` in
    it is about something else, and no drafter class is named."""
    tree = ast.parse(Path(decode.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not {node.module for node in imports} & DRAFTER_MODULES
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not {n for n in names if n.endswith("Drafter") and n != "Drafter"}
    tested = {
        ast.unparse(call.args[1])
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "isinstance"
    }
    assert tested <= NOT_DRAFTERS, tested - NOT_DRAFTERS


@pytest.mark.parametrize("cls", [TreeDrafter, JacobiDrafter])
def test_both_drafters_implement_the_interface(cls):
    """Each member of ``Drafter``, with its parameters by the same names."""
    for name in MEMBERS:
        want, got = getattr(Drafter, name), getattr(cls, name)
        if isinstance(want, property):
            assert isinstance(got, property), name
        else:
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
