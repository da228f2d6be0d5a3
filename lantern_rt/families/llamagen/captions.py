"""Captions -> T5 token ids, and LlamaGen's left padding of the T5 features.

A port of LlamaGen's ``language/t5.py`` (``T5Embedder``, after PixArt) and of the left padding in
``autoregressive/sample/sample_t2i.py``: the prompt is cleaned twice by :func:`clean_caption`
(the text cleaning of the training stage), tokenised to ``max_length`` tokens (120 for LlamaGen's
flan-t5-xl features) with ``</s>`` last, right padded; after the encoder, :func:`left_pad` moves
each prompt's valid features to the end. ftfy, BeautifulSoup and transformers are imported only
when needed (``pip install 'lantern-rt[t2i]'``).
"""

from __future__ import annotations

import html
import re
import urllib.parse as ul
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lantern_rt.errors import TextEncoderError, first_line, require

INSTALL_HINT = "pip install 'lantern-rt[t2i]'"


# LlamaGen's (PixArt's) regexes, verbatim and in their order.
_URL_HTTP = re.compile(
    r"\b((?:https?:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)))"
)
_URL_WWW = re.compile(
    r"\b((?:www:(?:\/{1,3}|[a-zA-Z0-9%])|[a-zA-Z0-9.\-]+[.](?:com|co|ru|net|org|edu|gov|it)[\w/-]*\b\/?(?!@)))"
)
_CJK = [
    r"[\u31c0-\u31ef]+",  # CJK Strokes
    r"[\u31f0-\u31ff]+",  # Katakana Phonetic Extensions
    r"[\u3200-\u32ff]+",  # Enclosed CJK Letters and Months
    r"[\u3300-\u33ff]+",  # CJK Compatibility
    r"[\u3400-\u4dbf]+",  # CJK Unified Ideographs Extension A
    r"[\u4dc0-\u4dff]+",  # Yijing Hexagram Symbols
    r"[\u4e00-\u9fff]+",  # CJK Unified Ideographs
]
_DASHES = (
    r"[\u002D\u058A\u05BE\u1400\u1806\u2010-\u2015\u2E17\u2E1A\u2E3A\u2E3B\u2E40\u301C\u3030\u30A0"
    r"\uFE31\uFE32\uFE58\uFE63\uFF0D]+"
)
_BAD_PUNCT = re.compile(r"[#®•©™&@·º½¾¿¡§~\)\(\]\[\}\{\|\\\/\*]{1,}")
_DASH_OR_UNDERSCORE = re.compile(r"(?:\-|\_)")

_BEFORE_HTML = [("<person>", "person"), (_URL_HTTP, ""), (_URL_WWW, "")]
_AFTER_HTML = [
    (r"@[\w\d]+\b", ""),  # @<nickname>
    *((cjk, "") for cjk in _CJK),
    (_DASHES, "-"),  # all kinds of dash -> "-"
    (r"[`´«»“”¨]", '"'),  # quotes to one standard
    (r"[‘’]", "'"),
    (r"&quot;?", ""),
    (r"&amp", ""),
    (r"\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}", " "),  # ip addresses
    (r"\d:\d\d\s+$", ""),  # article ids
    (r"\\n", " "),  # a literal backslash-n
    (r"#\d{1,3}\b", ""),  # "#123"
    (r"#\d{5,}\b", ""),  # "#12345.."
    (r"\b\d{6,}\b", ""),  # "123456.."
    (r"[\S]+\.(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)", ""),  # filenames
    (r"[\"\']{2,}", r'"'),  # """AUSVERKAUFT"""
    (r"[\.]{2,}", r" "),
    (_BAD_PUNCT, r" "),  # ***AUSVERKAUFT***, #AUSVERKAUFT
    (r"\s+\.\s+", r" "),  # " . "
]
_AFTER_BASIC_CLEAN = [
    (r"\b[a-zA-Z]{1,3}\d{3,15}\b", ""),  # jc6640
    (r"\b[a-zA-Z]+\d+[a-zA-Z]+\b", ""),  # jc6640vc
    (r"\b\d+[a-zA-Z]+\d+\b", ""),  # 6640vc231
    (r"(worldwide\s+)?(free\s+)?shipping", ""),
    (r"(free\s)?download(\sfree)?", ""),
    (r"\bclick\b\s(?:for|on)\s\w+", ""),
    (r"\b(?:png|jpg|jpeg|bmp|webp|eps|pdf|apk|mp4)(\simage[s]?)?", ""),
    (r"\bpage\s+\d+\b", ""),
    (r"\b\d*[a-zA-Z]+\d+[a-zA-Z]+\d+[a-zA-Z\d]*\b", r" "),  # j2d1a2a...
    (r"\b\d+\.?\d*[xх×]\d+\.?\d*\b", ""),
    (r"\b\s+\:\s+", r": "),
    (r"(\D[,\./])\b", r"\1 "),
    (r"\s+", " "),
    (r"^[\"\']([\w\W]+)[\"\']$", r"\1"),
    (r"^[\'\_,\-\:;]", r""),
    (r"[\'\_,\-\:\-\+]$", r""),
    (r"^\.\S+$", ""),
]


