"""Where the merged rest helps: radar+pooled with ``MergedRest`` in some layers only (issue 17, docs/methods.md).

Each variant is ``SplitLayers`` of radar+pooled and radar+merged at budget 512; the gap ratio is read
against the dense and StreamingLLM runs that ``benchmarks/quality.py`` left for the same texts (their
first ``--steps`` records: teacher-forced, so a shorter run is a prefix of a longer one). Resumable:
each variant keeps a run directory under ``--runs``.

    python benchmarks/merged_layers.py --texts dev --steps 512 --variants all:128 first1:128 first1:0 after1:128
    python benchmarks/merged_layers.py --texts six --steps 1024 --variants first1:0 all:0
    python benchmarks/merged_layers.py --texts dev --steps 512 --variants after1:128x4

A variant is ``WHERE:MERGE``: ``all`` (every layer), ``firstN`` (the first N layers only) or ``afterN``
(every layer but the first N), with blocks of MERGE segments (0: the whole rest as one token).
``afterN:MERGExF`` also gives the first N layers F times the budget and the others what is left
(``FirstLayers`` over the ``SplitLayers``; the total over the layers is unchanged).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import torch

from sparseattn.data.sources import load_text
from sparseattn.evaluation.ppl import run_ppl_together, tokenize
from sparseattn.evaluation.runs import RunDir
from sparseattn.hf import load_model
from sparseattn.methods.layers import FirstLayers, SplitLayers
from sparseattn.methods.radar_plus import RadarPlusMerged, RadarPlusPooled

RESULTS = Path(__file__).parent / "results"
#: The text sets and the quality.py run directories whose dense and StreamingLLM runs they reuse.
SETS = {
    "dev": (["macbeth", "othello", "pydecimal", "inspect"], 2, "macbeth+othello+pydecimal+inspect-p4096-s512"),
    "six": (["kjv-bible", "hamlet", "areopagitica", "typing", "tarfile", "argparse"], 3,
            "kjv-bible+hamlet+areopagitica+typing+tarfile+argparse-p4096-s1024"),
}  # fmt: skip
BUDGET, PREFILL = 512, 4096


def variant(spec: str):
    """``WHERE:MERGE[xFACTOR]`` as a method (a ValueError naming the spec and what is allowed otherwise)."""
    match = re.fullmatch(r"(all|first(\d+)|after(\d+)):(\d+)(?:x(\d+(?:\.\d+)?))?", spec)
    if not match or (match[5] is not None and (match[3] is None or float(match[5]) < 1)):
        raise ValueError(f"--variants {spec!r}: expected WHERE:MERGE with WHERE all, firstN or afterN and MERGE >= 0, "
                         "and xFACTOR >= 1 only after afterN")  # fmt: skip
    merged, plain = RadarPlusMerged(budget=BUDGET, merge=int(match[4])), RadarPlusPooled(budget=BUDGET)
    if match[1] == "all":
        return merged
    if match[2] is not None:
        return SplitLayers(merged, plain, layers=int(match[2]))
    split = SplitLayers(plain, merged, layers=int(match[3]))
    return split if match[5] is None else FirstLayers(split, layers=int(match[3]), factor=float(match[5]))


def ppls(records: list[dict], rows: int, steps: int) -> list[float]:
    return [math.exp(sum(r["nlls"][i] for r in records[:steps]) / steps) for i in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", choices=sorted(SETS), default="dev")
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--variants", nargs="+", default=["after1:128"])
    parser.add_argument("--runs", type=Path, default=RESULTS / "merged-layers-runs")
    args = parser.parse_args()
    texts, n_prose, reference = SETS[args.texts]
    reference = RESULTS / "quality-runs" / reference
    try:
        methods = {spec: variant(spec) for spec in args.variants}
    except ValueError as error:
        parser.error(str(error))
    files = [reference / name / "tokens.jsonl" for name in ("dense", f"streamingllm-b{BUDGET}")]
    if not all(f.exists() for f in files):
        kinds = " ".join(f"--{'prose' if i < n_prose else 'code'} {t}" for i, t in enumerate(texts))
        parser.error(f"no dense and StreamingLLM runs in {reference}: make them first with "
                     f"`python benchmarks/quality.py {kinds} --steps {reference.name.rsplit('-s', 1)[1]} --budgets {BUDGET} "
                     "--methods streamingllm`")  # fmt: skip
    base = [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]
    if any(len(records) < args.steps for records in base) or args.steps < 1:
        parser.error(f"--steps {args.steps}: the reference runs in {reference} hold {min(map(len, base))} steps")
    model, tokenizer = load_model("default")
    ids = torch.stack([tokenize(tokenizer, load_text(t), PREFILL + args.steps + 1, name=t) for t in texts])
    where = args.runs / f"{args.texts}-s{args.steps}"
    runs = {spec: (m, RunDir(where / spec.replace(":", "-m"), {"variant": spec, "texts": texts, "steps": args.steps}))
            for spec, m in methods.items()}  # fmt: skip
    run_ppl_together(model, runs, ids, PREFILL, args.steps)
    dense, stream = (ppls(records, len(texts), args.steps) for records in base)
    out = {}
    print(f"{'variant':<14}" + "".join(f"{t:>14}" for t in texts) + "   prose mean (worst)   code mean (worst)")
    for spec, (_, run) in runs.items():
        mine = ppls(run.records("tokens.jsonl"), len(texts), args.steps)
        gaps = [(p - d) / (s - d) for p, d, s in zip(mine, dense, stream)]
        prose, code = gaps[:n_prose], gaps[n_prose:]
        out[spec] = dict(zip(texts, gaps))
        print(f"{spec:<14}" + "".join(f"{g:>14.3f}" for g in gaps)
              + f"   {sum(prose) / len(prose):.3f} ({max(prose):.3f})      {sum(code) / len(code):.3f} ({max(code):.3f})")  # fmt: skip
    path = RESULTS / f"merged-layers-{args.texts}-s{args.steps}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **out}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
