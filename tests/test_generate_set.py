"""``lantern generate-set``: the same images as ``lantern generate``, locally and on Ray (two
actors, one of them killed mid-run), resumed after a partial run, and one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from lantern_rt.cli import main
from lantern_rt.image_sets import SetJob, generate_set, plan_units
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.settings import MethodConfig, RunPlan
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir

CLASSES, N = "1,3", 3  # 6 images, class-major: (1, 0..2), (3, 3..5)


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """conftest's tiny model (tiny_model_dir's files), whose graphs other modules export too
    (tests/test_jacobi.py's first run with sjd's window 3, tests/test_openvino.py's in-place
    bundle): the run's graph store exports them once."""
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny", tiny_gpt(), tiny_vq())


def same_images(tiny_dir: Path) -> list[str]:
    """The options that make the same images in ``generate`` and ``generate-set``."""
    return ["-q", "--backend", "torch", "--model", str(tiny_dir), "--classes", CLASSES, "-n", str(N)]


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory) -> np.ndarray:
    """The tokens of ``lantern generate`` for the set's classes, -n and seed."""
    path = tmp_path_factory.mktemp("ref") / "tokens.npy"
    r = cli(
        "generate", *same_images(tiny_dir), "-o", str(path.with_suffix(".png")), "--save-tokens", str(path)
    )
    assert r.exit_code == 0, r.output
    return np.load(path)


@pytest.fixture(scope="module")
def ray_cluster(ray_alone):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def make_set(tiny_dir: Path, out: Path, *extra: str):
    return cli(
        "generate-set",
        *same_images(tiny_dir),
        "--unit-size",
        "2",
        "--out",
        str(out),
        *extra,
    )


def shards(out: Path) -> dict[str, np.ndarray]:
    """Every shard of ``out`` concatenated in index order; asserts no (label, index) twice."""
    files = sorted(out.glob("shard-*.npz"))
    data = [dict(np.load(f)) for f in files]
    joined = {k: np.concatenate([d[k] for d in data]) for k in ("codes", "labels", "index", "images")}
    pairs = list(zip(joined["labels"].tolist(), joined["index"].tolist(), strict=True))
    assert len(set(pairs)) == len(pairs)
    return joined


def check_set(out: Path, reference: np.ndarray) -> dict[str, np.ndarray]:
    data = shards(out)
    assert np.array_equal(data["codes"], reference)
    assert data["index"].tolist() == list(range(2 * N))
    assert data["labels"].tolist() == [1] * N + [3] * N
    assert data["images"].dtype == np.uint8 and data["images"].shape[0] == 2 * N
    return data


