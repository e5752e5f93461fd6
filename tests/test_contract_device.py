"""The method contract on an explicit device: states, inputs and steps on ``device``, references on the CPU.

:func:`sparseattn.testing.check_method` draws every input on the CPU (the same numbers on every
device), moves it to ``device``, and checks that outputs, ``attended`` and masks stay there. Here it
runs on the CPU named explicitly, and, marked ``gpu``, on CUDA for every registered method: run the
latter on a GPU machine with ``python -m pytest -m gpu tests/test_contract_device.py``.
"""

from __future__ import annotations

import pytest
import torch

from sparseattn import registry
from sparseattn.testing import check_method

#: Why the CUDA contract skips here, and where the same contract runs instead.
NO_GPU = (
    "needs a CUDA GPU: the contract with every state, input and step on device='cuda'; on the CPU "
    "tests/test_methods_budget.py runs the same checks"
)


# One method per engine that draws or builds on its own: a seeded selector (CPU generator), SubGen's
# sketch (CPU generator, multinomial), and a prefill eviction handing over to a segment search.
@pytest.mark.parametrize("name", ["radar-random", "subgen", "snapkv-then-radar"])
def test_the_contract_runs_on_a_device_given_as_a_torch_device(name):
    check_method(name, device=torch.device("cpu"))


@pytest.mark.parametrize("name", ["radar+", "quest"])
def test_the_contract_runs_at_another_head_dim(name):
    check_method(name, head_dim=16)  # what the CUDA run below uses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("head_dim", [8, 16], ids=["d8-torch-ops", "d16-triton-kernels"])
@pytest.mark.parametrize("name", registry.names())
def test_every_registered_method_meets_the_contract_on_cuda(name, head_dim):
    # Head dim 8 runs the torch ops on CUDA (the Triton kernels need 16 or more); 16 runs the kernels.
    check_method(name, device="cuda", head_dim=head_dim)
