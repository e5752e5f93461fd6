"""LongBench v1, English and code tasks: prompts, data loading, metrics and scoring.

LongBench (Bai et al., ACL 2024, https://github.com/THUDM/LongBench) scores a model's free-text
answers with a per-task metric. This module re-implements the official v1 pipeline for the 16
English and code tasks so that scores are comparable with published numbers:

* ``PROMPTS`` and ``MAX_NEW_TOKENS`` are the data of ``LongBench/config/dataset2prompt.json`` and
  ``dataset2maxlen.json``, character for character (typos included: changing a prompt changes the
  benchmark);
* the metrics follow ``LongBench/metrics.py``, including its quirks, each noted where it is kept;
* ``score_task`` follows ``LongBench/eval.py``: first line only for trec, triviaqa and samsum, the
  best score over the gold answers, and ``round(100 * mean, 2)`` per task.

The Chinese tasks (multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh) are not included;
they need the jieba segmenter and are refused with an explanation.

>>> qa_f1_score("The Eiffel Tower, in Paris", "Eiffel Tower")  # 2 of 4 tokens right, all of 2 found
0.6666666666666666
>>> score_task("passage_retrieval_en", [{"pred": "Paragraph 3", "answers": ["Paragraph 3"]},
...                                     {"pred": "Paragraph 3 or 4", "answers": ["Paragraph 4"]}])
75.0
"""

from __future__ import annotations

import difflib
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from sparseattn.validation import check_int

TASKS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en",
    "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news",
    "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en",
    "lcc", "repobench-p",
)  # fmt: skip
"""The 16 English and code tasks, in LongBench's order (grouped by category)."""

CHINESE_TASKS: tuple[str, ...] = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
"""LongBench v1 tasks that are not supported here (their metrics need the jieba segmenter)."""

CATEGORIES: dict[str, str] = {
    "narrativeqa": "Single-Doc QA", "qasper": "Single-Doc QA", "multifieldqa_en": "Single-Doc QA",
    "hotpotqa": "Multi-Doc QA", "2wikimqa": "Multi-Doc QA", "musique": "Multi-Doc QA",
    "gov_report": "Summarization", "qmsum": "Summarization", "multi_news": "Summarization",
    "trec": "Few-shot Learning", "triviaqa": "Few-shot Learning", "samsum": "Few-shot Learning",
    "passage_count": "Synthetic", "passage_retrieval_en": "Synthetic",
    "lcc": "Code", "repobench-p": "Code",
}  # fmt: skip
"""Task -> LongBench category (the six columns of the LongBench paper's tables)."""

CATEGORY_ORDER: tuple[str, ...] = (
    "Single-Doc QA", "Multi-Doc QA", "Summarization", "Few-shot Learning", "Synthetic", "Code",
)  # fmt: skip

# ``dataset2maxlen.json``: the ``max_new_tokens`` of generation for each task.
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128,
    "passage_count": 32, "passage_retrieval_en": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

_MULTI_DOC_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\n"
    "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_INSTRUCTION = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
    "answered based on the information in the article, write \"unanswerable\". If the question is a "
    "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)

# ``dataset2prompt.json``, filled with ``str.format(**example)``. "asconcisely" (narrativeqa), the
# space before "Answer" (qasper) and the spaces before newlines (multi_news, lcc, repobench-p) are
# in the official file and kept.
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_INSTRUCTION}"
        "\n\nArticle: {context}\n\n"
        f" Answer the question based on the above article {_QASPER_INSTRUCTION}"
        "\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and do not "
        "output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "hotpotqa": _MULTI_DOC_QA,
    "2wikimqa": _MULTI_DOC_QA,
    "musique": _MULTI_DOC_QA,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\n"
        "Now, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
        "{context}\n\n{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be "
        "like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

FIRST_LINE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum"})
"""Tasks whose prediction is cut to its first line before scoring (few-shot models keep going)."""

NO_CHAT_TEMPLATE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lcc", "repobench-p"})
"""Tasks that ``pred.py`` sends to chat models without the chat template (continuation-style prompts)."""


