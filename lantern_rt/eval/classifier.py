"""The metric feature extractor: a small CNN trained on Fashion-MNIST in this repository.

    python -m lantern_rt.eval.classifier --out lantern_rt/eval/weights

Inputs are float [N, 1, 32, 32] in [-1, 1] (``to_model_range`` of the uint8 images); the
features are the 128-d penultimate layer *before* its ReLU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from lantern_rt.eval.metrics import class_accuracy, extract_features
from lantern_rt.models.checkpoint import CheckpointError, load_strict, read_state_dict, save_safetensors
from lantern_rt.training.data import FASHION_MNIST_DIR, DatasetMissing, load_fashion_mnist, to_model_range

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights"
WEIGHTS_FILE, INFO_FILE = "classifier.safetensors", "classifier.json"
IMAGE_SIZE, FEATURE_DIM, NUM_CLASSES = 32, 128, 10


class FashionClassifier(nn.Module):
    """conv 32-32-pool-64-64-pool, FC 128 (the features), FC 10."""

    def __init__(self) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

        self.conv = nn.Sequential(
            *conv(1, 32), *conv(32, 32), nn.MaxPool2d(2), *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2)
        )
        self.fc = nn.Linear(64 * (IMAGE_SIZE // 4) ** 2, FEATURE_DIM)
        self.head = nn.Linear(FEATURE_DIM, NUM_CLASSES)

    def features(self, x: Tensor) -> Tensor:
        """Images [N, 1, 32, 32] in [-1, 1] -> penultimate pre-activation features [N, 128]."""
        if x.shape[1:] != (1, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"expected images [N, 1, {IMAGE_SIZE}, {IMAGE_SIZE}], got {tuple(x.shape)}")
        return self.fc(self.conv(x).flatten(1))

    def logits(self, features: Tensor) -> Tensor:
        """Class logits [N, 10] from ``features``."""
        return self.head(F.relu(features))

    def forward(self, x: Tensor) -> Tensor:
        return self.logits(self.features(x))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> float:
    """One cross-entropy step; returns the loss."""
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def _batch(
    images: np.ndarray, labels: np.ndarray, idx: Tensor, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Model-range inputs with random horizontal flips, and int64 labels."""
    x = torch.from_numpy(to_model_range(images[idx.numpy()]))
    flip = torch.rand(len(x), generator=gen) < 0.5
    x[flip] = x[flip].flip(-1)
    return x, torch.from_numpy(labels[idx.numpy()].astype(np.int64))


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def train_classifier(
    out: Path, epochs: int = 8, seed: int = 0, batch: int = 128, data_root: Path = FASHION_MNIST_DIR
) -> dict:
    """Train on the Fashion-MNIST train split, write ``classifier.safetensors`` and ``classifier.json``.

    AdamW (lr 1e-3, cosine to 0, weight decay 1e-4), random horizontal flips. Returns the
    summary written to the json (final test accuracy, and after each epoch).
    """
    train_x, train_y = load_fashion_mnist("train", data_root)
    test_x, test_y = load_fashion_mnist("test", data_root)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = FashionClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    steps = -(-len(train_x) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * steps)
    history = []
    for epoch in range(epochs):
        model.train()
        bar = tqdm(
            torch.randperm(len(train_x), generator=gen).split(batch), desc=f"epoch {epoch + 1}/{epochs}"
        )
        for idx in bar:
            loss = train_step(model, opt, *_batch(train_x, train_y, idx, gen))
            sched.step()
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        model.eval()
        history.append(class_accuracy(extract_features(model, test_x)[1], test_y))
        tqdm.write(f"epoch {epoch + 1}: test accuracy {history[-1]:.4f}")
    summary = {
        "test_accuracy": history[-1],
        "test_accuracy_per_epoch": history,
        "epochs": epochs,
        "seed": seed,
        "batch": batch,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(model, out / WEIGHTS_FILE)
    _write_json_atomic(out / INFO_FILE, summary)
    return summary


def load_classifier(path: Path = DEFAULT_WEIGHTS) -> FashionClassifier:
    """The trained classifier in eval mode, from a weights directory or a ``.safetensors`` file."""
    path = Path(path)
    file = path / WEIGHTS_FILE if path.suffix != ".safetensors" else path
    if not file.is_file():
        raise CheckpointError(
            f"classifier weights not found: {file} (train them with "
            f"'python -m lantern_rt.eval.classifier --out {file.parent}')"
        )
    model = FashionClassifier()
    load_strict(model, read_state_dict(file), "classifier weights")
    return model.eval()


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=DEFAULT_WEIGHTS, show_default=True)
@click.option("--epochs", default=8, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--batch", default=128, show_default=True)
@click.option(
    "--data", "data_root", type=click.Path(path_type=Path), default=FASHION_MNIST_DIR, show_default=True
)
def main(out: Path, epochs: int, seed: int, batch: int, data_root: Path) -> None:
    """Train the metric classifier on Fashion-MNIST and save it to OUT."""
    try:
        summary = train_classifier(out, epochs, seed, batch, data_root)
    except DatasetMissing as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"test accuracy {summary['test_accuracy']:.4f}; wrote {out / WEIGHTS_FILE}")


if __name__ == "__main__":
    main()
