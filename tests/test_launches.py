"""The launch helpers: the capture mode and the trusted values (per thread), the host-read counter, the CUDA-graph
helpers and their bad inputs, programmatic dependent launch, and the launch keys (Triton's specializations)."""
import collections, threading
import pytest
import torch
import triton
import triton.language as tl
from fastcore.test import test_fail as fails_with
from dsv41_nb.dispatch import kernel_backend, check_device, seen_in_thread
from dsv41_nb.launches import (capturing, as_captured, HostReads, cuda_graph, graph_time,
                               pdl_launch, PDL, spec_class, launch_keys, copy_time, _copy_launch)
import dsv41_nb.launches as launches
from triton.runtime.jit import JITFunction
from triton.runtime.interpreter import InterpretedFunction


def test_as_captured_nests_and_restores():
    assert not capturing()
    with as_captured():
        with as_captured(): assert capturing()
        assert capturing()
    assert not capturing()


def test_as_captured_is_per_thread_and_restored():
    "A thread inside as_captured leaves another thread eager, its checks on; the mode comes back after an exception"
    from dsv41_nb.launches import checks_values
    here, there = seen_in_thread(as_captured, lambda: (capturing(), checks_values()))
    assert here == (False, True) and there == (True, False)
    with as_captured():                                      # a thread started inside is not captured
        seen = []
        t = threading.Thread(target=lambda: seen.append(capturing())); t.start(); t.join()
        assert seen == [False] and capturing()
    with pytest.raises(KeyError, match='inside'):
        with as_captured(): raise KeyError('inside')
    assert not capturing() and checks_values()


def test_host_reads_sees_reads_and_only_reads():
    x = torch.arange(8)
    with HostReads() as none:
        y = torch.where(x > 3, x, 0).cumsum(0)
        z = y[torch.tensor([1, 2])] + x.sum()                          # integer indexing reads nothing back
    assert none.count == 0, dict(none.sites)
    with HostReads() as reads:
        int(x.max()); x[x > 3]; x.nonzero(); bool(x.any())
    assert reads.count >= 4 and all('test_launches.py' in s for s in reads.sites), dict(reads.sites)


@pytest.mark.parametrize('call, words', [
    (lambda: cuda_graph(3), 'fn must be callable'),
    (lambda: cuda_graph(lambda: None, calls=0), 'calls must be an int >= 1'),
    (lambda: cuda_graph(lambda: None, warmup=-1), 'warmup must be an int >= 0'),
    (lambda: cuda_graph(lambda: None, warmup=True), 'warmup must be an int >= 0'),
    (lambda: graph_time('f'), 'fn must be callable'),
    (lambda: graph_time(lambda i: None, calls=-2), 'calls must be an int >= 1'),
    (lambda: graph_time(lambda i: None, reps=0), 'reps must be an int >= 1'),
    (lambda: copy_time(1, 'cpu'), 'nbytes must be an int >= 2'),
    (lambda: copy_time(2.0, 'cpu'), 'nbytes must be an int >= 2'),
    (lambda: copy_time(False, 'cpu'), 'nbytes must be an int >= 2'),
])
def test_cuda_graph_bad_inputs(call, words): fails_with(call, contains=words)


def test_copy_time_times_one_copy_of_the_bytes(monkeypatch):
    "the launch copies nbytes // 2 bytes to a second buffer (a graph replay on a GPU); that call is timed"
    dev = check_device()
    src, dst, run = _copy_launch(4097, dev)
    dst.zero_(); run()
    assert (src.numel(), dst.equal(src), dst.data_ptr() != src.data_ptr()) == (2048, True, True)
    seen = []
    monkeypatch.setattr(launches, 'median_time', lambda fn, warmup, rep: seen.append((warmup, rep)) or 0.25)
    assert copy_time(1 << 12, dev, rep=20) == 0.25 and seen == [(5, 20)]
    assert copy_time(2, dev, rep=3) == 0.25 and seen[-1] == (1, 3)      # the fewest bytes: one each way


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message a machine without CUDA gives')
def test_cuda_graph_needs_a_gpu(): fails_with(lambda: cuda_graph(lambda: None), contains='no CUDA device')


def test_graph_time_calls_the_first_call_off_the_gpu():
    seen = []
    t = graph_time(lambda i: seen.append(i), calls=4, reps=2)
    assert t > 0 and set(seen) == ({0} if not torch.cuda.is_available() else set(range(4)))


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


