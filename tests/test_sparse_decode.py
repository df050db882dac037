"""The sparse decode kernel against the reference attention of `05_csa2`: every record format in either cache, head counts
4 to 64, one split or many, ragged lists with -1 entries and empty ones, ratio-1 and ratio-2 indices, batches up to 256;
record decoding bit for bit against the codecs; the split heuristic's bounds.

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either they are skipped."""
from dataclasses import replace
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st
from fastcore import test as fct
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import kernel_backend, use_kernels
from dsv41_nb.formats import cache_format
from dsv41_nb.csa2 import CSA2Attention, CSA2State, make_step, random_block_tables, sparse_attention_reference
from dsv41_nb.sparse_decode import (sparse_decode, decode_inputs, check_decode, decode_launch, _format_meta, _half_view, _kv_tile)

DEV = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
HAS_TRITON = kernel_backend(torch.zeros(1, device=DEV)) == 'triton'
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason='no Triton: needs a GPU or TRITON_INTERPRET=1')
GPU = DEV.type == 'cuda'
TINY, FULL = ModelConfig.tiny(), ModelConfig.full()
SMALL = replace(FULL, window_size=24)                    # full width (the formats need 512), few records per token
FORMATS = ('window_fp8', 'fp8_ds_mla', 'ds_fp4')


@triton.jit
def _probe(ptr, half_ptr, slot_ptr, out_ptr, n, D: tl.constexpr, BN: tl.constexpr,
           P_FP4: tl.constexpr, P_QDIM: tl.constexpr, P_BLOCK: tl.constexpr,
           P_ROPE: tl.constexpr, P_SCALE_OFF: tl.constexpr, P_REC: tl.constexpr,
           P_E4M3: tl.constexpr, HW_CVT: tl.constexpr):
    r = tl.arange(0, BN)
    slot = tl.load(slot_ptr + r, mask=r < n, other=-1)
    v = _kv_tile(ptr, half_ptr, slot, slot >= 0, D, P_FP4, P_QDIM, P_BLOCK, P_ROPE, P_SCALE_OFF, P_REC, P_E4M3, HW_CVT)
    tl.store(out_ptr + r[:, None] * D + tl.arange(0, D)[None, :], v, mask=(r < n)[:, None])


@needs_triton
@pytest.mark.parametrize('cfg', [FULL, TINY], ids=['512', '64'])
@pytest.mark.parametrize('name', FORMATS + ('index_mxfp4',))
def test_record_tiles_decode_exactly(cfg, name):
    from dsv41_nb.dispatch import triton_interpreting
    codec = cache_format(cfg, name)
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(64, codec.dim, device=DEV, generator=g) * torch.rand(64, 1, device=DEV, generator=g) * 20
    x[0] = 0
    cache = codec.pack(x)
    slots = torch.randint(-1, 64, (32,), device=DEV, generator=g).int()
    got = torch.empty(32, codec.dim, dtype=torch.bfloat16, device=DEV)
    _probe[(1,)](cache, _half_view(cache), slots, got, 32, D=codec.dim, BN=32, **_format_meta(codec, codec.dim, 'P'),
                 HW_CVT=not triton_interpreting())
    want = torch.where((slots >= 0)[:, None], codec.unpack(cache[slots.clamp_min(0).long()]), 0)
    assert torch.equal(got.float(), want)


@needs_triton
@settings(max_examples=30 if GPU else 20, deadline=None)
@given(st.sampled_from(FORMATS[:2]), st.sampled_from(FORMATS), st.sampled_from([4, 8, 16, 32, 64]), st.integers(1, 4),
       st.booleans(), st.sampled_from([None, 1, 2, 3, 5]), st.sampled_from([1, 2]), st.booleans(), st.integers(0, 2**31))
def test_kernel_against_the_reference(wfmt, cfmt, heads, T, ragged, splits, ratio, with_sink, seed):
    args = list(decode_inputs(SMALL, T, 200 + seed % 50, 40, wfmt, cfmt, ratio=ratio, heads=heads, ragged=ragged,
                              device=DEV, seed=seed))
    if not with_sink: args[4] = None
    check_decode(tuple(args), num_splits=splits)


