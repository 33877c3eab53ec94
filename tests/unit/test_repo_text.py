"""The repository speaks of the software, not of how it was developed, and its links hold.

(a) No file tracked by git names a development round or an issue number, and no result under
benchmarks/results is named after the run that produced it: a result file is named after what
it measures, and its history lives in git.
(b) Every relative markdown link in README.md, docs/ and benchmarks/ resolves to a file or
folder tracked in this repository.
"""

from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Words about how the code came to be: a numbered session, issue or round, or a run suffix.
PROCESS_WORDS = re.compile(
    r"\bsessions? ?[0-9]+|\bissues? ?#?[0-9]+|\brounds? ?[0-9]+"
    r"|_run2|_rerun|_final\b|_repeat|before_merge",
    re.IGNORECASE,
)
# Identifiers that contain those letters and mean something else; removed from a line before
# it is searched.
ALLOWED = re.compile(
    r"\b_repeat\(|no_repeat_ngram|prefill_repeats|_on_repeat\b|request_repeats\b"
    r"|continue_final_message|_final_message|UNSTREAMED_FINAL_TOKENS",
    re.IGNORECASE,
)
# A result named after a run instead of a measurement: a session or round number, a rerun,
# a numbered or final run, a before/after pair.
ROUND_NAME = re.compile(
    r"session|round_?[0-9]|_run[0-9]*(?=[._]|$)|_rerun|_final|_repeat|_review|_before|_after",
    re.IGNORECASE,
)
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (reference definitions).
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
CODE_SPAN = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


@lru_cache(maxsize=1)
def tracked() -> tuple[str, ...]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return tuple(p for p in out.decode().split("\0") if p)


def _text(rel: str) -> str | None:
    """The file's text, or None for a binary file (or one gone from the working tree)."""
    try:
        data = (ROOT / rel).read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def process_words(text: str) -> list[str]:
    """`line: match` for every process word in `text` outside the allow-list."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in PROCESS_WORDS.finditer(ALLOWED.sub("", line)):
            hits.append(f"{n}: {m.group(0)!r}")
    return hits


def round_named(rel: str) -> bool:
    """Whether a path under benchmarks/results names a run instead of a measurement."""
    return any(ROUND_NAME.search(part) for part in Path(rel).parts[2:])


def markdown_files() -> list[str]:
    return [
        p
        for p in tracked()
        if p.endswith(".md")
        and (p == "README.md" or p.startswith(("docs/", "benchmarks/")))
        and p != THIS
    ]


def broken_links(rel: str, text: str, files: set[str], dirs: set[str]) -> list[str]:
    """The relative link targets of markdown file `rel` that name no tracked file or folder."""
    text = CODE_SPAN.sub("", text)
    base = Path(rel).parent
    bad = []
    for target in LINK.findall(text) + REF_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s), mailto, ...; an anchor in the same file
        path = target.split("#", 1)[0].split("?", 1)[0]
        parts: list[str] = []
        for part in (base / path).parts:
            if part == "..":
                if not parts:
                    parts = ["<outside the repository>"]
                    break
                parts.pop()
            elif part != ".":
                parts.append(part)
        resolved = "/".join(parts)
        if resolved not in files and resolved not in dirs:
            bad.append(target)
    return bad


def test_process_words_finds_what_it_should():
    assert process_words("measured in session 21")
    assert process_words("see issue #11") and process_words("Round 2 (issue 11)")
    assert process_words("decode_layer_run2.json")
    assert not process_words("def _repeat(x, groups):")
    assert not process_words("req.continue_final_message and no_repeat_ngram_size")
    assert round_named("benchmarks/results/decode_layer_session21.md")
    assert round_named("benchmarks/results/kernels_mla_heads_before_merge_fix.json")
    assert round_named("benchmarks/results/moe_m1_tiles_run2.log")
    assert not round_named("benchmarks/results/decode_layer_deepseek_fp8.md")
    assert not round_named("benchmarks/results/gpu_serve_smoke/gpu_count_to_50_graphs.txt")


def test_link_check_finds_what_it_should():
    files, dirs = {"README.md", "docs/a.md", "benchmarks/results/x.md"}, {"docs"}
    text = (
        "[ok](docs/a.md#part) [dir](docs/) [web](https://x.org/y.md) [mail](mailto:a@b.c) "
        "[gone](docs/b.md) [out](../shared/DESIGN.md) `[code](not/a/link.md)`"
    )
    assert broken_links("README.md", text, files, dirs) == ["docs/b.md", "../shared/DESIGN.md"]
    assert broken_links("docs/a.md", "[up](../benchmarks/results/x.md)", files, dirs) == []


def test_no_process_words_in_tracked_files():
    found = {}
    for rel in tracked():
        if rel == THIS:
            continue  # it spells the words out to look for them
        text = _text(rel)
        if text is not None and (hits := process_words(text)):
            found[rel] = hits[:5]
    assert not found, f"development rounds or issue numbers in tracked files: {found}"


def test_results_are_named_after_what_they_measure():
    bad = [p for p in tracked() if p.startswith("benchmarks/results/") and round_named(p)]
    assert not bad, f"results named after a run, not a measurement: {bad}"


def test_relative_markdown_links_resolve():
    files = set(tracked())
    dirs = {str(parent) for p in files for parent in Path(p).parents if str(parent) != "."}
    bad = {}
    for rel in markdown_files():
        text = _text(rel)
        if text is not None and (broken := broken_links(rel, text, files, dirs)):
            bad[rel] = broken
    assert not bad, f"relative links that resolve to nothing in the repository: {bad}"
