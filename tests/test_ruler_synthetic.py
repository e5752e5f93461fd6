"""RULER's vt, cwe and fwe as generated here: each sample's answer is really in its text as RULER's rules say,
samples are deterministic and fitted to their length, the metric scores hand cases as RULER's does, one shared
prefill answers as separate prefills do, and ``sparseattn ruler`` runs end to end or refuses bad options in one line."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections import Counter

import pytest
from typer.testing import CliRunner

from sparseattn.data.needle import clean_prediction, string_match_all
from sparseattn.data.ruler import (
    RULER_TASKS,
    CommonWords,
    FrequentWords,
    VariableTracking,
    common_words,
    tokens_to_generate,
    zeta,
)
from sparseattn.testing import char_tokenizer, save_tiny_checkpoint
from word_tokens import words


runner = CliRunner()


@pytest.fixture(scope="module")
def chars():
    """A real HF tokenizer (one token per character, plus BOS): what the CLI tests' tiny model reads."""
    return char_tokenizer()


def context(sample) -> str:
    return sample.prompt[slice(*sample.context_span)]


# -- variable tracking ----------------------------------------------------------------------------------


def resolve(text: str) -> dict[str, str]:
    """Every variable's value after following the ``VAR X = ...`` statements of ``text`` in order."""
    values: dict[str, str] = {}
    for name, rhs in re.findall(r"^VAR ([A-Z]+) = (.+?) ?$", text, flags=re.MULTILINE):
        values[name] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
    return values


@pytest.mark.parametrize("chains, hops", [(1, 4), (2, 3), (3, 1)])
def test_vt_chain_resolves_to_exactly_the_answer_variables(chains, hops):
    task = VariableTracking(num_chains=chains, num_hops=hops)
    s = task.sample(1500, words, seed=7)
    values = resolve(context(s))
    (query,) = s.queries
    assert sorted(v for v, value in values.items() if value == query) == sorted(s.answers)
    assert len(s.answers) == hops + 1 and len(set(s.answers)) == hops + 1
    assert all(re.fullmatch(r"[A-Z]{5}", v) for v in s.answers) and re.fullmatch(r"\d{5}", query)
    assert len(values) == chains * (hops + 1) and len({*values.values()}) == chains  # distinct values
    # each statement once, in chain order, at the recorded depths (sorted, in the haystack)
    assert len(s.needles) == len(s.depths) == task.num_needles
    assert all(context(s).count(n) == 1 for n in s.needles)
    assert s.depths == sorted(s.depths) and 0 <= s.depths[0] and s.depths[-1] < 100
    lines = context(s).splitlines()
    chain = [f"VAR {s.answers[0]} = {query}"] + [f"VAR {b} = VAR {a} " for a, b in itertools.pairwise(s.answers)]
    at = [lines.index(statement) for statement in chain]
    assert at == sorted(at) and lines[-1].startswith("The grass")  # in order, noise after the last one
    assert s.prompt.endswith(f"{hops + 1} variables are assigned the value {query}, they are: ")


def test_vt_starts_with_a_one_shot_example_of_its_own_chain(chars):
    s = RULER_TASKS["vt"].sample(2000, chars, seed=3, reserve_tokens=30)
    example, _ = s.prompt.split("\n\nMemorize and track", 1)  # the example, then the task
    question = example[: example.rindex("they are: ") + len("they are: ")]
    shown = example[len(question) :].split()
    assert len(shown) == 5 and all(re.fullmatch(r"[A-Z]{3}", v) for v in shown)  # RULER: 3-letter variables
    values = resolve(example)
    (value,) = set(values.values())
    assert sorted(values) == sorted(shown) and value != s.queries[0] and re.fullmatch(r"\d{5}", value)
    assert len(chars.encode(question)) <= 500  # RULER fits its example to 500 tokens


