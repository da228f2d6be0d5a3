"""The LANTERN authors' HF-layout target (jadohu/LlamaGen-T2I), LlamaGen training checkpoints, shards."""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
from pathlib import Path

import pytest
import torch
from conftest import tiny_gpt

from lantern_rt.families.llamagen.hf_layout import (
    from_hf_state,
    gpt_config_from_hf,
    is_hf_layout,
    read_target_state,
    resolve_gpt_section,
)
from lantern_rt.models.checkpoint import CheckpointError, load_strict, read_state_dict, save_safetensors
from lantern_rt.models.config import ConfigError, GPTConfig, gpt_config
from lantern_rt.models.target import Transformer

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "lantern_llamagen_t2i_keys.json").read_text())
T2I = dict(model_type="t2i", cls_token_num=3, caption_dim=12)
GQA = dict(T2I, n_head=4, n_kv_head=2)


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """Our state dict in the authors' names, written from their modeling code (not from hf_layout)."""
    cfg, out = model.config, {}
    kv = cfg.kv_heads * cfg.head_dim
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if parts[0] == "layers":
            i, rest = parts[1], ".".join(parts[2:])
            pre = f"model.layers.{i}."
            if rest == "attention.wqkv.weight":
                q, k, v = value.split([cfg.dim, kv, kv], dim=0)
                out |= {pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k}
                out[pre + "self_attn.v_proj.weight"] = v
                continue
            theirs = {
                "attention.wo.weight": "self_attn.o_proj.weight",
                "feed_forward.w1.weight": "mlp.gate_proj.weight",
                "feed_forward.w3.weight": "mlp.up_proj.weight",
                "feed_forward.w2.weight": "mlp.down_proj.weight",
                "attention_norm.weight": "input_layernorm.weight",
                "ffn_norm.weight": "post_attention_layernorm.weight",
            }[rest]
            out[pre + theirs] = value
        elif key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = value
        elif key == "output.weight":
            out["lm_head.weight"] = value
        else:  # cls_embedding.*, norm.weight
            out["model." + key] = value
    return out


