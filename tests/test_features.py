"""``lantern bench --features / --reference``: the user's feature extractor and real images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from lantern_rt.cli import main
from lantern_rt.eval import bench
from lantern_rt.eval.bench import BenchSettings, run_bench
from lantern_rt.eval.classifier import load_classifier
from lantern_rt.eval.features import load_features, load_reference, user_features
from lantern_rt.eval.metrics import extract_features, quality_report
from lantern_rt.models.config import ConfigError, VQConfig
from lantern_rt.models.vq import VQModel
from lantern_rt.training.data import load_fashion_mnist
from tests.conftest import TINY_VQ
from tests.test_bench import fashion_tiny, model_with_drafter, write_fashion_like

FEATURES_PY = """
import torch
from torch import nn


class Pool(nn.Module):
    def forward(self, x):
        return nn.functional.avg_pool2d(x, 4)


def make():
    return Pool()


def make_rank1():
    return lambda x: x.mean((1, 2, 3))


def make_int():
    return 3


def make_fails():
    return lambda x: x.view(7, -1)


def make_raises():
    raise ValueError("needs a checkpoint")


NOT_CALLABLE = 3
"""


class Pool(nn.Module):
    """The same extractor as ``FEATURES_PY``'s, built here for the independent checks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.avg_pool2d(x, 4)