@needs_triton
def test_empty_lists_window_only_and_one_record():
    q, window, compressed, idx, sink, scale = decode_inputs(SMALL, 3, 100, 30, heads=8, device=DEV, seed=2)
    nothing = replace(idx, window_lens=torch.zeros_like(idx.window_lens), topk_lens=torch.zeros_like(idx.topk_lens))
    for splits in (1, 3):
        out, lse = sparse_decode(q, window, compressed, nothing, sink, scale, num_splits=splits)
        assert not out.float().abs().any() and ((lse - sink).abs() <= 2 ** -21 * sink.abs()).all()
        assert sparse_decode(q, window, compressed, nothing, None, scale, num_splits=splits)[1].isneginf().all()
    swa_only = replace(idx, topk=idx.topk[:, :0], topk_lens=torch.zeros_like(idx.topk_lens))
    check_decode((q, window, None, swa_only, sink, scale), num_splits=2)
    one = replace(idx, window_slots=torch.where(torch.arange(24, device=DEV) == 5, idx.window_slots, -1),
                  topk=torch.full_like(idx.topk, -1))
    worst, out, _ = check_decode((q, window, compressed, one, None, scale), num_splits=4)
    v = window.codec.unpack(window.records()[idx.window_slots[:, 5].long()])
    assert torch.equal(out.float(), v[:, None, :].expand_as(out).bfloat16().float())      # one record, no sink: itself


@needs_triton
@pytest.mark.parametrize('batch', [1, 16, 64, 256])
def test_batch_sizes(batch):
    if GPU: args = decode_inputs(FULL, batch, 1024, 512, ragged=True, device=DEV, seed=batch)        # 64 heads, 128 + 512 records
    else: args = decode_inputs(replace(FULL, window_size=8), batch, 16, 8, heads=4, ragged=True, swa_block_size=8, block_size=16,
                               device=DEV, seed=batch)
    check_decode(args, block_n=None if GPU else 16)


@needs_triton
def test_a_prefill_chunk_through_the_layer():
    torch.manual_seed(7)
    pair = [CSA2Attention(TINY, l).to(DEV) for l in (6, 7)]                       # the ratio-1 Full layer and a Reuse layer
    for m in pair: m.attn_sink.data.normal_()
    g = torch.Generator().manual_seed(8)
    swa_bt, bt = random_block_tables(2, 12, 64, g).to(DEV), random_block_tables(2, 3, 64, g).to(DEV)
    step = make_step(TINY, [(0, 19), (5, 9)], swa_bt, bt, 4, 16)
    x = torch.randn(2, 28, TINY.dim, generator=g).bfloat16().to(DEV)
    topk = torch.randint(-1, 14, (28, 32), generator=g).int().to(DEV)
    runs = []
    for core in (sparse_attention_reference, sparse_decode):
        state = CSA2State(TINY).allocate(pair, 64, 4, 16, DEV)
        for m in pair: m.attend = core
        with use_kernels('torch' if core is sparse_attention_reference else None):
            runs.append([m.attention(x[i], step, state, topk if m.role == 'Full' else None)[0] for i, m in enumerate(pair)])
    vmax = max(m.window_codec.unpack(state.window[m.layer]).abs().max() for m in pair)
    vmax = max(vmax, state.main_codec.unpack(state.compressed[6]).abs().max())
    for ro, ko in zip(*runs): assert ((ko.float() - ro.float()).abs() <= 2 ** -7 * vmax + 2 ** -6 * ro.float().abs()).all()


@given(st.integers(1, 512), st.sampled_from([4, 16, 64, 128]), st.integers(1, 40))
def test_split_heuristic_stays_in_bounds(T, H, tiles):
    launch = decode_launch(T, H, tiles, 'cpu')
    assert launch['SPLITS'] == 1 and launch['BLOCK_H'] in (16, 32, 64) and launch['BLOCK_H'] >= min(H, 16)
    if GPU:
        s = decode_launch(T, H, tiles, DEV)['SPLITS']
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        assert 1 <= s <= min(tiles, 16) and (s == 1 or T * triton.cdiv(H, 64) * s <= sms)


def test_bad_arguments():
    q, window, compressed, idx, sink, scale = decode_inputs(SMALL, 2, 100, 30, heads=4, device=DEV)
    cases = [(lambda: sparse_decode(q, window, compressed, idx, sink, scale, num_splits=0), 'num_splits = 0'),
             (lambda: sparse_decode(q, window, compressed, idx, sink, scale, block_n=-8), 'block_n = -8'),
             (lambda: sparse_decode(q, window, None, idx, sink, scale), 'compressed: expected PagedRecords'),
             (lambda: sparse_decode(q[:, :3], window, compressed, idx, sink, scale), 'sink: expected a (3,) tensor'),
             (lambda: _format_meta(cache_format(FULL, 'index_fp8'), 128, 'W'), 'FP8 records with block scales or FP4 records')]
    if HAS_TRITON: cases.append((lambda: sparse_decode(q.half(), window, compressed, idx, sink, scale), 'the kernel takes bf16 queries'))
    for f, msg in cases: fct.test_fail(f, contains=msg)
