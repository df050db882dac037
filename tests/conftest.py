import pytest, torch
import budget                      # noqa: F401  (registers and loads the hypothesis profile of this run)


@pytest.fixture(scope='module')
def one_thread():
    "Tensors this small gain nothing from threads, and other processes share the cores (restored afterwards)"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
