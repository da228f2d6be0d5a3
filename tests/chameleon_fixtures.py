"""Test-only builders: a tiny random Anole-layout model directory (HF folder written by
transformers' ``save_pretrained``, plus the VQ decoder Anole's conversion keeps, a tokenizer.json
with Chameleon's special ids) and a drafter folder in the authors' layout (cnets_anole.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lantern_rt.families.chameleon.vq import ChameleonVQ, ChameleonVQConfig

N_IMAGE = 32  # image tokens at ids 4..35 (codes 0..31), as Anole's are at 4..8195
VOCAB = 8870  # room for <racm3:break> 8197, <reserved08706> 8710 and Lumina's 8803..8828
PROMPT_TOKENS = 10
GRID = 4  # a 4 x 4 image: 16 tokens, 8 px with the VQ's downsampling of 2
WORDS = "a red cat on the mat blue dog runs fast under green sky".split()
VQ = dict(
    embed_dim=8,
    num_embeddings=N_IMAGE,
    latent_channels=16,
    resolution=32,
    base_channels=32,
    channel_multiplier=[1, 2],
    num_res_blocks=1,
    attn_resolutions=[],
)


# the tiny random decoder every Chameleon test builds (transformers' ChameleonConfig fields)
TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)


def code_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(c)) for c in str(code)) + "Z"


def vocabulary(n_image: int = N_IMAGE) -> dict[str, int]:
    """Chameleon's ids: <s> 0, <pad> 1, ``n_image`` image tokens from 4, <eoss> 8196,
    <racm3:break> 8197, <reservedNNNNN> at NNNNN + 4, then the test words."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab |= {code_name(c): 4 + c for c in range(n_image)}
    vocab |= {f"<reserved{i - 4:05d}>": i for i in range(4 + n_image, 8196)}
    vocab |= {"<eoss>": 8196, "<racm3:break>": 8197}
    vocab |= {f"<reserved{i - 4:05d}>": i for i in range(8198, 8850)}
    vocab |= {w: 8850 + i for i, w in enumerate(WORDS)}
    return vocab


def hf_config(n_image: int = N_IMAGE, **overrides):
    """The tiny decoder's transformers config, with ``n_image`` image tokens (VQ codes)."""
    import transformers

    values = dict(
        TINY_DECODER,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        vocabulary_map=vocabulary(n_image),
        vq_config=VQ | {"num_embeddings": n_image},
    )
    return transformers.ChameleonConfig(**(values | overrides))


# Lumina-mGPT's layout at 32 px: a VQ of 4 pixels per token, an 8 x 8 grid, each row ending with
# <reserved08799> (8803): 72 tokens; the prompt's grid-count tokens are 8804 + 32 // 32.
LUMINA_VQ = VQ | {"channel_multiplier": [1, 2, 2]}
LUMINA_SIZE = 32


def hf_model(seed: int = 0, **overrides):
    """A random HF Chameleon with non-trivial norms and image logits far enough apart that float
    noise cannot flip a greedy choice."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.ChameleonForConditionalGeneration(hf_config(**overrides))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_norm." in name or "layernorm" in name or name == "model.norm.weight":
                p.add_(0.3 * torch.randn_like(p))
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def write_tokenizer(folder: Path, vocab: dict[str, int]) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tok.save(str(folder / "tokenizer.json"))


def write_model_dir(root: Path, model, drafter: Path | None = None, layout: str = "anole") -> Path:
    """``root``/config.json naming ``root``/hf, the HF folder of ``model`` with a random VQ
    decoder added under model.vqmodel.decoder.* (Anole's layout) and its tokenizer; the prompt
    ``layout`` anole (8 px images) or lumina (:data:`LUMINA_SIZE` px, rows ending in 8803)."""
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    torch.manual_seed(1)
    vq = ChameleonVQ(ChameleonVQConfig.from_hf(model.config.vq_config.to_dict()))
    state = load_file(str(hf_dir / "model.safetensors"))
    state |= {f"model.vqmodel.{k}": v.clone() for k, v in vq.state_dict().items() if k.startswith("decoder.")}
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(hf_dir, dict(model.config.vocabulary_map))
    config = {
        "family": "chameleon",
        "name": "tiny-anole",
        "files": {"chameleon": "hf"},
        "prompt": {"layout": layout, "tokens": PROMPT_TOKENS + 6 * (layout == "lumina")},
        "image_size": LUMINA_SIZE if layout == "lumina" else 2 * GRID,  # 2 pixels per token
    }
    if drafter is not None:
        config["files"]["drafter"] = str(drafter.relative_to(root))
    (root / "config.json").write_text(json.dumps(config))
    return root


def authors_drafter_state(model, seed: int = 2) -> dict[str, torch.Tensor]:
    """A random drafter in cnets_anole.py's layout: embed_tokens (the target's, frozen), fc with
    bias, one Chameleon decoder layer (input norm included, per-head q/k norms)."""
    g = torch.Generator().manual_seed(seed)
    layer = {
        k.removeprefix("model.layers.0."): v
        for k, v in model.state_dict().items()
        if k.startswith("model.layers.0.")
    }
    state = {"layers.0." + k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in layer.items()}
    h = model.config.hidden_size
    state["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    state["fc.weight"] = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    state["fc.bias"] = torch.randn(h, generator=g) * 0.02
    return state


def write_authors_drafter(folder: Path, model, seed: int = 2) -> Path:
    """The authors' drafter folder: their config.json (the target's Chameleon config with one
    layer) and pytorch_model.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict() | {"num_hidden_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(authors_drafter_state(model, seed), folder / "pytorch_model.bin")
    return folder
