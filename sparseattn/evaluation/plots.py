"""Figures and tables from run directories (matplotlib, headless).

Each figure has a ``draw_*`` function that returns the matplotlib ``Figure`` (for tests and notebooks)
and a function that draws it into a PNG and returns the path (what the CLI calls).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter  # noqa: E402

#: Resolution of every PNG written here.
DPI = 120


def save(fig: Figure, out: Path) -> Path:
    """Write ``fig`` to ``out`` (PNG) and free it."""
    try:
        fig.savefig(out, dpi=DPI)
    finally:
        plt.close(fig)
    return Path(out)


def load_run(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(summary, token records)`` of a finished perplexity run directory."""
    path = Path(path)
    summary_path = path / "summary.json"
    if not summary_path.exists():
        raise ValueError(f"{path} holds no finished run (no summary.json)")
    records = [json.loads(line) for line in (path / "tokens.jsonl").read_text().splitlines() if line.strip()]
    return json.loads(summary_path.read_text()), records


def run_label(summary: dict[str, Any]) -> str:
    label = summary.get("method", "?")
    if summary.get("budget") and "budget=" not in label:
        label += f" (budget {summary['budget']})"
    return label


def cumulative_ppl(nll: Sequence[float]) -> list[float]:
    """Perplexity of the tokens so far at each position, ``exp(mean of the NLLs up to i)`` (the paper's curve).

    >>> [round(x, 3) for x in cumulative_ppl([0.0, math.log(4.0)])]
    [1.0, 2.0]
    """
    total, out = 0.0, []
    for i, value in enumerate(nll, 1):
        total += value
        out.append(math.exp(total / i))
    return out


def settled_limits(curves: Sequence[Sequence[float]], warmup: int) -> tuple[float, float] | None:
    """Log-axis limits that hold every curve after its first ``warmup`` points (None: nothing left)."""
    rest = [v for curve in curves for v in curve[warmup:] if math.isfinite(v) and v > 0]
    if not rest:
        return None
    lo, hi = min(rest), max(rest)
    pad = max(math.log(hi / lo) * 0.08, 0.01)  # a margin, also when every curve is flat
    return lo * math.exp(-pad), hi * math.exp(pad)


