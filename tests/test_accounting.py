"Accounting: the checkpoint inventory, bytes per token, expert touch and decode floors against independent computations"
import math
from dataclasses import replace
import pytest
import torch
import numpy as np
import fastcore.test as fct
from hypothesis import given, strategies as st
from dsv41_nb.config import ModelConfig
from dsv41_nb.record_codecs import cache_format, CACHE_FORMATS
from dsv41_nb.accounting import (compressed_entries_per_token, global_kv_bytes_per_token, swa_bytes_per_sequence,
                                 record_saving, checkpoint_manifest, params_by_group, expert_params,
                                 active_params_per_token, memory_table, engram_gathers_per_token,
                                 engram_bytes_per_token, TensorSpec, GiB, gqa_kv_bytes_per_token, DTYPE_BYTES)
from dsv41_nb.floors import (step_floor, decode_kv_read_bytes, decode_flops_per_token, expert_touch_fraction,
                             decode_floor, Hardware, HARDWARE, agreement, accounting_rows, format_rows, ROW_HEADER,
                             rank_weight_gib, vram_minimum_gb, UTILIZATION)
from test_config import topologies

TINY, FULL = ModelConfig.tiny(), ModelConfig.full()

def test_manifest_counts():
    for c in (TINY, ModelConfig.bench()):
        man = checkpoint_manifest(c)
        names = [s.name for s in man]
        assert len(names) == len(set(names))
        g = params_by_group(man)
        assert g['routed_experts'] == c.n_layers * c.n_routed_experts * expert_params(c)
        assert g['dspark_experts'] == c.n_mtp_layers * c.dspark_n_routed_experts * expert_params(c)
        assert sum(1 for s in names if s.endswith('.attn.compressor.norm.weight')) == len(c.kv_source_layers)
        assert sum(1 for s in names if s.endswith('.attn.indexer.wq_b.weight')) == len(c.index_source_layers)
        assert sum(1 for s in names if s.endswith('.engram.embed.weight')) == len(c.engram_layer_ids)

@given(topologies(), st.integers(1, 64))
def test_entries_per_token_by_emission(t, n_pairs):
    "Count the entries the compressors emit over a sequence ((pos + 1) % ratio == 0) and compare per token"
    c = replace(TINY, **t)
    n = 2 * n_pairs                                                         # a multiple of every ratio (1, 2)
    emitted = sum(1 for s in c.kv_source_layers for pos in range(n) if (pos + 1) % c.compress_ratios[s] == 0)
    assert compressed_entries_per_token(c) == pytest.approx(emitted / n, rel=1e-12)

@pytest.mark.parametrize('c', [TINY, FULL], ids=['tiny', 'full'])
def test_kv_bytes_match_packed_records(c):
    "Bytes per token from the widths the codecs really write (pack random vectors and measure)"
    width = {n: cache_format(c, n).pack(torch.randn(3, cache_format(c, n).dim)).shape[-1] for n in CACHE_FORMATS}
    e = compressed_entries_per_token(c)
    assert (global_kv_bytes_per_token(c, 'ds_fp4', 'index_mxfp4')
            == pytest.approx(e * (width['ds_fp4'] + width['index_mxfp4'])))
    assert global_kv_bytes_per_token(c, 'fp8_ds_mla') == pytest.approx(e * width['fp8_ds_mla'])
    assert swa_bytes_per_sequence(c) == c.window_size * (c.n_layers + c.n_mtp_layers) * width['window_fp8']
    assert record_saving(c, 'ds_fp4', 'window_fp8') == pytest.approx(1 - width['ds_fp4'] / width['window_fp8'])

def test_nvfp4_saving_and_flags_in_rows():
    rows = {r[0]: r for r in accounting_rows(FULL)}
    assert all(len(r) == len(ROW_HEADER) for r in rows.values())
    nv = rows['NVFP4 (ds_fp4) KV smaller than FP8 (window_fp8)']
    assert nv[1:] == ('45%', '45%', 'throughput news', 'same')
    assert rows['KV per 1M-token sequence, DeepSeek / vLLM (MB)'][1:3] == ('933 / 1,531', '933 / 1,530')
    assert rows['KV per 1M-token sequence, DeepSeek / vLLM (MB)'][4] == 'rounding'
    assert (rows['checkpoint size (GiB)'][1:3] == ('474.3', '476')
            and rows['checkpoint size (GiB)'][4].startswith('differs'))
    for r in rows.values():                                     # a row whose figures print differently is never 'same'
        if r[2] and r[4] == 'same' and not {'-', '>'} & set(r[2]): assert r[1] == r[2].replace('~', '')
    assert {r[4] for r in accounting_rows(TINY)} == {''}        # the sources' figures describe the released model only
    assert 'rounding' in format_rows(accounting_rows(FULL))

