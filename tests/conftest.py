import os
os.environ.setdefault('MKL_CBWR', 'AUTO,STRICT')   # as the test command sets it: MKL reads it at its first GEMM
import pytest, torch
import budget                      # noqa: F401  (registers and loads the hypothesis profile of this run)

SLOW = bool(os.environ.get('DSV41_SLOW'))


def pytest_configure(config):
    config.addinivalue_line('markers', "cpu_exact: bit-level parity of two PyTorch paths on this CPU (the GPU tier "
                                       "deselects them: they test the host's CPU, not the compiled kernels)")
    config.addinivalue_line('markers', "processes: starts process groups of its own (spawned ranks, torchrun); CI runs "
                                       "these after the rest, not beside another pytest worker (ports, cores)")
    config.addinivalue_line('markers', "slow: a minute or so in Triton's interpreter; on a CPU it runs with "
                                       "DSV41_SLOW=1, on a GPU always (the GPU tier runs it compiled)")


def pytest_collection_modifyitems(config, items):
    "Skip the `slow` tests on a CPU unless DSV41_SLOW=1"
    if SLOW or torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="slow in Triton's interpreter: DSV41_SLOW=1 runs it (the GPU tier always does)")
    for item in items:
        if item.get_closest_marker('slow'): item.add_marker(skip)


@pytest.fixture(scope='module')
def one_thread():
    "Tensors this small gain nothing from threads, and other processes share the cores (restored afterwards)"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
