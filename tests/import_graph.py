"""The import graph of sparseattn's own modules, read statically: what the no-cycle tests walk."""

from __future__ import annotations

import ast
from pathlib import Path

import sparseattn

ROOT = Path(sparseattn.__file__).parent


def sparseattn_imports(path: Path) -> set[str]:
    """Every sparseattn module (and ``module.name``) a file imports, wherever the import is written
    (function-local imports count: they hide cycles), except those under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparseattn"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sparseattn")}
    return found


def package_imports(*folders: str) -> dict[str, set[str]]:
    """``sparseattn.<folder>.<module>`` -> what it imports, for every module of the folders (``__init__`` left out)."""
    return {f"sparseattn.{p.parent.name}.{p.stem}": sparseattn_imports(p) for d in folders for p in (ROOT / d).glob("*.py") if p.stem != "__init__"}


def in_cycles(modules: dict[str, set[str]]) -> list[str]:
    """The modules of ``modules`` that reach themselves through imports among them."""
    graph = {name: {m for m in found if m in modules} for name, found in modules.items()}

    def reaches(start: str, target: str, seen: tuple[str, ...] = ()) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, (*seen, n))) for n in graph[start])

    return [name for name in graph if reaches(name, name)]


def module_name(path: Path) -> str:
    """``sparseattn/a/b.py`` -> ``sparseattn.a.b``; a package's ``__init__.py`` -> the package's name."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def whole_package() -> dict[str, list[tuple[str, str]]]:
    """Every module of sparseattn -> ``(module, name)`` for each name it imports from another sparseattn module,
    wherever the import is written: function-local and ``if TYPE_CHECKING`` imports count (a cycle through a
    type hint or a lazy import is still a cycle). ``from package import submodule`` names the submodule;
    relative imports are resolved."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, list[tuple[str, str]]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "sparseattn"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base.split(".")[0] != "sparseattn":
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub, "") if sub in paths else (base, a.name))
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports): its strongly connected components of
    more than one module, or a module importing itself, each sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        found.append(sorted(component))
    return found
