"""``sparseattn report``: the quality report, methods x budgets x engines, with 95% intervals (issue 49).

What it measures and how is :mod:`sparseattn.evaluation.report`; this module turns options into a
:class:`~sparseattn.evaluation.report_plan.ReportConfig`, refuses bad input before any work (one line naming the
option, the value and what is allowed), loads the model last, runs (or resumes) the cells and prints the tables.

Sizes (the default model, float32, the 2-core AMD EPYC this toolkit is measured on; 2026-11-28):

* ``--quick``: 3 methods (dense, streamingllm, radar+adaptive) at budget 1/8; at 2048 tokens niah_single_1 and
  niah_multikey_1 x 4 prompts and passkey at 3 depths x 1 prompt (11 prompts, each prefilled once for the 3
  cells), answers of at most 12 tokens; perplexity of 2 prose + 2 code texts of 1024 tokens over their last 16
  (4 cells: StreamingLLM's and the pooled oracle's at 1/8 join as the ratios' references). Measured from a clean
  clone on quiet cores: 1 min 34 s wall (8 min 27 s before the shared prefill computed the prompt's attention
  once, with both cores busy); a rerun with every cell finished takes 7 s.
* the default run, sized to about an hour per engine: 8 methods; retrieval at budget 1/8 (8 cells: the targets'
  budget), the 11 offline RULER tasks x 4 prompts and passkey 10 depths x 1 at 4096 tokens (54 prompts, each
  prefilled once for the 8 cells, answers of at most 32 tokens); perplexity of 2 prose + 2 code texts of 4096
  tokens over their last 256 at 1/16, 1/8, 1/4 and default (29 cells). Measured in transformers: retrieval 33
  min, perplexity 27 min (peak memory 12.6 GB: the 29 cells' caches of the 4 texts); the vLLM panel 26 min (a minute to start
  the engine, retrieval 18 min, perplexity 6 min).
* ``--wide``, the issue's grid: every budget in retrieval too (29 cells), 25 prompts per task and passkey 10
  depths x 5 at 4096 and 8192 tokens (650 prompts), 512 perplexity steps. Estimated from the costs above, not
  run: about 30 hours on that CPU (per 4k prompt 33 s of shared prefill and 3.4 s per answer token for the 29
  cells): a machine with more cores, or a GPU.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import typer
from rich.table import Table

from sparseattn.cli.checks import bad, check_range
from sparseattn.cli.consoles import console
from sparseattn.cli.options import MODEL

#: The measured wall time of ``sparseattn report --quick`` (see the module docstring).
QUICK_MEASURED = "1 min 34 s measured on 2 quiet cores"


#: The option behind each field of :class:`~sparseattn.evaluation.report_plan.ReportConfig`, for its refusals.
_OPTIONS = {"methods": "--methods", "budgets": "--budgets", "contexts": "--contexts", "tasks": "--task",
            "prompts": "--prompts", "retrieval_budgets": "--retrieval-budgets", "passkey_prompts": "--passkey-prompts", "ppl_steps": "--ppl-steps",
            "ppl_context": ["--ppl-context", "--ppl-steps"], "prose/code": ["--prose", "--code"],
            "answer_tokens": "--answer-tokens", "engines": "--engines"}  # fmt: skip


def _split(values: list[str] | None) -> list[str] | None:
    """Repeated and comma-separated values as one list (``--budgets 1/16,1/8 --budgets default``); None: not given."""
    if not values:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _budgets(values: list[str] | None, option: str) -> tuple[str, ...] | None:
    from sparseattn.evaluation.report_plan import parse_budget

    words = _split(values)
    if words is None:
        return None
    try:
        return tuple(dict.fromkeys(parse_budget(w) for w in words))
    except ValueError as err:
        raise bad(option, str(err)) from None


def _contexts(values: list[str] | None, window: int | None) -> tuple[int, ...] | None:
    words = _split(values)
    if words is None:
        return None
    contexts = []
    for word in words:
        if not word.isdigit():
            raise bad("--contexts", f"{word!r} is not a number of tokens; allowed: integers from 64 to {window or 'the model window'}")
        check_range("--contexts", int(word), 64, window)
        contexts.append(int(word))
    return tuple(dict.fromkeys(contexts))


def _engines(values: list[str] | None) -> tuple[str, ...]:
    """The engines asked for, vLLM's checked importable; by default both where it is, else transformers (said)."""
    from sparseattn.evaluation.report_plan import ENGINES
    from sparseattn.evaluation.vllm_engine import vllm_unavailable_reason

    words = _split(values)
    if words is None:
        if vllm_unavailable_reason() is None:
            return ENGINES
        console.print("report: transformers only (vLLM is not installed for this interpreter: run it from vLLM's venv, "
                      "docs/serving.md#install, for the vllm panel)", highlight=False)  # fmt: skip
        return ("transformers",)
    for word in words:
        if word not in ENGINES:
            raise bad("--engines", f"unknown engine {word!r}; allowed: {', '.join(ENGINES)}")
    if "vllm" in words and (reason := vllm_unavailable_reason()) is not None:
        raise bad("--engines", f"vllm: {reason}")
    return tuple(e for e in ENGINES if e in words)


