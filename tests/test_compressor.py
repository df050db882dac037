"""Property tests of the compressor: RoPE/YaRN against independent formulas, and the fused kernel and the PyTorch path
against the token-by-token reference over random schedules (several requests, random chunks, padding).

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either they are skipped."""
import math
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore import test as fct
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.kv_cache import compressed_slot_mapping, ring_slot_mapping, PAD_SLOT_ID
import dsv41_nb.compressor_kernel as comp_kernel
from dsv41_nb.launches import HostReads
from dsv41_nb.compressor import (rope_inv_freq, layer_inv_freq, rope_cos_sin, apply_rope, rms_norm,
                                 pool_group, Compressor, compress_reference, compress_torch)
from dsv41_nb.compressor_kernel import compress_step, compress_version
from dsv41_nb.ring_rollback import RingJournal, RingRows, ring_rewind_trial
from machine import DEV, HAS_TRITON

TINY, FULL = ModelConfig.tiny(), ModelConfig.full()
FORMATS = ('ds_fp4', 'fp8_ds_mla', 'window_fp8')

def same_bits(a, b): return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))

# ---------------------------------------------------------------- RoPE
def yarn_numpy(dim, theta, L, factor, beta_fast, beta_slow):
    "YaRN frequencies in float64, written from the formula"
    i = np.arange(dim // 2)
    f = theta ** (-2.0 * i / dim)
    # rotations of each pair over the training context
    turns = L * f / (2 * np.pi)
    lo = max(math.floor(dim * math.log(L / (beta_fast * 2 * math.pi)) / (2 * math.log(theta))), 0)
    hi = min(math.ceil(dim * math.log(L / (beta_slow * 2 * math.pi)) / (2 * math.log(theta))), dim - 1)
    ramp = np.clip((i - lo) / max(hi - lo, 1e-3), 0, 1)
    return f / factor * ramp + f * (1 - ramp), turns

def test_yarn_against_float64_formula():
    got = rope_inv_freq(64, 160000., 65536, 16, 32, 1).double().numpy()
    want, turns = yarn_numpy(64, 160000., 65536, 16, 32, 1)
    np.testing.assert_allclose(got, want, rtol=3e-7)                    # fp32 rounding of each step (a few ulp)
    assert (got[turns > 32] == rope_inv_freq(64, 160000.).numpy()[turns > 32]).all()   # fast pairs untouched
    fct.test_fail(lambda: rope_inv_freq(0, 1e4), contains='positive even integer')

@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.integers(0, 2**31))
@settings(max_examples=examples(30))
def test_rope_is_a_rotation(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    f = layer_inv_freq(FULL, 2)
    x = torch.randn(3, 512, generator=g)
    cos, sin = rope_cos_sin(f, [m] * 3)
    y = apply_rope(x, cos, sin)
    z = torch.view_as_complex(x[:, -64:].unflatten(-1, (-1, 2)).contiguous()) * torch.complex(cos, sin)
    assert ((y[:, -64:] - torch.view_as_real(z).flatten(-2)).abs()
            <= 2 ** -23 * x[:, -64:].abs().amax(-1, keepdim=True)).all()
    assert torch.equal(y[:, :-64], x[:, :-64])
    back = apply_rope(y, cos, sin, inverse=True)
    assert (back - x).abs().max() <= 4 * 2 ** -23 * x.abs().max()       # two rotations, a few roundings each

def test_cos_sin_do_not_depend_on_the_batch():
    f = layer_inv_freq(FULL, 2)
    pos = torch.randint(0, 1 << 20, (257,))
    c_all, s_all = rope_cos_sin(f, pos)
    for k in (0, 1, 100, 256):
        c1, s1 = rope_cos_sin(f, pos[k:k + 1])
        assert torch.equal(c1[0], c_all[k]) and torch.equal(s1[0], s_all[k])

def test_rms_norm_and_pooling():
    x = (torch.randn(64, 512) * 7).bfloat16()
    w = torch.rand(512) + 0.5
    ref = (w * (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-20))).bfloat16()
    assert (rms_norm(x, w, 1e-20).view(torch.int16).int() - ref.view(torch.int16).int()).abs().max() <= 1
    kv, sc = torch.randn(50, 2, 512), torch.randn(50, 2, 512) * 3
    assert ((pool_group(kv, sc) - (kv * sc.softmax(1)).sum(1)).abs() <= 2 ** -22 * kv.abs().sum(1)).all()

