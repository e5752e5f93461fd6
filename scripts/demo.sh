#!/usr/bin/env bash
# Install the pinned CPU torch and the package, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet torch==2.13.0  # the pinned CPU build; an unpinned torch pulls CUDA
python3 -m pip install --quiet -e .
sparseattn demo "$@"
