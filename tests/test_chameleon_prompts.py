"""Chameleon-family prompts (lantern_rt.families.chameleon.prompts) and the HF greedy CFG reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lantern_rt.errors import TextEncoderError
from lantern_rt.families.chameleon.prompts import (
    ANOLE,
    LUMINA,
    PromptLayout,
    check_tokenizer,
    load_chameleon_tokenizer,
    lumina_layout,
    prompt_rows,
    token_name,
)

tokenizers = pytest.importorskip("tokenizers")

WORDS = "a red cat on the mat Generate an image of 768x768 according to following prompt :".split()


def _save(vocab: dict[str, int], folder: Path, bos: str) -> Path:
    """A WordLevel tokenizer.json with an HF-style post-processor that adds ``bos``."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _chameleon_vocab() -> dict[str, int]:
    """Chameleon's special ids: <s> 0, <pad> 1, image codes 4..8195, <eoss> 8196,
    <racm3:break> 8197, <reservedNNNNN> at NNNNN + 4; then the test words."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"IMG{c}": 4 + c for c in range(8192)})
    vocab.update({"<eoss>": 8196, "<racm3:break>": 8197})
    vocab.update({f"<reserved{i - 4:05d}>": i for i in range(8198, 8840)})
    for word in WORDS:
        vocab[word] = len(vocab)
    return vocab


@pytest.fixture(scope="module")
def chameleon_tok(tmp_path_factory):
    return load_chameleon_tokenizer(_save(_chameleon_vocab(), tmp_path_factory.mktemp("cham"), "<s>"))


def _word_ids(tok, text: str) -> list[int]:
    return [tok.token_to_id(w) for w in text.split()]


def test_layouts_match_the_authors_ids():
    assert (ANOLE.prefix_ids, ANOLE.suffix_ids, ANOLE.uncond_ids, ANOLE.pad_id) == (
        (0,),
        (8710, 8197),
        (0, 8197),
        1,
    )
    assert ANOLE.text("a cat") == "a cat"
    assert LUMINA.prefix_ids == (0,) and LUMINA.suffix_ids == (8710, 8197, 8828, 8828)
    assert LUMINA.uncond_ids == (8197, 8828, 8828) and LUMINA.pad_id == 1
    assert LUMINA.text("a cat") == "Generate an image of 768x768 according to the following prompt:\na cat"
    assert lumina_layout(512).suffix_ids == (8710, 8197, 8820, 8820)
    names = dict(LUMINA.named_ids)
    assert names == {
        1: "<pad>",
        0: "<s>",
        8710: "<reserved08706>",
        8197: "<racm3:break>",
        8828: "<reserved08824>",
    }
    assert token_name(8803) == "<reserved08799>" and token_name(8196) == "<eoss>"
    for bad in (500, 0, "768"):
        with pytest.raises(TextEncoderError, match="multiple of 32"):
            lumina_layout(bad)


def test_anole_rows(chameleon_tok):
    rows = prompt_rows(chameleon_tok, "a red cat", 10, ANOLE)
    text = _word_ids(chameleon_tok, "a red cat")
    assert rows.ids.dtype == torch.int64 and rows.mask.dtype == torch.bool
    assert rows.ids.shape == rows.mask.shape == (2, 10) and not rows.truncated
    assert rows.ids[0].tolist() == [1] * 4 + [
        0,
        *text,
        8710,
        8197,
    ]  # one <s>: the post-processor's is not added
    assert rows.ids[1].tolist() == [1] * 8 + [0, 8197]
    assert rows.mask[0].tolist() == [False] * 4 + [True] * 6
    assert rows.mask[1].tolist() == [False] * 8 + [True] * 2
    assert (rows.ids[~rows.mask] == 1).all()


def test_lumina_rows(chameleon_tok):
    rows = prompt_rows(chameleon_tok, "a red cat", 24, LUMINA)
    text = _word_ids(
        chameleon_tok, "Generate an image of 768x768 according to the following prompt : a red cat"
    )
    cond = [0, *text, 8710, 8197, 8828, 8828]
    assert rows.ids[0].tolist() == [1] * (24 - len(cond)) + cond and not rows.truncated
    assert rows.ids[1].tolist() == [1] * 21 + [8197, 8828, 8828]
    assert rows.mask.sum(1).tolist() == [len(cond), 3]
    assert rows.ids[:, -1].tolist() == [8828, 8828]  # the last prompt token predicts the first code


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_the_layout_without_text(chameleon_tok, prompt):
    """Not the unconditional row: Anole's fixed tokens around no text, Lumina's template alone."""
    anole = prompt_rows(chameleon_tok, prompt, 10, ANOLE)
    assert anole.ids[0].tolist() == [1] * 7 + [0, 8710, 8197] and anole.mask.sum(1).tolist() == [3, 2]
    assert anole.ids[1].tolist() == [1] * 8 + [0, 8197] and not anole.truncated
    lumina = prompt_rows(chameleon_tok, prompt, 24, LUMINA)
    template = "Generate an image of 768x768 according to the following prompt :"
    cond = [0, *_word_ids(chameleon_tok, template), 8710, 8197, 8828, 8828]
    assert lumina.ids[0, 24 - len(cond) :].tolist() == cond and lumina.mask[0].sum() == len(cond)


def test_truncation_cuts_the_end_of_the_text_and_keeps_the_fixed_tokens(chameleon_tok):
    text = _word_ids(chameleon_tok, "a red cat on the mat")
    exact = prompt_rows(chameleon_tok, "a red cat on the mat", 9, ANOLE)
    assert exact.ids[0].tolist() == [0, *text, 8710, 8197] and not exact.truncated and exact.mask[0].all()
    cut = prompt_rows(chameleon_tok, "a red cat on the mat", 6, ANOLE)
    assert cut.truncated and cut.ids[0].tolist() == [0, *text[:3], 8710, 8197] and cut.mask[0].all()
    assert cut.ids[1].tolist() == [1] * 4 + [0, 8197]
    tiny = prompt_rows(chameleon_tok, "a red cat", 6, LUMINA)  # room for a single text token
    assert tiny.truncated and tiny.ids[0].tolist() == [
        0,
        *_word_ids(chameleon_tok, "Generate"),
        8710,
        8197,
        8828,
        8828,
    ]


def test_errors_are_one_line(chameleon_tok, tmp_path):
    cases = [
        (lambda: prompt_rows(chameleon_tok, None, 10, ANOLE), "must be a string"),
        (lambda: prompt_rows(chameleon_tok, "a cat", 3, ANOLE), "too small"),
        (lambda: prompt_rows(chameleon_tok, "a cat", 5, LUMINA), "too small"),
        (lambda: prompt_rows(chameleon_tok, "a cat", True, ANOLE), "too small"),
        (lambda: PromptLayout("x", "no slot", (0,), (1,), (0,)), "lacks"),
        (lambda: PromptLayout("x", "{prompt}", (0,), (1,), ()), "unconditional"),
    ]
    other = load_chameleon_tokenizer(
        _save({"<unk>": 0, "<s>": 1, "<pad>": 2, "a": 3}, tmp_path / "other", "<s>")
    )
    cases.append((lambda: prompt_rows(other, "a", 10, ANOLE), r"does not fit anole: <pad> is id 2, not id 1"))
    no_sep = load_chameleon_tokenizer(_save({"<s>": 0, "<pad>": 1, "<unk>": 2}, tmp_path / "no_sep", "<s>"))
    cases.append((lambda: check_tokenizer(no_sep, LUMINA), "<reserved08706> is absent, not id 8710"))
    for call, words in cases:
        with pytest.raises(TextEncoderError, match=words) as info:
            call()
        assert "\n" not in str(info.value)


def test_tokenizer_loading_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(TextEncoderError, match="no such tokenizer folder"):
        load_chameleon_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TextEncoderError, match=r"tokenizer\.json: no such file") as info:
        load_chameleon_tokenizer(empty)
    assert str(empty / "tokenizer.json") in str(info.value)
    (empty / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TextEncoderError, match="does not load") as info:
        load_chameleon_tokenizer(empty)
    assert "\n" not in str(info.value) and str(empty / "tokenizer.json") in str(info.value)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError
    with pytest.raises(TextEncoderError) as info:
        load_chameleon_tokenizer(empty)
    assert "lantern-rt[chameleon]" in str(info.value) and "tokenizers" in str(info.value)


def test_a_transformers_fast_tokenizer_gives_the_same_rows(chameleon_tok):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=chameleon_tok)
    for layout in (ANOLE, LUMINA):
        a, b = prompt_rows(chameleon_tok, "a red cat", 30, layout), prompt_rows(fast, "a red cat", 30, layout)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)


# --- the HF reference on a tiny random Chameleon -------------------------------------------------

TINY = PromptLayout(
    "tiny",
    "{prompt}",
    prefix_ids=(1,),
    suffix_ids=(5, 6),
    uncond_ids=(1, 6),
    pad_id=0,
    named_ids=((0, "<pad>"), (1, "<s>"), (5, "<sep>"), (6, "<boi>")),
)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    from tests.test_chameleon import _hf_config

    config = transformers.ChameleonConfig(**_hf_config())
    torch.manual_seed(0)
    model = transformers.ChameleonForConditionalGeneration(config).eval()
    with torch.no_grad():  # logits far enough apart that float noise cannot flip an argmax
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<image>": 3, "<unk>": 4, "<sep>": 5, "<boi>": 6}
    vocab |= {w: 7 + i for i, w in enumerate(WORDS)}
    return load_chameleon_tokenizer(_save(vocab, tmp_path_factory.mktemp("tiny"), "<s>"))


IMAGE_IDS = list(range(100, 116))  # test_chameleon's vocabulary map: codes 0..15 at ids 100..115


def _naive(model, cond: list[int], uncond: list[int], n: int, cfg_scale: float) -> list[int]:
    """Greedy CFG without padding, masks or a cache: each row recomputed alone every step."""
    image = torch.tensor(IMAGE_IDS)
    codes = []
    with torch.no_grad():
        for _ in range(n):
            rows = [
                model.lm_head(model.model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1])[image]
                for seq in (cond, uncond)
            ]
            guided = rows[1] + cfg_scale * (rows[0] - rows[1]) if cfg_scale > 1 else rows[0]
            code = int(guided.argmax())
            codes.append(code)
            cond, uncond = [*cond, IMAGE_IDS[code]], [*uncond, IMAGE_IDS[code]]
    return codes


def _real(rows, row: int) -> list[int]:
    return rows.ids[row][rows.mask[row]].tolist()


def test_hf_masks_image_logits_so_the_reference_uses_lm_head(hf_model):
    ids = torch.tensor([[1, 7, 8, 5, 6]])
    with torch.no_grad():
        logits = hf_model(input_ids=ids).logits
    assert (logits[..., IMAGE_IDS] == torch.finfo(logits.dtype).min).all()


def test_reference_with_left_padding_matches_a_loop_without_padding(hf_model, tiny_tok):
    from tests.chameleon_reference import hf_greedy_cfg

    rows = prompt_rows(tiny_tok, "a red cat on the mat", 12, TINY)  # cond: 3 pads; uncond: 10 pads
    assert rows.mask.sum(1).tolist() == [9, 2]
    n = 8
    got = hf_greedy_cfg(hf_model, rows.ids, rows.mask, n, 1.0, IMAGE_IDS)
    assert got.dtype == torch.int64 and got.shape == (n,)
    cond = torch.tensor([_real(rows, 0)] * 2)
    alone = hf_greedy_cfg(hf_model, cond, torch.ones_like(cond, dtype=torch.bool), n, 1.0, IMAGE_IDS)
    assert got.tolist() == alone.tolist() == _naive(hf_model, _real(rows, 0), _real(rows, 1), n, 1.0)
    # a shorter conditional row, padded further: the same prompt, the same codes
    wide = prompt_rows(tiny_tok, "a red cat on the mat", 20, TINY)
    assert hf_greedy_cfg(hf_model, wide.ids, wide.mask, n, 1.0, IMAGE_IDS).tolist() == got.tolist()


def test_reference_cfg_matches_a_loop_without_padding(hf_model, tiny_tok):
    from tests.chameleon_reference import hf_greedy_cfg

    rows = prompt_rows(tiny_tok, "a red cat", 10, TINY)
    n = 8
    got = hf_greedy_cfg(hf_model, rows.ids, rows.mask, n, 3.0, IMAGE_IDS).tolist()
    assert got == _naive(hf_model, _real(rows, 0), _real(rows, 1), n, 3.0)
    assert got != _naive(hf_model, _real(rows, 0), _real(rows, 1), n, 1.0)  # the guidance matters here
