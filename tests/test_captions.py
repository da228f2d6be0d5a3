"""Captions -> T5 ids -> features: LlamaGen's cleaning, tokenising, left padding, and the exported
encoder against transformers."""

from __future__ import annotations

import html
import re
import sys
import urllib.parse as ul
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from t5_fixtures import TINY_T5, tiny_t5

from lantern_rt.errors import LanternError, TextEncoderError
from lantern_rt.export.exporter import export_graph
from lantern_rt.families.llamagen.captions import (
    INSTALL_HINT,
    basic_clean,
    clean_caption,
    left_pad,
    load_tokenizer,
    preprocess,
    tokenize,
)
from lantern_rt.families.llamagen.text_encoder import encode, load_text_encoder
from lantern_rt.families.llamagen.text_encoder_graph import TOKENIZER_FILES, TextEncoderGraph, copy_tokenizer

ftfy = pytest.importorskip("ftfy")  # the t2i extra
bs4 = pytest.importorskip("bs4")
pytest.importorskip("transformers")

LENGTH = 16  # tokenizer tests
EXPORT_LENGTH = 120  # LlamaGen's t5_feature_max_len


# fmt: off
class LlamaGenCleaner:
    """LlamaGen's ``language/t5.py`` (``T5Embedder``) cleaning, copied as the independent reference
    (only ``bad_punct_regex``'s non-raw escapes are doubled: the same string, without warnings)."""

    bad_punct_regex = re.compile(r'['+'#®•©™&@·º½¾¿¡§~'+'\\)'+'\\('+'\\]'+'\\['+'\\}'+'\\{'+'\\|'+'\\'+'\\/'+'\\*' + r']{1,}')

    @staticmethod
    def basic_clean(text):
        text = ftfy.fix_text(text)
        text = html.unescape(html.unescape(text))
        return text.strip()

    def clean_caption(self, caption):
        caption = str(caption)
        caption = ul.unquote_plus(caption)
        caption = caption.strip().lower()
        caption = re.sub('<person>', 'person', caption)
        # urls:
        caption = re.sub(
            r'\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)))',  # noqa
            '', caption)  # regex for urls
        caption = re.sub(
            r'\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)))',  # noqa
            '', caption)  # regex for urls
        # html:
        caption = bs4.BeautifulSoup(caption, features='html.parser').text

        # @<nickname>
        caption = re.sub(r'@[\w\d]+\b', '', caption)

        caption = re.sub(r'[\u31c0-\u31ef]+', '', caption)
        caption = re.sub(r'[\u31f0-\u31ff]+', '', caption)
        caption = re.sub(r'[\u3200-\u32ff]+', '', caption)
        caption = re.sub(r'[\u3300-\u33ff]+', '', caption)
        caption = re.sub(r'[\u3400-\u4dbf]+', '', caption)
        caption = re.sub(r'[\u4dc0-\u4dff]+', '', caption)
        caption = re.sub(r'[\u4e00-\u9fff]+', '', caption)
        #######################################################

        # все виды тире / all types of dash --> "-"
        caption = re.sub(
            r'[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C\u3030\u30A0\uFE31\uFE32\uFE58\uFE63\uFF0D]+',  # noqa
            '-', caption)

        # кавычки к одному стандарту
        caption = re.sub(r'[`´«»“”¨]', '"', caption)
        caption = re.sub(r'[‘’]', "'", caption)

        # &quot;
        caption = re.sub(r'&quot;?', '', caption)
        # &amp
        caption = re.sub(r'&amp', '', caption)

        # ip adresses:
        caption = re.sub(r'\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}', ' ', caption)

        # article ids:
        caption = re.sub(r'\d:\d\d\s+$', '', caption)

        # \n
        caption = re.sub(r'\\n', ' ', caption)

        # "#123"
        caption = re.sub(r'#\d{1,3}\b', '', caption)
        # "#12345.."
        caption = re.sub(r'#\d{5,}\b', '', caption)
        # "123456.."
        caption = re.sub(r'\b\d{6,}\b', '', caption)
        # filenames:
        caption = re.sub(r'[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)', '', caption)

        #
        caption = re.sub(r'[\"\']{2,}', r'"', caption)  # """AUSVERKAUFT"""
        caption = re.sub(r'[\.]{2,}', r' ', caption)  # """AUSVERKAUFT"""

        caption = re.sub(self.bad_punct_regex, r' ', caption)  # ***AUSVERKAUFT***, #AUSVERKAUFT
        caption = re.sub(r'\s+\.\s+', r' ', caption)  # " . "

        # this-is-my-cute-cat / this_is_my_cute_cat
        regex2 = re.compile(r'(?:\-|\_)')
        if len(re.findall(regex2, caption)) > 3:
            caption = re.sub(regex2, ' ', caption)

        caption = self.basic_clean(caption)

        caption = re.sub(r'\b[a-zA-Z]{1,3}\d{3,15}\b', '', caption)  # jc6640
        caption = re.sub(r'\b[a-zA-Z]+\d+[a-zA-Z]+\b', '', caption)  # jc6640vc
        caption = re.sub(r'\b\d+[a-zA-Z]+\d+\b', '', caption)  # 6640vc231

        caption = re.sub(r'(worldwide\s+)?(free\s+)?shipping', '', caption)
        caption = re.sub(r'(free\s)?download(\sfree)?', '', caption)
        caption = re.sub(r'\bclick\b\s(?:for|on)\s\w+', '', caption)
        caption = re.sub(r'\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?', '', caption)
        caption = re.sub(r'\bpage\s+\d+\b', '', caption)

        caption = re.sub(r'\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b', r' ', caption)  # j2d1a2a...

        caption = re.sub(r'\b\d+\.?\d*[xх×]\d+\.?\d*\b', '', caption)

        caption = re.sub(r'\b\s+\:\s+', r': ', caption)
        caption = re.sub(r'(\D[,\./])\b', r'\1 ', caption)
        caption = re.sub(r'\s+', ' ', caption)

        caption.strip()

        caption = re.sub(r'^[\"\']([\w\W]+)[\"\']$', r'\1', caption)
        caption = re.sub(r'^[\'\_,\-\:;]', r'', caption)
        caption = re.sub(r'[\'\_,\-\:\-\+]$', r'', caption)
        caption = re.sub(r'^\.\S+$', '', caption)

        return caption.strip()
