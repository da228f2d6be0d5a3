"""Published models by their shapes alone, for ``lantern info NAME`` and the fit table of
docs/jetson.md: no configuration file or weights needed.

- LlamaGen's class-conditional GPT-B/L/XL/XXL at 256 px (LlamaGen's ``GPT_models`` presets: dim,
  layers and heads 768/12/12, 1024/24/16, 1280/36/20, 1536/48/24; 16 x 16 codes of its VQ-16
  tokenizer, vocabulary 16384; 1000 classes) with an EAGLE drafter of one layer of the target's
  width, as LANTERN's;
- Anole-7B: Chameleon-7B's decoder (hidden 4096, 32 layers, 32 heads, FFN 11008, vocabulary
  65536 of which 8192 image codes, 4096 positions, q/k LayerNorm), its VQGAN (8192 codes, 512
  px: 32 x 32 codes), a 64-slot prompt and the authors' one-layer drafter (``jadohu/anole_drafter``);
- Lumina-mGPT-7B-768: the same decoder, 768 px (48 rows of 48 codes, each row ending with an
  end-of-row token), a 96-slot prompt (README, "Anole and Lumina-mGPT"), no drafter: it runs
  ``--method sjd`` over a chain.
"""

from __future__ import annotations

from collections.abc import Callable

from lantern_rt.memory_plan import ModelShape

LLAMAGEN_SIZES = {"b": "GPT-B", "l": "GPT-L", "xl": "GPT-XL", "xxl": "GPT-XXL"}
CHAMELEON_IMAGE_TOKENS = tuple(range(4, 8196))  # IMGIMG* ids of Chameleon's vocabulary, codes 0..8191
CHAMELEON_ROW_END = 8803  # <reserved08799>, Lumina-mGPT's end of an image row


def _llamagen(size: str) -> Callable[[], ModelShape]:
    def shape() -> ModelShape:
        from lantern_rt.models.config import gpt_config, vq_config

        preset = LLAMAGEN_SIZES[size]
        gpt = gpt_config(preset, vocab_size=16384, block_size=256, num_classes=1000, cls_token_num=1)
        vq = vq_config("VQ-16", codebook_size=16384, codebook_embed_dim=8)
        return ModelShape(f"llamagen-{size}", "llamagen", gpt, vq, 256, drafter_layers=1)

    return shape


def _chameleon(
    name: str, prompt: int, grid: int, row_end: bool, drafter_layers: int
) -> Callable[[], ModelShape]:
    def shape() -> ModelShape:
        from lantern_rt.families.chameleon.convert import runtime_config
        from lantern_rt.families.chameleon.model import ChameleonConfig
        from lantern_rt.families.chameleon.vq import ChameleonVQConfig

        config = ChameleonConfig(
            image_token_ids=CHAMELEON_IMAGE_TOKENS, row_end_token_id=CHAMELEON_ROW_END if row_end else None
        )
        gpt = runtime_config(config, prompt, grid * (grid + row_end), row_end)
        return ModelShape(name, "chameleon", gpt, ChameleonVQConfig(), grid * 16, drafter_layers)

    return shape


REFERENCE_MODELS: dict[str, Callable[[], ModelShape]] = {
    **{f"llamagen-{size}": _llamagen(size) for size in LLAMAGEN_SIZES},
    "anole-7b": _chameleon("anole-7b", 64, 32, False, 1),
    "lumina-mgpt-7b-768": _chameleon("lumina-mgpt-7b-768", 96, 48, True, 0),
}


FIT_PRECISIONS = ("fp16", "int8", "w4a16")
FIT_WINDOWS = (1, 4)  # `lantern export --cache-windows 1`, and its default


def fit_table() -> list[str]:
    """docs/jetson.md's fit table, a Markdown row per published model and precision: the plans
    and the memory a run at batch 1 needs with one cache window and with four (the export's
    default), and per device whether it fits (``yes``; ``1 window``: only with
    ``--cache-windows 1``; ``no``)."""
    from lantern_rt.devices import DEVICES
    from lantern_rt.memory_plan import model_layout, model_plan
    from lantern_rt.settings import CPU_DEFAULT_TREE, GPU_DEFAULT_TREE

    def gib(n: int) -> str:
        return f"{n / 2**30:.1f}"

    head = "| model | precision | plans, GiB | KV cache, GiB | need, 1 / 4 windows, GiB | "
    lines = [
        head + " | ".join(d.key for d in DEVICES) + " |",
        "|---|---|---:|---:|---:|" + "---|" * len(DEVICES),
    ]
    for name, make in REFERENCE_MODELS.items():
        model = make()
        tree = GPU_DEFAULT_TREE if model.drafter_layers else CPU_DEFAULT_TREE
        plans = [
            model_plan(model, model_layout(model, [tree], [1], w), "published shapes", name, FIT_PRECISIONS)
            for w in FIT_WINDOWS
        ]
        for p in FIT_PRECISIONS:
            one, four = (plan.precisions[p] for plan in plans)
            cells = []
            for d in DEVICES:
                fits = [plan.fits(d, p, 1) for plan in plans]
                cells.append("yes" if all(fits) else "1 window" if fits[0] else "no")
            lines.append(
                f"| {name} | {p} | {gib(sum(g.size for g in one.graphs))} | {gib(sum(one.kv[1]))} | "
                f"{gib(one.need(1))} / {gib(four.need(1))} | " + " | ".join(cells) + " |"
            )
    return lines
