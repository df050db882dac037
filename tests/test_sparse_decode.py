"""The sparse decode kernel against the reference attention of `05_csa2`: every record format in either cache, head
counts 4 to 64, one split or many, ragged lists with -1 entries and empty ones, ratio-1 and ratio-2 indices, batches up
to 256 (128 in the interpreter), every distinct kernel among the launch shapes the sweep times; record decoding bit for
bit against the codecs; the launch table and the split heuristic's bounds. On a GPU, also the compiled kernel on every
format pair at 16, 64 and 128 heads and 1 to 256 tokens.

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either they are skipped."""
from dataclasses import replace
import pytest
import torch
import triton
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore import test as fct
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels, triton_interpreting
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.rope_norm import rope
from dsv41_nb.csa2 import CSA2State, make_step, random_block_tables, sparse_attention_reference
from dsv41_nb.csa2_layer import CSA2Attention
from dsv41_nb.sparse_decode import (sparse_decode, decode_inputs, check_decode, check_decode_grid,
                                    decode_launch, decode_variants, distinct_kernels, launch_name,
                                    DECODE_TUNING, _check_launch, _format_meta, _half_view,
                                    _tile_probe)
from machine import DEV, HAS_TRITON, needs_triton

GPU = DEV.type == 'cuda'
TINY, FULL = ModelConfig.tiny(), ModelConfig.full()
SMALL = replace(FULL, window_size=24)                    # full width (the formats need 512), few records per token
FORMATS = ('window_fp8', 'fp8_ds_mla', 'ds_fp4')
KERNELS = distinct_kernels(decode_variants())


@needs_triton
@pytest.mark.parametrize('per_block', [True, False], ids=['block-scales', 'value-scales'])
@pytest.mark.parametrize('cfg', [FULL, TINY], ids=['512', '64'])
@pytest.mark.parametrize('name', FORMATS + ('index_mxfp4',))
def test_record_tiles_decode_exactly(cfg, name, per_block):
    codec = cache_format(cfg, name)
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(64, codec.dim, device=DEV, generator=g) * torch.rand(64, 1, device=DEV, generator=g) * 20
    x[0] = 0
    cache = codec.pack(x)
    slots = torch.randint(-1, 64, (32,), device=DEV, generator=g).int()
    got = torch.empty(32, codec.dim, dtype=torch.bfloat16, device=DEV)
    _tile_probe[(1,)](cache, _half_view(cache), slots, got, 32, D=codec.dim, BN=32,
                      **_format_meta(codec, codec.dim, 'P'),
                      HW_CVT=not triton_interpreting(), SCALE_TILE=per_block)
    want = torch.where((slots >= 0)[:, None], codec.unpack(cache[slots.clamp_min(0).long()]), 0)
    assert torch.equal(got.float(), want)


@needs_triton
@settings(max_examples=examples(30 if GPU else 10), deadline=None)
@given(st.sampled_from(FORMATS[:2]), st.sampled_from(FORMATS), st.sampled_from([4, 8, 16, 32, 64]), st.integers(1, 4),
       st.booleans(), st.sampled_from([None, 1, 2, 3, 5]), st.sampled_from([1, 2]), st.booleans(),
       st.sampled_from(KERNELS), st.integers(0, 2**31))
def test_kernel_against_the_reference(wfmt, cfmt, heads, T, ragged, num_splits, ratio, with_sink, launch, seed):
    args = list(decode_inputs(SMALL, T, 200 + seed % 50, 40, wfmt, cfmt, ratio=ratio, heads=heads, ragged=ragged,
                              device=DEV, seed=seed))
    if not with_sink: args[4] = None
    if (cfmt == 'ds_fp4' and launch['block_n'] == 16
        and min(launch['block_h'], max(16, triton.next_power_of_2(heads))) == 16):
        # a shape sparse_decode refuses (test_bad_arguments)
        launch = dict(launch, block_n=32)
    check_decode(tuple(args), num_splits=num_splits, launch=launch)


