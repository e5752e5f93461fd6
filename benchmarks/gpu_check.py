"""The prepared GPU check: every kernel test compiled on the GPU, the method contract on CUDA, one layer's
decode step, and ``model.generate`` end to end, in one run of a few minutes (scripts/gpu-check.sh).

Steps, in order, each in its own process with its own time limit, each written to ``--out`` as it
finishes (a later step's failure, a crash or the run's time limit loses nothing before it):

``kernels``
    ``tests/test_triton_ops.py`` (every Triton kernel against its float64 reference, plus the ``gpu``
    cases: head dims 64/128, bf16/fp16, 131072 tokens) and the compiled split kernel's GPU cases of
    ``tests/test_backends.py``, with ``TRITON_INTERPRET=0``.
``contract``
    ``tests/test_contract_device.py -m gpu``: every registered method at full budget equals dense
    attention (float64 reference), budgets honoured, beam reindexing, with its states on CUDA
    (``sparseattn.testing.check_method(name, device="cuda")``); and ``tests/test_static_loop.py -m gpu``: the
    fixed-shape loop captured as CUDA graphs gives the eager loop's tokens (radar+, the preset, Quest, dense), its
    step on the compiled Triton kernels equals the state's own step.
``attention``
    ``benchmarks/attention.py`` on CUDA: Llama-3-8B heads (32 query / 8 KV, d = 128), bfloat16, t = 32k
    and 128k, batch 1 and 8: dense (torch SDPA), dense (the Triton kernel), radar, radar+, quest at a
    budget of 4096 tokens: ms/step (eager, and replayed as a CUDA graph), speedup, kernels per step,
    bytes read and fraction of the bandwidth floor (bandwidth measured in the same run).
``generate``
    ``benchmarks/e2e_generate.py``: a random-weight Llama-3.1-8B-shaped model in bfloat16, 32k and
    128k tokens, batch 1 and 4 where memory allows: dense vs radar+ vs quest tokens/s and peak memory.
``loop``
    ``benchmarks/loop.py``: the same model through the fixed-shape decode loop (``sparseattn.hf.loop.generate``),
    eager and captured as CUDA graphs, dense (the Triton kernel) vs radar+ vs quest at 32k and 128k, batch 1:
    ms per step graph against graph, and the captured loop's tokens against the eager loop's.

Then ``report.json`` and ``report.md``: each step's status and numbers, and the issue's targets, each
met or missed: one layer at 128k x batch 8, radar+ >= 8x SDPA's step and >= 50% of its own bandwidth
floor; end to end at 128k, batch 1, radar+ >= 1.8x dense tokens/s (with the byte model's ceiling
beside it); radar+'s step grows no faster than t^0.3 over 32k..128k; through the captured loop, radar+ >= 1.7x
dense at 128k x 1 and >= 1.3x at 32k x 1 (issue 48), its tokens those of the eager loop.

``--cpu`` runs the same steps at toy sizes on the CPU, the kernels in Triton's interpreter, so that
the check cannot rot before a GPU is lent (tests/test_gpu_check.py runs it in CI).

    python benchmarks/gpu_check.py --out "$OUT"                    # on a GPU machine
    python benchmarks/gpu_check.py --cpu --out /tmp/gpu-check      # the CPU check
    python benchmarks/gpu_check.py --steps attention generate ...  # some steps only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("kernels", "contract", "attention", "generate", "loop")

#: The rows of the attention step, by their names in benchmarks/attention.py (dense SDPA always runs).
ATTENTION_ROWS = ("radar (budget 4096)", "radar+ (budget 4096)", "quest (budget 4096)")
#: On the GPU also: per-head selections read as their union (issue 48) against a program per head, for radar+ and
#: the preset's layers 1-29, interleaved with the same dense baselines.
UNION_ROWS = (
    "radar+ (budget 4096, per head)", "radar+ (budget 4096, per head, a program per head)",
    "radar+adaptive (budget 4096, layers 1-29)", "radar+adaptive (budget 4096, layers 1-29, a program per head)",
)  # fmt: skip


#: The sparse rows of the loop step (dense always runs): issue 48's targets are radar+'s and the preset's.
LOOP_ROWS = ("radar+ (budget 4096)", "radar+adaptive (budget 4096)")


def step_commands(cpu: bool, out: Path) -> dict[str, tuple[list[str], dict[str, str], int]]:
    """Each step's command, environment and time limit (seconds): GPU sizes, or toy sizes for ``--cpu``."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    if cpu:
        kernel_env = {"TRITON_INTERPRET": "1"}
        kernels = [*pytest, "tests/test_triton_ops.py", "-m", "not slow and not gpu", "-k", "dense_kernel or bound_scores"]
        contract = [*pytest, "tests/test_contract_device.py", "-m", "not gpu"]
        attention = [py, "benchmarks/attention.py", "--device", "cpu", "--lengths", "8192", "12288", "--batches", "1",
                     "--repeats", "3", "--warmup", "1", "--methods", "dense (cpu kernel)", *ATTENTION_ROWS]  # fmt: skip
        generate = [py, "benchmarks/e2e_generate.py", "--device", "cpu", "--shape", "tiny", "--lengths", "300",
                    "--batches", "1", "--new-tokens", "4", "--budget", "64"]  # fmt: skip
        loop = [py, "benchmarks/loop.py", "--device", "cpu", "--shape", "tiny", "--lengths", "300", "--batches", "1",
                "--modes", "generate", "loop", "--rounds", "1", "--new-tokens", "8", "--budget", "64"]  # fmt: skip
        limits = (300, 300, 300, 300, 300)
    else:
        kernel_env = {"TRITON_INTERPRET": "0"}
        parallel = ["-n", "8"] if _has_xdist() else []  # compiling the kernels' variants dominates: spread it
        kernels = [*pytest, *parallel, "tests/test_triton_ops.py", "tests/test_backends.py::test_compiled_kernel_matches_reference_on_gpu",
                   "tests/test_backends.py::test_auto_picks_triton_on_gpu", "-m", "not slow"]  # fmt: skip
        # The method contract on CUDA, and the fixed-shape loop captured (tokens = the eager loop's; the Triton kernels
        # compiled, step for step against the state's own step; Quest's steps seal pages inside a graph).
        contract = [*pytest, *parallel, "tests/test_contract_device.py", "tests/test_static_loop.py", "-m", "gpu"]
        attention = [py, "benchmarks/attention.py", "--device", "cuda", "--dtype", "bfloat16", "--lengths", "32768", "131072",
                     "--batches", "1", "8", "--repeats", "30", "--warmup", "5", "--methods", "dense (triton kernel)",
                     "dense (triton kernel, 2 programs/SM)", *ATTENTION_ROWS, *UNION_ROWS]  # fmt: skip
        generate = [py, "benchmarks/e2e_generate.py", "--device", "cuda"]
        # The fixed-shape loop, eager and captured, dense, radar+ and the preset; each call prefills its own cache (12
        # prefills; Quest's rows are left to benchmarks/loop.py run alone).
        loop = [py, "benchmarks/loop.py", "--device", "cuda", "--lengths", "32768", "131008", "--batches", "1",
                "--modes", "loop", "graphs", "--rounds", "1", "--new-tokens", "32", "--methods", *LOOP_ROWS]  # fmt: skip
        limits = (120, 120, 120, 150, 180)
    attention += ["--out", str(out / "attention.json")]
    generate += ["--out", str(out / "generate.json")]
    loop += ["--out", str(out / "loop.json")]
    envs = (kernel_env, kernel_env, {}, {}, {})
    commands = (kernels, contract, attention, generate, loop)
    return {name: (cmd, env, limit) for name, cmd, env, limit in zip(STEPS, commands, envs, limits)}


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def run_step(name: str, command: list[str], env: dict[str, str], limit: int, out: Path) -> dict:
    """Run one step in its own process (a crash or a hung kernel cannot take the others with it); its log in ``out``."""
    log = out / f"{name}.log"
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1", **env}
    begin = time.time()
    with log.open("w") as sink:
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        try:
            done = subprocess.run(command, cwd=ROOT, env=environment, stdout=sink, stderr=subprocess.STDOUT, timeout=limit)
            status = "passed" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit} s"
    result = {"step": name, "status": status, "seconds": round(time.time() - begin, 1), "command": " ".join(command)}
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip()]
    result["tail"] = lines[-25:]
    if name in ("kernels", "contract"):
        summary = [line for line in lines if " passed" in line or " failed" in line or " error" in line]
        result["summary"] = summary[-1] if summary else None
        result["failures"] = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:40]
    return result