# ---------------------------------------------------------------- the compressor against its reference
class Harness:
    "Requests with random block tables and ring blocks, their tokens projected once, and caches of random bytes"
    def __init__(self, c, lengths, seed, block_size=16):
        g = torch.Generator().manual_seed(seed)
        self.c, self.bs, self.lengths = c, block_size, lengths
        need = [-(-n // block_size) for n in lengths]
        ids = (torch.randperm(sum(need) + 3, generator=g) + 1).tolist()
        self.tables = [ids[sum(need[:q]):sum(need[:q + 1])] for q in range(len(lengths))]
        self.rings = (torch.randperm(len(lengths) + 2, generator=g) + 1)[:len(lengths)].tolist()
        self.num_blocks = sum(need) + 5
        with torch.no_grad():
            self.proj = [c.project(torch.randn(n, c.wkv.in_features, generator=g).to(DEV)) for n in lengths]
        self.g = g

    def caches(self):
        g = torch.Generator().manual_seed(99)
        cache = torch.randint(0, 256, self.c.new_cache(self.num_blocks, self.bs).shape,
                              dtype=torch.uint8, generator=g).to(DEV)
        ring = (torch.randn(self.num_blocks * self.c.ratio, 2, self.c.head_dim, generator=g).to(DEV)
                if self.c.ratio > 1 else None)
        return cache, ring

    def step(self, chunks):
        "chunks: [(request or None for padding, first position, n)] -> the arguments of one emit call"
        r, D = self.c.ratio, self.c.head_dim
        kv, sc, pos, rs, cs = [], [], [], [], []
        for q, s, n in chunks:
            p = torch.arange(s, s + n); pos.append(p)
            if q is None:
                kv.append(torch.randn(n, D, generator=self.g).to(self.proj[0][0].dtype))
                sc.append(torch.randn(n, D, generator=self.g))
                rs.append(torch.full((n,), PAD_SLOT_ID)); cs.append(torch.full((n,), PAD_SLOT_ID)); continue
            k, s_ = self.proj[q]
            kv.append(k[s:s + n].cpu()); sc.append(s_[s:s + n].cpu() if s_ is not None else torch.zeros(n, D))
            rs.append(ring_slot_mapping(self.rings[q], p, r) if r > 1 else torch.full((n,), PAD_SLOT_ID))
            cs.append(compressed_slot_mapping(self.tables[q], p, self.bs, r))
        cat = lambda t: torch.cat(t).to(DEV)
        return cat(kv), (cat(sc) if r > 1 else None), cat(pos), (cat(rs) if r > 1 else None), cat(cs)

    def run(self, fn, schedule):
        cache, ring = self.caches()
        lat = [fn(self.c, *self.step(chunks), ring, cache) for chunks in schedule]
        return cache, ring, lat

@st.composite
def schedules(draw, max_requests=3, max_len=40, max_chunk=9):
    """Request lengths and steps: each step advances every unfinished request by a random chunk,
    padding sometimes between"""
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_requests))
    done, steps = [0] * len(lengths), []
    while any(d < n for d, n in zip(done, lengths)):
        step = []
        for q in draw(st.permutations(range(len(lengths)))):
            if done[q] >= lengths[q]: continue
            k = min(draw(st.integers(1, max_chunk)), lengths[q] - done[q])
            step.append((q, done[q], k)); done[q] += k
            if draw(st.integers(0, 4)) == 0: step.append((None, 0, draw(st.integers(1, 2))))
        steps.append(step)
    return lengths, steps

def kernel_emit(c, *args):
    with use_kernels('triton'): return c.emit(*args)

def compressor(layer, fmt, seed):
    c = Compressor(TINY, layer, fmt).to(DEV)
    c.norm.weight.data = torch.rand(TINY.head_dim, generator=torch.Generator().manual_seed(seed)).to(DEV) + 0.5
    return c

def run_both(sched, layer, fmt, seed, fn):
    "The same schedule through the token-by-token reference and through `fn`: (harness, reference run, `fn` run)"
    lengths, steps = sched
    h = Harness(compressor(layer, fmt, seed), lengths, seed)
    return h, h.run(compress_reference, steps), h.run(fn, steps)

@given(schedules(), st.sampled_from([2, 6]), st.sampled_from(FORMATS), st.integers(0, 2**31))
@settings(max_examples=examples(25))
def test_torch_path_equals_reference(sched, layer, fmt, seed):
    h, (ca, ra, la), (cb, rb, lb) = run_both(sched, layer, fmt, seed, compress_torch)
    assert same_bits(ca, cb) and all(same_bits(a, b) for a, b in zip(la, lb))