@pytest.fixture(scope="module")
def feats_py(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("features") / "my_feats.py"
    path.write_text(FEATURES_PY)
    return path


@pytest.fixture(scope="module")
def grey_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 classes of 8x8 greyscale images: not Fashion-MNIST shaped."""
    vq = VQModel(VQConfig(**TINY_VQ)).eval()
    return model_with_drafter(tmp_path_factory.mktemp("grey") / "tiny", vq)


def expected_pool(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.avg_pool2d(x, 4).flatten(1)


# --- loading -------------------------------------------------------------------------------


def test_load_from_file_module_and_torchscript(feats_py, tmp_path, monkeypatch):
    x = torch.rand(3, 1, 8, 8) * 2 - 1
    from_file = load_features(f"{feats_py}:make", (1, 8, 8))
    assert torch.equal(from_file(x), expected_pool(x)) and from_file(x).shape == (3, 4)
    monkeypatch.syspath_prepend(str(feats_py.parent))
    assert torch.equal(load_features("my_feats:Pool", (1, 8, 8))(x), expected_pool(x))
    scripted = tmp_path / "pool.pt"
    torch.jit.script(Pool()).save(str(scripted))
    assert torch.equal(load_features(str(scripted), (1, 8, 8))(x), expected_pool(x))
    images = np.random.default_rng(0).integers(0, 256, (5, 8, 8, 1), dtype=np.uint8)
    as_model_input = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    assert np.allclose(user_features(from_file, images), expected_pool(as_model_input).numpy())


def test_load_reference(tmp_path):
    path = tmp_path / "ref.npz"
    rng = np.random.default_rng(0)
    np.savez(path, images=rng.integers(0, 256, (6, 8, 8), dtype=np.uint8), labels=np.arange(6) % 3)
    images, labels = load_reference(path, (1, 8, 8), [0, 2], 2)
    assert images.shape == (6, 8, 8, 1) and labels.tolist() == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ConfigError, match="needs 3 or more images of class 0"):
        load_reference(path, (1, 8, 8), [0], 3)
    with pytest.raises(ConfigError, match=r"images must be uint8 \[N, 8, 8, 3\]"):
        load_reference(path, (3, 8, 8), [0], 1)


def bad_inputs(feats: Path, tmp: Path) -> list[tuple[list[str], str]]:
    """(bench options, the start of the one-line error) for each kind of bad --features/--reference."""
    (tmp / "junk.pt").write_bytes(b"not a zip")
    (tmp / "junk.npz").write_bytes(b"not a zip")
    np.savez(tmp / "keys.npz", pictures=np.zeros((2, 8, 8), np.uint8))
    (tmp / "syntax.py").write_text("import torch\n\n\ndef make(:\n    return None\n")
    (tmp / "raises.py").write_text("import torch\n\nraise RuntimeError('no weights here')\n")
    (tmp / "imports.py").write_text("import no_such_module_xyz\n")
    raises_line = FEATURES_PY.splitlines().index('    raise ValueError("needs a checkpoint")') + 1
    return [
        (["--features", f"{tmp}/syntax.py:make"], f"{tmp}/syntax.py, line 4: SyntaxError"),
        (
            ["--features", f"{tmp}/raises.py:make"],
            f"{tmp}/raises.py, line 3: RuntimeError: no weights here",
        ),
        (
            ["--features", f"{tmp}/imports.py:make"],
            f"{tmp}/imports.py, line 1: ModuleNotFoundError: No module named 'no_such_module_xyz'",
        ),
        (
            ["--features", f"{feats}:make_raises"],
            f"make_raises() fails: {feats}, line {raises_line}: ValueError: needs a checkpoint",
        ),
        (
            ["--features", f"{tmp}/missing.py:make"],
            f"--features {tmp}/missing.py:make: {tmp}/missing.py not found",
        ),
        (["--features", f"{tmp}/missing.ts"], f"--features {tmp}/missing.ts: {tmp}/missing.ts not found"),
        (["--features", f"{tmp}/junk.pt"], "not a TorchScript file"),
        (["--features", f"{feats}:nope"], f"{feats} has no attribute 'nope'"),
        (["--features", f"{feats}:NOT_CALLABLE"], "NOT_CALLABLE is not callable (int)"),
        (["--features", f"{feats}:make_int"], "make_int() returned int, not a module or callable"),
        (["--features", f"{feats}:make_rank1"], "needs features [N, D] for N=2 images, got shape (2,)"),
        (["--features", f"{feats}:make_fails"], "fails on a batch [2, 1, 8, 8] in [-1, 1]"),
        (["--features", "no_such_module_xyz:make"], "cannot import no_such_module_xyz"),
        (["--features", "just_a_name"], "use path/to/file.py:NAME"),
        (["--reference", f"{tmp}/missing.npz"], f"--reference {tmp}/missing.npz: file not found"),
        (["--reference", f"{tmp}/junk.npz"], "not an .npz file"),
        (["--reference", f"{tmp}/keys.npz"], "needs arrays 'images' and 'labels'"),
    ]


def test_bad_features_and_reference_are_one_line_exit_2(feats_py, grey_model, tmp_path):
    out = tmp_path / "never"
    for options, message in bad_inputs(feats_py, tmp_path):
        args = [
            "bench",
            "--model",
            str(grey_model),
            "--backend",
            "torch",
            "--config",
            "ar",
            "--out",
            str(out),
        ]
        r = CliRunner().invoke(main, args + options)
        assert r.exit_code == 2, (options, r.output)
        assert r.output.strip().count("\n") == 0 and r.output.startswith("error: --"), r.output
        assert message in r.output, (message, r.output)
    assert not out.exists()


# --- bench runs ----------------------------------------------------------------------------


def test_features_on_fashion_shape_match_quality_report(feats_py, tmp_path, monkeypatch):
    """FD/precision/recall from the user's extractor; class accuracy still from the classifier."""
    model = fashion_tiny(tmp_path)
    data_root = write_fashion_like(tmp_path / "fashion")
    spec = f"{feats_py}:make"
    base = BenchSettings(
        out=tmp_path / "classifier-run",
        model=model,
        backends=("torch",),
        configs=("ar",),
        num_images=1,
        classes=("0", "3", "5", "9"),
        warmup=0,
        ar_seeds=1,
        classifier=tmp_path / "classifier.safetensors",
        data_root=data_root,
    )
    ours = run_bench(base)["rows"][0]
    seen = []
    original = bench.quality_fields
    monkeypatch.setattr(
        bench,
        "quality_fields",
        lambda ref, im, feats, lab: seen.append((im, lab)) or original(ref, im, feats, lab),
    )
    results = run_bench(
        BenchSettings(**{**base.__dict__, "out": tmp_path / "features-run", "features": spec})
    )
    theirs = results["rows"][0]
    assert results["quality_note"] is None and theirs["fd_classifier"] != ours["fd_classifier"]
    assert theirs["class_accuracy"] == ours["class_accuracy"]
    images, labels = seen[0]
    classifier = load_classifier(tmp_path / "classifier.safetensors")
    test_images, test_labels = load_fashion_mnist("test", data_root)
    real = test_images[np.isin(test_labels, [0, 3, 5, 9])]
    reference = extract_features(classifier, real, feature_fn=Pool())[0]
    expected = quality_report(classifier, images, np.asarray(labels), reference, feature_fn=Pool())
    assert {k: theirs[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    assert "FD-classifier" in (base.out / "results.md").read_text()
    assert f"FD-features({spec})" in (tmp_path / "features-run" / "results.md").read_text()


def test_reference_scores_a_colour_model(feats_py, tmp_path):
    """An RGB model the classifier cannot score: --features with --reference gives quality numbers."""
    vq = VQModel(VQConfig(**{**TINY_VQ, "in_channels": 3, "out_channels": 3})).eval()
    model = model_with_drafter(tmp_path / "rgb", vq)
    rng = np.random.default_rng(0)
    npz = tmp_path / "ref.npz"
    np.savez(npz, images=rng.integers(0, 256, (30, 8, 8, 3), dtype=np.uint8), labels=np.arange(30) % 5)
    settings = BenchSettings(
        out=tmp_path / "out",
        model=model,
        backends=("torch",),
        configs=("ar",),
        num_images=1,
        warmup=0,
        ar_seeds=1,
        features=f"{feats_py}:make",
    )
    without = run_bench(settings)
    assert "metric classifier scores Fashion-MNIST" in without["quality_note"]
    assert "--features with --reference" in without["quality_note"]
    results = run_bench(BenchSettings(**{**settings.__dict__, "reference": npz}))
    row = results["rows"][0]
    assert results["quality_note"] is None and row["class_accuracy"] is None
    assert all(isinstance(row[k], float) for k in ("fd_classifier", "precision", "recall"))
    names = [r["name"] for r in results["calibration"]]
    assert names == ["real reference subset", "VQ reconstruction", "AR seed 0 (torch)"]
    md = (settings.out / "results.md").read_text()
    assert f"FD-features({feats_py}:make); real images: {npz}" in md
