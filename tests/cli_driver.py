"""Run ``sparseattn`` command lines in one fresh interpreter, as the installed script would, and collect
each one's exit code, stdout and stderr (the CLI tests' shared driver)."""

import json
import subprocess
import sys
from pathlib import Path

#: Runs each command line of a JSON object (stdin, name -> args) as the ``sparseattn`` script would,
#: with its stdout and stderr sent to files (so that all the process writes is caught: transformers
#: logs to the stderr it found at import); prints the exit codes, outputs and tracebacks as JSON.
DRIVER = r"""
import json, os, sys, tempfile, traceback
from sparseattn.cli import app
cases = json.load(sys.stdin)
saved = os.dup(1), os.dup(2)
results = {}
for name, args in cases.items():
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            app(args=args, prog_name="sparseattn")
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        out.seek(0), err.seek(0)
        results[name] = {"code": code, "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}
print(json.dumps(results))
"""


def run_cli_cases(cases: dict[str, list[str]], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """``{name: {"code", "stdout", "stderr"}}`` for every ``{name: args}`` of ``cases``, run in one subprocess."""
    done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def assert_one_error_line(result: dict, expected: list[str]) -> str:
    """A refusal: exit status 2, no traceback, one ``Error:`` line on stderr holding every ``expected`` phrase."""
    assert result["code"] == 2, result
    assert "Traceback" not in result["stderr"], result["stderr"]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result["stderr"]
    for words in expected:
        assert words in errors[0], errors[0]
    return errors[0]
