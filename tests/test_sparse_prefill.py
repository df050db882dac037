"""Sparse attention over a prompt's runs of tokens (`sparse_prefill`) against the reference attention of `05_csa2`:
every record format pair, ratios 1 and 2, runs that start at 0 and later, chunk sizes that divide the runs and that
do not, batches of chunks, holes, empty lists and records listed twice, with and without a sink; the chunking and the
plan on their own; `served_attend`'s split of a mixed step, its guard and its choice by backend; the served layers'
default core; bad inputs by name; the `bench` layer's width, where short prompts share nearly everything. On a GPU the
same checks run on cuBLAS."""
from dataclasses import replace
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore import test as fct
import dsv41_nb.sparse_prefill as sp
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels, kernel_backend, mm_f32
from dsv41_nb.csa2 import sparse_attention_reference
from dsv41_nb.sparse_decode import sparse_decode, decode_tolerance
from dsv41_nb.sparse_prefill import (step_chunks, chunk_records, plan_prefill, sparse_prefill,
                                     prefill_inputs, check_prefill, run_lengths, take_tokens,
                                     served_attend, _record_keys)
from machine import DEV, needs_triton

TINY, FULL = ModelConfig.tiny(), ModelConfig.full()
SMALL = replace(FULL, window_size=24, index_topk=40)   # the formats' full width, few records a token
PAIRS = [('window_fp8', 'ds_fp4'), ('fp8_ds_mla', 'fp8_ds_mla'), ('window_fp8', 'fp8_ds_mla')]


@given(st.lists(st.integers(0, 9), min_size=1, max_size=30), st.integers(1, 7))
@settings(max_examples=examples(60), deadline=None)
def test_step_chunks_cut_runs(rows, chunk):
    rows = torch.tensor(rows)
    c, place, n = step_chunks(rows, chunk)
    # plainly: walk the tokens
    want_c, want_p, cur, k = [], [], -1, 0
    for t, r in enumerate(rows.tolist()):
        if t == 0 or r != rows[t - 1] or k == chunk: cur, k = cur + 1, 0
        want_c.append(cur); want_p.append(k); k += 1
    assert c.tolist() == want_c and place.tolist() == want_p and n == cur + 1


def test_run_lengths():
    assert run_lengths(torch.tensor([3, 3, 3, 1, 2, 2, 3])).tolist() == [3, 3, 3, 1, 2, 2, 1]
    assert run_lengths(torch.zeros(0, dtype=torch.long)).tolist() == []


@pytest.mark.parametrize('ratio', [1, 2])
def test_chunk_records_are_each_chunks_distinct_records(ratio):
    q, window, compressed, idx, sink, scale = prefill_inputs(TINY, [(0, 40), (30, 6), (5, 1)],
                                                             ratio=ratio, device=DEV)
    chunk_of, _, n = step_chunks(idx.rows, 16)
    records, rchunk, inverse = chunk_records(window, compressed, idx, chunk_of)
    keys, live, _ = _record_keys(window, compressed, idx)
    assert (rchunk[inverse[live]] == chunk_of[:, None].expand_as(live)[live]).all()
    assert (records[inverse[live]] == keys[live]).all() and ((inverse >= 0) == live).all()
    for c in range(n):   # each chunk's records: exactly the set its tokens read, once each
        got = records[rchunk == c]
        assert got.tolist() == sorted(set(keys[chunk_of == c][live[chunk_of == c]].tolist()))


@pytest.mark.parametrize('ratio', [1, 2])
@pytest.mark.parametrize('formats', PAIRS, ids=lambda p: '+'.join(p))
@pytest.mark.parametrize('layout', [[(0, 70)], [(0, 40), (10, 7), (100, 1)], [(5, 3), (0, 130), (60, 20)]],
                         ids=['one', 'three', 'late'])
def test_prefill_matches_reference(layout, formats, ratio):
    args = prefill_inputs(TINY, layout, *formats, ratio=ratio, device=DEV, seed=ratio)
    for chunk, elements in ((64, 1 << 26), (16, 1 << 26), (7, 5000)):
        assert check_prefill(args, chunk=chunk, max_elements=elements) <= 1


def test_prefill_at_full_width():
    args = prefill_inputs(SMALL, [(0, 50), (20, 9)], heads=16, device=DEV)
    assert check_prefill(args, chunk=32) <= 1


