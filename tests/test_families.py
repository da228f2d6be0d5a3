"""Model families (docs/architecture.md): a third family added as docs/architecture.md says, its
own class plus one registry line, runs end to end (model directory, torch, export, onnxruntime,
inspect) with the tokens of the same weights in LlamaGen's layout; the registry refuses a family
it does not know, in a model directory and in a bundle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from lantern_rt.assembly import onnxruntime_pipeline, torch_pipeline
from lantern_rt.bundle import BundleError
from lantern_rt.cli import main
from lantern_rt.export.exporter import export_bundle
from lantern_rt.families.base import Conditioner, Family, Warn
from lantern_rt.families.loading import load_target, open_bundle, open_model_dir
from lantern_rt.families.registry import FAMILIES
from lantern_rt.generate import generate
from lantern_rt.models.checkpoint import load_strict
from lantern_rt.models.config import ConfigError, GPTConfig, VQConfig, config_from_dict, to_dict
from lantern_rt.models.model_dir import ModelDir
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel
from lantern_rt.runtime.decode import Condition
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from lantern_rt.settings import MethodConfig
from tests.conftest import tiny_gpt, tiny_vq, write_model_dir

CHECKPOINT = "toy.pt"
NOTE = "toy_note.json"


class ToyFamily(Family):
    """A family of our own: one ``toy.pt`` holding both configs and both state dicts, class
    names instead of ids as what a run asks for, and a note file in its bundles."""

    name = "toy"

    def open_dir(self, root: Path, file: Path, raw: dict[str, Any]) -> ModelDir:
        if not (root / CHECKPOINT).is_file():
            raise ConfigError(f"{root} lacks {CHECKPOINT}")
        saved = torch.load(root / CHECKPOINT, weights_only=True)
        gpt, vq = (
            config_from_dict(GPTConfig, saved["gpt_config"]),
            config_from_dict(VQConfig, saved["vq_config"]),
        )
        names = [f"toy{i}" for i in range(gpt.num_classes)]
        files = {"toy": CHECKPOINT}  # what the export cache's fingerprint covers
        return ModelDir(root, raw, gpt, vq, files, gpt.grid_size * vq.downsample, names, self.name, saved)

    def load_target(self, md: ModelDir, device, dtype) -> Transformer:
        model = Transformer(md.gpt)
        load_strict(model, md.details["gpt"], "toy target")
        return model.to(device=device, dtype=dtype).eval()

    def load_vq(self, md: ModelDir, device, dtype) -> VQModel:
        model = VQModel(md.vq)
        load_strict(model, md.details["vq"], "toy tokenizer")
        return model.to(device=device, dtype=dtype).eval()

    def vq_config(self, raw: dict[str, Any]) -> VQConfig:
        return config_from_dict(VQConfig, raw)

    def default_cfg_scale(self, gpt: GPTConfig) -> float:
        return 1.5

    def torch_conditioner(self, md: ModelDir, target: Transformer, device: str, warn: Warn) -> Conditioner:
        return self._classes(md.gpt.num_classes)

    def bundle_conditioner(self, bundle, runner, device, warn) -> Conditioner:
        return self._classes(bundle.constants.null_condition["toy_null"])

    @staticmethod
    def _classes(null: int) -> Conditioner:
        def condition(label: int | str) -> Condition:
            return Condition(torch.tensor([int(label), null]))

        return condition

    def write_bundle_files(self, md: ModelDir, target: Transformer, folder: Path) -> dict[str, Any]:
        (folder / NOTE).write_text(json.dumps({"classes": md.class_names}))
        return {"null_condition": {"toy_null": md.gpt.num_classes}}

    def describe_bundle(self, bundle) -> list[str]:
        return [f"toy      {len(json.loads((bundle.path / NOTE).read_text())['classes'])} named classes"]

    def codes_key(self, gpt: GPTConfig) -> str:
        return "labels"


@pytest.fixture
def toy_registered(monkeypatch):
    """The registry line that adds the family (docs/architecture.md, step 3)."""
    monkeypatch.setitem(FAMILIES, ToyFamily.name, ToyFamily())


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """The same random weights as a toy model directory and as a LlamaGen one: conftest's tiny
    model (tiny_model_dir's), whose graphs other modules export too."""
    root = tmp_path_factory.mktemp("families")
    gpt, vq = tiny_gpt(), tiny_vq()
    llamagen = write_model_dir(root / "llamagen", gpt, vq)
    toy = root / "toy"
    toy.mkdir()
    torch.save(
        {
            "gpt_config": to_dict(gpt.config),
            "vq_config": to_dict(vq.config),
            "gpt": gpt.state_dict(),
            "vq": vq.state_dict(),
        },
        toy / CHECKPOINT,
    )
    (toy / "config.json").write_text(json.dumps({"family": "toy", "name": "toy"}))
    return toy, llamagen


LABELS = [0, 4, 2]
SAMPLED = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=0)


