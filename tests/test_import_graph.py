"""No import cycle among the modules of ``unified_models`` (function-level imports included).

The graph is read from the source with ``ast`` (nothing is imported). An edge
``A -> B`` is an ``import`` / ``from ... import`` in ``A`` that executes module
``B`` of the package, wherever the statement is: at module level or inside a
function (a lazy import only moves the cycle to the first call). Importing
``a.b.c`` also executes the packages ``a`` and ``a.b`` (their ``__init__``), so
those are edges too, except the packages that contain ``A`` itself: they are
already being imported when ``A`` runs. ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. Imports under
``if TYPE_CHECKING:`` never run and are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "unified_models"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, mod: str, is_pkg: bool, modules):
    """Yield ``(target module, lazy, line)`` for every import statement of one module."""

    def visit(node, lazy):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.If) and _is_type_checking(ch):
                for sub in ch.orelse:
                    yield from visit(ast.Module(body=[sub], type_ignores=[]), lazy)
                continue
            if isinstance(ch, ast.Import):
                for a in ch.names:
                    yield a.name, lazy, ch.lineno
            elif isinstance(ch, ast.ImportFrom):
                if ch.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (ch.level - 1)]
                    target = ".".join(base + ([ch.module] if ch.module else []))
                else:
                    target = ch.module or ""
                for a in ch.names:
                    sub = f"{target}.{a.name}"
                    yield (sub if sub in modules else target), lazy, ch.lineno
            else:
                yield from visit(ch, lazy or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    yield from visit(tree, False)


def import_graph(root: Path = ROOT) -> dict[str, dict[str, list[tuple[bool, int]]]]:
    """``{importer: {imported: [(lazy, line), ...]}}`` over the modules of the package."""
    modules = _modules(root)
    graph: dict[str, dict[str, list[tuple[bool, int]]]] = {m: {} for m in modules}
    for mod, (path, is_pkg) in modules.items():
        for target, lazy, line in _imports(ast.parse(path.read_text(), str(path)), mod, is_pkg, modules):
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                executed = ".".join(parts[:i])
                if executed not in modules or executed == mod:
                    continue
                if i < len(parts) and mod.startswith(executed + "."):
                    continue  # a package containing the importer: already being imported
                uses = graph[mod].setdefault(executed, [])
                if (lazy, line) not in uses:
                    uses.append((lazy, line))
    return graph


def cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            connect(v)
    return sorted(out)


def describe(graph, comp: list[str]) -> str:
    lines = []
    for m in comp:
        for t, uses in sorted(graph[m].items()):
            if t in comp:
                where = ", ".join(f"line {ln}{' (lazy)' if lazy else ''}" for lazy, ln in uses)
                lines.append(f"    {m} -> {t}: {where}")
    return "\n".join(lines)


def test_graph_sees_imports():
    graph = import_graph()
    assert "unified_models.ops.autograd" in graph["unified_models.ops"]
    # a function-level import is an edge too
    assert any(lazy for lazy, _ in graph["unified_models.ops.linear.dispatch"]["unified_models.ops.linear.triton"])


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among unified_models modules:\n" + "\n".join(
        f"  cycle {i + 1}:\n{describe(graph, c)}" for i, c in enumerate(found))
