"""Batches of long, distinct token rows from texts every machine has: CPython's standard library.

Row ``i`` is window ``i // 7`` of module ``STDLIB_TEXTS[i % 7]`` (code, no padding, equal lengths),
so a batch of up to 7 rows holds 7 different modules and larger batches take further windows.
"""

from __future__ import annotations

import torch

#: Stdlib modules long enough for 8k-token windows (text names of :func:`sparseattn.data.load_text`).
STDLIB_TEXTS = ("pydecimal", "inspect", "typing", "tarfile", "doctest", "argparse", "pyio")


def stdlib_rows(tokenizer, batch: int, n_tokens: int) -> torch.Tensor:
    """``[batch, n_tokens]`` token ids: row i is window ``i // 7`` of ``STDLIB_TEXTS[i % 7]``."""
    from sparseattn.data.sources import load_text
    from sparseattn.evaluation.ppl import tokenize

    if batch < 1 or n_tokens < 1:
        raise ValueError(f"batch and n_tokens must be >= 1, got batch={batch}, n_tokens={n_tokens}")
    rows = []
    for i in range(batch):
        name, window = STDLIB_TEXTS[i % len(STDLIB_TEXTS)], i // len(STDLIB_TEXTS)
        ids = tokenize(tokenizer, load_text(name), (window + 1) * n_tokens, name=name)
        rows.append(ids[window * n_tokens :])
    return torch.stack(rows)
