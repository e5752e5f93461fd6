"""The evaluation commands: ``ppl``, ``plot``, ``needle``, ``ruler``, ``diagnose``, ``sweep`` and ``longbench run``.

Methods are named on the command line as ``NAME[:key=value,...]`` with the keys of
:mod:`sparseattn.registry` options that the method takes (``sparseattn methods`` lists
them), e.g. ``radar:top_k=8,n_features=256`` or ``h2o:heavy_ratio=0.25``; ``--budget`` sets the
budget of every method that has one and whose spec sets neither ``budget`` nor ``top_k`` (dense has
no budget and runs without one). Every run writes a directory (``--out``) holding its resolved
config, its records as they are produced, and a summary; rerunning skips what is finished and
resumes what is not. The runs in another ``--dtype`` than float32 go to their own directories.

Every command checks all of its input before any work starts (the model's weights are loaded last):
a mistake ends with one line naming the option, the value and what is allowed, and exit code 2.
"""

from __future__ import annotations

import difflib
import json
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer
from rich.markup import escape
from rich.table import Table

from sparseattn import registry
from sparseattn.cli.consoles import console
from sparseattn.cli.methods import range_problem
from sparseattn.progress import forward_progress, progress

#: The spec of the embedded default model: ``sparseattn.hf.DEFAULT_MODEL``, repeated rather than
#: imported because importing ``sparseattn.hf`` loads transformers (seconds), which a mistyped
#: option should not wait for.
DEFAULT_MODEL = "default"


QUICK = "quick defaults finish in minutes on a 2-core CPU; raise them for full-size runs"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- input checks: every mistake is refused before any work starts ---------------------------------------


def bad(options: str | Sequence[str], message: str) -> typer.BadParameter:
    """A usage error (exit code 2) naming ``options``: ``Invalid value for '--steps': ...``."""
    return typer.BadParameter(message, param_hint=[options] if isinstance(options, str) else list(options))


def check_range(option: str, value: float | None, low: float, high: float | None = None) -> None:
    """Refuse ``value`` outside ``[low, high]`` (no upper end when ``high`` is None); None passes."""
    if value is None or (low <= value and (high is None or value <= high)):
        return
    allowed = f">= {_number(low)}" if high is None else f"from {_number(low)} to {_number(high)}"
    raise bad(option, f"{_number(value)} is out of range; allowed: {allowed}")


def _number(value: float) -> str:
    """``150`` for 150.0 and for 150 (however large), ``2.5`` for 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def check_dtype(dtype: str) -> torch.dtype:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise bad("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}") from None


def check_out(out: Path, option: str = "--out") -> None:
    """Refuse an ``out`` directory that cannot be created or written, without creating anything.

    A directory is made and removed again in the nearest existing ancestor: only that shows what the
    file system allows (permissions, a read-only mount, a file where a directory should be).
    """
    path = out.expanduser()
    if path.exists() and not path.is_dir():
        raise bad(option, f"{out} exists and is not a directory")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise bad(option, f"cannot create {out}: {ancestor} is a file, not a directory")
    try:
        Path(tempfile.mkdtemp(prefix=".sparseattn-write-check-", dir=ancestor)).rmdir()
    except OSError as err:
        raise bad(option, f"cannot create or write {out}: {ancestor} is not writable ({err.strerror})") from None


@dataclass(frozen=True)
class ModelInfo:
    """A model spec resolved to its local directory and config, its weights not loaded."""

    spec: str
    directory: Path
    config: Any

    @property
    def window(self) -> int | None:
        """The positions the model was trained for (``max_position_embeddings``), None if unknown."""
        return getattr(self.config, "max_position_embeddings", None)

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        except (OSError, ValueError) as err:
            raise bad("--model", f"{self.spec!r}: no tokenizer that transformers can load in {self.directory}: {err}") from None

    def load(self, dtype: torch.dtype):
        """The model's weights, in eval mode (the last step of every command: checks come first)."""
        from sparseattn.hf import load_model

        return load_model(self.spec, dtype=dtype)[0]


def inspect_model(model: str) -> ModelInfo:
    """Resolve ``--model`` and read its config, without loading weights (a GGUF spec converts once)."""
    from transformers import AutoConfig

    from sparseattn.hf.models import ModelSourceError, local_model_dir

    try:
        directory = local_model_dir(model)
    except ModelSourceError as err:
        raise bad("--model", str(err)) from None
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise bad("--model", f"{model!r}: cannot read the config in {directory}: {err}") from None
    return ModelInfo(model, directory, config)


