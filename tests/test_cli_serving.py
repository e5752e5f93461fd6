"""``sparseattn serve`` and ``sparseattn serving-bench`` check everything before vLLM starts (issue 16 item 8).

No engine and no server is started here: ``serve --dry-run`` prints the server's command line, every
other case is refused before vLLM is imported (the main environment has no vLLM; the cases that
need its absence are left out where it is installed, since ``serve`` would then start the server).
All cases run in one subprocess, through the console script's entry point, as in test_cli_input.py.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli_driver import assert_one_error_line, run_cli_cases
from tiny_checkpoint import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None



def _default_model_dir() -> str | None:
    from sparseattn.hf import default_model_unavailable_reason

    if default_model_unavailable_reason() is not None:
        return None
    from sparseattn.hf.models import local_model_dir

    return str(local_model_dir())


DEFAULT_DIR = _default_model_dir()


def refusals(model: str) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (command line, what its one ``Error:`` line must say)."""
    serve = ["serve", "--model", model]
    bench = ["serving-bench", "--model", model]
    cases = {
        "unknown method": (serve + ["-m", "qwest"], ["'--method'", "unknown method 'qwest'", "known methods: dense", "radar+"]),
        "budget 0": (serve + ["-m", "radar+", "--budget", "0"], ["'--budget'", "0 is out of range", "[1, "]),
        "spec budget not a number": (serve + ["-m", "radar+:budget=x"], ["'--method'", "budget", "must be a int", "'x'"]),
        "spec option the method does not take": (serve + ["-m", "quest:heavy_ratio=0.5"], ["'--method'", "heavy_ratio"]),
        "eviction method": (serve + ["-m", "h2o", "--budget", "64"], ["'--method'", "cannot run in vLLM", "eviction"]),
        "always-kept part": (serve + ["-m", "radar-with-h2o", "--budget", "512"], ["'--method'", "always-kept", "not supported in vLLM"]),
        "bad dtype": (serve + ["--dtype", "float8"], ["'--dtype'", "'float8'", "bfloat16, float16, float32"]),
        "segment 0": (serve + ["--segment", "0"], ["'--segment'", "0 is out of range", ">= 1"]),
        "segment a word": (serve + ["--segment", "pages"], ["'--segment'", "'pages' is not allowed", "auto, page or a number"]),
        "port 0": (serve + ["--port", "0"], ["'--port'", "0 is out of range", "from 1 to 65535"]),
        "memory fraction 0": (serve + ["--memory-fraction", "0"], ["'--memory-fraction'", "0.0 is out of range", "at most 1"]),
        "model len beyond the window": (serve + ["--max-model-len", "5000", "--dry-run"],
                                        ["'--max-model-len'", "5000", "model's 4096", "1 to 4096"]),
        "own option after --": (serve + ["--dry-run", "--", "--additional-config", "{}"],
                                ["'VLLM_ARGS'", "--additional-config", "--method/--budget"]),
        "stray argument": (serve + ["--dry-run", "radar+"], ["'VLLM_ARGS'", "unexpected argument 'radar+'", "after --"]),
        "nonexistent model": (["serve", "--model", "/no/such/model", "--dry-run"], ["'--model'", "/no/such/model"]),
        "bench batch 0": (bench + ["--batch", "0"], ["'--batch'", "0 is out of range", "1 to 64"]),
        "bench no steps": (bench + ["--steps", "0"], ["'--steps'", "0 is out of range", ">= 1"]),
        "bench one held token": (bench + ["--held", "1"], ["'--held'", "1 is out of range", ">= 2"]),
        "bench no rounds": (bench + ["--runs", "0"], ["'--runs'", "0 is out of range", ">= 1"]),
        "bench short context": (bench + ["--context", "10"], ["'--context'", "10 is out of range", ">= 64"]),
        "bench beyond the window": (bench + ["--context", "4050", "--steps", "32"],
                                    ["'--context' / '--steps'", "4115 positions", "model's 4096", "<= 4064"]),
        "bench block size": (bench + ["--block-size", "48"], ["'--block-size'", "48 is not allowed", "multiple of 32"]),
        "bench segment 0": (bench + ["--segment", "0"], ["'--segment'", "0 is out of range"]),
        "bench segment not dividing": (bench + ["--block-size", "32", "--segment", "5"], ["'--segment'", "5 does not divide the block size 32"]),
        "bench segment vs the default page": (bench + ["--segment", "48"], ["'--segment'", "48 does not divide the block size 128"]),
        "bench unknown text": (bench + ["--text", "hamlett"], ["'--text'", "'hamlett'", "did you mean hamlet", "sparseattn data list"]),
        "bench budget 0": (bench + ["--budget", "0"], ["'--budget'", "0 is out of range"]),
        "bench dense as a method": (bench + ["-m", "dense"], ["'--method'", "dense path is always run"]),
        "bench eviction method": (bench + ["-m", "snapkv"], ["'--method'", "cannot run in vLLM"]),
        "bench method twice": (bench + ["-m", "quest", "-m", "quest:budget=1024"], ["'--method'", "quest (1024), 16-token segments given twice"]),
        "bench out not json": (bench + ["--out", "table.txt"], ["'--out'", "not a .json file"]),
        "bench dtype": (bench + ["--dtype", "float16"], ["'--dtype'", "'float16' is not allowed", "bfloat16, float32"]),
        "bench kv cache dtype": (bench + ["--kv-cache-dtype", "int8"], ["'--kv-cache-dtype'", "'int8' is not allowed", "auto, fp8, fp8_e4m3, fp8_e5m2"]),
        "bench yarn 1": (bench + ["--yarn", "1"], ["'--yarn'", "1.0 is out of range", "> 1"]),
        "bench beyond the stretched window": (bench + ["--yarn", "2", "--context", "8150", "--steps", "32"],
                                              ["'--context' / '--steps'", "8215 positions", "model's 8192"]),
    }
    if not VLLM_INSTALLED:  # with vLLM installed these would start the server or the engines
        hint = ["vLLM is not installed for", "docs/serving.md#install", "pip install -e '.[vllm]'", "torchvision"]
        cases["serve without vLLM"] = (serve + ["-m", "radar+", "--budget", "1024"], hint)
        cases["bench without vLLM"] = (bench + ["--batch", "1", "--steps", "4", "--runs", "1", "--context", "256"], hint)
    return cases


