"""Offline image-quality metrics on classifier features: Fréchet distance, precision/recall, accuracy.

Features are compared as float64. Images enter as uint8 [N, H, W] (or [N, H, W, 1]) and are
mapped to the generator's range [-1, 1] by ``to_model_range`` before any network sees them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from lantern_rt.training.data import to_model_range

FeatureFn = Callable[[Tensor], Tensor]
"""Images float32 [B, 1, H, W] in [-1, 1] -> features [B, D] (any trailing shape is flattened)."""

ArrayLike = np.ndarray | Tensor


def _numpy(x: ArrayLike) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def _as_features(x: ArrayLike, name: str) -> np.ndarray:
    a = _numpy(x)
    if a.ndim != 2 or len(a) < 2:
        raise ValueError(f"{name} must be [N >= 2, D] features, got shape {a.shape}")
    return a.astype(np.float64)


def _sqrtm_psd(m: np.ndarray) -> np.ndarray:
    """Square root of a symmetric positive semi-definite matrix (tiny negative eigenvalues -> 0)."""
    w, v = np.linalg.eigh((m + m.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def frechet_distance(feats_a: ArrayLike, feats_b: ArrayLike) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (FID's formula).

    ``|mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr(sqrt(sqrt(S_a) S_b sqrt(S_a)))`` with sample
    covariances (ddof=1), computed by symmetric eigendecompositions in float64.
    """
    a, b = _as_features(feats_a, "feats_a"), _as_features(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature sizes differ: {a.shape[1]} vs {b.shape[1]}")
    cov_a = np.atleast_2d(np.cov(a, rowvar=False, ddof=1))
    cov_b = np.atleast_2d(np.cov(b, rowvar=False, ddof=1))
    root_a = _sqrtm_psd(cov_a)
    cross = root_a @ cov_b @ root_a
    tr_cross = np.sqrt(np.clip(np.linalg.eigvalsh((cross + cross.T) / 2), 0.0, None)).sum()
    fd = np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2 * tr_cross
    return float(max(fd, 0.0))


def _sq_dists(x: Tensor, y: Tensor) -> Tensor:
    """Squared Euclidean distances [len(x), len(y)], clamped at 0."""
    d = (x * x).sum(1)[:, None] + (y * y).sum(1)[None] - 2 * x @ y.T
    return d.clamp_min_(0.0)


def _knn_sq_radii(feats: Tensor, k: int, chunk: int) -> Tensor:
    """Squared distance from each sample to its k-th nearest other sample in the same set."""
    # The (k+1)-th smallest distance counts the sample itself (distance 0) as the first.
    return torch.cat(
        [
            torch.kthvalue(_sq_dists(feats[i : i + chunk], feats), k + 1, dim=1).values
            for i in range(0, len(feats), chunk)
        ]
    )


def _fraction_inside(centres: Tensor, sq_radii: Tensor, queries: Tensor, chunk: int) -> float:
    """Fraction of ``queries`` within the k-NN ball of at least one centre."""
    inside = sum(
        int((_sq_dists(queries[i : i + chunk], centres) <= sq_radii[None]).any(1).sum())
        for i in range(0, len(queries), chunk)
    )
    return inside / len(queries)


def precision_recall(
    real_feats: ArrayLike, fake_feats: ArrayLike, k: int = 3, chunk: int = 512
) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al. 2019) with k-NN balls.

    Precision: fraction of fake samples inside some real sample's k-NN ball (fidelity).
    Recall: fraction of real samples inside some fake sample's k-NN ball (diversity).
    Distances are computed ``chunk`` rows at a time (float64: ``8 * chunk * N`` bytes each).
    """
    real = torch.from_numpy(_as_features(real_feats, "real_feats"))
    fake = torch.from_numpy(_as_features(fake_feats, "fake_feats"))
    if real.shape[1] != fake.shape[1]:
        raise ValueError(f"feature sizes differ: {real.shape[1]} vs {fake.shape[1]}")
    if not 1 <= k < min(len(real), len(fake)):
        raise ValueError(f"k={k} needs 1 <= k < number of samples in each set")
    precision = _fraction_inside(real, _knn_sq_radii(real, k, chunk), fake, chunk)
    recall = _fraction_inside(fake, _knn_sq_radii(fake, k, chunk), real, chunk)
    return precision, recall


def class_accuracy(logits_or_probs: ArrayLike, labels: ArrayLike) -> float:
    """Top-1 agreement of scores [N, C] with integer labels [N]."""
    scores, y = _numpy(logits_or_probs), _numpy(labels)
    if scores.ndim != 2 or y.shape != (len(scores),) or len(y) == 0:
        raise ValueError(f"need scores [N, C] and labels [N], got {scores.shape} and {y.shape}")
    return float(np.mean(scores.argmax(1) == y))


def _as_images(images: ArrayLike) -> np.ndarray:
    x = _numpy(images)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.ndim != 3 or x.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [N, H, W] or [N, H, W, 1], got {x.dtype} {x.shape}")
    return x


@torch.inference_mode()
def extract_features(
    model: nn.Module, images: ArrayLike, batch: int = 256, feature_fn: FeatureFn | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features [N, D] and class logits [N, C] of uint8 images, as float32 arrays.

    ``model`` needs ``features(x)`` and ``logits(features)`` (see ``FashionClassifier``); it runs
    in its current mode on its own device. ``feature_fn``, if given, supplies the features
    instead (it receives the same [-1, 1] batches); the logits still come from ``model``.
    """
    x = _as_images(images)
    device = next(model.parameters()).device
    feats, logits = [], []
    for i in range(0, len(x), batch):
        inputs = torch.from_numpy(to_model_range(x[i : i + batch])).to(device)
        f = model.features(inputs)
        logits.append(model.logits(f).float().cpu())
        feats.append((f if feature_fn is None else feature_fn(inputs)).flatten(1).float().cpu())
    return torch.cat(feats).numpy(), torch.cat(logits).numpy()


def quality_report(
    model: nn.Module,
    images: ArrayLike,
    labels: ArrayLike,
    reference_features: ArrayLike,
    *,
    feature_fn: FeatureFn | None = None,
    k: int = 3,
    batch: int = 256,
) -> dict[str, float]:
    """FD, class accuracy and precision/recall of generated ``images`` against reference features.

    ``reference_features`` must come from the same extractor (``extract_features(model, real,
    feature_fn=feature_fn)[0]``); ``labels`` are the classes the images were generated for.
    """
    feats, logits = extract_features(model, images, batch, feature_fn)
    precision, recall = precision_recall(reference_features, feats, k)
    return {
        "fd_classifier": frechet_distance(reference_features, feats),
        "class_accuracy": class_accuracy(logits, labels),
        "precision": precision,
        "recall": recall,
    }
