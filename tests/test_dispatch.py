"""The dispatch helpers: which implementation a kernel call reaches (per thread), a GPU's multiprocessors,
and the GEMMs whose rows agree whatever their number."""
import threading
import pytest
import torch
from fastcore.test import test_fail as fails_with
from dsv41_nb.dispatch import sm_count, kernel_backend, check_device, use_kernels, seen_in_thread


def test_seen_in_thread_refuses_what_it_cannot_call():
    fails_with(lambda: seen_in_thread(check_device, 3), contains='enter and probe must be callable')


def _backend_here(x):
    "kernel_backend(x), or 'refused' where Triton is forced onto CPU memory without the interpreter"
    try: return kernel_backend(x)
    except RuntimeError: return 'refused'


def test_use_kernels_is_per_thread_and_restored(monkeypatch):
    "A thread inside use_kernels leaves another thread's choice automatic; the choice comes back after an exception"
    monkeypatch.delenv('DSV41_KERNELS', raising=False)
    x = torch.zeros(3, device=check_device())
    auto = kernel_backend(x)
    other = 'torch' if auto == 'triton' else 'triton'        # what the automatic choice is not
    forced = other if other == 'torch' else 'refused'        # Triton on CPU memory, no interpreter
    here, there = seen_in_thread(lambda: use_kernels(other), lambda: _backend_here(x))
    assert (here, there) == (auto, forced)
    with use_kernels(other):                                 # a thread started inside chooses for itself
        seen = []
        t = threading.Thread(target=lambda: seen.append(_backend_here(x))); t.start(); t.join()
        assert seen == [auto] and _backend_here(x) == forced
    with pytest.raises(KeyError, match='inside'):
        with use_kernels(other): raise KeyError('inside')
    assert kernel_backend(x) == auto
    with use_kernels('torch'):
        with use_kernels(None): assert kernel_backend(x) == auto
        assert kernel_backend(x) == 'torch'                  # the outer block still holds
    assert kernel_backend(x) == auto


def test_sm_count():
    "A GPU's multiprocessor count, asked once; a CPU's is the default it is given; an unknown device name is refused"
    assert sm_count('cpu') == 1 and sm_count(torch.device('cpu'), default=16) == 16
    if torch.cuda.is_available():
        assert sm_count('cuda') == torch.cuda.get_device_properties(0).multi_processor_count >= 1
    fails_with(lambda: sm_count('tpu:0'), contains='tpu')


def test_gemm_rows_independent_says_what_this_cpu_does():
    "The answer is this machine's: on other shapes too, a row's bits from 1 to 5 rows match a 6-row product's or not"
    from dsv41_nb.dispatch import gemm_rows_independent
    g = torch.Generator().manual_seed(1)
    same = True
    for dt in (torch.float32, torch.bfloat16):
        w, x = torch.randn(40, 128, generator=g).to(dt), torch.randn(6, 128, generator=g).to(dt)
        full = x @ w.T
        same &= all(torch.equal(x[:m] @ w.T, full[:m]) for m in range(1, 6))
    assert isinstance(gemm_rows_independent(), bool) and gemm_rows_independent() == same


def test_mm_f32_sums_the_exact_products_in_fp32():
    "a @ bᵀ of BF16 operands in fp32 (on a CPU the widened operands' product), one or a batch, bad operands named"
    from dsv41_nb.dispatch import mm_f32
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(7, 48, generator=g).bfloat16()
    out = mm_f32(a, b)
    assert out.dtype == torch.float32 and out.shape == (5, 7)
    assert torch.equal(out, a.float() @ b.float().t())
    A, B = torch.randn(3, 5, 48, generator=g).bfloat16(), torch.randn(3, 7, 48, generator=g).bfloat16()
    out = mm_f32(A, B)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 7)
    assert torch.equal(out, A.float() @ B.float().transpose(1, 2))
    for i in range(3): torch.testing.assert_close(out[i], mm_f32(A[i], B[i]), rtol=1e-6, atol=1e-6)
    strided = B.transpose(1, 2).contiguous().transpose(1, 2)   # the same values, other strides
    torch.testing.assert_close(mm_f32(A, strided), out, rtol=1e-6, atol=1e-6)
    for args, msg in [((a.float(), b), 'a must be a 2-D or 3-D BF16 tensor'),
                      ((a, b[0]), 'b must be a 2-D or 3-D BF16 tensor'),
                      ((a, b[:, :8]), 'expected the same batch, K and device'),
                      ((A, B[:2]), 'expected the same batch, K and device'),
                      ((A, b), 'expected the same batch, K and device'),
                      ((a, 'b'), 'b must be a 2-D or 3-D BF16 tensor')]:
        with pytest.raises(ValueError, match=msg): mm_f32(*args)
