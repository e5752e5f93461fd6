"""Decode speed with quality inside vLLM: ``sparseattn serving-bench``, its JSON written under benchmarks/results.

The comparison a user would make (docs/serving.md, "Measured"): 8 distinct 8000-token prompts decoded
together, stock vLLM in bfloat16 (its attention on the CPU's best ISA) as the reference, stock float32
as a labelled extra, the plugin's dense path beside radar+adaptive (what ``sparseattn serve`` runs), radar+ and
quest at budget 1024, 64 timed steps,
3 alternating rounds, a shared-prefix workload as a labelled extra row, and quality at the same
configuration. Every option of ``sparseattn serving-bench --help`` is taken, e.g.

    .venv-vllm/bin/python benchmarks/serving.py                       # the defaults: about 25 minutes on 2 cores
    .venv-vllm/bin/python benchmarks/serving.py --batch 4 --no-float32 --no-shared

Writes ``benchmarks/results/serving-cpu-c<context>-b<batch>[-<cpu kind>].json`` unless ``--out`` is given, and
vLLM's own output beside it (``.vllm.log``; ``--verbose`` shows it on the terminal instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sparseattn.cli import app
from sparseattn.machine import cpu_model

REPO = Path(__file__).resolve().parents[1]


def default_out(argv: list[str]) -> Path:
    """``benchmarks/results/serving-cpu-c<context>-b<batch>-<isa>.json`` (the ISA: amx, avx512 or avx2)."""

    def value(flag: str, default: str) -> str:
        for i, word in enumerate(argv):
            if word == flag and i + 1 < len(argv):
                return argv[i + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
        return default

    isa = cpu_model()["isa"]
    kind = "amx" if any(f.startswith("amx") for f in isa) else "avx512" if any(f.startswith("avx512") for f in isa) else "avx2"
    batch = value("--batch", value("-b", "8"))
    return REPO / "benchmarks" / "results" / f"serving-cpu-c{value('--context', '8000')}-b{batch}-{kind}.json"


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
        argv += ["--out", str(default_out(argv))]
    app(["serving-bench", *argv])