def draw_ppl(runs: Sequence[Path], title: str | None = None) -> Figure:
    """The paper's Figure 3 layout: cumulative perplexity (top) and cumulative decode time (bottom) vs position.

    The first tokens' perplexity is a spike (little context yet) orders of magnitude above where the
    curves settle, and a cumulative mean forgets it only as 1/position; on a linear axis up to the spike
    the curves flatten into one line. So the top axis is log-scaled and its limits hold the curves after
    their first quarter (at least 8 tokens), where the methods separate; the spike runs off the top.
    """
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    curves, n_max = [], 0
    for path in runs:
        summary, records = load_run(path)
        positions = [r["position"] for r in records]
        running = cumulative_ppl([r["nll"] for r in records])
        curves.append(running)
        n_max = max(n_max, len(running))
        label = f"{run_label(summary)}: ppl {summary['ppl']:.2f}, {summary['tokens_per_second']:.1f} tok/s"
        top.plot(positions, running, label=label)
        bottom.plot(positions, [r["elapsed"] for r in records], label=run_label(summary))
    warmup = min(max(8, n_max // 4), max(0, n_max - 1))
    top.set_yscale("log")
    limits = settled_limits(curves, warmup)
    if limits is not None:
        top.set_ylim(*limits)
    top.set_ylabel(f"cumulative perplexity (log scale;\nfirst {warmup} tokens may run off the top)" if warmup
                   else "cumulative perplexity (log scale)")
    # Evenly spread plain numbers: the log axis' defaults (powers of ten, labels like 2x10^1) label one
    # or two ticks when the curves span less than a decade, as they usually do.
    top.yaxis.set_major_locator(MaxNLocator(nbins=7))
    top.yaxis.set_major_formatter(FormatStrFormatter("%.4g"))
    top.yaxis.set_minor_formatter(NullFormatter())
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)
    bottom.set_ylabel("cumulative decode time (s)")
    bottom.set_xlabel("token position")
    bottom.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def ppl_figure(runs: Sequence[Path], out: Path, title: str | None = None) -> Path:
    """:func:`draw_ppl` into the PNG ``out``."""
    return save(draw_ppl(runs, title), out)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table; ``columns`` are ``(key, header, format)`` with format like ``"{:.2f}"``."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body])


PPL_COLUMNS = (
    ("label", "method", "{}"),
    ("text", "text", "{}"),
    ("prefill", "prefill", "{}"),
    ("n_tokens", "tokens", "{}"),
    ("ppl", "ppl", "{:.3f}"),
    ("tokens_per_second", "tokens/s", "{:.2f}"),
    ("mean_attended_tokens", "attended / step", "{:.0f}"),
    ("mean_context_tokens", "context", "{:.0f}"),
)


def ppl_table(runs: Sequence[Path]) -> str:
    """The finished perplexity runs as a markdown table; a figure not measured (NaN, such as the KV tokens a step
    attended, which vLLM does not report: ``ppl --engine vllm``) shows as ``-``."""
    rows = []
    for path in runs:
        summary, _ = load_run(path)
        known = {key: None if isinstance(value, float) and math.isnan(value) else value for key, value in summary.items()}
        rows.append({**known, "label": run_label(summary)})
    return markdown_table(rows, PPL_COLUMNS)


def draw_heatmap(matrix: Sequence[Sequence[float]], rows: Sequence[str], cols: Sequence[str], title: str,
                 xlabel: str, ylabel: str, vmin: float = 0.0, vmax: float = 100.0,
                 colorbar_label: str = "accuracy (%)") -> Figure:
    """An annotated heatmap (e.g. needle accuracy by length x depth) with a labelled colour bar.

    The figure grows with the grid but never below 6.4 x 4 inches (768 x 480 px): one row of a few
    cells, with its title, labels and colour bar, must still read.
    """
    width = max(6.4, 2.4 + 0.9 * len(cols))
    height = max(4.0, 1.8 + 0.55 * len(rows))
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    image = ax.imshow(matrix, cmap="RdYlGn", vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                # White on the dark ends of the colour map, black on its light middle.
                r, g, b, _ = image.cmap(image.norm(value))
                colour = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.45 else "black"
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=10, color=colour)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=colorbar_label)
    return fig


def heatmap(matrix: Sequence[Sequence[float]], rows: Sequence[str], cols: Sequence[str], out: Path, title: str,
            xlabel: str, ylabel: str, vmin: float = 0.0, vmax: float = 100.0, colorbar_label: str = "accuracy (%)") -> Path:
    """:func:`draw_heatmap` into the PNG ``out``."""
    return save(draw_heatmap(matrix, rows, cols, title, xlabel, ylabel, vmin, vmax, colorbar_label), out)


