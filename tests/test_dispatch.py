"""The dispatch helpers: the capture mode, the host-read counter, and the bad inputs of the CUDA-graph helper."""
import pytest
import torch
from fastcore.test import test_fail as fails_with
from dsv41_nb.dispatch import capturing, as_captured, HostReads, cuda_graph, graph_time, sm_count, pdl_launch, PDL


def test_as_captured_nests_and_restores():
    assert not capturing()
    with as_captured():
        with as_captured(): assert capturing()
        assert capturing()
    assert not capturing()


def test_host_reads_sees_reads_and_only_reads():
    x = torch.arange(8)
    with HostReads() as none:
        y = torch.where(x > 3, x, 0).cumsum(0)
        z = y[torch.tensor([1, 2])] + x.sum()                          # integer indexing reads nothing back
    assert none.count == 0, dict(none.sites)
    with HostReads() as reads:
        int(x.max()); x[x > 3]; x.nonzero(); bool(x.any())
    assert reads.count >= 4 and all('test_dispatch.py' in s for s in reads.sites), dict(reads.sites)


@pytest.mark.parametrize('call, words', [
    (lambda: cuda_graph(3), 'fn must be callable'),
    (lambda: cuda_graph(lambda: None, calls=0), 'calls must be an int >= 1'),
    (lambda: cuda_graph(lambda: None, warmup=-1), 'warmup must be an int >= 0'),
    (lambda: cuda_graph(lambda: None, warmup=True), 'warmup must be an int >= 0'),
    (lambda: graph_time('f'), 'fn must be callable'),
    (lambda: graph_time(lambda i: None, calls=-2), 'calls must be an int >= 1'),
    (lambda: graph_time(lambda i: None, reps=0), 'reps must be an int >= 1'),
])
def test_cuda_graph_bad_inputs(call, words): fails_with(call, contains=words)


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message a machine without CUDA gives')
def test_cuda_graph_needs_a_gpu(): fails_with(lambda: cuda_graph(lambda: None), contains='no CUDA device')


def test_graph_time_calls_the_first_call_off_the_gpu():
    seen = []
    t = graph_time(lambda i: seen.append(i), calls=4, reps=2)
    assert t > 0 and set(seen) == ({0} if not torch.cuda.is_available() else set(range(4)))

def test_sm_count():
    "A GPU's multiprocessor count, asked once; a CPU's is the default it is given; an unknown device name is refused"
    assert sm_count('cpu') == 1 and sm_count(torch.device('cpu'), default=16) == 16
    if torch.cuda.is_available():
        assert sm_count('cuda') == torch.cuda.get_device_properties(0).multi_processor_count >= 1
    fails_with(lambda: sm_count('tpu:0'), contains='tpu')


@pytest.mark.parametrize('call, words', [
    (lambda: pdl_launch('gpu0'), "'gpu0' is not a device"),
    (lambda: pdl_launch(2.5), '2.5 is not a device'),
])
def test_pdl_launch_bad_inputs(call, words): fails_with(call, contains=words)


def test_pdl_launch_is_off_where_there_is_nothing_to_overlap(monkeypatch):
    """The CPU (interpreter or not) and a switched-off PDL get PDL=False and no launch option; a
    non-bool switch is refused"""
    assert pdl_launch('cpu') == dict(PDL=False)
    monkeypatch.setitem(PDL, 'enabled', False)
    assert pdl_launch('cuda') == dict(PDL=False)
    monkeypatch.setitem(PDL, 'enabled', 1)
    fails_with(lambda: pdl_launch('cpu'), contains="PDL['enabled'] = 1; expected a bool")
    monkeypatch.setitem(PDL, 'enabled', True)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        assert pdl_launch('cuda') == dict(PDL=False)
    else: assert pdl_launch('cuda') == dict(PDL=True, launch_pdl=True)


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
    "a @ bᵀ of BF16 operands in fp32 (on a CPU the widened operands' product), and bad operands named"
    from dsv41_nb.dispatch import mm_f32
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 48, generator=g).bfloat16(), torch.randn(7, 48, generator=g).bfloat16()
    out = mm_f32(a, b)
    assert out.dtype == torch.float32 and out.shape == (5, 7)
    assert torch.equal(out, a.float() @ b.float().t())
    for args, msg in [((a.float(), b), 'a must be a 2-D BF16 tensor'), ((a, b[0]), 'b must be a 2-D BF16 tensor'),
                      ((a, b[:, :8]), 'expected the same K and device'), ((a, 'b'), 'b must be a 2-D BF16 tensor')]:
        with pytest.raises(ValueError, match=msg): mm_f32(*args)
