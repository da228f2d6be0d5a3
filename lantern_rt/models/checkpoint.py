"""Reading and writing weights: LlamaGen ``.pt`` files, safetensors, strict key checking."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch
from torch import Tensor, nn

from lantern_rt.errors import LanternError
from lantern_rt.fileio import atomic_write


class CheckpointError(LanternError, ValueError):
    """A checkpoint is missing, unreadable, or does not fit the model it is loaded into."""


WRAPPER_KEYS = ("model", "module", "state_dict")


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors from a ``.safetensors`` file or a torch checkpoint (read with ``weights_only``).

    A torch checkpoint may hold the state dict itself or wrap it under ``model``, ``module``
    or ``state_dict`` (LlamaGen's released files use ``model``).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {str(exc).splitlines()[0]}") from exc
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


def _listing(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_strict(module: nn.Module, state: dict[str, Tensor], what: str) -> None:
    """Copy ``state`` into ``module``; any missing, unexpected or mis-shaped key is an error."""
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
    module.load_state_dict(state, strict=True)


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
