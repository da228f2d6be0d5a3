"""The demo widened to LlamaGen's shapes (lantern_rt/sized_demo/widen.py) keeps the demo's function:
its logits equal the demo's to fp32 round-off (a prefill, cached steps, the drafter), its greedy
tokens equal the demo's for every method on torch and onnxruntime, and each planted mistake of
the widening moves the logits past that tolerance. At the ``tiny`` size (dim 384, 6 heads of 64,
8 layers): an extra head, extra layers and extra FFN units, like GPT-B/L/XL."""

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
from lantern_rt.families.loading import load_drafter, load_target, open_model_dir
from lantern_rt.generate import generate
from lantern_rt.models.checkpoint import read_state_dict
from lantern_rt.models.config import ConfigError
from lantern_rt.models.model_dir import DEMO_DIR
from lantern_rt.runtime.sampling import SamplingConfig
from lantern_rt.runtime.tree import load_tree
from lantern_rt.settings import MethodConfig
from lantern_rt.sized_demo.cache import sized_model_dir
from lantern_rt.sized_demo.sizes import SIZES
from lantern_rt.sized_demo.widen import MISTAKES, Widening, write_widened

# fp32 round-off of the widened model measured 1.3e-5 on logits up to 16; the subtlest planted
# mistake (eps not rescaled) moves them by 7e-2
TOLERANCE = 1e-3
TREE = "chain-3"
METHODS = ("ar", "exact", "lantern++", "sjd")
GREEDY = SamplingConfig(cfg_scale=3.0, temperature=0.0)
LABELS = [3]  # dress


@pytest.fixture(scope="module")
def demo():
    return open_model_dir(DEMO_DIR)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return open_model_dir(write_widened(tmp_path_factory.mktemp("widen") / "tiny", "tiny"))