@given(st.floats(-1e6, 1e6, allow_nan=False), st.integers(0, 3))
def test_agreement(x, d):
    "A source quotes q to d decimals: q itself is the same, q + 0.6 units a rounding, q + 3 units a difference"
    quoted, unit = f'{x:.{d}f}', 10 ** -d
    q = float(quoted)
    assert agreement(q, quoted, quoted) == 'same'
    assert agreement(q + 0.6 * unit, f'{q + 0.6 * unit:.{d + 1}f}', quoted) == 'rounding'
    assert agreement(q - 3 * unit, f'{q - 3 * unit:.{d}f}', quoted) == 'differs: see notebook'
    assert agreement(q + unit, '', f'>{quoted}') == 'same' and agreement(q, '', f'>{quoted}') == 'differs: see notebook'

@given(st.integers(0, 5000), st.integers(1, 512), st.data())
def test_expert_touch_against_combinations(batch, n, data):
    "1 - P(an expert escapes every token), P(escape one token) = C(n-1, k) / C(n, k)"
    k = data.draw(st.integers(1, n))
    expected = 1 - (math.comb(n - 1, k) / math.comb(n, k)) ** batch
    assert expert_touch_fraction(batch, k, n) == pytest.approx(expected, rel=1e-9, abs=1e-12)

def test_expert_touch_by_simulation():
    """Route B tokens to k distinct random experts; the tolerance is 5 standard deviations of a
    negatively associated mean"""
    T, n, k = 300, 96, 3
    for B in (1, 7, 40):
        picks = torch.rand(T, B, n).topk(k, dim=-1).indices
        frac = torch.zeros(T, n, dtype=torch.bool).scatter_(1, picks.flatten(1), True).float().mean(1).mean().item()
        p = expert_touch_fraction(B, k, n)
        assert abs(frac - p) <= 5 * math.sqrt(p * (1 - p) / (n * T)) + 1e-12
    assert np.allclose(expert_touch_fraction(np.arange(5)), [expert_touch_fraction(b) for b in range(5)])

def test_decode_floor_properties():
    hw = HARDWARE['B300']
    f0, f1, f_big = (decode_floor(TINY, hw, b) for b in (0, 1, 10_000))
    assert f0['expert_bytes'] == 0 and f0['dense_bytes'] == f1['dense_bytes'] > 0
    assert f0['expert_bytes'] < f1['expert_bytes'] < f_big['expert_bytes']
    slice_ = TINY.n_routed_experts * TINY.n_layers * expert_params(TINY) * (0.5 + 1 / 32) / 8
    assert f_big['expert_bytes'] == pytest.approx(slice_)                # every expert touched: the whole slice
    assert decode_floor(TINY, hw, 10_000, world_size=4)['expert_bytes'] == pytest.approx(2 * slice_)
    assert f1['seconds'] == pytest.approx((f1['dense_bytes'] + f1['expert_bytes']) / hw.bandwidth)
    slow = replace(hw, bandwidth=hw.bandwidth / 3)
    assert decode_floor(TINY, slow, 1)['seconds'] == pytest.approx(3 * f1['seconds'])


