"""The quality report from its cells' files: intervals and verdicts per cell, the tables, ``report.json``,
``report.md`` and the figure (:mod:`sparseattn.evaluation.report`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


from sparseattn.evaluation.intervals import compare, stratified_bootstrap_mean
from sparseattn.evaluation.runs import environment, write_json
from sparseattn.evaluation.report_plan import ORACLE, STREAMING, Plan, part_runs, ppl_runs, record_key


# -- the report: tables, JSON and the figure, from the cells' files ---------------------------------------------------


def _ratio(value: float, dense: float, reference: float | None) -> float | None:
    if reference is None or reference == dense:
        return None
    return (value - dense) / (reference - dense)


def _kind_summary(values: Sequence[float | None], kinds: Sequence[str]) -> dict[str, dict[str, float] | None]:
    """Mean and worst (largest) of ``values`` over the texts of each kind (None: a ratio undefined on some text)."""
    out: dict[str, dict[str, float] | None] = {}
    for kind in dict.fromkeys(kinds):
        mine = [v for v, k in zip(values, kinds) if k == kind]
        out[kind] = None if any(v is None for v in mine) else {"mean": sum(mine) / len(mine), "worst": max(mine)}
    return out


def assemble(plan: Plan) -> dict[str, Any]:
    """The report from the cells' files: ``report.json``, ``report.md`` and ``report.png`` under ``plan.out``.

    Per retrieval cell its interval; per (engine, context, method, budget) the RULER mean over tasks
    (stratified bootstrap) compared with dense's at that context (paired: the same prompts); per
    perplexity cell each text's perplexity, gap ratio and ceiling-relative gap.
    """
    config = plan.config
    cells, records = [], {}
    for part in plan.parts:
        for label, (_, run) in part_runs(plan, part).items():
            summary = run.summary()
            planned = {key for key, _ in part.samples}
            records[(part.engine, part.context, label, part.task)] = {
                record_key(r): r["score"] for r in run.records("samples.jsonl") if record_key(r) in planned}  # fmt: skip
            cells.append({"engine": part.engine, "context": part.context, "task": part.task, "label": label,
                          "method": summary["method"], "budget": summary["budget"],
                          "budget_tokens": summary["budget_tokens"], "score": summary["score"],
                          "fraction": summary["fraction"], "by_depth": summary["by_depth"]})  # fmt: skip
    means = []
    for engine in config.engines:
        for context in config.contexts:
            labels = list(dict.fromkeys(c["label"] for c in cells if c["engine"] == engine and c["context"] == context))
            for group, tasks in (("ruler", list(config.tasks)), ("passkey", ["passkey"] if config.passkey_prompts else [])):
                if not tasks:
                    continue
                dense = next((lab for lab in labels if lab.startswith("dense@")), None)
                for label in labels:
                    mine = {t: records[(engine, context, label, t)] for t in tasks}
                    row = {"engine": engine, "context": context, "group": group, "label": label,
                           "tasks": tasks}  # fmt: skip
                    own = [c for c in cells if c["engine"] == engine and c["context"] == context and c["label"] == label
                           and c["task"] in tasks]  # fmt: skip
                    row.update(method=own[0]["method"], budget=own[0]["budget"], budget_tokens=own[0]["budget_tokens"])
                    fractions = [c["fraction"] for c in own if not math.isnan(c["fraction"])]
                    row["fraction"] = sum(fractions) / len(fractions) if fractions else float("nan")
                    if dense is not None:
                        versus = compare(mine, {t: records[(engine, context, dense, t)] for t in tasks},
                                         resamples=config.resamples, seed=config.seed)  # fmt: skip
                        row["score"], row["versus_dense"] = versus.method.to_dict(), versus.to_dict()
                    else:
                        row["score"] = stratified_bootstrap_mean({t: list(mine[t].values()) for t in tasks},
                                                                 resamples=config.resamples, seed=config.seed).to_dict()
                    means.append(row)
    ppl_rows = []
    for part in plan.ppl:
        summaries = {label: run.summary() for label, (_, run) in ppl_runs(plan, part).items()}
        dense = summaries.get("dense@full")
        for label, s in summaries.items():
            row = {"engine": part.engine, "context": part.context, "steps": part.steps, "label": label,
                   "method": s["method"], "budget": s["budget"], "budget_tokens": s["budget_tokens"],
                   "fraction": s["fraction"], "ppl": dict(zip(part.texts, s["row_ppl"]))}  # fmt: skip
            if dense is not None and s["budget"] not in ("full", "default", "spec"):
                streaming = summaries.get(f"{STREAMING}@{s['budget']}")
                oracle = summaries.get(f"{ORACLE}@{s['budget']}")
                gap = [_ratio(p, d, None if streaming is None else r)
                       for p, d, r in zip(s["row_ppl"], dense["row_ppl"], (streaming or s)["row_ppl"])]
                ceiling = [_ratio(p, d, None if oracle is None else r)
                           for p, d, r in zip(s["row_ppl"], dense["row_ppl"], (oracle or s)["row_ppl"])]
                row["gap_ratio"] = dict(zip(part.texts, gap))
                row["ceiling_relative"] = dict(zip(part.texts, ceiling))
                row["gap_ratio_by_kind"] = _kind_summary(gap, part.kinds)
                row["ceiling_relative_by_kind"] = _kind_summary(ceiling, part.kinds)
            ppl_rows.append(row)
    report = {"config": config.to_dict(), "model": plan.model, "environment": environment(), "cells": cells,
              "means": means, "ppl": ppl_rows,
              "ppl_texts": [{"text": t, "kind": k} for part in plan.ppl[:1] for t, k in zip(part.texts, part.kinds)]}  # fmt: skip
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json(plan.out / "report.json", report)
    (plan.out / "report.md").write_text(markdown(report) + "\n")
    from sparseattn.evaluation.plots import save

    save(draw_report(report), plan.out / "report.png")
    return report


def _interval_text(score: dict[str, float]) -> str:
    return f"{score['mean']:.1f} [{score['low']:.1f}, {score['high']:.1f}]"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def retrieval_tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` per engine and context: a row per cell, a column per task, the RULER mean
    with its interval and its verdict against dense (the markdown and the console print these)."""
    config = report["config"]
    tasks = [*config["tasks"], *(["passkey"] if config["passkey_prompts"] else [])]
    tables = []
    for engine in config["engines"]:
        for context in config["contexts"]:
            cells = {(c["label"], c["task"]): c for c in report["cells"] if c["engine"] == engine and c["context"] == context}
            means = {(m["label"], m["group"]): m for m in report["means"] if m["engine"] == engine and m["context"] == context}
            labels = list(dict.fromkeys(label for label, _ in cells))
            header = ["method", "budget", "attended", *tasks]
            if config["tasks"]:
                header += ["RULER mean [95%]", "vs dense"]
            rows = []
            for label in labels:
                first = next(c for (lab, _), c in cells.items() if lab == label)
                budget = first["budget"] + (f" ({first['budget_tokens']})" if first["budget_tokens"] else "")
                fractions = [c["fraction"] for (lab, _), c in cells.items() if lab == label and not math.isnan(c["fraction"])]
                row = [first["method"], budget, _number(sum(fractions) / len(fractions) if fractions else None, 3)]
                row += [_interval_text(cells[(label, t)]["score"]) for t in tasks]
                if config["tasks"]:
                    mean = means[(label, "ruler")]
                    versus = mean.get("versus_dense")
                    verdict = "-" if versus is None or label.startswith("dense@") else (
                        f"{versus['verdict']} (diff {_interval_text(versus['difference'])})")
                    row += [_interval_text(mean["score"]), verdict]
                rows.append(row)
            title = (f"Retrieval, {engine}, {context} tokens: score (%) [95% bootstrap interval], {config['prompts']} prompts "
                     f"per RULER task, passkey {len(config['passkey_depths'])} depths x {config['passkey_prompts']}")
            tables.append((title, header, rows))
    return tables