@needs_triton
@pytest.mark.parametrize('launch', KERNELS, ids=launch_name)
def test_every_distinct_kernel_one_split_and_several(launch):
    # 40 heads: a partial block of 64, or 32 + 8, or 16 + 16 + 8
    small = replace(FULL, window_size=16)
    for num_splits, (wf, cf) in zip((1, 3), (('fp8_ds_mla', 'ds_fp4'), ('window_fp8', 'fp8_ds_mla'))):
        check_decode(decode_inputs(small, 2, 100, 24, wf, cf, heads=40, ragged=True, device=DEV, seed=7),
                     num_splits=num_splits, launch=launch)


def test_separate_kernel_is_the_same_source_with_noinline_passes():
    """The separate-pass kernel: the same code and annotations (which say what is `tl.constexpr`) as the inlined
    one, its passes `noinline` copies, and (compiled) its own cache key"""
    import dsv41_nb.sparse_decode as sd
    one, two = sd._sparse_decode_kernel, sd._sparse_decode_separate
    assert two.fn.__code__ is one.fn.__code__ and two.fn.__globals__ is not one.fn.__globals__
    assert two.fn.__annotations__ == one.fn.__annotations__ and two.fn.__defaults__ == one.fn.__defaults__
    for name in ('_window_pass', '_topk_pass'):
        twin = two.fn.__globals__[name]
        assert twin is not getattr(sd, name) and twin.fn is getattr(sd, name).fn
        if not triton_interpreting(): assert twin.noinline and not getattr(sd, name).noinline
    if not triton_interpreting():
        assert [p.is_constexpr for p in two.params] == [p.is_constexpr for p in one.params]
        assert one.cache_key != two.cache_key                                   # never one binary for both


@needs_triton
def test_separate_and_inlined_passes_agree_bit_for_bit():
    args = decode_inputs(SMALL, 3, 100, 30, 'window_fp8', 'ds_fp4', heads=16, ragged=True, device=DEV, seed=4)
    for num_splits in (1, 2):
        a, b = (sparse_decode(*args, num_splits=num_splits, launch=dict(block_n=32, separate=s)) for s in (False, True))
        if triton_interpreting(): assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        else:                     # compiled apart, the two may contract multiply-adds differently
            torch.testing.assert_close(a[0].float(), b[0].float(), rtol=2 ** -7, atol=2 ** -10)
            torch.testing.assert_close(a[1], b[1], rtol=2 ** -20, atol=2 ** -16)


@needs_triton
def test_empty_lists_window_only_and_one_record():
    q, window, compressed, idx, sink, scale = decode_inputs(SMALL, 3, 100, 30, heads=8, device=DEV, seed=2)
    nothing = replace(idx, window_lens=torch.zeros_like(idx.window_lens), topk_lens=torch.zeros_like(idx.topk_lens))
    for num_splits in (1, 3):
        out, lse = sparse_decode(q, window, compressed, nothing, sink, scale, num_splits=num_splits)
        assert not out.float().abs().any() and ((lse - sink).abs() <= 2 ** -21 * sink.abs()).all()
        assert sparse_decode(q, window, compressed, nothing, None, scale, num_splits=num_splits)[1].isneginf().all()
    swa_only = replace(idx, topk=idx.topk[:, :0], topk_lens=torch.zeros_like(idx.topk_lens))
    check_decode((q, window, None, swa_only, sink, scale), num_splits=2)
    one = replace(idx, window_slots=torch.where(torch.arange(24, device=DEV) == 5, idx.window_slots, -1),
                  topk=torch.full_like(idx.topk, -1))
    worst, out, _ = check_decode((q, window, compressed, one, None, scale), num_splits=4)
    v = window.codec.unpack(window.records()[idx.window_slots[:, 5].long()])
    assert torch.equal(out.float(), v[:, None, :].expand_as(out).bfloat16().float())      # one record, no sink: itself