def dry_runs(model: str) -> dict[str, list[str]]:
    cases = {
        "radar+": ["serve", "--model", model, "-m", "radar+", "--budget", "1024", "--dry-run"],
        "the default method with segments": ["serve", "--model", model, "--budget", "512", "--segment", "4", "--dry-run"],
        "the default method on pages": ["serve", "--model", model, "--budget", "512", "--segment", "page", "--dry-run"],
        "quest with options": ["serve", "--model", model, "-m", "quest:sinks=128", "--budget", "512", "--port", "8123",
                               "--host", "0.0.0.0", "--name", "tiny", "--kv-cache-gib", "2", "--dry-run", "--",
                               "--max-num-seqs", "8"],
    }
    if DEFAULT_DIR is not None:
        cases["default model"] = ["serve", "-m", "radar+", "--budget", "1024", "--dry-run"]
    return cases


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-serving")
    return root, str(save_tiny_checkpoint(root / "model"))  # 4096 positions


@pytest.fixture(scope="module")
def results(workspace):
    root, model = workspace
    cases = {name: args for name, (args, _) in refusals(model).items()}
    cases.update({f"dry run: {name}": args for name, args in dry_runs(model).items()})
    return run_cli_cases(cases, root)


@pytest.mark.parametrize("name", list(refusals("m")))
def test_a_mistake_is_one_line_with_exit_status_2_before_anything_starts(workspace, results, name):
    root, model = workspace
    expected = refusals(model)[name][1]
    result = results[name]
    assert_one_error_line(result, expected)
    assert result["stdout"] == ""  # no command line printed, nothing run
    assert not (root / "results").exists()  # serving-bench wrote nothing


