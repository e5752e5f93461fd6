"""Where a command's results go: a directory per run under ``--out``, checked before anything is written.

A command that writes results writes a directory per run (``--out``) holding its resolved config, its
records as they are produced, and a summary; rerunning skips what is finished and resumes what is not
(:class:`sparseattn.evaluation.runs.RunDir`). Its last line says where the files are (:func:`wrote`).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sparseattn.cli.checks import bad
from sparseattn.cli.consoles import console


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