# fmt: on


LLAMAGEN_PROMPTS = [  # sample_t2i.py's
    "A portrait photo of a kangaroo wearing an orange hoodie and blue sunglasses standing on the grassin "
    "front of the Sydney Opera House holding a sign on the chest that says Welcome Friends!",
    "A blue Porsche 356 parked in front of a yellow brick wall.",
    "A photo of an astronaut riding a horse in the forest. There is a river in front of them with water lilies.",
    "A map of the United States made out of sushi. It is on a table next to a glass of red wine.",
]
TRICKY = [
    "A cat on https://example.com/cats/1.html sitting, see http://foo.ru/x and www.site.org",
    "<b>Bold</b> <i>text</i> &amp; more &quot;quoted&quot; &amp;amp; &lt;tag&gt;",
    "Hello @john_doe and @Jane99, nice shot!",
    "this-is-my-cute-cat",
    "this_is_my_cute_cat",
    "a well-known dog - a three-legged one",
    "“Smart quotes” and ‘single’ — em dash – en dash ― bar",
    "IMG_1234.jpg of a sunset over my_photo.PNG and report.pdf",
    "Free shipping worldwide! Click for details, free download png images",
    "Server at 192.168.0.1 is down 12:30   ",
    "A%20URL%20encoded+caption%21",
    "Item #123 and #12345678 and 1234567 and #1234",
    "jc6640 and jc6640vc and 6640vc231 and j2d1a2a3 here",
    "A 1920x1080 wallpaper, page 3 of 10.5×7",
    "中文 Chinese characters 日本語 ㈱ ㎏",
    "'a quoted caption'",
    "***AUSVERKAUFT*** #sale ... done . end",
    "  multiple   spaces\\nliteral newline  ",
    "<person> holding a sign that says Welcome Friends!",
    "mojibake: cafÃ© crÃ¨me, Â£5 (price) [note] {x} |y| ~z~ ©2020",
    "",
    "-leading dash and trailing plus+",
    ".hidden",
    "&amp;quot;hi&amp;quot; and &amp;quotbye &amp;amp;lt;b&amp;amp;gt;",
    "«guillemets» and ``backticks'' and ´acute´ ¨",
]


def test_clean_caption_matches_llamagen():
    reference = LlamaGenCleaner()
    for text in LLAMAGEN_PROMPTS + TRICKY:
        once = reference.clean_caption(text)
        assert clean_caption(text) == once, text
        assert preprocess(text) == reference.clean_caption(once), text


