"""``sparseattn methods``: the catalogue of registered methods, by what each is for, with the engines that run it.

The recommended method comes first, then the fast configuration, the paper's, the baselines, the
ceilings and the paper's ablations (:data:`sparseattn.registry.CATEGORIES`); experimental methods and the former names
(aliases, with what each is now) are listed with ``--all``. Options are written as they are given
inside a method spec (``-m radar+:split=pooled,budget=512``), with their defaults. A method vLLM runs says
which step it takes there with its defaults (:func:`~sparseattn.vllm.route.route`): the fused C step, or the
generic paged path and why.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from sparseattn import registry
from sparseattn.cli.consoles import console
from sparseattn.registry import MethodEntry, Option, Range

__all__ = ["catalogue", "list_methods", "vllm_step"]


def _default(option: Option) -> str:
    if option.type is bool:
        return str(option.default).lower()
    return "-" if option.default is None else str(option.default)


def _spelled(option: Option) -> str:
    """``split=uniform|pooled (uniform)``: an option as a spec writes it, what it takes where that is a word, its default."""
    words = "" if isinstance(option.allowed, Range) or option.type is bool else "{" + "|".join(map(str, option.allowed)) + "}"
    shown = _default(option)
    return f"{option.name}{'=' + words if words else ''}" + ("" if shown == "-" else f" ({shown})")


def vllm_step(name: str) -> str | None:
    """The decode step method ``name`` (its defaults, at every layer) takes in vLLM: ``"fused"`` (the C step),
    ``"generic: <why>"`` (the torch paged path), or None where vLLM does not run it.

    >>> vllm_step("radar+adaptive"), vllm_step("radar"), vllm_step("h2o")
    ('fused', 'generic: PerformerFeatures declares no fused implementation', None)
    """
    if "vllm" not in registry.get(name).engines:
        return None
    from sparseattn.vllm.route import generic_refusal

    refused = generic_refusal(registry.build(name), name)
    return "fused" if refused is None else f"generic: {refused}"


def catalogue(include_all: bool = False, engine: str | None = None) -> list[dict[str, Any]]:
    """The rows ``sparseattn methods`` lists, ordered by category (recommended first), as plain data.

    >>> rows = catalogue(engine="vllm")
    >>> rows[0]["name"], rows[0]["category"], "vllm" in rows[0]["engines"]
    ('radar+adaptive', 'recommended', True)
    """
    if engine is not None and engine not in registry.ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(registry.ENGINES)}")
    entries: list[MethodEntry] = [registry.get(name) for name in registry.names()]
    rank = {category: i for i, category in enumerate(registry.CATEGORIES)}
    rows = []
    for entry in sorted(entries, key=lambda e: rank[e.category]):  # stable: registration order within a category
        if (entry.category == "experimental" and not include_all) or (engine is not None and engine not in entry.engines):
            continue
        rows.append({
            "name": entry.name, "category": entry.category, "engines": list(entry.engines), "vllm_step": vllm_step(entry.name),
            "recommended_for": [e for e in registry.ENGINES if entry.category == "recommended" and registry.recommended(e) is entry],
            "options": {o.name: {"type": o.type.__name__, "default": o.default, "help": o.help,
                                 **({"choices": list(o.allowed)} if not isinstance(o.allowed, Range) else {})} for o in entry.options},
            "description": entry.description,
        })  # fmt: skip
    return rows


def list_methods(
    include_all: Annotated[bool, typer.Option("--all", help="also the experimental methods and the former names (aliases)")] = False,
    engine: Annotated[str | None, typer.Option("--engine", help=f"only the methods one engine runs: {', '.join(registry.ENGINES)}")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the catalogue as JSON on stdout")] = False,
) -> None:
    """List the methods --method accepts by what each is for (recommended first), the engines that run each and its options."""
    if engine is not None and engine not in registry.ENGINES:
        raise typer.BadParameter(f"{engine!r} is not one of {', '.join(registry.ENGINES)}", param_hint="'--engine'")
    rows = catalogue(include_all, engine)
    aliases = registry.aliases() if include_all else {}
    if as_json:
        console.print_json(json.dumps({"methods": rows, "aliases": {a.name: a.spec for a in aliases.values()}}))
        return
    table = Table(title="methods (options go in the spec: -m NAME:key=value,...)")
    for column in ("category", "name", "engines", "options (default)", "description"):
        table.add_column(column)
    shown = None
    for row in rows:
        if shown is not None and row["category"] != shown:
            table.add_section()
        entry = registry.get(row["name"])
        category = row["category"] if row["category"] != shown or row["recommended_for"] else ""
        if row["recommended_for"]:
            category += f" for {', '.join(row['recommended_for'])}"
        engines = ", ".join(e + (" (fused)" if e == "vllm" and row["vllm_step"] == "fused" else "") for e in row["engines"])
        table.add_row(category, row["name"], engines, ", ".join(map(_spelled, entry.options)) or "-", row["description"])
        shown = row["category"]
    console.print(table)
    if aliases:
        former = Table(title="former names (aliases): they still work, each saying what it is now")
        former.add_column("name")
        former.add_column("is now")
        for made in aliases.values():
            former.add_row(made.name, made.spec)
        console.print(former)
    picks = ", ".join(f"{e}: {registry.recommended(e).name}" for e in registry.ENGINES)
    console.print(f"recommended: {picks}" + ("" if include_all else "; experimental methods and former names: --all"))
