"""Reading and writing weights: LlamaGen ``.pt`` files, safetensors, strict key checking."""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lantern_rt.errors import LanternError, first_line
from lantern_rt.fileio import atomic_write


class CheckpointError(LanternError, ValueError):
    """A checkpoint is missing, unreadable, or does not fit the model it is loaded into."""


WRAPPER_KEYS = ("model", "module", "state_dict")


# LlamaGen's train_c2i.py/train_t2i.py save {"model", "optimizer", "steps", "args": argparse.Namespace}
SAFE_GLOBALS = [argparse.Namespace]
_REFUSED = re.compile(r"Unsupported global: GLOBAL (\S+)")


def read_state_dict(path: str | Path, keep: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """Tensors from a ``.safetensors`` file, a torch checkpoint (read with ``weights_only``) or a
    sharded HF checkpoint's ``*.index.json``; with ``keep``, only the keys it accepts (a
    safetensors file reads no others, a sharded one opens only the shards that hold them).

    A torch checkpoint may hold the state dict itself or wrap it under ``model``, ``module``
    or ``state_dict`` (LlamaGen's released files use ``model``; its training checkpoints add
    ``optimizer``, ``steps`` and ``args``, an ``argparse.Namespace``, the one class allowed).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.name.endswith(".index.json"):
        return _read_sharded(path, keep)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys() if keep is None or keep(k)}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    state = _torch_state(path)
    return state if keep is None else {k: v for k, v in state.items() if keep(k)}


def _torch_state(path: Path) -> dict[str, Tensor]:
    obj = torch_load(path)
    if isinstance(obj, dict):
        for key in WRAPPER_KEYS:
            if key in obj and isinstance(obj[key], dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(
            f"{path} holds no state dict (expected tensors, optionally under {WRAPPER_KEYS})"
        )
    return obj


def torch_load(path: Path) -> Any:
    """A torch file read with ``weights_only`` (tensors, containers, numbers, strings and
    :data:`SAFE_GLOBALS`); any other Python object, or an unreadable file, is a one-line
    :class:`CheckpointError` (never torch's advice to unpickle with ``weights_only=False``)."""
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    try:
        with allow(SAFE_GLOBALS) if allow else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error says enough
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # an unpickler fed arbitrary bytes raises anything (KeyError, ...)
        raise CheckpointError(f"cannot read {path}: {_load_failure(exc)}") from None


_ADVICE = (
    "for safety it is not unpickled: save a state dict of tensors (torch.save(model.state_dict(), path))"
    " or convert it to .safetensors"
)


def _load_failure(exc: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line and in our words."""
    refused = _REFUSED.search(str(exc))
    if refused:
        return (
            f"it holds Python objects that are not tensors ({refused[1]}), which weights-only loading refuses;"
            f" {_ADVICE}"
        )
    if isinstance(exc, pickle.UnpicklingError) and "weights_only" in str(exc):
        return f"it is a pickle of Python objects, not tensors, or a corrupt file; {_ADVICE}"
    if isinstance(exc, (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile)):
        return first_line(exc).split(". ")[0]  # torch's next sentences guess at causes
    return f"not a torch checkpoint ({type(exc).__name__}: {first_line(exc)})"


def _read_sharded(index: Path, keep: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """The shards an HF ``model.safetensors.index.json``/``pytorch_model.bin.index.json`` names
    (with ``keep``: those holding a key it accepts, read for those keys)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if keep is not None:
            weight_map = {k: v for k, v in weight_map.items() if keep(k)}
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"cannot read {index}: not an HF index with a weight_map ({exc})") from exc
    folder = index.parent.resolve()
    state: dict[str, Tensor] = {}
    for name in shards:
        shard = (folder / str(name)).resolve()
        if not shard.is_relative_to(folder):
            raise CheckpointError(f"{index} names shard {name!r} outside its folder")
        if shard.name.endswith(".index.json"):
            raise CheckpointError(f"{index} names shard {name!r}, an index itself")
        if not shard.is_file():
            raise CheckpointError(f"{index} names shard {name}, which is missing")
        state.update(read_state_dict(shard, keep))
    absent = sorted(set(weight_map) - set(state))
    if absent:
        raise CheckpointError(f"{index} maps {_listing(absent, 3)} to shards that lack them")
    return state


def _listing(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_strict(module: nn.Module, state: dict[str, Tensor], what: str, assign: bool = False) -> None:
    """Copy ``state`` into ``module`` (``assign``: take its tensors themselves, for a module
    built on the meta device); any missing, unexpected or mis-shaped key is an error."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if shapes:
        problems.append(f"shape mismatches (checkpoint vs config): {_listing(shapes, 3)}")
    if problems:
        raise CheckpointError(f"{what} does not match its config: " + "; ".join(problems))
    bad = next((k for k, v in state.items() if v.is_floating_point() and not v.isfinite().all()), None)
    if bad is not None:
        raise CheckpointError(
            f"{what} holds NaN or infinite values (first in {bad}): the weights are corrupt"
        )
    module.load_state_dict(state, strict=True, assign=assign)


def save_safetensors(
    module: nn.Module | dict[str, Tensor], path: str | Path, dtype: torch.dtype | None = None
) -> None:
    """Write a module's (or dict's) tensors to ``path`` atomically, optionally cast to ``dtype``."""
    from safetensors.torch import save_file

    state = module.state_dict() if isinstance(module, nn.Module) else module
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
        for k, v in state.items()
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))
