"""Text-conditional decoding against LlamaGen's t2i sampling, written out independently here:
padded captions hidden in attention (both CFG rows), the learned null caption, guidance only
above a scale of 1, the drafter's view of the caption prefix as the authors' code feeds it, and
the exported graphs against torch."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lantern_rt.assembly import onnxruntime_pipeline
from lantern_rt.bundle import Bundle
from lantern_rt.export.exporter import export_bundle
from lantern_rt.families.loading import open_model_dir
from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.drafter import Drafter, DrafterConfig
from lantern_rt.models.target import rope_table_2d
from lantern_rt.runtime.acceptance import Relaxation
from lantern_rt.runtime.backends.base import CatchUp
from lantern_rt.runtime.backends.torch_backend import TorchDrafter, TorchTarget
from lantern_rt.runtime.decode import Condition, Speculation, decode_image, decode_images
from lantern_rt.runtime.drafting import drafter_capacity, noise_rows
from lantern_rt.runtime.run_shape import RunShape
from lantern_rt.runtime.sampling import SamplingConfig, cfg_mix, filter_inputs
from lantern_rt.runtime.tree import load_tree
from tests.conftest import PROMPT_SLOTS, randomize, tiny_gpt, tiny_vq, write_model_dir
from tests.llamagen_reference import reference_logits

PREFIX, CAPTION_DIM = 6, 12


def t2i_gpt(seed: int = 0, block_size: int = 16, **overrides):
    return tiny_gpt(
        seed,
        model_type="t2i",
        cls_token_num=PREFIX,
        caption_dim=CAPTION_DIM,
        block_size=block_size,
        **overrides,
    )


def caption(valid: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Caption features [T, C] as LlamaGen's left padding leaves them (``valid`` features last,
    the padding zeroed) and their mask [T]."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(PREFIX) >= PREFIX - valid
    return torch.randn(PREFIX, CAPTION_DIM, generator=g) * mask[:, None], mask


def llamagen_t2i_greedy(model, features, mask, cfg_scale: float, count: int) -> list[int]:
    """LlamaGen's ``generate`` for one caption, greedy, by full forwards: the null caption row
    only when ``cfg_scale > 1``, both rows under the caption's mask."""
    sd, cfg = model.state_dict(), model.config
    null = sd["cls_embedding.uncond_embedding"]
    guided = cfg_scale > 1.0
    cond = torch.stack([features, null]) if guided else features[None]
    masks = torch.stack([mask, mask]) if guided else mask[None]
    seq: list[int] = []
    for _ in range(count):
        idx = torch.tensor([seq] * len(cond), dtype=torch.long).view(len(cond), len(seq))
        logits = reference_logits(sd, cfg, idx, cond, masks)[:, -1]
        mixed = logits[1] + (logits[0] - logits[1]) * cfg_scale if guided else logits[0]
        seq.append(int(mixed.argmax()))
    return seq


def ours(model, features, mask, cfg_scale: float, count: int, spec=None) -> list[int]:
    null = model.null_condition
    cond = Condition(torch.stack([features, null]), mask)
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0)
    return decode_image(TorchTarget(model), cond, count, sampling, None, spec).tokens.tolist()


@pytest.mark.parametrize("valid", [PREFIX, 3, 1])
@pytest.mark.parametrize("cfg_scale", [4.0, 1.0, 0.5])
def test_greedy_tokens_equal_llamagens_t2i_loop(valid, cfg_scale):
    model = t2i_gpt(3)
    features, mask = caption(valid, seed=valid)
    want = llamagen_t2i_greedy(model, features, mask, cfg_scale, model.config.block_size)
    assert ours(model, features, mask, cfg_scale, model.config.block_size) == want


def test_stage_ii_geometry_32x32():
    """A 1024-token grid: positions, RoPE rows and caches sized from the config (first tokens)."""
    model = t2i_gpt(4, block_size=1024)
    features, mask = caption(4, seed=1)
    want = llamagen_t2i_greedy(model, features, mask, 3.0, 12)
    assert ours(model, features, mask, 3.0, 12) == want
    assert TorchTarget(model).cache.capacity == PREFIX + 1024