def in_order(how):
    "`compress_step` with its programs taking the rows in natural, reversed or shuffled order"
    def fn(c, kv, sc, pos, rs, cs, ring, cache):
        n = len(pos)
        order = {'natural': None, 'reversed': torch.arange(n - 1, -1, -1), 'shuffled': torch.randperm(n)}[how]
        return compress_step(c, kv, sc, pos, rs, cs, ring, cache, None if order is None else order.to(pos.device))
    return fn

def version_emit(v):
    def fn(c, *args):
        with compress_version(v): return kernel_emit(c, *args)
    return fn

KERNELS = {'v1': version_emit(1), 'v2': version_emit(2), 'v2 reversed': in_order('reversed'),
           'v2 shuffled': in_order('shuffled')}

@pytest.mark.skipif(not HAS_TRITON, reason='needs a GPU or TRITON_INTERPRET=1')
@given(schedules(max_requests=3, max_len=30, max_chunk=7), st.sampled_from([2, 6]),
       st.sampled_from(FORMATS), st.integers(0, 2**31), st.sampled_from(list(KERNELS)))
@settings(max_examples=examples(5))
def test_kernel_equals_reference(sched, layer, fmt, seed, kernel):
    "Both versions, and version 2 with its programs in any order (the interpreter runs them in index order otherwise)"
    lengths = sched[0]
    h, (ca, ra, la), (cb, rb, lb) = run_both(sched, layer, fmt, seed, KERNELS[kernel])
    assert same_bits(ca, cb), 'cache bytes differ'
    assert all(same_bits(a, b) for a, b in zip(la, lb)), 'latents differ'
    r = h.c.ratio
    for q, n in enumerate(lengths):                                   # the open group each request leaves in its ring
        if r > 1 and n % r:
            e = torch.arange(n - n % r, n) % r + h.rings[q] * r
            assert same_bits(ra[e], rb[e]), 'open group differs'

@pytest.mark.skipif(not HAS_TRITON, reason='needs a GPU or TRITON_INTERPRET=1')
@given(st.integers(1, 30), st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(0, 2**31))
@settings(max_examples=examples(5))
def test_chunked_equals_one_shot(n, chunk_sizes, seed):
    "A prompt prefilled in any chunks (and decoded one token at a time after them) stores what one prefill stores"
    h = Harness(compressor(2, 'ds_fp4', seed), [n], seed)
    steps, s = [], 0
    for k in chunk_sizes + [1] * n:
        if s >= n: break
        steps.append([(0, s, min(k, n - s))]); s += min(k, n - s)
    ca, _, la = h.run(kernel_emit, [[(0, 0, n)]])
    cb, _, lb = h.run(kernel_emit, steps)
    assert same_bits(ca, cb) and same_bits(la[0], torch.cat(lb))

@pytest.mark.parametrize('layer', [2, 6])
def test_padding_writes_nothing(layer):
    for backend in (('torch', 'triton') if HAS_TRITON else ('torch',)):
        h = Harness(compressor(layer, 'ds_fp4', 0), [4], 0)
        cache, ring = h.caches()
        cache0, ring0 = cache.clone(), (ring.clone() if ring is not None else None)
        with use_kernels(backend): lat = h.c.emit(*h.step([(None, 0, 3), (None, 5, 2)]), ring, cache)
        assert same_bits(cache, cache0) and (ring is None or same_bits(ring, ring0)) and not lat.any()

def test_bad_inputs():
    c = Compressor(TINY, 2)
    kv, sc, pos = torch.randn(4, 64), torch.randn(4, 64), torch.arange(4)
    rs, cs, ring, cache = torch.tensor([2, 3, 2, 3]), torch.tensor([-1, 0, -1, 1]), c.new_ring(2), c.new_cache(2, 16)
    for fn, msg in [
        (lambda: Compressor(TINY, 3), 'not a KV source'),
        (lambda: Compressor(FULL, 20, 'index_fp8'), 'not head_dim 512'),
        (lambda: Compressor(FULL, 20, 'no_such_format'), 'unknown cache format'),
        (lambda: rope_cos_sin(layer_inv_freq(TINY, 2), torch.tensor([[1, 2]])), 'expected 1-D integers'),
        (lambda: apply_rope(torch.randn(2, 16), torch.zeros(2, 8), torch.zeros(2, 7)), 'differ'),
        (lambda: c.emit(kv, sc, pos, rs, cs, ring, cache[..., :35]), 'cache: expected a contiguous uint8 tensor'),
        (lambda: c.emit(kv, sc[:3], pos, rs, cs, ring, cache), 'score: expected (4, 64)'),
        (lambda: c.emit(kv, sc, pos, rs, torch.tensor([-1, 0, -1, -2]), ring, cache), 'holds -2'),
        (lambda: c.emit(kv, sc, pos, rs, cs, ring.double(), cache), 'ring: expected'),
        (lambda: c.emit(kv, sc, pos, rs, cs.to(torch.int16), ring, cache), 'int32/int64'),
    ]: fct.test_fail(fn, contains=msg)