def check_task(task: str) -> str:
    """Return ``task`` if it is one of the 16 supported tasks, else raise a ``ValueError`` that says why."""
    if task in TASKS:
        return task
    if task in CHINESE_TASKS:
        raise ValueError(
            f"LongBench task {task!r} is Chinese; only the 16 English and code tasks are supported "
            f"(the Chinese metrics need the jieba segmenter): {', '.join(TASKS)}"
        )
    raise ValueError(f"unknown LongBench task {task!r}; known tasks: {', '.join(TASKS)}")


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop ASCII punctuation, articles and extra whitespace.

    >>> normalize_answer("The  Cat's, hat!")
    'cats hat'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing overlaps).

    >>> token_f1(["a", "b", "b"], ["b", "b", "c", "d"])  # 2 shared: P = 2/3, R = 2/4
    0.5714285714285715
    """
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """Token F1 after ``normalize_answer``: the QA tasks and triviaqa."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def rouge_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """ROUGE-L F of the PyPI ``rouge==1.0.1`` package, 0.0 where that package raises: the summaries.

    The package is the reference, not the ROUGE-L of the literature: it splits on "." into sentences,
    counts distinct words, and rebuilds each LCS recursively, so a sentence pair whose LCS path is
    longer than Python's recursion limit raises ``RecursionError``. LongBench catches every error
    (also the ``AssertionError`` of an empty prediction) and scores 0.0, and so do we. The default
    ``Rouge()`` also computes ROUGE-1 and ROUGE-2; it is kept as LongBench calls it, so that the same
    inputs fail.
    """
    try:
        from rouge import Rouge
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("rouge_score needs the PyPI package rouge==1.0.1: pip install rouge==1.0.1") from err
    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # noqa: BLE001 - LongBench scores any failure of the package as 0.0
        return 0.0
    return scores["rouge-l"]["f"]


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """trec: 1/m when the gold class is among the m class names found in the prediction, else 0.

    Class names that are substrings of the gold class (e.g. "Other" inside "Other location") are
    dropped from the matches first. Two quirks of ``metrics.py`` are kept for parity: the drop loop
    removes from the list it iterates over, so the match right after a dropped one is never checked;
    and its fallback to the most similar class runs only when ``matches != 0``, which a list always
    is, so a prediction that names no class scores 0.

    >>> classes = ["Other", "location", "Other location"]
    >>> classification_score("Other location", "Other location", classes)  # "location" survives
    0.5
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes (the task's class names), got None")
    matches = [name for name in all_classes if name in prediction]
    for name in matches:  # mutates while iterating on purpose: LongBench's skip-after-remove
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    """The share of ``numbers`` equal to ``target`` (0 when there are none)."""
    return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """passage_retrieval_en: the share of the numbers in the prediction that are the gold paragraph's.

    >>> retrieval_score("Paragraph 12, or maybe Paragraph 3", "Paragraph 12")
    0.5
    """
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval_score: gold answer {ground_truth!r} has no 'Paragraph <n>'")
    return _share_equal(re.findall(r"\d+", prediction), found[0])


def count_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """passage_count: the share of the numbers in the prediction equal to the gold count.

    >>> count_score("I count 7 unique paragraphs out of 10", "7")
    0.5
    """
    return _share_equal(re.findall(r"\d+", prediction), str(ground_truth))


def fuzz_ratio(s1: str, s2: str) -> int:
    """``fuzzywuzzy.fuzz.ratio`` on its pure-Python path: ``round(100 * difflib ratio)``, an int.

    fuzzywuzzy switches to python-Levenshtein when that is installed (and rapidfuzz is a different
    package): both compute ``2 * LCS / (len1 + len2)`` exactly, while ``difflib.SequenceMatcher``
    matches the longest block first and can find fewer characters, so their ratios are higher (about
    2 points on lcc and repobench-p). LongBench's published numbers come from the difflib path, so we
    call difflib directly and the result cannot depend on what else is installed. The checks run in
    fuzzywuzzy's decorator order: equal strings give 100 (even two empty ones), then an empty string
    gives 0; ``round`` is Python's (half to even).

    >>> fuzz_ratio("bcb", "cab")  # difflib pairs one "b"; the LCS "cb" would give 67
    33
    """
    if s1 == s2:
        return 100
    if not s1 or not s2:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))


def first_code_line(prediction: str) -> str:
    """The first line of a code prediction that contains no ````` ``, ``#`` or ``//`` ("" if none).

    Despite the usual description ("not starting with"), ``metrics.py`` skips every line that
    *contains* one of the three, which is what we do.

    >>> first_code_line("\\n```python\\n# the next line\\nx = f(y)  # done\\nreturn x\\n")
    'return x'
    """
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None) -> float:
    """lcc and repobench-p: ``fuzz_ratio`` of the first code line of the prediction and the gold line, / 100."""
    return fuzz_ratio(first_code_line(prediction), ground_truth) / 100


Metric = Callable[..., float]

METRICS: dict[str, Metric] = {
    "narrativeqa": qa_f1_score, "qasper": qa_f1_score, "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score, "2wikimqa": qa_f1_score, "musique": qa_f1_score,
    "gov_report": rouge_score, "qmsum": rouge_score, "multi_news": rouge_score,
    "trec": classification_score, "triviaqa": qa_f1_score, "samsum": rouge_score,
    "passage_count": count_score, "passage_retrieval_en": retrieval_score,
    "lcc": code_sim_score, "repobench-p": code_sim_score,
}  # fmt: skip
"""Task -> metric function (``dataset2metric`` of ``eval.py``)."""


