"""The README's code runs as written: its transformers snippet on the default model, its commands' names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparseattn.hf import default_model_unavailable_reason

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_transformers_snippet_runs_as_written(tmp_path):
    """The `apply` snippet is complete: it defines model and inputs, generates, and prints the text."""
    reason = default_model_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the README snippet loads the default model, which is unavailable: {reason}")
    blocks = [b for b in _python_blocks(README.read_text()) if "sparseattn.apply(" in b]
    assert len(blocks) == 1, "the README should hold exactly one transformers snippet"
    script = tmp_path / "snippet.py"
    script.write_text(blocks[0])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip()) > 20, "the snippet prints the generated text"


def test_every_sparseattn_command_in_the_readme_exists():
    """Each `sparseattn <command>` line of the README names a command the CLI has (its --help exits 0)."""
    text = README.read_text()
    commands = sorted(set(re.findall(r"^sparseattn ([a-z-]+)", text, flags=re.M)))
    assert commands, "the README shows sparseattn commands"
    from typer.testing import CliRunner

    from sparseattn.cli import app

    for command in commands:  # in this process: a fresh interpreter per command spent ~2 s each importing torch
        result = CliRunner().invoke(app, [command, "--help"])
        assert result.exit_code == 0, f"`sparseattn {command} --help` failed: {result.output[-2000:]}"


DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``sparseattn ...`` line of a bash block in the README and docs (continuations joined)."""
    import shlex

    found = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words[:1] == ["sparseattn"] and "..." not in words:
                    found.append((f"{path.name}: {line.strip()}", words[1:]))
    return found


@pytest.mark.parametrize("where, argv", _documented_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_documented_command_line_parses(where, argv):
    """Each documented command line names a real command with options it has, values of the right type
    and range: parsed by the CLI's own parser (nothing runs; the runs themselves are the CLI tests')."""
    from typer.main import get_command

    from sparseattn.cli import app

    command, name = get_command(app), "sparseattn"
    while getattr(command, "commands", None) and argv and argv[0] in command.commands:
        name, command, argv = argv[0], command.commands[argv[0]], argv[1:]
    assert not getattr(command, "commands", None), f"{where}: names a command group, not a command"
    command.make_context(name, list(argv))  # raises a usage error on an unknown option or a bad value
