"""Codes files: the ``.npz`` a drafter trains on (``codes`` [N, tokens], and per image its class
id under ``labels`` or its prompt under ``prompts``, as ``lantern generate --save-tokens`` writes
them), read and checked, and turned into training data by the model's family."""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from lantern_rt.errors import first_line
from lantern_rt.families.base import TrainingRows
from lantern_rt.families.registry import family_named
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import ModelDir


def write_codes_file(path: Path, codes: np.ndarray, labels: Sequence[int | str]) -> None:
    """Write ``codes`` [N, tokens] by ``path``'s suffix: a ``.npz`` with each image's class id
    (``labels``) or prompt (``prompts``), what :func:`read_codes_file` reads back; else the
    codes alone as ``.npy``."""
    if path.suffix == ".npz" and any(isinstance(x, str) for x in labels):
        np.savez(path, codes=codes, prompts=np.asarray(labels, dtype=str))
    elif path.suffix == ".npz":
        np.savez(path, codes=codes, labels=np.asarray(labels, dtype=np.int64))
    else:
        np.save(path, codes)


def read_codes_file(
    path: Path, key: str = "labels", md: ModelDir | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One codes file's ``codes`` [N, tokens] (integers) and ``key``'s values [N]: integers for
    ``labels``, strings (a numpy unicode array) for ``prompts``; with ``md``, codes of its
    vocabulary and labels of its classes (the token count is :func:`join_codes_files`'s to
    check). :class:`ConfigError`, one line naming the file, for anything else."""
    if not path.is_file():
        raise ConfigError(f"codes file not found: {path}")
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("it is one array, not an .npz archive")
        with data:
            codes, values = data["codes"], data[key]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        why = "it holds Python objects" if "allow_pickle" in str(exc) else first_line(exc)
        raise ConfigError(f"cannot read {path}: expected an .npz with 'codes' and '{key}' ({why})") from None
    if codes.dtype.kind not in "iu" or codes.ndim != 2:
        raise ConfigError(
            f"{path}: 'codes' must be integers [N, tokens], got {codes.dtype} {list(codes.shape)}"
        )
    if key == "labels" and (values.dtype.kind not in "iu" or values.ndim != 1):
        raise ConfigError(f"{path}: 'labels' must be integers [N], got {values.dtype} {list(values.shape)}")
    if key == "prompts" and (values.dtype.kind != "U" or values.ndim != 1):
        raise ConfigError(f"{path}: 'prompts' must be strings [N], got {values.dtype} {list(values.shape)}")
    if len(codes) == 0 or values.shape != codes.shape[:1]:
        raise ConfigError(
            f"{path}: 'codes' [N, tokens] and '{key}' [N] hold {len(codes)} and {len(values)} images"
        )
    if md is not None:
        limits = [("codes", codes, md.gpt.vocab_size)]
        if key == "labels":
            limits.append(("labels", values, md.gpt.num_classes))
        for name, array, limit in limits:
            if array.min() < 0 or array.max() >= limit:
                raise ConfigError(
                    f"{path}: '{name}' holds {array.min()}..{array.max()}, outside 0..{limit - 1} of this model"
                )
    return codes, values


def join_codes_files(
    paths: Sequence[Path], key: str = "labels", md: ModelDir | None = None
) -> tuple[np.ndarray, list[tuple[Path, np.ndarray]]]:
    """The files' codes joined [N, tokens] (one token count, ``md``'s when given) and each
    file's path and ``key`` values, in order (:func:`read_codes_file` checks each)."""
    parts = [read_codes_file(path, key, md) for path in paths]
    lengths = {codes.shape[1] for codes, _ in parts}
    if len(lengths) > 1:
        raise ConfigError(f"the --codes files hold images of different token counts: {sorted(lengths)}")
    if md is not None and lengths != {md.gpt.block_size}:
        raise ConfigError(
            f"{paths[0]}: 'codes' holds images of {lengths.pop()} tokens; this model's are {md.gpt.block_size}"
        )
    codes = np.concatenate([codes for codes, _ in parts])
    return codes, [(path, values) for path, (_, values) in zip(paths, parts, strict=True)]


def drafter_training_data(
    md: ModelDir, paths: Sequence[Path], warn: Callable[[str], None]
) -> tuple[np.ndarray, np.ndarray | TrainingRows]:
    """(codes [N, tokens], their conditions) to train ``md``'s drafter on: the codes files at
    ``paths`` (every input checked now, before anything is written), or without any, the demo's:
    Fashion-MNIST's training split through the model's tokenizer (the apt package
    ``dataset-fashion-mnist``); ``warn`` is told what the user should know."""
    family = family_named(md.family)
    key = family.codes_key(md.gpt)
    if not paths:
        if key != "labels" or md.image_size != 32 or md.vq.in_channels != 1:
            raise ConfigError(
                f"{md.name} has no built-in training data (Fashion-MNIST takes 32x32 greyscale "
                f"class-conditional models): pass --codes FILE.npz with 'codes' and '{key}', e.g. "
                "from 'lantern generate --save-tokens FILE.npz'"
            )
        from lantern_rt.training.demo import encode_dataset

        return encode_dataset(family.load_vq(md, "cpu", torch.float32), "train")
    codes, values = join_codes_files(paths, key, md)
    return codes, family.training_conditions(md, values, warn)
