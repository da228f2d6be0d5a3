"""Shared fixtures: tiny random models in LlamaGen's layout, written as model directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lantern_rt.models.checkpoint import save_safetensors
from lantern_rt.models.config import GPTConfig, VQConfig, to_dict
from lantern_rt.models.target import Transformer
from lantern_rt.models.vq import VQModel

# Tiny models run fastest on one thread, and a second thread only fights any background job.
torch.set_num_threads(1)

TINY_GPT = dict(
    dim=32,
    n_layer=2,
    n_head=2,
    multiple_of=16,
    num_classes=5,
    vocab_size=64,
    block_size=16,
    token_dropout_p=0.0,
    resid_dropout_p=0.0,
    ffn_dropout_p=0.0,
)
TINY_VQ = dict(
    codebook_size=64,
    codebook_embed_dim=4,
    codebook_show_usage=False,
    encoder_ch_mult=[1, 1],
    decoder_ch_mult=[1, 1],
    z_channels=32,
    ch=32,
    num_res_blocks=1,
    in_channels=1,
    out_channels=1,
)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter non-trivial random values (LlamaGen zero-initialises the head)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_gpt(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return randomize(Transformer(GPTConfig(**{**TINY_GPT, **overrides})), seed)


def tiny_vq(seed: int = 0) -> VQModel:
    torch.manual_seed(seed)
    return VQModel(VQConfig(**TINY_VQ)).eval()


def write_model_dir(root: Path, gpt: Transformer, vq: VQModel, gpt_file: str = "gpt.safetensors") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if gpt_file.endswith(".safetensors"):
        save_safetensors(gpt, root / gpt_file)
    else:
        torch.save({"model": gpt.state_dict()}, root / gpt_file)
    save_safetensors(vq, root / "vq.safetensors")
    config = {
        "format_version": 1,
        "name": "tiny",
        "gpt": to_dict(gpt.config),
        "vq": to_dict(vq.config),
        "files": {"gpt": gpt_file, "vq": "vq.safetensors"},
        "class_names": ["a", "b", "c", "d", "e"],
        "sampling_defaults": {"cfg_scale": 2.0},
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "tiny", tiny_gpt(), tiny_vq())


def verify_step(target, tokens: torch.Tensor, vocab: int, tree=None, commit: bool = True):
    """One greedy, exact verify call of ``tokens`` [N+1] over ``tree`` (default: the root-only
    tree, an AR step) after the committed cache, then (``commit``) the accepted path committed;
    the backend's :class:`~lantern_rt.runtime.acceptance.Verified`."""
    from lantern_rt.runtime.acceptance import Relaxation, relax_inputs
    from lantern_rt.runtime.backends.base import Draft
    from lantern_rt.runtime.sampling import SamplingConfig, filter_inputs
    from lantern_rt.runtime.tree import ROOT_ONLY

    tree = tree or ROOT_ONLY
    device, n = target.cache.k.device, tree.num_nodes + 1
    filters = filter_inputs(SamplingConfig(cfg_scale=2.0, temperature=0.0), device)
    relax = relax_inputs(Relaxation("exact"), None, vocab, True, device)
    draft = Draft(
        tokens.to(device).reshape(1, n),
        torch.ones(1, n, dtype=torch.bool, device=device),
        torch.zeros(1, n, vocab, device=device),
    )
    out = target.verify(
        tree,
        draft,
        torch.zeros(1, n, device=device),
        torch.zeros(1, vocab, device=device),
        filters,
        relax,
    )
    if commit:
        target.cache.write(out.new_k, out.new_v, out.length + 1)
    return out