def test_padding_changes_the_tokens():
    """The mask matters: the same features seen unmasked give other tokens (else the tests above
    could not tell a masked prefix from an unmasked one)."""
    model = t2i_gpt(3)
    features, mask = caption(2, seed=2)
    masked = ours(model, features, mask, 4.0, 16)
    assert masked != ours(model, features, torch.ones_like(mask), 4.0, 16)


def random_drafter(model, seed: int = 5) -> Drafter:
    torch.manual_seed(seed)
    return randomize(Drafter(DrafterConfig.for_target(model.config), model.config), seed)


def test_drafter_sees_the_caption_prefix_as_the_authors_feed_it():
    """After the prefill, the drafter's distribution for the first tree's root children equals
    the authors' ``initialize_tree``: one causal pass over (token 0, h_i) for the first T - 1
    prefix slots and (x_0, h_{T-1}), at positions 0..T-1 of a RoPE table with T - 1 zero rows."""
    model = t2i_gpt(6)
    drafter = random_drafter(model)
    features, mask = caption(3, seed=3)
    target = TorchTarget(model)
    backend = TorchDrafter(drafter, model.output, drafter_capacity(PREFIX, model.config.block_size))
    cond, prefix = torch.stack([features, model.null_condition]), mask[None].expand(2, -1)
    logits, hidden = target.prefill(cond, prefix)
    backend.prefill(hidden[:, :-1], torch.tensor([True]), cond, prefix)
    x0 = int(cfg_mix(logits, 2.0, 1).argmax())
    tree = load_tree("chain-1")
    rows = 2  # catch_up_rows(chain-1)
    pending = torch.tensor([[x0, 0]])
    pending_hidden = torch.cat([hidden[:, -1:], torch.zeros_like(hidden[:, -1:])], 1)
    noise = torch.rand(1, noise_rows(tree), model.config.vocab_size)
    catch_up = CatchUp(pending, pending_hidden, torch.tensor([1]), target.cache.length, backend.cache.length)
    sampling = filter_inputs(SamplingConfig(cfg_scale=2.0, temperature=1.0), torch.device("cpu"))
    q_root = backend.draft(tree, catch_up, noise, sampling)[2][:, 0]
    assert rows == catch_up.tokens.shape[1]

    theirs = rope_table_2d(model.config.grid_size, model.config.head_dim, model.config.rope_base, PREFIX - 1)
    drafter.freqs_cis = theirs
    tokens = torch.tensor([[0] * (PREFIX - 1) + [x0]] * 2)
    with torch.no_grad():
        out = drafter(tokens, hidden, torch.arange(PREFIX))[:, -1]
        want = torch.softmax(cfg_mix(model.output(out).float(), 2.0, 1), -1)
    torch.testing.assert_close(q_root, want, atol=1e-5, rtol=1e-5)


def test_exact_speculation_keeps_the_greedy_tokens():
    """Exact speculative decoding over a padded caption: LlamaGen's greedy tokens, whatever the
    (random) drafter proposes, with the drafter's caption prefix committed first."""
    model = t2i_gpt(3)
    drafter = random_drafter(model)
    features, mask = caption(3, seed=3)
    backend = TorchDrafter(drafter, model.output, drafter_capacity(PREFIX, model.config.block_size))
    spec = Speculation(backend, load_tree("mc_sim_7b_63"), Relaxation("exact"))
    want = llamagen_t2i_greedy(model, features, mask, 4.0, 16)
    assert ours(model, features, mask, 4.0, 16, spec) == want


def test_batch_of_different_captions_equals_one_at_a_time():
    """Images of one batch keep their own prefix masks (and slots refilled with new captions)."""
    model = t2i_gpt(3)
    null = model.null_condition
    conds = [Condition(torch.stack([f, null]), m) for f, m in (caption(v, seed=v) for v in (6, 1, 3, 2, 5))]
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    alone = [decode_image(TorchTarget(model), c, 16, sampling, None).tokens for c in conds]
    batched = dict(
        decode_images(
            TorchTarget(model, RunShape(2, cache_windows=1)), [(c, None) for c in conds], 16, sampling
        )
    )
    for i, tokens in enumerate(alone):
        assert torch.equal(batched[i].tokens, tokens), i