def _server_argv(result: dict) -> tuple[dict[str, str], list[str]]:
    """The dry run's one stdout line: ``(environment assignments, argv)``."""
    assert result["code"] == 0, result
    lines = result["stdout"].splitlines()
    assert len(lines) == 1, result["stdout"]
    words = shlex.split(lines[0])
    env = {}
    while "=" in words[0] and not words[0].startswith("/"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_dry_run_prints_vllms_server_with_the_method_as_additional_config(workspace, results):
    _, model = workspace
    env, argv = _server_argv(results["dry run: radar+"])
    assert env == {}
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _option(argv, "--model") == model
    # By default the method runs on its own grid: the engine resolves "auto" for its pages and longest sequence.
    assert json.loads(_option(argv, "--additional-config")) == {"sparseattn": {"method": "radar+", "budget": 1024, "segment": "auto"}}
    _, segmented = _server_argv(results["dry run: the default method with segments"])
    assert json.loads(_option(segmented, "--additional-config")) == {"sparseattn": {"method": "radar+adaptive", "budget": 512, "segment": 4}}
    _, pages = _server_argv(results["dry run: the default method on pages"])
    assert json.loads(_option(pages, "--additional-config")) == {"sparseattn": {"method": "radar+adaptive", "budget": 512}}
    assert _option(argv, "--dtype") == "bfloat16"
    assert _option(argv, "--max-model-len") == "4096"  # the model's positions
    assert _option(argv, "--served-model-name") == model
    assert (_option(argv, "--host"), _option(argv, "--port")) == ("127.0.0.1", "8000")
    # The worker that counts the page stores in the memory vLLM is given (sparseattn.vllm.worker).
    assert _option(argv, "--worker-cls") == "sparseattn.vllm.worker.SparseCPUWorker"


def test_dry_run_passes_spec_options_server_options_and_what_follows_the_double_dash(results):
    env, argv = _server_argv(results["dry run: quest with options"])
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    config = json.loads(_option(argv, "--additional-config"))
    assert config == {"sparseattn": {"method": "quest", "sinks": 128, "budget": 512, "segment": "auto"}}
    assert (_option(argv, "--host"), _option(argv, "--port"), _option(argv, "--served-model-name")) == ("0.0.0.0", "8123", "tiny")
    assert argv[-2:] == ["--max-num-seqs", "8"]


def test_the_dry_run_config_is_what_the_plugin_reads(results):
    from sparseattn.vllm.config import request_from

    _, argv = _server_argv(results["dry run: quest with options"])
    request = request_from(json.loads(_option(argv, "--additional-config")), {})
    assert (request.name, request.options, request.segment) == ("quest", {"sinks": 128, "budget": 512}, "auto")
    # what the engine then runs: Quest's own 16-token pages inside a 32-token page, at any length
    assert request.policy(block_size=32, length=4096).segment == 16
    assert request.policy(block_size=16, length=4096).segment is None


@pytest.mark.skipif(DEFAULT_DIR is None, reason="the default model is not available here")
def test_dry_run_serves_the_default_model_by_default(results):
    _, argv = _server_argv(results["dry run: default model"])
    assert _option(argv, "--model") == DEFAULT_DIR
    assert _option(argv, "--max-model-len") == "8192"
    assert _option(argv, "--served-model-name") == "default"


def test_the_benchmark_script_refuses_bad_sizes_before_importing_vllm():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving.py"), "--steps", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "'--steps': 0 is out of range; allowed: >= 1" in done.stderr


def test_the_runs_are_stock_first_then_the_plugins_dense_path_then_each_method():
    from sparseattn.evaluation.serving_runs import plan_runs

    runs = plan_runs({"quest (1024)": {"method": "quest", "budget": 1024}, "radar+ (512)": {"method": "radar+", "budget": 512}})
    assert [(r.label, r.engine, r.attended) for r in runs] == [
        ("stock", "stock", None), ("dense", "plugin", None), ("quest (1024)", "plugin", 1024), ("radar+ (512)", "plugin", 512)]
    assert [r.label for r in plan_runs({}, float32=True)] == ["stock", "stock float32", "dense"]


@pytest.mark.parametrize("segment, expected", [
    (["--segment", "4"], [("radar+adaptive (512), 4-token segments", 4), ("quest (512), 4-token segments", 4)]),
    # the default, "auto": each method's own grid at the engine's longest sequence (256 + 32 + 32 = 320 tokens:
    # sqrt(320) / 16 -> 1 token for radar+adaptive), Quest's 16-token pages
    ([], [("radar+adaptive (512), 1-token segments", 1), ("quest (512), 16-token segments", 16)]),
    (["--segment", "page"], [("radar+adaptive (512)", None), ("quest (512)", None)]),
], ids=["4", "auto", "page"])  # fmt: skip
def test_the_benchmarks_segment_goes_to_every_methods_plugin_config(workspace, monkeypatch, tmp_path, segment, expected):
    """``serving-bench --segment``: each sparse run's ``additional_config`` carries the paged engine's segment
    (what ``sparseattn serve --segment`` sets; "auto" resolved as the engine would), and its label says so; the
    engines' run itself is replaced."""
    from typer.testing import CliRunner

    from sparseattn.cli import app
    from sparseattn.evaluation import serving, vllm_engine

    _, model = workspace
    seen = {}

    def fake_run(model_dir, plan, **kwargs):
        seen["plan"], seen["block_size"] = plan, kwargs["block_size"]
        raise SystemExit(0)

    monkeypatch.setattr(vllm_engine, "vllm_unavailable_reason", lambda import_it=False: None)
    monkeypatch.setattr(serving, "run", fake_run)
    args = ["serving-bench", "--model", model, "-m", "radar+adaptive", "-m", "quest", "--budget", "512", "--block-size", "32",
            *segment, "--context", "256", "--steps", "4", "--out", str(tmp_path / "bench.json")]  # fmt: skip
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    sparse = [r for r in seen["plan"] if r.label not in ("stock", "stock float32", "dense")]
    methods = [{"method": "radar+adaptive", "budget": 512}, {"method": "quest", "budget": 512}]
    assert [(r.label, r.method) for r in sparse] == [
        (label, method if own is None else {**method, "segment": own}) for (label, own), method in zip(expected, methods)]
    assert seen["block_size"] == 32


#: ``sparseattn serving-bench`` with its engines' run replaced by one that writes as vLLM does: a line from the
#: ``vllm`` logger (a handler on sys.stdout, as vLLM configures it at import), a line on stdout and one on stderr
#: from a process it starts (the engine core's), and a Python warning; between them, the run's own progress lines.
FAKE_VLLM_DRIVER = r"""
import logging, subprocess, sys, warnings
from sparseattn.cli import app
from sparseattn.evaluation import serving, vllm_engine

logging.getLogger("vllm").addHandler(logging.StreamHandler(sys.stdout))
logging.getLogger("vllm").setLevel(logging.INFO)

def run(model, plan, *, say, **options):
    say("progress: the engines start")
    logging.getLogger("vllm").info("vLLM banner from its logger")
    subprocess.run([sys.executable, "-c", "import sys; print('vLLM banner from the engine process'); "
                    "print('vLLM warning from the engine process', file=sys.stderr)"], check=True)
    warnings.warn("vLLM warning in this process")
    say("progress: the engines stopped")
    return {}, []

vllm_engine.vllm_unavailable_reason = lambda import_it=False: None
serving.run = run
app(sys.argv[1:], prog_name="sparseattn")
"""
VLLM_OUTPUT = ("vLLM banner from its logger", "vLLM banner from the engine process", "vLLM warning from the engine process",
               "vLLM warning in this process")  # fmt: skip


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_the_terminal_shows_progress_and_the_table_and_vllms_output_goes_to_the_printed_log(workspace, tmp_path, verbose):
    """What ``scripts/demo.sh`` shows: the benchmark's own lines on the terminal, vLLM's (its logger, its engine
    process, warnings) in ``<out>.vllm.log``, whose path is printed first; ``--verbose`` shows vLLM's output instead."""
    _, model = workspace
    out = tmp_path / "bench.json"
    args = ["serving-bench", "--model", model, "-m", "quest", "--budget", "512", "--context", "256", "--steps", "4",
            "--runs", "1", "--out", str(out), *(["--verbose"] if verbose else [])]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", FAKE_VLLM_DRIVER, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    terminal = done.stdout + done.stderr
    assert "progress: the engines start" in done.stdout and "progress: the engines stopped" in done.stdout
    assert "vLLM decode: batch" in done.stdout  # the table's title
    log = tmp_path / "bench.vllm.log"
    if verbose:
        assert all(line in terminal for line in VLLM_OUTPUT), terminal
        assert not log.exists()
        return
    assert not any(line in terminal for line in VLLM_OUTPUT), terminal
    assert done.stdout.splitlines()[0] == f"vLLM's own output (engine start-up, compilation, warnings) goes to {log}; --verbose shows it here"
    assert all(line in log.read_text() for line in VLLM_OUTPUT), log.read_text()
    assert done.stdout.splitlines()[-1] == f"wrote {out}, {log}"