@pytest.mark.parametrize('c', [TINY, FULL])
def test_decode_floor_prices_the_head_at_its_checkpoint_dtype(c):
    "The LM head is read at the manifest's dtype (BF16); every other dense weight at dense_bytes_per_param"
    hw, d = HARDWARE['H200'], 1 + 1 / 32
    head = {s.name: s for s in checkpoint_manifest(c)}['head.weight']
    assert head.dtype == 'bf16'
    act = active_params_per_token(c, 'decode')
    f = decode_floor(c, hw, 1, world_size=1)
    rest = act['attention_and_dense'] + act['shared'] - head.numel
    assert f['dense_bytes'] == pytest.approx(rest * d + head.numel * DTYPE_BYTES['bf16'])
    as_fp8 = decode_floor(c, hw, 1, world_size=1, head_bytes_per_param=d)           # the briefing's count
    assert as_fp8['dense_bytes'] == pytest.approx((act['attention_and_dense'] + act['shared']) * d)
    assert f['seconds'] - as_fp8['seconds'] == pytest.approx(head.numel * (2 - d) / hw.bandwidth)
    assert f['expert_bytes'] == as_fp8['expert_bytes']
    if c is FULL:                       # bench/full, batch 1, one H200 at the engine record's copy rate: ~0.15 ms
        assert head.numel * (2 - d) / 4.239e12 * 1e3 == pytest.approx(0.151, abs=0.002)

def test_memory_table_adds_up():
    for c in (TINY, FULL):
        mem, man = memory_table(c), checkpoint_manifest(c)
        assert sum(v for k, v in mem.items() if k != 'total') == pytest.approx(mem['total'], rel=1e-12)
        assert mem['total'] * GiB == pytest.approx(sum(s.nbytes for s in man), rel=1e-12)

def test_engram_bytes_from_the_manifest():
    "Per-token bytes = rows gathered x (bytes of one table row + its scales), with row sizes read off the inventory"
    for c in (TINY, FULL):
        man = {s.name: s for s in checkpoint_manifest(c)}
        total = 0
        for l in c.engram_layer_ids:
            w, sc = man[f'layers.{l}.engram.embed.weight'], man[f'layers.{l}.engram.embed.scale']
            total += engram_gathers_per_token(c) * (w.nbytes + sc.nbytes) // w.shape[0]
        assert engram_bytes_per_token(c) == total

def test_active_params_halve_in_prefill():
    for c in (TINY, FULL):
        dec, pre = active_params_per_token(c, 'decode'), active_params_per_token(c, 'prefill')
        assert dec['routed'] == 2 * pre['routed'] and dec['shared'] == 2 * pre['shared']
        assert dec['total'] == sum(v for k, v in dec.items() if k != 'total')

def test_rank_weights_add_up_to_the_checkpoint():
    "Every GPU's share, times the GPUs, is the whole checkpoint: split parts once, replicated parts on every GPU"
    for c in (TINY, FULL):
        total, mem = sum(s.nbytes for s in checkpoint_manifest(c)) / GiB, memory_table(c)
        tables = mem['Engram tables (values)'] + mem['Engram scales']
        for n in (1, 3, 8):
            tp, dp = rank_weight_gib(c, n, 'tp', 'device'), rank_weight_gib(c, n, 'dp', 'host')
            assert tp['total'] * n == pytest.approx(total, rel=1e-12)
            assert (dp['experts'] * n + dp['rest'] + tables) == pytest.approx(total, rel=1e-12)
            assert dp['engram'] == 0 and rank_weight_gib(c, n, 'dp', 'device')['engram'] * n == pytest.approx(tables)

def test_memory_figures_of_the_sources():
    rows = {r[0]: r for r in accounting_rows(FULL)}
    assert rows['Engram per GPU over 8 / 4 / 2 GPUs (GiB)'][1:3] == ('23.6 / 47.2 / 94.4',) * 2
    assert rows['Engram the H200 TP4 offload moves off each GPU (GiB)'][4].startswith('differs')
    assert rows['1M-token sequences in it at vLLM main KV'][4] == 'same'
    assert vram_minimum_gb(FULL) == math.ceil(1.2 * sum(s.nbytes for s in checkpoint_manifest(FULL)) / 1e9)
    assert gqa_kv_bytes_per_token(80, 8, 128) == 320 * 1024                     # Llama 3 70B at BF16
    assert rows['main KV per token, SM100 FlashMLA fallback, 528-B records (B)'][1] == '1,320'
    room = HARDWARE['B300'].hbm_bytes / GiB * UTILIZATION - rank_weight_gib(FULL, 8)['total']
    assert rows['left per B300 at 0.92 utilization (GiB)'][1] == f'{room:.0f}'

