"""What users bring to ``lantern bench``'s quality metrics: their own feature extractor
(``--features``) and their own real images (``--reference``).

An extractor maps a float batch [N, C, H, W] in [-1, 1] to features [N, D] (or [N, ...], which
is flattened). A spec names it as ``path/to/file.py:NAME`` or ``package.module:NAME`` (``NAME()``
returns an ``nn.Module`` or any such callable; ``NAME`` may also be a module instance itself), or
as a TorchScript file (``.pt`` / ``.ts``). Modules run on the CPU in eval mode.
"""

from __future__ import annotations

import importlib
import importlib.util
import traceback
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lantern_rt.errors import first_line
from lantern_rt.eval.metrics import FeatureFn
from lantern_rt.models.config import ConfigError
from lantern_rt.training.data import to_model_range

TORCHSCRIPT_SUFFIXES = (".pt", ".ts")
IMPORTLIB_DIR = Path(importlib.__file__).parent
SPEC_FORMS = "use path/to/file.py:NAME, package.module:NAME or a TorchScript .pt/.ts file"
# what the user's code raises that is its own failure, sys.exit() included (Ctrl-C still interrupts)
USER_FAILURES = (Exception, SystemExit)


def _import(target: str, spec: str) -> ModuleType:
    """The module a spec names: a .py file, or an importable module."""
    if not target.endswith(".py"):
        try:
            return importlib.import_module(target)
        except USER_FAILURES as exc:  # the user's module: a syntax error or any failure while it runs
            raise ConfigError(f"--features {spec}: cannot import {target}: {_where(exc)}") from None
    path = Path(target)
    if not path.is_file():
        raise ConfigError(f"--features {spec}: {path} not found")
    loader_spec = importlib.util.spec_from_file_location(f"lantern_user_features_{path.stem}", path)
    assert loader_spec is not None and loader_spec.loader is not None  # always, for a .py file
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except USER_FAILURES as exc:  # the user's file: a syntax error or any failure while it runs
        raise ConfigError(f"--features {spec}: {_where(exc, path)}") from None
    return module


def _where(exc: BaseException, path: Path | None = None) -> str:
    """``FILE, line N: TYPE: MESSAGE`` for an exception the user's code raised: the line a syntax
    error is on, else the innermost line of ``path`` in the traceback (of any file without one)."""
    if isinstance(exc, SyntaxError):
        return f"{exc.filename}, line {exc.lineno}: {type(exc).__name__}: {exc.msg}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_users(f.filename)]
    if path is not None:
        frames = [f for f in frames if Path(f.filename).resolve() == path.resolve()] or frames
    where = f"{frames[-1].filename}, line {frames[-1].lineno}: " if frames else ""
    return f"{where}{type(exc).__name__}: {first_line(exc)}"


def _is_users(filename: str) -> bool:
    """Whether a traceback's file is outside this module and Python's import machinery."""
    here = Path(filename)
    return not (filename.startswith("<") or here == Path(__file__) or IMPORTLIB_DIR in here.parents)


def _extractor(spec: str) -> Any:
    """The object a spec names (not yet checked on images)."""
    path = Path(spec)
    if path.suffix.lower() in TORCHSCRIPT_SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"--features {spec}: {path} not found")
        try:
            return torch.jit.load(str(path), map_location="cpu")
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(f"--features {spec}: not a TorchScript file ({first_line(exc)})") from None
    target, sep, name = spec.rpartition(":")
    if not (sep and target and name.isidentifier()):
        raise ConfigError(f"--features {spec!r}: {SPEC_FORMS}")
    module = _import(target, spec)
    factory = getattr(module, name, None)
    if factory is None:
        raise ConfigError(f"--features {spec}: {target} has no attribute {name!r}")
    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise ConfigError(f"--features {spec}: {name} is not callable ({type(factory).__name__})")
    try:
        made = factory()
    except USER_FAILURES as exc:  # the user's code
        origin = Path(module.__file__) if getattr(module, "__file__", None) else None
        raise ConfigError(f"--features {spec}: {name}() fails: {_where(exc, origin)}") from None
    if not callable(made):
        raise ConfigError(
            f"--features {spec}: {name}() returned {type(made).__name__}, not a module or callable"
        )
    return made


def load_features(spec: str, image_shape: tuple[int, int, int]) -> FeatureFn:
    """The extractor ``spec`` names, tried on a batch of two zero images of ``image_shape`` (C, H, W).

    The returned function checks every output: a tensor [N, ...] for N images, flattened to [N, D].
    """
    extractor = _extractor(spec)
    if isinstance(extractor, nn.Module):
        extractor.eval()

    def features(x: Tensor) -> Tensor:
        out = extractor(x)
        if not isinstance(out, Tensor) or out.ndim < 2 or len(out) != len(x):
            got = f"shape {tuple(out.shape)}" if isinstance(out, Tensor) else f"a {type(out).__name__}"
            raise ConfigError(f"--features {spec}: needs features [N, D] for N={len(x)} images, got {got}")
        return out.flatten(1)

    probe = torch.zeros(2, *image_shape)
    try:
        with torch.inference_mode():
            features(probe)
    except ConfigError:
        raise
    except USER_FAILURES as exc:  # the user's code: any failure on a valid batch is theirs to fix
        raise ConfigError(
            f"--features {spec}: fails on a batch {list(probe.shape)} in [-1, 1]: {first_line(exc)}"
        ) from None
    return features


@torch.inference_mode()
def user_features(feature_fn: FeatureFn, images: np.ndarray, batch: int = 256) -> np.ndarray:
    """Features float32 [N, D] of uint8 images [N, H, W] or [N, H, W, C], ``batch`` at a time."""
    x = to_model_range(images)
    return torch.cat(
        [feature_fn(torch.from_numpy(x[i : i + batch])).float().cpu() for i in range(0, len(x), batch)]
    ).numpy()


def load_reference(
    path: Path, image_shape: tuple[int, int, int], classes: Sequence[int], per_class: int
) -> tuple[np.ndarray, np.ndarray]:
    """Real images uint8 [N, H, W, C] and labels [N] from an .npz with ``images`` and ``labels``.

    The images must have ``image_shape`` (C, H, W) and hold ``per_class`` or more of each class.
    """
    if not path.is_file():
        raise ConfigError(f"--reference {path}: file not found")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in ("images", "labels") if k in data}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"--reference {path}: not an .npz file ({first_line(exc)})") from None
    if len(arrays) < 2:
        raise ConfigError(f"--reference {path}: needs arrays 'images' and 'labels'")
    images, labels = arrays["images"], arrays["labels"]
    images = images[..., None] if images.ndim == 3 else images
    c, h, w = image_shape
    if images.dtype != np.uint8 or images.shape[1:] != (h, w, c):
        raise ConfigError(
            f"--reference {path}: images must be uint8 [N, {h}, {w}, {c}] like the model's, "
            f"got {images.dtype} {list(arrays['images'].shape)}"
        )
    if not np.issubdtype(labels.dtype, np.integer) or labels.shape != (len(images),):
        raise ConfigError(
            f"--reference {path}: labels must be integers [{len(images)}], got {labels.dtype} {list(labels.shape)}"
        )
    for cls in classes:
        if (have := int(np.sum(labels == cls))) < per_class:
            raise ConfigError(
                f"--reference {path}: needs {per_class} or more images of class {cls} (one per image "
                f"generated for it), has {have}"
            )
    return images, labels.astype(np.int64)
