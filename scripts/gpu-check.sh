#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py; docs/performance.md, "GPU"): kernel tests compiled on the
# GPU, the method contract on CUDA, one layer's decode step, model.generate and the fixed-shape loop end to
# end, each step's result written to $OUT (or --out) as it finishes. Made for a bare GPU machine without
# network: nothing is installed, the checkout is put on PYTHONPATH (torch, triton, transformers, einops, typer,
# rich, safetensors, pytest and hypothesis must be there already). Its runs so far took 3.4-3.9 minutes on an
# H200 before the loop step (issue 48: ~2 more; the steps' time limits add up to 11.5 minutes). `--cpu` runs the same steps
# at toy sizes on the CPU, the kernels in Triton's interpreter (what tests/test_gpu_check.py runs in CI).
#
#   bash scripts/gpu-check.sh                        # on a GPU machine: results in $OUT or benchmarks/results/gpu-check
#   bash scripts/gpu-check.sh --steps attention      # one step (kernels, contract, attention, generate, loop)
#   bash scripts/gpu-check.sh --cpu --out /tmp/check # the CPU check
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 benchmarks/gpu_check.py "$@"