@needs_triton
@pytest.mark.parametrize('batch', [1, 16, 64, 256 if GPU else 128])
def test_batch_sizes(batch):
    # 64 heads, 128 + 512 records
    if GPU: args = decode_inputs(FULL, batch, 1024, 512, ragged=True, device=DEV, seed=batch)
    else: args = decode_inputs(replace(FULL, window_size=8), batch, 16, 8, 'window_fp8',
                               'fp8_ds_mla', heads=4, ragged=True, swa_block_size=8, block_size=16,
                               device=DEV, seed=batch)   # FP8: 16-record tiles at 16 heads
    check_decode(args, launch=None if GPU else dict(block_n=16))


@needs_triton
def test_a_prefill_chunk_through_the_layer():
    torch.manual_seed(7)
    # the ratio-1 Full layer and a Reuse layer
    pair = [CSA2Attention(TINY, l).to(DEV) for l in (6, 7)]
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
            runs.append([m.attention(x[i], step, state, topk if m.role == 'Full' else None)[0]
                         for i, m in enumerate(pair)])
    vmax = max(m.window_codec.unpack(state.window[m.layer]).abs().max() for m in pair)
    vmax = max(vmax, state.main_codec.unpack(state.compressed[6]).abs().max())
    for ro, ko in zip(*runs):
        assert ((ko.float() - ro.float()).abs() <= 2 ** -7 * vmax + 2 ** -6 * ro.float().abs()).all()


@pytest.mark.skipif(not GPU, reason='the compiled kernel needs a GPU')
def test_compiled_kernel_on_every_format_pair_head_count_and_batch():
    rows = check_decode_grid(DEV)                   # raises on the first case past the bound
    assert len(rows) == 2 * 2 * 3 * 4 and all(r['worst'] <= 1 for r in rows)


def test_the_tuning_table_is_complete_and_valid():
    assert list(DECODE_TUNING)[-1] is None and all(isinstance(k, int) for k in list(DECODE_TUNING)[:-1])
    assert list(DECODE_TUNING)[:-1] == sorted(list(DECODE_TUNING)[:-1])
    for entry in DECODE_TUNING.values():
        _check_launch(entry)
        assert {'block_h', 'block_n', 'num_warps', 'num_stages', 'scale_tile', 'separate'} <= set(entry)
    # every shape has its own name
    assert len({launch_name(v) for v in decode_variants()}) == len(decode_variants())


@given(st.integers(1, 512), st.sampled_from([4, 16, 64, 128]), st.integers(0, 200), st.integers(0, 600))
def test_split_heuristic_stays_in_bounds(T, H, W, K):
    fixed = next(v for k, v in DECODE_TUNING.items() if k is None or T <= k).get('splits')     # a count the table sets
    launch = decode_launch(T, H, W, K, 'cpu')
    assert launch['SPLITS'] == (fixed or 1) and launch['BLOCK_H'] in (16, 32, 64) and launch['BLOCK_H'] >= min(H, 16)
    if GPU and not fixed:
        L = decode_launch(T, H, W, K, DEV)
        tiles = max(1, triton.cdiv(W, L['BLOCK_N']) + triton.cdiv(K, L['BLOCK_N']))
        sms = torch.cuda.get_device_properties(DEV).multi_processor_count
        assert (1 <= L['SPLITS'] <= min(tiles, 16)
                and (L['SPLITS'] == 1 or T * triton.cdiv(H, L['BLOCK_H']) * L['SPLITS'] <= sms))