def _subs(text: str, rules) -> str:
    for pattern, repl in rules:
        text = re.sub(pattern, repl, text)
    return text


def basic_clean(text: str) -> str:
    """ftfy's fix, two rounds of HTML unescaping, strip (``T5Embedder.basic_clean``)."""
    text = require("ftfy", INSTALL_HINT).fix_text(text)
    return html.unescape(html.unescape(text)).strip()


def clean_caption(text: str) -> str:
    """LlamaGen's ``T5Embedder.clean_caption``: lower case; URLs, HTML, @names, CJK, ids, file
    names and stray punctuation removed; dashes and quotes unified."""
    soup = require("bs4", INSTALL_HINT).BeautifulSoup
    caption = ul.unquote_plus(str(text)).strip().lower()
    caption = _subs(caption, _BEFORE_HTML)
    caption = soup(caption, features="html.parser").text
    caption = _subs(caption, _AFTER_HTML)
    if len(re.findall(_DASH_OR_UNDERSCORE, caption)) > 3:  # this-is-my-cute-cat / this_is_my_cute_cat
        caption = re.sub(_DASH_OR_UNDERSCORE, " ", caption)
    caption = basic_clean(caption)
    return _subs(caption, _AFTER_BASIC_CLEAN).strip()


def preprocess(text: str) -> str:
    """The text cleaning of LlamaGen's training stage: :func:`clean_caption` twice."""
    return clean_caption(clean_caption(text))


def load_tokenizer(folder: Path) -> Any:
    """The T5 tokenizer in ``folder`` (``AutoTokenizer.from_pretrained``)."""
    folder = Path(folder)
    auto = require("transformers", INSTALL_HINT).AutoTokenizer
    if not folder.is_dir():
        raise TextEncoderError(f"{folder}: no such tokenizer folder")
    try:
        return auto.from_pretrained(str(folder))
    except Exception as err:  # transformers raises many types; report one line
        raise TextEncoderError(f"{folder}: the tokenizer does not load: {first_line(err)}") from err


class Tokens(NamedTuple):
    """Token ids and attention mask, int64 [N, L], right padded; whether each prompt was cut."""

    ids: Tensor
    mask: Tensor
    truncated: list[bool]


def tokenize(tokenizer: Any, prompts: list[str], max_length: int) -> Tokens:
    """The preprocessed ``prompts`` tokenised as LlamaGen does: ``</s>`` appended, cut to
    ``max_length`` tokens (``</s>`` kept last, so at most ``max_length - 1`` text tokens) and
    right padded with ``<pad>``. ``truncated[i]``: prompt i had more than ``max_length`` tokens.
    An empty prompt (or one that cleans to nothing) is allowed: it is ``</s>`` alone."""
    if isinstance(prompts, str) or not prompts:
        raise TextEncoderError("prompts must be a non-empty list of strings")
    if max_length < 1:
        raise TextEncoderError(f"max_length must be at least 1, not {max_length}")
    texts = [preprocess(p) for p in prompts]
    enc = tokenizer(
        texts,
        max_length=max_length,
        padding="max_length",
        truncation=True,
        return_attention_mask=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    full = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    truncated = [len(ids) > max_length for ids in full]
    return Tokens(enc["input_ids"].to(torch.int64), enc["attention_mask"].to(torch.int64), truncated)


def left_pad(features: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """LlamaGen's left padding: each row of ``features`` [N, L, C] rotated so that its
    ``mask.sum()`` valid features come last, the padded slots zeroed; and the flipped ``mask``
    [N, L] as bool. Equal to ``sample_t2i.py``'s loop, without one (a gather)."""
    length = features.shape[1]
    valid = mask.to(torch.int64).sum(-1, keepdim=True)  # [N, 1]
    rows = (torch.arange(length, device=features.device)[None] + valid.to(features.device)) % length
    rotated = features.gather(1, rows[..., None].expand(-1, -1, features.shape[2]))
    new_mask = torch.flip(mask, dims=[-1]).to(features.device)
    return rotated * new_mask[..., None].to(features.dtype), new_mask.bool()
