import os

import pytest
import torch
from hypothesis import settings

# The tests run tiny tensors, where intra-op threads cost more than they give (4x slower on 2 vCPUs).
torch.set_num_threads(1)

# Under pytest-xdist (scripts/test.sh runs two processes) each worker's vLLM engines get a core of their own: vLLM
# binds its CPU worker's threads to VLLM_CPU_OMP_THREADS_BIND, by default core 0 for every engine on the machine.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(int(_XDIST_WORKER.removeprefix("gw")) % (os.cpu_count() or 1))

# The default ("ci") runs 200 derandomised examples per property everywhere, so a failure reproduces
# and CI runs what a developer runs; HYPOTHESIS_PROFILE=explore draws fresh random examples instead.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