def ppl_tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """``(title, header, rows)`` per engine: perplexity per text, gap ratio and ceiling-relative gap per kind."""
    texts = report["ppl_texts"]
    tables = []
    for engine in report["config"]["engines"]:
        rows_in = [r for r in report["ppl"] if r["engine"] == engine]
        if not rows_in:
            continue
        kinds = list(dict.fromkeys(t["kind"] for t in texts))
        header = ["method", "budget", "attended", *(Path(t["text"]).name for t in texts),
                  *(f"gap ratio, {k}: mean (worst)" for k in kinds), *(f"ceiling-relative, {k}: mean (worst)" for k in kinds)]
        rows = []
        for r in rows_in:
            budget = r["budget"] + (f" ({r['budget_tokens']})" if r["budget_tokens"] else "")
            row = [r["method"], budget, _number(r["fraction"], 3), *(f"{r['ppl'][t['text']]:.3f}" for t in texts)]
            for key in ("gap_ratio_by_kind", "ceiling_relative_by_kind"):
                for k in kinds:
                    s = (r.get(key) or {}).get(k)
                    row.append("-" if s is None else f"{s['mean']:.3f} ({s['worst']:.3f})")
            rows.append(row)
        first = rows_in[0]
        title = (f"Perplexity, {engine}: {first['context']} tokens per text, the last {first['steps']} decoded; gap ratio = "
                 "(ppl - dense) / (StreamingLLM's - dense), ceiling-relative = (ppl - dense) / (oracle-tokens:split=pooled's "
                 "- dense), both at the same budget")
        tables.append((title, header, rows))
    return tables


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: its setup, a retrieval table per engine and context, a perplexity table per engine."""
    config = report["config"]
    env = report["environment"]
    lines = [
        "# Quality report",
        "",
        f"Model `{report['model']}`; engines {', '.join(config['engines'])}; methods {', '.join(config['methods'])}; budgets "
        f"{', '.join(config['budgets'])} (fractions of the context: past KV tokens per decode step); seed {config['seed']}; "
        f"answers of at most {config['answer_tokens']} tokens; torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['threads']} threads on {env['processor']}.",
        "",
        f"Intervals: 95% percentile bootstrap over the prompts ({config['resamples']} resamples; the RULER mean: "
        "stratified by task, each task weighing the same). `vs dense`: *within* = the mean lies inside dense's "
        "interval; *worse* = the paired difference's interval is below 0; *outside* = neither. `attended`: the KV "
        "tokens a decode step attended over those it could attend (measured).",
        "",
        "Perplexity ratios divide by the reference's own gap to dense: where that gap is near 0 (StreamingLLM or the "
        "oracle about as good as dense on a text, or better) a text's ratio is large or of either sign; read each text's "
        "perplexities beside its ratios.",
    ]
    for title, header, rows in [*retrieval_tables(report), *ppl_tables(report)]:
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def draw_report(report: dict[str, Any]):
    """Quality against the fraction of tokens attended: a panel per engine, a line per method (and context), its
    95% interval shaded; dense is a point with its interval as a band across the panel."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    config = report["config"]
    group = "ruler" if config["tasks"] else "passkey"
    engines = list(config["engines"])
    fig, axes = plt.subplots(1, len(engines), figsize=(8 * len(engines), 5.5), squeeze=False, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ax, engine in zip(axes[0], engines):
        rows = [m for m in report["means"] if m["engine"] == engine and m["group"] == group]
        methods = list(dict.fromkeys(r["method"] for r in rows))
        for i, method in enumerate(methods):
            colour = colours[i % len(colours)]
            for j, context in enumerate(config["contexts"]):
                points = sorted((r["fraction"], r["score"]) for r in rows if r["method"] == method and r["context"] == context
                                and not math.isnan(r["fraction"]))  # fmt: skip
                if not points:
                    continue
                x = [p[0] for p in points]
                label = f"{method}, {context} tokens" if len(config["contexts"]) > 1 else method
                if method == "dense":
                    s = points[0][1]
                    ax.axhspan(s["low"], s["high"], color=colour, alpha=0.08)
                    ax.errorbar(x, [s["mean"]], yerr=[[s["mean"] - s["low"]], [s["high"] - s["mean"]]], fmt="s",
                                color=colour, linestyle=styles[j % len(styles)], label=label, capsize=3)  # fmt: skip
                    continue
                y = [p[1]["mean"] for p in points]
                ax.plot(x, y, marker="o", color=colour, linestyle=styles[j % len(styles)], label=label)
                ax.fill_between(x, [p[1]["low"] for p in points], [p[1]["high"] for p in points], color=colour, alpha=0.15)
                # a line of one budget has no area to shade: its interval shows as a bar at the point too
                ax.errorbar(x, y, yerr=[[m - p[1]["low"] for m, p in zip(y, points)], [p[1]["high"] - m for m, p in zip(y, points)]],
                            fmt="none", ecolor=colour, alpha=0.6, capsize=3)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: "1" if x >= 1 else f"1/{round(1 / x):d}"))
        ax.set_ylim(-3, 103)
        ax.set_xlabel("fraction of the context's KV tokens attended per decode step (measured, log scale)")
        ax.set_title(f"{engine}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    what = f"RULER mean over {len(config['tasks'])} tasks" if group == "ruler" else "passkey accuracy"
    axes[0][0].set_ylabel(f"{what} (%), 95% interval shaded")
    fig.suptitle(f"Quality against tokens attended ({report['model']}, {config['prompts']} prompts per task)")
    fig.tight_layout()
    return fig
