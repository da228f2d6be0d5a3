"""Latent neighbours: for each VQ code, the other codes nearest to it in the codebook space."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


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


def load_neighbors_file(path) -> Tensor:
    """The table as int64 (stored as uint16: torch cannot index with uint16 everywhere)."""
    return torch.from_numpy(np.load(path).astype(np.int64))
