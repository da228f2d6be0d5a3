"""Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package, padded to 32x32."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from lantern_rt.errors import LanternError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASS_NAMES = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)


class DatasetMissing(LanternError, FileNotFoundError):
    """The Fashion-MNIST files are not installed."""


def load_fashion_mnist(split: str = "train", root: Path = FASHION_MNIST_DIR) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 [N, 32, 32] (zero-padded from 28x28) and labels uint8 [N]."""
    prefix = {"train": "train", "test": "t10k"}[split]
    images, labels = root / f"{prefix}-images-idx3-ubyte.gz", root / f"{prefix}-labels-idx1-ubyte.gz"
    if not images.exists():
        raise DatasetMissing(f"{images} not found: install it with 'apt-get install dataset-fashion-mnist'")
    with gzip.open(images) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(labels) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return np.pad(x, ((0, 0), (2, 2), (2, 2))), y.copy()


def to_model_range(x: np.ndarray) -> np.ndarray:
    """uint8 [N, H, W] or [N, H, W, C] -> float32 [N, C, H, W] in [-1, 1] (C = 1 for [N, H, W])."""
    x = x[..., None] if x.ndim == 3 else x
    return (x.astype(np.float32) / 127.5 - 1.0).transpose(0, 3, 1, 2)