@pytest.fixture(scope="module")
def t2i_bundle(tmp_path_factory):
    """A fp32 t2i bundle with a drafter (its prefill graph), exported from a model directory (one
    cache window: the tokens do not depend on the windows, tests/test_cache_windows.py)."""
    root = tmp_path_factory.mktemp("t2i")
    model = t2i_gpt(3)
    md = write_model_dir(root / "model", model, tiny_vq())
    drafter = random_drafter(model)
    (md / "drafter").mkdir()
    save_safetensors(drafter, md / "drafter" / "drafter.safetensors")
    (md / "drafter" / "config.json").write_text(json.dumps(dataclasses.asdict(drafter.config)))
    config = json.loads((md / "config.json").read_text())
    config["files"]["drafter"] = "drafter"
    (md / "config.json").write_text(json.dumps(config))
    trees = [load_tree("chain-2")]
    out = export_bundle(open_model_dir(md), root / "bundle", trees, threads=1, batch_sizes=[1, 2], windows=1)
    return model, Bundle.open(out)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "exact"])
def test_onnxruntime_tokens_equal_torch(t2i_bundle, method):
    model, bundle = t2i_bundle
    assert "drafter_prefill" in bundle.graphs
    from lantern_rt.settings import MethodConfig

    pipe = onnxruntime_pipeline(bundle, MethodConfig(method, "chain-2"), threads=1)
    features, mask = caption(2, seed=4)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = Condition(torch.stack([features, model.null_condition]), mask)
    got = decode_image(pipe.target, cond, 16, sampling, None, pipe.speculation).tokens.tolist()
    assert got == llamagen_t2i_greedy(model, features, mask, 4.0, 16)


# -- prompts end to end: a tiny T5 folder beside a t2i model ------------------------------------


