"""Every file a command reads is validated (issue 18): a bad model directory, drafter config,
checkpoint, neighbour table, tree file or training input is one line ``error: ...`` naming the
file and the field, exit code 2, and nothing written: not even in the export cache, which a model
directory on onnxruntime is exported into (issue 46)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from lantern_rt.cli import main
from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.neighbors import latent_neighbors, save_neighbors
from tests.conftest import randomize, tiny_gpt, tiny_vq, write_model_dir


class Custom:
    """A Python object weights-only loading refuses."""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model directory with a drafter folder and a stored neighbour table; copied, never edited."""
    target, vq = tiny_gpt(), tiny_vq()
    root = write_model_dir(tmp_path_factory.mktemp("faults") / "model", target, vq)
    drafter = randomize(Drafter(DrafterConfig.for_target(target.config), target.config), 1)
    (root / "drafter").mkdir()
    save_safetensors(drafter, root / "drafter" / "drafter.safetensors")
    (root / "drafter" / "config.json").write_text(json.dumps(dataclasses.asdict(drafter.config)))
    save_neighbors(latent_neighbors(vq.quantize.codebook(), 12), root / "neighbors.npy")
    config = json.loads((root / "config.json").read_text())
    config["files"] |= {"drafter": "drafter", "neighbors": "neighbors.npy"}
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def model(base: Path, tmp_path: Path) -> Path:
    """A fresh copy of ``base`` to spoil."""
    return Path(shutil.copytree(base, tmp_path / "model"))


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The export cache of every run in a test (``$LANTERN_CACHE``): :func:`fails` checks that a
    refused input created nothing there."""
    path = tmp_path / "cache"
    monkeypatch.setenv("LANTERN_CACHE", str(path))
    return path


def edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def fails(args: list[str], *words: str, absent: Path | None = None) -> str:
    """Run the CLI: exit 2, one line ``error: ...`` holding every word, and neither ``absent``
    nor the export cache (no lock, no folder) created."""
    result = CliRunner().invoke(main, args)
    out = result.output
    assert result.exit_code == 2, out
    assert out.startswith("error: ") and out.count("\n") == 1 and "Traceback" not in out, out
    for word in words:
        assert word in out, out
    assert absent is None or not absent.exists()
    cache = Path(os.environ["LANTERN_CACHE"])
    assert not cache.exists(), sorted(cache.rglob("*"))
    return out


def generate(model: Path, tmp_path: Path, *extra: str, backend: str = "torch") -> list[str]:
    """``lantern generate`` of one image on ``backend`` into tmp_path/x.png."""
    return [
        "generate",
        "-q",
        "--backend",
        backend,
        "--model",
        str(model),
        "-o",
        str(tmp_path / "x.png"),
        *extra,
    ]


SPECULATIVE = ("--method", "lantern++", "--tree", "chain-2")
# the torch backend loads the model directory; onnxruntime exports it into the cache first
LOADED_BY = pytest.mark.parametrize("backend", ["torch", "onnxruntime"])


# ---- 1. the model directory's config.json ----------------------------------------------------------

RAW_CONFIGS = {
    "a-json-list": (b"[1, 2]", "holds a JSON list"),
    "binary-garbage": (b"\xff\xfe\x00\x81garbage", "not UTF-8"),
    "not-json": (b'{"gpt": ', "not valid JSON"),
    "deeply-nested": (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
}


@pytest.mark.parametrize("raw, message", RAW_CONFIGS.values(), ids=RAW_CONFIGS)
def test_config_json_that_is_not_an_object(model, tmp_path, raw, message):
    (model / "config.json").write_bytes(raw)
    fails(generate(model, tmp_path), str(model / "config.json"), message, absent=tmp_path / "x.png")


def test_config_json_that_is_a_folder(model, tmp_path):
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    fails(generate(model, tmp_path), str(model / "config.json"), "is a folder", absent=tmp_path / "x.png")


def _set(section: str | None, key: str, value) -> Callable[[dict], None]:
    return lambda c: (c[section] if section else c).__setitem__(key, value)


# config edit -> what the error says (after the config file's path)
BAD_FIELDS = {
    "n_head-0": (_set("gpt", "n_head", 0), "GPTConfig.n_head must be an integer >= 1, got 0"),
    "dim-negative": (_set("gpt", "dim", -32), "GPTConfig.dim must be an integer >= 1, got -32"),
    "n_layer-0": (_set("gpt", "n_layer", 0), "GPTConfig.n_layer must be an integer >= 1"),
    "vocab-0": (_set("gpt", "vocab_size", 0), "GPTConfig.vocab_size must be an integer >= 1"),
    "block_size-negative": (_set("gpt", "block_size", -16), "GPTConfig.block_size must be an integer >= 1"),
    "cls_token_num-0": (_set("gpt", "cls_token_num", 0), "GPTConfig.cls_token_num must be an integer >= 1"),
    "num_classes-0": (_set("gpt", "num_classes", 0), "GPTConfig.num_classes must be an integer >= 1"),
    "dropout-2": (_set("gpt", "resid_dropout_p", 2.0), "GPTConfig.resid_dropout_p must be a probability"),
    "norm_eps-nan": (_set("gpt", "norm_eps", float("nan")), "GPTConfig.norm_eps must be float, got nan"),
    "codebook-negative": (_set("vq", "codebook_size", -64), "VQConfig.codebook_size must be an integer >= 1"),
    "ch_mult-empty": (_set("vq", "decoder_ch_mult", []), "VQConfig.decoder_ch_mult must be a non-empty list"),
    "dim-not-divisible": (_set("gpt", "dim", 33), "dim 33 is not divisible by n_head 2"),
    "kv-not-divisible": (_set("gpt", "n_kv_head", 3), "n_head 2 is not a multiple of n_kv_head 3"),
    "preset-a-list": (_set("gpt", "preset", ["GPT-B"]), "unknown GPT preset ['GPT-B']"),
    "class_names-a-string": (_set(None, "class_names", "abc"), "class_names must be a list of strings"),
    "class_names-ints": (_set(None, "class_names", [1, 2, 3, 4, 5]), "class_names must be a list of strings"),
    "class_names-too-few": (
        _set(None, "class_names", ["a", "b"]),
        "class_names has 2 names for gpt.num_classes 5",
    ),
    "file-an-int": (lambda c: c["files"].update(gpt=5), "files.gpt must be a file name, got 5"),
    "file-absolute": (lambda c: c["files"].update(gpt="/etc/passwd"), "files.gpt '/etc/passwd' is outside"),
    "file-dotdot": (lambda c: c["files"].update(vq="../model/vq.safetensors"), "files.vq '../model/vq"),
    "image_size-a-string": (_set(None, "image_size", "8"), "image_size must be an integer, got '8'"),
    "image_size-a-float": (_set(None, "image_size", 8.0), "image_size must be an integer, got 8.0"),
    "format_version-a-string": (
        _set(None, "format_version", "1"),
        "format_version must be an integer, got '1'",
    ),
    "format_version-a-bool": (
        _set(None, "format_version", True),
        "format_version must be an integer, got True",
    ),
    "sampling_defaults-a-list": (
        _set(None, "sampling_defaults", [3.0]),
        "sampling_defaults must be an object",
    ),
    "sampling_defaults-unknown": (
        _set(None, "sampling_defaults", {"cfg": 3.0}),
        "sampling_defaults.cfg is unknown",
    ),
    "sampling_defaults-nan": (
        _set(None, "sampling_defaults", {"cfg_scale": float("nan")}),
        "sampling_defaults.cfg_scale must be a finite number, got nan",
    ),
    "hf_config-dotdot": (
        _set("gpt", "hf_config", "../elsewhere/config.json"),
        "gpt.hf_config '../elsewhere/config.json' is outside",
    ),
}


@pytest.mark.parametrize("edit, message", BAD_FIELDS.values(), ids=BAD_FIELDS)
def test_config_json_fields_are_checked(model, tmp_path, edit, message):
    edit_json(model / "config.json", edit)
    fails(generate(model, tmp_path), f"{model / 'config.json'}: ", message, absent=tmp_path / "x.png")


# ---- 2. the drafter's config ------------------------------------------------------------------------

DRAFTER_FIELDS = {
    "heads-0": ("num_attention_heads", 0, "DrafterConfig.num_attention_heads must be an integer >= 1, got 0"),
    "hidden-a-string": ("hidden_size", "32", "DrafterConfig.hidden_size must be int, got '32'"),
    "ffn-negative": ("intermediate_size", -40, "DrafterConfig.intermediate_size must be an integer >= 1"),
    "layers-0": ("num_hidden_layers", 0, "DrafterConfig.num_hidden_layers must be an integer >= 1"),
    "kv-not-divisible": ("num_key_value_heads", 3, "num_attention_heads 2 is not a multiple of"),
    "bias-a-string": ("bias", "yes", "DrafterConfig.bias must be bool"),
}


@LOADED_BY
@pytest.mark.parametrize("key, value, message", DRAFTER_FIELDS.values(), ids=DRAFTER_FIELDS)
def test_drafter_config_fields_are_checked(model, tmp_path, key, value, message, backend):
    config = model / "drafter" / "config.json"
    edit_json(config, _set(None, key, value))
    fails(
        generate(model, tmp_path, *SPECULATIVE, backend=backend),
        f"{config}: drafter config: ",
        message,
        absent=tmp_path / "x.png",
    )


def test_drafter_config_that_is_a_list(model, tmp_path):
    (model / "drafter" / "config.json").write_text("[]")
    fails(generate(model, tmp_path, *SPECULATIVE), "drafter", "config.json holds a JSON list")


# ---- 3. checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "file, what",
    [
        ("gpt.safetensors", "target"),
        ("vq.safetensors", "tokenizer"),
        ("drafter/drafter.safetensors", "drafter"),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@LOADED_BY
def test_non_finite_weights_are_refused(model, tmp_path, file, what, bad, backend):
    state = load_file(model / file)
    key = sorted(k for k, v in state.items() if v.is_floating_point())[1]
    state[key].view(-1)[3] = bad
    save_file(state, model / file)
    fails(
        generate(model, tmp_path, *SPECULATIVE, backend=backend),
        f"{what} checkpoint {model / file} holds NaN or infinite values (first in {key})",
        absent=tmp_path / "x.png",
    )


def test_export_refuses_non_finite_weights_and_writes_nothing(model, tmp_path):
    state = load_file(model / "gpt.safetensors")
    state["output.weight"][0, 0] = float("nan")
    save_file(state, model / "gpt.safetensors")
    out = tmp_path / "exports" / "bundle"
    out.parent.mkdir()
    fails(["export", "-q", "--model", str(model), "--tree", "chain-1", "--out", str(out)], "output.weight")
    assert list(out.parent.iterdir()) == []


@LOADED_BY
def test_a_pickle_of_python_objects_is_refused_without_torch_advice(model, tmp_path, backend):
    torch.save({"model": Custom()}, model / "gpt.pt")
    edit_json(model / "config.json", lambda c: c["files"].update(gpt="gpt.pt"))
    out = fails(
        generate(model, tmp_path, backend=backend),
        f"cannot read {model / 'gpt.pt'}: it holds Python objects that are not tensors",
        "Custom",
        "not unpickled",
        "state dict of tensors",
        "safetensors",
        absent=tmp_path / "x.png",
    )
    assert "weights_only" not in out and "likely succeed" not in out


# ---- 4. neighbour tables ----------------------------------------------------------------------------


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


NEIGHBOR_TABLES = {
    "truncated": (_truncated, "cannot read neighbour table"),
    "object-array": (lambda p: np.save(p, np.array([None] * 64), allow_pickle=True), "Object arrays"),
    "one-dimensional": (
        lambda p: np.save(p, np.arange(64)),
        "must be an integer array [codes, k], got int64 [64]",
    ),
    "floats": (lambda p: np.save(p, np.zeros((64, 12))), "must be an integer array [codes, k], got float64"),
    "code-64": (lambda p: np.save(p, np.full((64, 12), 64)), "holds codes 64..64, outside 0..63"),
    "negative": (lambda p: np.save(p, np.full((64, 12), -1)), "holds codes -1..-1, outside 0..63"),
    "fewer-rows": (lambda p: np.save(p, np.zeros((32, 12), np.uint16)), "has 32 rows for a codebook of 64"),
}


@LOADED_BY
@pytest.mark.parametrize("spoil, message", NEIGHBOR_TABLES.values(), ids=NEIGHBOR_TABLES)
def test_neighbour_tables_are_checked(model, tmp_path, spoil, message, backend):
    spoil(model / "neighbors.npy")
    fails(
        generate(model, tmp_path, *SPECULATIVE, backend=backend),
        str(model / "neighbors.npy"),
        message,
        absent=tmp_path / "x.png",
    )


# ---- 5. tree files ----------------------------------------------------------------------------------

TREE_FILES = {
    "deeply-nested": (b"[" * 100_000 + b"]" * 100_000, "nests lists too deeply"),
    "a-string-rank": (b'[[0], ["1"]]', "ranks must be integers >= 0, got path ['1']"),
    "a-bool-rank": (b"[[true]]", "ranks must be integers >= 0, got path [True]"),
    "a-float-rank": (b"[[0], [1.0]]", "ranks must be integers >= 0, got path [1.0]"),
    "a-negative-rank": (b"[[0], [0, -1]]", "ranks must be integers >= 0, got path [0, -1]"),
    "too-many-nodes": (json.dumps([[0]] + [[0, i] for i in range(1100)]).encode(), "at most 1024 paths"),
    "over-1-mib": (b" " * (1 << 20) + b"[[0]]", "is over 1 MiB"),
    "not-json": (b"[[0],", "is not valid JSON"),
    "not-utf-8": (b"\xff\xfe[[0]]", "not UTF-8"),
}


@pytest.mark.parametrize("raw, message", TREE_FILES.values(), ids=TREE_FILES)
def test_tree_files_are_checked(base, tmp_path, raw, message):
    tree = tmp_path / "tree.json"
    tree.write_bytes(raw)
    args = generate(base, tmp_path, "--method", "lantern++", "--tree", str(tree))
    fails(args, f"tree file {tree}", message, absent=tmp_path / "x.png")


# ---- 6. train-drafter -------------------------------------------------------------------------------


def train(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train-drafter", "--model", str(model), "--out", str(out), "--steps", "2", "--batch", "2", *extra]


def _codes(path: Path, codes, labels=None) -> Path:
    codes = np.asarray(codes)
    np.savez(
        path, codes=codes, labels=np.zeros(len(codes), np.int64) if labels is None else np.asarray(labels)
    )
    return path


def _npy(path: Path, array: np.ndarray) -> None:
    with path.open("wb") as f:  # np.save(path) would add ".npy"
        np.save(f, array)


GOOD = np.arange(48).reshape(3, 16) % 64
CODES_FILES = {
    "code-64": (lambda p: _codes(p, GOOD + 17), "'codes' holds 17..64, outside 0..63 of this model"),
    "code-negative": (lambda p: _codes(p, GOOD - 1), "'codes' holds -1..46, outside 0..63"),
    "nan-codes": (
        lambda p: _codes(p, np.full((3, 16), np.nan)),
        "'codes' must be integers [N, tokens], got float64",
    ),
    "no-images": (lambda p: _codes(p, np.zeros((0, 16), np.int64)), "hold 0 and 0 images"),
    "short-images": (lambda p: _codes(p, [[8, 7]]), "images of 2 tokens; this model's are 16"),
    "one-dimensional": (lambda p: _codes(p, [8, 7]), "'codes' must be integers [N, tokens], got int64 [2]"),
    "label-5": (lambda p: _codes(p, GOOD, [0, 1, 5]), "'labels' holds 0..5, outside 0..4"),
    "label-negative": (lambda p: _codes(p, GOOD, [0, -1, 2]), "'labels' holds -1..2, outside 0..4"),
    "labels-too-few": (lambda p: _codes(p, GOOD, [0, 1]), "hold 3 and 2 images"),
    "labels-2d": (
        lambda p: _codes(p, GOOD, [[0], [1], [2]]),
        "'labels' must be integers [N], got int64 [3, 1]",
    ),
    "truncated": (lambda p: p.write_bytes(_codes(p, GOOD).read_bytes()[:-30]), "cannot read"),
    "object-arrays": (
        lambda p: np.savez(p, codes=np.array([None] * 3), labels=np.zeros(3)),
        "it holds Python objects",
    ),
    "no-labels": (lambda p: np.savez(p, codes=GOOD), "expected an .npz with 'codes' and 'labels'"),
    "an-npy": (lambda p: _npy(p, GOOD), "it is one array, not an .npz archive"),
}


@pytest.mark.parametrize("write, message", CODES_FILES.values(), ids=CODES_FILES)
def test_train_drafter_checks_its_codes_before_making_out(base, tmp_path, write, message):
    codes = tmp_path / "codes.npz"
    write(codes)
    out = tmp_path / "runs" / "drafter"
    fails(train(base, out, f"--codes={codes}"), str(codes), message, absent=tmp_path / "runs")


@pytest.mark.parametrize(
    "lr, message",
    [("nan", "--lr must be a finite number, got nan"), ("inf", "--lr must be a finite number"), ("0", "x>0")],
)
def test_train_drafter_checks_the_learning_rate_first(base, tmp_path, lr, message):
    codes = _codes(tmp_path / "codes.npz", GOOD)
    fails(train(base, tmp_path / "out", f"--codes={codes}", "--lr", lr), message, absent=tmp_path / "out")


def test_a_failed_train_drafter_leaves_an_existing_out_as_it_was(base, tmp_path):
    codes = _codes(tmp_path / "codes.npz", GOOD + 40)
    out = tmp_path / "out"
    out.mkdir()
    fails(train(base, out, f"--codes={codes}"), "outside 0..63")
    assert list(out.iterdir()) == []


TRAIN_STATES = {
    "garbage": (lambda p: p.write_bytes(b"\x80\x02garbage"), "cannot read"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:200]), "cannot read"),
    "python-objects": (lambda p: torch.save({"model": Custom()}, p), "Python objects that are not tensors"),
    "not-a-state": (lambda p: torch.save({"step": 1}, p), "is not a drafter training state"),
    "negative-step": (lambda p: _edit_state(p, step=-1), "step must be an integer >= 0, got -1"),
    "nan-weights": (lambda p: _edit_state(p, nan=True), "holds NaN or infinite values (first in fc.weight)"),
    "other-model": (
        lambda p: _edit_state(p, model={"fc.weight": torch.zeros(2)}),
        "does not match its config",
    ),
    "other-optimizer": (
        lambda p: _edit_state(p, optim={"state": {}, "param_groups": []}),
        "optim does not fit",
    ),
}


def _edit_state(path: Path, nan: bool = False, **fields) -> None:
    state = torch.load(path, weights_only=True)
    if nan:
        state["model"]["fc.weight"][0, 0] = float("nan")
    torch.save(state | fields, path)


@pytest.fixture(scope="module")
def trained(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(codes file, --out folder of a 2-step run) for the resume tests to copy."""
    root = tmp_path_factory.mktemp("trained")
    codes = _codes(root / "codes.npz", GOOD, [0, 1, 2])
    result = CliRunner().invoke(main, train(base, root / "out", f"--codes={codes}"))
    assert result.exit_code == 0, result.output
    return codes, root / "out"


