"""The serving benchmark's workload: distinct prompts of real text, a pass key hidden in each, the true text after it.

``batch`` *distinct* prompts (:func:`workload`), each ``context`` tokens of a different CPython stdlib
module (windows of :data:`~sparseattn.evaluation.batches.STDLIB_TEXTS`, no shared prefix), with a pass-key
comment line hidden in each at its own depth (10% to 90%, :func:`depths`), and the file's true next tokens
held back for teacher forcing. A second, labelled workload (:func:`shared_prompts`) has every row read row
0's prompt followed by its own short line: what prefix caching makes of a shared document.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: The pass key's line, a comment in the code it hides in, and the question after the prompt.
NEEDLE = "# The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n# Question: what is the pass key? Answer: the pass key is"
#: Tokens generated for the pass-key answer.
ANSWER_TOKENS = 8
#: Positions kept beyond the prompt and the generated tokens: the pass-key question and answer, the shared workload's line.
MARGIN = 32


def positions_needed(context: int, steps: int, held: int = 0) -> int:
    """The engines' ``max_model_len``: the prompt, the longer of the timed and the forced tokens, and :data:`MARGIN`.

    >>> positions_needed(8000, 64, 32)
    8097
    """
    return context + max(steps + 1, held) + MARGIN


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


def passkey_found(answers: Sequence[str], rows: Sequence[Prompt]) -> float:
    """The share of answers containing their row's key.

    >>> passkey_found([" 12345.", " 1234"], [Prompt([], [], [], "12345", 0, ""), Prompt([], [], [], "54321", 0, "")])
    0.5
    """
    return sum(row.key in answer for answer, row in zip(answers, rows)) / len(rows)
