"""The command line refuses bad input before any work starts, says what it does and where it wrote,
and reads well in a log (issue 14).

The CLI runs in a subprocess whose stdout and stderr are not a terminal, as in CI. The cases run in
one subprocess, one after the other, through the console script's own entry point (``app(args)``),
so that they share one interpreter start (seconds each otherwise); each case's output is what the
process writes to its file descriptors 1 and 2, libraries' warnings and progress lines included.
Every refusal must come before the model's weights are loaded: those cases take milliseconds.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import pytest

from cli_driver import assert_one_error_line, run_cli_cases
from tiny_checkpoint import save_tiny_checkpoint

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))



@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-input")
    model = save_tiny_checkpoint(root / "model")  # a char tokenizer; 6 query heads, 2 layers, 4096 positions
    text = root / "text.txt"
    text.write_text(TEXT)
    short = root / "short.txt"
    short.write_text(TEXT[:500])
    (root / "file").write_text("a file, not a directory")
    # A run of another experiment (another model) lies where a ppl run on "taken-text" would go.
    taken = root / "taken" / "ppl-taken-text-p16-s2" / "dense"
    taken.mkdir(parents=True)
    (taken / "config.json").write_text(json.dumps({"command": "ppl", "model": "another model"}))
    (root / "taken-text").write_text(TEXT)
    return root, str(model), str(text), str(short)


def refusals(root: Path, model: str, text: str, short: str) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (command line, what its one error line must say: the option, the value, what is allowed)."""
    untouched = str(root / "untouched")  # every refused command's --out: must still not exist afterwards
    ppl = ["ppl", "--model", model, "--text", text, "--out", untouched, "-m", "dense"]
    gen = ["generate", "--model", model, "--method", "radar"]
    needle = ["needle", "--model", model, "-m", "dense", "--out", untouched]
    return {
        # defect 1: a negative prefill once prefilled the whole text
        "negative prefill": (ppl + ["--prefill", "-8", "--steps", "4"], ["'--prefill'", "-8 is out of range", ">= 0"]),
        "zero steps": (ppl + ["--prefill", "16", "--steps", "0"], ["'--steps'", "0 is out of range", ">= 1"]),
        "negative steps": (ppl + ["--prefill", "16", "--steps", "-3"], ["'--steps'", "-3 is out of range", ">= 1"]),
        "prefill + steps beyond the window": (
            ppl + ["--prefill", "4000", "--steps", "200"], ["'--prefill' / '--steps'", "4201 positions", "model's 4096", "<= 4095"]
        ),
        "text shorter than the steps": (
            ppl[:4] + [short] + ppl[5:] + ["--prefill", "100", "--steps", "1000"], ["'--text'", "500 tokens", "fewer than the 1101"]
        ),
        "nonexistent model": (["ppl", "--model", str(root / "no-such-model"), "--out", untouched],
                              ["'--model'", "no-such-model", "'default'"]),
        "unwritable out": (ppl[:5] + ["--out", str(root / "file" / "runs"), "-m", "dense"], ["'--out'", "is a file"]),
        "another experiment in the out directory": (  # the text's name, relative to the working directory (root)
            ["ppl", "--model", model, "--text", "taken-text", "--out", str(root / "taken"), "-m", "dense",
             "--prefill", "16", "--steps", "2"], ["'--out'", "different config", "model"]
        ),
        "unknown dtype": (ppl + ["--dtype", "float8"], ["'--dtype'", "'float8'", "float32, bfloat16, float16"]),
        # defect 2: --max-prompt-tokens -840 kept the last 6 tokens, 0 kept everything
        "negative max prompt tokens": (gen + ["--prompt", "x", "--max-prompt-tokens", "-840"],
                                       ["'--max-prompt-tokens'", "-840 is out of range", ">= 1"]),
        "zero max prompt tokens": (gen + ["--prompt", "x", "--max-prompt-tokens", "0"],
                                   ["'--max-prompt-tokens'", "0 is out of range", ">= 1"]),
        "empty prompt": (gen + ["--prompt", ""], ["'--prompt'", "empty"]),
        "two prompts": (gen + ["--prompt", "x", "--text", "pydecimal"], ["'--prompt' / '--text'", "exactly one"]),
        # defect 7, needle
        "needle beyond the window": (needle + ["--length", "20000"], ["'--length'", "20000", "up to 4096"]),
        "needle without samples": (needle + ["--samples", "0"], ["'--samples'", "0 is out of range", ">= 1"]),
        "needle depth 150": (needle + ["--depth", "150"], ["'--depth'", "150 is out of range", "from 0 to 100"]),
        "needle shorter than its task": (needle + ["--length", "10"], ["'--length'", "10 is too short for passkey", "allowed: 2"]),
        # the other commands
        "diagnose without steps": (["diagnose", "--model", model, "--steps", "0"], ["'--steps'", "0 is out of range"]),
        "diagnose head beyond the heads": (["diagnose", "--model", model, "--head", "6", "--out", untouched],
                                           ["'--head'", "6 is out of range", "from 0 to 5"]),
        "sweep without features": (["sweep", "--model", model, "--n", "0"], ["'--n'", "0 is out of range", ">= 1"]),
        "longbench without data": (["longbench", "run", "--data-dir", str(root / "no-data"), "--model", model],
                                   ["'--data-dir'", "no-data", "not a directory"]),
        "plot of nothing": (["plot", str(root / "no-runs")], ["'RUNS'", "no-runs", "does not exist"]),
        "plot to a text file": (["plot", str(root), "--out", str(root / "ppl.txt")], ["'--out'", ".txt is not a picture", ".png"]),
        # defects 8 and 9: options a method does not take, and budgets out of range
        "dense with a budget option": (ppl + ["-m", "dense:budget=64"], ["'--method'", "dense does not take budget", "no options"]),
        "top_k and budget in a spec": (ppl + ["-m", "radar:top_k=8,budget=64"], ["'--method'", "budget or top_k, not both"]),
        "spec option out of range": (
            ppl + ["-m", "h2o:heavy_ratio=1.5"], ["'--method'", "heavy_ratio 1.5 is out of range", "(0, 1)"]
        ),
        "negative budget": (ppl + ["-m", "snapkv-then-radar", "--budget", "-3"], ["'--budget'", "-3 is out of range", "[1, "]),
        "budget below the method's floor": (
            ppl + ["-m", "subgen", "--budget", "20"], ["'--method'", "--budget 20", "SubGen.budget must be an int >= 41"]
        ),
        "generate option the method does not take": (
            gen + ["--prompt", "x", "--page-size", "4"], ["'--page-size'", "radar does not take --page-size", "it takes --budget"]
        ),
        "generate top-k and budget": (gen + ["--prompt", "x", "--top-k", "8", "--budget", "64"],
                                      ["'--budget' / '--top-k'", "not both"]),
        "generate negative budget": (["generate", "--model", model, "--method", "snapkv-then-radar", "--budget", "-3", "--prompt", "x"],
                                     ["'--budget'", "-3 is out of range"]),
    }