@given(st.integers(0, 2 ** 31 - 1), st.booleans())
@settings(max_examples=examples(25), deadline=None)
def test_prefill_holes_empty_lists_and_repeats(seed, with_sink):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, window, compressed, idx, sink, scale = prefill_inputs(TINY, [(0, 30), (12, 9)], device=DEV, seed=seed)
    T, (W, K) = len(q), (idx.window_slots.shape[1], idx.topk.shape[1])
    hole = lambda x: torch.where(torch.rand(x.shape, generator=g, device=DEV) < 0.2, -1, x).int()
    w, k = hole(idx.window_slots), hole(idx.topk)
    wl = torch.minimum(torch.randint(0, W + 1, (T,), generator=g, device=DEV).int(), idx.window_lens)
    kl = torch.minimum(torch.randint(0, K + 1, (T,), generator=g, device=DEV).int(), idx.topk_lens)
    wl[-1] = kl[-1] = 0                                    # a token that reads nothing
    w[20, :2] = idx.window_slots[20, 0]; wl[20] = max(2, int(wl[20]))   # a record listed twice
    idx = replace(idx, window_slots=w, window_lens=wl, topk=k, topk_lens=kl)
    assert check_prefill((q, window, compressed, idx, sink if with_sink else None, scale), chunk=8) <= 1


def test_a_misplaced_plan_fails_the_oracle():
    args = prefill_inputs(TINY, [(0, 40), (10, 7)], device=DEV)
    plan = plan_prefill(*args[1:4], 16)
    wrong = replace(plan, chunk_of=(plan.chunk_of + 1) % plan.n)
    with pytest.raises(AssertionError, match='past the bound'): check_prefill(args, chunk=16, plan=wrong)


def test_repeats_count_twice():
    "Without the multiplicities a record listed twice would count once: the reference counts it twice"
    q, window, compressed, idx, sink, scale = prefill_inputs(TINY, [(0, 20)], device=DEV)
    w, wl = idx.window_slots.clone(), idx.window_lens.clone()
    w[19, :8] = idx.window_slots[19, 0]; wl[19] = 8        # one record, eight times
    idx = replace(idx, window_slots=w, window_lens=wl)
    ref, _ = sparse_attention_reference(q, window, compressed, idx, sink, scale)
    out, _ = sparse_prefill(q, window, compressed, idx, sink, scale)
    once = replace(idx, window_lens=torch.where(torch.arange(20, device=DEV) == 19, 1, wl))
    ref1, _ = sparse_attention_reference(q, window, compressed, once, sink, scale)
    tol, _ = decode_tolerance(window, compressed, idx, ref)
    assert ((out.float() - ref.float()).abs() <= tol).all()
    assert ((ref1.float() - ref.float()).abs()[19] > tol[19]).any()   # the test can tell


def test_empty_step():
    q, window, compressed, idx, sink, scale = prefill_inputs(TINY, [(0, 5)], device=DEV)
    none = take_tokens(idx, torch.zeros(5, dtype=torch.bool, device=DEV))
    out, lse = sparse_prefill(q[:0], window, compressed, none, sink, scale)
    assert out.shape == (0, *q.shape[1:]) and lse.shape == (0, q.shape[1])


