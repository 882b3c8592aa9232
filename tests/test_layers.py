"""The project's layers, read from the source: who may import whom, no import circle, small modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("diloco", "coordinator", "islands", "benchmarks", "tests/probes")
GENERATED = ("diloco/v1/",)  # protoc output


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every import of our own modules, function-level ones included (that is where circles hide)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            edges |= {t for t in map(resolve, targets) if t and t != name}
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(_modules())


def test_the_circle_finder_finds_a_circle_and_a_lazy_import(tmp_path):
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    # The graph reads imports inside functions too: the harness's old circle was a lazy one.
    (tmp_path / "a.py").write_text("from p.b import run\n")
    (tmp_path / "b.py").write_text("def run():\n    from p import a\n    import p.c as c\n")
    (tmp_path / "c.py").write_text("")
    graph = import_graph({f"p.{m}": tmp_path / f"{m}.py" for m in "abc"})
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a", "p.c"}, "p.c": set()}
    assert circles(graph) == [["p.a", "p.b"]]


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_the_harness_sits_above_what_it_launches(graph):
    offenders = {
        (src, dst)
        for src, targets in graph.items()
        for dst in targets
        if (src.startswith("diloco") and dst.split(".")[0] in ("coordinator", "islands"))
        or (src.startswith("coordinator") and dst.startswith("islands"))
        or (src.startswith("islands") and dst.startswith("coordinator"))
        or (dst.startswith("islands.sim") and not src.startswith(("islands.sim", "benchmarks", "tests")))
        # benchmarks and probes sit above everything they measure or attack
        or (dst.split(".")[0] in ("benchmarks", "tests") and src.split(".")[0] in ("diloco", "coordinator", "islands"))
    }
    assert offenders == set()
    # and the harness really does use the layers beneath it, so the rules above have something to hold
    assert any(d.startswith("diloco") for d in graph["islands.sim.simulation"])
    assert "islands.sim.simulation" in graph["islands.sim.chaos"]


def test_the_core_library_is_in_wings_each_saying_what_it_holds():
    """diloco/: what a reader of DiLoCo needs at the top; the wire, data, models, security and the command lines in
    subpackages, each with a docstring."""
    wings = sorted(p.parent.name for p in (ROOT / "diloco").glob("*/__init__.py") if p.parent.name != "v1")
    assert wings == ["cli", "data", "models", "security", "wire"]
    for wing in wings:
        doc = ast.get_docstring(ast.parse((ROOT / "diloco" / wing / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"diloco/{wing}/__init__.py needs a paragraph saying what the wing holds"
    top = {p.stem for p in (ROOT / "diloco").glob("*.py")} - {"__init__"}
    assert {"config", "outer", "aggregate", "inner", "fragments", "streaming"} <= top and len(top) <= 15, sorted(top)


def _defines(path: Path, symbol: str) -> bool:
    """Whether path defines symbol: a top-level function or class, or Class.method."""
    tree = ast.parse(path.read_text(), str(path))
    owner, _, name = symbol.rpartition(".")
    scopes = [tree] if not owner else [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(n, kinds) and n.name == name for scope in scopes for n in scope.body)


def test_every_function_the_readme_round_map_names_is_where_it_says():
    """The README's "One outer round, file by file": each step's `file` and the `functions` named after it."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("One outer round, file by file"):]
    steps = re.findall(r"^\d+\. (.*?)(?=^\d+\. |^\n)", section[: section.index("\n\n", section.index("\n1. "))] + "\n\n",
                       re.M | re.S)
    assert len(steps) >= 8, steps
    checked = 0
    for step in steps:
        path, where = None, None
        for name in re.findall(r"`([^`]+)`", step.split(":")[0] + " " + " ".join(re.findall(r"\(`[^)]*\)", step))):
            if name.endswith(".py"):
                path = ROOT / name
                assert path.is_file(), f"the round map names {name}, which does not exist"
            elif re.fullmatch(r"[A-Za-z_][\w.]*", name) and path is not None:
                assert _defines(path, name), f"the round map says {name} is in {path.relative_to(ROOT)}; it is not"
                checked += 1
    assert checked >= len(steps), f"only {checked} functions checked in {len(steps)} steps"
