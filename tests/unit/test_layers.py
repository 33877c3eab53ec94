"""The package's import structure, from its source (ast): the layer order written in
docs/design.md holds (no import from a lower layer to a higher one, none between peers),
there are no import circles, and every module is imported by another one (entry points
aside). Imports inside functions count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moeserve"
DESIGN = ROOT / "docs" / "design.md"
# modules run from outside: the console script, `python -m moeserve.bench`, the package's
# public re-exports (`from moeserve import LLM`)
ENTRY_POINTS = {"moeserve", "moeserve.cli", "moeserve.bench.__main__"}


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the moeserve modules it imports (a `from pkg import name` counts as pkg.name
    where that is a module, else as pkg)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [
                    f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix
                    for a in node.names
                ]
            else:
                continue
            for t in targets:
                if t in modules and t != mod:
                    edges[mod].add(t)
    return edges


def _layer_order() -> dict[str, int]:
    """Top-level name -> its line in docs/design.md's `layers` block (0 = highest)."""
    m = re.search(r"```layers\n(.*?)```", DESIGN.read_text(), re.S)
    assert m, "docs/design.md has no ```layers block"
    rank = {}
    for i, line in enumerate(x for x in m.group(1).splitlines() if x.strip()):
        for name in line.split():
            rank[name] = i
    return rank


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_imports_follow_the_layer_order_in_design_md():
    modules = _modules()
    rank = _layer_order()
    tops = {_top(m) for m in modules if m != "moeserve"}
    assert not tops - set(rank), f"not placed in docs/design.md: {sorted(tops - set(rank))}"
    upward = []
    for src, targets in _imports(modules).items():
        if src == "moeserve":
            continue  # the package root re-exports the public API
        for dst in targets:
            a, b = _top(src), _top(dst)
            if a != b and rank[a] >= rank[b]:
                upward.append(f"{src} -> {dst}")
    assert upward == [], "imports from a lower (or peer) layer:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    edges = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert circles == []


def test_every_module_is_imported_by_another():
    modules = _modules()
    edges = _imports(modules)
    used = set()
    for targets in edges.values():
        for t in targets:
            parts = t.split(".")
            used.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    orphans = sorted(m for m in modules if m not in used and m not in ENTRY_POINTS)
    assert orphans == [], f"modules nothing in moeserve imports: {orphans}"
