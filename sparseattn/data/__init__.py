"""Offline data for evaluation: long texts (books from PyPI packages, stdlib code), retrieval tasks and
RULER's other synthetic tasks.

>>> from sparseattn.data import RULER_NIAH, RULER_TASKS, PasskeyTask, load_text, string_match_all
>>> sorted(RULER_NIAH)[:3]
['niah_multikey_1', 'niah_multikey_2', 'niah_multikey_3']
>>> list(RULER_TASKS)[8:]
['vt', 'cwe', 'fwe']
"""

from sparseattn.data.needle import (
    RULER_DEPTHS,
    RULER_NIAH,
    NeedleSample,
    NiahTask,
    PasskeyTask,
    RetrievalTask,
    clean_prediction,
    fit_units,
    split_sentences,
    string_match_all,
    string_match_part,
    token_counter,
)
from sparseattn.data.ruler import RULER_QA, RULER_TASKS, CommonWords, FrequentWords, VariableTracking
from sparseattn.data.sources import TEXTS, FetchError, Text, TextInfo, fetch, get_text, list_texts, load_text, strip_gutenberg

__all__ = [
    "RULER_DEPTHS",
    "RULER_NIAH",
    "RULER_QA",
    "RULER_TASKS",
    "TEXTS",
    "CommonWords",
    "FetchError",
    "FrequentWords",
    "NeedleSample",
    "NiahTask",
    "PasskeyTask",
    "RetrievalTask",
    "Text",
    "TextInfo",
    "VariableTracking",
    "clean_prediction",
    "fetch",
    "fit_units",
    "get_text",
    "list_texts",
    "load_text",
    "split_sentences",
    "string_match_all",
    "string_match_part",
    "strip_gutenberg",
    "token_counter",
]
