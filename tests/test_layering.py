"""The package's layering, read from its imports: no import cycle anywhere (module to module, lazy imports inside
functions included), no library module importing a CLI, and the top-level packages importing only down:

    cli -> runtime -> planner -> formats        synth -> formats

A newcomer can then read any module knowing that nothing below it depends on it. A planted cycle or an upward import
fails here with the chain that closes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "pinfer_llm"
# what each top-level package may import besides itself; "" is the package root (pinfer_llm/__init__.py: the
# version, which the CLIs' --version prints), which imports nothing (test_the_root_imports_nothing)
ALLOWED = {"formats": set(), "planner": {"formats"}, "synth": {"formats"}, "runtime": {"formats", "planner"},
           "cli": {"formats", "planner", "runtime", "synth", ""}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PKG).rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == PKG}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != PKG:
                continue
            for a in node.names:
                out.add(f"{src}.{a.name}" if f"{src}.{a.name}" in known else src)
    return {m for m in out if m in known} - {name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a closed chain of modules), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def top(m: str) -> str:
    parts = m.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read():
    g = graph()
    # a reader that sees nothing would pass every rule below
    assert len(g) > 80 and sum(len(d) for d in g.values()) > 250
    assert "pinfer_llm.formats.header" in g["pinfer_llm.formats.reader"]
    assert "pinfer_llm.runtime.ffn.predictor" in g["pinfer_llm.runtime.ffn.sparse"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_code_never_imports_a_cli():
    bad = [f"{m} -> {d}" for m, deps in graph().items() if top(m) != "cli" for d in deps if top(d) == "cli"]
    assert not bad, "library code imports a CLI module: " + "; ".join(bad)


def test_top_level_packages_import_only_down():
    bad = [f"{m} -> {d}" for m, deps in graph().items() if top(m) in ALLOWED for d in deps
           if top(d) != top(m) and top(d) not in ALLOWED[top(m)]]
    assert not bad, "an import against the layering (" + ", ".join(f"{k} may use {sorted(v)}" for k, v in
                                                           ALLOWED.items()) + "): " + "; ".join(bad)


def test_the_root_imports_nothing():
    assert graph()[PKG] == set()


@pytest.mark.parametrize("g, expect", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_find_cycle(g, expect):
    assert find_cycle(g) == expect