def test_batched_mm_f32_sums_exact_products():
    "the union's two products: scores against the records, probabilities against them transposed"
    a, b = torch.randn(3, 5, 7, device=DEV).bfloat16(), torch.randn(3, 4, 7, device=DEV).bfloat16()
    want = a.double().bmm(b.double().transpose(1, 2)).float()
    torch.testing.assert_close(mm_f32(a, b), want, rtol=1e-6, atol=1e-6)
    p = torch.randn(3, 5, 4, device=DEV).bfloat16()
    torch.testing.assert_close(mm_f32(p, b.transpose(1, 2)), p.double().bmm(b.double()).float(),
                               rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize('layout', [[(50, 1), (0, 30), (80, 1), (20, 12), (9, 1)], [(0, 24)], [(3, 1), (7, 1)]],
                         ids=['mixed', 'runs only', 'singles only'])
def test_served_attend_splits_a_step(layout, monkeypatch):
    monkeypatch.setattr(sp, 'PREFILL_MAX_WORK', 10 ** 6)          # the guard off: every run goes to the union
    args = prefill_inputs(TINY, layout, device=DEV, seed=3)
    ref, _ = sparse_attention_reference(*args)
    calls = []
    monkeypatch.setattr(sp, 'sparse_prefill', lambda q, *a, **k: calls.append(len(q)) or sparse_prefill(q, *a, **k))
    out, lse = served_attend(*args, union=True)
    tol, _ = decode_tolerance(*args[1:4], ref)
    assert ((out.float() - ref.float()).abs() <= tol).all()
    runs = int((run_lengths(args[3].rows) >= sp.PREFILL_MIN_RUN).sum())
    assert calls == ([runs] if runs else [])


@needs_triton
def test_served_attend_guard_sends_sparse_sharing_to_the_kernel(monkeypatch):
    args = prefill_inputs(TINY, [(0, 400)], device=DEV)
    plan = plan_prefill(*args[1:4], sp.PREFILL_CHUNK)
    assert plan.work > sp.PREFILL_MAX_WORK * plan.reads           # random top-k lists share little
    monkeypatch.setattr(sp, 'sparse_prefill', lambda *a, **k: pytest.fail('the guard let it through'))
    out, _ = served_attend(*args, union=True)
    assert torch.equal(out, sparse_decode(*args)[0])


def test_served_attend_choice(monkeypatch):
    "As served (PREFILL_UNION off) every step is sparse_decode's; on, the union where the Triton kernel would run"
    args = prefill_inputs(TINY, [(0, 24)], device=DEV)
    assert not sp.PREFILL_UNION
    assert torch.equal(served_attend(*args)[0], sparse_decode(*args)[0])
    monkeypatch.setattr(sp, 'PREFILL_UNION', True)
    monkeypatch.setattr(sp, 'PREFILL_MAX_WORK', 10 ** 6)
    with use_kernels('torch'):
        out, lse = served_attend(*args)
        ref, ref_lse = sparse_attention_reference(*args)
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    q, window, compressed, idx, sink, scale = args
    if kernel_backend(q) == 'triton':
        assert torch.equal(served_attend(*args)[0], served_attend(*args, union=True)[0])
        # out_rope (the fused decode path) always goes to the kernel
        rope = (torch.ones(q.shape[-1] // 2, device=DEV), torch.arange(len(q), device=DEV))
        assert torch.equal(served_attend(*args, out_rope=rope)[0], sparse_decode(*args, out_rope=rope)[0])


def test_served_layers_default_to_served_attend():
    from dsv41_nb.paged import PagedModel
    from dsv41_nb.model import init_random
    m = PagedModel.from_model(init_random(TINY))
    assert all(l.attn.attend is served_attend for l in m.layers)


BAD = [
    (lambda a: step_chunks(a[3].rows, 0), 'chunk'),
    (lambda a: step_chunks(a[3].rows.float(), 4), 'rows must be a 1-D integer'),
    (lambda a: run_lengths(a[3].rows[None]), 'rows must be a 1-D integer'),
    (lambda a: sparse_prefill(*a, chunk=0), 'chunk'),
    (lambda a: sparse_prefill(*a, max_elements=0), 'max_elements'),
    (lambda a: sparse_prefill(a[0][:3], *a[1:]), 'window_slots'),
    (lambda a: sparse_prefill(*a[:4], a[4][:2], a[5]), 'sink'),
    (lambda a: sparse_prefill(*a, plan='plan'), 'plan must be a PrefillPlan'),
    (lambda a: sparse_prefill(*a, chunk=8, plan=plan_prefill(*a[1:4], 16)), 'in chunks of 8'),
    (lambda a: served_attend(*a, union=1), 'union'),
    (lambda a: prefill_inputs(TINY, []), 'at least one request'),
    (lambda a: prefill_inputs('tiny', [(0, 4)]), 'ModelConfig'),
    (lambda a: prefill_inputs(TINY, [(0, 4)], ratio=0), 'ratio'),
    (lambda a: prefill_inputs(TINY, [(0, 4)], heads=0), 'heads'),
    (lambda a: take_tokens(a[3], [0, 1]), 'sel must be a 1-D tensor'),
    (lambda a: take_tokens(a[3], torch.zeros(2, 2, dtype=torch.bool)), 'sel must be a 1-D tensor'),
]


@pytest.mark.parametrize('call,msg', BAD, ids=[m for _, m in BAD])
def test_bad_inputs(call, msg):
    args = prefill_inputs(TINY, [(0, 20)], device=DEV)
    fct.test_fail(lambda: call(args), contains=msg)


def test_few_reads_of_device_values():
    "A prefill step runs eagerly, but each read of device values waits for the GPU: the plan makes two, the rest none"
    from dsv41_nb.launches import HostReads, trusted_values
    args = prefill_inputs(TINY, [(0, 30), (4, 1), (0, 20)], device=DEV)
    with trusted_values(), HostReads() as h: plan = plan_prefill(*args[1:4], 16)
    assert h.count == 2, dict(h.sites)
    with trusted_values(), HostReads() as h: sparse_prefill(*args, 16, check_indices=False, plan=plan)
    assert h.count == 0, dict(h.sites)


def test_prefill_at_the_bench_layer():
    "The bench layer's width and heads (64 x 512), its window of 128 and top-k of 512: prompts sharing everything"
    args = prefill_inputs(ModelConfig.bench(), [(0, 128), (0, 128)], device=DEV, seed=7)
    plan = plan_prefill(*args[1:4], 64)
    assert plan.work <= 2.1 * plan.reads          # a short prompt's chunks share nearly every record
    assert check_prefill(args, chunk=64, plan=plan) <= 1
