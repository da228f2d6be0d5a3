"""``lantern generate``: outputs, determinism, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from lantern_rt.cli import main
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir


def run(*args: str):
    """``lantern generate`` on the torch backend (other backends are tested with bundles)."""
    return CliRunner().invoke(main, ["generate", "-q", "--backend", "torch", *args])


def test_generate_writes_grid_tokens_and_stats(tiny_model_dir, tmp_path):
    out, tok, stats = tmp_path / "g.png", tmp_path / "t.npy", tmp_path / "s.json"
    r = run(
        "--model",
        str(tiny_model_dir),
        "--classes",
        "0,b",
        "--class",
        "4",
        "-n",
        "3",
        "-o",
        str(out),
        "--save-tokens",
        str(tok),
        "--stats-json",
        str(stats),
    )
    assert r.exit_code == 0, r.output
    tokens = np.load(tok)
    assert tokens.shape == (9, 16) and tokens.dtype == np.int64 and tokens.min() >= 0 and tokens.max() < 64
    s = json.loads(stats.read_text())
    assert s["method"] == "ar" and s["backend"] == "torch" and s["num_images"] == 9
    assert s["tokens_per_image"] == 16 and s["mean_accepted_length"] == 1.0
    assert s["target_calls"] == 9 * 16  # one prefill + 15 steps per image
    assert s["labels"] == [0, 0, 0, 1, 1, 1, 4, 4, 4]
    assert 0 < s["decode_seconds"] <= s["total_seconds"]
    img = Image.open(out)
    # 3 rows x 3 columns of 8 px images upscaled x8 with 2 px padding
    assert img.size == (3 * 66 + 2, 3 * 66 + 2)


def test_same_seed_same_tokens_other_seed_other_tokens(tiny_model_dir, tmp_path):
    def tokens(seed: int, name: str) -> np.ndarray:
        path = tmp_path / f"{name}.npy"
        r = run(
            "--model",
            str(tiny_model_dir),
            "--class",
            "2",
            "-n",
            "2",
            "--seed",
            str(seed),
            "-o",
            str(tmp_path / "x.png"),
            "--save-tokens",
            str(path),
        )
        assert r.exit_code == 0, r.output
        return np.load(path)

    a, b, c = tokens(1, "a"), tokens(1, "b"), tokens(2, "c")
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a[0], a[1])  # images of one run differ


def test_save_tokens_npz_holds_codes_and_labels(tiny_model_dir, tmp_path):
    """A .npz holds the same tokens as the .npy of an identical run, with their class ids:
    the format of 'train-drafter --codes'."""

    def save(name: str) -> Path:
        path = tmp_path / name
        args = ["--model", str(tiny_model_dir), "--class", "2,0", "-n", "2", "-o", str(tmp_path / "x.png")]
        r = run(*args, "--save-tokens", str(path))
        assert r.exit_code == 0, r.output
        return path

    tokens = np.load(save("t.npy"))
    with np.load(save("t.npz")) as data:
        assert sorted(data.files) == ["codes", "labels"]
        assert np.array_equal(data["codes"], tokens)
        assert data["labels"].tolist() == [2, 2, 0, 0]
    r = run(
        "--model",
        str(tiny_model_dir),
        "-o",
        str(tmp_path / "y.png"),
        "--save-tokens",
        str(tmp_path / "t.txt"),
    )
    assert r.exit_code != 0 and "must end in .npy or .npz" in r.output


def test_greedy_matches_argmax_of_full_forward(tiny_model_dir, tmp_path):
    """Greedy AR through the cached runtime equals argmax decoding with full forwards."""
    path = tmp_path / "g.npy"
    r = run(
        "--model",
        str(tiny_model_dir),
        "--class",
        "3",
        "-n",
        "1",
        "--greedy",
        "--cfg-scale",
        "2",
        "-o",
        str(tmp_path / "x.png"),
        "--save-tokens",
        str(path),
    )
    assert r.exit_code == 0, r.output
    model = tiny_gpt()
    seq = torch.zeros(0, dtype=torch.long)
    with torch.no_grad():
        for _ in range(16):
            logits = model(seq.expand(2, -1), torch.tensor([3, 5]))[:, -1]
            mixed = logits[1] + 2.0 * (logits[0] - logits[1])
            seq = torch.cat([seq, mixed.argmax().view(1)])
    assert np.array_equal(np.load(path)[0], seq.numpy())


def corrupt(md: Path) -> None:
    (md / "gpt.safetensors").write_bytes(b"\x00garbage" * 10)


def other_architecture(md: Path) -> None:
    cfg = json.loads((md / "config.json").read_text())
    cfg["gpt"]["n_layer"] = 3
    (md / "config.json").write_text(json.dumps(cfg))


def corrupt_pt(md: Path) -> None:
    cfg = json.loads((md / "config.json").read_text())
    cfg["files"]["gpt"] = "broken.pt"
    (md / "config.json").write_text(json.dumps(cfg))
    (md / "broken.pt").write_bytes(b"PK\x03\x04 not really a zip")


def missing_weights(md: Path) -> None:
    (md / "gpt.safetensors").unlink()


BAD = {
    "unknown class id": (["--class", "7"], None, "out of range"),
    "unknown class name": (["--class", "boots"], None, "unknown class"),
    "negative cfg": (["--cfg-scale", "-1"], None, "CFG scale"),
    "nan cfg": (["--cfg-scale", "nan"], None, "CFG scale"),
    "top-p zero": (["--top-p", "0"], None, "top-p"),
    "top-p above one": (["--top-p", "1.5"], None, "top-p"),
    "corrupt safetensors": ([], corrupt, "cannot read"),
    "corrupt pt": ([], corrupt_pt, "cannot read"),
    "missing checkpoint": ([], missing_weights, "not found"),
    "other architecture": ([], other_architecture, "missing keys: layers.2"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_no_output(tiny_model_dir, tmp_path, case):
    args, damage, message = BAD[case]
    if damage:
        damage(tiny_model_dir)
    out = tmp_path / "never.png"
    r = run("--model", str(tiny_model_dir), "-o", str(out), "--stats-json", str(tmp_path / "s.json"), *args)
    assert r.exit_code == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert not out.exists() and not (tmp_path / "s.json").exists()
    assert list(tmp_path.glob(".never*")) == []


def test_missing_model_dir_and_unwritable_outputs(tiny_model_dir, tmp_path):
    r = run("--model", str(tmp_path / "nope"), "-o", str(tmp_path / "x.png"))
    assert r.exit_code == 2 and "model directory not found" in r.stderr
    r = run("--model", str(tiny_model_dir), "-o", str(tmp_path / "no" / "such" / "x.png"))
    assert r.exit_code == 2 and "does not exist" in r.stderr
    r = run("--model", str(tiny_model_dir), "-o", str(tmp_path))
    assert r.exit_code == 2 and "is a folder" in r.stderr
    r = run(
        "--model",
        str(tiny_model_dir),
        "-o",
        str(tmp_path / "x.png"),
        "--save-tokens",
        str(tmp_path / "t.txt"),
    )
    assert r.exit_code == 2 and ".npy" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_bundle_from_another_format_version(tmp_path):
    md = write_model_dir(tmp_path / "m", tiny_gpt(), tiny_vq())
    cfg = json.loads((md / "config.json").read_text())
    cfg["format_version"] = 99
    (md / "config.json").write_text(json.dumps(cfg))
    r = run("--model", str(md), "-o", str(tmp_path / "x.png"))
    assert r.exit_code == 2 and "format version 99" in r.stderr


def test_train_drafter_reads_several_codes_files(tiny_model_dir, tmp_path):
    """Repeated --codes files are trained on together; files of other token counts, or a
    missing file, are refused with a one-line error and no drafter written."""
    from lantern_rt.training.codes_files import join_codes_files

    rng = np.random.default_rng(0)
    a, b, short = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "short.npz"
    np.savez(a, codes=rng.integers(0, 64, (3, 16)), labels=np.array([0, 1, 2]))
    np.savez(b, codes=rng.integers(0, 64, (2, 16)), labels=np.array([3, 4]))
    np.savez(short, codes=rng.integers(0, 64, (2, 9)), labels=np.array([3, 4]))
    codes, values = join_codes_files((a, b))
    with np.load(a) as da, np.load(b) as db:
        assert np.array_equal(codes, np.concatenate([da["codes"], db["codes"]]))
    assert [(path, v.tolist()) for path, v in values] == [(a, [0, 1, 2]), (b, [3, 4])]

    def train(out: str, *files: Path):
        args = ["train-drafter", "--model", str(tiny_model_dir), "--out", str(tmp_path / out), "--steps", "2"]
        return CliRunner().invoke(main, [*args, "--batch", "2", *(f"--codes={f}" for f in files)])

    r = train("ok", a, b)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "ok" / "drafter.safetensors").is_file()
    for files, message in (
        ((a, short), "different token counts: [9, 16]"),
        ((a, tmp_path / "x.npz"), "not found"),
    ):
        r = train("bad", *files)
        assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output
        assert not (tmp_path / "bad" / "drafter.safetensors").exists()


def test_package_version_without_an_installed_distribution(monkeypatch):
    """A checkout run from PYTHONPATH (the GPU machine cannot pip install) still has a version:
    the one in pyproject.toml, which export writes into manifests and the bundle cache keys on."""
    import importlib.metadata

    from lantern_rt import version

    installed = version.package_version()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert version.package_version() == installed  # pyproject.toml says the same as the install
    monkeypatch.setattr(version, "PYPROJECT", version.PYPROJECT.with_name("no-such-file.toml"))
    assert version.package_version() == "unknown"


def test_a_bundle_with_a_model_is_one_line_exit_2(tiny_model_dir, tmp_path):
    """A bundle and a model directory together are refused before anything is opened (a bundle
    with a drafter: tests/test_run_options.py)."""
    bundle = tmp_path / "no-bundle"
    for args, says in (
        (["generate", "--bundle", str(bundle), "--model", str(tiny_model_dir)], "drop --model"),
        (
            ["bench", "--bundle", str(bundle), "--model", str(tiny_model_dir), "--out", str(tmp_path / "b")],
            "drop --model",
        ),
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and says in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, says",
    [
        (["generate", "--seed", "-1"], "'--seed'"),
        (["bench", "--seed", "-3", "--out", "unused"], "'--seed'"),
        (["generate", "-n", "100000000000"], "'--num-images'"),
        (["generate", "--temperature", "abc"], "'--temperature'"),
        (["generate", "--bogus"], "No such option '--bogus'"),
        (["export"], "Missing option '--out'"),
        (["no-such-command"], "No such command"),
        (["generate", "--device", "bogus"], "--device 'bogus' is not a torch device"),
    ],
)
def test_bad_arguments_are_one_line_exit_2_before_any_work(args, says, tmp_path):
    """click's usage errors too (not its usage, hint and error lines), and a device that does
    not exist; nothing is written."""
    out = tmp_path / "g.png"
    result = CliRunner().invoke(main, [*args, *(["-o", str(out)] if args[0] == "generate" else [])])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("error: ") and says in result.output
    assert not out.exists() and not (tmp_path / "unused").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_device_without_cuda_is_refused():
    result = CliRunner().invoke(main, ["generate", "--device", "cuda", "-q"])
    assert result.exit_code == 2 and "no CUDA device" in result.output and result.output.count("\n") == 1


def test_help_and_version_still_exit_0():
    for args in (["--help"], ["generate", "--help"], ["--version"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and result.output.strip(), args


def test_outputs_that_are_links_devices_or_on_a_refusing_file_system_are_refused(tmp_path):
    """Refused in one line before any work, and nothing at the path is replaced."""
    target = tmp_path / "target.png"
    target.write_bytes(b"mine")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    for out in (link, Path("/dev/null"), Path("/proc/x.png")):
        result = CliRunner().invoke(main, ["generate", "-q", "-o", str(out)])
        assert result.exit_code == 2 and result.output.count("\n") == 1, (out, result.output)
        assert result.output.startswith(f"error: cannot write image {out}")
    assert link.is_symlink() and target.read_bytes() == b"mine"
    assert Path("/dev/null").is_char_device()


def test_a_write_that_fails_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk (ENOSPC while the file is written) is a WriteError: no partial file, no
    temporary file left behind."""
    import errno

    from lantern_rt.fileio import WriteError, atomic_write

    def full(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WriteError, match="cannot write .*out.json: No space left on device"):
        atomic_write(tmp_path / "out.json", full)
    assert list(tmp_path.iterdir()) == []
