import os

import pytest
import torch
from hypothesis import settings

# Quick examples while developing; CI (CI=true) runs more, derandomised so a failure reproduces.
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
