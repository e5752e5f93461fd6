"""How the CLI spells and checks method options; the methods themselves are in :mod:`sparseattn.registry`.

One meaning of ``--budget`` for every method: the past KV tokens a decode step may attend (sinks and
recent window included). The Radar family turns it into top-k segments (``SegmentSearch.budget``);
the evicting methods keep that many tokens per KV head. Without ``--budget`` each method runs at its
paper's default (Radar family: ``--top-k`` segments).

The CLI refuses what a method would silently ignore: an option the method does not take, a value
out of its range, and ``--top-k`` together with ``--budget`` (the budget decides the segments
attended, so the ``--top-k`` would be dropped); the registry's :func:`~sparseattn.registry.check`
does it, with the option spelled as the user wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from sparseattn import registry
from sparseattn.registry import OptionError

__all__ = ["OptionError", "check_method_options", "flag", "range_problem"]


def flag(key: str) -> str:
    """How an option is spelled as a command-line flag: ``top_k`` -> ``--top-k``."""
    return "--" + key.replace("_", "-")


def range_problem(key: str, value: object) -> str | None:
    """What is wrong with ``value`` for the option ``key`` of any registered method, None if nothing."""
    return registry.all_options()[key].problem(value)


def check_method_options(name: str, given: Mapping[str, object], spell: Callable[[str], str] = flag) -> None:
    """Refuse what ``name`` would silently ignore or misread in the options the user gave (see
    :func:`sparseattn.registry.check`; here options are spelled as flags unless ``spell`` says otherwise)."""
    registry.check(name, given, spell)
