"""Collection rules for the whole repository (tests/conftest.py has the test suite's settings).

``--doctest-modules`` imports every module of the package; the modules that exist to be loaded by vLLM
and import it at their top (their classes subclass vLLM's) are collected only where vLLM is installed:
the vLLM venv, where scripts/test.sh runs the vLLM tests.
"""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["sparseattn/vllm/backend.py", "sparseattn/vllm/forcing.py", "sparseattn/vllm/worker.py"]
