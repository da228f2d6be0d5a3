"""``lantern bench``: config specs, the interleaved run order, the numbers it reports, its files."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from lantern_rt.cli import main
from lantern_rt.eval.bench import (
    BenchSettings,
    Measurement,
    add_speedups,
    chunk_size,
    expand_configs,
    mean_accepted_length,
    method_config,
    parse_config,
    run_bench,
    run_interleaved,
)
from lantern_rt.eval.classifier import FashionClassifier
from lantern_rt.eval.report import markdown_table, nice_ticks, row_label, speed_table
from lantern_rt.generate import Generation
from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.config import ConfigError, VQConfig
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.vq import VQModel
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig
from lantern_rt.stats import GenerationStats
from tests.conftest import TINY_VQ, randomize, tiny_gpt, tiny_vq, write_model_dir

PLOTS = ("quality_vs_speedup.png", "accepted_lengths.png")


def model_with_drafter(root: Path, vq: VQModel, **gpt: int) -> Path:
    """A tiny model directory whose config names a drafter file (``drafter.safetensors``)."""
    target = tiny_gpt(**gpt)
    write_model_dir(root, target, vq)
    config = DrafterConfig.for_target(target.config)
    drafter = randomize(Drafter(config, target.config), 1)
    drafter.embed_tokens.weight.data.copy_(target.tok_embeddings.weight)
    save_safetensors(drafter, root / "drafter.safetensors")
    raw = json.loads((root / "config.json").read_text())
    raw["files"]["drafter"] = "drafter.safetensors"
    raw["drafter"] = config.__dict__
    (root / "config.json").write_text(json.dumps(raw))
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_with_drafter(tmp_path_factory.mktemp("bench") / "tiny", tiny_vq())


T = "naive_extend_57"  # the tree a config gets when it names none


# --- config specs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("ar", MethodConfig("ar")),
        ("exact:tree=chain-3", MethodConfig("exact", tree="chain-3")),
        ("lantern", MethodConfig("lantern", tree=T, k=1000, delta=0.1)),
        ("lantern:k=20,delta=0.05", MethodConfig("lantern", tree=T, k=20, delta=0.05)),
        ("lantern++", MethodConfig("lantern++", tree=T, k=10, lam=5.0)),
        (
            " lantern++: k=5 , lambda=20, tree=mc_sim_7b_63",
            MethodConfig("lantern++", "mc_sim_7b_63", 5, lam=20.0),
        ),
    ],
)
def test_good_specs(spec, expected):
    assert method_config(spec, T) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "unknown method ''"),
        ("medusa", "unknown method 'medusa'"),
        ("ar:k=3", "ar, which takes no parameters"),
        ("exact:k=3", "exact, which takes tree"),
        ("lantern:lambda=5", "'lambda' is not a parameter of lantern, which takes tree, k, delta"),
        ("lantern++:k", "'k' is not key=value"),
        ("lantern++:k=ten", "k needs an integer, got 'ten'"),
        ("lantern++:k=", "k needs an integer, got ''"),
        ("lantern:k=3,k=4", "k is given twice"),
        ("lantern:delta=2", "delta must be in [0, 1]"),
        ("lantern++:lambda=0.5", "lambda must be a finite number >= 1"),
        ("lantern++:k=-1", "k must be an integer >= 0"),
        ("exact:tree=no-such-tree", "--config 'exact:tree=no-such-tree'"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(ConfigError) as err:
        method_config(spec, "naive_extend_57")
    assert message in str(err.value)


def test_parse_keeps_only_named_parameters():
    assert parse_config("lantern++:lambda=10") == ("lantern++", {"lambda": 10.0})


def test_configs_cross_trees_ar_first_without_repeats():
    configs = expand_configs(
        ["exact", "ar", "lantern++:tree=chain-2", "exact:tree=chain-3"], ["chain-3", "chain-4"]
    )
    assert configs == [
        MethodConfig("ar", tree="chain-3"),  # on the first tree's bundle, listed once
        MethodConfig("exact", tree="chain-3"),
        MethodConfig("exact", tree="chain-4"),
        MethodConfig("lantern++", tree="chain-2"),
    ]


def test_bad_spec_is_one_line_exit_2(tmp_path):
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["bench", "--config", "lantern++:lambda=x", "--out", str(out)])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and r.output.startswith("error: --config")
    assert not out.exists()


def test_bench_takes_generate_s_run_options(tmp_path):
    """bench shares generate's option decorators: --top-k, --top-p, --device and --cuda-graphs
    parse, and are checked as generate checks them (one line, exit 2, nothing written); its
    --backend lists the registry's backends and refuses torch a bundle in the registry's words."""
    import torch

    from lantern_rt.cli.bench import bench_cmd
    from lantern_rt.cli.generate import generate

    shared = {"--top-k", "--top-p", "--device", "--cuda-graphs", "--cfg-scale", "--temperature", "--seed"}
    for command in (bench_cmd, generate):
        assert shared <= {name for p in command.params for name in p.opts}
    out = tmp_path / "never"
    if not torch.cuda.is_available():
        r = CliRunner().invoke(main, ["bench", "--device", "cuda", "--no-quality", "--out", str(out)])
        assert r.exit_code == 2 and "this machine has no CUDA device" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", "--device", "tpu", "--out", str(out)])
    assert r.exit_code == 2 and "is not a torch device" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", "--top-p", "2", "--out", str(out)])
    assert r.exit_code == 2 and r.output.startswith("error: top-p must be in (0, 1]"), r.output
    r = CliRunner().invoke(
        main, ["bench", "--bundle", str(tmp_path), "--backend", "torch", "--out", str(out)]
    )
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0, r.output
    assert not out.exists()


# --- the run order and the numbers ---------------------------------------------------------


def test_run_is_chunk_major_with_warmup_first():
    """Every configuration generates a chunk of images before any generates the next; the
    warm-up chunk (untimed, past the timed range) comes first; a short last chunk works."""
    calls = []

    def fake_generate(pipe, labels, sampling, seed, progress, start_index):
        calls.append((pipe.name, start_index, list(labels)))
        n = len(labels)
        stats = GenerationStats(
            model="m",
            method="ar",
            params={},
            tree=None,
            backend="torch",
            device="cpu",
            tokens_per_image=4,
            accepted=[1, 1, 1] * n,
            seconds_per_image=[0.1] * n,
            vq_decode_seconds=0.0,
            total_seconds=0.2 * n,
            seed=seed,
            sampling=sampling,
            labels=list(labels),
        )
        return Generation(labels, torch.zeros(n, 4), np.zeros((n, 2, 2, 1), np.uint8), stats)

    pipes = [
        SimpleNamespace(name=n, backend="torch", method=MethodConfig(), batch_size=2, streams=[n])
        for n in "abc"
    ]
    sampling = SamplingConfig(cfg_scale=3.0)
    runs = [Measurement.of_pipeline(p, sampling, 0, fake_generate) for p in pipes]
    run_interleaved(runs, [7, 8, 9], warmup=1, chunk=2)
    warm = [(n, 3, [7, 8]) for n in "abc"]
    timed = [(n, 0, [7, 8]) for n in "abc"] + [(n, 2, [9]) for n in "abc"]
    assert calls == warm + timed
    for m in runs:
        assert m.seconds == pytest.approx([0.1, 0.1]) and m.end_to_end == pytest.approx([0.2, 0.2])
        assert m.histogram == {1: 9} and m.batch_size == 2 and m.streams == 1
    assert [chunk_size(sizes, n) for sizes, n in (([1, 4, 16], 100), ([1], 3), ([16], 8))] == [64, 3, 8]


def test_pure_numbers():
    assert mean_accepted_length({1: 2, 3: 2}) == 2.0 and mean_accepted_length({}) == 0.0
    rows = [
        {"method": "ar", "backend": "torch", "batch_size": 1, "seconds_per_image_all": [4.0, 2.0, 3.0]},
        {"method": "exact", "backend": "torch", "batch_size": 1, "seconds_per_image_all": [1.0, 2.0]},
        {"method": "ar", "backend": "onnxruntime", "batch_size": 1, "seconds_per_image_all": [1.0]},
        {"method": "ar", "backend": "torch", "batch_size": 4, "seconds_per_image_all": [0.5]},
        {"method": "exact", "backend": "torch", "batch_size": 4, "seconds_per_image_all": [1.0]},
        {"method": "exact", "backend": "other", "batch_size": 4, "seconds_per_image_all": [1.0]},
    ]
    assert [r["speedup_vs_ar"] for r in add_speedups(rows)] == [1.0, 2.0, 1.0, 1.0, 0.5, None]
    assert nice_ticks(0.0, 0.93) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(1.0, 1.0)[0] <= 0.9 and nice_ticks(1.0, 1.0)[-1] >= 1.1
    assert markdown_table(["a", "b"], [["1", "x|y"]]) == "| a | b |\n| --- | --- |\n| 1 | x\\|y |"
    row = {"method": "lantern++", "params": {"tree": "chain-3", "k": 5, "lambda": 10.0}, "tree": "chain-3"}
    assert row_label({**row, "backend": "torch"}) == "lantern++ k=5 lambda=10 [chain-3] / torch"
    assert row_label({**row, "backend": "torch", "batch_size": 16}).endswith("/ torch B=16")


# --- end to end ----------------------------------------------------------------------------


def test_bench_speed_only_files_and_numbers(model_dir, tmp_path):
    out = tmp_path / "bench"
    args = f"bench --model {model_dir} --backend torch --config ar --config lantern++:k=5,lambda=10"
    args += (
        f" --classes 0,e -n 3 --warmup 1 --no-quality --batch-size 2,1 --baseline torch-batched --out {out}"
    )
    r = CliRunner().invoke(main, args.split())
    assert r.exit_code == 0, r.output
    results = json.loads((out / "results.json").read_text())
    assert {"platform", "cpu_count", "torch", "onnxruntime"} <= results["machine"].keys()
    assert results["command"].startswith("lantern") and results["date"] and results["calibration"] == []
    assert results["settings"]["classes"] == [0, 4] and results["settings"]["batch_sizes"] == [1, 2]
    assert results["settings"]["images_per_call"] == 6  # every image (four batches would be 8)
    assert results["settings"]["rows_per_image"] == [2]  # CFG rows at the model's scale
    rows = results["rows"]
    assert [(r["method"], r["backend"], r["batch_size"]) for r in rows] == [
        ("ar", "torch", 1),
        ("lantern++", "torch", 1),
        ("ar", "torch", 2),
        ("lantern++", "torch", 2),
        ("ar", "torch-batched", 1),
        ("ar", "torch-batched", 2),
    ]
    ars = {r["batch_size"]: r for r in rows[:4] if r["method"] == "ar"}
    assert all(ar["mean_accepted_length"] == 1.0 for ar in ars.values())
    assert ars[1]["accepted_length_histogram"] == {"1": 6 * 15}
    for row in rows:
        times = row["seconds_per_image_all"]
        assert len(times) == 1 and row["num_images"] == 6  # one call
        assert row["seconds_per_image"] == statistics.median(times)
        assert row["images_per_second"] == pytest.approx(1 / row["seconds_per_image"])
        reference = ars[row["batch_size"]] if row["backend"] == "torch" else row
        assert row["speedup_vs_ar"] == pytest.approx(
            statistics.median(reference["seconds_per_image_all"]) / statistics.median(times)
        )
        assert row["mean_accepted_length"] == pytest.approx(
            mean_accepted_length({int(n): c for n, c in row["accepted_length_histogram"].items()})
        )
        assert row["fd_classifier"] is None and "--no-quality" in row["quality_note"]
        assert row["peak_memory_mb"] > 0
    assert rows[1]["params"] == {"tree": "chain-5", "k": 5, "lambda": 10.0}  # generate's CPU default
    # every committed token is counted: 15 per image after the prefill's
    hist = rows[1]["accepted_length_histogram"]
    assert sum(int(n) * c for n, c in hist.items()) == 6 * 15
    md = (out / "results.md").read_text()
    assert all(line in md for line in speed_table(rows).splitlines())
    assert md.count("| ar |") == 4 and md.count("| lantern++ | k=5 lambda=10 | chain-5 | torch |") == 2
    for name in PLOTS:
        with Image.open(out / name) as img:
            img.load()
            assert img.format == "PNG" and img.width > 100


def write_fashion_like(root: Path, n: int = 60) -> Path:
    """Random 28x28 images in Fashion-MNIST's idx.gz layout (the loader skips the headers)."""
    rng = np.random.default_rng(0)
    root.mkdir()
    for prefix in ("train", "t10k"):
        with gzip.open(root / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(bytes(16) + rng.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes())
        with gzip.open(root / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(bytes(8) + (np.arange(n) % 10).astype(np.uint8).tobytes())
    return root


def fashion_tiny(tmp_path: Path) -> Path:
    """A 10-class 32x32 greyscale model at ``tmp_path``/fashion-tiny (no class names, so the
    Fashion-MNIST classifier scores it) and a random classifier at ``tmp_path``/classifier.safetensors."""
    vq = VQModel(VQConfig(**{**TINY_VQ, "encoder_ch_mult": [1, 1, 1, 1], "decoder_ch_mult": [1, 1, 1, 1]}))
    model = model_with_drafter(tmp_path / "fashion-tiny", vq.eval(), num_classes=10)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "class_names": []}))
    torch.manual_seed(0)
    save_safetensors(FashionClassifier(), tmp_path / "classifier.safetensors")
    return model