# (call, exception type, words the message must contain): each public function of accounting and floors, given bad input
BAD_INPUTS = [
    (lambda: expert_touch_fraction(-3), ValueError, 'batch = -3; a token count cannot be negative'),
    (lambda: expert_touch_fraction(np.array([4, -1])), ValueError, 'a token count cannot be negative'),
    (lambda: expert_touch_fraction(1.5), TypeError, 'batch must be a token count (int), got 1.5'),
    (lambda: expert_touch_fraction('64'), TypeError, "batch must be a token count (int), got '64'"),
    (lambda: expert_touch_fraction(64, 0), ValueError, 'n_activated = 0; expected at least 1'),
    (lambda: expert_touch_fraction(64, 6, 0), ValueError, 'n_experts = 0; expected at least 1'),
    (lambda: expert_touch_fraction(64, 8, 4), ValueError, 'n_activated = 8 > n_experts = 4'),
    (lambda: expert_touch_fraction(64, 6.0), TypeError, 'n_activated must be an int'),
    (lambda: decode_floor(FULL, 'B300'), TypeError, 'hw must be a Hardware'),
    (lambda: decode_floor(FULL, HARDWARE['B300'], -1), ValueError, 'batch = -1; expected at least 0'),
    (lambda: decode_floor(FULL, HARDWARE['B300'], 1, world_size=0), ValueError, 'world_size = 0; expected at least 1'),
    (lambda: decode_floor(FULL, HARDWARE['B300'], 1, dense_bytes_per_param=0), ValueError, 'dense_bytes_per_param = 0'),
    (lambda: decode_floor(FULL, HARDWARE['B300'], 1, head_bytes_per_param=-2), ValueError, 'head_bytes_per_param = -2'),
    (lambda: decode_floor('full', HARDWARE['B300']), TypeError, 'active_params_per_token: expected a ModelConfig'),
    (lambda: Hardware('x', 1e9, 0, ''), ValueError, 'bandwidth = 0; expected a positive number'),
    (lambda: Hardware('x', '141e9', 1e12, ''), ValueError, "hbm_bytes = '141e9'"),
    (lambda: active_params_per_token(FULL, 'train'), ValueError,
     "phase = 'train'; expected one of ('decode', 'prefill')"),
    (lambda: active_params_per_token(None), TypeError, 'active_params_per_token: expected a ModelConfig'),
    (lambda: expert_params({}), TypeError, 'expert_params: expected a ModelConfig, got dict'),
    (lambda: checkpoint_manifest([1]), TypeError, 'checkpoint_manifest: expected a ModelConfig, got list'),
    (lambda: params_by_group(FULL), TypeError, 'params_by_group: expected TensorSpecs'),
    (lambda: params_by_group([1, 2]), TypeError, 'params_by_group: expected TensorSpecs'),
    (lambda: memory_table('full'), TypeError, 'checkpoint_manifest: expected a ModelConfig, got str'),
    (lambda: compressed_entries_per_token(3), TypeError, 'compressed_entries_per_token: expected a ModelConfig'),
    (lambda: global_kv_bytes_per_token(FULL, 'compressed'), ValueError, "unknown cache format 'compressed'"),
    (lambda: global_kv_bytes_per_token(FULL, 'ds_fp4', 'index'), ValueError, "unknown cache format 'index'"),
    (lambda: swa_bytes_per_sequence(FULL, 'swa'), ValueError, "unknown cache format 'swa'"),
    (lambda: swa_bytes_per_sequence(None), TypeError, 'swa_bytes_per_sequence: expected a ModelConfig'),
    (lambda: record_saving(FULL, 'ds_fp4', 'fp8'), ValueError, "unknown cache format 'fp8'"),
    (lambda: engram_gathers_per_token('x'), TypeError, 'engram_gathers_per_token: expected a ModelConfig'),
    (lambda: engram_bytes_per_token(FULL, 'yes'), TypeError, "with_scales must be a bool, got 'yes'"),
    (lambda: TensorSpec('w', (4, -2), 'fp8', 'dense'), ValueError, 'must be a tuple of non-negative ints'),
    (lambda: TensorSpec('w', [4, 2], 'fp8', 'dense'), ValueError, 'must be a tuple of non-negative ints'),
    (lambda: TensorSpec('w', (4,), 'fp16', 'dense'), ValueError, "dtype 'fp16'"),
    (lambda: TensorSpec('w', (4,), 'fp8', 'misc'), ValueError, "group 'misc'"),
    (lambda: agreement(1.0, '1', 'about 1'), ValueError, "cannot read 'about 1'"),
    (lambda: accounting_rows('full'), TypeError, 'accounting_rows: expected a ModelConfig, got str'),
    (lambda: format_rows([('a', 'b')]), ValueError, 'format_rows: every row needs 5 entries'),
    (lambda: agreement(1.0, '1', '>1-2'), ValueError, "cannot read '>1-2'"),
    (lambda: rank_weight_gib('full', 8), TypeError, 'rank_weight_gib: expected a ModelConfig, got str'),
    (lambda: rank_weight_gib(FULL, 0), ValueError, 'rank_weight_gib: world_size = 0; expected at least 1'),
    (lambda: rank_weight_gib(FULL, 4.0), TypeError, 'rank_weight_gib: world_size must be an int'),
    (lambda: rank_weight_gib(FULL, 4, 'ep'), ValueError, "layout = 'ep'; expected one of ('dp', 'tp')"),
    (lambda: rank_weight_gib(FULL, 4, 'tp', 'hbm'), ValueError, "engram = 'hbm'; expected one of ('device', 'host')"),
    (lambda: vram_minimum_gb(None), TypeError, 'vram_minimum_gb: expected a ModelConfig'),
    (lambda: vram_minimum_gb(FULL, 0.8), ValueError, 'headroom = 0.8; expected a number >= 1'),
    (lambda: vram_minimum_gb(FULL, True), ValueError, 'headroom = True'),
    (lambda: gqa_kv_bytes_per_token(0, 8, 128), ValueError, 'n_layers = 0; expected at least 1'),
    (lambda: gqa_kv_bytes_per_token(80, 8.0, 128), TypeError, 'n_kv_heads must be an int'),
    (lambda: gqa_kv_bytes_per_token(80, 8, 128, 0), ValueError, 'bytes_per_value = 0; expected a positive number'),
    (lambda: step_floor(FULL, HARDWARE['H200'], 0, 128), ValueError, 'step_floor: batch = 0'),
    (lambda: decode_kv_read_bytes(FULL, -1), ValueError, 'decode_kv_read_bytes: context = -1'),
    (lambda: decode_kv_read_bytes(FULL, 64, 'fp8'), ValueError, "unknown cache format 'fp8'"),
    (lambda: decode_flops_per_token('full', 64), TypeError, 'decode_flops_per_token: expected a ModelConfig'),
]