def runs(root: Path, model: str, text: str) -> dict[str, list[str]]:
    """name -> a command line that must succeed (tiny sizes: seconds in all)."""
    # A directory name long enough that its lines are wider than 80 columns (which rich used to wrap).
    out = str(root / "runs-in-a-directory-whose-name-is-long-enough-to-make-every-line-wider-than-eighty-columns")
    ppl = ["ppl", "--model", model, "--text", text, "--prefill", "16", "--steps", "2", "--out", out, "-m", "dense"]
    return {
        "ppl": ppl,
        # the same run in another dtype: its own directory (it used to collide with the float32 run's)
        "ppl bfloat16": ppl + ["--dtype", "bfloat16"],
        "ppl global budget": ppl[:-2] + ["-m", "dense", "-m", "radar:n_features=16", "--budget", "40"],
        "needle": ["needle", "--model", model, "-m", "dense", "--length", "300", "--depth", "50", "--samples", "1",
                   "--max-new-tokens", "2", "--out", out],
        "diagnose": ["diagnose", "--model", model, "-m", "radar:top_k=2,n_features=16", "--text", text, "--prefill", "64",
                     "--steps", "2", "--head", "0", "--out", out],
        "generate a named text": ["generate", "--model", model, "--method", "radar", "--budget", "64", "--text", "pydecimal",
                                  "--max-prompt-tokens", "200", "--max-new-tokens", "2", "--quiet"],
        "dense generate at a budget": ["generate", "--model", model, "--method", "dense", "--budget", "64", "--prompt", "x" * 50,
                                       "--max-new-tokens", "2", "--quiet"],
        "generate a long file": ["generate", "--model", model, "--method", "radar", "--budget", "64", "--prompt-file",
                                 str(Path(sysconfig.get_paths()["stdlib"]) / "_pydecimal.py"), "--max-prompt-tokens", "100",
                                 "--max-new-tokens", "2", "--quiet"],
        "ppl help": ["ppl", "--help"],
        "generate help": ["generate", "--help"],
        "methods": ["methods"],
    }


@pytest.fixture(scope="module")
def results(workspace):
    root, model, text, short = workspace
    cases = {name: args for name, (args, _) in refusals(root, model, text, short).items()}
    cases.update(runs(root, model, text))
    env = {**os.environ, "SPARSEATTN_PROGRESS_SECONDS": "0.05", "COLUMNS": "80"}
    return run_cli_cases(cases, root, env, timeout=900)