def check_positions(info: ModelInfo, options: str | Sequence[str], needed: int, how: str, allowed: str) -> None:
    """Refuse a run that needs more positions than the model has: ``how`` says how ``needed`` adds up."""
    if info.window is not None and needed > info.window:
        raise bad(options, f"{how} = {needed} positions, beyond the model's {info.window}; allowed: {allowed}")


def read_text(name: str, option: str = "--text") -> str:
    """A text by name (``sparseattn data list``) or a file; a text not fetched yet is fetched (with progress)."""
    from sparseattn.data.sources import TEXTS, FetchError, get_text, load_text

    path = Path(name).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    try:
        entry = get_text(name)
    except ValueError:
        close = difflib.get_close_matches(name, TEXTS, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise bad(option, f"{name!r} is neither a file nor a known text; {hint}allowed: a file or a name from "
                  "`sparseattn data list`") from None
    try:
        if entry.fetched:
            return load_text(name)
        with progress(f"fetching the text {name} (once)"):
            return load_text(name)
    except FetchError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        raise typer.Exit(1) from None


def text_ids(tokenizer, text: str, name: str, needed: int, how: str) -> torch.Tensor:
    """The first ``needed`` tokens of ``text``; a usage error naming ``--text`` when it has fewer."""
    from sparseattn.evaluation.ppl import tokenize

    try:
        return tokenize(tokenizer, text, needed, name=name)
    except ValueError as err:
        raise bad("--text", f"{err} ({how}); use a longer text or fewer steps") from None


def check_runs(runs: Sequence[tuple[Path, dict]]) -> None:
    """Refuse to mix a run into a directory that holds another experiment's run (nothing is written)."""
    from sparseattn.evaluation.runs import RunDir

    for path, config in runs:
        try:
            RunDir.check(path, config)
        except ValueError as err:
            raise bad("--out", str(err)) from None


def plan_runs(root: Path, resolved, common: dict) -> list[tuple[str, object, Path, dict]]:
    """One run directory per resolved method under ``root`` (``root/<label>``), its config ``common`` plus the
    method's label, budget and parameters; refused, before anything is written, where another experiment lives."""
    runs = []
    for label, sparse_method, given in resolved:
        config = {**common, "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        runs.append((label, sparse_method, root / _slug(label), config))
    check_runs([(path, config) for _, _, path, config in runs])
    return runs


def run_name(kind: str, dtype: str, *parts: object) -> str:
    """The directory of one experiment under ``--out``: ``ppl-pydecimal-p2048-s256`` (float32), and
    ``...-bfloat16`` in another dtype, so that runs in two dtypes never meet in one directory while
    float32 runs keep the names they always had (and stay resumable)."""
    name = "-".join([kind, *map(str, parts)])
    return name if dtype == "float32" else f"{name}-{dtype}"


def wrote(paths: Sequence[Path], what: str = "") -> None:
    """The last line of every command that writes files: where they are."""
    console.print(f"wrote {', '.join(map(str, paths))}{f' ({what})' if what else ''}", markup=False)


def parse_method(spec: str, budget: int | None = None) -> tuple[str, object, dict]:
    """``"radar:top_k=8"`` -> ``(label, method instance, options given)``; ``budget`` fills in a missing budget.

    The grammar and every check are the registry's (:func:`sparseattn.registry.parse`, shared with the
    vLLM plugin and lm-eval); a refusal becomes the ``--method`` option's error.
    """
    try:
        parsed = registry.parse(spec, budget, budget_option="--budget")
    except (ValueError, registry.PluginError) as err:  # a bad spec, or a broken third-party method package
        raise bad("--method", str(err)) from None
    return parsed.label, parsed.method, dict(parsed.options)


def parse_methods(specs: Sequence[str], budget: int | None) -> list[tuple[str, object, dict]]:
    """Every ``--method`` spec, after checking ``--budget``; two specs with one label are refused."""
    problem = None if budget is None else range_problem("budget", budget)
    if problem:
        raise bad("--budget", problem)
    resolved = [parse_method(spec, budget) for spec in specs]
    labels = [label for label, _, _ in resolved]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        also = "" if budget is None else f" (with --budget {budget})"
        raise bad("--method", f"{', '.join(twice)} given twice{also}; each method once")
    return resolved


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label)


MODEL = typer.Option(DEFAULT_MODEL, help="'default' (SmolLM2-135M-Instruct), a local HF directory or a .gguf file")
METHOD = typer.Option(["dense", "radar"], "--method", "-m", help="NAME[:key=value,...]; repeat for several methods")
BUDGET = typer.Option(
    None,
    help="past KV tokens a decode step may attend (>= 1, sinks and window included), for every method with a budget "
    "whose spec sets neither budget nor top_k",
)
DTYPE = typer.Option("float32", help="float32, bfloat16 or float16")
OUT = typer.Option(Path("results"), help="root directory of the runs")


def ppl(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    text: str = typer.Option("pydecimal", help="a text name (`sparseattn data list`) or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled densely (>= 0; 0: generation without prompts)"),
    steps: int = typer.Option(256, help=f"decode steps (>= 1; {QUICK}; the paper: prefill 16384 + the whole text)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Perplexity as in the paper's section 4.1: prefill a prompt, then feed the text token by token with the method."""
    torch_dtype = check_dtype(dtype)
    check_range("--prefill", prefill, 0)
    check_range("--steps", steps, 1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    needed = prefill + steps + 1
    how = f"--prefill {prefill} + --steps {steps} + 1"
    allowed = "--prefill + --steps <= " + str((info.window or 0) - 1)
    check_positions(info, ["--prefill", "--steps"], needed, how, allowed)
    ids = text_ids(info.tokenizer(), read_text(text), text, needed, how)
    root = out / run_name("ppl", dtype, _slug(text), f"p{prefill}", f"s{steps}")
    runs = plan_runs(root, resolved, {"command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps,
                                      "dtype": dtype})  # fmt: skip

    from sparseattn.evaluation.plots import ppl_table
    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.runs import RunDir

    hf_model = info.load(torch_dtype)
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        summary = run_ppl(hf_model, sparse_method, ids, prefill, steps, run, label=label)
        console.print(f"{label}: ppl {summary['ppl']:.3f}, {summary['tokens_per_second']:.2f} tokens/s, "
                      f"{summary['mean_attended_tokens']:.0f} KV tokens attended per step -> {run.path}", markup=False)
        dirs.append(run.path)
    console.print(ppl_table(dirs), markup=False)
    wrote(dirs, "config.json, tokens.jsonl, summary.json in each")


def plot(
    runs: list[Path] = typer.Argument(..., help="perplexity run directories (or parents of them)"),
    out: Path = typer.Option(
        Path("ppl.png"), help="the picture to write (.png, .pdf, .svg, ...); a markdown table goes beside it (.md)"
    ),
    title: str | None = typer.Option(None),
) -> None:
    """Perplexity and cumulative time vs position (the paper's Figure 3 layout) and a markdown table."""
    missing = [str(path) for path in runs if not path.exists()]
    if missing:
        raise bad("RUNS", f"{', '.join(missing)} does not exist")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        raise bad("--out", f"{out}: {out.suffix or 'no suffix'} is not a picture format; allowed: "
                  f"{', '.join('.' + f for f in sorted(formats))}")
    check_out(out.parent)
    found = []
    for path in runs:
        found += [path] if (path / "summary.json").exists() else sorted(p.parent for p in path.glob("*/summary.json"))
    if not found:
        raise bad("RUNS", f"no finished run (a directory with summary.json) in or under {', '.join(map(str, runs))}")

    from sparseattn.evaluation.plots import ppl_figure, ppl_table

    out.parent.mkdir(parents=True, exist_ok=True)
    ppl_figure(found, out, title)
    table = ppl_table(found)
    out.with_suffix(".md").write_text(table + "\n")
    console.print(table, markup=False)
    wrote([out, out.with_suffix(".md")])


def needle(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: str = typer.Option("passkey", help="passkey or a RULER task (niah_single_1, niah_multikey_1, ...)"),
    lengths: list[int] = typer.Option([4096], "--length", help="target prompt lengths in tokens, answer included (repeatable)"),
    depths: list[float] = typer.Option([10.0, 50.0, 90.0], "--depth", help="needle depths in percent, 0 to 100 (repeatable)"),
    samples: int = typer.Option(2, help=f"samples per length x depth (>= 1; {QUICK})"),
    haystack: str = typer.Option("paradise-lost", help="text for RULER's prose haystack (tasks with haystack='prose')"),
    max_new_tokens: int = typer.Option(16, help="answer tokens generated (>= 1)"),
    chat: bool = typer.Option(False, help="wrap prompts in the tokenizer's chat template"),
    seed: int = typer.Option(0),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Retrieval accuracy (passkey / RULER NIAH) by length x depth: a table, JSON and a heatmap per method."""
    from sparseattn.data.needle import RULER_NIAH, PasskeyTask

    torch_dtype = check_dtype(dtype)
    if task == "passkey":
        retrieval = PasskeyTask()
    elif task in RULER_NIAH:
        retrieval = RULER_NIAH[task]
    else:
        raise bad("--task", f"unknown task {task!r}; known: passkey, {', '.join(RULER_NIAH)}")
    for length in lengths:
        check_range("--length", length, 1)
    for depth in depths:
        check_range("--depth", depth, 0, 100)
    check_range("--samples", samples, 1)
    check_range("--max-new-tokens", max_new_tokens, 1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    for length in lengths:  # before any sample is built
        if info.window is not None and length > info.window:
            raise bad("--length", f"{length} is beyond the model's {info.window} positions; allowed: up to {info.window}")
    haystack_text = read_text(haystack, "--haystack") if getattr(retrieval, "haystack", None) == "prose" else None
    tokenizer = info.tokenizer()
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise bad("--chat", f"the tokenizer of {model!r} has no chat template")

    from sparseattn.evaluation.generation import needle_plan, shortest_lengths

    plan = needle_plan(retrieval, lengths, depths, samples, seed)
    shortest = shortest_lengths(retrieval, tokenizer, plan, max_new_tokens=max_new_tokens, haystack_text=haystack_text, chat=chat)
    for length in lengths:
        if length < shortest[length]:
            raise bad("--length", f"{length} is too short for {task}: its prompt without any haystack has "
                      f"{shortest[length] - max_new_tokens} tokens, and --max-new-tokens {max_new_tokens} come on top; "
                      f"allowed: {shortest[length]} to {info.window}")
    root = out / run_name(f"needle-{task}", dtype)
    runs = []
    for label, sparse_method, given in resolved:
        # Lengths, depths and samples say how much of the grid to run: more of them extends the run.
        config = {"command": "needle", "model": model, "task": task, "max_new_tokens": max_new_tokens, "chat": chat,
                  "seed": seed, "dtype": dtype, "method": label, "budget": given.get("budget"), "params": repr(sparse_method),
                  "haystack": haystack if haystack_text else None}
        runs.append((label, sparse_method, root / _slug(label), config))
    check_runs([(path, config) for _, _, path, config in runs])

    from sparseattn.evaluation.generation import accuracy_grid, run_needle
    from sparseattn.evaluation.plots import heatmap
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model = info.load(torch_dtype)
    table = Table(title=f"{task}: accuracy (%) by length and depth")
    table.add_column("method")
    table.add_column("length", justify="right")
    shown_depths = depths if getattr(retrieval, "num_needles", 1) == 1 else [-1.0]
    for d in shown_depths:
        table.add_column("spread" if d < 0 else f"{d:g}%", justify="right")
    table.add_column("mean", justify="right")
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        records = run_needle(hf_model, tokenizer, sparse_method, retrieval, lengths, depths, samples, run,
                             max_new_tokens=max_new_tokens, haystack_text=haystack_text, chat=chat, seed=seed)
        grid = accuracy_grid(records, lengths, shown_depths)
        for n, row in zip(lengths, grid):
            table.add_row(label, str(n), *(f"{v:.0f}" for v in row), f"{sum(row) / len(row):.0f}")
        mean = sum(r["score"] for r in records) / len(records)
        run.finish({**config, "lengths": lengths, "depths": shown_depths, "samples": samples, "accuracy": mean, "grid": grid,
                    "n_samples": len(records),
                    "mean_attended_tokens": sum(r["attended"] for r in records) / len(records)})
        heatmap(grid, [str(n) for n in lengths], ["spread" if d < 0 else f"{d:g}%" for d in shown_depths],
                run.path / "heatmap.png", f"{task}, {label}", "needle depth", "prompt tokens")
        write_json(run.path / "grid.json", {"lengths": lengths, "depths": shown_depths, "accuracy": grid})
        dirs.append(run.path)
    console.print(table)
    wrote(dirs, "config.json, samples.jsonl, summary.json, grid.json, heatmap.png in each")


def _ruler_tasks(names: Sequence[str]) -> list[str]:
    """``--task`` values resolved to RULER task names, in RULER's order, each once (``all``: the 11 offline tasks)."""
    from sparseattn.data.ruler import RULER_QA, RULER_TASKS

    allowed = f"all, {', '.join(RULER_TASKS)}"
    chosen: set[str] = set()
    for name in names:
        if name in RULER_QA:
            raise bad("--task", f"{name} needs the {RULER_QA[name]} data set, which cannot be fetched offline, so it is "
                      f"not generated; allowed: {allowed}")
        if name != "all" and name not in RULER_TASKS:
            close = difflib.get_close_matches(name, list(RULER_TASKS), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise bad("--task", f"unknown task {name!r}{hint}; allowed: {allowed}")
        chosen |= set(RULER_TASKS) if name == "all" else {name}
    return [name for name in RULER_TASKS if name in chosen]


def ruler(
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: list[str] = typer.Option(
        ["all"], "--task", help="RULER tasks (repeatable): niah_single_1..3, niah_multikey_1..3, niah_multivalue, "
        "niah_multiquery, vt, cwe, fwe, or all (qa_1/qa_2 need SQuAD/HotpotQA, not available offline)"
    ),
    lengths: list[int] = typer.Option([4096], "--length", help="target prompt lengths in tokens, answer included (repeatable)"),
    depths: list[float] = typer.Option(
        None, "--depth", help="needle depths in percent, 0 to 100, for the one-needle NIAH tasks (repeatable; default: "
        "RULER's random depth per sample); the other tasks spread their needles or have no depth"
    ),
    samples: int = typer.Option(1, help="samples per task x length x depth (>= 1; RULER: 500)"),
    haystack: str = typer.Option("paradise-lost", help="text for the prose haystack (RULER's essays) of NIAH tasks"),
    max_new_tokens: int | None = typer.Option(
        None, help="answer tokens generated, for every task (>= 1; default: RULER's, 128 NIAH, 30 vt, 120 cwe, 50 fwe)"
    ),
    chat: bool = typer.Option(False, help="wrap prompts in the tokenizer's chat template"),
    seed: int = typer.Option(0),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """RULER's synthetic tasks (NIAH, vt, cwe, fwe) for several methods, one prefill per prompt: heatmaps and a table."""
    from sparseattn.data.ruler import RULER_TASKS, tokens_to_generate

    torch_dtype = check_dtype(dtype)
    names = _ruler_tasks(task)
    depths = list(depths or [])
    for length in lengths:
        check_range("--length", length, 1)
    for depth in depths:
        check_range("--depth", depth, 0, 100)
    if depths and not any(RULER_TASKS[name].num_needles == 1 for name in names):
        raise bad("--depth", f"none of the tasks {', '.join(names)} has one needle to place (vt and the multi-needle "
                  "tasks spread theirs as RULER does, cwe and fwe have no depth); allowed: --depth with niah_single_1..3, "
                  "niah_multikey_2 or niah_multikey_3")
    check_range("--samples", samples, 1)
    check_range("--max-new-tokens", max_new_tokens, 1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    for length in lengths:
        if info.window is not None and length > info.window:
            raise bad("--length", f"{length} is beyond the model's {info.window} positions; allowed: up to {info.window}")
    prose = any(getattr(RULER_TASKS[name], "haystack", None) == "prose" for name in names)
    haystack_text = read_text(haystack, "--haystack") if prose else None
    tokenizer = info.tokenizer()
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise bad("--chat", f"the tokenizer of {model!r} has no chat template")

    from sparseattn.evaluation.generation import (
        build_samples,
        needle_plan,
        shortest_lengths,
    )

    # Every prompt is built before the weights load: a length a task cannot be built at fails in seconds.
    root = out / run_name("ruler", dtype)
    jobs = []
    for name in names:
        retrieval, answer = RULER_TASKS[name], max_new_tokens or tokens_to_generate(name)
        text = haystack_text if getattr(retrieval, "haystack", None) == "prose" else None
        plan = needle_plan(retrieval, lengths, depths, samples, seed)
        shortest = shortest_lengths(retrieval, tokenizer, plan, max_new_tokens=answer, haystack_text=text, chat=chat)
        for length in lengths:
            if length < shortest[length]:
                raise bad("--length", f"{length} is too short for {name}: its prompt without any haystack has "
                          f"{shortest[length] - answer} tokens, and {answer} answer tokens come on top; "
                          f"allowed: {shortest[length]} to {info.window}")
        try:
            built = build_samples(retrieval, tokenizer, plan, max_new_tokens=answer, haystack_text=text, chat=chat)
        except ValueError as err:
            raise bad("--length", str(err)) from None
        runs = []
        for label, sparse_method, given in resolved:
            config = {"command": "ruler", "model": model, "task": name, "task_params": repr(retrieval),
                      "max_new_tokens": answer, "chat": chat, "seed": seed, "dtype": dtype, "method": label,
                      "budget": given.get("budget"), "params": repr(sparse_method), "haystack": haystack if text else None}
            runs.append((label, sparse_method, root / name / _slug(label), config))
        jobs.append((name, retrieval, answer, plan, built, runs))
    check_runs([(path, config) for *_, runs in jobs for _, _, path, config in runs])

    from sparseattn.evaluation.generation import accuracy_grid, depth_label, run_shared
    from sparseattn.evaluation.plots import heatmap, ruler_markdown, ruler_rows
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model = info.load(torch_dtype)
    labels = [label for label, _, _ in resolved]
    scores: dict[str, dict[str, dict[int, float]]] = {}
    for name, retrieval, answer, plan, built, runs in jobs:
        dirs = {label: (sparse_method, RunDir(path, config)) for label, sparse_method, path, config in runs}
        records = run_shared(hf_model, tokenizer, retrieval, dirs, built, max_new_tokens=answer, chat=chat)
        shown = list(dict.fromkeys(d for _, d, _ in plan))
        columns = [depth_label(retrieval, d) for d in shown]
        scores[name] = {}
        for label, (_, run) in dirs.items():
            mine = records[label]
            grid = accuracy_grid(mine, lengths, shown)
            scores[name][label] = {n: sum(row) / len(row) for n, row in zip(lengths, grid)}
            run.finish({**run.config, "lengths": lengths, "depths": shown, "samples": samples, "grid": grid,
                        "accuracy": sum(r["score"] for r in mine) / len(mine), "n_samples": len(mine),
                        "mean_attended_tokens": sum(r["attended"] for r in mine) / len(mine)})
            xlabel = "no needle depth: the answer words are spread over the whole text" if retrieval.num_needles == 0 \
                else "needle depth"
            heatmap(grid, [str(n) for n in lengths], columns, run.path / "heatmap.png", f"{name}, {label}", xlabel,
                    "prompt tokens")
            write_json(run.path / "grid.json", {"lengths": lengths, "depths": shown, "columns": columns, "accuracy": grid})
    rows = ruler_rows(scores, lengths)
    table = Table(title=f"RULER accuracy (%), {samples} sample(s) per cell; mean: over the tasks")
    for column in ("task", "length", *labels):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["task"], str(row["length"]), *("-" if row.get(m) is None else f"{row[m]:.1f}" for m in labels))
    console.print(table)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "summary.json", {"tasks": names, "methods": labels, "lengths": lengths, "samples": samples,
                                       "scores": scores, "rows": rows})
    (root / "summary.md").write_text(ruler_markdown(rows, labels) + "\n")
    matrix = [[float("nan") if r.get(m) is None else r[m] for m in labels] for r in rows]
    heatmap(matrix, [f"{r['task']} @ {r['length']}" for r in rows], labels, root / "summary.png",
            f"RULER accuracy (%), {samples} sample(s) per cell", "method", "task @ length")
    wrote([root / "summary.md", root / "summary.json", root / "summary.png"],
          "and per task and method: config.json, samples.jsonl, summary.json, grid.json, heatmap.png")


def diagnose(
    model: str = MODEL,
    # The ablations swap one part of Algorithm 1 (radar-alg1): the default compares them with it, on one grid.
    method: list[str] = typer.Option(["radar-alg1", "radar-exact", "radar-recent", "radar-random"], "--method", "-m",
                                     help="NAME[:key=value,...]; repeat for several methods"),
    budget: int | None = typer.Option(
        512, help="past KV tokens per decode step (>= 1) for every method with a budget whose spec sets neither budget "
        "nor top_k (recall and error depend on it)"
    ),
    text: str = typer.Option("paradise-lost", help="a text name or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled (>= 1)"),
    steps: int = typer.Option(16, help=f"decode steps measured (>= 1; {QUICK})"),
    picture_heads: list[int] = typer.Option([0, 4, 8], "--head", help="query heads drawn in the appendix picture"),
    picture_layer: int = typer.Option(0, help="layer drawn in the appendix picture"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """Per layer and head: top-1/top-3 segment hit rate vs exact segment attention, mass recall, output error."""
    torch_dtype = check_dtype(dtype)
    check_range("--prefill", prefill, 1)
    check_range("--steps", steps, 1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    layers = getattr(info.config, "num_hidden_layers", None)
    heads = getattr(info.config, "num_attention_heads", None)
    check_range("--picture-layer", picture_layer, 0, None if layers is None else layers - 1)
    for head in picture_heads:
        check_range("--head", head, 0, None if heads is None else heads - 1)
    needed = prefill + steps
    how = f"--prefill {prefill} + --steps {steps}"
    check_positions(info, ["--prefill", "--steps"], needed, how, f"--prefill + --steps <= {info.window}")
    ids = text_ids(info.tokenizer(), read_text(text), text, needed, how)
    root = out / run_name("diagnose", dtype, _slug(text), f"p{prefill}", f"s{steps}")
    runs = plan_runs(root, resolved, {"command": "diagnose", "model": model, "text": text, "prefill": prefill,
                                      "steps": steps, "dtype": dtype})  # fmt: skip

    from sparseattn.evaluation.diagnose import Probe, summarize_probes
    from sparseattn.evaluation.plots import attention_pictures
    from sparseattn.evaluation.runs import RunDir
    from sparseattn.hf import apply, cache_kwargs

    hf_model = info.load(torch_dtype)
    table = Table(title=f"diagnostics on {text}, prefill {prefill}, {steps} steps (dense trajectory)")
    for column in ("method", "hit@1", "hit@3", "mass recall", "rel. error", "attended", "segments"):
        table.add_column(column, justify="right")
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        if not run.finished:
            probe = Probe(sparse_method, pictures=True)
            with apply(hf_model, probe) as sparse, torch.no_grad():
                cache = sparse.new_cache()
                with forward_progress(hf_model, f"{label}: prefill {prefill} tokens"):
                    hf_model(ids[None, :prefill], **cache_kwargs(hf_model, cache), use_cache=True)
                with progress(f"{label}: decode with exact attention beside", total=steps, unit="steps") as bar:
                    for i in range(steps):
                        hf_model(ids[None, prefill + i : prefill + i + 1], **cache_kwargs(hf_model, cache), use_cache=True)
                        bar.advance()
            states = [layer.state for layer in cache.sparse_layers]
            summary = {**config, **summarize_probes(states)}
            pictures = states[picture_layer].records.pictures if picture_layer < len(states) else []
            if pictures:
                shown = [h for h in picture_heads if h < pictures[0][0].shape[0]]
                attention_pictures(pictures, shown, run.path / "attention.png", f"{label}, layer {picture_layer}")
            run.finish(summary)
        summary = run.summary()
        o = summary["overall"]
        segments = sum(r["mean_segments"] for r in summary["per_layer"]) / max(1, len(summary["per_layer"]))
        table.add_row(label, *(f"{100 * o[k]:.1f}%" for k in ("hit@1", "hit@3", "recall")), f"{o['rel_error']:.3f}",
                      f"{o['attended']:.0f}", f"{segments:.0f}")
        dirs.append(run.path)
    console.print(table)
    console.print("paper (Llama-3, 10 segments): Radar 34.38% / 62.5%, recency 18.75% / 46.88%, random 10% / 30%")
    wrote(dirs, "config.json, summary.json, attention.png (segment methods) in each")


def sweep(
    model: str = MODEL,
    text: str = typer.Option("pydecimal", help="a text name or a file"),
    prefill: int = typer.Option(2048, help="prompt tokens prefilled densely (>= 0)"),
    steps: int = typer.Option(128, help=f"decode steps per run (>= 1; {QUICK})"),
    n_features: list[int] = typer.Option([64, 256, 1024, 2048], "--n", help="random feature counts n (k fixed)"),
    top_k: list[int] = typer.Option([2, 4, 8, 16], "--k", help="segments k (n fixed)"),
    fixed_n: int = typer.Option(2048, help="n while sweeping k"),
    fixed_k: int = typer.Option(8, help="k while sweeping n and in the ablation"),
    window: int = typer.Option(0, help="recent window for every Radar run (>= 0)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """The paper's n and k sweeps and the selection ablation (lowest / random / recent / approximate / exact)."""
    torch_dtype = check_dtype(dtype)
    check_range("--prefill", prefill, 0)
    check_range("--steps", steps, 1)
    for option, values in (("--n", n_features), ("--k", top_k), ("--fixed-n", [fixed_n]), ("--fixed-k", [fixed_k])):
        for value in values:
            check_range(option, value, 1)
    check_range("--window", window, 0)
    check_out(out)
    info = inspect_model(model)
    needed = prefill + steps + 1
    how = f"--prefill {prefill} + --steps {steps} + 1"
    check_positions(info, ["--prefill", "--steps"], needed, how, f"--prefill + --steps <= {(info.window or 0) - 1}")
    ids = text_ids(info.tokenizer(), read_text(text), text, needed, how)
    root = out / run_name("sweep", dtype, _slug(text), f"p{prefill}", f"s{steps}")
    # Algorithm 1's parts throughout: the ablation presets swap one part of radar-alg1, so the selection
    # panel compares them with radar-alg1 on the same segment grid.
    panels_specs = {
        "n (random features)": [(n, f"radar-alg1:n_features={n},top_k={fixed_k},window={window}") for n in n_features],
        "k (segments)": [(k, f"radar-alg1:n_features={fixed_n},top_k={k},window={window}") for k in top_k],
        "selection": [(name, f"{spec}:top_k={fixed_k},window={window}")
                      for name, spec in (("lowest", "radar-lowest"), ("random", "radar-random"), ("recent", "radar-recent"),
                                         ("radar", "radar-alg1"), ("exact", "radar-exact"))],
    }
    runs = {}
    for spec in ["dense"] + [spec for points in panels_specs.values() for _, spec in points]:
        label, sparse_method, given = parse_method(spec)
        config = {"command": "ppl", "model": model, "text": text, "prefill": prefill, "steps": steps, "dtype": dtype,
                  "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        runs[spec] = (label, sparse_method, root / _slug(label), config)
    check_runs([(path, config) for _, _, path, config in runs.values()])

    from sparseattn.evaluation.plots import sweep_figure
    from sparseattn.evaluation.ppl import run_ppl
    from sparseattn.evaluation.runs import RunDir, write_json

    hf_model = info.load(torch_dtype)

    def measure(spec: str) -> float:
        label, sparse_method, path, config = runs[spec]
        return run_ppl(hf_model, sparse_method, ids, prefill, steps, RunDir(path, config), label=label)["ppl"]

    dense = measure("dense")
    panels = {name: [(value, measure(spec)) for value, spec in points] for name, points in panels_specs.items()}
    write_json(root / "sweep.json", {"dense": dense, "panels": {k: [list(p) for p in v] for k, v in panels.items()}})
    sweep_figure(panels, root / "sweep.png", f"{text}: prefill {prefill}, {steps} steps", reference=dense)
    table = Table(title=f"sweep on {text} (dense ppl {dense:.3f})")
    for column in ("panel", "value", "ppl"):
        table.add_column(column)
    for name, points in panels.items():
        for value, metric in points:
            table.add_row(name, str(value), f"{metric:.3f}")
    console.print(table)
    wrote([root / "sweep.png", root / "sweep.json"], f"and one run directory per point under {root}")


def longbench_run(
    data_dir: Path = typer.Option(..., help="directory of LongBench v1 {task}.jsonl files (local; nothing is downloaded)"),
    model: str = MODEL,
    method: list[str] = METHOD,
    budget: int | None = BUDGET,
    task: list[str] = typer.Option(None, "--task", help="tasks to run (default: every {task}.jsonl present)"),
    max_length: int = typer.Option(7500, help="middle-truncate prompts to this many tokens (the model's window minus room)"),
    limit: int | None = typer.Option(None, help="first N examples per task (>= 1; quick runs)"),
    chat: bool = typer.Option(True, help="chat template (except the tasks LongBench runs without one)"),
    out: Path = OUT,
    dtype: str = DTYPE,
) -> None:
    """LongBench v1 predictions under each method (pred.py's protocol), then scored with the official metrics."""
    from sparseattn.evaluation import longbench as lb

    torch_dtype = check_dtype(dtype)
    if not data_dir.is_dir():
        raise bad("--data-dir", f"{data_dir} is not a directory")
    for name in task or []:
        try:
            lb.check_task(name)
        except ValueError as err:
            raise bad("--task", str(err)) from None
        if not (data_dir / f"{name}.jsonl").is_file():
            raise bad("--task", f"{name}: there is no {data_dir / f'{name}.jsonl'}")
    tasks = task or [t for t in lb.TASKS if (data_dir / f"{t}.jsonl").exists()]
    if not tasks:
        raise bad("--data-dir", f"no LongBench task files ({', '.join(lb.TASKS)}.jsonl) in {data_dir}")
    check_range("--max-length", max_length, 1)
    check_range("--limit", limit, 1)
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    answer = max(lb.MAX_NEW_TOKENS[t] for t in tasks)
    check_positions(info, "--max-length", max_length + answer, f"--max-length {max_length} + {answer} answer tokens",
                    f"--max-length <= {(info.window or 0) - answer} for these tasks")
    root = out / run_name("longbench", dtype)
    runs = []
    for label, sparse_method, given in resolved:
        # The tasks and --limit say how much of the experiment to run, not which one: more of either extends it.
        config = {"command": "longbench", "model": model, "data_dir": str(data_dir), "max_length": max_length,
                  "chat": chat, "dtype": dtype, "method": label, "budget": given.get("budget"), "params": repr(sparse_method)}
        runs.append((label, sparse_method, root / _slug(label), config))
    check_runs([(path, config) for _, _, path, config in runs])

    from sparseattn.evaluation.generation import run_longbench
    from sparseattn.evaluation.runs import RunDir, write_json

    tokenizer = info.tokenizer()
    hf_model = info.load(torch_dtype)
    dirs = []
    for label, sparse_method, path, config in runs:
        run = RunDir(path, config)
        run_longbench(hf_model, tokenizer, sparse_method, data_dir, tasks, max_length, run, limit=limit, chat=chat)
        result = lb.score_directory(run.path)
        write_json(run.path / "result.json", {**result, "limit": limit})
        console.print(f"{label}: {json.dumps(result.get('scores', result))}", markup=False)
        dirs.append(run.path)
    wrote(dirs, "config.json, {task}.jsonl predictions, result.json in each")
