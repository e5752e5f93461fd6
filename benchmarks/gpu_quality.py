"""The embedded model's quality on a GPU against the CPU's (issue 48, item 4): perplexity and the fixed-shape loop's
greedy tokens of dense and the preset on two prose and two code texts, the same token ids on both machines.

A GPU machine lent here has no network and no wheel of the default model, and a device call carries at most
64 MiB, so ``prepare`` (here, on the CPU) writes what the check needs in two halves, each under that limit, and
the reference it is judged against:

* ``.gpu-carry/a``: the first half of the model's GGUF file, the texts' token ids, the CPU's results, the ``gguf``
  wheel (transformers converts the GGUF with it; the GPU image lacks it);
* ``.gpu-carry/b``: the GGUF's second half;
* ``benchmarks/results/quality-cpu.json``: the CPU's results (committed; ``check`` compares with the copy in ``a``).

A device session runs gpu-check carrying ``a``, then at once, the machine still warm (what a call carried stays
there), the check carrying ``b``::

    python benchmarks/gpu_quality.py prepare                          # here, ~3 min
    device run, carry [".gpu-carry/a"]: bash scripts/gpu-check.sh
    device run, carry [".gpu-carry/b"]: python3 benchmarks/gpu_quality.py check --out $OUT/quality.json

``check`` joins the halves (their sha256 checked), converts and loads the model on CUDA in float32 and in bfloat16,
measures what ``prepare`` measured, and reports per text and method: ppl against the CPU's and the greedy tokens
(eager loop, and as CUDA graphs) against the CPU's. Verdicts: float32 ppl within 0.1% of the CPU's and the same
tokens; bfloat16 ppl within 2% (tokens: how many lead equal, reported). ``check --device cpu`` runs the same on
the CPU (tests/test_gpu_quality.py runs it on a tiny model).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Nothing here imports transformers at import time: check installs the carried gguf wheel first (transformers
# notes at its own import which optional packages it can use).
from sparseattn import registry  # noqa: E402
from sparseattn.evaluation.runs import RunDir  # noqa: E402

#: Two prose and two code texts (docs/evaluation.md), the budget 1/8 of the prefill.
TEXTS = ("cymbeline", "henry-v", "difflib", "pickle")
METHODS = ("dense", "radar+adaptive")
PREFILL, STEPS, NEW_TOKENS, BUDGET = 2048, 128, 32, 256
CARRY = ROOT / ".gpu-carry"
REFERENCE = ROOT / "benchmarks" / "results" / "quality-cpu.json"
#: Verdicts: ppl's relative difference from the CPU's, at most, per dtype.
PPL_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2}


def build(name: str, budget: int):
    return registry.build(name) if name == "dense" else registry.build(name, budget=budget)


def measure(model, ids: dict[str, list[int]], config: dict, device: torch.device, graphs: bool) -> dict:
    """Per text and method: ppl (prefill, then ``steps`` teacher-forced decode steps through the method's cache) and
    the greedy tokens of ``sparseattn.generate`` after the prefill (eager, and captured with ``graphs``)."""
    from sparseattn.evaluation.ppl import run_ppl_together
    from sparseattn.hf.loop import generate

    prefill, steps, new, budget = config["prefill"], config["steps"], config["new_tokens"], config["budget"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for text, row in ids.items():
            tokens = torch.tensor(row[: prefill + steps + 1])
            runs = {m: (build(m, budget), RunDir(Path(tmp) / text / m, {"text": text, "method": m, **config})) for m in config["methods"]}
            ppl = run_ppl_together(model, runs, tokens, prefill, steps, progress=False)
            prompt = torch.tensor([row[:prefill]], device=device)
            results[text] = {}
            for m in config["methods"]:
                entry = {"ppl": ppl[m]["ppl"], "tokens": generate(model, prompt, build(m, budget), new).tokens[0].tolist()}
                if graphs:
                    entry["graph_tokens"] = generate(model, prompt, build(m, budget), new, graphs=True).tokens[0].tolist()
                results[text][m] = entry
    return results


def _sha256(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def prepare(args) -> None:
    from sparseattn.data.sources import load_text
    from sparseattn.evaluation.ppl import tokenize
    from sparseattn.hf import load_model
    from sparseattn.hf.models import resolve_model_source

    source = resolve_model_source(args.model)
    if source.kind != "gguf":
        raise SystemExit(f"prepare: the model must be a .gguf file (what travels in two halves), got {source.path}")
    (CARRY / "a").mkdir(parents=True, exist_ok=True)  # first the wheel the GPU lacks: a failed download costs no measurement
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(CARRY / "a"),
                    f"gguf=={importlib.metadata.version('gguf')}"], check=True)  # fmt: skip
    model, tokenizer = load_model(args.model)
    config = {"prefill": args.prefill, "steps": args.steps, "new_tokens": args.new_tokens, "budget": args.budget, "methods": list(METHODS)}
    ids = {t: tokenize(tokenizer, load_text(t), args.prefill + args.steps + 1, t).tolist() for t in args.texts}
    results = measure(model, ids, config, torch.device("cpu"), graphs=False)
    gguf = Path(source.path)
    halves = [CARRY / "a" / "model.gguf.0", CARRY / "b" / "model.gguf.1"]
    for half in halves:
        half.parent.mkdir(parents=True, exist_ok=True)
    data = gguf.read_bytes()
    cut = len(data) // 2
    halves[0].write_bytes(data[:cut])
    halves[1].write_bytes(data[cut:])
    reference = {"machine": machine(), "config": config, "gguf": {"name": gguf.name, "sha256": _sha256([gguf])}, "results": results}
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(json.dumps(reference, indent=1))
    (CARRY / "a" / "reference.json").write_text(json.dumps(reference))
    (CARRY / "a" / "ids.json").write_text(json.dumps(ids))
    sizes = {p.name: p.stat().st_size for half in ("a", "b") for p in (CARRY / half).iterdir()}
    print(json.dumps({"reference": str(REFERENCE), "carry": sizes}, indent=1))
    print(table(results, None))


def machine() -> dict:
    info = {"device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    else:
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        info["cpu"] = "AMX" if "amx_tile" in flags else ("AVX-512" if "avx512f" in flags else "other")
    return info


def check(args) -> None:
    reference = json.loads((args.carry / "a" / "reference.json").read_text())
    ids = json.loads((args.carry / "a" / "ids.json").read_text())
    model_path = args.model  # a directory or GGUF file (main joins the carried halves)
    from sparseattn.hf import load_model

    device = torch.device(args.device)
    report = {"machine": machine(), "reference_machine": reference["machine"], "config": reference["config"], "runs": {}, "verdicts": []}
    for dtype_name in args.dtypes:
        model, _ = load_model(str(model_path), dtype=getattr(torch, dtype_name), device=str(device))
        results = measure(model, ids, reference["config"], device, graphs=device.type == "cuda")
        report["runs"][dtype_name] = results
        report["verdicts"] += verdicts(results, reference["results"], dtype_name)
        print(table(results, reference["results"], dtype_name), flush=True)
        del model
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for v in report["verdicts"]:
        print(f"{'met' if v['met'] else 'MISSED'}: {v['target']}: {v['value']}")


def joined_model(carry: Path, gguf: dict, into: Path) -> Path:
    """The GGUF file ``prepare`` split into ``carry``'s two halves, joined in ``into`` (kept: a rerun reuses it);
    ValueError naming what is missing, or when the halves are not that file (sha256)."""
    halves = [carry / "a" / "model.gguf.0", carry / "b" / "model.gguf.1"]
    missing = [str(h) for h in halves if not h.exists()]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: carry .gpu-carry/a in one call and .gpu-carry/b in the next, "
                         "the machine still warm (see benchmarks/gpu_quality.py)")  # fmt: skip
    if _sha256(halves) != gguf["sha256"]:
        raise ValueError("the two halves are not the GGUF file prepare split (sha256 differs): run prepare again")
    joined = into / gguf["name"]
    if not joined.exists() or _sha256([joined]) != gguf["sha256"]:
        with joined.open("wb") as out:
            for half in halves:
                out.write(half.read_bytes())
    return joined


def _install_gguf(folder: Path) -> None:
    """The ``gguf`` wheel carried in ``folder`` onto the import path (the GPU image lacks it; nothing to fetch)."""
    try:
        import gguf  # noqa: F401

        return
    except ImportError:
        pass
    wheels = sorted(folder.glob("gguf-*.whl"))
    if not wheels:
        raise SystemExit(f"check: no gguf wheel in {folder} (prepare downloads it)")
    target = Path(tempfile.gettempdir()) / "gguf-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), str(wheels[-1])], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def verdicts(results: dict, reference: dict, dtype_name: str) -> list[dict]:
    """Per method, over the texts: ppl within the dtype's tolerance of the CPU's; in float32 also the same greedy tokens."""
    found = []
    tolerance = PPL_TOLERANCE.get(dtype_name, PPL_TOLERANCE["bfloat16"])
    for method in next(iter(results.values())):
        diffs = {t: results[t][method]["ppl"] / reference[t][method]["ppl"] - 1 for t in results}
        worst = max(diffs.values(), key=abs)
        found.append({"target": f"{dtype_name}, {method}: ppl within {tolerance:.1%} of the CPU's on every text",
                      "value": ", ".join(f"{t} {d:+.3%}" for t, d in diffs.items()), "met": abs(worst) <= tolerance})  # fmt: skip
        if dtype_name == "float32":
            for key in ("tokens", "graph_tokens"):
                if key not in next(iter(results.values()))[method]:
                    continue
                lead = {t: _leading_equal(results[t][method][key], reference[t][method]["tokens"]) for t in results}
                total = len(reference[next(iter(reference))][method]["tokens"])
                found.append({"target": f"float32, {method}: the {'captured' if key == 'graph_tokens' else 'eager'} loop's "
                              f"greedy tokens equal the CPU's", "value": ", ".join(f"{t} {n}/{total}" for t, n in lead.items()),
                              "met": all(n == total for n in lead.values())})  # fmt: skip
    return found


def table(results: dict, reference: dict | None, dtype_name: str = "") -> str:
    lines = [f"{'text':<12}{'method':<16}{'ppl':>9}{'CPU ppl':>9}{'diff':>9}{'tokens = CPU':>14}{'graphs = CPU':>14}  {dtype_name}"]
    for text, by_method in results.items():
        for method, r in by_method.items():
            ref = reference[text][method] if reference else None
            total = len(r["tokens"])
            same = f"{_leading_equal(r['tokens'], ref['tokens'])}/{total}" if ref else "-"
            graph = f"{_leading_equal(r['graph_tokens'], ref['tokens'])}/{total}" if ref and "graph_tokens" in r else "-"
            cpu, diff = (f"{ref['ppl']:.3f}", f"{r['ppl'] / ref['ppl'] - 1:+.3%}") if ref else ("-", "-")
            lines.append(f"{text:<12}{method:<16}{r['ppl']:>9.3f}{cpu:>9}{diff:>9}{same:>14}{graph:>14}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here, on the CPU: the reference results and the carry folder")
    p.add_argument("--model", default="default", help="a .gguf file or 'default' (the embedded model)")
    p.add_argument("--texts", nargs="+", default=list(TEXTS))
    p.add_argument("--prefill", type=int, default=PREFILL)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--budget", type=int, default=BUDGET)
    c = sub.add_parser("check", help="on the GPU: the same measurements against the CPU's reference")
    c.add_argument("--carry", type=Path, default=CARRY)
    c.add_argument("--model", type=Path, default=None, help="a model to load instead of the carried halves (a test's)")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    c.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality-gpu.json")
    args = parser.parse_args()
    if args.command == "prepare":
        for name in ("prefill", "steps", "new_tokens", "budget"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        from sparseattn.data.sources import get_text

        for name in args.texts:
            try:
                get_text(name)
            except ValueError as error:
                parser.error(f"--texts: {error}")
        prepare(args)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available")
    missing = [str(args.carry / "a" / name) for name in ("reference.json", "ids.json") if not (args.carry / "a" / name).exists()]
    if missing:
        parser.error(f"--carry {args.carry}: {', '.join(missing)} missing (run prepare here, carry .gpu-carry/a)")
    if args.model is None:  # the carried halves, joined before any model work
        try:
            reference = json.loads((args.carry / "a" / "reference.json").read_text())
            args.model = joined_model(args.carry, reference["gguf"], Path(tempfile.gettempdir()))
        except ValueError as error:
            parser.error(f"--carry {args.carry}: {error}")
        _install_gguf(args.carry / "a")
    check(args)


if __name__ == "__main__":
    main()