def draw_attention_pictures(pictures, heads: Sequence[int], title: str) -> Figure:
    """The Radar paper's appendix figure: per head (columns), token attention (top row), exact segment
    attention (middle) and the method's estimated segment attention (bottom), one decode step per row
    of pixels.

    ``pictures``: per step ``(token probs [H_q, t], exact [H_q, S], estimated [H_q, S])``, each row a
    distribution over keys or segments; steps with a different segment count than the first are dropped
    so the rows align. Each figure row has one colour scale and a colour bar; the exact and the estimated
    segment rows share theirs, so their colours compare directly.
    """
    if not pictures:
        raise ValueError("no pictures were recorded (the method has no segments at these lengths?)")
    if not heads:
        raise ValueError("no heads to draw: every requested head is beyond the model's query heads")
    S = pictures[0][1].shape[-1]
    steps = [p for p in pictures if p[1].shape[-1] == S]
    t0 = min(p[0].shape[-1] for p in steps)
    token = {h: [p[0][h, :t0].tolist() for p in steps] for h in heads}
    exact = {h: [p[1][h].tolist() for p in steps] for h in heads}
    estimated = {h: [p[2][h].tolist() for p in steps] for h in heads}
    token_max = max(max(map(max, token[h])) for h in heads)
    segment_max = max(max(max(map(max, exact[h])) for h in heads), max(max(map(max, estimated[h])) for h in heads))
    panels = (
        (token, "token attention", "key token position", "attention probability", token_max),
        (exact, "exact segment attention", "segment index", "share of the step's attention", segment_max),
        (estimated, "estimated segment attention", "segment index", "share of the step's attention", segment_max),
    )
    fig, axes = plt.subplots(3, len(heads), figsize=(1.4 + 3.4 * len(heads), 8.5), squeeze=False, layout="constrained")
    for row, (data, name, xlabel, scale_label, vmax) in enumerate(panels):
        image = None
        for col, h in enumerate(heads):
            ax = axes[row][col]
            image = ax.imshow(data[h], cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
            ax.set_title(f"head {h}: {name}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("decode step", fontsize=8)
            ax.tick_params(labelsize=7)
        if row == 1:  # the exact and estimated rows share one scale: one bar beside both
            continue
        owners = list(axes[row]) if row == 0 else [*axes[1], *axes[2]]
        fig.colorbar(image, ax=owners, label=scale_label, shrink=0.9)
    fig.suptitle(title)
    return fig


def attention_pictures(pictures, heads: Sequence[int], out: Path, title: str) -> Path:
    """:func:`draw_attention_pictures` into the PNG ``out``."""
    return save(draw_attention_pictures(pictures, heads, title), out)


def sweep_figure(panels: dict[str, list[tuple[Any, float]]], out: Path, title: str, ylabel: str = "perplexity",
                 reference: float | None = None) -> Path:
    """One panel per swept parameter: ``{name: [(value, metric), ...]}``; a dashed line for dense."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (name, points) in zip(axes[0], panels.items()):
        labels = [str(v) for v, _ in points]
        values = [m for _, m in points]
        if all(isinstance(v, (int, float)) for v, _ in points):
            ax.plot([v for v, _ in points], values, marker="o")
            ax.set_xscale("log", base=2)
        else:
            ax.bar(labels, values)
            ax.tick_params(axis="x", labelrotation=20)
        if reference is not None:
            ax.axhline(reference, linestyle="--", color="gray", label="dense")
            ax.legend(fontsize=8)
        ax.set_xlabel(name)
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    return save(fig, out)


def ruler_rows(scores: dict[str, dict[str, dict[int, float]]], lengths: Sequence[int]) -> list[dict[str, Any]]:
    """The rows of RULER's summary table: one per task and length, then the mean over tasks per length.

    ``scores[task][method][length]`` is a mean accuracy in percent; a row is ``{"task", "length",
    <method>: accuracy, ...}`` (RULER reports the average over its tasks as its headline number).
    """
    methods = list(dict.fromkeys(m for per_task in scores.values() for m in per_task))
    rows = [
        {"task": task, "length": n, **{m: per_task[m].get(n) for m in per_task}}
        for task, per_task in scores.items()
        for n in lengths
    ]
    for n in lengths:
        mean = {}
        for m in methods:
            values = [r[m] for r in rows if r["length"] == n and r.get(m) is not None and r["task"] != "mean"]
            mean[m] = sum(values) / len(values) if values else None
        rows.append({"task": "mean", "length": n, **mean})
    return rows


def ruler_markdown(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> str:
    """:func:`ruler_rows` as a markdown table (accuracy in percent, one column per method)."""
    columns = [("task", "task", "{}"), ("length", "length", "{}"), *((m, m, "{:.1f}") for m in methods)]
    return markdown_table(rows, columns)