def reference_condition(md, prompt: str):
    """LlamaGen's sample_t2i.py on our tiny T5, with transformers directly: clean twice, tokenize
    right-padded (max_length, truncation), encode, rotate the valid features last, zero the rest."""
    from transformers import AutoTokenizer, T5EncoderModel

    from lantern_rt.families.llamagen.captions import preprocess

    tokenizer = AutoTokenizer.from_pretrained(md / "t5")
    t = tokenizer(
        [preprocess(prompt)],
        max_length=PROMPT_SLOTS,
        padding="max_length",
        truncation=True,
        return_attention_mask=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        emb = T5EncoderModel.from_pretrained(md / "t5")(**t).last_hidden_state[0]
    mask = t["attention_mask"][0]
    valid = int(mask.sum())
    rotated = torch.cat([emb[valid:], emb[:valid]])
    flipped = torch.flip(mask, dims=[-1])
    return rotated * flipped[:, None], flipped.bool()


def run_cli(*args: str):
    from click.testing import CliRunner

    from lantern_rt.cli import main

    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("backend", ["torch", pytest.param("onnxruntime", marks=pytest.mark.slow)])
def test_generate_with_prompts(prompt_model, tmp_path, backend):
    """`lantern generate --prompt` on both backends: greedy tokens equal LlamaGen's loop on the
    reference condition; one PNG row per prompt; the stats JSON names the prompts."""
    import numpy as np
    from PIL import Image

    long = " ".join(["a red apple on a table"] * 6)
    prompts = ["A red apple", long]
    args = ["generate", "--model", str(prompt_model), "--backend", backend, "--greedy", "-n", "2", "-q"]
    args += ["--prompt", prompts[0], "--prompt", long, "--method", "ar", "--cfg-scale", "4"]
    args += ["-o", str(tmp_path / "apple.png"), "--save-tokens", str(tmp_path / "t.npz")]
    result = run_cli(*args, "--stats-json", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    assert "is over 12 tokens: its first 11 and the end token are kept" in result.output
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["prompts"] == [prompts[0]] * 2 + [long] * 2 and "labels" not in stats
    image = Image.open(tmp_path / "apple.png")
    assert image.size[1] == 2 * image.size[0] // 2  # two rows of two images (square tiles)
    saved = np.load(tmp_path / "t.npz")
    model = open_model_dir(prompt_model)
    from lantern_rt.families.loading import load_target

    target = load_target(model)
    for i, prompt in enumerate(prompts):
        features, mask = reference_condition(prompt_model, prompt)
        want = llamagen_t2i_greedy_with_null(target, features, mask, 4.0, 16)
        assert saved["codes"][2 * i].tolist() == want, prompt
        assert saved["prompts"][2 * i] == prompt


@pytest.mark.parametrize("prompt", ["", "  "])
def test_an_empty_prompt_is_conditioned_on_the_end_token_as_llamagen_does(prompt_model, tmp_path, prompt):
    """`--prompt ""`: LlamaGen encodes ``</s>`` alone (one valid caption slot), not the null
    caption; greedy tokens equal its loop on that condition."""
    import numpy as np

    from lantern_rt.families.loading import load_target

    args = ["generate", "--model", str(prompt_model), "--backend", "torch", "--greedy", "-n", "1", "-q"]
    args += ["--prompt", prompt, "--method", "ar", "--cfg-scale", "4", "-o", str(tmp_path / "e.png")]
    result = run_cli(*args, "--save-tokens", str(tmp_path / "t.npz"))
    assert result.exit_code == 0, result.output
    features, mask = reference_condition(prompt_model, prompt)
    assert mask.sum() == 1  # </s>
    want = llamagen_t2i_greedy_with_null(load_target(open_model_dir(prompt_model)), features, mask, 4.0, 16)
    assert np.load(tmp_path / "t.npz")["codes"][0].tolist() == want


def llamagen_t2i_greedy_with_null(model, features, mask, cfg_scale, count):
    return llamagen_t2i_greedy(model, features.to(model.null_condition.dtype), mask, cfg_scale, count)


@pytest.mark.slow
def test_bundle_text_encoder_equals_transformers(prompt_model, tmp_path):
    """The exported encoder graph (fp32 in an fp16 bundle) against T5EncoderModel on the same
    ids and mask, and its tokenizer files beside it."""
    import numpy as np
    import onnxruntime as ort
    from transformers import T5EncoderModel

    out = export_bundle(open_model_dir(prompt_model), tmp_path / "b", dtype="fp16", threads=1, windows=1)
    bundle = Bundle.open(out)
    entry = bundle.graph("text_encoder")
    assert bundle.text_max_length == PROMPT_SLOTS and entry.outputs[0].dtype == "float32"
    assert {"tokenizer_config.json", "tokenizer.json"} <= set(bundle.files)
    ids = torch.tensor([[5, 17, 40, 1] + [0] * (PROMPT_SLOTS - 4)])
    mask = (torch.arange(PROMPT_SLOTS) < 4).long()[None]
    session = ort.InferenceSession(str(bundle.file(entry)), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"ids": ids.numpy(), "mask": mask.numpy()})
    with torch.no_grad():
        want = T5EncoderModel.from_pretrained(prompt_model / "t5")(input_ids=ids, attention_mask=mask)
    np.testing.assert_allclose(got, want.last_hidden_state.numpy(), atol=1e-4)
    inspected = run_cli("inspect", str(out))
    assert f"text     prompts of {PROMPT_SLOTS} tokens, encoded by the text_encoder graph" in inspected.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--class", "1"], "is a text-to-image model: give --prompt or --prompts, not --class"),
        ([], "is a text-to-image model: give --prompt TEXT or --prompts FILE"),
        (["--prompts", "missing.txt"], "--prompts file not found: missing.txt"),
    ],
)
def test_bad_prompt_input_is_one_line(prompt_model, tmp_path, args, message):
    result = run_cli(
        "generate", "--model", str(prompt_model), "--backend", "torch", "-o", str(tmp_path / "x.png"), *args
    )
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert message in result.output and not (tmp_path / "x.png").exists()


