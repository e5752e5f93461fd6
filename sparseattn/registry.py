"""The method registry: every named method, its description and its typed options, in one library table.

Each method registers itself next to its definition (a :func:`register` call at the bottom of the
module that defines it: ``methods/dense.py``, ``methods/segment_search.py``, ``methods/presets.py``,
...). The CLI (``--method NAME[:key=value,...]``, ``sparseattn methods``), the evaluation commands,
the benchmarks and the contract tests all read this table, so a method is covered by all of them
the moment it is registered, from the package, from user code, or from a third-party package
through the ``sparseattn.methods`` entry point group (loaded on the first lookup).

This module imports nothing from the rest of the package at import time (the method modules import
it to register); the first lookup imports :mod:`sparseattn.methods`, which registers the built-ins.

A method is built from the options given, checked first: an option it does not take, a value of
the wrong type or out of range, or ``budget`` with ``top_k`` is refused with one line naming the
method, the option, the value and what is allowed. Options not given keep the builder's own
defaults, which each :class:`Option` repeats for the listing (a test holds them equal).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENTRY_POINT_GROUP",
    "MAX_COUNT",
    "MethodEntry",
    "Spec",
    "Option",
    "OptionError",
    "PluginError",
    "Range",
    "all_options",
    "label",
    "parse",
    "build",
    "check",
    "get",
    "names",
    "register",
    "unregister",
]

#: The entry point group third-party packages register methods under: each entry point loads to a
#: :class:`MethodEntry` (or an iterable of them), e.g. in ``pyproject.toml``
#: ``[project.entry-points."sparseattn.methods"] mine = "mypkg.methods:MINE"``.
ENTRY_POINT_GROUP = "sparseattn.methods"

#: Counts larger than this are no real run's and overflow torch's 64-bit sizes on the way (a budget
#: of 1e23 died with "Overflow when unpacking long long"); 2**31 - 1 leaves that far behind.
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take: integers in ``[low, high]``, or floats in ``(low, high)``."""

    low: float
    high: float
    integer: bool = True

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer:
            return isinstance(value, int) and self.low <= value <= self.high
        return self.low < value < self.high  # False for NaN

    def __str__(self) -> str:
        return f"an integer in [{self.low}, {self.high}]" if self.integer else f"a number in ({self.low:g}, {self.high:g})"


