"""What the commands share: their common options, the checks of their input, method specs, the model
and the text a command reads, and where its results go.

Every command checks all of its input before any work starts (the model's weights are loaded last):
a mistake ends with one line naming the option, the value and what is allowed, and exit code 2.

Methods are named on the command line as ``NAME[:key=value,...]`` with the keys of the
:mod:`sparseattn.registry` options that the method takes (``sparseattn methods`` lists them), e.g.
``radar:top_k=8,n_features=256`` or ``h2o:heavy_ratio=0.25``. ``--budget`` has one meaning for every
method: the past KV tokens a decode step may attend, sinks and recent window included (the Radar
family turns it into top-k segments, the evicting methods keep that many tokens per KV head). It sets
the budget of every method that has one and whose spec sets neither ``budget`` nor ``top_k``; dense
has no budget and runs without one.

A command that writes results writes a directory per run (``--out``) holding its resolved config,
its records as they are produced, and a summary; rerunning skips what is finished and resumes what
is not (:class:`sparseattn.evaluation.runs.RunDir`).
"""

from __future__ import annotations

import difflib
import re
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer
from rich.markup import escape

from sparseattn import registry
from sparseattn.cli.consoles import console, err_console
from sparseattn.progress import progress

#: The spec of the embedded default model: ``sparseattn.hf.DEFAULT_MODEL``, repeated rather than
#: imported because importing ``sparseattn.hf`` loads transformers (seconds), which a mistyped
#: option should not wait for.
DEFAULT_MODEL = "default"

#: Said in the help of the sizes whose defaults are small.
QUICK = "quick defaults finish in minutes on a 2-core CPU; raise them for full-size runs"

#: The ``--dtype`` values, and the torch dtypes they name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The options several commands take, with one spelling and one help text.
MODEL = typer.Option(DEFAULT_MODEL, help="'default' (SmolLM2-135M-Instruct), a local HF directory or a .gguf file")
METHOD = typer.Option(["dense", "radar"], "--method", "-m", help="NAME[:key=value,...]; repeat for several methods")
BUDGET = typer.Option(
    None,
    help="past KV tokens a decode step may attend (>= 1, sinks and window included), for every method with a budget "
    "whose spec sets neither budget nor top_k",
)
DTYPE = typer.Option("float32", help="float32, bfloat16 or float16")
OUT = typer.Option(Path("results"), help="root directory of the runs")


def bad(options: str | Sequence[str], message: str) -> typer.BadParameter:
    """A usage error (exit code 2) naming ``options``: ``Invalid value for '--steps': ...``."""
    return typer.BadParameter(message, param_hint=[options] if isinstance(options, str) else list(options))


def refuse(message: str) -> typer.Exit:
    """A refusal that is not about one option's value (vLLM missing): one ``Error:`` line, exit status 2."""
    sys.stdout.flush()
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(2)


def check_range(option: str, value: float | None, low: float, high: float | None = None) -> None:
    """Refuse ``value`` outside ``[low, high]`` (no upper end when ``high`` is None); None passes."""
    if value is None or (low <= value and (high is None or value <= high)):
        return
    allowed = f">= {_number(low)}" if high is None else f"from {_number(low)} to {_number(high)}"
    raise bad(option, f"{_number(value)} is out of range; allowed: {allowed}")


#: ``--segment``'s help, for ``serve`` and ``serving-bench``.
SEGMENT_HELP = ("the paged engine's segments inside vLLM's pages: auto (the method's own grid at the longest sequence, e.g. "
                "radar+adaptive's 4 tokens at 8k), page (a page is a segment: fastest, coarser), or a number of tokens "
                "dividing the block size")


def segment_choice(value: str, option: str = "--segment") -> int | str | None:
    """``--segment`` as the plugin's config takes it: ``"auto"``, None for ``"page"``, or a number of tokens (>= 1).

    >>> segment_choice("auto"), segment_choice("page"), segment_choice("4")
    ('auto', None, 4)
    """
    word = value.strip().lower()
    if word in ("auto", "page"):
        return None if word == "page" else word
    if not word.isdigit():
        raise bad(option, f"{value!r} is not allowed; allowed: auto, page or a number of tokens dividing the block size")
    check_range(option, int(word), 1)
    return int(word)


def _number(value: float) -> str:
    """``150`` for 150.0 and for 150 (however large), ``2.5`` for 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def check_dtype(dtype: str, allowed: Sequence[str] = tuple(DTYPES)) -> torch.dtype:
    """The torch dtype ``--dtype`` names, one of ``allowed``."""
    if dtype not in allowed:
        raise bad("--dtype", f"{dtype!r} is not one of {', '.join(allowed)}")
    return DTYPES[dtype]


def check_decoding(dtype: str, prefill: int, steps: int, min_prefill: int = 0) -> torch.dtype:
    """The torch dtype of a run that prefills a text and decodes on, after checking ``--prefill`` and ``--steps``."""
    torch_dtype = check_dtype(dtype)
    check_range("--prefill", prefill, min_prefill)
    check_range("--steps", steps, 1)
    return torch_dtype


def check_grid(lengths: Sequence[int], depths: Sequence[float], samples: int, max_new_tokens: int | None) -> None:
    """Refuse a retrieval grid's ``--length`` below 1, ``--depth`` outside 0 to 100 percent, ``--samples`` or
    ``--max-new-tokens`` below 1."""
    for length in lengths:
        check_range("--length", length, 1)
    for depth in depths:
        check_range("--depth", depth, 0, 100)
    check_range("--samples", samples, 1)
    check_range("--max-new-tokens", max_new_tokens, 1)


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


def check_lengths(info: ModelInfo, lengths: Sequence[int]) -> None:
    """Refuse a ``--length`` (a prompt with its answer) beyond the model's positions."""
    for length in lengths:
        if info.window is not None and length > info.window:
            raise bad("--length", f"{length} is beyond the model's {info.window} positions; allowed: up to {info.window}")