def test_prompts_for_a_class_model_are_refused(tmp_path):
    result = run_cli("generate", "--prompt", "a shoe", "-o", str(tmp_path / "x.png"))
    assert (
        result.exit_code == 2 and "is a class-conditional model: give --class, not --prompt" in result.output
    )


def test_prompts_file(prompt_model, tmp_path):
    (tmp_path / "p.txt").write_text("a red apple\n\n  a blue car  \n")
    out = tmp_path / "x.png"
    args = ["generate", "--model", str(prompt_model), "--backend", "torch", "--method", "ar", "-n", "1", "-q"]
    result = run_cli(
        *args, "--prompts", str(tmp_path / "p.txt"), "-o", str(out), "--stats-json", str(tmp_path / "s.json")
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "s.json").read_text())["prompts"] == ["a red apple", "a blue car"]
    (tmp_path / "empty.txt").write_text("\n \n")
    result = run_cli(*args, "--prompts", str(tmp_path / "empty.txt"), "-o", str(out))
    assert result.exit_code == 2 and "holds no prompt" in result.output


@pytest.mark.slow
def test_bench_with_prompts(prompt_model, tmp_path):
    args = ["bench", "--model", str(prompt_model), "--prompt", "a red apple", "--prompt", "a blue car"]
    result = run_cli(*args, "--config", "ar", "-n", "1", "--warmup", "0", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert results["settings"]["classes"] == ["a red apple", "a blue car"]
    assert {row["backend"] for row in results["rows"]} == {"torch", "onnxruntime"}
    assert "speed only" in results["quality_note"]
    result = run_cli(*args, "--baseline", "torch-batched", "--out", str(tmp_path / "c"))
    assert result.exit_code == 2 and "baseline runs class-conditional models" in result.output
    assert not (tmp_path / "c").exists()


def test_a_t2i_model_without_a_text_encoder_is_refused_before_any_export(tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    md = write_model_dir(tmp_path / "m", t2i_gpt(1), tiny_vq())
    for backend in ("torch", "onnxruntime"):
        result = run_cli("generate", "--model", str(md), "--backend", backend, "--prompt", "a cat")
        assert result.exit_code == 2 and "without a text encoder" in result.output, result.output
    assert not (tmp_path / "cache").exists()


def test_the_authors_t2i_layout_runs_prompts(prompt_model, tmp_path):
    """Their converted target (HF key names, their config.json named by gpt.hf_config) and their
    drafter folder (their llamagen_t2i_config.json fields + pytorch_model.bin): the model loads
    strictly and `lantern generate --prompt` with LANTERN++ gives exact speculation's greedy
    tokens equal to AR's, on torch."""
    import shutil

    import numpy as np

    from lantern_rt.families.loading import load_target
    from tests.test_hf_layout import hf_config, to_hf

    root = tmp_path / "authors"
    shutil.copytree(prompt_model, root)
    target = load_target(open_model_dir(prompt_model))
    (root / "LlamaGen-T2I").mkdir()
    torch.save(to_hf(target), root / "LlamaGen-T2I" / "pytorch_model.bin")
    (root / "LlamaGen-T2I" / "config.json").write_text(json.dumps(hf_config(target.config)))
    drafter = random_drafter(target)
    theirs = {  # data/configs/llamagen_t2i_config.json, sizes of the tiny target
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": target.config.dim,
        "caption_dim": target.config.caption_dim,
        "class_dropout_p": 0.0,
        "intermediate_size": drafter.config.intermediate_size,
        "num_attention_heads": target.config.n_head,
        "num_hidden_layers": 1,
        "num_key_value_heads": target.config.n_head,
        "rms_norm_eps": drafter.config.rms_norm_eps,
        "vocab_size": target.config.vocab_size,
        "input_type": "t2i",
        "torch_dtype": "float16",
    }
    (root / "drafter").mkdir()
    (root / "drafter" / "config.json").write_text(json.dumps(theirs))
    torch.save(drafter.state_dict(), root / "drafter" / "pytorch_model.bin")
    config = json.loads((root / "config.json").read_text())
    config["gpt"] = {"hf_config": "LlamaGen-T2I/config.json"}
    config["files"] |= {"gpt": "LlamaGen-T2I/pytorch_model.bin", "drafter": "drafter"}
    (root / "config.json").write_text(json.dumps(config))
    codes = []
    for method in ("ar", "exact"):
        args = ["generate", "--model", str(root), "--backend", "torch", "--greedy", "-n", "1", "-q"]
        args += ["--method", method, "--tree", "mc_sim_7b_63", "--prompt", "a red apple"]
        out = tmp_path / f"{method}.npz"
        result = run_cli(*args, "-o", str(tmp_path / f"{method}.png"), "--save-tokens", str(out))
        assert result.exit_code == 0, result.output
        codes.append(np.load(out)["codes"])
    np.testing.assert_array_equal(codes[0], codes[1])


@pytest.mark.slow
def test_onnxruntime_batch_of_different_captions_equals_one_at_a_time(t2i_bundle):
    """B = 2 graphs (the drafter's caption prefill included): each image keeps its own padding,
    slots refilled with new captions, the same tokens as alone."""
    from lantern_rt.settings import MethodConfig

    model, bundle = t2i_bundle
    null = model.null_condition
    conds = [Condition(torch.stack([f, null]), m) for f, m in (caption(v, seed=v) for v in (6, 1, 3))]
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    method = MethodConfig("lantern++", "chain-2")
    one, two = (onnxruntime_pipeline(bundle, method, RunShape(b), threads=1) for b in (1, 2))

    def generators():
        return [torch.Generator().manual_seed(i) for i in range(len(conds))]

    alone = [
        decode_image(one.target, c, 16, sampling, g, one.speculation).tokens
        for c, g in zip(conds, generators(), strict=True)
    ]
    jobs = list(zip(conds, generators(), strict=True))
    batched = dict(decode_images(two.target, jobs, 16, sampling, two.speculation))
    for i, tokens in enumerate(alone):
        assert torch.equal(batched[i].tokens, tokens), i


def test_train_drafter_refuses_a_t2i_model(prompt_model, tmp_path):
    result = run_cli(
        "train-drafter", "--model", str(prompt_model), "--out", str(tmp_path / "d"), "--steps", "1"
    )
    assert result.exit_code == 2 and "train-drafter trains on class labels" in result.output
    assert not (tmp_path / "d").exists()


def test_a_text_encoder_of_another_width_is_refused(tmp_path, monkeypatch):
    """One check, for the torch pipeline and the export alike: T5's width is the target's caption_dim."""
    from tests.t5_fixtures import tiny_t5

    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    md = write_model_dir(tmp_path / "m", t2i_gpt(1), tiny_vq())  # caption_dim 12; the tiny T5 makes 32
    tiny_t5(md / "t5")
    config = json.loads((md / "config.json").read_text())
    config["files"]["t5"] = "t5"
    (md / "config.json").write_text(json.dumps(config))
    for backend in ("torch", "onnxruntime"):
        result = run_cli("generate", "--model", str(md), "--backend", backend, "--prompt", "a cat")
        assert (
            result.exit_code == 2
            and "makes 32-wide features; the target reads caption_dim 12" in result.output
        )
    assert not list((tmp_path / "cache" / "bundles").glob("tiny-*"))


def test_one_row_per_image_gives_the_two_row_tokens(prompt_model):
    """Guidance off (docs/method.md §13): the captions' rows alone, B instead of 2B (captions of
    different lengths, a batch of 2), give the tokens of the CFG rows."""
    from lantern_rt.assembly import torch_pipeline
    from lantern_rt.generate import generate
    from lantern_rt.settings import MethodConfig

    md, prompts = open_model_dir(prompt_model), ["a red cat", "a dog"]
    for sampling in (SamplingConfig(1.0, temperature=0), SamplingConfig(1.0, temperature=1.0)):
        two, one = (
            generate(torch_pipeline(md, MethodConfig(), RunShape(2, g)), prompts, sampling, progress=False)
            for g in (True, False)
        )
        assert torch.equal(two.tokens, one.tokens)
