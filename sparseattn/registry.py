"""The method registry: every named method, its description and its typed options, in one library table.

Each method registers itself next to its definition (a :func:`register` call at the bottom of the
module that defines it: ``methods/dense.py``, ``methods/segment_search.py``, ``methods/presets.py``,
...). The CLI (``--method NAME[:key=value,...]``, ``sparseattn methods``), the evaluation commands,
the benchmarks and the contract tests all read this table, so a method is covered by all of them
the moment it is registered, from the package, from user code, or from a third-party package
through the ``sparseattn.methods`` entry point group (loaded on the first lookup).

This module imports nothing from the rest of the package (the method modules import it to register:
the registry sits below them); importing the package imports :mod:`sparseattn.methods`, which registers
the built-ins before any lookup, and the first lookup loads the plugins.

A method is built from the options given, checked first: an option it does not take, a value of
the wrong type or out of range, or ``budget`` with ``top_k`` is refused with one line naming the
method, the option, the value and what is allowed. Options not given keep the builder's own
defaults: the registry reads them from the builder's signature (written once, in the builder).

The catalogue: each entry declares a category (:data:`CATEGORIES`, the order ``sparseattn
methods`` lists them in) and the engines that run it (:data:`ENGINES`). A variant of a method is
an option of it (a choice, a flag, a number), not another name; names that were variants stay as
aliases (:func:`alias`) that say what they are now when used.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "ENGINES",
    "ENTRY_POINT_GROUP",
    "Alias",
    "alias",
    "aliases",
    "recommended",
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

#: What a method is for, in the order the catalogue lists them: the preset to use first (quality kept);
#: the fastest configuration (less quality at the same budget); the paper's methods as their authors
#: ran or wrote them; the field's methods we compare with; exact oracles that bound what a selector can
#: reach (O(t) per step, not fast); one part of a paper's method swapped (its ablations); variants kept
#: for research (listed only with ``sparseattn methods --all``).
CATEGORIES = ("recommended", "fast", "paper", "baseline", "ceiling", "ablation", "experimental")

#: The engines a method may run in: the transformers engine (``model.generate``, every method) and
#: vLLM's paged cache (:mod:`sparseattn.vllm`, the methods its paged engine supports).
ENGINES = ("transformers", "vllm")

#: Counts larger than this are no real run's and overflow torch's 64-bit sizes on the way (a budget
#: of 1e23 died with "Overflow when unpacking long long"); 2**31 - 1 leaves that far behind.
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """The values a numeric option may take: integers in ``[low, high]``, or floats in ``(low, high)`` (``[low, high)``
    with ``closed``: where the part itself takes ``low``)."""

    low: float
    high: float
    integer: bool = True
    closed: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer:
            return isinstance(value, int) and self.low <= value <= self.high
        return (self.low <= value if self.closed else self.low < value) and value < self.high  # False for NaN

    def __str__(self) -> str:
        if self.integer:
            return f"an integer in [{self.low}, {self.high}]"
        return f"a number in {'[' if self.closed else '('}{self.low:g}, {self.high:g})"


#: An option's default read from its builder's signature when the entry is registered.
FROM_BUILDER: Any = type("FromBuilder", (), {"__repr__": lambda self: "FROM_BUILDER"})()

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class Option:
    """One option of a method: its keyword, type, default, help and allowed values.

    ``type`` is ``int``, ``float``, ``bool`` (a flag: ``true``/``false`` in a spec) or ``str`` (a
    choice: ``allowed`` lists the words). ``default`` is the builder's own, read from its signature
    when the entry is registered (None where the builder derives it from other options, which
    ``help`` then says); giving it here as well is allowed and checked equal. ``allowed`` defaults to
    the counts ``[minimum, MAX_COUNT]`` for an ``int`` and the open interval ``(0, 1)`` for a
    ``float``.
    """

    name: str
    type: type
    default: Any = FROM_BUILDER
    help: str = ""
    minimum: int = 1
    allowed: Range | tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if self.type not in (int, float, bool, str):
            raise TypeError(f"option {self.name}: type must be int, float, bool or str, got {self.type!r}")
        if not self.help:
            raise TypeError(f"option {self.name}: give a help line (what the option changes)")
        if self.allowed is None:
            if self.type is str:
                raise TypeError(f"option {self.name}: a str option is a choice; give allowed=(the words it takes)")
            allowed = {int: Range(self.minimum, MAX_COUNT), float: Range(0.0, 1.0, integer=False), bool: (False, True)}[self.type]
            object.__setattr__(self, "allowed", allowed)

    def parse(self, text: str) -> Any:
        """``text`` (a spec's value) as this option's type; ValueError if it is not one."""
        if self.type is bool:
            word = text.strip().lower()
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            raise ValueError(f"{text!r} is not true or false")
        return self.type(text)

    def problem(self, value: object) -> str | None:
        """What is wrong with ``value`` for this option (the value and what is allowed), None if nothing."""
        if isinstance(self.allowed, Range):
            return None if value in self.allowed else f"{value!r} is out of range; allowed: {self.allowed}"
        if any(value is word or (type(value) is type(word) and value == word) for word in self.allowed):
            return None
        return f"{value!r} is not allowed; allowed: {', '.join(_spelled(word) for word in self.allowed)}"


def _spelled(word: object) -> str:
    return str(word).lower() if isinstance(word, bool) else str(word)


@dataclass(frozen=True)
class MethodEntry:
    """A named method: a one-line description, how to build it, the options the builder takes, what it is
    for (``category``, one of :data:`CATEGORIES`) and the engines that run it (:data:`ENGINES`).

    ``build`` is called with the options given as keywords (those not given keep its defaults).
    """

    name: str
    description: str
    build: Callable[..., Any]
    options: tuple[Option, ...] = ()
    #: Where it was registered from (a module, or an entry point): named when a name is taken twice.
    origin: str = field(default="", compare=False)
    category: str = "experimental"
    engines: tuple[str, ...] = ("transformers",)

    def option(self, key: str) -> Option | None:
        return next((o for o in self.options if o.name == key), None)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def takes(self, **options: Any) -> dict[str, Any]:
        """The options of ``options`` this method takes, for one set of options passed to many methods."""
        return {key: value for key, value in options.items() if key in self.option_names}


@dataclass(frozen=True)
class Alias:
    """A name that was a method of its own and is now ``spec`` (a method name with options): kept so
    that scripts and results naming it keep working; each use says what it is now."""

    name: str
    spec: str


class OptionError(ValueError):
    """Method options refused; ``options`` names the ones at fault."""

    def __init__(self, message: str, options: tuple[str, ...]) -> None:
        super().__init__(message)
        self.options = options


class PluginError(RuntimeError):
    """An entry point of the ``sparseattn.methods`` group that could not be loaded or registered."""


_ENTRIES: dict[str, MethodEntry] = {}
_ALIASES: dict[str, Alias] = {}
_plugins_loaded = False
_plugin_errors: list[str] = []


def _with_builder_defaults(entry: MethodEntry) -> MethodEntry:
    """``entry`` with every option's default read from its builder's signature (checked where given twice)."""
    try:
        parameters = inspect.signature(entry.build).parameters
    except (TypeError, ValueError):  # a builtin without a signature: defaults must be given
        parameters = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    options = []
    for o in entry.options:
        p = parameters.get(o.name)
        if p is None and not takes_any and parameters:
            raise ValueError(f"method {entry.name!r}: option {o.name!r} is not a keyword of its builder {entry.build!r}")
        own = p.default if p is not None and p.default is not inspect.Parameter.empty else FROM_BUILDER
        if o.default is FROM_BUILDER:
            if own is FROM_BUILDER:
                raise ValueError(f"method {entry.name!r}: option {o.name!r} has no default in its builder; give one")
            o = Option(o.name, o.type, own, o.help, o.minimum, o.allowed)
        elif own is not FROM_BUILDER and own != o.default:
            raise ValueError(f"method {entry.name!r}: option {o.name!r} declares default {o.default!r}, its builder has {own!r}")
        options.append(o)
    return dataclasses.replace(entry, options=tuple(options))


def register(entry: MethodEntry) -> MethodEntry:
    """Add ``entry`` to the registry and return it; a name already taken by another entry is refused (ValueError).

    The entry returned carries its ``origin`` (the builder's module unless given) and its options'
    defaults read from the builder's signature.
    """
    if not isinstance(entry, MethodEntry):
        raise TypeError(f"register takes a MethodEntry, got {type(entry).__name__}")
    if entry.category not in CATEGORIES:
        raise ValueError(f"method {entry.name!r}: category {entry.category!r} is not one of {', '.join(CATEGORIES)}")
    unknown = [e for e in entry.engines if e not in ENGINES]
    if unknown or not entry.engines:
        raise ValueError(f"method {entry.name!r}: engines {entry.engines!r} must be a non-empty tuple of {', '.join(ENGINES)}")
    seen = [o.name for o in entry.options]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"method {entry.name!r} declares the option(s) {', '.join(twice)} twice")
    entry = _with_builder_defaults(entry)
    old = _ENTRIES.get(entry.name)
    if old == entry:  # the same entry again (a module imported twice, a plugin that also registers itself)
        return old
    if old is not None or entry.name in _ALIASES:
        where = f" by {old.origin}" if old is not None and old.origin else " (as an alias)" if old is None else ""
        raise ValueError(f"method {entry.name!r} is already registered{where}; unregister it first or pick another name")
    if not entry.origin:
        entry = dataclasses.replace(entry, origin=getattr(entry.build, "__module__", ""))
    _ENTRIES[entry.name] = entry
    return entry


def alias(name: str, spec: str) -> Alias:
    """Keep ``name`` working as ``spec`` (``"radar+:split=pooled,aspect=16"``): options given with the old
    name are laid over the spec's; each use warns once (FutureWarning) with what it is now. The spec's
    method must be registered first and its options valid: a bad alias fails here, not at its first use."""
    if name in _ENTRIES or name in _ALIASES:
        raise ValueError(f"{name!r} is already a method or an alias")
    target, _, rest = spec.partition(":")
    if target not in _ENTRIES:
        raise ValueError(f"alias {name!r}: {target!r} is not a registered method")
    entry = _ENTRIES[target]
    _check(entry, _typed(entry, _items(rest, spec, entry.options), spec), str)
    made = _ALIASES[name] = Alias(name, spec)
    return made


def aliases() -> dict[str, Alias]:
    """Every alias, by its old name."""
    _load_plugins()
    return dict(_ALIASES)


_WARNED: set[str] = set()


def _resolve(name: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """An alias's method name and its options with ``options`` laid over them; any other name as it is."""
    made = _ALIASES.get(name)
    if made is None:
        return name, dict(options)
    target, fixed = _split(made.spec)
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"method {name!r} is now {made.spec!r}; the old name will be removed in the next release", FutureWarning, stacklevel=3)
    return target, {**fixed, **options}


def _split(spec: str) -> tuple[str, dict[str, Any]]:
    """``"NAME:key=value,..."`` as the name and its typed options (no alias resolution, no range check)."""
    name, _, rest = spec.strip().partition(":")
    entry = get(name)
    return name, _typed(entry, _items(rest, spec, all_options()), spec)


def _items(rest: str, spec: object, fields: Iterable[Option] | Mapping[str, Option]) -> list[tuple[str, str]]:
    """The ``key=value`` pairs of a spec's options part, each key one of ``fields``."""
    known = [o.name for o in fields.values()] if isinstance(fields, Mapping) else [o.name for o in fields]
    items = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in known:
            raise ValueError(f"bad option {item!r} in {spec!r}; options are key=value with key in {', '.join(known)}")
        items.append((key, value.strip()))
    return items


def _typed(entry: MethodEntry, items: Iterable[tuple[str, Any]], shown: object) -> dict[str, Any]:
    """The option values of ``items`` typed by their declaration (``entry``'s, else any method's): strings parsed."""
    fields = None
    given: dict[str, Any] = {}
    for key, value in items:
        declared = entry.option(key)
        if declared is None:
            fields = fields if fields is not None else all_options(_ENTRIES.values())
            declared = fields.get(key)
        if declared is not None and isinstance(value, str):
            try:
                value = declared.parse(value)
            except ValueError:
                raise ValueError(f"option {key} in {shown!r} must be {_a(declared)}, got {value!r}") from None
        given[key] = value
    return given


def _a(option: Option) -> str:
    if option.type is str:
        return "one of " + ", ".join(map(str, option.allowed))
    return "true or false" if option.type is bool else f"a {option.type.__name__}"


def recommended(engine: str = "transformers") -> MethodEntry:
    """The recommended method of ``engine`` (one of :data:`ENGINES`): the first ``recommended`` entry that runs in it.

    >>> recommended("vllm").name
    'radar+adaptive'
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    _load_plugins()
    best = [e for e in _ENTRIES.values() if e.category == "recommended" and engine in e.engines]
    if not best:
        raise LookupError(f"no recommended method runs in {engine}")
    # The engine's own preset (made for it alone) before a method recommended for every engine.
    return min(best, key=lambda e: len(e.engines))


def unregister(name: str) -> MethodEntry | Alias:
    """Remove and return the entry (or alias) called ``name`` (KeyError if there is none)."""
    return _ALIASES.pop(name) if name in _ALIASES else _ENTRIES.pop(name)


def _load_plugins() -> None:
    global _plugins_loaded
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
                register(e if e.origin else dataclasses.replace(e, origin=origin))
        except Exception as err:  # a broken plugin: named, never a crash of the import
            _plugin_errors.append(f"{origin} failed: {type(err).__name__}: {err}")
    if _plugin_errors:
        raise PluginError("; ".join(_plugin_errors))


def names() -> list[str]:
    """Every registered method name, in registration order (built-ins first); aliases are in :func:`aliases`."""
    _load_plugins()
    return list(_ENTRIES)


def get(name: str) -> MethodEntry:
    """The entry called ``name`` (an alias: the entry of the method it is now); a ValueError lists the known names otherwise."""
    _load_plugins()
    if name in _ALIASES:
        name = _ALIASES[name].spec.partition(":")[0]
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(_ENTRIES)}") from None


def check(name: str, given: Mapping[str, object], spell: Callable[[str], str] = str) -> MethodEntry:
    """Refuse what ``name`` would silently ignore or misread in the options ``given``; return its entry.

    ``spell`` names an option as the user wrote it (``--top-k`` on the command line, ``top_k``
    inside ``-m radar:top_k=8``). Raises a ValueError for an unknown method, an :class:`OptionError`
    for an option the method does not take, a value of the wrong type or out of range, or ``top_k``
    together with ``budget``. An alias is checked as the method it is now, with its options.
    """
    target, options = _resolve(name, given)
    return _check(get(target), options, spell)


def _check(entry: MethodEntry, given: Mapping[str, object], spell: Callable[[str], str]) -> MethodEntry:
    name = entry.name
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
    target, options = _resolve(name, options)
    return _check(get(target), options, str).build(**options)


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
    get(name)  # an unknown name: the registry's message, listing the known ones
    name, fixed = _resolve(name, {})
    entry = get(name)
    given = {**fixed, **_typed(entry, raw.items() if rest is None else _items(rest, spec, all_options()), shown)}
    if budget is not None and "budget" in entry.option_names and not {"budget", "top_k"} & set(given):
        given["budget"] = budget
    try:
        _check(entry, given, str)
    except ValueError as err:
        raise ValueError(f"{shown!r}: {err}") from None
    try:
        method = entry.build(**given)
    except ValueError as err:  # a limit that depends on other fields, e.g. SnapKV's budget > observation window
        also = "" if budget is None or "budget" not in given else f" ({budget_option} {budget})"
        raise ValueError(f"{shown!r}{also}: {err}") from None
    return Spec(name, given, method)