def test_a_registered_family_opens_loads_and_decodes_like_llamagen(toy_registered, pair):
    """The toy directory opens through its family (its own layout and class names), loads the
    same target, and samples the tokens the LlamaGen directory of the same weights gives."""
    toy_dir, llamagen_dir = pair
    toy, llamagen = open_model_dir(toy_dir), open_model_dir(llamagen_dir)
    assert toy.family == "toy" and llamagen.family == "llamagen"
    assert toy.gpt == llamagen.gpt and toy.class_names == ["toy0", "toy1", "toy2", "toy3", "toy4"]
    for a, b in zip(
        load_target(toy).state_dict().values(), load_target(llamagen).state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    got = generate(torch_pipeline(toy, MethodConfig()), LABELS, SAMPLED, seed=1, progress=False)
    want = generate(torch_pipeline(llamagen, MethodConfig()), LABELS, SAMPLED, seed=1, progress=False)
    assert torch.equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.images, want.images)


@pytest.fixture(scope="module")
def toy_bundle(pair, tmp_path_factory) -> Path:
    """The toy model exported (its family registered for the export only), one cache window:
    the graphs of ``lantern export --cache-windows 1`` of tiny_model_dir on a CPU (its default
    tree, chain-5; tests/test_faults_output.py), exported once a run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(FAMILIES, ToyFamily.name, ToyFamily())
        out = tmp_path_factory.mktemp("toy-bundle") / "bundle"
        return export_bundle(open_model_dir(pair[0]), out, [load_tree("chain-5")], threads=1, windows=1)


@pytest.mark.slow
def test_a_registered_family_exports_and_runs_on_onnxruntime(toy_registered, pair, toy_bundle):
    """The toy family's bundle names it, holds its note and its own null condition; onnxruntime
    decodes it to torch's tokens, and 'lantern inspect' prints the family's line."""
    toy, out = open_model_dir(pair[0]), toy_bundle
    bundle = open_bundle(out)
    assert bundle.family == "toy" and bundle.constants.null_condition == {"toy_null": 5}
    assert (out / NOTE).is_file() and NOTE in bundle.files
    method = MethodConfig("ar")
    got = generate(onnxruntime_pipeline(bundle, method), LABELS, SAMPLED, seed=2, progress=False)
    want = generate(torch_pipeline(toy, method), LABELS, SAMPLED, seed=2, progress=False)
    assert torch.equal(got.tokens, want.tokens)
    result = CliRunner().invoke(main, ["inspect", str(out)])
    assert result.exit_code == 0, result.output
    assert "toy      5 named classes" in result.output


def test_the_default_cfg_scale_is_the_family_s(toy_registered, pair):
    from lantern_rt.settings import default_cfg_scale

    assert default_cfg_scale(open_model_dir(pair[0])) == 1.5
    assert default_cfg_scale(open_model_dir(pair[1])) == 2.0  # its config.json's sampling_defaults


@pytest.mark.slow
def test_an_unknown_family_is_one_line(pair, toy_bundle, tmp_path):
    """Without its registry line the toy family is unknown: its model directory is refused by
    name, and so is a bundle it wrote (one line, exit 2, nothing written)."""
    known = r"family must be one of 'llamagen', 'chameleon', got 'toy'"
    with pytest.raises(ConfigError, match=rf"config\.json: {known}"):
        open_model_dir(pair[0])
    with pytest.raises(BundleError, match=rf"^{toy_bundle.resolve()}: {known}"):
        open_bundle(toy_bundle)
    for source in (["--model", str(pair[0])], ["--bundle", str(toy_bundle)]):
        result = CliRunner().invoke(main, ["generate", *source, "-o", str(tmp_path / "x.png")])
        assert result.exit_code == 2 and "got 'toy'" in result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x.png").exists()
