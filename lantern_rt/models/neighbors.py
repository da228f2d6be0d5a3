"""Latent neighbours: for each VQ code, the other codes nearest to it in the codebook space."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lantern_rt.errors import LanternError, first_line


class NeighborsError(LanternError, ValueError):
    """A stored neighbour table cannot be read or does not fit the codebook."""


def latent_neighbors(codebook: Tensor, k: int, chunk: int = 1024) -> Tensor:
    """[V, k] int64: each code's ``k`` nearest other codes by Euclidean distance, nearest first.

    Pass the vectors the decoder looks up (l2-normalised where the quantizer normalises).
    Ties are broken by code id so the table is deterministic.
    """
    v = codebook.shape[0]
    if not 0 < k < v:
        raise ValueError(f"k must be in 1..{v - 1} for a codebook of {v} codes, got {k}")
    book = codebook.detach().double().cpu()
    rows = []
    for start in range(0, v, chunk):
        d = torch.cdist(book[start : start + chunk], book)
        d[torch.arange(d.shape[0]), torch.arange(start, start + d.shape[0])] = float("inf")
        # stable sort on distance keeps equal distances in id order
        rows.append(torch.sort(d, dim=1, stable=True).indices[:, :k])
    return torch.cat(rows)


def save_neighbors(table: Tensor, path) -> None:
    np.save(path, table.numpy().astype(np.uint16 if table.max() < 2**16 else np.int32))


def load_neighbors_file(path, codebook_size: int | None = None) -> Tensor:
    """The table [V, k] as int64 (stored as uint16: torch cannot index with uint16 everywhere);
    V is ``codebook_size`` when given, and every entry a code 0..V-1. Anything else (a truncated
    file, an object array, a float array, a table of another shape) is a :class:`NeighborsError`."""
    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise NeighborsError(f"cannot read neighbour table {path}: {first_line(exc)}") from None
    if not isinstance(table, np.ndarray):
        raise NeighborsError(f"neighbour table {path} is an .npz archive, not one .npy array")
    if table.ndim != 2 or table.dtype.kind not in "iu":
        raise NeighborsError(
            f"neighbour table {path} must be an integer array [codes, k], got {table.dtype} {list(table.shape)}"
        )
    rows = table.shape[0] if codebook_size is None else codebook_size
    if table.shape[0] != rows:
        raise NeighborsError(
            f"neighbour table {path} has {table.shape[0]} rows for a codebook of {rows} codes"
        )
    if table.size and (table.min() < 0 or table.max() >= rows):
        raise NeighborsError(
            f"neighbour table {path} holds codes {table.min()}..{table.max()}, outside 0..{rows - 1}"
        )
    return torch.from_numpy(table.astype(np.int64))
