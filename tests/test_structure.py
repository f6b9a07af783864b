"""The house plan, read from the source: no import cycle between packages, no module over 400 lines.

A package is a folder under src/lowbit (``quant``, ``formats``, ...) or a top-level module
(``model_quant``, ``fusion``, ...). Every import counts, the ones inside functions too: a lazy
import defers the cost, not the dependency. ``from lowbit import save`` goes through the lazy
facade (``lowbit._PUBLIC``) and counts as an import of the package that defines the name, and
so does ``lowbit.save(...)`` after ``import lowbit``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import lowbit

SRC = Path(lowbit.__file__).parent
MAX_LINES = 400

def _package_of(module: str) -> str:
    """'lowbit.quant.scale_rules' -> 'quant'; 'lowbit.fusion' -> 'fusion'; 'lowbit' -> 'lowbit'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lowbit"


def _is_submodule(name: str) -> bool:
    return (SRC / name).is_dir() or (SRC / f"{name}.py").is_file()


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    """(absolute lowbit module, line) of every import in ``path``, at any depth."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    module = ".".join(rel.parts)
    package = module[: -len(".__init__")] if module.endswith(".__init__") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if base == "lowbit":  # the facade: a subpackage, or a public name defined elsewhere
                for a in node.names:
                    if _is_submodule(a.name):
                        out.append((f"lowbit.{a.name}", node.lineno))
                    elif a.name in lowbit._PUBLIC:
                        out.append((lowbit._PUBLIC[a.name], node.lineno))
            else:
                out.append((base, node.lineno))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "lowbit":
            if node.attr in lowbit._PUBLIC:  # `import lowbit` ... `lowbit.save(...)`
                out.append((lowbit._PUBLIC[node.attr], node.lineno))
            elif _is_submodule(node.attr):
                out.append((f"lowbit.{node.attr}", node.lineno))
    return [(m, line) for m, line in out if m == "lowbit" or m.startswith("lowbit.")]


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> ["file:line", ...] (imports within a package left out)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(SRC.rglob("*.py")):
        src = _package_of(".".join(path.relative_to(SRC.parent).with_suffix("").parts))
        for module, line in _imported_modules(path):
            dst = _package_of(module)
            if dst != src:
                graph[src][dst].append(f"{path.relative_to(SRC)}:{line}")
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one package (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def test_the_reader_sees_lazy_and_facade_imports():
    graph = package_graph()
    # lowbit.quantize imports lowbit.calibration inside the function
    assert "calibration" in graph["model_quant"]
    # models/builtin.py: `from lowbit import load` (defined in lowbit.checkpoint)
    assert "checkpoint" in graph["models"]
    # report/compare.py: `import lowbit` ... `lowbit.save(...)`
    assert any(where.startswith("report/compare.py") for where in graph["report"]["checkpoint"])


def test_no_import_cycle_between_packages():
    graph = package_graph()
    found = cycles({src: set(dsts) for src, dsts in graph.items()})
    detail = {c: {d: graph[c][d] for d in graph[c] if d in comp} for comp in found for c in comp}
    assert found == [], f"import cycles between packages: {found}; imports: {detail}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