def stepped(model, tokens: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 16-row prefill (the condition and 15 tokens) then of one-token steps over
    the cache to 20 rows, and the prefill's final-norm hidden state."""
    h = torch.cat([model.embed_condition(cond), model.tok_embeddings(tokens[:, :19])], dim=1)
    logits, hidden, k, v = model.step(
        h[:, :16], torch.arange(16), torch.ones(16, 16).tril().bool(), None, None
    )
    rows = [logits]
    for p in range(16, h.shape[1]):
        out, _, new_k, new_v = model.step(
            h[:, p : p + 1], torch.tensor([p]), torch.ones(1, 1, 1, p + 1).bool(), k, v
        )
        k, v = torch.cat([k, new_k], dim=3), torch.cat([v, new_v], dim=3)
        rows.append(out)
    return torch.cat(rows, dim=1), hidden


@torch.no_grad()
def logits_error(demo, wide) -> float:
    """The largest logit difference of the wide target and drafter from the demo's: a
    teacher-forced forward, cached steps (:func:`stepped`), a drafter step on the hidden
    states; the extra dims of the wide hidden states must be exactly 0."""
    a, b = load_target(demo), load_target(wide)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(demo.gpt.vocab_size, (2, demo.gpt.block_size - 1), generator=g)
    cond = torch.tensor([3, demo.gpt.num_classes])  # a class and the null class (CFG's two rows)
    (logits_a, hidden_a), (logits_b, hidden_b) = stepped(a, tokens, cond), stepped(b, tokens, cond)
    da, db = load_drafter(demo), load_drafter(wide)
    positions, mask = torch.arange(1, 17), torch.ones(16, 16).tril().bool()
    draft_a = da.step(tokens[:, :16], hidden_a, positions, mask, None, None)[0]
    draft_b = db.step(tokens[:, :16], hidden_b, positions, mask, None, None)[0]
    d = demo.gpt.dim
    assert hidden_b[..., d:].abs().max() == 0 and draft_b[..., d:].abs().max() == 0
    errors = [
        a(tokens, cond) - b(tokens, cond),
        logits_a - logits_b,
        a.output(draft_a) - b.output(draft_b),
    ]
    return max(float(e.abs().max()) for e in errors)


def test_logits_equal_the_demos_to_round_off(demo, wide) -> None:
    assert logits_error(demo, wide) < TOLERANCE


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_planted_mistake_moves_the_logits(demo, tmp_path, mistake) -> None:
    wrong = open_model_dir(write_widened(tmp_path / "wrong", "tiny", mistake=mistake))
    assert logits_error(demo, wrong) > TOLERANCE


def greedy_tokens(pipe) -> torch.Tensor:
    return generate(pipe, LABELS, GREEDY, seed=1, progress=False).tokens


def method(name: str) -> MethodConfig:
    return MethodConfig(name, tree=TREE)


@pytest.fixture(scope="module")
def demo_tokens(demo):
    return {m: greedy_tokens(torch_pipeline(demo, method(m))) for m in METHODS}


@pytest.mark.slow  # 4-13 s a method on this CPU (256 tokens each)
@pytest.mark.parametrize("name", METHODS)
def test_greedy_tokens_equal_the_demos_on_torch(wide, demo_tokens, name) -> None:
    assert torch.equal(greedy_tokens(torch_pipeline(wide, method(name))), demo_tokens[name])


@pytest.mark.slow  # exports the tiny widening, then decodes (about 100 s on this shared CPU)
def test_greedy_tokens_equal_the_demos_on_onnxruntime(wide, demo_tokens, tmp_path) -> None:
    path = export_bundle(wide, tmp_path / "bundle", trees=[load_tree(TREE)], threads=1, windows=1)
    bundle = Bundle.open(path)
    for name in METHODS:
        tokens = greedy_tokens(onnxruntime_pipeline(bundle, method(name), threads=1))
        assert torch.equal(tokens, demo_tokens[name]), name


def test_sizes_have_llamagens_shapes(demo) -> None:
    shapes = {name: Widening(demo.gpt, name).wide for name in ("GPT-B", "GPT-L", "GPT-XL")}
    assert [(c.dim, c.n_layer, c.n_head, c.head_dim, c.ffn_hidden) for c in shapes.values()] == [
        (768, 12, 12, 64, 2048),
        (1024, 24, 16, 64, 2816),
        (1280, 36, 20, 64, 3584),
    ]
    with pytest.raises(ConfigError, match="unknown model size 'GPT-Q'; choose from GPT-B, GPT-L"):
        Widening(demo.gpt, "GPT-Q")


def test_inert_parts_are_dense_and_random(wide) -> None:
    """Only the blocks the rules name are zero: extra layers, heads, FFN units and the columns
    reading extra dims hold random weights a backend must multiply."""
    state = read_state_dict(wide.path("gpt"))
    d, ffn = 160, 448
    qkv = state["layers.7.attention.wqkv.weight"]  # an extra layer: random but for v and w3
    assert (qkv[: 2 * qkv.shape[0] // 3] != 0).all() and qkv[2 * qkv.shape[0] // 3 :].abs().max() == 0
    assert state["layers.7.feed_forward.w3.weight"].abs().max() == 0  # what keeps a layer inert
    for key in (
        "layers.7.feed_forward.w1.weight",
        "layers.7.attention.wo.weight",
        "layers.7.feed_forward.w2.weight",
    ):
        assert (state[key] != 0).all()
    assert (state["layers.0.feed_forward.w1.weight"][ffn:] != 0).all()  # extra FFN units
    assert (state["layers.0.attention.wqkv.weight"][:, d:] != 0).all()  # columns of extra dims
    q_rows = state["layers.0.attention.wqkv.weight"][: 5 * 64, :d]
    assert (q_rows == 0).sum() == 5 * 32 * d  # q's pairs outside the demo's, in the demo's columns
    assert (state["output.weight"][:, d:] != 0).all()
    assert abs(float(state["layers.7.feed_forward.w1.weight"].std()) - 0.02) < 1e-3
    # no whole tensor is zero: a bundle's weights file stores identical tensors once, so zero
    # wo/w2 shared by every extra layer would be read from one cached copy
    assert all(t.abs().max() > 0 for k, t in state.items() if not k.endswith("w3.weight"))


def test_sized_model_dir_builds_once_into_the_cache(wide, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path))
    path = sized_model_dir("tiny")
    assert path.parent == tmp_path / "models"
    made = (path / "gpt.safetensors").stat().st_mtime_ns
    assert sized_model_dir("tiny") == path and (path / "gpt.safetensors").stat().st_mtime_ns == made
    for file in ("gpt.safetensors", "drafter/drafter.safetensors", "config.json"):  # deterministic
        assert (path / file).read_bytes() == (wide.root / file).read_bytes(), file
    assert json.loads((path / "config.json").read_text())["name"] == "fashion-mnist-demo-tiny"


def test_widen_command(tmp_path: Path) -> None:
    bad = CliRunner().invoke(main, ["widen", "--size", "GPT-Q"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        f"error: unknown model size 'GPT-Q'; choose from {', '.join(SIZES)}"
    ]
    out = CliRunner().invoke(main, ["widen", "--size", "tiny", "--out", str(tmp_path / "m")])
    assert out.exit_code == 0, out.output
    assert open_model_dir(tmp_path / "m").gpt.dim == 384
    again = CliRunner().invoke(main, ["widen", "--size", "tiny", "--out", str(tmp_path / "m")])
    assert again.exit_code == 0, again.output  # its own output is replaced
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "config.json").write_text("{}")  # another model directory
    (tmp_path / "file").write_text("")
    for taken in ("user", "file"):
        refused = CliRunner().invoke(main, ["widen", "--size", "tiny", "--out", str(tmp_path / taken)])
        assert refused.exit_code == 2 and "is not a model directory 'lantern widen' wrote" in refused.output
    assert (tmp_path / "user" / "config.json").read_text() == "{}"
