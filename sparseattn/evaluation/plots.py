"""Figures and tables from run directories (matplotlib, headless)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402


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


def ppl_figure(runs: Sequence[Path], out: Path, title: str | None = None) -> Path:
    """The paper's Figure 3 layout: running perplexity (top) and cumulative decode time (bottom) vs position."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for path in runs:
        summary, records = load_run(path)
        positions = [r["position"] for r in records]
        total, running = 0.0, []
        for i, r in enumerate(records, 1):
            total += r["nll"]
            running.append(math.exp(total / i))
        label = f"{run_label(summary)}: ppl {summary['ppl']:.2f}, {summary['tokens_per_second']:.1f} tok/s"
        top.plot(positions, running, label=label)
        bottom.plot(positions, [r["elapsed"] for r in records], label=run_label(summary))
    top.set_ylabel("perplexity (running)")
    top.legend(fontsize=8)
    bottom.set_ylabel("cumulative decode time (s)")
    bottom.set_xlabel("token position")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


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
    rows = []
    for path in runs:
        summary, _ = load_run(path)
        rows.append({**summary, "label": run_label(summary)})
    return markdown_table(rows, PPL_COLUMNS)


def heatmap(matrix: Sequence[Sequence[float]], rows: Sequence[str], cols: Sequence[str], out: Path, title: str,
            xlabel: str, ylabel: str, vmin: float = 0.0, vmax: float = 100.0) -> Path:
    """An annotated heatmap (e.g. needle accuracy by length x depth)."""
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(cols), 1.0 + 0.5 * len(rows)))
    image = ax.imshow(matrix, cmap="RdYlGn", vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def attention_pictures(pictures, heads: Sequence[int], out: Path, title: str) -> Path:
    """The Radar paper's appendix figure: per head, token attention (top), exact segment attention
    (middle) and the method's estimated segment attention (bottom), queries as rows.

    ``pictures``: per step ``(token probs [H_q, t], exact [H_q, S], estimated [H_q, S])``; steps with a
    different segment count than the first are dropped so the rows align.
    """
    if not pictures:
        raise ValueError("no pictures were recorded (the method has no segments at these lengths?)")
    S = pictures[0][1].shape[-1]
    steps = [p for p in pictures if p[1].shape[-1] == S]
    t0 = min(p[0].shape[-1] for p in steps)
    fig, axes = plt.subplots(3, len(heads), figsize=(3.2 * len(heads), 7), squeeze=False)
    for col, h in enumerate(heads):
        token = [p[0][h, :t0].tolist() for p in steps]
        exact = [p[1][h].tolist() for p in steps]
        estimated = [p[2][h].tolist() for p in steps]
        for row, (data, name) in enumerate(((token, "token attention"), (exact, "exact segment attention"),
                                            (estimated, "estimated segment attention"))):
            ax = axes[row][col]
            ax.imshow(data, cmap="coolwarm", aspect="auto", interpolation="nearest")
            ax.set_title(f"head {h}: {name}", fontsize=8)
            ax.set_ylabel("decode step", fontsize=7)
            ax.tick_params(labelsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


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
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