# -- common words -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target, freq_cw, freq_ucw", [(3000, 6, 1), (6000, 30, 3)])  # RULER's rule below 4096
def test_cwe_common_words_appear_exactly_freq_cw_times_and_more_than_any_other(target, freq_cw, freq_ucw):
    s = CommonWords().sample(target, words, seed=11, reserve_tokens=120)
    entries = context(s).split()
    numbers, listed = entries[::2], entries[1::2]
    assert numbers == [f"{i}." for i in range(1, len(listed) + 1)]  # "1. w 2. w ...", RULER's format
    counts = Counter(listed)
    assert len(s.answers) == 10 and all(counts[w] == freq_cw for w in s.answers)
    others = [n for w, n in counts.items() if w not in s.answers]
    assert set(others) == {freq_ucw} and len(others) == s.haystack_units
    assert s.prompt.endswith("Question: What are the 10 most common words in the above list? Answer: The top 10 words "
                             "that appear most often in the list are:")
    # the one example list comes first, with its answer, and shares no word with the sample
    example = s.prompt[: s.context_span[0]].split("are: ", 1)[1].split("\n")[0]
    shown = example.split()[1::2]
    assert len(shown) == 10 and not set(shown) & set(counts)


def test_cwe_refuses_a_length_beyond_its_word_list():
    task = CommonWords()
    assert task.max_units == len(common_words()) - 10 - 40 > 7000  # wonderwords' nouns, adjectives and verbs
    with pytest.raises(ValueError, match=r"needs more than the \d+ haystack units"):
        task.sample(10**6, words)


# -- frequent words -----------------------------------------------------------------------------------------


def test_fwe_counts_follow_the_zeta_distribution_and_the_answer_is_the_top_three():
    s = FrequentWords().sample(6000, words, seed=5, reserve_tokens=50)
    counts = Counter(context(s).split())
    n = s.haystack_units
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answers
    assert counts[s.answers[2]] > max(c for w, c in counts.items() if w not in ("...", *s.answers))
    expected = [int(n / zeta(2.0) * k**-2.0) for k in range(1, (6000 - 50) // 50 + 1)]  # RULER's vocabulary size
    assert sorted(counts.values(), reverse=True) == [c for c in expected if c > 0]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])


def test_zeta_matches_known_values():
    # zeta(2) = pi^2/6, zeta(4) = pi^4/90; Apery's constant zeta(3); double precision, summed over 31 terms + remainder
    import math

    for s, value in ((2.0, math.pi**2 / 6), (3.0, 1.2020569031595942), (4.0, math.pi**4 / 90), (1.5, 2.612375348685488)):
        assert zeta(s) == pytest.approx(value, rel=4 * 2**-52)
    with pytest.raises(ValueError, match="s > 1"):
        zeta(1.0)


# -- every task: determinism, length fitting, inputs ----------------------------------------------------------


@pytest.mark.parametrize("name", ["vt", "cwe", "fwe"])
def test_samples_are_deterministic_by_seed_and_fitted_to_the_length(name, chars):
    task, target = RULER_TASKS[name], 2900
    reserve = tokens_to_generate(name)
    a, b = (task.sample(target, chars, seed=4, reserve_tokens=reserve) for _ in range(2))
    assert a == b and a.prompt != task.sample(target, chars, seed=5, reserve_tokens=reserve).prompt
    # the longest that fits: one more haystack unit would not
    assert a.num_tokens == len(chars.encode(a.prompt)) <= target - reserve
    grown = FrequentWords(vocab_size=(target - reserve) // 50) if name == "fwe" else task  # as sample() sets it
    assert grown.render(a.haystack_units + 1, chars, seed=4, target_tokens=target).num_tokens > target - reserve
    assert a.prompt.endswith(a.answer_prefix) and a.target_tokens == target


@pytest.mark.parametrize("name", ["vt", "cwe", "fwe"])
def test_tasks_refuse_depths_and_haystack_text(name):
    task = RULER_TASKS[name]
    with pytest.raises(ValueError, match="depth"):
        task.sample(900, words, depths=[50])
    with pytest.raises(ValueError, match="haystack_text"):
        task.sample(900, words, haystack_text="A book.")


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="num_hops"):
        VariableTracking(num_hops=0)
    with pytest.raises(ValueError, match="freq_cw=3 must exceed freq_ucw=3"):
        CommonWords(freq_cw=3)
    with pytest.raises(ValueError, match="alpha"):
        FrequentWords(alpha=1.0)


