"""The package's shape, as docs/design.md states it: no import circle, the step imports no
diagnostics, no control flow by message text, thin CLI verbs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ampguard"


def _modules() -> dict[str, Path]:
    return {".".join(f.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): f
            for f in SRC.rglob("*.py")}


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """module -> the package modules it imports (with ``lazy``, imports inside functions too)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = ast.walk(tree) if lazy else iter(tree.body)
        deps: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.level:
                parent = base[: len(base) - (node.level - 1)]
                target = ".".join(parent + ([node.module] if node.module else []))
                subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}
                deps |= subs or {target}
        graph[mod] = deps - {mod}
    return graph


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                circles.append(path[path.index(dep):] + [dep])
            elif len(path) < 40:
                visit(dep, path + [dep])

    for start in sorted(graph):
        visit(start, [start])
    return circles


def test_the_circle_finder_finds_a_circle():
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) and not find_circles({"a": {"b"}, "b": set()})


def test_no_import_circle_in_the_package_lazy_imports_included():
    circles = find_circles(import_graph(lazy=True))
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("diagnostic", ["ampguard.validate", "ampguard.locate", "ampguard.report", "ampguard.bench"])
def test_the_step_never_imports_diagnostics(diagnostic):
    assert diagnostic not in _reachable(import_graph(lazy=True), "ampguard.step")


def test_no_control_flow_by_message_text():
    pattern = re.compile(r"""["'][^"']*["']\s+(not\s+)?in\s+[\w.]*message\b""")
    hits = [f"{p.name}:{n}" for p in SRC.rglob("*.py")
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_cli_verbs_are_thin():
    tree = ast.parse((SRC / "cli.py").read_text(encoding="utf-8"))
    verbs = {node.name: node.end_lineno - node.lineno + 1 for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name in
             {"_demo", "_train", "_validate", "_locate", "_report", "_bench"}}
    assert len(verbs) == 6
    assert max(verbs.values()) <= 25, verbs