@pytest.mark.parametrize('v, want', [
    (1, ('constexpr', 1)), (0, ('i32', 'D')), (48, ('i32', 'D')), (47, ('i32', '')), (-16, ('i32', 'D')),
    (2**31, ('i64', 'D')), (2**40 + 1, ('i64', '')), (2**63, ('u64', 'D')), (True, ('u1', None)),
    (0.5, ('fp32', None)), (None, ('constexpr', None)),
    (torch.zeros(4, dtype=torch.bfloat16), ('*bfloat16', 'D')), (torch.zeros(9)[1:], ('*float32', ''))])
def test_spec_class(v, want):
    assert spec_class(v) == want
    if isinstance(v, int) and not isinstance(v, bool): assert spec_class(v, specialize=False)[1] is None
    if isinstance(v, torch.Tensor): assert spec_class(v, align=False)[1] == ''


def test_spec_class_agrees_with_triton():
    native = pytest.importorskip('triton._C.libtriton').__dict__.get('native_specialize_impl')
    if native is None: pytest.skip("this Triton classes its arguments in Python")
    from triton.backends.compiler import BaseBackend
    for v in (1, 0, 16, 33, -32, 2**40, 2**40 + 3, torch.zeros(4), torch.zeros(5)[1:], torch.zeros(2).half()):
        assert spec_class(v)[1] == native(BaseBackend, v, False, True, True)[1], v


@triton.jit
def _bump_kernel(x_ptr, n, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(x_ptr + i, x + (2 if TWICE else 1), mask=i < n)


@triton.jit(do_not_specialize=['n'])
def _bump_any_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def test_launch_keys_tell_specializations_apart_and_the_kernels_still_run():
    x = torch.zeros(40, device=check_device())
    if kernel_backend(x) != 'triton': pytest.skip('no Triton here (a CPU without TRITON_INTERPRET=1)')
    runs = (JITFunction.run, InterpretedFunction.run)
    with launch_keys() as keys:
        for n in (1, 3, 5, 16, 32): _bump_kernel[(1,)](x, n, BLOCK=32)        # n: 1, odd twice, 16 twice
        _bump_kernel[(1,)](x, 5, BLOCK=32, TWICE=True)                         # another constexpr
        _bump_kernel[(1,)](x[1:], 5, BLOCK=32)                                  # an unaligned pointer
        _bump_kernel[(1,)](x, 5, BLOCK=32, num_warps=2)                         # another launch option
        for n in (1, 3, 16): _bump_any_kernel[(1,)](x, n, BLOCK=32)             # one kernel for all
    assert (JITFunction.run, InterpretedFunction.run) == runs                  # put back
    by_name = collections.Counter(k[0] for k in keys)
    assert by_name == {'_bump_kernel': 6, '_bump_any_kernel': 1} and sum(keys.values()) == 11
    assert sorted(keys.values()) == [1, 1, 1, 1, 2, 2, 3]
    # every launch ran: x[0] by all but the unaligned one (the twice one adds 2), x[5] by those past 5, x[1:]'s too
    assert (x[0].item(), x[5].item(), x[30].item()) == (5 + 2 + 1 + 3, 2 + 1 + 1, 1)
    with pytest.raises(RuntimeError, match='inside'):
        with launch_keys(): raise RuntimeError('inside')
    assert (JITFunction.run, InterpretedFunction.run) == runs


def test_trusted_values_skip_only_the_checks_that_read_values():
    "Inside trusted_values a negative position is not read back (no error); outside, it is refused; shapes always are"
    from dsv41_nb.launches import trusted_values, checks_values
    from dsv41_nb.rope_norm import _check_rope
    x, f = torch.zeros(3, 8), torch.ones(2)
    with pytest.raises(ValueError, match='positions holds -1'): _check_rope(x, f, torch.tensor([0, -1, 2]))
    with trusted_values():
        assert not checks_values()
        _check_rope(x, f, torch.tensor([0, -1, 2]))
        with pytest.raises(TypeError, match=r'positions must be integers of shape \(3,\)'):
            _check_rope(x, f, torch.tensor([0, 1]))
    assert checks_values()


def test_trusted_values_is_per_thread_and_restored():
    "A thread inside trusted_values leaves another thread's checks on; the flag comes back, after an exception too"
    from dsv41_nb.launches import trusted_values, checks_values
    assert seen_in_thread(trusted_values, checks_values) == (True, False)   # not this thread's block
    assert checks_values()
    with pytest.raises(KeyError, match='inside'):
        with trusted_values(): raise KeyError('inside')
    assert checks_values()
    with trusted_values():
        with trusted_values(): pass
        assert not checks_values()                           # the outer block still holds
    assert checks_values()