def test_the_eleven_offline_tasks_in_rulers_order():
    assert list(RULER_TASKS) == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                                 "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
                                 "vt", "cwe", "fwe"]  # fmt: skip
    assert [tokens_to_generate(t) for t in ("niah_single_1", "vt", "cwe", "fwe")] == [128, 30, 120, 50]


# -- the metric --------------------------------------------------------------------------------------------------


def test_string_match_all_on_hand_cases():
    vt = ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]
    assert string_match_all(["ABCDE, FGHIJ, KLMNO, PQRST, UVWXY"], [vt]) == 100.0
    assert string_match_all(["abcde fghij and then nothing"], [vt]) == 40.0  # case-insensitive, 2 of 5
    cwe = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "melon", "grape", "lemon"]
    assert string_match_all([" 1. apple 2. pear 3. plum 4. banana"], [cwe]) == 30.0
    assert string_match_all(["pineapple"], [["apple"]]) == 100.0  # RULER matches substrings
    fwe = ["qzqgby", "zomwto", "dxiibz"]
    assert string_match_all(["qzqgby zomwto", "dxiibz"], [fwe, fwe]) == 50.0  # averaged: 66.67 and 33.33
    assert clean_prediction(" ABCDE\tFGHIJ\x00") == "ABCDE\nFGHIJ"


# -- one prefill for every method answers as each method's own prefill does ------------------------------------------


def test_shared_prefill_generates_what_separate_prefills_generate(tmp_path_factory):
    import torch

    from sparseattn import H2O, Dense, Quest, RadarPlus, SnapKV, StreamingLLM
    from sparseattn.evaluation.generation import continue_greedy, encode_prompt, greedy
    from sparseattn.evaluation.shared_prefill import prefill_shared
    from sparseattn.hf import apply, load_model

    model, tokenizer = load_model(str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=2)))
    methods = {"dense": Dense(), "streamingllm": StreamingLLM(budget=40), "h2o": H2O(budget=40),
               "snapkv": SnapKV(budget=48, observation_window=8), "quest": Quest(budget=48, page_size=8),
               "radar+": RadarPlus(budget=80)}  # fmt: skip
    sample = RULER_TASKS["vt"].sample(1100, tokenizer, seed=1, reserve_tokens=12)
    ids = encode_prompt(tokenizer, sample.prompt, False)
    shared = prefill_shared(model, methods, ids, progress=False)
    texts = set()
    for label, method in methods.items():
        with apply(model, method) as sparse:
            alone = greedy(model, tokenizer, sparse, ids, 12)
            together = continue_greedy(model, tokenizer, shared.caches[label], shared.logits, ids.shape[1], 12)
        assert (together.text, together.new_tokens) == (alone.text, alone.new_tokens), label
        assert together.mean_attended == pytest.approx(alone.mean_attended), label
        texts.add(alone.text)
    assert len(texts) > 1  # the budgets are small enough that the methods answer differently
    assert torch.equal(shared.logits.argmax(-1), model(ids).logits[:, -1].argmax(-1))


# -- the command ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    model = save_tiny_checkpoint(root / "model")
    # the same model with unreadable weights: a command that refuses its options must never get to loading them
    bare = root / "bare"
    shutil.copytree(model, bare)
    for weights in bare.glob("*.safetensors"):
        weights.write_bytes(b"not weights")
    return root, str(model), str(bare)