def metric_name(task: str) -> str:
    """Short name of a task's metric: qa_f1, rouge, classification, retrieval, count or code_sim."""
    return METRICS[check_task(task)].__name__.removesuffix("_score")



@dataclass(frozen=True)
class Prediction:
    """One line of a LongBench prediction file: the model's answer and what it is scored against."""

    pred: str
    answers: list[str]
    all_classes: list[str] | None = None
    length: int | None = None


def score_example(
    task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """The score in [0, 1] of one prediction: the best over the gold answers (0 when there are none).

    >>> score_example("triviaqa", "Paris\\nQuestion: ...", ["paris", "Paris, France"])  # first line only
    1.0
    """
    metric = METRICS[check_task(task)]
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def score_task(task: str, predictions: Iterable[Prediction | Mapping[str, Any]]) -> float:
    """A task's score: ``round(100 * mean over examples, 2)``.

    ``predictions`` are ``Prediction`` objects or mappings with ``pred``, ``answers`` and (for trec)
    ``all_classes``. Each example uses its own ``all_classes``; ``eval.py`` uses the last line's for
    all, which is the same in every LongBench file.
    """
    check_task(task)
    total, count = 0.0, 0
    for i, item in enumerate(predictions):
        p = item if isinstance(item, Prediction) else _prediction_from_mapping(item, task, f"prediction {i}")
        total += score_example(task, p.pred, p.answers, p.all_classes)
        count += 1
    if count == 0:
        raise ValueError(f"score_task({task!r}): no predictions to score")
    return round(100 * total / count, 2)


def _prediction_from_mapping(obj: Any, task: str, where: str) -> Prediction:
    """Validate one decoded JSON line; ``where`` names it (file and line) in the error."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [key for key in ("pred", "answers") if key not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}; present: {', '.join(sorted(obj))}")
    pred, answers, all_classes = obj["pred"], obj["answers"], obj.get("all_classes")
    if not isinstance(pred, str):
        raise ValueError(f"{where}: 'pred' must be a string, got {type(pred).__name__}: {pred!r:.80}")
    if not isinstance(answers, list):
        raise ValueError(f"{where}: 'answers' must be a list of gold answers, got {type(answers).__name__}")
    if all_classes is not None and not isinstance(all_classes, list):
        raise ValueError(f"{where}: 'all_classes' must be a list or null, got {type(all_classes).__name__}")
    if METRICS[task] is classification_score and not all_classes:
        raise ValueError(f"{where}: task {task!r} needs 'all_classes' (the class names), got {all_classes!r}")
    if METRICS[task] is retrieval_score:
        for answer in answers:
            if not re.search(r"Paragraph (\d+)", str(answer)):
                raise ValueError(f"{where}: gold answer {answer!r} of {task!r} has no 'Paragraph <n>'")
    return Prediction(pred=pred, answers=answers, all_classes=all_classes, length=obj.get("length"))


def _task_of_file(path: Path) -> str:
    """The task a prediction file is for, from its name ``{task}.jsonl``."""
    task = path.name.removesuffix(".jsonl")
    try:
        return check_task(task)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """Every non-blank line of a JSON-lines file, decoded, with where it stands (``file:line``) for errors."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}): {line.strip()!r:.80}") from None
            yield f"{path}:{number}", obj


def read_predictions(path: str | Path, task: str | None = None) -> list[Prediction]:
    """Read a prediction file (JSON lines; blank lines are skipped); errors name the file and line."""
    path = Path(path)
    task = check_task(task) if task is not None else _task_of_file(path)
    predictions = [_prediction_from_mapping(obj, task, where) for where, obj in _json_lines(path)]
    if not predictions:
        raise ValueError(f"{path}: no predictions (the file is empty)")
    return predictions


@dataclass(frozen=True)
class TaskScore:
    """The score of one task's prediction file."""

    task: str
    category: str
    metric: str
    n: int
    score: float


def score_file(path: str | Path) -> TaskScore:
    """Score ``{task}.jsonl``; the task comes from the file name, as in ``eval.py``."""
    path = Path(path)
    task = _task_of_file(path)
    predictions = read_predictions(path, task)
    return TaskScore(task, CATEGORIES[task], metric_name(task), len(predictions), score_task(task, predictions))