def machine(cpu: bool) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "mode": "cpu (toy sizes)" if cpu else "gpu"}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 1e9, 1), multiprocessors=props.multi_processor_count)
            info["cuda"] = torch.version.cuda
        import triton

        info["triton"] = triton.__version__
    except ImportError as error:
        info["import_error"] = str(error)
    return info


def _rows(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def _row(rows: list[dict], method: str, **where) -> dict | None:
    found = [r for r in rows if r.get("method") == method and all(r.get(k) == v for k, v in where.items())]
    return found[0] if found else None


def targets(out: Path, cpu: bool) -> list[dict]:
    """The issue's targets, each with its measured value and met / missed / not measured."""
    attention, generate = _rows(out / "attention.json"), _rows(out / "generate.json")
    long_t, short_t, big_batch = (12288, 8192, 1) if cpu else (131072, 32768, 8)
    verdicts = []
    plus = _row(attention, "radar+ (budget 4096)", t=long_t, batch=big_batch)
    if plus and plus.get("ms") == plus.get("ms") and "error" not in plus:
        speedup, floor = plus["speedup"], plus["fraction_of_floor"]
        graph = plus.get("graph_ms", float("nan"))
        graph_speedup = plus["dense_ms"] / graph if graph == graph else float("nan")
        verdicts.append({
            "target": f"one layer, t={long_t}, batch {big_batch}: radar+ (budget 4096) >= 8x torch SDPA's step",
            "value": f"{speedup:.2f}x eager, {graph_speedup:.2f}x as a CUDA graph ({plus['ms']:.3f} ms / {graph:.3f} ms vs {plus['dense_ms']:.3f} ms)",
            "met": speedup >= 8, "met_as_graph": graph_speedup >= 8,
        })  # fmt: skip
        graph_floor = plus["floor_ms"] / graph if graph == graph else float("nan")
        verdicts.append({
            "target": "... and >= 50% of its own bandwidth floor",
            "value": f"{floor:.2f} eager, {graph_floor:.2f} as a CUDA graph (floor {plus['floor_ms']:.3f} ms for {plus['bytes'] / 1e6:.0f} MB)",
            "met": floor >= 0.5, "met_as_graph": graph_floor >= 0.5,
        })  # fmt: skip
    else:
        verdicts.append({"target": "one layer radar+ >= 8x SDPA and >= 50% of floor", "value": "not measured", "met": None})
    for batch in sorted({1, big_batch}):
        a, b = _row(attention, "radar+ (budget 4096)", t=short_t, batch=batch), _row(attention, "radar+ (budget 4096)", t=long_t, batch=batch)
        if a and b and a["ms"] == a["ms"] and b["ms"] == b["ms"]:
            exponent = math.log(b["ms"] / a["ms"]) / math.log(long_t / short_t)
            verdicts.append({"target": f"radar+ step growth over {short_t}..{long_t}, batch {batch}: <= t^0.3",
                             "value": f"t^{exponent:.2f} ({a['ms']:.3f} -> {b['ms']:.3f} ms)", "met": exponent <= 0.3})  # fmt: skip
    long_ctx = max((r["context"] for r in generate), default=None)
    dense = _row(generate, "dense (transformers sdpa)", context=long_ctx, batch=1)
    plus = _row(generate, "radar+ (budget 4096)" if not cpu else "radar+ (budget 64)", context=long_ctx, batch=1)
    if dense and plus:
        verdicts.append({
            "target": f"end to end, {long_ctx} tokens, batch 1: radar+ >= 1.8x dense tokens/s",
            "value": f"{plus['speedup']:.2f}x ({plus['tokens_per_second']:.1f} vs {dense['tokens_per_second']:.1f} tok/s; "
                     f"byte-model ceiling {plus['byte_model_ceiling']:.2f}x)",
            "met": plus["speedup"] >= 1.8,
        })  # fmt: skip
    else:
        verdicts.append({"target": "end to end radar+ >= 1.8x dense at 128k, batch 1", "value": "not measured", "met": None})
    verdicts += loop_targets(_rows(out / "loop.json"), cpu)
    return verdicts


def loop_targets(rows: list[dict], cpu: bool) -> list[dict]:
    """Issue 48's end-to-end targets, graph against graph: radar+ and the preset >= 1.7x dense at 128k x 1 and >= 1.3x
    at 32k x 1 (the eager loop on the CPU check), and the captured loop's greedy tokens equal to the eager loop's."""
    mode, budget = ("loop", 64) if cpu else ("graphs", 4096)
    found = []
    for name in ("radar+", "radar+adaptive"):
        for context, goal in ((300, 1.0),) if cpu else ((131008, 1.7), (32768, 1.3)):
            sparse = _row(rows, f"{name} (budget {budget})", context=context, batch=1, mode=mode)
            dense = next((r for r in rows if r["method"].startswith("dense") and r["context"] == context and r["batch"] == 1 and r["mode"] == mode), None)
            target = f"end to end through the {mode} loop, {context} tokens, batch 1: {name} >= {goal}x dense"
            if sparse and dense:  # every step, the phases' set-up (capture) included; the replayed steps' ratio beside it
                found.append({"target": target, "met": sparse["vs_dense_same_mode"] >= goal,
                              "value": f"{sparse['vs_dense_same_mode']:.2f}x ({sparse['ms_per_step']:.2f} vs {dense['ms_per_step']:.2f} "
                                       f"ms/step; replayed steps {sparse['steady_vs_dense_same_mode']:.2f}x)"})  # fmt: skip
            else:
                found.append({"target": target, "value": "not measured", "met": None})
    captured = [r for r in rows if r["mode"] == mode]
    if captured:
        key = next(k for k in captured[0] if k.startswith("tokens_equal_"))
        unequal = [f"{r['method']} at {r['context']}" for r in captured if not r[key]]
        found.append({"target": f"the {mode} loop's greedy tokens equal the {key.removeprefix('tokens_equal_')} mode's",
                      "value": "all equal" if not unequal else f"differ: {', '.join(unequal)}", "met": not unequal})  # fmt: skip
    return found


def markdown(report: dict) -> str:
    """The report as markdown: the machine, each step, the targets, and the benchmark tables."""
    m = report["machine"]
    lines = [f"# GPU check ({m.get('gpu', m['mode'])})", "", f"`{json.dumps(m)}`", "", "| step | status | seconds | summary |", "|---|---|---|---|"]
    for s in report["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('summary') or ''} |")
    for s in report["steps"]:
        if s.get("failures"):
            lines += ["", f"{s['step']} failures:", "", *[f"- `{f[:300]}`" for f in s["failures"]]]
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for t in report["targets"]:
        met = {True: "met", False: "missed", None: "not measured"}[t["met"]]
        if "met_as_graph" in t:
            met += f" ({'met' if t['met_as_graph'] else 'missed'} as a CUDA graph)"
        lines.append(f"| {t['target']} | {t['value']} | {met} |")
    attention = [r for r in report.get("attention_rows") or [] if "error" not in r]
    failed = [r for r in report.get("attention_rows") or [] if "error" in r]
    if failed:
        lines += ["", "attention rows that failed:", "", *[f"- {r['method']}, batch {r['batch']}, t={r['t']}: `{r['error']}`" for r in failed]]
    if attention:
        lines += ["", "| method | batch | t | attended | ms/step | graph ms | kernels | speedup | vs kernel | MB read | of floor | rel. err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in attention:
            lines.append(
                f"| {r['method']} | {r['batch']} | {r['t']} | {r['attended']:.0f} | {r['ms']:.3f} | {r.get('graph_ms', float('nan')):.3f} | "
                f"{r.get('kernels_per_step', '')} | {r['speedup']:.2f} | {r['speedup_vs_kernel_dense']:.2f} | {r['bytes'] / 1e6:.0f} | "
                f"{r['fraction_of_floor']:.2f} | {r['rel_error']:.1e} |"
            )
    profiled = [r for r in attention if r.get("kernel_us")]
    if profiled:
        longest = max((r["t"], r["batch"]) for r in profiled)
        lines += ["", f"GPU time per step by kernel at t={longest[0]}, batch {longest[1]} (torch profiler, microseconds):", ""]
        for r in profiled:
            if (r["t"], r["batch"]) == longest:
                top = ", ".join(f"{name} {us}" for name, us in r["kernel_us"][:6])
                lines.append(f"- {r['method']}: {r.get('kernel_us_total')} in {r.get('kernels_per_step')} kernels: {top}")
    generate = report.get("generate_rows") or []
    if generate:
        lines += ["", "| method | batch | context | tokens/s | speedup | byte-model ceiling | attended | peak GB | cache GB |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in generate:
            peak = r.get("peak_memory_bytes", float("nan")) / 1e9
            lines.append(
                f"| {r['method']} | {r['batch']} | {r['context']} | {r['tokens_per_second']:.2f} | {r['speedup']:.2f} | "
                f"{r['byte_model_ceiling']:.2f} | {r['mean_attended_tokens']:.0f} | {peak:.1f} | {r['cache_bytes'] / 1e9:.2f} |"
            )
    for skip in report.get("generate_skipped") or []:
        lines.append(f"\ngenerate, batch {skip['batch']} at {skip['context']} tokens: {skip['reason']}")
    loop = report.get("loop_rows") or []
    if loop:
        lines += ["", "| method | mode | batch | context | ms/step | steady ms/step | vs dense (same mode) | steady | phases | graphs | tokens as the first mode's |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in loop:
            same = next(v for k, v in r.items() if k.startswith("tokens_equal_"))
            lines.append(f"| {r['method']} | {r['mode']} | {r['batch']} | {r['context']} | {r['ms_per_step']:.2f} | {r['steady_ms_per_step']:.2f} | "
                         f"{r['vs_dense_same_mode']:.2f} | {r['steady_vs_dense_same_mode']:.2f} | {r.get('phases') or '-'} | "
                         f"{r.get('captures') or '-'} | {'yes' if same else 'NO'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def write_report(out: Path, info: dict, results: list[dict], cpu: bool) -> dict:
    report = {"machine": info, "steps": results, "targets": targets(out, cpu)}
    report["attention_rows"] = _rows(out / "attention.json")
    report["generate_rows"] = _rows(out / "generate.json")
    report["loop_rows"] = _rows(out / "loop.json")
    try:
        report["generate_skipped"] = json.loads((out / "generate.json").read_text()).get("skipped", [])
    except (OSError, ValueError):
        report["generate_skipped"] = []
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="toy sizes on the CPU, kernels in Triton's interpreter")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "gpu-check"))
    parser.add_argument("--steps", nargs="+", default=list(STEPS), help=f"some of {', '.join(STEPS)} (default: all, in order)")
    args = parser.parse_args()
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown --steps {unknown}; choose from {', '.join(STEPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine(args.cpu)
    if not args.cpu and "gpu" not in info:
        raise SystemExit("no CUDA GPU is visible (torch.cuda.is_available() is False); use --cpu for the CPU check")
    print(f"machine: {json.dumps(info)}", flush=True)
    commands = step_commands(args.cpu, args.out)
    results = []
    for name in STEPS:
        if name not in args.steps:
            continue
        command, env, limit = commands[name]
        print(f"[{name}] {' '.join(command)}", flush=True)
        result = run_step(name, command, env, limit, args.out)
        results.append(result)
        print(f"[{name}] {result['status']} in {result['seconds']} s" + (f": {result['summary']}" if result.get("summary") else ""), flush=True)
        write_report(args.out, info, results, args.cpu)  # after every step: nothing is lost to a later one
    report = write_report(args.out, info, results, args.cpu)
    print()
    print(markdown(report))
    failed = [r["step"] for r in results if r["status"] != "passed"]
    raise SystemExit(f"steps not passed: {', '.join(failed)}" if failed else 0)


if __name__ == "__main__":
    main()
