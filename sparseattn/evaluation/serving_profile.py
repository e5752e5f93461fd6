"""Where a decode step's time goes in the plugin's engine: a worker's profile per step, and its table.

The plugin's workers time each part of a decode step when asked
(:meth:`sparseattn.vllm.switch.MethodSwitch.sparseattn_profile`); the serving benchmark profiles a 1-token
run and a run of ``steps + 1`` tokens and takes the difference (:func:`profile_difference`), so that what is
left is the decode steps' (:func:`step_profile`), shown beside the step's measured time (:func:`profile_table`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def profile_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Worker profile ``a`` less ``b`` (steps, calls and every part's ns and bytes; a part ``b`` lacks counts 0)."""
    parts = {}
    for name, v in a["parts"].items():
        w = b["parts"].get(name, {"ns": 0.0, "bytes": 0.0})
        parts[name] = {"ns": v["ns"] - w["ns"], "bytes": v["bytes"] - w["bytes"]}
    return {"steps": a["steps"] - b["steps"], "calls": a["calls"] - b["calls"], "parts": parts}


#: Profile parts a decode step's time does not include (see :func:`step_profile`).
NOT_IN_STEP = ("prefill in mixed steps",)


def step_profile(timed: Mapping[str, Any], ms_step: float, steps: int | None = None) -> dict[str, Any]:
    """A worker's profile (:meth:`sparseattn.vllm.switch.MethodSwitch.sparseattn_profile`) per decode step, beside the
    step's measured time ``ms_step``: ``parts`` (each C phase, the plan, the glue, the layers' own Python: ``ms`` per
    step and ``mb`` read per step) and ``other``, what the step spends outside attention (the model's other work,
    vLLM's scheduling and sampling): ``ms_step`` less every part.

    ``steps``: what to divide by (default: the profile's own count of decode steps).

    >>> p = step_profile({"steps": 2, "calls": 60, "parts": {"score": {"ns": 4e6, "bytes": 2e6}, "plan": {"ns": 2e5, "bytes": 0}}}, 10.0)
    >>> [(x["part"], x["ms"]) for x in p["parts"]], p["other_ms"]
    ([('score', 2.0), ('plan', 0.1)], 7.9)
    """
    steps = max(int(timed.get("steps", 0) if steps is None else steps), 1)
    parts = [{"part": name, "ms": v["ns"] / steps / 1e6, "mb": v["bytes"] / steps / 1e6} for name, v in timed["parts"].items()]
    # A mixed step's prefill (the long run's last pages, prefilled beside other rows' decoding) is work the 1-token run
    # does too, as a pure prefill step the profile does not see: the step time (a difference of the two runs) has it
    # taken out, so it is shown but not counted against the step.
    spent = sum(p["ms"] for p in parts if p["part"] not in NOT_IN_STEP)
    return {"steps": timed.get("steps", 0), "layer_calls": timed.get("calls", 0), "ms_step": ms_step, "parts": parts,
            "other_ms": round(ms_step - spent, 6)}  # fmt: skip


def profile_table(rows: Sequence[Mapping[str, Any]], bandwidth_gbps: float | None = None):
    """Where each profiled run's decode step goes: one rich table, a column per run, a row per part (ms per step)."""
    from rich.table import Table

    from sparseattn.vllm.profile import PHASE_WHAT

    profiled = [r for r in rows if r.get("profile")]
    result = Table(title="where a decode step goes (ms per step; the parts' MB and GB/s in brackets)" +
                   (f"; read bandwidth {bandwidth_gbps:.1f} GB/s (1 thread, 4 KiB chunks)" if bandwidth_gbps else ""))  # fmt: skip
    result.add_column("part")
    for r in profiled:
        result.add_column(r["run"], justify="right")
    result.add_column("what")
    names = list(dict.fromkeys(p["part"] for r in profiled for p in r["profile"]["parts"]))
    for name in names:
        cells = []
        for r in profiled:
            part = next((p for p in r["profile"]["parts"] if p["part"] == name), None)
            if part is None:
                cells.append("-")
            elif part["mb"]:
                cells.append(f"{part['ms']:.2f} ({part['mb']:.0f} MB, {part['mb'] / max(part['ms'], 1e-9):.1f} GB/s)")
            else:
                cells.append(f"{part['ms']:.2f}")
        result.add_row(name + (" (not in the step)" if name in NOT_IN_STEP else ""), *cells, PHASE_WHAT.get(name, ""))
    result.add_row("other", *[f"{r['profile']['other_ms']:.2f}" for r in profiled], "the rest of the step: the model's other layers, vLLM's scheduling and sampling")
    result.add_row("step", *[f"{r['profile']['ms_step']:.2f}" for r in profiled], "the profiled measurement's time per step")
    return result
