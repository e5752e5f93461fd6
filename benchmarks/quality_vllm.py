"""Perplexity through vLLM on prose and code texts, as ``benchmarks/quality.py`` measures it in transformers.

The same texts, tokens, prefill and steps as ``benchmarks/quality.py`` (its tokenisation), decoded by one
vLLM engine whose decode attention is the sparseattn plugin's paged engine, teacher-forced
(:func:`sparseattn.evaluation.vllm_ppl.run_ppl_vllm`: one request per text and method, the prompt
prefilled once per text and found in the prefix cache by every method). Gap ratio as there:
``(ppl - dense) / (ppl(StreamingLLM) - dense)`` at the same budget, StreamingLLM and dense run through
vLLM too. With ``--against`` (a ``benchmarks/quality.py`` JSON of the same texts, prefill and steps) the
table puts each method's transformers gap ratio beside its vLLM one.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/quality_vllm.py --prose king-lear --code doctest \\
        --methods radar+ radar+adaptive --budget 512 --block-size 16 \\
        --against benchmarks/results/quality-unseen6-p4096-s256-b512-transformers.json

Resumable: each (text, method) run directory lives under ``--runs``; a finished one is skipped. Writes
``benchmarks/results/quality-vllm-<texts>-p<prefill>-s<steps>-b<budget>-bs<block>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quality import check_texts  # benchmarks/quality.py, beside this script

from sparseattn import registry
from sparseattn.data.sources import load_text
from sparseattn.evaluation.ppl import tokenize
from sparseattn.evaluation.runs import RunDir, environment
from sparseattn.hf.models import local_model_dir
from sparseattn.vllm.paged import PagedPolicy

RESULTS = Path(__file__).parent / "results"


def plugin_config(spec: str, budget: int, segment: int | None = None) -> dict:
    """``additional_config["sparseattn"]`` of a spec (``name:key=value,...``) at ``budget`` (with the paged engine's
    ``segment``, tokens per segment inside a page), checked by the paged engine."""
    parsed = registry.parse(spec, None if spec.partition(":")[0] == "dense" else budget)
    PagedPolicy(parsed.method, spec, segment)  # refused here, with the reason, before an engine starts
    name, _, rest = spec.partition(":")
    config = {"method": name, **({} if name == "dense" else {"budget": budget}), **({} if segment is None else {"segment": segment})}
    for pair in filter(None, rest.split(",")):
        key, _, value = pair.partition("=")
        config[key] = value
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prose", action="append", required=True, help="a prose text (repeatable)")
    parser.add_argument("--code", action="append", required=True, help="a code text (repeatable)")
    parser.add_argument("--methods", nargs="+", default=["radar+"], help="method specs NAME[:key=value,...]")
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's page size: the paged engine's segment")
    parser.add_argument("--segment", type=int, default=None, help="tokens per segment inside a page for --methods (a divisor "
                        "of --block-size; default: the page)")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--against", type=Path, default=None, help="benchmarks/quality.py's JSON of the same texts")
    parser.add_argument("--runs", type=Path, default=RESULTS / "quality-vllm-runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    check_texts(parser, args)
    if args.block_size < 32 or args.block_size % 32:
        parser.error(f"--block-size: {args.block_size} is not allowed; allowed: a multiple of 32 (vLLM's CPU attention backend)")
    if args.segment is not None and (args.segment < 1 or args.block_size % args.segment):
        parser.error(f"--segment: {args.segment} is not allowed; allowed: a divisor of --block-size {args.block_size}")
    specs = list(dict.fromkeys(["dense", "streamingllm", *args.methods]))
    try:
        configs = {spec: plugin_config(spec, args.budget, args.segment if spec in args.methods else None) for spec in specs}
    except ValueError as error:
        parser.error(f"--methods: {error}")
    against = json.loads(args.against.read_text()) if args.against else None
    texts = [*args.prose, *args.code]
    if against and (against["prefill"], against["steps"]) != (args.prefill, args.steps):
        parser.error(f"--against {args.against}: prefill {against['prefill']}, {against['steps']} steps; this run: {args.prefill}, {args.steps}")

    from transformers import AutoTokenizer

    from sparseattn.evaluation.vllm_engine import start_engine, stop_engine
    from sparseattn.evaluation.vllm_ppl import run_ppl_vllm

    model = str(local_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model)
    n = args.prefill + args.steps + 1
    ids = {t: tokenize(tokenizer, load_text(t), n, name=t).tolist() for t in texts}
    where = args.runs / f"p{args.prefill}-s{args.steps}-b{args.budget}-bs{args.block_size}"
    seg = "" if args.segment is None else f"-seg{args.segment}"
    llm = None
    ppl: dict[str, dict[str, float]] = {spec: {} for spec in specs}
    try:
        for text in texts:
            runs = {}
            for spec, config in configs.items():
                run_config = {"command": "quality_vllm", "text": text, "prefill": args.prefill, "steps": args.steps,
                              "block_size": args.block_size, "method": spec, "config": config}  # fmt: skip
                label = spec.replace(":", "_") + (seg if spec in args.methods else "")
                runs[spec] = (config, RunDir(where / text / label, run_config))
            if llm is None and not all(run.finished for _, run in runs.values()):
                llm = start_engine(model, dtype="float32", kv_cache_gib=args.kv_cache_gib, max_model_len=n,
                                   block_size=args.block_size, method=configs["dense"], enforce_eager=True)  # fmt: skip
            summaries = run_ppl_vllm(model, runs, ids[text], args.prefill, args.steps, block_size=args.block_size, llm=llm)
            for spec, summary in summaries.items():
                ppl[spec][text] = summary["ppl"]
                if summary.get("fallback_layer_steps"):
                    print(f"warning: {spec} on {text}: {summary['fallback_layer_steps']} layer-steps fell back to vLLM's dense kernel")
            print(text, {spec: round(ppl[spec][text], 3) for spec in specs}, flush=True)
    finally:
        if llm is not None:
            stop_engine(llm)

    def gap(table: dict[str, dict[str, float]], spec: str, text: str) -> float | None:
        dense, stream = table["dense"][text], table["streamingllm"][text]
        return None if stream == dense else (table[spec][text] - dense) / (stream - dense)

    theirs = None
    if against:  # the transformers rows, by spec: quality.py labels them "<spec>@<budget>"
        theirs = {"dense": against["rows"][0]["ppl"]}
        for row in against["rows"][1:]:
            spec, _, budget = row["method"].rpartition("@")
            if int(budget) == args.budget:
                theirs[spec] = row["ppl"]
    rows = []
    print(f"\nvLLM (float32, {args.block_size}-token pages" + ("" if args.segment is None else f", {args.segment}-token segments")
          + f"), prefill {args.prefill}, {args.steps} steps, budget {args.budget}; "
          f"gap ratio = (ppl - dense) / (StreamingLLM's ppl - dense)" + ("; [transformers]" if theirs else ""))
    print(f"{'method':<44}" + "".join(f"{t:>24}" for t in texts))
    for spec in specs:
        cells, row = "", {"method": spec, "ppl": ppl[spec], "gap_ratio": {}, "transformers_gap_ratio": {}}
        for t in texts:
            mine = gap(ppl, spec, t) if spec != "dense" else None
            other = gap(theirs, spec, t) if theirs and spec in theirs and spec != "dense" and t in theirs[spec] else None
            row["gap_ratio"][t], row["transformers_gap_ratio"][t] = mine, other
            cell = f"{ppl[spec][t]:.3f}" + ("" if mine is None else f" {mine:.2f}") + ("" if other is None else f" [{other:.2f}]")
            cells += f"{cell:>24}"
        print(f"{spec:<44}{cells}")
        for kind in ("prose", "code"):
            gaps = [row["gap_ratio"][t] for t in getattr(args, kind) if row["gap_ratio"][t] is not None]
            other = [row["transformers_gap_ratio"][t] for t in getattr(args, kind) if row["transformers_gap_ratio"][t] is not None]
            if gaps:
                row.setdefault("summary", {})[kind] = {"mean": sum(gaps) / len(gaps), "worst": max(gaps),
                                                       **({"transformers_mean": sum(other) / len(other),
                                                           "transformers_worst": max(other)} if other else {})}  # fmt: skip
        rows.append(row)
    print("\ngap ratio over the texts of each kind: mean (worst) in vLLM [transformers]")
    for row in rows[1:]:
        cells = ""
        for kind, s in row.get("summary", {}).items():
            cells += f"   {kind} {s['mean']:.3f} ({s['worst']:.3f})"
            if "transformers_mean" in s:
                cells += f" [{s['transformers_mean']:.3f} ({s['transformers_worst']:.3f})]"
        print(f"{row['method']:<44}{cells}")
    out = args.out or RESULTS / f"quality-vllm-{'-'.join(texts)}-p{args.prefill}-s{args.steps}-b{args.budget}-bs{args.block_size}{seg}.json"
    out.write_text(json.dumps({"environment": environment(), "engine": "vllm", "dtype": "float32", "block_size": args.block_size,
                               "segment": args.segment,
                               "texts": texts, "prose": args.prose, "code": args.code, "prefill": args.prefill,
                               "steps": args.steps, "budget": args.budget, "against": str(args.against) if args.against else None,
                               "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