def _names(kind):
    return list(kind(Path("/r"), "m", "t", "s")) if kind is refusals else list(kind(Path("/r"), "m", "t"))


@pytest.mark.parametrize("name", _names(refusals))
def test_a_mistake_is_one_line_naming_the_option_value_and_range_with_exit_code_2(workspace, results, name):
    root, model, text, short = workspace
    expected = refusals(root, model, text, short)[name][1]
    result = results[name]
    assert_one_error_line(result, expected)
    assert not (root / "untouched").exists() and not (root / "results").exists()  # refused before anything was written


def test_ppl_shows_its_progress_and_says_where_it_wrote_on_whole_lines(results):
    ppl = results["ppl"]
    assert ppl["code"] == 0, ppl
    assert "dense: prefill 16 tokens: started" in ppl["stderr"] and "(done)" in ppl["stderr"]
    wrote = [line for line in ppl["stdout"].splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1 and "wider-than-eighty-columns/ppl-" in wrote[0] and wrote[0].endswith("in each)"), ppl["stdout"]
    assert len(wrote[0]) > 80  # not wrapped, though the output is not a terminal (and COLUMNS=80)


def test_another_dtype_gets_its_own_run_directory(results):
    float32, bfloat16 = results["ppl"], results["ppl bfloat16"]
    assert bfloat16["code"] == 0, bfloat16
    path = next(line for line in bfloat16["stdout"].splitlines() if line.startswith("wrote ")).split()[1]
    assert Path(path).parent.name.endswith("-bfloat16") and (Path(path) / "summary.json").exists()
    assert json.loads((Path(path) / "summary.json").read_text())["dtype"] == "bfloat16"
    first = next(line for line in float32["stdout"].splitlines() if line.startswith("wrote ")).split()[1]
    assert Path(first).parent.name.endswith("-s2")  # float32 keeps the name its runs always had (resumable)


def test_the_global_budget_applies_to_methods_with_a_budget_only(results):
    ppl = results["ppl global budget"]
    assert ppl["code"] == 0, ppl
    assert "dense: ppl" in ppl["stdout"] and "radar:budget=40,n_features=16: ppl" in ppl["stdout"]


def test_parse_method_gives_the_spec_priority_over_the_global_budget():
    from sparseattn.cli.method_specs import parse_method

    assert parse_method("dense", budget=512)[2] == {}  # dense has no budget
    assert parse_method("radar", budget=512)[2] == {"budget": 512}
    assert parse_method("radar:top_k=8", budget=512)[2] == {"top_k": 8}  # was {"top_k": 8, "budget": 512}: top_k ignored
    assert parse_method("radar:budget=64", budget=512)[2] == {"budget": 64}


@pytest.mark.parametrize("name", ["needle", "diagnose"])
def test_commands_that_write_files_say_where(results, name):
    result = results[name]
    assert result["code"] == 0, result
    wrote = [line for line in result["stdout"].splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1 and Path(wrote[0].split()[1].rstrip(",")).is_dir(), result["stdout"]
    assert "started" in result["stderr"] and "(done)" in result["stderr"]  # progress: samples, prefill and steps


def test_generate_continues_a_named_text_and_shows_its_prefill(results):
    result = results["generate a named text"]
    assert result["code"] == 0, result
    assert "prompt: 200 tokens" in result["stderr"]
    assert "prefill 200 tokens: started" in result["stderr"] and "(done)" in result["stderr"]


def test_generate_dense_at_a_budget_says_the_budget_does_not_apply(results):
    result = results["dense generate at a budget"]
    assert result["code"] == 0, result
    assert "dense has no budget" in result["stderr"] and "--budget 64 does not apply" in result["stderr"]


def test_help_shows_flags_without_a_value_type(results):
    for name, flags in (("ppl help", ["--help"]), ("generate help", ["--help", "--chat", "--quiet"])):
        lines = results[name]["stdout"].splitlines()
        assert results[name]["code"] == 0
        for flag in flags:
            line = next(line for line in lines if flag in line.split())
            assert "<bool>" not in line, line
        assert any("--steps <int>" in line for line in lines) or name != "ppl help"  # options that take a value show its type


def test_user_facing_text_names_no_issue_numbers(results):
    out = results["methods"]["stdout"]
    assert "radar+" in out and "sharper ranking" in out
    assert "issue" not in out.lower()


def test_generate_on_a_long_file_prints_no_tokenizer_warning(results):
    # transformers warned "Token indices sequence length is longer than the specified maximum sequence length
    # ... indexing errors" for every long prompt, though --max-prompt-tokens keeps what fits.
    result = results["generate a long file"]
    assert result["code"] == 0, result
    assert "Token indices sequence length" not in result["stderr"] and "indexing errors" not in result["stderr"]
    assert "prefill 100 tokens: started" in result["stderr"]
