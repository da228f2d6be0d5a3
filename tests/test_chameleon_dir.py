"""Opening HF Chameleon folders (lantern_rt.families.chameleon.folder) written by transformers' save_pretrained."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lantern_rt.errors import LanternError
from lantern_rt.families.chameleon.folder import (
    WEIGHT_FILES,
    load_chameleon_target,
    load_chameleon_vq,
    open_chameleon_dir,
    read_chameleon_state,
)
from lantern_rt.models.checkpoint import CheckpointError
from lantern_rt.models.config import ConfigError

transformers = pytest.importorskip("transformers")

from tests.test_chameleon import N_IMAGE, VOCAB, _hf_config, _hf_logits  # noqa: E402
from tests.test_chameleon_vq import TINY, _tiny  # noqa: E402

VQ_CONFIG = TINY | {"num_embeddings": N_IMAGE}  # attention at resolution 16: the decoder's attn blocks load
GRID = VQ_CONFIG["resolution"] // 2
ATOL = 1e-4


@pytest.fixture(scope="module")
def source():
    """(HF model with random norms, our VQ whose encoder half is HF's and whose decoder is random)."""
    torch.manual_seed(0)
    hf = transformers.ChameleonForConditionalGeneration(
        transformers.ChameleonConfig(**_hf_config(vq_config=VQ_CONFIG))
    )
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "_norm." in name or "layernorm" in name or name == "model.norm.weight":
                p.add_(0.3 * torch.randn_like(p))
    hf.eval()
    ref = _tiny(1, num_embeddings=N_IMAGE)
    ref.load_state_dict(hf.model.vqmodel.state_dict(), strict=False)
    return hf, ref


def _decoder_state(ref) -> dict[str, torch.Tensor]:
    """Anole's layout: the VQGAN decoder under model.vqmodel.decoder.*."""
    return {f"model.vqmodel.{k}": v.clone() for k, v in ref.state_dict().items() if k.startswith("decoder.")}


def _write(root: Path, hf, ref, layout: str) -> Path:
    """Save ``hf`` into ``root`` as ``layout``, with the decoder added unless the layout is 'no_decoder'."""
    if layout == "sharded":
        hf.save_pretrained(root, max_shard_size="200KB")
        save_file(_decoder_state(ref), str(root / "model-vqdecoder.safetensors"), metadata={"format": "pt"})
        index = json.loads((root / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2  # really sharded
        index["weight_map"].update(dict.fromkeys(_decoder_state(ref), "model-vqdecoder.safetensors"))
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
        return root
    hf.save_pretrained(root)
    file = root / "model.safetensors"
    state = load_file(str(file))
    if layout != "no_decoder":
        state |= _decoder_state(ref)
    if layout == "bin":
        file.unlink()
        torch.save(state, root / "pytorch_model.bin")
    else:
        save_file(state, str(file), metadata={"format": "pt"})
    return root


@pytest.fixture(scope="module")
def folders(source, tmp_path_factory):
    hf, ref = source
    return {
        layout: _write(tmp_path_factory.mktemp(layout), hf, ref, layout)
        for layout in ("single", "sharded", "bin", "no_decoder")
    }


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and isinstance(exc.value, LanternError)
    return message


@pytest.mark.parametrize(
    "layout, weights",
    [
        ("single", "model.safetensors"),
        ("sharded", "model.safetensors.index.json"),
        ("bin", "pytorch_model.bin"),
    ],
)
def test_loaded_target_and_vq_equal_hf_and_ours(source, folders, layout, weights):
    hf, ref = source
    d = open_chameleon_dir(folders[layout])
    assert d.weights.name == weights and d.root == folders[layout].resolve()
    assert d.config.vocab_size == VOCAB and len(d.config.image_token_ids) == N_IMAGE
    assert d.vq.num_embeddings == N_IMAGE and d.vq.attn_resolutions == [16]

    target = load_chameleon_target(d)
    assert not target.training
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(target(ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)

    vq = load_chameleon_vq(d)
    codes = torch.randint(0, N_IMAGE, (2, GRID * GRID), generator=torch.Generator().manual_seed(3))
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.no_grad():
        assert torch.equal(vq.decode_code(codes, GRID), ref.decode_code(codes, GRID))
        assert torch.equal(vq.encode(images), hf.model.vqmodel.encode(images).image_tokens.view(2, -1))


def test_one_read_feeds_both_loaders_and_dtype_keeps_fp32_rope(source, folders):
    hf, _ = source
    d = open_chameleon_dir(folders["sharded"])
    state = read_chameleon_state(d)
    assert any(k.startswith("model.vqmodel.decoder.") for k in state)
    target = load_chameleon_target(d, dtype=torch.bfloat16, state=state)
    vq = load_chameleon_vq(d, dtype=torch.bfloat16, state=state)
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16} == {p.dtype for p in vq.parameters()}
    assert target.model.inv_freq.dtype == torch.float32
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(target(ids), _hf_logits(hf, ids), atol=0.1, rtol=0.05)


def test_checkpoint_without_decoder_is_a_one_line_error(source, folders):
    hf, _ = source
    d = open_chameleon_dir(folders["no_decoder"])
    with pytest.raises(CheckpointError) as err:
        load_chameleon_vq(d)
    message = _one_line(err)
    assert str(d.weights) in message and "model.vqmodel.decoder." in message and "Anole" in message
    ids = torch.randint(0, VOCAB, (1, 4))
    with torch.no_grad():  # the language model itself still loads
        torch.testing.assert_close(load_chameleon_target(d)(ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_checkpoint_without_any_vq_weights(source, tmp_path):
    hf, ref = source
    root = _write(tmp_path, hf, ref, "no_decoder")
    state = {k: v for k, v in load_file(str(root / "model.safetensors")).items() if "vqmodel" not in k}
    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    d = open_chameleon_dir(root)
    load_chameleon_target(d)
    with pytest.raises(CheckpointError, match="holds no VQ tokenizer weights") as err:
        load_chameleon_vq(d)
    assert str(d.weights) in _one_line(err)


def test_mismatched_checkpoint_names_the_folder_and_key(source, tmp_path):
    hf, ref = source
    root = _write(tmp_path, hf, ref, "single")
    file = root / "model.safetensors"
    state = load_file(str(file))
    del state["model.layers.1.mlp.up_proj.weight"]
    del state["model.vqmodel.decoder.conv_out.bias"]
    save_file(state, str(file), metadata={"format": "pt"})
    d = open_chameleon_dir(root)
    with pytest.raises(CheckpointError, match=r"missing keys: model\.layers\.1\.mlp\.up_proj\.weight") as err:
        load_chameleon_target(d)
    assert str(file.resolve()) in _one_line(err)
    with pytest.raises(CheckpointError, match=r"missing keys: decoder\.conv_out\.bias$") as err:
        load_chameleon_vq(d)
    assert str(file.resolve()) in _one_line(err)


def test_missing_shard_names_the_index(source, tmp_path):
    hf, ref = source
    root = _write(tmp_path, hf, ref, "sharded")
    (root / "model-vqdecoder.safetensors").unlink()
    d = open_chameleon_dir(root)
    with pytest.raises(CheckpointError, match="model-vqdecoder.safetensors, which is missing") as err:
        load_chameleon_vq(d)
    assert "model.safetensors.index.json" in _one_line(err)


def test_lumina_per_shard_qk_norm_rows_load(source, tmp_path):
    """Lumina-mGPT stores q/k norms as [model_parallel_size, D]: one row per shard of heads."""
    hf, ref = source
    hf = copy.deepcopy(hf)
    root = _write(tmp_path, hf, ref, "single")
    file = root / "model.safetensors"
    state = load_file(str(file))
    for name in [k for k in state if "_norm." in k and "vqmodel" not in k]:
        rows = state[name][::2].contiguous()  # q: 4 heads -> 2 rows; k: 2 heads -> 1 row
        state[name] = rows
        with torch.no_grad():
            param = hf.get_parameter(name)
            param.copy_(rows.repeat_interleave(param.shape[0] // rows.shape[0], dim=0))
    save_file(state, str(file), metadata={"format": "pt"})
    target = load_chameleon_target(open_chameleon_dir(root))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(target(ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_tokenizer_files_are_listed(folders, tmp_path):
    assert open_chameleon_dir(folders["single"]).tokenizer_files == []
    (tmp_path / "config.json").write_text((folders["single"] / "config.json").read_text())
    for name in ("tokenizer_config.json", "tokenizer.json", "pytorch_model.bin"):
        (tmp_path / name).write_text("{}")
    d = open_chameleon_dir(tmp_path)
    assert d.tokenizer_files == [d.root / "tokenizer.json", d.root / "tokenizer_config.json"]
    assert d.config_file == d.root / "config.json" and d.weights.name == "pytorch_model.bin"


def _config(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


@pytest.mark.parametrize(
    "case, words",
    [
        ("no_folder", "Chameleon model folder not found"),
        ("no_config", "config file not found"),
        ("bad_json", "is not valid JSON"),
        ("not_chameleon", "is not a Chameleon config: model_type is 'llama'"),
        ("no_vq_config", "lacks a 'vq_config' object"),
        ("bad_field", "hidden_act 'gelu' is not supported"),
        ("bad_vq_field", "ChameleonVQConfig.num_res_blocks must be an integer"),
        ("codebook_mismatch", "vocabulary_map has 16 image tokens for the VQ codebook of 32"),
        ("no_weights", "no weights found in"),
    ],
)
def test_open_errors_are_one_line_and_name_the_file(folders, tmp_path, case, words):
    root = tmp_path / "model"
    root.mkdir()
    raw = _config(folders["single"])
    named = root / "config.json"
    if case == "no_folder":
        root, named = tmp_path / "absent", tmp_path / "absent"
    elif case == "no_config":
        (root / "model.safetensors").write_bytes(b"")
    elif case == "bad_json":
        named.write_text('{"model_type": "chameleon",')
    elif case == "no_weights":
        named.write_text(json.dumps(raw))
        (root / "tokenizer.json").write_text("{}")
        named = root
    else:
        changes = {
            "not_chameleon": {"model_type": "llama"},
            "no_vq_config": {"vq_config": None},
            "bad_field": {"hidden_act": "gelu"},
            "bad_vq_field": {"vq_config": raw["vq_config"] | {"num_res_blocks": 0}},
            "codebook_mismatch": {"vq_config": raw["vq_config"] | {"num_embeddings": 32}},
        }[case]
        named.write_text(json.dumps(raw | changes))
        (root / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=words) as err:
        open_chameleon_dir(root)
    message = _one_line(err)
    assert str(named) in message
    if case == "no_weights":
        assert all(name in message for name in WEIGHT_FILES)


def test_each_loader_reads_only_its_own_shards(source, folders, tmp_path):
    """The target and the VQ tokenizer each read their keys alone: with a target-only shard gone,
    the VQ still loads (and equals the full read's) while the target names the missing shard."""
    import shutil

    root = tmp_path / "partial"
    shutil.copytree(folders["sharded"], root)
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    vq_shards = {f for k, f in index.items() if k.startswith("model.vqmodel.")}
    gone = next(f for f in sorted(set(index.values())) if f not in vq_shards)
    (root / gone).unlink()
    d = open_chameleon_dir(root)
    full = load_chameleon_vq(open_chameleon_dir(folders["sharded"]))
    vq = load_chameleon_vq(d)
    for (name, a), (_, b) in zip(vq.state_dict().items(), full.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match=gone):
        load_chameleon_target(d)