def chat_tokenizer(info: ModelInfo, chat: bool):
    """The model's tokenizer; with ``--chat``, refused unless it has a chat template."""
    tokenizer = info.tokenizer()
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise bad("--chat", f"the tokenizer of {info.spec!r} has no chat template")
    return tokenizer


def check_buildable(prompts, plan: Sequence[tuple[int, float, int]], window: int | None, answer: str) -> None:
    """Refuse a ``--length`` of the ``plan`` shorter than its prompt without any haystack, plus the answer.

    ``prompts`` is a :class:`sparseattn.evaluation.generation.RetrievalPrompts`; ``answer`` says where
    the answer's tokens come from (``--max-new-tokens 16``).
    """
    shortest = prompts.shortest_lengths(plan)
    for length in dict.fromkeys(length for length, _, _ in plan):
        if length < shortest[length]:
            raise bad("--length", f"{length} is too short for {prompts.task.name}: its prompt without any haystack has "
                      f"{shortest[length] - prompts.max_new_tokens} tokens, and {answer} come on top; "
                      f"allowed: {shortest[length]} to {window}")


def retrieval_inputs(model: str, method: Sequence[str], budget: int | None, out: Path, lengths: Sequence[int],
                     haystack: str | None, chat: bool):  # fmt: skip
    """What a retrieval command (``needle``, ``ruler``) checks and reads before any prompt is built:
    ``(methods, model info, haystack text or None, tokenizer)``; ``haystack`` None when no task needs one."""
    resolved = parse_methods(method, budget)
    check_out(out)
    info = inspect_model(model)
    check_lengths(info, lengths)
    haystack_text = None if haystack is None else read_text(haystack, "--haystack")
    return resolved, info, haystack_text, chat_tokenizer(info, chat)


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


def text_tokens(info: ModelInfo, text: str, prefill: int, steps: int, extra: int = 0) -> torch.Tensor:
    """The first ``prefill + steps + extra`` tokens of the text ``--text`` names: ``[prefill + steps + extra]``.

    Refused where the model has fewer positions or the text fewer tokens (``extra``: the tokens a run
    reads beyond its steps, such as the target of the last one).
    """
    from sparseattn.evaluation.ppl import tokenize

    needed = prefill + steps + extra
    how = f"--prefill {prefill} + --steps {steps}" + (f" + {extra}" if extra else "")
    allowed = f"--prefill + --steps <= {(info.window or 0) - extra}"
    check_positions(info, ["--prefill", "--steps"], needed, how, allowed)
    tokenizer, content = info.tokenizer(), read_text(text)
    try:
        return tokenize(tokenizer, content, needed, name=text)
    except ValueError as err:
        raise bad("--text", f"{err} ({how}); use a longer text or fewer steps") from None


def flag(key: str) -> str:
    """How an option is spelled as a command-line flag: ``top_k`` -> ``--top-k``."""
    return "--" + key.replace("_", "-")


def range_problem(key: str, value: object) -> str | None:
    """What is wrong with ``value`` for the option ``key`` of any registered method, None if nothing."""
    return registry.all_options()[key].problem(value)


def parse_method(spec: str, budget: int | None = None) -> tuple[str, object, dict]:
    """``"radar:top_k=8"`` -> ``(label, method instance, options given)``; ``budget`` fills in a missing budget.

    The grammar and every check are the registry's (:func:`sparseattn.registry.parse`, shared with the
    vLLM plugin and lm-eval); a refusal becomes the ``--method`` option's error.
    """
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", FutureWarning)
            parsed = registry.parse(spec, budget, budget_option="--budget")
    except (ValueError, registry.PluginError) as err:  # a bad spec, or a broken third-party method package
        raise bad("--method", str(err)) from None
    for warning in said:  # a former name: one line saying what it is now, not a Python traceback line
        err_console.print(f"note: {escape(str(warning.message))}", highlight=False)
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


def vllm_method(spec: str, budget: int | None, option: str = "--method") -> tuple[str, dict]:
    """``(label, additional_config["sparseattn"])`` for a method spec, refused unless vLLM's paged engine runs it.

    The spec is parsed by the registry's grammar, which the vLLM plugin reads ``additional_config``
    with too (:func:`sparseattn.registry.parse`): what is served is what was checked here.
    """
    from sparseattn.vllm.paged import PagedPolicy

    ((label, built, given),) = parse_methods([spec], budget)
    try:
        PagedPolicy(built, label)  # eviction methods and always-kept parts are refused, saying why
    except ValueError as err:
        raise bad(option, str(err)) from None
    return label, {"method": label.partition(":")[0], **given}


def slug(label: str) -> str:
    """``label`` as a directory name: every run of other characters becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label)


def run_name(kind: str, dtype: str, *parts: object) -> str:
    """The directory of one experiment under ``--out``: ``ppl-pydecimal-p2048-s256`` in float32, with
    ``-bfloat16`` (the dtype) appended in another dtype, so that runs in two dtypes never meet in one
    directory."""
    name = "-".join([kind, *map(str, parts)])
    return name if dtype == "float32" else f"{name}-{dtype}"


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
        runs.append((label, sparse_method, root / slug(label), config))
    check_runs([(path, config) for _, _, path, config in runs])
    return runs


def wrote(paths: Sequence[Path], what: str = "") -> None:
    """The last line of every command that writes files: where they are."""
    console.print(f"wrote {', '.join(map(str, paths))}{f' ({what})' if what else ''}", markup=False)