@pytest.mark.parametrize('call, exc, words', BAD_INPUTS, ids=[w[:40] for _, _, w in BAD_INPUTS])
def test_bad_inputs(call, exc, words):
    fct.test_fail(call, contains=words, exc=exc)


def test_step_floor_adds_up():
    "The step floor is decode_floor's weights plus each request's cache reads and Engram rows over the bandwidth;"
    " FLOPs grow with the batch, bytes stop growing once every expert is touched, so large batches turn compute-bound"
    from dsv41_nb.accounting import engram_bytes_per_token
    bench, hw = ModelConfig.bench(), HARDWARE['H200']
    for B in (1, 7, 64):
        s, w = step_floor(bench, hw, B, 300), decode_floor(bench, hw, B, world_size=1)
        want = (w['dense_bytes'] + w['expert_bytes']
                + B * (decode_kv_read_bytes(bench, 300) + engram_bytes_per_token(bench)))
        assert math.isclose(s['bytes'], want) and math.isclose(s['memory_s'], want / hw.bandwidth)
        assert math.isclose(s['flops'], B * decode_flops_per_token(bench, 300))
    assert decode_flops_per_token(bench, 300) > 2 * active_params_per_token(bench)['total']
    assert decode_kv_read_bytes(bench, 0) == 0 and decode_kv_read_bytes(bench, 2000) > decode_kv_read_bytes(bench, 200)
    big = step_floor(bench, hw, 65536, 300)
    assert big['bound'] == 'compute' and big['seconds'] == big['compute_s']
    assert step_floor(bench, replace(hw, matmul_flops=None), 65536, 300)['bound'] == 'memory'