def _tasks(values: list[str] | None) -> tuple[str, ...] | None:
    from sparseattn.data.ruler import RULER_QA, RULER_TASKS

    words = _split(values)
    if words is None:
        return None
    allowed = f"all, none, {', '.join(RULER_TASKS)}"
    chosen: list[str] = []
    for word in words:
        if word in ("all", "none"):
            chosen += list(RULER_TASKS) if word == "all" else []
            continue
        if word in RULER_QA:
            raise bad("--task", f"{word} needs the {RULER_QA[word]} data set, which cannot be fetched offline; allowed: {allowed}")
        if word not in RULER_TASKS:
            close = difflib.get_close_matches(word, list(RULER_TASKS), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise bad("--task", f"unknown task {word!r}{hint}; allowed: {allowed}")
        chosen.append(word)
    return tuple(t for t in RULER_TASKS if t in chosen)


def _texts(values: list[str] | None, kind: str) -> tuple[str, ...] | None:
    from sparseattn.cli.inputs import read_text
    from sparseattn.data.sources import get_text

    if not values:
        return None
    for name in values:
        read_text(name, f"--{kind}")  # a name that is not known, or a text that cannot be fetched: refused here
        if not Path(name).expanduser().is_file() and get_text(name).kind != kind:
            raise bad(f"--{kind}", f"{name!r} is a {get_text(name).kind} text; allowed: {kind} texts "
                      f"(`sparseattn data list`) or files")  # fmt: skip
    return tuple(values)


def report(
    quick: bool = typer.Option(False, "--quick", help=f"the first look: 3 methods, budget 1/8, 2048 tokens, 2 RULER tasks "
                               f"x 4 prompts, passkey 3 depths, 1024-token perplexity over 16 steps ({QUICK_MEASURED})"),
    methods: list[str] = typer.Option(None, "--methods", "-m", help="method specs NAME[:key=value,...] (repeatable; "
                                      "default: dense, streamingllm, snapkv, quest, radar, radar+, radar+adaptive, "
                                      "oracle-tokens:split=pooled; --quick: dense, streamingllm, radar+adaptive)"),
    wide: bool = typer.Option(False, "--wide", help="the issue's whole grid, for a machine bigger than 2 CPU cores: every "
                              "budget in retrieval too, 25 prompts per task and passkey 10 depths x 5 at 4096 and 8192 "
                              "tokens, 512 perplexity steps"),
    budgets: list[str] = typer.Option(None, "--budgets", "-b", help="1/N fractions of the context and/or default, the "
                                      "method's own (repeatable or comma-separated; default: 1/16, 1/8, 1/4, default; "
                                      "--quick: 1/8)"),
    retrieval_budgets: list[str] = typer.Option(None, "--retrieval-budgets", help="the retrieval cells' budgets, as "
                                                "--budgets (default: 1/8; --quick and --wide: --budgets)"),
    contexts: list[str] = typer.Option(None, "--contexts", help="prompt lengths in tokens, answer included (repeatable or "
                                       "comma-separated; default 4096; --wide: 4096, 8192; --quick: 2048); perplexity "
                                       "runs at the smallest"),
    prompts: int | None = typer.Option(None, help="seeded prompts per RULER task and context (>= 1; default 4, --wide 25, "
                                       "--quick 4)"),
    tasks: list[str] = typer.Option(None, "--task", help="RULER tasks (repeatable or comma-separated): all, none or "
                                    "niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe "
                                    "(default: all; --quick: niah_single_1, niah_multikey_1)"),
    passkey_prompts: int | None = typer.Option(None, help="passkey prompts per depth (>= 0, 0: no passkey; default 1 at "
                                               "10 depths, --wide 5; --quick: 1 at 3 depths)"),
    ppl_steps: int | None = typer.Option(None, help="teacher-forced perplexity steps per text (>= 0, 0: no perplexity; "
                                         "default 256, --wide 512; --quick 16)"),
    ppl_context: int | None = typer.Option(None, help="tokens per perplexity text, the budgets taken of it (>= 64; "
                                           "default: the smallest --contexts; --quick 1024)"),
    prose: list[str] = typer.Option(None, "--prose", help="prose texts for perplexity (repeatable; default: king-lear, "
                                    "paradise-regained)"),
    code: list[str] = typer.Option(None, "--code", help="code texts for perplexity (repeatable; default: pyio, subprocess)"),
    answer_tokens: int | None = typer.Option(None, help="most answer tokens generated per prompt (>= 1; RULER's own "
                                             "budget where smaller; default 32, --quick 12)"),
    engines: list[str] = typer.Option(None, "--engines", help="transformers and/or vllm, a figure panel each (repeatable "
                                      "or comma-separated; default: both where vLLM imports here, else transformers "
                                      "and a line saying so; vllm holds the methods its paged engine runs fused)"),
    verbose: bool = typer.Option(False, "--verbose", help="show vLLM's own output (default: in <out>.vllm.log)"),
    seed: int = typer.Option(0, help="the first prompt's seed (prompts are seeded, so reruns see the same ones)"),
    out: Path = typer.Option(Path("results/report"), help="directory of the report and its cells (a rerun resumes there)"),
    model: str = MODEL,
) -> None:
    """The quality report: methods x budgets on RULER's offline tasks, passkey and perplexity, with 95% intervals.

    Writes report.md, report.json and report.png (quality against the fraction of tokens attended, a column per
    engine) under --out, and a run directory per cell; a rerun skips the finished cells. Each prompt is
    prefilled once for every method and budget. --quick: a first look in about 2 minutes on 2 cores; the
    default: about an hour per engine there (4k tokens, 4 prompts per RULER task, retrieval at budget 1/8);
    --wide: the whole grid (about 30 hours on 2 cores, estimated). Sizes and times: docs/evaluation.md.
    """
    from sparseattn import registry
    from sparseattn.cli.inputs import inspect_model
    from sparseattn.cli.outputs import check_out, wrote
    from sparseattn.evaluation.report_plan import QUICK, WIDE, ReportConfig, plan_cells, with_overrides

    if quick and wide:
        raise bad(["--quick", "--wide"], "both given; allowed: one of them, or neither (the hour-sized default)")
    base = QUICK if quick else WIDE if wide else ReportConfig()
    check_range("--prompts", prompts, 1)
    check_range("--passkey-prompts", passkey_prompts, 0)
    check_range("--ppl-steps", ppl_steps, 0)
    check_range("--ppl-context", ppl_context, 64)
    check_range("--answer-tokens", answer_tokens, 1)
    for spec in methods or []:
        try:
            registry.parse(spec)
        except (ValueError, registry.PluginError) as err:  # a bad spec: the registry's message
            raise bad("--methods", str(err)) from None
    chosen_budgets, chosen_tasks = _budgets(budgets, "--budgets"), _tasks(tasks)
    chosen_retrieval = _budgets(retrieval_budgets, "--retrieval-budgets")
    chosen_engines = _engines(engines)
    check_out(out)
    info = inspect_model(model)
    chosen_contexts = _contexts(contexts, info.window)
    try:
        config = with_overrides(base, methods=tuple(methods) if methods else None, budgets=chosen_budgets,
                                retrieval_budgets=chosen_retrieval, engines=chosen_engines,
                                contexts=chosen_contexts, prompts=prompts, tasks=chosen_tasks,
                                passkey_prompts=passkey_prompts, ppl_steps=ppl_steps, ppl_context=ppl_context,
                                prose=_texts(prose, "prose"), code=_texts(code, "code"), answer_tokens=answer_tokens,
                                seed=seed)  # fmt: skip
    except ValueError as err:  # a combination the preset's fields refuse: said with the options behind the field
        field = str(err).partition(":")[0].removeprefix("ReportConfig.")
        raise bad(_OPTIONS.get(field, "--quick"), str(err).partition(": ")[2]) from None
    if not config.tasks and not config.passkey_prompts:
        raise bad(["--task", "--passkey-prompts"], "no retrieval task left to run; allowed: at least one RULER task or "
                  "--passkey-prompts >= 1")  # fmt: skip
    for context in config.contexts:
        try:
            plan_cells(config.methods, config.retrieval, context)
        except ValueError as err:
            raise bad(["--methods", "--retrieval-budgets"], f"at context {context}: {err}") from None
    if config.ppl_steps:
        _texts(list(config.prose), "prose"), _texts(list(config.code), "code")  # the defaults fetched once, or refused
        check_range("--ppl-context", config.ppl_tokens, 64, info.window)
        if config.ppl_steps >= config.ppl_tokens - 1:
            raise bad("--ppl-steps", f"{config.ppl_steps} leaves no prefill in the {config.ppl_tokens}-token texts; "
                      f"allowed: 0 to {config.ppl_tokens - 2}")  # fmt: skip
        try:
            plan_cells(["dense", *config.methods, "streamingllm", "oracle-tokens:split=pooled"], config.budgets,
                       config.ppl_tokens)
        except ValueError as err:
            raise bad(["--methods", "--budgets"], f"at the perplexity context {config.ppl_tokens}: {err}") from None

    from sparseattn.evaluation.report import run_report
    from sparseattn.evaluation.report_output import ppl_tables, retrieval_tables
    from sparseattn.evaluation.report_plan import plan_report

    tokenizer = info.tokenizer()
    try:
        plan = plan_report(config, tokenizer, out, model, info.window)
    except ValueError as err:  # a context a task cannot fill, or a text too short
        raise bad("--contexts", str(err)) from None
    from sparseattn.evaluation.report_plan import check_plan

    try:
        check_plan(plan)
    except ValueError as err:
        raise bad("--out", str(err)) from None
    import torch

    from sparseattn.cli.vllm_log import log_path, output_to_log

    result = run_report(plan, lambda: info.load(torch.float32), model_dir=str(info.directory),
                        say=lambda line: console.print(line, highlight=False),
                        vllm_output=None if verbose else lambda: output_to_log(log_path(out)))  # fmt: skip
    for title, header, rows in [*retrieval_tables(result), *ppl_tables(result)]:
        table = Table(title=title)
        for column in header:
            table.add_column(column, justify="left" if column in ("method", "budget") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    wrote([out / "report.md", out / "report.json", out / "report.png"], "and a run directory per cell under "
          f"{out}/<engine>/")  # fmt: skip
