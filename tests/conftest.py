import os
import pytest, torch
from hypothesis import settings, HealthCheck

# Default runs are sized for CI (2 cores, ~20 minutes for everything); DSV41_SLOW=1 runs the long versions.
settings.register_profile('ci', deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('slow', deadline=None, max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile('slow' if os.environ.get('DSV41_SLOW') else 'ci')


@pytest.fixture(scope='module')
def one_thread():
    "Tensors this small gain nothing from threads, and other processes share the cores (restored afterwards)"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
