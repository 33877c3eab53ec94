"""Byte-level BPE tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

`tokenizer.ggml.pre` names llama.cpp's pre-tokenizer: a list of regexes applied one after the
other, each splitting every piece into matches and the text between them (`tokenizers`'
Split with behavior "isolated"), before byte-level BPE. Llama-family files (`smollm`,
`llama-bpe`, ...) and the DeepSeek / Kimi files of `deepseek2` models (`deepseek-v3`,
`deepseek-llm`, `deepseek-coder`, `kimi-k2`) are covered; an unknown name falls back to
GPT-2's split with a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from moeserve.tokenizer.fast import FastTokenizerWrapper

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer families (tokenizer.ggml.pre) -> splits applied before byte-level
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3 / R1: 1-3 digit runs, CJK runs, then words / punctuation runs / whitespace
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
]
# DeepSeek-LLM / V2: letters of the cased scripts (these code point ranges), then ASCII and
# full-width punctuation, trailing spaces, CJK / Hangul runs, digit runs
_CASED_LETTERS = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
    (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
    (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
    (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
    (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
    (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
    (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
    (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
    (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
    (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
    (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
    (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)  # fmt: skip
_CASED_CLASS = "".join(f"{chr(a)}-{chr(b)}" if a != b else chr(a) for a, b in _CASED_LETTERS)
_CJK_HANGUL = r"[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_LLM = [
    r"[\r\n]",
    rf"\s?[{_CASED_CLASS}]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"]
_PRE_SPLITS: dict[str, list[str]] = {
    "smollm": [r"\p{N}", _GPT2],  # digits one by one, then GPT-2's split
    "gpt2": [_GPT2],
    "default": [_GPT2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "deepseek-v3": _DEEPSEEK3,
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
}


def _pre_splits(pre: str) -> list[str]:
    if pre == "kimi-k2":  # the Kimi tokenizer's tiktoken pattern (Han runs apart from letters)
        from moeserve.tokenizer.kimi import PAT_STR

        return [PAT_STR]
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        log.warning("GGUF pre-tokenizer %r is not known; splitting text as GPT-2 does", pre)
        return [_GPT2]
    return splits


def build_gguf_tokenizer(meta: dict[str, Any]) -> FastTokenizerWrapper:
    """`meta`: the file's key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE only)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    splits = _pre_splits(meta.get("tokenizer.ggml.pre", "default"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(types) if t == _CONTROL]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in special])
    user = [
        AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED
    ]
    if user:
        tok.add_tokens(user)

    def opt_id(key: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    return FastTokenizerWrapper(
        tok,
        bos_token_id=opt_id("bos_token_id"),
        eos_token_id=opt_id("eos_token_id"),
        pad_token_id=opt_id("padding_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        special_ids=set(special),
    )
