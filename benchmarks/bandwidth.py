"""The machine's read bandwidth: the floor every memory-bound figure here is held to (:mod:`sparseattn.bandwidth`).

Reads a buffer of ``--mib`` MiB (far above the last-level cache) in order and in scattered chunks of the sizes a
paged decode step reads (a page's keys and values, its keys, a segment's values, a centroid row), on 1 and 2
threads, each ``--repeats`` times; prints median and best GB/s and writes JSON
(``benchmarks/results/bandwidth-<cpu kind>.json``). ``sparseattn serving-bench`` measures the same before its
engines start and records it in its JSON; ``benchmarks/paged_kernel.py --profile`` holds each phase to the
one-thread 4 KiB figure.

    python benchmarks/bandwidth.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sparseattn.bandwidth import CHUNKS, machine_bandwidth
from sparseattn.machine import cpu_model

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="the buffer read (MiB; well above the last-level cache)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for option, value in (("--mib", args.mib), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{option}: {value} is out of range; allowed: >= 1")
    rows = machine_bandwidth((1, 2), CHUNKS, args.mib, args.repeats)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"read bandwidth, GB/s (median, best of {args.repeats}; {args.mib} MiB)")
    for col in ("threads", "chunk", "median", "best"):
        table.add_column(col, justify="right")
    for row in rows:
        chunk = "sequential" if row["chunk"] is None else f"{row['chunk']} B scattered"
        table.add_row(str(row["threads"]), chunk, f"{row['median_gbps']:.1f}", f"{row['best_gbps']:.1f}")
    Console().print(table)
    machine = cpu_model()
    kind = "amx" if any(f.startswith("amx") for f in machine["isa"]) else "avx512" if any(f.startswith("avx512") for f in machine["isa"]) else "avx2"
    out = args.out or REPO / "benchmarks" / "results" / f"bandwidth-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "args": {"mib": args.mib, "repeats": args.repeats}, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
