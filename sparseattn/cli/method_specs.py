"""Methods named on the command line: ``NAME[:key=value,...]``, parsed and checked by the registry.

The keys are those of the :mod:`sparseattn.registry` options that the method takes (``sparseattn methods``
lists them), e.g. ``radar:top_k=8,n_features=256`` or ``h2o:heavy_ratio=0.25``. ``--budget`` has one meaning
for every method: the past KV tokens a decode step may attend, sinks and recent window included (the Radar
family turns it into top-k segments, the evicting methods keep that many tokens per KV head). It sets the
budget of every method that has one and whose spec sets neither ``budget`` nor ``top_k``; dense has no budget
and runs without one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from rich.markup import escape

from sparseattn import registry
from sparseattn.cli.checks import bad
from sparseattn.cli.consoles import err_console


def flag(key: str) -> str:
    """How an option is spelled as a command-line flag: ``top_k`` -> ``--top-k``."""
    return "--" + key.replace("_", "-")


def range_problem(key: str, value: object) -> str | None:
    """What is wrong with ``value`` for the option ``key`` of any registered method, None if nothing."""
    return registry.all_options()[key].problem(value)


def parse_method(spec: str, budget: int | None = None) -> tuple[str, object, dict]:
    """``"radar:top_k=8"`` -> ``(label, method instance, options given)``; ``budget`` fills in a missing budget.

    The grammar and every check are the registry's (:func:`sparseattn.registry.parse`, shared with the
    vLLM plugin and lm-eval); a refusal becomes the ``--method`` option's error.
    """
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", FutureWarning)
            parsed = registry.parse(spec, budget, budget_option="--budget")
    except (ValueError, registry.PluginError) as err:  # a bad spec, or a broken third-party method package
        raise bad("--method", str(err)) from None
    for warning in said:  # a former name: one line saying what it is now, not a Python traceback line
        err_console.print(f"note: {escape(str(warning.message))}", highlight=False)
    return parsed.label, parsed.method, dict(parsed.options)


def parse_methods(specs: Sequence[str], budget: int | None) -> list[tuple[str, object, dict]]:
    """Every ``--method`` spec, after checking ``--budget``; two specs with one label are refused."""
    problem = None if budget is None else range_problem("budget", budget)
    if problem:
        raise bad("--budget", problem)
    resolved = [parse_method(spec, budget) for spec in specs]
    labels = [label for label, _, _ in resolved]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        also = "" if budget is None else f" (with --budget {budget})"
        raise bad("--method", f"{', '.join(twice)} given twice{also}; each method once")
    return resolved


def vllm_method(spec: str, budget: int | None, option: str = "--method") -> tuple[str, dict]:
    """``(label, additional_config["sparseattn"])`` for a method spec, refused unless vLLM's paged engine runs it.

    The spec is parsed by the registry's grammar, which the vLLM plugin reads ``additional_config``
    with too (:func:`sparseattn.registry.parse`): what is served is what was checked here.
    """
    from sparseattn.vllm.paged import PagedPolicy

    ((label, built, given),) = parse_methods([spec], budget)
    try:
        PagedPolicy(built, label)  # eviction methods and always-kept parts are refused, saying why
    except ValueError as err:
        raise bad(option, str(err)) from None
    return label, {"method": label.partition(":")[0], **given}