def summarize(scores: Iterable[TaskScore]) -> dict[str, Any]:
    """Per-task table plus the two LongBench averages, as a JSON-ready dict.

    ``task_mean`` is the plain mean of the task scores; ``category_mean`` is the mean of the category
    means (each category weighs the same however many tasks it has). Both are over the tasks present;
    ``complete`` says whether all 16 are, and ``missing_tasks`` lists the others.
    """
    by_task = {s.task: s for s in scores}
    ordered = [by_task[t] for t in TASKS if t in by_task]
    if not ordered:
        raise ValueError("summarize: no task scores")
    categories = {}
    for category in CATEGORY_ORDER:
        values = [s.score for s in ordered if s.category == category]
        if values:
            categories[category] = round(sum(values) / len(values), 2)
    return {
        "scores": {s.task: s.score for s in ordered},
        "tasks": {s.task: {k: v for k, v in asdict(s).items() if k != "task"} for s in ordered},
        "category_means": categories,
        "task_mean": round(sum(s.score for s in ordered) / len(ordered), 2),
        "category_mean": round(sum(categories.values()) / len(categories), 2),
        "n_tasks": len(ordered),
        "complete": len(ordered) == len(TASKS),
        "missing_tasks": [t for t in TASKS if t not in by_task],
    }


def score_directory(pred_dir: str | Path) -> dict[str, Any]:
    """Score every ``*.jsonl`` in ``pred_dir`` (other files are ignored) and ``summarize`` them.

    Raises ``ValueError`` for a file that is not named after a supported task, a malformed line (with
    file and line number), or a directory without prediction files.
    """
    pred_dir = Path(pred_dir)
    if not pred_dir.is_dir():
        raise ValueError(f"{pred_dir}: not a directory")
    files = sorted(p for p in pred_dir.iterdir() if p.suffix == ".jsonl" and p.is_file())
    if not files:
        raise ValueError(f"{pred_dir}: no prediction files (*.jsonl, one per task, named like qasper.jsonl)")
    return summarize(score_file(p) for p in files)


DATA_FIELDS: tuple[str, ...] = (
    "input", "context", "answers", "length", "dataset", "language", "all_classes", "_id",
)  # fmt: skip
"""Fields of every line of a LongBench data file."""


def load_task(data_dir: str | Path, task: str) -> list[dict[str, Any]]:
    """Read ``data_dir/{task}.jsonl`` (LongBench's data format), checking every line has ``DATA_FIELDS``."""
    check_task(task)
    path = Path(data_dir) / f"{task}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no LongBench data for {task!r}: {path} does not exist")
    examples = []
    for where, obj in _json_lines(path):
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [key for key in DATA_FIELDS if key not in obj]
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
        examples.append(obj)
    if not examples:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return examples


def build_prompt(task: str, example: Mapping[str, Any]) -> str:
    """The task's official prompt filled with the example's fields (``context``, and ``input`` for most).

    >>> build_prompt("lcc", {"context": "def f(x):\\n", "input": "", "answers": ["    return x"]})
    'Please complete the code given below. \\ndef f(x):\\nNext line of code:\\n'
    """
    template = PROMPTS[check_task(task)]
    try:
        return template.format(**example)
    except KeyError as err:
        field = err.args[0]
        raise ValueError(f"the {task!r} prompt needs field {field!r}; the example has {sorted(example)}") from None


def truncate_middle(token_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Keep the first and the last ``max_tokens // 2`` tokens when there are more than ``max_tokens``.

    LongBench cuts the middle because instructions sit at both ends of its prompts. As in ``pred.py``,
    an odd ``max_tokens`` keeps ``max_tokens - 1`` tokens. Accepts lists, tuples and 1-d tensors or
    arrays (anything with ``tolist``).

    >>> truncate_middle(list(range(10)), 5)
    [0, 1, 8, 9]
    """
    check_int("", "max_tokens", max_tokens, 2, "one token kept from each end")
    ids = list(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)
    if len(ids) <= max_tokens:
        return ids
    half = max_tokens // 2
    return ids[:half] + ids[-half:]


class Tokenizer(Protocol):
    """The two methods of a HuggingFace tokenizer that ``truncate_prompt`` uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def truncate_prompt(prompt: str, tokenizer: Tokenizer, max_length: int, add_special_tokens: bool = False) -> str:
    """Cut the middle of a prompt that is longer than ``max_length`` tokens, as ``pred.py`` does.

    The prompt is tokenized, and when it has more than ``max_length`` tokens the first and the last
    ``max_length // 2`` are decoded separately (``skip_special_tokens=True``) and the two strings
    joined; a prompt that fits is returned unchanged (not re-decoded). ``pred.py`` tokenizes with the
    tokenizer's default, which adds a BOS token for Llama-style tokenizers (not for chatglm3); that
    token then counts toward ``max_length`` and is dropped by the decode. ``add_special_tokens=True``
    reproduces that; the default counts only the prompt's own tokens.
    """
    check_int("", "max_length", max_length, 2)
    ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )
