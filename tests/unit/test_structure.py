"""The shape of the code: no class over 400 lines, no `__init__` over 40 lines in engine/ and
layers/ (construction is spelled out in named steps), and no layer that compares a kernel
plan's field against a kernel name (layers call the backend object the plan chose)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "moeserve"
MAX_CLASS_LINES = 400
MAX_INIT_LINES = 40
# `plan.mla == "triton"`, `self.kernel in ("fused", ...)`: a string kernel name held by a layer
KERNEL_NAME_TEST = re.compile(r"\bplan\.\w+\s*(==|!=|\bin\b)\s*[\(\[\{]?\s*[\"']")


def _trees() -> list[tuple[Path, ast.Module]]:
    return [(f, ast.parse(f.read_text())) for f in sorted(ROOT.rglob("*.py"))]


def _classes() -> list[tuple[Path, ast.ClassDef]]:
    return [(f, n) for f, t in _trees() for n in ast.walk(t) if isinstance(n, ast.ClassDef)]


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_is_over_400_lines():
    big = [(f"{f.relative_to(ROOT)}:{c.name}", _lines(c)) for f, c in _classes()]
    assert [b for b in big if b[1] > MAX_CLASS_LINES] == []
    assert big  # the walk found classes: the test can fail


@pytest.mark.parametrize("package", ["engine", "layers"])
def test_no_init_is_over_40_lines(package):
    long = []
    for f, c in _classes():
        if package not in f.relative_to(ROOT).parts[:1]:
            continue
        for m in c.body:
            if isinstance(m, ast.FunctionDef) and m.name == "__init__":
                if _lines(m) > MAX_INIT_LINES:
                    long.append((f"{f.relative_to(ROOT)}:{c.name}", _lines(m)))
    assert long == []


def test_layers_hold_no_kernel_names():
    hits = []
    for sub in ("layers", "models"):
        for f in sorted((ROOT / sub).rglob("*.py")):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if KERNEL_NAME_TEST.search(line):
                    hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == []


def test_the_kernel_name_pattern_matches_what_it_forbids():
    assert KERNEL_NAME_TEST.search('self.fused = plan.moe == "fused"')
    assert KERNEL_NAME_TEST.search("if plan.mla in ('triton', 'gluon'):")
    assert not KERNEL_NAME_TEST.search("self.backend = plan.mla_backend")