# ---------------------------------------------------------------- taking rows back
@settings(max_examples=examples(25), deadline=None)
@given(st.integers(0, 6), st.integers(2, 7), st.integers(0, 6), st.sampled_from(['torch', 'triton']))
def test_ring_rewind_equals_a_run_without_the_rejected_rows(start, n, keep, backend):
    """A step of n rows from `start` journaled, then rewound to keep `keep` of them: the ring block
    a run of only those leaves"""
    if backend == 'triton' and not HAS_TRITON: pytest.skip('no Triton here')
    keep = min(keep, n - 1)
    c = Compressor(TINY, 2).to(DEV)
    kv, sc = (t.detach() for t in c.project(torch.randn(start + n, TINY.dim, device=DEV)))
    def run(ring, cache, a, b, journal=None):
        pos = torch.arange(a, b, device=DEV)
        c.journal = journal
        try:
            with use_kernels(backend):
                c.emit(kv[a:b], sc[a:b], pos, 2 + pos % 2,
                       torch.where((pos + 1) % 2 == 0, pos // 2, -1), ring, cache)
        finally: c.journal = None
    fresh = lambda: (c.new_ring(2, DEV), torch.zeros(16, c.codec.record_bytes, dtype=torch.uint8, device=DEV))
    ring, cache = fresh()
    if start: run(ring, cache, 0, start)
    j = RingJournal(ring, 2, [1])
    run(ring, cache, start, start + n, j)
    p = start + keep + 1                                    # rows start..p-1 kept
    want, want_cache = fresh(); run(want, want_cache, 0, p)
    if p % 2:                                               # an open group: the ring must hold its row
        j.rewind(ring, 1, p)
        assert same_bits(ring[2:4][0], want[2:4][0])
    assert j.first_position(1) == start

@pytest.mark.parametrize('f, exc, msg', [
    (lambda r: RingJournal(r, 1, [0]), ValueError, 'a ring needs a ratio >= 2'),
    (lambda r: RingJournal(r, 2, [2]), IndexError, 'outside the ring'),
    (lambda r: RingJournal(r, 2, [1]).rewind(r, 0, 3), KeyError, 'block 0 was not journaled'),
])
def test_ring_journal_bad_input(f, exc, msg):
    ring = Compressor(TINY, 2).new_ring(2)
    with pytest.raises(exc, match=msg): f(ring)

@pytest.mark.parametrize('backend, seed', [('torch', 0), ('torch', 1), ('torch', 2)]
                         + ([pytest.param('triton', 0, marks=pytest.mark.slow)] if HAS_TRITON else []))
def test_ring_rows_rewind_as_the_journal(backend, seed):
    """Random verification steps, rewound by RingJournal and by RingRows (the fixed-shape journal a CUDA
    graph can hold): the same latents, records and open ring rows after every step"""
    with use_kernels(backend): assert ring_rewind_trial(Compressor(TINY, 2).to(DEV), 30, 3, seed, DEV) == 0

def test_ring_rows_record_reads_nothing_and_restores_one_row():
    c = Compressor(TINY, 2)
    ring = c.new_ring(3)
    rows = RingRows(ring, 2)
    kv, sc, pos = torch.randn(6, 64), torch.randn(6, 64), torch.tensor([3, 4, 5, 6, 7, 0])
    rs = torch.tensor([2, 3, 2, 3, 2, -1])                         # block 1; the last row is padding
    with HostReads() as reads: rows.record(kv, sc, pos, rs)
    assert reads.count == 0 and torch.equal(rows.rows[1 * 8 + 5, 0], kv[2])
    assert torch.equal(rows.rows[-1, 1], sc[5])                    # padding: the spare row
    rows.restore(ring, [(1, 6), (1, 7)])                           # 6 opens nothing; 7: row 6
    assert torch.equal(ring[2, 0], kv[3]) and torch.equal(ring[2, 1], sc[3])
    other = c.new_ring(3)                                          # another layer, the index built once
    rows.restore(other, [(1, 6), (1, 7)], rows.pairs([(1, 6), (1, 7)]))
    assert torch.equal(other, ring) and rows.pairs([(1, 6), (0, 4)]) is None

@pytest.mark.parametrize('f, exc, msg', [
    (lambda r: RingRows(r, 3), ValueError, 'rings of ratio 2'),
    (lambda r: RingRows(r, 2, 1), ValueError, 'depth = 1'),
    (lambda r: RingRows(r, 2, True), ValueError, 'depth = True'),
    (lambda r: RingRows(r.double(), 2), ValueError, r'expected a \(blocks \* 2, 2, head_dim\) float32'),
    (lambda r: RingRows(r[:3], 2), ValueError, 'expected a'),
    (lambda r: RingRows(r, 2).restore(r, [(2, 3)]), IndexError, 'block 2, position 3'),
    (lambda r: RingRows(r, 2).restore(r, [(0, -1)]), IndexError, 'block 0, position -1'),
    (lambda r: RingRows(r, 2).restore(r[:2], [(0, 3)]), ValueError, r'restore: ring: expected \(4, 2, 64\)'),
])
def test_ring_rows_bad_input(f, exc, msg):
    ring = Compressor(TINY, 2).new_ring(2)
    with pytest.raises(exc, match=msg): f(ring)


@pytest.mark.skipif(not HAS_TRITON, reason='needs a GPU or TRITON_INTERPRET=1')
@pytest.mark.parametrize('how', ['reversed', 'shuffled'])
def test_step_kernel_chunks_that_straddle_groups(how):
    "Chunks that start inside a group and end inside another (the hazard one launch must survive), in any program order"
    steps = [[(0, 0, 5), (1, 0, 3)], [(0, 5, 4), (None, 0, 2), (1, 3, 1)], [(0, 9, 1), (1, 4, 6)],
             [(0, 10, 3), (1, 10, 1)]]
    for layer in (2, 6):
        h, (ca, ra, la), (cb, rb, lb) = run_both(([13, 11], steps), layer, 'ds_fp4', 3, in_order(how))
        assert same_bits(ca, cb) and all(same_bits(a, b) for a, b in zip(la, lb))
        if h.c.ratio > 1:
            for q, n in enumerate([13, 11]):
                e = torch.arange(n - n % 2, n) % 2 + h.rings[q] * 2
                assert same_bits(ra[e], rb[e])

class _Counting:
    "A stand-in for a Triton kernel that counts its launches"
    def __init__(self, kernel): self.kernel, self.launches = kernel, 0
    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

@pytest.mark.skipif(not HAS_TRITON, reason='needs a GPU or TRITON_INTERPRET=1')
@pytest.mark.parametrize('layer', [2, 6])
def test_emit_is_one_launch_and_reads_nothing(layer, monkeypatch):
    """A decode step of eight requests: version 2 launches one kernel (version 1 two at ratio 2),
    neither reads the device"""
    h = Harness(compressor(layer, 'ds_fp4', 0), [2] * 8, 0)
    cache, ring = h.caches()
    args = h.step([(q, q % 2, 1) for q in range(8)])             # half open a pair, half close one
    for version, want in ((2, 1), (1, 2 if h.c.ratio > 1 else 1)):
        step, two = _Counting(comp_kernel._compress_step_kernel), _Counting(comp_kernel._compress_kernel)
        monkeypatch.setattr(comp_kernel, '_compress_step_kernel', step)
        monkeypatch.setattr(comp_kernel, '_compress_kernel', two)
        with use_kernels('triton'), compress_version(version), HostReads() as reads:
            h.c.emit(*args, ring, cache, check_slots=False)
        assert (step.launches + two.launches == want
                and reads.count == 0), (version, step.launches, two.launches, reads.sites)
        monkeypatch.undo()

def test_step_bad_inputs():
    c = Compressor(TINY, 2)
    kv, sc, pos = torch.randn(4, 64), torch.randn(4, 64), torch.arange(4)
    rs, cs, ring, cache = torch.tensor([2, 3, 2, 3]), torch.tensor([-1, 0, -1, 1]), c.new_ring(2), c.new_cache(2, 16)
    for fn, msg in [
        (lambda: compress_step(c, kv, sc, pos, rs, cs, ring, cache, torch.arange(5)),
         'order: expected a (4,) int32/int64'),
        (lambda: compress_step(c, kv, sc, pos, rs, cs, ring, cache, torch.tensor([1, 1, 2, 3])),
         'a permutation of 0..3'),
        (lambda: compress_step(c, kv, sc, pos, rs, cs, ring, cache, torch.arange(4.0)), 'int32/int64'),
    ]: fct.test_fail(fn, contains=msg)
    with pytest.raises(ValueError, match=r'compressor kernel version 0; expected one of \[1, 2\]'):
        with compress_version(0): pass
    assert comp_kernel.COMPRESS_KERNEL['version'] == 2