def test_train_drafter_resumes_from_its_state(base, trained, tmp_path):
    codes, done = trained
    out = Path(shutil.copytree(done, tmp_path / "out"))
    result = CliRunner().invoke(main, train(base, out, f"--codes={codes}", "--steps", "3"))  # the last wins
    assert result.exit_code == 0, result.output
    assert torch.load(out / "train_state.pt", weights_only=True)["step"] == 3


@pytest.mark.parametrize("spoil, message", TRAIN_STATES.values(), ids=TRAIN_STATES)
def test_a_corrupt_train_state_is_refused_and_out_left_as_it_was(base, trained, tmp_path, spoil, message):
    codes, done = trained
    out = Path(shutil.copytree(done, tmp_path / "out"))
    spoil(out / "train_state.pt")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fails(train(base, out, f"--codes={codes}"), str(out / "train_state.pt"), message)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_generate_set_refuses_a_bad_model_before_its_export(model, tmp_path):
    """``generate-set`` exports a model directory (for its workers) as ``generate`` does."""
    _truncated(model / "neighbors.npy")
    out = tmp_path / "set"
    args = [
        "generate-set",
        "-q",
        "--backend",
        "onnxruntime",
        "--model",
        str(model),
        "-n",
        "1",
        "--out",
        str(out),
    ]
    fails([*args, *SPECULATIVE], str(model / "neighbors.npy"), "cannot read neighbour table", absent=out)