@dataclass(frozen=True)
class Option:
    """One option of a method: its keyword, type (``int`` or ``float``), default, help and allowed values.

    ``default`` is the builder's own default (None where the builder derives it from other options,
    which ``help`` then says). ``allowed`` defaults to the counts ``[minimum, MAX_COUNT]`` for an
    ``int`` and the open interval ``(0, 1)`` for a ``float``.
    """

    name: str
    type: type
    default: Any
    help: str
    minimum: int = 1
    allowed: Range | None = None

    def __post_init__(self) -> None:
        if self.type not in (int, float):
            raise TypeError(f"option {self.name}: type must be int or float, got {self.type!r}")
        if self.allowed is None:
            allowed = Range(self.minimum, MAX_COUNT) if self.type is int else Range(0.0, 1.0, integer=False)
            object.__setattr__(self, "allowed", allowed)

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` for this option (the value and the allowed range), None if nothing."""
        return None if value in self.allowed else f"{value!r} is out of range; allowed: {self.allowed}"


@dataclass(frozen=True)
class MethodEntry:
    """A named method: a one-line description, how to build it, and the options the builder takes.

    ``build`` is called with the options given as keywords (those not given keep its defaults).
    """

    name: str
    description: str
    build: Callable[..., Any]
    options: tuple[Option, ...] = ()
    #: Where it was registered from (a module, or an entry point): named when a name is taken twice.
    origin: str = field(default="", compare=False)

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.name == key), None)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def takes(self, **options: Any) -> dict[str, Any]:
        """The options of ``options`` this method takes, for one set of options passed to many methods."""
        return {key: value for key, value in options.items() if key in self.option_names}


class OptionError(ValueError):
    """Method options refused; ``options`` names the ones at fault."""

    def __init__(self, message: str, options: tuple[str, ...]) -> None:
        super().__init__(message)
        self.options = options


class PluginError(RuntimeError):
    """An entry point of the ``sparseattn.methods`` group that could not be loaded or registered."""


_ENTRIES: dict[str, MethodEntry] = {}
_plugins_loaded = False
_plugin_errors: list[str] = []


def register(entry: MethodEntry) -> MethodEntry:
    """Add ``entry`` to the registry and return it; a name already taken by another entry is refused (ValueError).

    The entry returned carries its ``origin`` (the builder's module unless given), for messages.
    """
    if not isinstance(entry, MethodEntry):
        raise TypeError(f"register takes a MethodEntry, got {type(entry).__name__}")
    old = _ENTRIES.get(entry.name)
    if old == entry:  # the same entry again (a module imported twice, a plugin that also registers itself)
        return old
    if old is not None:
        where = f" by {old.origin}" if old.origin else ""
        raise ValueError(f"method {entry.name!r} is already registered{where}; unregister it first or pick another name")
    seen = [o.name for o in entry.options]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"method {entry.name!r} declares the option(s) {', '.join(twice)} twice")
    if not entry.origin:
        entry = MethodEntry(entry.name, entry.description, entry.build, entry.options, getattr(entry.build, "__module__", ""))
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> MethodEntry:
    """Remove and return the entry called ``name`` (KeyError if there is none)."""
    return _ENTRIES.pop(name)


def _load_builtins_and_plugins() -> None:
    global _plugins_loaded
    import sparseattn.methods  # noqa: F401  (registers the built-in methods)

    if _plugins_loaded:
        if _plugin_errors:
            raise PluginError("; ".join(_plugin_errors))
        return
    _plugins_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        origin = f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP!r}"
        try:
            loaded = ep.load()
            entries = [loaded] if isinstance(loaded, MethodEntry) else list(loaded)
            bad = [e for e in entries if not isinstance(e, MethodEntry)]
            if bad:
                raise TypeError(f"it loads to {type(bad[0]).__name__}, not a MethodEntry or an iterable of them")
            for e in entries:
                register(e if e.origin else MethodEntry(e.name, e.description, e.build, e.options, origin=origin))
        except Exception as err:  # a broken plugin: named, never a crash of the import
            _plugin_errors.append(f"{origin} failed: {type(err).__name__}: {err}")
    if _plugin_errors:
        raise PluginError("; ".join(_plugin_errors))


def names() -> list[str]:
    """Every registered method name, in registration order (built-ins first)."""
    _load_builtins_and_plugins()
    return list(_ENTRIES)


def get(name: str) -> MethodEntry:
    """The entry called ``name``; a ValueError lists the known names otherwise."""
    _load_builtins_and_plugins()
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(_ENTRIES)}") from None


def check(name: str, given: Mapping[str, object], spell: Callable[[str], str] = str) -> MethodEntry:
    """Refuse what ``name`` would silently ignore or misread in the options ``given``; return its entry.

    ``spell`` names an option as the user wrote it (``--top-k`` on the command line, ``top_k``
    inside ``-m radar:top_k=8``). Raises a ValueError for an unknown method, an :class:`OptionError`
    for an option the method does not take, a value of the wrong type or out of range, or ``top_k``
    together with ``budget``.
    """
    entry = get(name)
    unused = tuple(key for key in given if key not in entry.option_names)
    if unused:
        takes = ", ".join(spell(o) for o in entry.option_names) if entry.options else "no options"
        raise OptionError(f"{name} does not take {', '.join(spell(k) for k in unused)}; it takes {takes}", unused)
    for key, value in given.items():
        problem = entry.option(key).problem(value)
        if problem:
            raise OptionError(f"{spell(key)} {problem}", (key,))
    if "budget" in given and "top_k" in given:
        raise OptionError(
            f"give {spell('budget')} or {spell('top_k')}, not both: {name} turns the budget into the segments it "
            f"attends, so {spell('top_k')} would be ignored",
            ("budget", "top_k"),
        )
    return entry


def build(name: str, **options: Any) -> Any:
    """The method ``name`` built with ``options`` (checked by :func:`check`; the others keep their defaults)."""
    return check(name, options).build(**options)


def all_options(entries: Iterable[MethodEntry] | None = None) -> dict[str, Option]:
    """Every option name of the registered methods (or of ``entries``), with the first declaration of each."""
    union: dict[str, Option] = {}
    for entry in entries if entries is not None else (get(n) for n in names()):
        for o in entry.options:
            union.setdefault(o.name, o)
    return union


def label(name: str, options: Mapping[str, object]) -> str:
    """A method's label: its name and the options given, sorted (``quest:budget=1024,sinks=128``).

    >>> label("dense", {}), label("quest", {"sinks": 128, "budget": 1024})
    ('dense', 'quest:budget=1024,sinks=128')
    """
    return name + ("" if not options else ":" + ",".join(f"{k}={v}" for k, v in sorted(options.items())))


@dataclass(frozen=True)
class Spec:
    """A method spec, parsed and checked once: the registry name, the options given (typed), the method built."""

    name: str
    options: Mapping[str, Any]
    method: Any

    @property
    def label(self) -> str:
        return label(self.name, self.options)


def parse(spec: str | Mapping[str, Any], budget: int | None = None, budget_option: str = "budget") -> Spec:
    """The one grammar of a method spec, for every front end (the CLI, the vLLM plugin, lm-eval, the benchmarks).

    ``spec`` is ``"NAME[:key=value,...]"`` (values typed by the option's declaration) or a mapping
    ``{"method": NAME, key: value, ...}`` (vLLM's ``additional_config``; string values typed the same
    way). ``budget`` fills in the budget of a method that has one when the spec sets neither its
    ``budget`` nor its ``top_k`` (the commands' ``--budget``: ``budget_option`` names it in messages). Everything is checked here, once: the
    name, each option's name, type and range (:func:`check`), and what only building reveals (a
    limit that depends on other fields). Raises ValueError with a message that quotes the spec.

    >>> parse("quest:budget=1024").label, parse({"method": "radar+", "budget": "512"}).options
    ('quest:budget=1024', {'budget': 512})
    >>> parse("radar:top_k=x")
    Traceback (most recent call last):
    ...
    ValueError: option top_k in 'radar:top_k=x' must be a int, got 'x'
    """
    if isinstance(spec, Mapping):
        raw = dict(spec)
        name = raw.pop("method", None)
        if not isinstance(name, str):
            raise ValueError(f'a method spec mapping needs "method": a method name, got {dict(spec)!r}; e.g. {{"method": "quest", "budget": 1024}}')
        shown, rest = label(name, raw), None
    elif isinstance(spec, str):
        name, _, rest = spec.strip().partition(":")
        shown = spec
    else:
        raise ValueError(f"a method spec is a 'NAME[:key=value,...]' string or a mapping with \"method\", got {spec!r}")
    entry = get(name)  # an unknown name: the registry's message, listing the known ones
    fields = all_options()
    if rest is None:
        items = list(raw.items())
    else:
        items = []
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in fields:
                raise ValueError(f"bad option {item!r} in {spec!r}; options are key=value with key in {', '.join(fields)}")
            items.append((key, value.strip()))
    given: dict[str, Any] = {}
    for key, value in items:
        declared = entry.option(key) or fields.get(key)
        if declared is not None and isinstance(value, str):
            try:
                value = declared.type(value)
            except ValueError:
                raise ValueError(f"option {key} in {shown!r} must be a {declared.type.__name__}, got {value!r}") from None
        given[key] = value
    if budget is not None and "budget" in entry.option_names and not {"budget", "top_k"} & set(given):
        given["budget"] = budget
    try:
        check(name, given)
    except ValueError as err:
        raise ValueError(f"{shown!r}: {err}") from None
    try:
        method = entry.build(**given)
    except ValueError as err:  # a limit that depends on other fields, e.g. SnapKV's budget > observation window
        also = "" if budget is None or "budget" not in given else f" ({budget_option} {budget})"
        raise ValueError(f"{shown!r}{also}: {err}") from None
    return Spec(name, given, method)
