"""Property tests of the lightning indexer: the Triton kernels (paged index logits, ragged top-k, block top-k, sparse
logits) against the PyTorch references on random ragged batches, tie-breaking, the candidate pool's invariants,
select-all, and chunked prefill against one-shot.

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either they are skipped."""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings, strategies as st
from budget import examples
from fastcore import test as fct
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels, triton_interpreting
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.records import store_records
from dsv41_nb import indexer_kernels, indexer_speed
from dsv41_nb.indexer import (Indexer, IndexBatch, qdq_mxfp4, qdq_mxfp4_fused, index_logits_reference,
                              topk_reference, candidate_pool_reference, pool_mask, sparse_topk_reference)
from dsv41_nb.indexer_kernels import (index_logits, ragged_topk, candidate_pool, sparse_topk,
                                      logits_error_bound)
from machine import DEV, needs_triton

TINY = ModelConfig.tiny()

def world(ix, contexts, queries, seed, block_size=16):
    """Keys for requests of `contexts` entries in random pages of a cache of random bytes; `queries` = [(row, position)]
    (row -1 = padding). Returns (q, w, cache, batch)."""
    g = torch.Generator().manual_seed(seed)
    per = block_size // ix.ratio
    pages = [triton.cdiv(n, per) + 1 for n in contexts]
    ids = (torch.randperm(sum(pages) + 2, generator=g) + 1).tolist()
    table = torch.zeros(len(contexts), max(pages), dtype=torch.int32)
    cache = torch.randint(0, 256, (sum(pages) + 3, per, ix.codec.record_bytes), dtype=torch.uint8, generator=g)
    for r, n in enumerate(contexts):
        table[r, :pages[r]] = torch.tensor(ids[sum(pages[:r]):sum(pages[:r + 1])], dtype=torch.int32)
        e = torch.arange(n)
        store_records(ix.codec, (torch.randn(n, ix.head_dim, generator=g) * 3).bfloat16(), cache,
                      table[r, e // per].long() * per + e % per)
    q = qdq_mxfp4(torch.randn(len(queries), ix.n_heads, ix.head_dim, generator=g).bfloat16())
    w = torch.randn(len(queries), ix.n_heads, generator=g) * 0.3
    rows = torch.tensor([r for r, _ in queries], dtype=torch.int32)
    pos = torch.tensor([p for _, p in queries])
    return q.to(DEV), w.to(DEV), cache.to(DEV), IndexBatch(pos.to(DEV), rows.to(DEV), table.to(DEV),
                                                           block_size, ix.ratio)

@st.composite
def batches(draw, max_context=3000, max_requests=3, max_queries=5):
    "Contexts of 1 .. several thousand entries and queries at positions inside them, padding and empty rows included"
    contexts = draw(st.lists(st.integers(1, max_context), min_size=1, max_size=max_requests))
    queries = []
    for _ in range(draw(st.integers(1, max_queries))):
        r = draw(st.integers(-1, len(contexts) - 1))
        queries.append((r, draw(st.integers(0, contexts[r] - 1)) if r >= 0 else draw(st.integers(0, 10))))
    return contexts, queries

@needs_triton
@given(batches(),
       st.sampled_from([(6, 'index_mxfp4'), (6, 'index_fp8'), (2, 'index_mxfp4'), (2, 'index_fp8')]),
       st.integers(0, 2**31), st.sampled_from([2, 1, 3]))
@example(b=([3000, 1, 40], [(0, 2999), (1, 0), (-1, 3), (2, 17)]), layer_fmt=(6, 'index_mxfp4'), seed=1,
         version=2)
@example(b=([300, 1, 40], [(0, 299), (1, 0), (-1, 3), (2, 17)]), layer_fmt=(6, 'index_mxfp4'), seed=1, version=1)
@example(b=([2500, 7], [(0, 2499), (1, 0), (1, 1)]), layer_fmt=(2, 'index_fp8'), seed=2, version=2)
@example(b=([3000, 1, 40], [(0, 2999), (1, 0), (-1, 3), (2, 17)]), layer_fmt=(6, 'index_mxfp4'), seed=3,
         version=3)
@example(b=([700, 33], [(0, 699), (1, 32)]), layer_fmt=(2, 'index_mxfp4'), seed=4, version=3)
@example(b=([2500, 7], [(0, 2499), (1, 0), (1, 1)]), layer_fmt=(6, 'index_fp8'), seed=5, version=3)
@settings(max_examples=examples(4))       # the examples above cover each version and format
def test_logits_kernel_equals_reference(b, layer_fmt, seed, version):
    "Every version of the MXFP4 decoding (`key_decoding`) and the FP8 keys against the reference"
    contexts, queries = b
    ix = Indexer(TINY, *layer_fmt)
    q, w, cache, batch = world(ix, contexts, queries, seed)                  # at ratio 2 a query sees half its context
    ref = index_logits_reference(q, w, cache, batch, ix.codec)
    with indexer_kernels.key_decoding(version), use_kernels('triton'):
        got = index_logits(q, w, cache, batch, ix.codec)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert ((got - ref)[fin].abs() <= logits_error_bound(q, w, cache, batch, ix.codec)[fin]).all()

@triton.jit
def _key_slots_probe(cache_ptr, out_ptr, REC: tl.constexpr, DH: tl.constexpr, N: tl.constexpr,
                     GPU: tl.constexpr):
    rows = tl.arange(0, N)
    k = indexer_kernels._fp4_key_slots(cache_ptr + rows[:, None] * REC, rows >= 0, DH, GPU)
    tl.store(out_ptr + rows[:, None] * DH + tl.arange(0, DH)[None, :], k.to(tl.float32))

@needs_triton
@pytest.mark.parametrize('cfg', [TINY, ModelConfig.bench()], ids=['tiny', 'bench'])
def test_version_3_decodes_every_scale_in_slot_order(cfg):
    "Version 3's key tile is the reference's decoding in `slot_dims` order, bit for bit, at all 256 scale codes"
    codec = cache_format(cfg, 'index_mxfp4')
    dh, nb = cfg.index_head_dim, cfg.index_head_dim // 32
    n = 256 // nb
    g = torch.Generator().manual_seed(0)
    rec = torch.randint(0, 256, (n, codec.record_bytes), generator=g, dtype=torch.uint8)
    rec[:, dh // 2:] = torch.arange(256, dtype=torch.uint8).view(n, nb)   # every UE8M0 code, 255 (NaN) too
    out = torch.empty(n, dh, device=DEV)
    _key_slots_probe[(1,)](rec.to(DEV), out, REC=codec.record_bytes, DH=dh, N=n,
                           GPU=not triton_interpreting())
    want = codec.unpack(rec)[:, indexer_kernels.slot_dims(dh)]
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0, equal_nan=True)

@st.composite
def score_rows(draw):
    "Scores with ties, signed zeros, wide magnitudes; ragged lengths including 0 and exactly k"
    T, L, k = draw(st.integers(1, 6)), draw(st.integers(1, 3000)), draw(st.sampled_from([1, 5, 32, 512]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(['gauss', 'few', 'zeros', 'wide']))
    x = {'gauss': lambda: torch.randn(T, L, generator=g),
         'few': lambda: torch.randint(-2, 3, (T, L), generator=g).float(),
         'zeros': lambda: (torch.where(torch.rand(T, L, generator=g) < 0.5, 0.0, -0.0)
                           + torch.randint(0, 2, (T, L), generator=g)),
         'wide': lambda: (torch.randn(T, L, generator=g)
                          * torch.exp2(torch.randint(-100, 100, (T, L), generator=g).float()))}[kind]()
    lengths = torch.tensor([draw(st.sampled_from([0, min(k, L), L, draw(st.integers(0, L))])) for _ in range(T)])
    return x, lengths, k

@needs_triton
@given(score_rows())
@settings(max_examples=examples(25))
def test_topk_kernel_equals_reference(rows):
    x, lengths, k = rows
    with use_kernels('triton'): got = ragged_topk(x.to(DEV), lengths.to(DEV), k)
    assert torch.equal(got.cpu(), topk_reference(x, lengths, k))

@needs_triton
def test_topk_ties_are_deterministic():
    x = torch.zeros(3, 2000); x[:, 1000:] = 1.0                               # 1,000 equal maxima
    with use_kernels('triton'):
        runs = [ragged_topk(x.to(DEV), torch.tensor([2000, 1500, 900], device=DEV), 512).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert runs[0][0].tolist() == list(range(1000, 1512)) and runs[0][2].tolist() == list(range(512))

@needs_triton
@given(batches(max_context=2000), st.sampled_from([(16, 4), (64, 8), (3, 2)]), st.integers(0, 2**31))
@settings(max_examples=examples(10))
def test_candidate_pool(b, geometry, seed):
    contexts, queries = b
    nblk, cbs = geometry
    ix = Indexer(TINY, 6)
    q, w, cache, batch = world(ix, contexts, queries, seed)
    logits, vis = index_logits_reference(q, w, cache, batch, ix.codec), batch.visible
    with use_kernels('triton'): got = candidate_pool(logits, vis, nblk, cbs)
    assert torch.equal(got.cpu(), candidate_pool_reference(logits, vis, nblk, cbs).cpu())
    for s in range(len(vis)):
        n = int(vis[s])
        blocks = [b for b in got[s].tolist() if b >= 0]
        assert len(blocks) == min(nblk, triton.cdiv(n, cbs)) and blocks == sorted(blocks)
        # the query's newest block is always in the pool
        if n: assert (n - 1) // cbs in blocks

@needs_triton
@given(batches(max_context=2000), st.integers(0, 2**31))
@settings(max_examples=examples(8))
def test_sparse_logits_select_like_masked_dense(b, seed):
    contexts, queries = b
    src, re = Indexer(TINY, 6), Indexer(TINY, 8)
    q, w, cache, batch = world(src, contexts, queries, seed)
    vis = batch.visible
    pool = candidate_pool_reference(index_logits_reference(q, w, cache, batch, src.codec), vis, 16, 4)
    q2, w2 = qdq_mxfp4(torch.randn_like(q.float()).bfloat16()), torch.randn_like(w)
    want = sparse_topk_reference(index_logits_reference(q2, w2, cache, batch, re.codec), vis, pool, re.topk, 4)
    with use_kernels('triton'): got = sparse_topk(q2, w2, cache, batch, re.codec, pool, re.topk, 4)
    assert torch.equal(got.cpu(), want.cpu())
    assert pool_mask(pool, max(int(vis.max()), 1), 4).gather(1, got.clamp_min(0).long())[got >= 0].all()

@needs_triton
@given(batches(max_context=2000), st.sampled_from([(16, 4, 8), (64, 8, 40), (3, 2, 16)]), st.integers(0, 2**31))
@settings(max_examples=examples(10))
def test_pool_topk_kernel_equals_torch_path(b, geometry, seed):
    """ragged_topk over a sparse row with its pool: the kernel's prefix and entries against the
    PyTorch path (pool_entries, gather)"""
    contexts, queries = b
    nblk, cbs, k = geometry
    q, w, cache, batch = world(Indexer(TINY, 6), contexts, queries, seed)
    vis, g = batch.visible, torch.Generator().manual_seed(seed)
    pool = candidate_pool_reference(index_logits_reference(q, w, cache, batch, Indexer(TINY, 6).codec), vis, nblk, cbs)
    x = torch.randn(len(vis), nblk * cbs, generator=g).to(DEV)
    with use_kernels('torch'): want = ragged_topk(x, vis, k, pool=pool, block_size=cbs)
    with use_kernels('triton'): got = ragged_topk(x, vis, k, pool=pool, block_size=cbs)
    assert torch.equal(got.cpu(), want.cpu())

def test_select_all_scores_nothing():
    "Queries that see at most top-k entries select all of them: the scores are never read (here the keys are NaN)"
    ix = Indexer(TINY, 6)
    cache = torch.full((4, 16, ix.codec.record_bytes), 0xFF, dtype=torch.uint8, device=DEV)  # NaN scales
    batch = IndexBatch(torch.tensor([0, 5, 31], device=DEV), torch.zeros(3, dtype=torch.int32, device=DEV),
                       torch.tensor([[1, 2, 3]], dtype=torch.int32, device=DEV), 16, 1)
    q, w = (torch.zeros(3, ix.n_heads, ix.head_dim, dtype=torch.bfloat16, device=DEV),
            torch.zeros(3, ix.n_heads, device=DEV))
    sel, pool = ix.select(q, w, batch, cache)
    assert (sel[:, :6].tolist() == [[0, -1, -1, -1, -1, -1], list(range(6)), list(range(6))]
            and (sel[2] == torch.arange(32, device=DEV)).all())
    assert pool[2, :9].tolist() == list(range(8)) + [-1]

@needs_triton
def test_benchmark_checks_the_kernel_before_timing_it(monkeypatch):
    "benchmark_index_logits times only a kernel whose logits match the reference; a wrong one is named, not timed"
    row = indexer_speed.benchmark_index_logits(TINY, 64, batch=2, device=DEV, bandwidth=1e10, rep=1, version=3)
    assert row['checked'] and row['version'] == 3
    real = indexer_kernels.index_logits
    monkeypatch.setattr(indexer_speed, 'index_logits', lambda *a, **k: real(*a, **k) * 1.001)
    with pytest.raises(RuntimeError, match='version 3 at 64 entries: .* logits beyond'):
        indexer_speed.benchmark_index_logits(TINY, 64, batch=2, device=DEV, bandwidth=1e10, rep=1, version=3)


def test_bad_inputs():
    ix = Indexer(TINY, 6)
    q, w, cache, batch = world(ix, [5], [(0, 3)], 0)
    for fn, msg in [
        (lambda: Indexer(TINY, 3), 'not an index source'),
        (lambda: Indexer(TINY, 6, 'index_fp4'), "expected 'index_mxfp4' or 'index_fp8'"),
        (lambda: index_logits(q, w[:, :2], cache, batch, ix.codec), 'w (T, heads)'),
        (lambda: index_logits(q[:0], w[:0], cache, batch, ix.codec), 'batch has 1 queries, q has 0'),
        (lambda: ragged_topk(torch.randn(2, 4, dtype=torch.float64), torch.tensor([1, 2]), 2), 'float32'),
        (lambda: ragged_topk(torch.randn(2, 4), torch.tensor([1.0, 2.0]), 2), 'integer lengths'),
        (lambda: ragged_topk(torch.randn(2, 4), torch.tensor([1, 2]), 2,
                             pool=torch.zeros(2, 2, dtype=torch.int64), block_size=2), 'int32'),
        (lambda: ragged_topk(torch.randn(2, 4), torch.tensor([1, 2]), 2,
                             pool=torch.zeros(3, 2, dtype=torch.int32), block_size=2), '(2, blocks)'),
        (lambda: ragged_topk(torch.randn(2, 4), torch.tensor([1, 2]), 2, pool=torch.zeros(2, 2, dtype=torch.int32)),
         'block_size = 0'),
        (lambda: IndexBatch(torch.arange(2), torch.zeros(2, dtype=torch.int32),
                            torch.zeros(1, 2, dtype=torch.int64), 16, 1), 'block_table'),
        (lambda: ix.new_key_cache(2, -16), 'positive multiple'),
        (lambda: indexer_speed.benchmark_index_logits(TINY, 64, version=4), 'version = 4; expected 1, 2 or 3'),
        (lambda: indexer_speed.benchmark_index_logits(TINY, 64, version=0), 'version = 0; expected 1, 2 or 3'),
        (lambda: indexer_kernels.key_decoding(0).__enter__(), 'version = 0; expected 1, 2 or 3'),
        (lambda: indexer_kernels.slot_dims(48), 'dh = 48; expected a multiple of 32'),
        (lambda: indexer_kernels.slot_dims(16), 'dh = 16; expected at least 32'),
    ]: fct.test_fail(fn, contains=msg)

@pytest.mark.slow
@needs_triton
@given(st.integers(40, 160), st.lists(st.integers(1, 40), min_size=1, max_size=6),
       st.sampled_from([2, 6]), st.integers(0, 2**31))
@settings(max_examples=examples(5))
def test_chunked_prefill_selects_like_one_shot(n, chunks, layer, seed):
    "Keys stored and queries scored chunk by chunk (then one token at a time) select what one prefill selects"
    torch.manual_seed(seed)
    ix = Indexer(TINY, layer).to(DEV)
    g = torch.Generator().manual_seed(seed)
    # one key per token, written when it completes
    keys = (torch.randn(n, ix.head_dim, generator=g) * 2).bfloat16().to(DEV)
    q = qdq_mxfp4(torch.randn(n, ix.n_heads, ix.head_dim, generator=g).bfloat16()).to(DEV)
    w = (torch.randn(n, ix.n_heads, generator=g) * 0.3).to(DEV)
    table = torch.arange(1, triton.cdiv(n, 16) + 1, dtype=torch.int32, device=DEV)[None]
    def run(steps):
        cache = ix.new_key_cache(table.shape[1] + 1, 16, DEV)
        out = []
        for s, k in steps:
            pos = torch.arange(s, s + k, device=DEV)
            slots = torch.where((pos + 1) % ix.ratio == 0, pos // ix.ratio + 16 // ix.ratio, -1)   # page p + 1 of table
            store_records(ix.codec, keys[s:s + k], cache, slots)
            batch = IndexBatch(pos, torch.zeros(k, dtype=torch.int32, device=DEV), table, 16, ix.ratio)
            with use_kernels('triton'): out.append(ix.select(q[s:s + k], w[s:s + k], batch, cache)[0])
        return torch.cat(out)
    steps, s = [], 0
    # random chunks, the rest, 8 decode steps
    for k in chunks + [max(n - 8 - s, 1)] + [1] * 8:
        if s >= n: break
        steps.append((s, min(k, n - s))); s += steps[-1][1]
    assert torch.equal(run(steps), run([(0, n)]))


@settings(max_examples=examples(10), deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 5), log_scale=st.integers(-130, 120), poison=st.booleans(),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**31))
@example(rows=1, groups=1, log_scale=-124, poison=False, dtype=torch.bfloat16, seed=0)   # BF16 subnormals in and out
@example(rows=3, groups=2, log_scale=-127, poison=False, dtype=torch.bfloat16, seed=0)
def test_qdq_mxfp4_fused_matches_reference(rows, groups, log_scale, poison, dtype, seed):
    "The one-launch MXFP4 rounding gives the reference's bits (NaN where a NaN or an infinity poisons a group)"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * groups, generator=g) * 2.0 ** log_scale
    if poison: x[0, 3], x[-1, -1] = float('nan'), float('inf')
    x = x.to(DEV, dtype)
    got, want = qdq_mxfp4_fused(x), qdq_mxfp4(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_qdq_mxfp4_fused_bad_input():
    for bad in (torch.zeros(2, 30), torch.zeros(2, 32, dtype=torch.int32), 'x'):
        with pytest.raises(ValueError, match='expected floats'): qdq_mxfp4_fused(bad)
