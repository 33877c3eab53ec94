"""Byte-level BPE tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from moeserve.tokenizer.fast import FastTokenizerWrapper

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer families (tokenizer.ggml.pre) -> splits applied before byte-level
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, list[str]] = {
    "smollm": [r"\p{N}", _GPT2],  # digits one by one, then GPT-2's split
    "gpt2": [_GPT2],
    "default": [_GPT2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
}


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
    splits = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", "default"), [_GPT2])
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
