"""Image-quality metrics and the metric classifier, on synthetic data only."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lantern_rt.eval.classifier import FashionClassifier, load_classifier, train_classifier, train_step
from lantern_rt.eval.metrics import (
    class_accuracy,
    extract_features,
    frechet_distance,
    precision_recall,
    quality_report,
)
from lantern_rt.models.checkpoint import CheckpointError
from lantern_rt.training.data import to_model_range


def with_moments(rng: np.random.Generator, n: int, mean: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """n samples whose sample mean and sample covariance (ddof=1) are exactly ``mean`` and ``cov``."""
    z = rng.normal(size=(n, len(mean)))
    z -= z.mean(0)
    z = z @ np.linalg.inv(np.linalg.cholesky(np.cov(z, rowvar=False))).T
    return z @ np.linalg.cholesky(cov).T + mean


def random_cov(rng: np.random.Generator, d: int) -> np.ndarray:
    m = rng.normal(size=(d, d))
    return m @ m.T / d + 0.1 * np.eye(d)


def test_fd_of_a_set_with_itself_is_zero():
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(400, 128)) @ rng.normal(size=(128, 128))
    assert frechet_distance(feats, feats) < 1e-6 * np.trace(np.cov(feats, rowvar=False))


def test_fd_grows_with_shift():
    rng = np.random.default_rng(1)
    feats = rng.normal(size=(300, 16))
    direction = rng.normal(size=16)
    fds = [frechet_distance(feats, feats + t * direction) for t in (0.1, 0.5, 1.0, 2.0, 5.0)]
    assert all(a < b for a, b in zip(fds, fds[1:], strict=False))
    np.testing.assert_allclose(fds[-1], 25 * direction @ direction, rtol=1e-6)


def test_fd_matches_closed_form_for_diagonal_gaussians():
    rng = np.random.default_rng(2)
    mu_a, mu_b = np.array([0.0, 1.0, -2.0, 0.5]), np.array([1.0, 1.0, 0.0, -0.5])
    var_a, var_b = np.array([1.0, 4.0, 0.25, 2.0]), np.array([2.0, 1.0, 1.0, 0.5])
    expected = np.sum((mu_a - mu_b) ** 2) + np.sum((np.sqrt(var_a) - np.sqrt(var_b)) ** 2)
    n = 200_000
    a = mu_a + np.sqrt(var_a) * rng.normal(size=(n, 4))
    b = mu_b + np.sqrt(var_b) * rng.normal(size=(n, 4))
    assert frechet_distance(a, b) == pytest.approx(expected, rel=0.02)
    exact = frechet_distance(
        with_moments(rng, 50, mu_a, np.diag(var_a)), with_moments(rng, 80, mu_b, np.diag(var_b))
    )
    assert exact == pytest.approx(expected, rel=1e-9)


def test_fd_matches_closed_form_for_non_commuting_covariances():
    rng = np.random.default_rng(3)
    d = 12
    mu_a, mu_b = rng.normal(size=d), rng.normal(size=d)
    cov_a, cov_b = random_cov(rng, d), random_cov(rng, d)
    # tr(sqrt(A B)): the eigenvalues of A B are real and non-negative for PSD A, B.
    tr_cross = np.sqrt(np.linalg.eigvals(cov_a @ cov_b).real.clip(0)).sum()
    expected = np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2 * tr_cross
    fd = frechet_distance(with_moments(rng, 100, mu_a, cov_a), with_moments(rng, 60, mu_b, cov_b))
    assert fd == pytest.approx(expected, rel=1e-8)


def test_fd_accepts_tensors_and_rejects_mismatched_sizes():
    a = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    assert frechet_distance(a, a + 1) == pytest.approx(4.0, rel=1e-9)
    with pytest.raises(ValueError, match="feature sizes differ"):
        frechet_distance(a, a[:, :3])


def clusters(rng: np.random.Generator, centres: np.ndarray, per: int) -> np.ndarray:
    return np.concatenate([c + rng.normal(size=(per, centres.shape[1])) for c in centres])


CENTRES = np.array([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0], [50.0, 50.0]])


def test_precision_recall_hand_case():
    real = np.array([[0.0], [1.0], [3.0]])  # 1-NN radii 1, 1, 2
    fake = np.array([[5.0], [-1.5], [2.5]])  # inside the ball of 3, outside all, inside; radii 2.5, 4, 2.5
    assert precision_recall(real, fake, k=1) == (pytest.approx(2 / 3), 1.0)


def test_precision_recall_identical_and_same_distribution():
    rng = np.random.default_rng(4)
    real = clusters(rng, CENTRES, 200)
    assert precision_recall(real, real) == (1.0, 1.0)
    precision, recall = precision_recall(real, clusters(rng, CENTRES, 200))
    assert precision > 0.9 and recall > 0.9


def test_precision_recall_disjoint_clusters():
    rng = np.random.default_rng(5)
    assert precision_recall(clusters(rng, CENTRES, 100), clusters(rng, CENTRES + 1000, 100)) == (0.0, 0.0)


def test_precision_recall_mode_dropping():
    rng = np.random.default_rng(6)
    real = clusters(rng, CENTRES, 200)
    fake = clusters(rng, CENTRES[:2], 400)  # only half the modes
    precision, recall = precision_recall(real, fake)
    assert precision > 0.9
    assert 0.4 < recall <= 0.5


def test_precision_recall_chunking_does_not_change_result():
    rng = np.random.default_rng(7)
    real, fake = rng.normal(size=(103, 5)), rng.normal(0.3, 1.0, size=(97, 5))
    assert precision_recall(real, fake, k=3, chunk=7) == precision_recall(real, fake, k=3, chunk=1000)
    with pytest.raises(ValueError, match="k=5"):
        precision_recall(real[:5], fake, k=5)


def test_class_accuracy():
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.0, 3.0, 1.0]])
    labels = np.array([0, 2, 1, 1])
    assert class_accuracy(logits, labels) == 0.75
    assert class_accuracy(torch.softmax(torch.from_numpy(logits), 1), torch.from_numpy(labels)) == 0.75
    with pytest.raises(ValueError):
        class_accuracy(logits, labels[:3])


def test_classifier_shapes():
    model = FashionClassifier()
    x = torch.rand(5, 1, 32, 32) * 2 - 1
    assert model.features(x).shape == (5, 128)
    assert model(x).shape == (5, 10)
    with pytest.raises(ValueError, match="expected images"):
        model(torch.zeros(2, 1, 28, 28))


def synthetic_images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [n, 32, 32] noise with a bright 6x6 square whose position encodes the label."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    images = rng.integers(0, 60, size=(n, 32, 32), dtype=np.uint8)
    for img, y in zip(images, labels, strict=True):
        r, c = 3 + 12 * (y // 5), 3 + 5 * (y % 5)
        img[r : r + 6, c : c + 6] = 255
    return images, labels.astype(np.uint8)


def test_training_steps_decrease_loss():
    torch.manual_seed(0)
    model = FashionClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = synthetic_images(32)
    x, y = torch.from_numpy(to_model_range(images)), torch.from_numpy(labels.astype(np.int64))
    losses = [train_step(model, opt, x, y) for _ in range(3)]
    assert losses[2] < losses[0]


def test_extract_features_layouts_batching_and_range():
    torch.manual_seed(0)
    model = FashionClassifier().eval()
    images, _ = synthetic_images(7)
    feats, logits = extract_features(model, images)
    assert feats.shape == (7, 128) and logits.shape == (7, 10) and feats.dtype == np.float32
    feats2, logits2 = extract_features(model, images[..., None], batch=3)
    np.testing.assert_allclose(feats2, feats, atol=1e-5)
    np.testing.assert_allclose(logits2, logits, atol=1e-5)
    pixels, _ = extract_features(model, images, feature_fn=lambda x: x)
    np.testing.assert_allclose(pixels, images.reshape(7, -1) / 127.5 - 1, atol=1e-6)
    with pytest.raises(ValueError, match="uint8"):
        extract_features(model, images.astype(np.float32))


def test_quality_report_against_itself():
    torch.manual_seed(0)
    model = FashionClassifier().eval()
    images, labels = synthetic_images(20)
    reference, logits = extract_features(model, images)
    report = quality_report(model, images, labels, reference)
    assert report["fd_classifier"] < 1e-6 * np.trace(np.cov(reference, rowvar=False))
    assert (report["precision"], report["recall"]) == (1.0, 1.0)
    assert report["class_accuracy"] == class_accuracy(logits, labels)
    custom = quality_report(model, images, labels, images.reshape(20, -1) / 127.5 - 1, feature_fn=lambda x: x)
    assert custom["fd_classifier"] < 1e-6 and custom["precision"] == 1.0


def write_idx(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Fashion-MNIST's gzip'd idx files (28x28 images)."""
    n = len(images)
    header = np.array([2051, n, 28, 28], ">i4").tobytes()
    (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(header + images[:, 2:30, 2:30].tobytes())
    )
    header = np.array([2049, n], ">i4").tobytes()
    (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(header + labels.tobytes()))


def test_train_classifier_writes_loadable_weights(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    write_idx(data, "train", *synthetic_images(24, seed=1))
    test_images, test_labels = synthetic_images(10, seed=2)
    write_idx(data, "t10k", test_images, test_labels)
    out = tmp_path / "weights"
    summary = train_classifier(out, epochs=1, batch=8, data_root=data)  # 3 steps
    saved = json.loads((out / "classifier.json").read_text())
    assert saved == summary and saved["epochs"] == 1 and saved["seed"] == 0
    model = load_classifier(out)
    assert not model.training
    _, logits = extract_features(model, test_images)
    assert class_accuracy(logits, test_labels) == saved["test_accuracy"]
    assert load_classifier(out / "classifier.safetensors").state_dict().keys() == model.state_dict().keys()


def test_load_classifier_missing(tmp_path: Path):
    with pytest.raises(
        CheckpointError, match="classifier weights not found.*python -m lantern_rt.eval.classifier"
    ):
        load_classifier(tmp_path / "nowhere")