def test_bad_arguments():
    q, window, compressed, idx, sink, scale = decode_inputs(SMALL, 2, 100, 30, heads=4, device=DEV)
    run = lambda **kw: sparse_decode(q, window, compressed, idx, sink, scale, **kw)
    cases = [(lambda: run(num_splits=0), 'num_splits = 0'),
             (lambda: run(launch=dict(block_n=-8)), 'block_n = -8'),
             (lambda: run(launch=dict(block_n=48)), 'block_n = 48 is not a power of two'),
             (lambda: run(launch=dict(num_warps=3)), 'num_warps = 3 is not a power of two'),
             (lambda: run(launch=dict(scale_tile='yes')), 'scale_tile must be True or False'),
             (lambda: run(launch=dict(prefetch=1)), 'prefetch must be True or False'),
             (lambda: run(launch=dict(warps=8)), "unknown keys ['warps']"),
             (lambda: run(launch=[('block_n', 32)]), 'launch: expected a dict'),
             (lambda: decode_launch(1, 0, 10, 10, 'cpu'), 'H = 0'),
             (lambda: sparse_decode(q, window, None, idx, sink, scale), 'compressed: expected PagedRecords'),
             (lambda: sparse_decode(q[:, :3], window, compressed, idx, sink, scale), 'sink: expected a (3,) tensor'),
             (lambda: _format_meta(cache_format(FULL, 'index_fp8'), 128, 'W'),
              'FP8 records with block scales or FP4 records'),
             (lambda: run(out_rope=torch.ones(4)), 'out_rope: expected (inv_freq, positions)'),
             (lambda: run(out_rope=(torch.ones(4, device=DEV), torch.tensor([1], device=DEV))),
              'positions must be integers of shape (2,)')]
    if HAS_TRITON:
        cases += [(lambda: sparse_decode(q.half(), window, compressed, idx, sink, scale),
                   'the kernel takes bf16 queries'),
                  (lambda: run(launch=dict(block_n=16)), 'decodes FP4 records wrongly')]   # a shape that compiles wrong
    for f, msg in cases: fct.test_fail(f, contains=msg)


@needs_triton
@pytest.mark.parametrize('num_splits', [1, 3])
def test_out_rope_is_the_inverse_rotation_of_the_output(num_splits):
    """out_rope: the output rotated back in the combining launch (or, with one split, by `rope`),
    bit for bit; lse unchanged"""
    q, window, compressed, idx, sink, scale = decode_inputs(SMALL, 2, 100, 30, heads=4, device=DEV)
    inv, pos = (1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).float().to(DEV), torch.tensor([99, 99], device=DEV)
    o, lse = sparse_decode(q, window, compressed, idx, sink, scale, num_splits=num_splits)
    o_r, lse_r = sparse_decode(q, window, compressed, idx, sink, scale, num_splits=num_splits, out_rope=(inv, pos))
    assert torch.equal(o_r, rope(o, inv, pos, inverse=True)) and torch.equal(lse_r, lse)


def test_prefetch_takes_the_word_kernel_only_where_the_codes_can_be_read_as_words():
    "FP4 records in a word-aligned cache: the prefetching kernels; FP8 records or a misaligned view: the byte tiles"
    import dsv41_nb.sparse_decode as sd
    _, _, fp4, idx, _, _ = decode_inputs(SMALL, 2, 100, 30, 'window_fp8', 'ds_fp4', heads=4, device=DEV)
    _, _, fp8, *_ = decode_inputs(SMALL, 2, 100, 30, 'window_fp8', 'fp8_ds_mla', heads=4, device=DEV)
    L = lambda **kw: decode_launch(2, 64, 16, 32, DEV, 1, dict(prefetch=True, **kw))
    fn, view = sd._decode_kernel(L(separate=True), fp4)
    assert fn is sd._sparse_decode_prefetch and view.dtype == torch.int32
    assert view.data_ptr() == fp4.cache.data_ptr() and view.shape[-1] * 4 == fp4.cache.shape[-1]
    assert sd._decode_kernel(L(separate=False), fp4)[0] is sd._one_function_prefetch
    assert sd._decode_kernel(L(separate=True), fp8)[0] is sd._sparse_decode_separate
    assert sd._decode_kernel(dict(L(separate=True), PREFETCH=False), fp4)[0] is sd._sparse_decode_separate
    flat = fp4.cache.reshape(-1)
    assert sd._words_view(flat[1:1 + 288 * 4].view(4, 288)) is None        # a view that starts mid-word
    assert sd._words_view(fp4.cache.view(torch.int8)) is None               # not bytes as stored
