"""``sparseattn diagnose``: how well each method's selection matches exact attention, per layer and head."""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from rich.table import Table

from sparseattn.cli.checks import check_decoding, check_range
from sparseattn.cli.consoles import console
from sparseattn.cli.inputs import inspect_model, text_tokens
from sparseattn.cli.method_specs import parse_methods
from sparseattn.cli.options import DTYPE, MODEL, OUT, QUICK
from sparseattn.cli.outputs import check_out, plan_runs, run_name, slug, wrote
from sparseattn.progress import forward_progress, progress


def diagnose(
    model: str = MODEL,
    # The ablations swap one part of Algorithm 1 (radar-alg1): the default compares them with it, on one grid.
    method: list[str] = typer.Option(["radar-alg1", "radar-exact", "radar-recent", "radar-random"], "--method", "-m",
                                     help="NAME[:key=value,...]; repeat for several methods"),
    budget: int | None = typer.Option(
        512, help="past KV tokens per decode step (>= 1) for every method with a budget whose spec sets neither budget "
        "nor top_k (recall and error depend on it)"
    ),
    text: str = typer.Option("paradise-lost", help="a text name or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled (>= 1)"),
    steps: int = typer.Option(16, help=f"decode steps measured (>= 1; {QUICK})"),
    picture_heads: list[int] = typer.Option([0, 4, 8], "--head", help="query heads drawn in the appendix picture"),
    picture_layer: int = typer.Option(0, help="layer drawn in the appendix picture"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Per layer and head: top-1/top-3 segment hit rate vs exact segment attention, mass recall (and the exact pooled
    oracle's at the same budget: benchmarks/selection_gap.py splits the difference), output error."""
    torch_dtype = check_decoding(dtype, prefill, steps, min_prefill=1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    layers = getattr(info.config, "num_hidden_layers", None)
    heads = getattr(info.config, "num_attention_heads", None)
    check_range("--picture-layer", picture_layer, 0, None if layers is None else layers - 1)
    for head in picture_heads:
        check_range("--head", head, 0, None if heads is None else heads - 1)
    ids = text_tokens(info, text, prefill, steps)
    root = out / run_name("diagnose", dtype, slug(text), f"p{prefill}", f"s{steps}")
    runs = plan_runs(root, resolved, {"command": "diagnose", "model": model, "text": text, "prefill": prefill,
                                      "steps": steps, "dtype": dtype})  # fmt: skip

    from sparseattn.evaluation.diagnose import Probe, summarize_probes
    from sparseattn.evaluation.plots import attention_pictures
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import apply, cache_kwargs

    hf_model = info.load(torch_dtype)
    table = Table(title=f"diagnostics on {text}, prefill {prefill}, {steps} steps (dense trajectory)")
    for column in ("method", "hit@1", "hit@3", "mass recall", "pooled oracle's", "rel. error", "attended", "segments"):
        table.add_column(column, justify="right")
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        if not run.finished:
            probe = Probe(sparse_method, pictures=True)
            with apply(hf_model, probe) as sparse, torch.no_grad():
                cache = sparse.new_cache()
                with forward_progress(hf_model, f"{label}: prefill {prefill} tokens"):
                    hf_model(ids[None, :prefill], **cache_kwargs(hf_model, cache), use_cache=True)
                with progress(f"{label}: decode with exact attention beside", total=steps, unit="steps") as bar:
                    for i in range(steps):
                        hf_model(ids[None, prefill + i : prefill + i + 1], **cache_kwargs(hf_model, cache), use_cache=True)
                        bar.advance()
            states = [layer.state for layer in cache.sparse_layers]
            summary = {**config, **summarize_probes(states)}
            pictures = states[picture_layer].records.pictures if picture_layer < len(states) else []
            if pictures:
                shown = [h for h in picture_heads if h < pictures[0][0].shape[0]]
                attention_pictures(pictures, shown, run.path / "attention.png", f"{label}, layer {picture_layer}")
            run.finish(summary)
        summary = run.summary()
        o = summary["overall"]
        segments = sum(r["mean_segments"] for r in summary["per_layer"]) / max(1, len(summary["per_layer"]))
        table.add_row(label, *(f"{100 * o[k]:.1f}%" for k in ("hit@1", "hit@3", "recall", "kept:pooled")), f"{o['rel_error']:.3f}",
                      f"{o['attended']:.0f}", f"{segments:.0f}")
        dirs.append(run.path)
    console.print(table)
    console.print("paper (Llama-3, 10 segments): Radar 34.38% / 62.5%, recency 18.75% / 46.88%, random 10% / 30%")
    wrote(dirs, "config.json, summary.json, attention.png (segment methods) in each")
