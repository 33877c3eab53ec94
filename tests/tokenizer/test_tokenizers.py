"""Kimi tiktoken tokenizer and chat format; HF tokenizer.json + Jinja template against
transformers' own tokenizer on the same files."""

from __future__ import annotations

import json

import pytest
import regex

from moeserve.testing.checkpoints import write_deepseek_tokenizer, write_kimi_tokenizer
from moeserve.tokenizer.fast import FastTokenizerWrapper
from moeserve.tokenizer.hf import load_hf_tokenizer
from moeserve.tokenizer.kimi import PAT_STR, KimiTokenizer

MULTILINGUAL = (
    "Hello, world! It's 2026; we'll test 1234567 numbers.\n"
    "人工智能正在改变世界。中文English混合 北京市 Pascal\n"
    "Emoji 🙂🚀👩‍💻 and Ünïcödé façade — naïve café; Привет мир!\n"
    "def f(x):\n\treturn x**2  # comment\n\n\n    indented   spaces\r\n"
)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(str(folder), 300)
    return str(folder)


@pytest.fixture(scope="module")
def kimi(kimi_dir):
    tok = load_hf_tokenizer(kimi_dir)
    assert isinstance(tok, KimiTokenizer)
    return tok


def test_kimi_round_trip_multilingual(kimi):
    ids = kimi.encode(MULTILINGUAL)
    assert kimi.decode(ids) == MULTILINGUAL
    assert len(ids) < len(MULTILINGUAL.encode())  # merges were applied
    assert all(0 <= i < kimi.vocab_size for i in ids)


def test_kimi_pretokenizer_is_the_published_pattern(kimi):
    """Han runs split from Latin words; digits in groups of at most 3; each piece encodes alone."""
    assert regex.findall(PAT_STR, "中文English混合", flags=regex.V1) == ["中文", "English", "混合"]
    assert regex.findall(PAT_STR, "北京市 Pascal", flags=regex.V1) == ["北京市", " Pascal"]
    assert regex.findall(PAT_STR, "1234567", flags=regex.V1) == ["123", "456", "7"]
    assert regex.findall(PAT_STR, "they're", flags=regex.V1) == ["they're"]
    text = "中文English混合 1234567 they're"
    pieces = [i for p in regex.findall(PAT_STR, text, flags=regex.V1) for i in kimi.encode(p)]
    assert kimi.encode(text) == pieces


def test_kimi_special_tokens_are_single_ids(kimi, kimi_dir):
    with open(f"{kimi_dir}/tokenizer_config.json") as f:
        added = {v["content"]: int(k) for k, v in json.load(f)["added_tokens_decoder"].items()}
    base = added["[BOS]"]
    # published offsets from 163584 kept
    assert added["<|im_end|>"] == base + 2 and added["<|im_middle|>"] == base + 17
    assert added["<think>"] == base + 22 and added["</think>"] == base + 23
    for t in [
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
    ]:
        assert kimi.encode(t) == [added[t]]
    ids = kimi.encode("<|im_user|>user<|im_middle|>hi<|im_end|>")
    assert ids[0] == added["<|im_user|>"] and ids[-1] == added["<|im_end|>"]
    assert kimi.decode(ids, skip_special_tokens=True) == "userhi"
    assert kimi.decode(ids, skip_special_tokens=False) == "<|im_user|>user<|im_middle|>hi<|im_end|>"
    assert kimi.eos_token_id == added["<|im_end|>"]
    assert kimi.id_to_token(added["<think>"]) == "<think>"


def test_kimi_chat_thinking_modes(kimi):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    base = (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert kimi.apply_chat_template(msgs) == base + "<think>"
    assert kimi.apply_chat_template(msgs, thinking=False) == base + "<think></think>"
    assert kimi.apply_chat_template(msgs, enable_thinking=False) == base + "<think></think>"
    no_sys = kimi.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert no_sys == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
        "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
    )


def test_kimi_chat_tools_and_tool_turns(kimi):
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    msgs = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need tool",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    text = kimi.apply_chat_template(msgs, tools=tools)
    expected = (
        "<|im_system|>tool_declare<|im_middle|>"
        + json.dumps(tools, separators=(",", ":"))
        + "<|im_end|>"
        "<|im_system|>system<|im_middle|>"
        "You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>need tool</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert text == expected
    # earlier rounds lose their reasoning; content parts are joined
    hist = kimi.apply_chat_template(
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "reasoning_content": "old"},
            {"role": "user", "content": [{"type": "text", "text": "c"}]},
        ],
        thinking=False,
    )
    assert "<think></think>b<|im_end|>" in hist and "old" not in hist
    assert "<|im_user|>user<|im_middle|>c<|im_end|>" in hist


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ds")
    write_deepseek_tokenizer(str(folder), 200)
    return str(folder)


def test_hf_tokenizer_matches_transformers(ds_dir):
    from transformers import AutoTokenizer

    ours = load_hf_tokenizer(ds_dir)
    assert isinstance(ours, FastTokenizerWrapper)
    ref = AutoTokenizer.from_pretrained(ds_dir)
    for text in [MULTILINGUAL, "plain", "<｜User｜>hi<｜Assistant｜>"]:
        assert ours.encode(text) == ref.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.encode("x")[0] == ours.bos_token_id == 0
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(msgs) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜><｜User｜>More<｜Assistant｜>"
    )
    assert ours.eos_token_id == 1 and 1 in ours.all_special_ids
