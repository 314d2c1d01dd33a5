"""The package's shape, as docs/design.md states it: imports point down its layer tree (the
upward ones inside functions are the ones it lists), no import circle, the step imports no
diagnostics, no control flow by message text, thin CLI verbs."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ampguard"


def _modules() -> dict[str, Path]:
    return {".".join(f.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"): f
            for f in SRC.rglob("*.py")}


def import_graph(lazy: bool = True) -> dict[str, frozenset[str]]:
    """module -> the package modules it imports (with ``lazy``, imports inside functions too)."""
    return _import_graphs()[lazy]


@functools.cache  # (every source file parsed once for the whole module's tests, both kinds: not once a test)
def _import_graphs() -> dict[bool, dict[str, frozenset[str]]]:
    """{lazy: :func:`import_graph`'s graph} (each tree walked while it is held: not kept, for the GC to walk)."""
    mods = _modules()
    graphs: dict[bool, dict[str, frozenset[str]]] = {True: {}, False: {}}
    for mod, path in mods.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for lazy, graph in graphs.items():
            nodes = ast.walk(tree) if lazy else iter(tree.body)
            deps: set[str] = set()
            for node in nodes:
                if isinstance(node, ast.ImportFrom) and node.level:
                    parent = base[: len(base) - (node.level - 1)]
                    target = ".".join(parent + ([node.module] if node.module else []))
                    subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}
                    deps |= subs or {target}
            graph[mod] = frozenset(deps - {mod})
    return graphs


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


DESIGN = SRC.parents[1] / "docs" / "design.md"
UPWARD_IN_FUNCTIONS = {  # design.md section 1, "Imports inside functions that point up the tree"
    ("ampguard.precision", "ampguard.fp8"),
    ("ampguard.trainer", "ampguard.report"),
    ("ampguard.guards", "ampguard.locate"),
    ("ampguard.locate", "ampguard.report"),
    ("ampguard.validate", "ampguard"),
    ("ampguard.report", "ampguard"),
    ("ampguard.cli", "ampguard"),
}


def layer_order() -> dict[str, int]:
    """Each module's place in design.md's layer tree, bottom (0) to top; a package's modules
    (``tasks/``) share its place. Read from the tree's code block in section 1: a name at the
    start of a line, or after "; " (``__main__.py``, on ``__init__.py``'s line)."""
    text = DESIGN.read_text(encoding="utf-8")
    block = text[text.index("```\nsrc/ampguard/\n"):]
    block = block[: block.index("\n```", 4)]
    order: dict[str, int] = {}
    for line in block.splitlines()[2:]:
        for path in re.findall(r"(?:^  |; )([\w/]+?)(?:\.py|/)(?=\s)", line + " "):
            order["ampguard." + path.replace("/", ".")] = len(order)
    order["ampguard"] = order.pop("ampguard.__init__")
    return order


def _place(order: dict[str, int], module: str) -> int | None:
    while module and module not in order:
        module = module.rpartition(".")[0]
    return order.get(module)


def test_the_layer_tree_names_every_module():
    order = layer_order()
    missing = [m for m in _modules() if _place(order, m) is None and m != "ampguard.integrations"]
    assert not missing, f"modules design.md's tree does not place: {missing}"
    assert len(order) > 30


def test_module_level_imports_point_down_the_layer_tree():
    order = layer_order()
    upward = [f"{m} -> {d}" for m, deps in import_graph(lazy=False).items() for d in deps
              if m != "ampguard" and (_place(order, d) or 0) > (_place(order, m) or 0)]
    assert not upward, f"imports at module level that point up design.md's tree: {upward}"


def test_the_imports_in_functions_that_point_up_are_the_ones_design_md_lists():
    order, eager = layer_order(), import_graph(lazy=False)
    upward = {(m, d) for m, deps in import_graph(lazy=True).items() for d in deps - eager[m]
              if m != "ampguard" and (_place(order, d) or 0) > (_place(order, m) or 0)}
    assert upward == UPWARD_IN_FUNCTIONS, (sorted(upward - UPWARD_IN_FUNCTIONS), sorted(UPWARD_IN_FUNCTIONS - upward))


@pytest.mark.parametrize("diagnostic", ["ampguard.validate", "ampguard.locate", "ampguard.report", "ampguard.bench",
                                        "ampguard.compare"])
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
             {"_demo", "_train", "_validate", "_locate", "_report", "_compare", "_bench"}}
    assert len(verbs) == 7
    assert max(verbs.values()) <= 25, verbs


def test_no_deprecated_amp_namespace_is_used():
    # seed 001: torch.amp, not torch.cuda.amp (deprecated; torch.cpu.amp too): one device-generic API
    root = SRC.parents[1]
    pattern = re.compile(r"\btorch\.(cuda|cpu)\.amp\b")
    hits = [f"{p.relative_to(root)}:{n}" for folder in ("src", "examples", "benchmarks") for p in (root / folder).rglob("*.py")
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_ampguard_makes_its_progress_bars_in_one_place():
    # review 58m: the suite sets TQDM_DISABLE=1 (tests/conftest.py), so a bar made without ``disable=`` would not show
    # in any test's output; events.progress_bar's ``disable=None`` (off where stderr is no terminal) is tested, and
    # the bars are all its (signals only writes beside a live one)
    makers = sorted(f"{p.relative_to(SRC)}:{node.lineno}" for p in SRC.rglob("*.py")
                    for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tqdm"
                    or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "tqdm" for a in node.names))
    assert [m.split(":")[0] for m in makers] == ["events.py"], makers
