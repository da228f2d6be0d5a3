"""One row per image when guidance is off (docs/method.md §13): at a CFG scale of at most 1 the
conditional rows alone decide, so graphs and caches of B rows give the tokens of today's 2B CFG
rows, on torch and onnxruntime, for AR, LANTERN++ and a Jacobi window, one image and a batch
with refills; a one-row pipeline refuses a CFG scale above 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lantern_rt.assembly import onnxruntime_pipeline, torch_pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.cli import main
from lantern_rt.export.exporter import export_bundle
from lantern_rt.export_cache import cached_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.config import ConfigError
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from lantern_rt.settings import MethodConfig
from tests.conftest import randomize, tiny_gpt, tiny_vq, write_model_dir
from tests.test_export import add_drafter
from tests.test_faults_output import fake_export

LABELS = [0, 3, 1, 4, 2]  # B = 2 refills slots and ends on a partial batch
OFF = {
    "greedy": SamplingConfig(cfg_scale=1.0, temperature=0.0),
    "sampled": SamplingConfig(cfg_scale=1.0, temperature=1.0),
    "below-1": SamplingConfig(cfg_scale=0.5, temperature=1.0),  # LlamaGen: the conditional rows alone
}
# one chain of two levels (a drafting graph's export costs about 2 s a level)
TREE = "chain-2"
METHODS = {
    "ar": MethodConfig("ar"),
    "lantern++": MethodConfig("lantern++", tree=TREE, k=5, lam=5.0),
    "sjd++": MethodConfig("sjd++", tree=TREE),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> ModelDir:
    """A tiny random class-conditional target (64-token images) with a random drafter."""
    target = tiny_gpt(3, block_size=64)
    root = write_model_dir(tmp_path_factory.mktemp("guidance") / "model", target, tiny_vq())
    add_drafter(root, randomize(Drafter(DrafterConfig.for_target(target.config), target.config), 4))
    return open_model_dir(root)


def _tokens(pipe, sampling: SamplingConfig) -> tuple[torch.Tensor, list[int]]:
    out = generate(pipe, LABELS, sampling, seed=3, progress=False)
    return out.tokens, out.stats.accepted


def _rows(pipe) -> set[int]:
    """The rows of the pipeline's caches (target, and drafter when there is one)."""
    caches = [pipe.target.cache]
    if pipe.speculation is not None and hasattr(pipe.speculation.drafter, "cache"):
        caches.append(pipe.speculation.drafter.cache)
    return {c.rows for c in caches}


@pytest.mark.parametrize("sampling", OFF.values(), ids=OFF.keys())
@pytest.mark.parametrize("method", METHODS)
def test_torch_one_row_gives_the_two_row_tokens(model_dir, method, sampling):
    for batch in (1, 2):
        two = torch_pipeline(model_dir, METHODS[method], RunShape(batch))
        one = torch_pipeline(model_dir, METHODS[method], RunShape(batch, guided=False))
        assert _rows(two) == {2 * batch} and _rows(one) == {batch}
        assert two.guided and not one.guided
        (want, want_accepted), (got, got_accepted) = _tokens(two, sampling), _tokens(one, sampling)
        assert torch.equal(want, got) and want_accepted == got_accepted, batch
        if method != "ar":
            assert max(got_accepted) >= 2  # multi-token steps were compared


def test_the_comparison_catches_a_mixing_rule_that_reads_the_unconditional_rows(model_dir, monkeypatch):
    """Planted: a CFG mix that interpolates towards the unconditional rows below a scale of 1
    (not LlamaGen's rule) makes the two-row run differ from the one-row run."""

    def always_mixed(logits, scale, images):
        if logits.shape[0] == images:
            return logits
        cond, uncond = logits.unflatten(0, (2, -1))
        return uncond + scale * (cond - uncond)

    one = _tokens(torch_pipeline(model_dir, METHODS["ar"], RunShape(guided=False)), OFF["below-1"])
    monkeypatch.setattr("lantern_rt.runtime.acceptance.cfg_mix", always_mixed)
    two = _tokens(torch_pipeline(model_dir, METHODS["ar"]), OFF["below-1"])
    assert not torch.equal(one[0], two[0])