def test_basic_clean_matches_llamagen():
    for text in ["&amp;lt;b&amp;gt; cafÃ© &amp;amp;amp;", "&amp;amp;lt; <b>", "ﬁne \u00e9t\u00e9"]:
        assert basic_clean(text) == LlamaGenCleaner.basic_clean(text), text


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("this-is-my-cute-cat", "this is my cute cat"),
        ("a well-known dog", "a well-known dog"),
        ("Hello @john_doe, hi!", "hello , hi!"),
        ("<b>Bold</b> cat", "bold cat"),
        ("IMG_1234.jpg of a sunset", "of a sunset"),
        ("“Hi” — there", '"hi" - there'),
        ("", ""),
    ],
)
def test_clean_caption_examples(text: str, want: str):
    assert preprocess(text) == want


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_t5(tmp_path_factory.mktemp("t5") / "tiny-t5")


@pytest.fixture(scope="module")
def tokenizer(t5_folder: Path):
    return load_tokenizer(t5_folder)


def test_tiny_t5_is_deterministic(t5_folder: Path, tmp_path: Path):
    again = tiny_t5(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (t5_folder / name).read_bytes(), name


def test_tokenize_empty_and_short(tokenizer):
    tokens = tokenize(tokenizer, ["", "A photo of a cat."], LENGTH)
    assert tokens.ids.dtype == tokens.mask.dtype == torch.int64
    assert tokens.ids.shape == tokens.mask.shape == (2, LENGTH)
    assert tokens.truncated == [False, False]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert (eos, pad) == (1, 0)
    assert tokens.ids[0].tolist() == [eos] + [pad] * (LENGTH - 1)  # an empty prompt is </s> alone
    assert tokens.mask[0].tolist() == [1] + [0] * (LENGTH - 1)
    want = tokenizer(preprocess("A photo of a cat."))["input_ids"]
    n = len(want)
    assert 2 < n < LENGTH and want[-1] == eos
    assert tokens.ids[1].tolist() == want + [pad] * (LENGTH - n)
    assert tokens.mask[1].tolist() == [1] * n + [0] * (LENGTH - n)


def test_tokenize_truncates_keeping_eos(tokenizer):
    assert tokenizer("a a")["input_ids"] == [tokenizer.convert_tokens_to_ids("▁a")] * 2 + [1]
    exact, over = "a " * (LENGTH - 1), "a " * (LENGTH - 2) + "cat on the sofa"  # LENGTH tokens, more
    words = "a red bicycle leaning against a stone fence near the window in the park at night"
    tokens = tokenize(tokenizer, [exact, over, words], LENGTH)
    assert len(tokenizer(preprocess(exact))["input_ids"]) == LENGTH
    assert tokens.truncated == [False, True, True]
    assert tokens.mask.all() and (tokens.ids[:, -1] == tokenizer.eos_token_id).all()
    for row, prompt in zip(tokens.ids, [exact, over, words], strict=True):
        full = tokenizer(preprocess(prompt))["input_ids"]
        assert row.tolist() == full[: LENGTH - 1] + [tokenizer.eos_token_id]


def test_tokenize_rejects_bad_arguments(tokenizer):
    with pytest.raises(TextEncoderError):
        tokenize(tokenizer, [], LENGTH)
    with pytest.raises(TextEncoderError):
        tokenize(tokenizer, "a cat", LENGTH)  # type: ignore[arg-type]
    with pytest.raises(TextEncoderError):
        tokenize(tokenizer, ["a cat"], 0)


def llamagen_left_pad(caption_embs: torch.Tensor, emb_masks: torch.Tensor):
    """sample_t2i.py's loop, verbatim but for the prints."""
    new_emb_masks = torch.flip(emb_masks, dims=[-1])
    new_caption_embs = []
    for caption_emb, emb_mask in zip(caption_embs, emb_masks, strict=True):
        valid_num = int(emb_mask.sum().item())
        new_caption_emb = torch.cat([caption_emb[valid_num:], caption_emb[:valid_num]])
        new_caption_embs.append(new_caption_emb)
    new_caption_embs = torch.stack(new_caption_embs)
    return new_caption_embs * new_emb_masks[:, :, None], new_emb_masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_pad_equals_llamagen_loop(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    n, length, dim = 6, 12, 5
    features = torch.randn(n, length, dim, generator=g).to(dtype)
    valid = torch.tensor([1, 3, 7, 11, 12, 5])
    right_padded = (torch.arange(length)[None] < valid[:, None]).to(torch.int64)
    scattered = (torch.rand(n, length, generator=g) < 0.5).to(torch.int64)  # not right padded: same rule
    for mask in (right_padded, scattered):
        got, got_mask = left_pad(features, mask)
        want, want_mask = llamagen_left_pad(features, mask)
        assert got.dtype == dtype and got_mask.dtype == torch.bool
        assert torch.equal(got, want)
        assert torch.equal(got_mask, want_mask.bool())
    got, got_mask = left_pad(features, right_padded)
    assert got_mask[:, -1].all() and not got[~got_mask].any()  # valid last, padding zero


# The exporter's constant folding of T5's relative position buckets takes log(0) (masked by a where).
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_exported_encoder_equals_transformers(t5_folder: Path, tokenizer, tmp_path: Path):
    from transformers import T5EncoderModel

    model = load_text_encoder(t5_folder)
    graph = TextEncoderGraph(model, EXPORT_LENGTH)
    ids, mask = graph.example_inputs(torch.Generator().manual_seed(0))
    assert 0 < int(mask.sum()) < EXPORT_LENGTH and ids.max() < TINY_T5["vocab_size"]
    entry = export_graph(graph, graph, tmp_path, 18, 0)
    assert entry["file"] == "text_encoder.onnx"
    assert entry["outputs"] == [{"name": "features", "shape": [1, EXPORT_LENGTH, 32], "dtype": "float32"}]
    session = ort.InferenceSession(str(tmp_path / entry["file"]), providers=["CPUExecutionProvider"])
    plain = T5EncoderModel.from_pretrained(str(t5_folder)).eval()  # transformers' defaults (SDPA)
    for prompt in ["", "a cat", LLAMAGEN_PROMPTS[0], " ".join(LLAMAGEN_PROMPTS)]:
        tokens = tokenize(tokenizer, [prompt], EXPORT_LENGTH)
        (got,) = session.run(None, {"ids": tokens.ids.numpy(), "mask": tokens.mask.numpy()})
        with torch.no_grad():
            want = plain(input_ids=tokens.ids, attention_mask=tokens.mask).last_hidden_state
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)
        assert torch.allclose(encode(model, tokens.ids, tokens.mask), want, atol=1e-5)
        assert want.abs().max() > 0.1
    TextEncoderGraph(plain, EXPORT_LENGTH)  # SDPA does not export: the graph switches it to eager
    assert plain.config._attn_implementation == "eager"


def test_load_errors_are_one_line(t5_folder: Path, tmp_path: Path):
    def one_line(fn, *args) -> str:
        with pytest.raises(TextEncoderError) as info:
            fn(*args)
        assert isinstance(info.value, LanternError) and "\n" not in str(info.value)
        return str(info.value)

    missing = tmp_path / "nowhere"
    assert str(missing) in one_line(load_text_encoder, missing)
    assert str(missing) in one_line(load_tokenizer, missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json" in one_line(load_text_encoder, empty)
    (empty / "config.json").write_bytes((t5_folder / "config.json").read_bytes())
    assert str(empty) in one_line(load_text_encoder, empty)  # no weights
    (empty / "model.safetensors").write_bytes(b"not a safetensors file")
    assert str(empty) in one_line(load_text_encoder, empty)
    from safetensors.torch import load_file, save_file

    state = load_file(str(t5_folder / "model.safetensors"))
    state.pop(next(k for k in state if "layer.1" in k))
    save_file(state, str(empty / "model.safetensors"))
    assert "lack" in one_line(load_text_encoder, empty)
    (empty / "tokenizer.json").write_text("{ not json")
    assert str(empty) in one_line(load_tokenizer, empty)


def test_missing_dependency_gives_the_install_hint(monkeypatch, t5_folder: Path):
    for module, call in [
        ("transformers", lambda: load_tokenizer(t5_folder)),
        ("transformers", lambda: load_text_encoder(t5_folder)),
        ("ftfy", lambda: clean_caption("a cat")),
        ("bs4", lambda: clean_caption("a cat")),
    ]:
        with monkeypatch.context() as m:
            m.setitem(sys.modules, module, None)  # import raises ImportError
            with pytest.raises(TextEncoderError) as info:
                call()
        message = str(info.value)
        assert "\n" not in message and INSTALL_HINT in message and module in message


def test_copy_tokenizer(t5_folder: Path, tmp_path: Path):
    names = copy_tokenizer(t5_folder, tmp_path / "bundle" / "tokenizer")
    assert set(names) <= set(TOKENIZER_FILES) and {"tokenizer.json", "tokenizer_config.json"} <= set(names)
    copied = load_tokenizer(tmp_path / "bundle" / "tokenizer")
    assert (
        copied("a photo of a cat")["input_ids"] == load_tokenizer(t5_folder)("a photo of a cat")["input_ids"]
    )
    with pytest.raises(TextEncoderError):
        copy_tokenizer(tmp_path / "bundle", tmp_path / "elsewhere")