def hf_config(cfg: GPTConfig) -> dict:
    """A config.json as their LlamaConfig would write it (cf. data/configs/llamagen_t2i_config.json)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "rms_norm_eps": cfg.norm_eps,
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "cls_token_num": cfg.cls_token_num,
        "caption_dim": cfg.caption_dim,
        "num_classes": cfg.num_classes,
        "class_dropout_p": cfg.class_dropout_prob,
        "token_dropout_p": 0.0,
        "resid_dropout_p": 0.0,
        "ffn_dropout_p": 0.0,
        "rope_base": cfg.rope_base,
        "rope_theta": 10000.0,
        "input_type": cfg.model_type,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "pretraining_tp": 1,
        "max_position_embeddings": 2048,
        "torch_dtype": "float16",
    }


def inputs(model: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, model.config.vocab_size, (2, 10), generator=g)
    if model.config.model_type == "c2i":
        return idx, torch.tensor([1, 4])
    return idx, torch.randn(2, model.config.cls_token_num, model.config.caption_dim, generator=g)


def reload(path: Path, cfg: GPTConfig) -> Transformer:
    model = Transformer(cfg)
    load_strict(model, read_target_state(path, cfg.n_layer), f"target {path}")
    return model.eval()


def test_fixture_keys_are_the_authors_layout():
    model = tiny_gpt(1, **T2I, n_layer=FIXTURE["n_layer"])
    hf = to_hf(model)
    assert set(hf) == set(FIXTURE["keys"])
    assert is_hf_layout(hf) and not is_hf_layout(model.state_dict())
    assert set(from_hf_state(hf, model.config.n_layer)) == set(model.state_dict())


@pytest.mark.parametrize("overrides", [T2I, GQA, {}], ids=["t2i", "t2i-gqa", "c2i"])
def test_hf_layout_loads_to_equal_logits(tmp_path, overrides):
    model = tiny_gpt(1, **overrides)
    path = tmp_path / "model.safetensors"
    save_safetensors(to_hf(model), path)
    cfg = gpt_config(**gpt_config_from_hf(hf_config(model.config)) | {"token_dropout_p": 0.0})
    assert cfg.ffn_hidden == model.config.ffn_hidden and cfg.kv_heads == model.config.kv_heads
    again = reload(path, cfg)
    idx, cond = inputs(model)
    with torch.no_grad():
        assert torch.equal(again(idx, cond), model(idx, cond))


def test_llamagen_layout_is_unchanged(tmp_path):
    model = tiny_gpt(2, **T2I)
    save_safetensors(model, tmp_path / "gpt.safetensors")
    state = read_target_state(tmp_path / "gpt.safetensors", model.config.n_layer)
    assert state.keys() == model.state_dict().keys()


def test_missing_and_unknown_keys_are_named(tmp_path):
    model = tiny_gpt(1, **T2I)
    hf = to_hf(model)
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        from_hf_state(hf, 2)
    hf = to_hf(model)
    hf["model.layers.0.mlp.gate_prj.weight"] = hf.pop("model.layers.0.mlp.gate_proj.weight")
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # dropped, not an error
    hf["model.freqs_cis"] = torch.ones(4)
    with pytest.raises(CheckpointError) as err:
        load_strict(Transformer(model.config), from_hf_state(hf, 2), "target")
    message = str(err.value)
    assert "missing keys: layers.0.feed_forward.w1.weight" in message
    assert "unexpected keys: model.layers.0.mlp.gate_prj.weight" in message
    assert "inv_freq" not in message and "freqs_cis" not in message
    wide = dict(hf, **{"model.layers.1.self_attn.v_proj.weight": torch.zeros(32, 40)})
    with pytest.raises(CheckpointError, match="layer 1: q/k/v_proj shapes"):
        from_hf_state(wide, 2)
    del hf["model.layers.0.self_attn.q_proj.weight"]  # a layer the config lacks still needs q, k, v
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.0\.self_attn\.q_proj\.weight"):
        from_hf_state(hf, 1)


def test_config_mapping_and_errors():
    # GPT-XL sizes, as in their data/configs/llamagen_t2i_config.json, plus the target's own fields
    xl = hf_config(gpt_config("GPT-XL", model_type="t2i", cls_token_num=120, norm_eps=1e-6))
    out = gpt_config_from_hf(xl)
    assert out["multiple_of"] == 256 and out["ffn_dim_multiplier"] is None and out["norm_eps"] == 1e-6
    assert gpt_config(**out).ffn_hidden == xl["intermediate_size"] == 3584
    assert "n_kv_head" not in out and out["model_type"] == "t2i" and out["rope_base"] == 10000.0
    odd = gpt_config(**gpt_config_from_hf(xl | {"intermediate_size": 4000}))
    assert odd.ffn_hidden == 4000
    with pytest.raises(ConfigError, match="intermediate_size 4000 .* multiple_of=256"):
        gpt_config_from_hf(xl | {"intermediate_size": 4000, "multiple_of": 256})
    for field in ("block_size", "cls_token_num", "caption_dim", "hidden_size"):
        with pytest.raises(ConfigError, match=f"lacks {field}$") as err:
            gpt_config_from_hf({k: v for k, v in xl.items() if k != field})
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="input_type"):
        gpt_config_from_hf(xl | {"input_type": "t2i2"})
    with pytest.raises(ConfigError, match="attention_bias"):
        gpt_config_from_hf(xl | {"attention_bias": True})


def test_model_dir_hf_config_section(tmp_path):
    model = tiny_gpt(1, **GQA)
    (tmp_path / "T2I").mkdir()
    (tmp_path / "T2I" / "config.json").write_text(json.dumps(hf_config(model.config)))
    section = resolve_gpt_section(tmp_path, {"hf_config": "T2I/config.json", "token_dropout_p": 0.0})
    assert gpt_config(**section).kv_heads == 2 and section["token_dropout_p"] == 0.0
    assert resolve_gpt_section(tmp_path, {"preset": "GPT-B"}) == {"preset": "GPT-B"}


class Odd(collections.OrderedDict):
    """A class no checkpoint may smuggle in."""


def training_checkpoint(model: Transformer, args: object) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    model(*inputs(model)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "steps": 5000, "args": args}


def test_llamagen_training_checkpoint(tmp_path):
    model = tiny_gpt(3, **T2I)
    args = argparse.Namespace(gpt_model="GPT-XL", gpt_type="t2i", lr=1e-4, no_compile=False, vq_ckpt=None)
    torch.save(training_checkpoint(model, args), tmp_path / "0005000.pt")
    state = read_state_dict(tmp_path / "0005000.pt")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert state.keys() == model.state_dict().keys()


@pytest.mark.parametrize(
    "bad",
    [
        lambda m: {"model": m.state_dict(), "args": pathlib.PosixPath("/tmp/x")},
        lambda m: {"model": Odd(m.state_dict())},
        lambda m: training_checkpoint(m, argparse.Namespace(data=pathlib.PosixPath("/tmp/x"))),
    ],
    ids=["posixpath", "ordereddict-subclass", "path-inside-namespace"],
)
def test_other_classes_are_refused(tmp_path, bad):
    torch.save(bad(tiny_gpt(3, **T2I)), tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="cannot read .*weights-only loading refuses") as err:
        read_state_dict(tmp_path / "bad.pt")
    assert "\n" not in str(err.value)
    assert "PosixPath" in str(err.value) or "Odd" in str(err.value)


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_sharded_index(tmp_path, kind):
    model = tiny_gpt(4, **T2I)
    hf = to_hf(model)
    keys = sorted(hf)
    halves = {"model-00001-of-00002": keys[: len(keys) // 2], "model-00002-of-00002": keys[len(keys) // 2 :]}
    weight_map = {}
    for stem, part in halves.items():
        name = f"{stem}.{kind}"
        weight_map |= dict.fromkeys(part, name)
        if kind == "safetensors":
            save_safetensors({k: hf[k] for k in part}, tmp_path / name)
        else:
            torch.save({k: hf[k] for k in part}, tmp_path / name)
    index = tmp_path / (
        "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    )
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    again = reload(index, model.config)
    idx, cond = inputs(model)
    with torch.no_grad():
        assert torch.equal(again(idx, cond), model(idx, cond))
    (tmp_path / f"model-00002-of-00002.{kind}").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.* missing") as err:
        read_state_dict(index)
    assert "\n" not in str(err.value)
    index.write_text(json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside its folder"):
        read_state_dict(index)
    index.write_text(json.dumps({"weight_map": {"a": f"model-00001-of-00002.{kind}"}}))
    with pytest.raises(CheckpointError, match="lack them"):  # a key the index maps but no shard holds
        read_state_dict(index)