def run_ruler(*args: str):
    from sparseattn.cli import app

    return runner.invoke(app, ["ruler", *args], catch_exceptions=False)


def test_ruler_runs_tasks_for_methods_writes_heatmaps_and_a_table_and_resumes(tiny):
    root, model, _ = tiny
    out = root / "out"
    common = ["--model", model, "--task", "vt", "--task", "cwe", "--task", "fwe", "--task", "niah_single_1",
              "--length", "2200", "--depth", "20", "--depth", "80", "--max-new-tokens", "4", "--out", str(out)]  # fmt: skip
    result = run_ruler(*common, "-m", "dense", "-m", "streamingllm", "--budget", "64")
    assert result.exit_code == 0, result.output
    base = out / "ruler"
    for task in ("vt", "cwe", "fwe", "niah_single_1"):
        for method in ("dense", "streamingllm_budget=64"):
            run = base / task / method
            records = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
            grid = json.loads((run / "grid.json").read_text())
            assert (run / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
            assert all(r["prompt_tokens"] + 4 <= 2200 and r["prefilled_with"] == 2 for r in records)
            assert json.loads((run / "summary.json").read_text())["n_samples"] == len(records)
            # depth means something only for the one-needle task; vt spreads its chain, cwe/fwe have none
            expected = {"vt": ["spread"], "cwe": ["no depth"], "fwe": ["no depth"], "niah_single_1": ["20%", "80%"]}[task]
            assert grid["columns"] == expected and len(records) == len(expected)
    summary = json.loads((base / "summary.json").read_text())
    assert summary["tasks"] == ["niah_single_1", "vt", "cwe", "fwe"] and summary["rows"][-1]["task"] == "mean"
    assert "| task | length | dense | streamingllm:budget=64 |" in (base / "summary.md").read_text()
    assert "mean" in result.output and (base / "summary.png").exists()
    # Again, plus a method: the finished methods are skipped, the new one prefills alone.
    result = run_ruler(*common, "-m", "dense", "-m", "streamingllm", "-m", "h2o", "--budget", "64")
    assert result.exit_code == 0, result.output
    assert len((base / "vt" / "dense" / "samples.jsonl").read_text().splitlines()) == 1
    h2o = [json.loads(line) for line in (base / "vt" / "h2o_budget=64" / "samples.jsonl").read_text().splitlines()]
    assert [r["prefilled_with"] for r in h2o] == [1]


@pytest.mark.parametrize("args, option, says", [
    (["--task", "vtt"], "--task", "unknown task 'vtt' (did you mean vt?); allowed: all, niah_single_1"),
    (["--task", "qa_1"], "--task", "qa_1 needs the SQuAD data set, which cannot be fetched offline"),
    (["--task", "qa_2"], "--task", "qa_2 needs the HotpotQA data set"),
    (["--task", "cwe", "--length", "5000"], "--length", "5000 is beyond the model's 4096 positions; allowed: up to 4096"),
    (["--task", "cwe", "--length", "900"], "--length", "900 is too short for cwe"),
    (["--task", "cwe", "--task", "fwe", "--depth", "50"], "--depth", "none of the tasks cwe, fwe has one needle"),
    (["--task", "vt", "--depth", "120"], "--depth", "120 is out of range; allowed: from 0 to 100"),
    (["--task", "vt", "--samples", "0"], "--samples", "0 is out of range"),
    (["--task", "vt", "-m", "radarr"], "--method", "unknown method 'radarr'"),
])  # fmt: skip
def test_ruler_refuses_bad_options_in_one_line_before_loading_the_model(tiny, args, option, says):
    root, _, bare = tiny
    result = run_ruler("--model", bare, "--out", str(root / "refused"), *args)
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 2, result.output
    assert len(errors) == 1 and f"'{option}'" in errors[0] and says in errors[0], result.output
    assert not (root / "refused").exists()
