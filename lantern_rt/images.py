"""Turning decoded images into a PNG grid, written atomically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lantern_rt.fileio import atomic_write


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Decoder output [N, C, H, W] in about [-1, 1] -> uint8 [N, H, W, C]."""
    x = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def grid(images: np.ndarray, rows: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """Tile uint8 images [N, H, W, C] into ``rows`` rows (row-major), upscaled by ``scale``."""
    n, h, w, c = images.shape
    cols = -(-n // rows)
    if scale > 1:
        images = images.repeat(scale, axis=1).repeat(scale, axis=2)
        h, w = h * scale, w * scale
    out = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 255, np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        out[
            pad + r * (h + pad) : pad + r * (h + pad) + h, pad + col * (w + pad) : pad + col * (w + pad) + w
        ] = img
    return out


def pil_image(array: np.ndarray) -> Image.Image:
    """uint8 [H, W, C] (C = 1: greyscale, or 3) as a PIL image."""
    return Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)


def write_png(array: np.ndarray, path: Path) -> None:
    """Write uint8 [H, W, C] (C = 1 or 3) as a PNG at ``path`` (as it is: see :func:`save_png`)."""
    pil_image(array).save(path, format="PNG")


def save_png(array: np.ndarray, path: Path) -> None:
    """Write uint8 [H, W, C] (C = 1 or 3) as a PNG, atomically."""
    atomic_write(path, lambda tmp: write_png(array, tmp))
