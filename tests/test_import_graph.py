"""The package's import graph: no module reaches itself, and no module imports another's private name.

Every import counts, wherever it is written (module level, inside a function, under ``if TYPE_CHECKING``):
a lazy import only hides a cycle until the day it runs first. A protocol sits below the parts that
implement it, so the graph is layered; a private name (``_x``) stays in its module.
"""

from __future__ import annotations

from import_graph import cycles, whole_package


def test_no_module_of_sparseattn_reaches_itself_through_its_imports():
    graph = {name: {module for module, _ in found} for name, found in whole_package().items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the walk saw the package
    assert cycles(graph) == []


def test_no_module_imports_a_private_name_of_another():
    private = [
        f"{name} imports {name_!r} from {module}"
        for name, found in whole_package().items()
        for module, name_ in found
        if name_.startswith("_") and not name_.startswith("__")
    ]
    assert private == []


def test_the_cycle_finder_finds_a_cycle_through_three_modules_and_a_self_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
