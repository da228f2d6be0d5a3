"""A tiny random T5 encoder folder in the Hugging Face layout, built offline (flan-t5-xl's shape, shrunk)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_T5 = dict(
    vocab_size=256,
    d_model=32,
    d_kv=8,
    num_heads=4,
    d_ff=64,
    num_layers=2,
    feed_forward_proj="gated-gelu",  # flan-t5
    dropout_rate=0.0,
    tie_word_embeddings=False,
)

SENTENCES = [
    "a portrait photo of a kangaroo wearing an orange hoodie and blue sunglasses",
    "standing on the grass in front of the sydney opera house holding a sign",
    "a blue porsche 356 parked in front of a yellow brick wall",
    "a photo of an astronaut riding a horse in the forest",
    "there is a river in front of them with water lilies",
    "a map of the united states made out of sushi",
    "it is on a table next to a glass of red wine",
    "a cute cat sleeping on a wooden chair near the window",
    "an oil painting of a lighthouse at sunset, with waves crashing",
    "a bowl of fresh fruit: apples, bananas, grapes and oranges",
    "a small dog playing with a ball in the park!",
    "a city street at night with neon lights and rain",
    "a snowy mountain landscape under a clear sky",
    "two people walking along the beach at dawn",
    "a vintage camera on a desk beside an old book",
    "a watercolor of flowers in a green vase",
    "a modern kitchen with white cabinets and marble counters",
    "a close-up of a bee on a sunflower",
    "an owl perched on a branch in the moonlight",
    "a red bicycle leaning against a stone fence",
    "a plate of pasta with tomato sauce and basil",
    "a futuristic robot reading a newspaper in a cafe",
    "children flying kites over a hill on a windy day",
    "a sailboat drifting on a calm lake, mountains behind",
    "a steaming cup of coffee next to a laptop",
    "the quick brown fox jumps over the lazy dog",
    "a knight in shining armor riding a white horse",
    "a busy market with colorful umbrellas and fruit stands",
    "a tiny house in the woods covered with moss",
    "an elephant spraying water in a muddy river",
    "a sign that says welcome friends 123 456 789 0",
    "a teddy bear sitting on a pile of books (very soft)",
]


def tiny_t5(folder: Path, seed: int = 0) -> Path:
    """Write a random T5 encoder (``config.json``, ``model.safetensors``) and a Unigram tokenizer
    with T5's special tokens (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2; ``</s>`` appended) to ``folder``.
    ``seed`` sets the weights; the tokenizer (217 pieces, lower case) is always the same."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=TINY_T5["vocab_size"],
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        max_piece_length=8,
    )
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence(  # T5Tokenizer's own pre-tokenizer
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    tok.train_from_iterator(SENTENCES, trainer)
    # The trainer's parallel sums differ in the last bits, and ties come in any order, from run to
    # run: round the scores and sort the pieces after the three special tokens.
    vocab = [(piece, round(score, 6)) for piece, score in json.loads(tok.to_str())["model"]["vocab"]]
    vocab = vocab[:3] + sorted(vocab[3:], key=lambda v: (-v[1], v[0]))
    # T5TokenizerFast (transformers 5: T5Tokenizer) rebuilds T5's pipeline from the vocabulary:
    # Metaspace pre-tokenizer and decoder, and the post-processor that appends </s>.
    T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512).save_pretrained(folder)
    torch.manual_seed(seed)
    T5EncoderModel(T5Config(**TINY_T5)).eval().save_pretrained(folder)
    return folder
