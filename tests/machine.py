"""Where the tests run, shared by every test file: the device, and whether Triton kernels can run on it (a GPU, or
TRITON_INTERPRET=1 on a CPU, as CI runs them); kernel tests carry `needs_triton` and are skipped without either."""
import pytest
import torch
from dsv41_nb.dispatch import kernel_backend

DEV = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
HAS_TRITON = kernel_backend(torch.zeros(1, device=DEV)) == 'triton'
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason='no Triton: needs a GPU or TRITON_INTERPRET=1')
