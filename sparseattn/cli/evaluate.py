"""The evaluation commands: ``ppl``, ``plot``, ``needle``, ``diagnose``, ``sweep`` and ``longbench run``.

Methods are named on the command line as ``NAME[:key=value,...]`` with the keys of
:class:`~sparseattn.cli.methods.MethodOptions`, e.g. ``radar:top_k=8,n_features=256`` or
``h2o:heavy_ratio=0.25``; ``--budget`` sets the budget of every method that has none in its spec.
Every run writes a directory (``--out``) holding its resolved config, its records as they are
produced, and a summary; rerunning skips what is finished and resumes what is not.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from sparseattn.cli.methods import METHODS, MethodOptions, build_method
from sparseattn.hf import DEFAULT_MODEL, load_model

console = Console()

QUICK = "quick defaults finish in minutes on a 2-core CPU; raise them for full-size runs"


def parse_method(spec: str, budget: int | None = None) -> tuple[str, object, dict]:
    """``"radar:top_k=8"`` -> ``(label, method instance, options given)``; ``budget`` fills in a missing budget."""
    name, _, rest = spec.partition(":")
    if name not in METHODS:
        raise typer.BadParameter(f"unknown method {name!r}; known: {', '.join(METHODS)}", param_hint="--method")
    fields = {f.name: f for f in dataclasses.fields(MethodOptions)}
    given: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            raise typer.BadParameter(
                f"bad option {item!r} in {spec!r}; options are key=value with key in {', '.join(fields)}", param_hint="--method"
            )
        kind = float if "float" in str(fields[key].type) else int
        try:
            given[key] = kind(value)
        except ValueError:
            raise typer.BadParameter(f"option {key} in {spec!r} must be a {kind.__name__}, got {value!r}") from None
    if budget is not None and "budget" in METHODS[name].options and "budget" not in given:
        given["budget"] = budget  # only methods that have a budget (dense has none)
    try:
        method = build_method(name, MethodOptions(**given))
    except ValueError as err:
        raise typer.BadParameter(f"{spec}: {err}", param_hint="--method") from None
    label = name + ("" if not given else ":" + ",".join(f"{k}={v}" for k, v in sorted(given.items())))
    return label, method, given


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label)


def _load(model: str, dtype: str):
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise typer.BadParameter(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return load_model(model, dtype=torch_dtype)


def _text(name: str) -> str:
    from sparseattn.data import load_text

    path = Path(name)
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    try:
        return load_text(name)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--text") from None


MODEL = typer.Option(DEFAULT_MODEL, help="'default' (SmolLM2-135M-Instruct), a local HF directory or a .gguf file")
METHOD = typer.Option(["dense", "radar"], "--method", "-m", help="NAME[:key=value,...]; repeat for several methods")
BUDGET = typer.Option(None, help="past KV tokens a decode step may attend, for every method (sinks and window included)")
DTYPE = typer.Option("float32", help="float32, bfloat16 or float16")
OUT = typer.Option(Path("results"), help="root directory of the runs")


def ppl(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    text: str = typer.Option("pydecimal", help="a text name (`sparseattn data list`) or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled densely (0: generation without prompts)"),
    steps: int = typer.Option(256, help=f"decode steps ({QUICK}; the paper: prefill 16384 + the whole text)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Perplexity as the paper's Sec. 4.1: prefill a prompt, then feed the text token by token with the method."""
    from sparseattn.evaluation.plots import ppl_table
    from sparseattn.evaluation.ppl import run_ppl, tokenize
    from sparseattn.evaluation.runs import RunDir

    resolved = [parse_method(spec, budget) for spec in method]
    hf_model, tokenizer = _load(model, dtype)
    ids = tokenize(tokenizer, _text(text), prefill + steps + 1, name=text)
    dirs = []
    for label, sparse_method, given in resolved:
        config = {"command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps, "dtype": dtype,
                  "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        run = RunDir(out / f"ppl-{_slug(text)}-p{prefill}-s{steps}" / _slug(label), config)
        summary = run_ppl(hf_model, sparse_method, ids, prefill, steps, run, label=label)
        console.print(f"{label}: ppl {summary['ppl']:.3f}, {summary['tokens_per_second']:.2f} tokens/s, "
                      f"{summary['mean_attended_tokens']:.0f} KV tokens attended per step -> {run.path}")
        dirs.append(run.path)
    console.print(ppl_table(dirs))


def plot(
    runs: list[Path] = typer.Argument(..., help="perplexity run directories (or parents of them)"),
    out: Path = typer.Option(Path("ppl.png"), help="the PNG to write; a markdown table goes beside it (.md)"),
    title: str | None = typer.Option(None),
) -> None:
    """Perplexity and cumulative time vs position (the paper's Figure 3 layout) and a markdown table."""
    from sparseattn.evaluation.plots import ppl_figure, ppl_table

    found = []
    for path in runs:
        found += [path] if (path / "summary.json").exists() else sorted(p.parent for p in path.glob("*/summary.json"))
    if not found:
        raise typer.BadParameter("no finished run (summary.json) under the given paths")
    ppl_figure(found, out, title)
    table = ppl_table(found)
    out.with_suffix(".md").write_text(table + "\n")
    console.print(table)
    console.print(f"wrote {out} and {out.with_suffix('.md')}")


def needle(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: str = typer.Option("passkey", help="passkey or a RULER task (niah_single_1, niah_multikey_1, ...)"),
    lengths: list[int] = typer.Option([4096], "--length", help="target prompt lengths in tokens (repeatable)"),
    depths: list[float] = typer.Option([10.0, 50.0, 90.0], "--depth", help="needle depths in percent (repeatable)"),
    samples: int = typer.Option(2, help=f"samples per length x depth ({QUICK})"),
    haystack: str = typer.Option("paradise-lost", help="text for RULER's prose haystack (tasks with haystack='prose')"),
    max_new_tokens: int = typer.Option(16),
    chat: bool = typer.Option(False, help="wrap prompts in the tokenizer's chat template"),
    seed: int = typer.Option(0),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Retrieval accuracy (passkey / RULER NIAH) by length x depth: a table, JSON and a heatmap per method."""
    from sparseattn.data.needle import RULER_NIAH, PasskeyTask
    from sparseattn.evaluation.generation import accuracy_grid, run_needle
    from sparseattn.evaluation.plots import heatmap
    from sparseattn.evaluation.runs import RunDir, write_json

    if task == "passkey":
        retrieval = PasskeyTask()
    elif task in RULER_NIAH:
        retrieval = RULER_NIAH[task]
    else:
        raise typer.BadParameter(f"unknown task {task!r}; known: passkey, {', '.join(RULER_NIAH)}", param_hint="--task")
    resolved = [parse_method(spec, budget) for spec in method]
    hf_model, tokenizer = _load(model, dtype)
    haystack_text = _text(haystack) if getattr(retrieval, "haystack", None) == "prose" else None
    table = Table(title=f"{task}: accuracy (%) by length and depth")
    table.add_column("method")
    table.add_column("length", justify="right")
    shown_depths = depths if getattr(retrieval, "num_needles", 1) == 1 else [-1.0]
    for d in shown_depths:
        table.add_column("spread" if d < 0 else f"{d:g}%", justify="right")
    table.add_column("mean", justify="right")
    for label, sparse_method, given in resolved:
        # Lengths, depths and samples say how much of the grid to run: more of them extends the run.
        config = {"command": "needle", "model": model, "task": task, "max_new_tokens": max_new_tokens, "chat": chat,
                  "seed": seed, "dtype": dtype, "method": label, "budget": given.get("budget"), "params": repr(sparse_method),
                  "haystack": haystack if haystack_text else None}
        run = RunDir(out / f"needle-{task}" / _slug(label), config)
        records = run_needle(hf_model, tokenizer, sparse_method, retrieval, lengths, depths, samples, run,
                             max_new_tokens=max_new_tokens, haystack_text=haystack_text, chat=chat, seed=seed)
        grid = accuracy_grid(records, lengths, shown_depths)
        for n, row in zip(lengths, grid):
            table.add_row(label, str(n), *(f"{v:.0f}" for v in row), f"{sum(row) / len(row):.0f}")
        mean = sum(r["score"] for r in records) / len(records)
        run.finish({**config, "lengths": lengths, "depths": shown_depths, "samples": samples, "accuracy": mean, "grid": grid,
                    "n_samples": len(records),
                    "mean_attended_tokens": sum(r["attended"] for r in records) / len(records)})
        heatmap(grid, [str(n) for n in lengths], ["spread" if d < 0 else f"{d:g}%" for d in shown_depths],
                run.path / "heatmap.png", f"{task}, {label}", "needle depth", "prompt tokens")
        write_json(run.path / "grid.json", {"lengths": lengths, "depths": shown_depths, "accuracy": grid})
    console.print(table)


def diagnose(
    model: str = MODEL,
    method: list[str] = typer.Option(["radar", "radar-exact", "radar-recent", "radar-random"], "--method", "-m",
                                     help="NAME[:key=value,...]; repeat for several methods"),
    budget: int | None = typer.Option(512, help="past KV tokens per decode step for every method (recall and error depend on it)"),
    text: str = typer.Option("paradise-lost", help="a text name or a file"),
    prefill: int = typer.Option(2048),
    steps: int = typer.Option(16, help=f"decode steps measured ({QUICK})"),
    picture_heads: list[int] = typer.Option([0, 4, 8], "--head", help="query heads drawn in the appendix picture"),
    picture_layer: int = typer.Option(0, help="layer drawn in the appendix picture"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Per layer and head: top-1/top-3 segment hit rate vs exact segment attention, mass recall, output error."""
    from sparseattn.evaluation.diagnose import Probe, summarize_probes
    from sparseattn.evaluation.plots import attention_pictures
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import apply

    resolved = [parse_method(spec, budget) for spec in method]
    hf_model, tokenizer = _load(model, dtype)
    ids = tokenize_ids(tokenizer, _text(text), prefill + steps, text)
    table = Table(title=f"diagnostics on {text}, prefill {prefill}, {steps} steps (dense trajectory)")
    for column in ("method", "hit@1", "hit@3", "mass recall", "rel. error", "attended", "segments"):
        table.add_column(column, justify="right")
    for label, sparse_method, given in resolved:
        config = {"command": "diagnose", "model": model, "text": text, "prefill": prefill, "steps": steps, "dtype": dtype,
                  "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        run = RunDir(out / f"diagnose-{_slug(text)}-p{prefill}-s{steps}" / _slug(label), config)
        if not run.finished:
            probe = Probe(sparse_method, pictures=True)
            with apply(hf_model, probe) as sparse, torch.no_grad():
                cache = sparse.new_cache()
                hf_model(ids[None, :prefill], past_key_values=cache, use_cache=True)
                for i in range(steps):
                    hf_model(ids[None, prefill + i : prefill + i + 1], past_key_values=cache, use_cache=True)
            states = [layer.state for layer in cache.sparse_layers]
            summary = {**config, **summarize_probes(states)}
            pictures = states[picture_layer].records.pictures if picture_layer < len(states) else []
            if pictures:
                heads = [h for h in picture_heads if h < pictures[0][0].shape[0]]
                attention_pictures(pictures, heads, run.path / "attention.png", f"{label}, layer {picture_layer}")
            run.finish(summary)
        summary = run.summary()
        o = summary["overall"]
        segments = sum(r["mean_segments"] for r in summary["per_layer"]) / max(1, len(summary["per_layer"]))
        table.add_row(label, *(f"{100 * o[k]:.1f}%" for k in ("hit@1", "hit@3", "recall")), f"{o['rel_error']:.3f}",
                      f"{o['attended']:.0f}", f"{segments:.0f}")
    console.print(table)
    console.print("paper (Llama-3, 10 segments): Radar 34.38% / 62.5%, recency 18.75% / 46.88%, random 10% / 30%")


def tokenize_ids(tokenizer, text: str, n: int, name: str) -> torch.Tensor:
    from sparseattn.evaluation.ppl import tokenize

    return tokenize(tokenizer, text, n, name=name)


def sweep(
    model: str = MODEL,
    text: str = typer.Option("pydecimal", help="a text name or a file"),
    prefill: int = typer.Option(2048),
    steps: int = typer.Option(128, help=f"decode steps per run ({QUICK})"),
    n_features: list[int] = typer.Option([64, 256, 1024, 2048], "--n", help="random feature counts n (k fixed)"),
    top_k: list[int] = typer.Option([2, 4, 8, 16], "--k", help="segments k (n fixed)"),
    fixed_n: int = typer.Option(2048, help="n while sweeping k"),
    fixed_k: int = typer.Option(8, help="k while sweeping n and in the ablation"),
    window: int = typer.Option(0, help="recent window for every Radar run"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """The paper's n and k sweeps and the selection ablation (lowest / random / recent / approximate / exact)."""
    from sparseattn.evaluation.plots import sweep_figure
    from sparseattn.evaluation.ppl import run_ppl, tokenize
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model, tokenizer = _load(model, dtype)
    ids = tokenize(tokenizer, _text(text), prefill + steps + 1, name=text)
    root = out / f"sweep-{_slug(text)}-p{prefill}-s{steps}"

    def measure(spec: str) -> float:
        label, sparse_method, given = parse_method(spec)
        config = {"command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps, "dtype": dtype,
                  "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        return run_ppl(hf_model, sparse_method, ids, prefill, steps, RunDir(root / _slug(label), config), label=label)["ppl"]

    dense = measure("dense")
    panels = {
        "n (random features)": [(n, measure(f"radar:n_features={n},top_k={fixed_k},window={window}")) for n in n_features],
        "k (segments)": [(k, measure(f"radar:n_features={fixed_n},top_k={k},window={window}")) for k in top_k],
        "selection": [
            (name, measure(f"{spec}:top_k={fixed_k},window={window}"))
            for name, spec in (("lowest", "radar-lowest"), ("random", "radar-random"), ("recent", "radar-recent"),
                               ("radar", "radar"), ("exact", "radar-exact"))
        ],
    }
    write_json(root / "sweep.json", {"dense": dense, "panels": {k: [list(p) for p in v] for k, v in panels.items()}})
    sweep_figure(panels, root / "sweep.png", f"{text}: prefill {prefill}, {steps} steps", reference=dense)
    table = Table(title=f"sweep on {text} (dense ppl {dense:.3f})")
    for column in ("panel", "value", "ppl"):
        table.add_column(column)
    for name, points in panels.items():
        for value, metric in points:
            table.add_row(name, str(value), f"{metric:.3f}")
    console.print(table)
    console.print(f"wrote {root / 'sweep.png'} and {root / 'sweep.json'}")


def longbench_run(
    data_dir: Path = typer.Option(..., help="directory of LongBench v1 {task}.jsonl files (local; nothing is downloaded)"),
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: list[str] = typer.Option(None, "--task", help="tasks to run (default: every {task}.jsonl present)"),
    max_length: int = typer.Option(7500, help="middle-truncate prompts to this many tokens (the model's window minus room)"),
    limit: int | None = typer.Option(None, help="first N examples per task (quick runs)"),
    chat: bool = typer.Option(True, help="chat template (except the tasks LongBench runs without one)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """LongBench v1 predictions under each method (pred.py's protocol), then scored with the official metrics."""
    from sparseattn.evaluation import longbench as lb
    from sparseattn.evaluation.generation import run_longbench
    from sparseattn.evaluation.runs import RunDir, write_json

    tasks = task or [t for t in lb.TASKS if (data_dir / f"{t}.jsonl").exists()]
    if not tasks:
        raise typer.BadParameter(f"no LongBench task files ({', '.join(lb.TASKS)}.jsonl) in {data_dir}", param_hint="--data-dir")
    resolved = [parse_method(spec, budget) for spec in method]
    hf_model, tokenizer = _load(model, dtype)
    for label, sparse_method, given in resolved:
        # The tasks and --limit say how much of the experiment to run, not which one: more of either extends it.
        config = {"command": "longbench", "model": model, "data_dir": str(data_dir), "max_length": max_length,
                  "chat": chat, "dtype": dtype, "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        run = RunDir(out / "longbench" / _slug(label), config)
        run_longbench(hf_model, tokenizer, sparse_method, data_dir, tasks, max_length, run, limit=limit, chat=chat)
        result = lb.score_directory(run.path)
        write_json(run.path / "result.json", {**result, "limit": limit})
        console.print(f"{label}: {json.dumps(result.get('scores', result))}")
