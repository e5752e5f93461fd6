"""Run directories: the resolved config saved beside the results, finished work kept and skipped.

A run directory holds ``config.json`` (everything that determines the results), append-only JSONL
record files (a line is written, flushed and fsynced as soon as it is known, so an interrupt loses
nothing that finished) and, once done, ``summary.json``. Re-running with the same config skips a
finished run and resumes an unfinished one; a different config in the same directory is an error
rather than a silent mix of two experiments.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every run."""
    import transformers

    import sparseattn

    return {
        "sparseattn": sparseattn.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a temp file renamed over the target)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class RunDir:
    """A run directory for one experiment, identified by its config.

    Args:
        path: the directory (created).
        config: JSON-serialisable; must equal the saved one when the directory already holds a run.
    """

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path = Path(path)
        self.config = self.check(self.path, config)
        self.path.mkdir(parents=True, exist_ok=True)
        saved = self.path / "config.json"
        if not saved.exists():
            write_json(saved, self.config)

    @staticmethod
    def check(path: Path, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` as saved (JSON-normalised); a ValueError if ``path`` holds a run of another config.

        Creates nothing, so a command can check all of its runs before it starts any work.
        """
        config = json.loads(json.dumps(config, sort_keys=True, default=str))
        saved = Path(path) / "config.json"
        if saved.exists():
            previous = json.loads(saved.read_text())
            if previous != config:
                changed = sorted(k for k in set(previous) | set(config) if previous.get(k) != config.get(k))
                raise ValueError(
                    f"{path} holds a run with a different config (differs in: {', '.join(changed)}); "
                    "use another --out directory or delete it"
                )
        return config

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def finished(self) -> bool:
        return self.summary_path.exists()

    def summary(self) -> dict[str, Any]:
        return json.loads(self.summary_path.read_text())

    def finish(self, summary: dict[str, Any]) -> None:
        write_json(self.summary_path, summary)

    def records(self, name: str) -> list[dict[str, Any]]:
        """The complete lines of ``name``; a torn last line (an interrupt mid-write) is cut off the file."""
        path = self.path / name
        if not path.exists():
            return []
        out, good = [], 0
        with path.open("rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break
                good += len(line)
        if path.stat().st_size != good:
            with path.open("r+b") as f:
                f.truncate(good)
        return out

    def appender(self, name: str) -> _Appender:
        return _Appender(self.path / name)


class _Appender:
    """Append JSON lines durably: each line is flushed and fsynced before the next computation."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> _Appender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
