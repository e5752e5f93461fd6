import os

import pytest
import torch
from hypothesis import settings

# The tests run tiny tensors, where intra-op threads cost more than they give (4x slower on 2 vCPUs).
torch.set_num_threads(1)

# The default ("ci") runs 200 derandomised examples per property everywhere, so a failure reproduces
# and CI runs what a developer runs; HYPOTHESIS_PROFILE=explore draws fresh random examples instead.
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
