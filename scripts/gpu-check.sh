#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py; docs/performance.md, "GPU"): kernel tests compiled on the
# GPU, the method contract on CUDA, one layer's decode step and model.generate end to end, each step's result
# written to $OUT (or --out) as it finishes. Made for a bare GPU machine without network: nothing is installed,
# the checkout is put on PYTHONPATH (torch, triton, transformers, einops, typer, rich, safetensors, pytest and
# hypothesis must be there already). About 7 minutes on an H200. `--cpu` runs the same steps at toy sizes on
# the CPU, the kernels in Triton's interpreter (what tests/test_gpu_check.py runs in CI).
#
#   bash scripts/gpu-check.sh                        # on a GPU machine: results in $OUT or benchmarks/results/gpu-check
#   bash scripts/gpu-check.sh --steps attention      # one step (kernels, contract, attention, generate)
#   bash scripts/gpu-check.sh --cpu --out /tmp/check # the CPU check
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 benchmarks/gpu_check.py "$@"
