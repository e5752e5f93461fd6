"""The caches' plumbing: where they live, the locks that make concurrent first use convert or build once,
the progress shown while they fill, and the test suite's own skip reasons (issue 14)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparseattn import paths
from sparseattn.backends import cpu_kernels
from sparseattn.hf import models

ROOT = Path(__file__).resolve().parents[1]


def clean_env(**extra):
    """This process's environment without the cache variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPARSEATTN_HOME", "SPARSEATTN_CACHE", "XDG_CACHE_HOME")}
    return {**env, **extra}


# --- where the caches live -----------------------------------------------------------------------


def test_sparseattn_home_moves_every_cache_including_the_kernels(tmp_path, monkeypatch):
    for name in ("SPARSEATTN_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARSEATTN_HOME", str(tmp_path / "home"))
    from sparseattn.data import sources

    assert cpu_kernels.cache_dir() == tmp_path / "home" / "kernels"
    assert sources.TEXTS["hamlet"].path.parent == tmp_path / "home" / "texts"
    assert models._conversion_dir(Path(__file__)).parent == tmp_path / "home" / "models"


def test_sparseattn_cache_still_moves_the_kernel_cache_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEATTN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARSEATTN_CACHE", str(tmp_path / "kernels-root"))
    assert cpu_kernels.cache_dir() == tmp_path / "kernels-root" / "kernels"
    assert paths.cache_dir("models") == tmp_path / "home" / "models"


@pytest.mark.skipif(cpu_kernels.find_compiler() is None, reason="needs a C compiler (gcc, clang or $CC) to build the kernel")
def test_a_fresh_process_builds_the_kernel_under_sparseattn_home(tmp_path):
    # The end-to-end check: nothing lands in the XDG (default) cache.
    env = clean_env(SPARSEATTN_HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    script = "from sparseattn.backends.cpu_kernels import load_library; load_library(); print('loaded')"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-3000:]
    assert len(list((tmp_path / "home" / "kernels").glob("cpu_kernels-*.so"))) == 1
    assert not list((tmp_path / "xdg").rglob("*.so"))


# --- one conversion, one build, however many processes start at once -------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEATTN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "Tiny.gguf"
    path.write_bytes(b"GGUF stand-in bytes")
    return path


def slow_fake_converter(calls, seconds):
    """A stand-in for the GGUF conversion: slow, counted, and leaving what a valid conversion has."""

    def convert(gguf, out):
        calls.append(threading.get_ident())
        time.sleep(seconds)
        (out / "model.safetensors").write_bytes(b"stand-in weights")

    return convert