def test_bench_quality_and_calibration(tmp_path):
    """A 10-class 32x32 greyscale model, a random classifier and a fake dataset: every quality field."""
    model = fashion_tiny(tmp_path)
    settings = BenchSettings(
        out=tmp_path / "out",
        model=model,
        backends=("torch",),
        configs=("exact:tree=chain-2",),
        num_images=1,
        classes=("0", "3", "5", "9"),
        warmup=0,
        classifier=tmp_path / "classifier.safetensors",
        data_root=write_fashion_like(tmp_path / "fashion"),
    )
    results = run_bench(settings)
    assert results["quality_note"] is None
    for row in results["rows"]:
        assert all(
            isinstance(row[k], float) for k in ("fd_classifier", "class_accuracy", "precision", "recall")
        )
    ar_row, exact_row = results["rows"]
    assert ar_row["fd_vs_ar"] is None and exact_row["fd_vs_ar"] > 0  # other draws than AR's
    calibration = {r["name"]: r for r in results["calibration"]}
    assert list(calibration) == [
        "real train subset",
        "VQ reconstruction",
        "AR seed 0 (torch)",
        "AR seed 1 (torch)",
    ]
    assert calibration["AR seed 0 (torch)"]["fd_classifier"] == results["rows"][0]["fd_classifier"]
    assert (
        calibration["AR seed 1 (torch)"]["fd_vs_ar"] > 0
        and calibration["real train subset"]["fd_vs_ar"] is None
    )
    md = (settings.out / "results.md").read_text()
    assert all(name in md for name in calibration)
    assert all((settings.out / name).is_file() for name in PLOTS)
