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