@pytest.fixture(scope="module")
def one_row_bundle(model_dir, tmp_path_factory) -> Bundle:
    path = tmp_path_factory.mktemp("guidance-bundle") / "bundle"
    trees = [load_tree(TREE)]
    return Bundle.open(
        export_bundle(model_dir, path, trees, threads=1, batch_sizes=(1, 2), windows=2, guided=False)
    )


@pytest.mark.slow
def test_the_one_row_bundle_has_b_rows_per_call(one_row_bundle):
    assert not one_row_bundle.constants.guided
    for name, entry in one_row_bundle.graphs.items():
        if name == "vq_decode":
            continue
        batch = 2 if name.endswith("_b2") else 1
        rows = {
            spec.shape[0] for spec in entry.inputs if spec.name.startswith(("past_k_", "hidden", "prefix"))
        }
        rows |= {spec.shape[0] for spec in entry.inputs if name.startswith("target_prefill")}
        assert rows == {batch}, name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "lantern++"])
def test_onnxruntime_one_row_gives_the_torch_two_row_tokens(model_dir, one_row_bundle, method):
    sampling = OFF["sampled"]
    for batch in (1, 2):
        want = _tokens(torch_pipeline(model_dir, METHODS[method], RunShape(batch)), sampling)
        pipe = onnxruntime_pipeline(one_row_bundle, METHODS[method], RunShape(batch), threads=1)
        assert _rows(pipe) == {batch}
        got = _tokens(pipe, sampling)
        assert torch.equal(want[0], got[0]) and want[1] == got[1], batch


@pytest.mark.slow
def test_a_one_row_pipeline_refuses_guidance(model_dir, one_row_bundle, tmp_path):
    for pipe in (
        torch_pipeline(model_dir, METHODS["ar"], RunShape(guided=False)),
        onnxruntime_pipeline(one_row_bundle, METHODS["ar"], threads=1),
    ):
        with pytest.raises(ConfigError, match="--no-guidance"):
            generate(pipe, [0], SamplingConfig(cfg_scale=2.0), progress=False)
    out = tmp_path / "grid.png"
    args = ["generate", "--bundle", str(one_row_bundle.path), "--cfg-scale", "2", "-o", str(out), "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and not out.exists()
    assert len(result.output.strip().splitlines()) == 1 and "--no-guidance" in result.output


@pytest.mark.slow
def test_inspect_shows_the_rows(one_row_bundle):
    result = CliRunner().invoke(main, ["inspect", str(one_row_bundle.path)])
    assert result.exit_code == 0 and "1 row per image (no guidance" in result.output


def test_a_model_directory_exports_one_row_graphs_for_cfg_1(model_dir, tmp_path: Path, monkeypatch):
    """cached_bundle keys its export by guidance, and passes it on."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []
    guided: list[bool] = []
    fake = fake_export(calls)

    def export(md, out, on_start=None, **kwargs):
        guided.append(kwargs["guided"])
        return fake(md, out, on_start, **kwargs)

    monkeypatch.setattr("lantern_rt.export.exporter.export_bundle", export)
    two, one = (cached_bundle(model_dir, METHODS["ar"], RunShape(guided=g)) for g in (True, False))
    assert two != one and calls == [two, one] and guided == [True, False]
    assert (
        cached_bundle(model_dir, METHODS["ar"], RunShape(guided=False)) == one and len(calls) == 2
    )  # reused


@pytest.mark.slow
def test_a_one_row_bundle_calibrates_at_cfg_1(one_row_bundle, tmp_path):
    """Calibration runs a bundle at the model's CFG scale, at most 1 for a one-row bundle."""
    out = tmp_path / "int8"
    args = [
        "calibrate",
        str(one_row_bundle.path),
        "--samples",
        "1",
        "--out",
        str(out),
        "--threads",
        "1",
        "-q",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert not Bundle.open(out).constants.guided


def test_bench_runs_one_row_at_cfg_1(model_dir, tmp_path):
    out = tmp_path / "bench"
    args = f"bench --model {model_dir.root} --backend torch --config ar --cfg-scale 1 --classes 0 -n 1"
    result = CliRunner().invoke(main, [*args.split(), "--warmup", "1", "--no-quality", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "results.json").read_text())["settings"]["rows_per_image"] == [1]