def test_local_set_matches_generate(tiny_dir, reference, tmp_path):
    out, fid = tmp_path / "set", tmp_path / "fid.npz"
    r = make_set(tiny_dir, out, "--fid-npz", str(fid))
    assert r.exit_code == 0, r.output
    # units (1, 0, 2), (1, 2, 1), (3, 3, 2), (3, 5, 1): never across a class
    assert sorted(p.name for p in out.glob("shard-*.npz")) == [
        "shard-00000000-00000001.npz",
        "shard-00000002-00000002.npz",
        "shard-00000003-00000004.npz",
        "shard-00000005-00000005.npz",
    ]
    data = check_set(out, reference)
    with np.load(fid) as f:
        assert np.array_equal(f["arr_0"], data["images"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images"] == 6 and summary["images_per_class"] == {"1": 3, "3": 3}
    assert summary["mode"] == "local" and summary["made_this_run"] == 6 and summary["tau"] == 1.0
    assert summary["settings"]["seed"] == 0 and summary["settings"]["method"] == "ar"


def test_demo_speculative_set_matches_generate(tmp_path):
    """The demo's lantern++ (drafter, tree, relaxed acceptance): shards equal ``generate()``."""
    from lantern_rt.export_cache import model_fingerprint
    from lantern_rt.families.loading import open_model_dir
    from lantern_rt.generate import generate
    from lantern_rt.pipeline import build_pipeline

    md = open_model_dir(None)
    method = MethodConfig("lantern++", "chain-5")
    sampling = SamplingConfig(cfg_scale=3.0)
    plan = RunPlan(md, "torch", method, sampling)
    summary = generate_set(
        tmp_path, SetJob(plan, 5), model_fingerprint(md), [7], 2, unit_size=1, progress=False
    )
    want = generate(build_pipeline(plan), [7, 7], sampling, seed=5, progress=False)
    data = shards(tmp_path)
    assert np.array_equal(data["codes"], want.tokens.numpy())
    assert np.array_equal(data["images"], want.images)
    assert summary["tau"] == pytest.approx(want.stats.mean_accepted_length)


@pytest.mark.slow
def test_ray_two_actors_match_generate(ray_cluster, tiny_dir, reference, tmp_path):
    r = make_set(tiny_dir, tmp_path / "set", "--ray", "--actors", "2")
    assert r.exit_code == 0, r.output
    check_set(tmp_path / "set", reference)
    summary = json.loads((tmp_path / "set" / "summary.json").read_text())
    assert summary["mode"] == "ray" and summary["workers"] == 2


@pytest.mark.slow
def test_ray_killed_actor_is_retried(ray_cluster, tiny_dir, reference, tmp_path):
    from lantern_rt.export_cache import model_fingerprint
    from lantern_rt.families.loading import open_model_dir

    marker, out = tmp_path / "killed", tmp_path / "set"
    md = open_model_dir(tiny_dir)
    job = SetJob(RunPlan(md, "torch", MethodConfig("ar"), SamplingConfig(cfg_scale=2.0)), 0)
    digest = model_fingerprint(md)
    summary = generate_set(
        out,
        job,
        digest,
        [1, 3],
        N,
        unit_size=2,
        ray_address="auto",
        actors=2,
        progress=False,
        fail_once=marker,
    )
    assert marker.exists()  # an actor did exit abruptly on its first unit
    assert summary["images"] == 6 and summary["made_this_run"] == 6
    check_set(out, reference)


@pytest.mark.slow
def test_partial_run_resumes_on_ray(ray_cluster, tiny_dir, reference, tmp_path):
    out = tmp_path / "set"
    assert make_set(tiny_dir, out).exit_code == 0
    kept = out / "shard-00000000-00000001.npz"
    kept_mtime = kept.stat().st_mtime_ns
    (out / "shard-00000003-00000004.npz").unlink()  # as if the run had stopped before this unit
    r = make_set(tiny_dir, out, "--ray", "--actors", "2")
    assert r.exit_code == 0, r.output
    assert kept.stat().st_mtime_ns == kept_mtime
    summary = json.loads((out / "summary.json").read_text())
    assert summary["made_this_run"] == 2 and summary["resumed"]
    check_set(out, reference)


def test_resume_with_other_settings_is_refused(tiny_dir, tmp_path):
    out = tmp_path / "set"
    assert make_set(tiny_dir, out, "-n", "1").exit_code == 0
    before = sorted(p.name for p in out.iterdir())
    r = make_set(tiny_dir, out, "-n", "1", "--seed", "1")
    assert r.exit_code == 2
    assert r.output.count("\n") == 1 and "other settings (seed)" in r.output
    assert sorted(p.name for p in out.iterdir()) == before


def test_bad_input_is_one_line(tiny_dir, tmp_path, monkeypatch):
    afile = tmp_path / "file"
    afile.write_text("x")
    cases = [
        (("--out", str(afile)), "is not a folder"),
        (("--out", str(tmp_path / "a"), "--classes", "bag"), "unknown class"),
        (("--out", str(tmp_path / "b"), "--fid-npz", str(tmp_path / "f.npy")), "must end in .npz"),
    ]
    for args, message in cases:
        r = cli("generate-set", "-q", "--backend", "torch", "--model", str(tiny_dir), "-n", "1", *args)
        assert r.exit_code == 2 and message in r.output and r.output.count("\n") == 1, r.output
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    r = cli("generate-set", "--model", str(tiny_dir), "--out", str(tmp_path / "c"), "--ray")
    assert r.exit_code == 2 and "pip install 'lantern-rt[ray]'" in r.output, r.output


def test_units_cover_each_class_in_order():
    units = plan_units([4, 0], 5, 2)
    assert [(u.label, u.first, u.count) for u in units] == [
        (4, 0, 2),
        (4, 2, 2),
        (4, 4, 1),
        (0, 5, 2),
        (0, 7, 2),
        (0, 9, 1),
    ]


@pytest.mark.slow
def test_local_onnxruntime_set_decodes_in_streams_with_generate_s_tokens(tiny_dir, tmp_path, monkeypatch):
    """A local set on onnxruntime chooses its decode streams as ``lantern generate`` does (two
    on two threads for units of three images) and makes the tokens of one stream. The method:
    sjd with a window of 3, whose first run exports tests/test_jacobi.py's graphs of the model."""
    common = ["-q", "--backend", "onnxruntime", "--model", str(tiny_dir), "--classes", CLASSES]
    common += ["-n", str(N), "--threads", "2", "--method", "sjd", "--window", "3"]
    path = tmp_path / "tokens.npy"
    r = cli(
        "generate", *common, "--streams", "1", "-o", str(tmp_path / "one.png"), "--save-tokens", str(path)
    )
    assert r.exit_code == 0, r.output
    built = []
    pipeline = SetJob.pipeline

    def recorded(job, *args, **kwargs):
        pipe = pipeline(job, *args, **kwargs)
        built.append(len(pipe.streams))
        return pipe

    monkeypatch.setattr(SetJob, "pipeline", recorded)
    r = cli("generate-set", *common, "--unit-size", "3", "--out", str(tmp_path / "set"))
    assert r.exit_code == 0, r.output
    assert built == [2]
    assert np.array_equal(shards(tmp_path / "set")["codes"], np.load(path))