def test_two_concurrent_first_loads_convert_the_model_once(home, fake_gguf, monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_convert_gguf", slow_fake_converter(calls, 1.0))
    results, errors = [], []

    def load():
        try:
            results.append(models.local_model_dir(str(fake_gguf)))
        except BaseException as err:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(err)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(calls) == 1, f"the model was converted {len(calls)} times"
    assert len(results) == 2 and results[0] == results[1] and (results[0] / models.MARKER).is_file()


def test_the_file_lock_makes_the_second_holder_wait_and_says_so(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPARSEATTN_PROGRESS_SECONDS", "0.1")
    lock = tmp_path / "locks" / "x.lock"
    order = []
    held = threading.Event()

    def first():
        with paths.file_lock(lock, "the first holder"):
            held.set()
            time.sleep(0.5)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(10)
    with paths.file_lock(lock, "the first holder"):
        order.append("second in")
    thread.join()
    assert order == ["first done", "second in"]
    err = capfd.readouterr().err
    assert "waiting for the first holder: started" in err and "(done)" in err


COUNTING_CC = """#!{python}
import os, sys, time
if "-c" in sys.argv:  # a compile step (not --version, not the link): count it, and take long enough to race
    with open({log!r}, "a") as log:
        log.write(f"{{os.getpid()}}\\n")
    time.sleep(2)
os.execv({cc!r}, [{cc!r}, *sys.argv[1:]])
"""


@pytest.mark.skipif(cpu_kernels.find_compiler() is None, reason="needs a C compiler (gcc, clang or $CC) to build the kernel")
def test_two_processes_on_an_empty_kernel_cache_compile_once(tmp_path):
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "counting-cc"
    wrapper.write_text(COUNTING_CC.format(python=sys.executable, log=str(log), cc=cpu_kernels.find_compiler()))
    wrapper.chmod(0o755)
    # SPARSEATTN_CACHE (not _HOME): the kernel cache's own variable, which also moved it before the lock existed.
    env = clean_env(SPARSEATTN_CACHE=str(tmp_path / "cache"), CC=str(wrapper), SPARSEATTN_PROGRESS_SECONDS="0.5")
    script = "from sparseattn.backends.cpu_kernels import cpu_kernel_refusal; print(cpu_kernel_refusal())"
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [out.strip() for out, _ in outputs] == ["None", "None"], [err[-2000:] for _, err in outputs]
    assert len(log.read_text().splitlines()) == 1, "both processes compiled the kernel"
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("compiling cpu_kernels.c with counting-cc") >= 2  # started ... done, by one builder


# --- progress while a cache fills --------------------------------------------------------------------


def test_the_model_conversion_shows_progress_lines_in_logs(home, fake_gguf, monkeypatch, capfd):
    monkeypatch.setenv("SPARSEATTN_PROGRESS_SECONDS", "0.1")
    monkeypatch.setattr(models, "_convert_gguf", slow_fake_converter([], 0.45))
    models.local_model_dir(str(fake_gguf))
    lines = capfd.readouterr().err.splitlines()
    converting = [line for line in lines if line.startswith("converting Tiny.gguf to safetensors (once)")]
    assert converting[0].endswith(": started") and converting[-1].endswith("(done)")
    assert len(converting) >= 4  # started, >= 2 heartbeats during the 0.45 s, done


def test_the_kernel_compile_shows_progress_lines_in_logs(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("SPARSEATTN_PROGRESS_SECONDS", "0.1")

    def slow_compile(compiler, source, target, extra):
        time.sleep(0.45)
        target.write_bytes(b"stand-in library")

    monkeypatch.setattr(cpu_kernels, "_compile", slow_compile)
    target = tmp_path / "cpu_kernels-0123.so"
    assert cpu_kernels._ensure_built("cc", "cc 1.0", b"int x;", target, "0123")
    assert not cpu_kernels._ensure_built("cc", "cc 1.0", b"int x;", target, "0123")  # verified: not rebuilt
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("compiling cpu_kernels.c")]
    assert lines[0].endswith(": started") and lines[-1].endswith("(done)") and len(lines) >= 4


# --- the suite's skip reasons say what is missing and how to get it ----------------------------------


def skip_reasons(*args, **env):
    """The ``SKIPPED`` lines of a pytest run in a fresh process."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]


def test_the_longbench_skip_says_what_the_fixture_is_and_how_to_point_at_it(tmp_path):
    (reason,) = skip_reasons("tests/test_longbench.py", "-k", "test_parity_with_official_eval and trec",
                             SPARSEATTN_LONGBENCH_FIXTURE=str(tmp_path / "nowhere"))
    assert "LongBench" in reason and "SPARSEATTN_LONGBENCH_FIXTURE" in reason and str(tmp_path / "nowhere") in reason
    assert "result.json" in reason and "eval.py" in reason  # what the folder must hold, and where it comes from


@pytest.mark.skipif(sys.platform != "linux" or not __import__("importlib").util.find_spec("triton"),
                    reason="needs triton (pip install -e '.[dev]' on Linux x86-64) to have triton tests to skip")
def test_the_triton_skips_say_why_and_how_to_run_them():
    reasons = skip_reasons("tests/test_backends.py", "-k", "test_triton_kernel_matches_reference and B1H1G1 and c1n7 and float32",
                           TRITON_INTERPRET="0")
    assert reasons, "expected the interpreter test to be skipped when triton runs compiled"
    for reason in reasons:
        assert "TRITON_INTERPRET=1" in reason and "python -m pytest" in reason, reason
    if not __import__("torch").cuda.is_available():
        (gpu,) = skip_reasons("tests/test_backends.py", "-m", "gpu", "-k", "test_auto_picks_triton_on_gpu")
        assert "needs a CUDA GPU" in gpu and "interpreter" in gpu, gpu
