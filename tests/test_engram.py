"""Engram: the token map, n-gram hashing against a plain-Python reference and against values computed with DeepSeek's
public code, row ranges and spread (09_engram, module engram); the gather kernel against the PyTorch reference, the
gate, sharding (09_engram_table, module engram_table); and bad input to each module.

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either they are skipped."""
import dataclasses
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig, engram_bucket_primes
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.formats import quantize_fp8, dequantize_fp8
from dsv41_nb.engram import (normalize_token, compressed_token_map, synthetic_token_strings, hash_multipliers,
                             ngram_hashes_reference, NgramHasher, hash_spread)
from dsv41_nb.engram_table import (EngramTable, engram_row_codec, engram_lookup, engram_kv, engram_gate, Engram,
                                   head_shards, sharding_traffic, engram_update)
from machine import DEV, HAS_TRITON

FULL, TINY = ModelConfig.full(), ModelConfig.tiny()
TINY_MAP = compressed_token_map(synthetic_token_strings(TINY.vocab_size, TINY.engram_compressed_vocab_size))

# What the `tokenizers` library's normaliser chain (as the public engram.py builds it) makes of these strings.
NORMALISED = [
    (' The', 'the'), ('THE', 'the'), ('Café', 'cafe'), ('ＣＡＦÉ', 'cafe'), ('ﬁne', 'fine'), ('Ⅻ', 'xii'),
    (' ', ' '), ('  ', ' '), ('\t\n', ' '), (' \r\n x \t', 'x'), ('ΟΔΟΣ', 'οδοσ'), ('İstanbul', 'istanbul'),
    ('ẞ', 'ß'), ('ǅ', 'dz'), ('Ω', 'ω'), ('e\u0301', 'e'), ('\u0301', ''), ('ೋ', ''),
    ('\x1chi\x1d', '\x1chi\x1d'), ('\x85x\u2028', 'x'), ('\u3000a\u3000', 'a'), ('①②', '12'), ('Ⓐ', 'a'),
    ('\u200b', '\u200b'), ('Ǆ', 'dz'), ('ﬀ', 'ff'), ('Å', 'a'), ('x\ny', 'x y')]

def test_normalisation_matches_the_tokenizers_library():
    for text, want in NORMALISED: assert normalize_token(text) == want, (text, want)

def test_token_map_is_deterministic_and_first_come():
    texts = synthetic_token_strings(300, 120, seed=5)
    a, b = compressed_token_map(texts), compressed_token_map(list(texts))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] == 120
    first = {}
    for t in texts: first.setdefault(normalize_token(t), len(first))
    assert a[0].tolist() == [first[normalize_token(t)] for t in texts]          # ids in order of first appearance

# DeepSeek's public NgramHashState, run on the `full` config with the token map i -> i % 99,092, the token ids
# [0, 1, 99091, 50000, 2, 123456, 7] and the mask [1, 1, 1, 1, 1, 0, 1]: layer 1's columns 0, 7, 8, 15, 16, 23.
PUBLIC_MULTIPLIERS = [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                      [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
PUBLIC_ROWS = [[5702652, 121476532, 131476717, 247482304, 257520185, 380066193],
               [15045429, 115577409, 128992384, 244941532, 261145562, 382841219],
               [14189969, 118783556, 141161095, 245767777, 266318584, 381684946],
               [3518010, 112703079, 139585012, 255617098, 259701339, 381510178],
               [7304119, 123132389, 140168536, 244602252, 260725383, 374272676],
               [4299726, 112312540, 129401291, 250883315, 264341430, 370096053],
               [8939594, 121427189, 128454377, 241631034, 263018334, 373889199]]
COLUMNS = [0, 7, 8, 15, 16, 23]

def test_hashes_equal_values_from_the_public_code():
    assert hash_multipliers(FULL).tolist() == PUBLIC_MULTIPLIERS
    lookup = torch.arange(FULL.vocab_size) % FULL.engram_compressed_vocab_size
    h = NgramHasher(FULL, lookup, FULL.engram_compressed_vocab_size)
    ids = torch.tensor([[0, 1, 99091, 50000, 2, 123456, 7]])
    mask = torch.tensor([[True] * 5 + [False, True]])
    assert h(ids, mask)[0, :, 0][:, COLUMNS].tolist() == PUBLIC_ROWS
    ref = ngram_hashes_reference(ids[0].tolist(), FULL, lookup.tolist(), mask[0].tolist())
    assert [[r[0][c] for c in COLUMNS] for r in ref] == PUBLIC_ROWS

@st.composite
def engram_configs(draw):
    "tiny with its Engram geometry varied: n-gram size, heads, compressed vocabulary, prime start, layers"
    layers = tuple(sorted(draw(st.sets(st.integers(0, TINY.n_layers - 1), min_size=1, max_size=3))))
    return dataclasses.replace(TINY, engram_max_ngram_size=draw(st.integers(2, 5)),
                               engram_n_heads=draw(st.integers(1, 4)),
                               engram_compressed_vocab_size=draw(st.integers(103, 400)),   # <= 5 texts per key in 512
                               engram_vocab_size=draw(st.integers(50, 5000)), engram_layer_ids=layers,
                               engram_num_embeddings=())

@settings(max_examples=examples(40))
@given(engram_configs(), st.integers(0, 2**31 - 1), st.integers(1, 12))
def test_hashing_equals_python_reference_and_stays_in_range(cfg, seed, L):
    texts = synthetic_token_strings(cfg.vocab_size, cfg.engram_compressed_vocab_size, seed=seed % 7)
    (lookup, size), g = compressed_token_map(texts), torch.Generator().manual_seed(seed)
    h = NgramHasher(cfg, lookup, size)
    ids, mask = torch.randint(0, cfg.vocab_size, (2, L), generator=g), torch.rand(2, L, generator=g) > 0.2
    k = int(torch.randint(0, cfg.engram_max_ngram_size, (1,), generator=g))
    hist = torch.randint(-1, cfg.vocab_size, (2, k), generator=g)
    got = h(ids, mask, hist)
    assert torch.equal(got, h(ids, mask, hist))                                            # deterministic
    for b in range(2):
        want = ngram_hashes_reference(ids[b].tolist(), cfg, lookup.tolist(), mask[b].tolist(), hist[b].tolist())
        assert got[b].tolist() == want
    primes = torch.tensor(engram_bucket_primes(cfg)).flatten(1)
    assert ((got >= h.offsets) & (got < h.offsets + primes)).all()
    assert (got < torch.tensor(cfg.engram_num_embeddings)[:, None]).all()

@settings(max_examples=examples(20))
@given(st.integers(0, 2**31 - 1), st.integers(2, 30))
def test_chunked_hashing_equals_one_pass(seed, split):
    g = torch.Generator().manual_seed(seed)
    h = NgramHasher(TINY, *TINY_MAP)
    ids, mask = torch.randint(0, TINY.vocab_size, (3, 32), generator=g), torch.rand(3, 32, generator=g) > 0.1
    parts, n = [h(ids[:, :split], mask[:, :split])], TINY.engram_max_ngram_size
    for p in range(split, 32):
        lo = max(0, p - n + 1)
        parts.append(h(ids[:, p:p + 1], mask[:, p:p + 1], torch.where(mask[:, lo:p], ids[:, lo:p], -1)))
    assert torch.equal(torch.cat(parts, 1), h(ids, mask))

@pytest.mark.parametrize('cfg', [TINY, FULL], ids=['tiny', 'full'])
def test_rows_spread_evenly_over_each_head(cfg):
    "Chi-square per hash column: random distinct windows folded into equal bins of each column's range"
    V = cfg.engram_compressed_vocab_size
    h = NgramHasher(cfg, torch.arange(cfg.vocab_size) % V, V)
    win = torch.randint(0, V, (40_000, cfg.engram_max_ngram_size), generator=torch.Generator().manual_seed(7))
    stat, limit = hash_spread(h, h.hashes(win), bins=32)
    assert (stat < limit).all(), (stat.max(), limit)

def test_gate_finite_for_zero_and_extreme_vectors():
    d, w = FULL.dim, torch.ones(4, FULL.dim)
    for hv, kv in ((0., 0.), (0., 1.), (1., 0.), (1e-30, 1e-30), (1e-30, 0.)):
        g = engram_gate(torch.full((2, 4, d), hv), torch.full((2, 4, d), kv), w, w, FULL.norm_eps)
        assert torch.isfinite(g).all() and ((g > 0) & (g < 1)).all()

@pytest.mark.skipif(not HAS_TRITON, reason='needs a GPU or TRITON_INTERPRET=1')
@settings(max_examples=examples(25))
@given(st.sampled_from([32, 64, 96, 256]), st.integers(1, 400), st.integers(0, 70), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.bfloat16, torch.float32]), st.booleans())
def test_gather_kernel_equals_reference(hd, rows, n_ids, seed, dtype, shard):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, hd, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    table = EngramTable.from_values(values)
    if DEV.type == 'cuda': table = table.placed('gpu')
    if shard:
        a = int(torch.randint(0, rows, (1,), generator=g))
        table = table.shard(a, int(torch.randint(a, rows + 1, (1,), generator=g)))
    ids = torch.randint(0, rows + 5, (n_ids,), generator=g).to(DEV)                    # some beyond the table: zeros
    got = engram_lookup(table, ids, dtype)
    with use_kernels('torch'): want = engram_lookup(table, ids, dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    held = ((ids >= table.row_start) & (ids < table.row_start + table.rows)).cpu()
    exact = dequantize_fp8(*quantize_fp8(values))[ids.cpu().clamp(max=rows - 1)]       # global ids index the values
    torch.testing.assert_close(got.cpu().float(),
                               torch.where(held[:, None], exact, 0).to(dtype).float(), rtol=0, atol=0)

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
def test_pinned_host_table_read_over_uva_equals_gpu_table():
    table = EngramTable.from_values(torch.randn(5000, 256))
    ids = torch.randint(0, 5000, (300, 24), device='cuda')
    host, gpu = table.placed('host'), table.placed('gpu')
    assert host.placement == 'pinned host'
    torch.testing.assert_close(engram_lookup(host, ids), engram_lookup(gpu, ids), rtol=0, atol=0)

def test_shards_reassemble_the_table():
    m = Engram.random(TINY, TINY.engram_layer_ids[0])
    ids = NgramHasher(TINY, *TINY_MAP)(torch.randint(0, TINY.vocab_size, (2, 11)))[:, :, 0]
    with use_kernels('torch'):
        whole = engram_lookup(m.table, ids)
        for world_size in (1, 2, 3, 6):
            plan = head_shards(TINY, world_size)[0]
            assert sum(r1 - r0 for *_, r0, r1 in plan) == m.table.rows
            summed = sum(engram_lookup(m.table.shard(r0, r1), ids).float() for *_, r0, r1 in plan)
            torch.testing.assert_close(summed.bfloat16(), whole, rtol=0, atol=0)

def test_sharding_matches_the_sources():
    assert [round(sharding_traffic(FULL, r, 1)['gib_per_rank'], 1) for r in (1, 2, 4, 8)] == [188.8, 94.4, 47.2, 23.6]
    t = sharding_traffic(FULL, 8, 64)
    assert t['allreduce_bytes'] == 2 * 7 / 8 * 64 * 24 * 256 * 2 * 2
    assert t['allgather_bytes'] == 7 / 8 * 64 * 24 * 264 * 2

def test_image_tokens_pass_through_unchanged():
    m = Engram.random(TINY, TINY.engram_layer_ids[1], seed=4)
    ids, mask = torch.randint(0, TINY.vocab_size, (1, 8)), torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    hid = NgramHasher(TINY, *TINY_MAP)(ids, mask)[:, :, m.layer_index]
    h = torch.randn(1, 8, TINY.hc_mult, TINY.dim).bfloat16()
    with use_kernels('torch'): out = m(h, hid, mask)
    assert torch.equal(out[0, 2:4], h[0, 2:4]) and not torch.equal(out[0, 4:], h[0, 4:])

_HASHER = NgramHasher(TINY, *TINY_MAP)
_TABLE = EngramTable.from_values(torch.randn(50, 64))
_NO_ENGRAM = dataclasses.replace(TINY, engram_layer_ids=(), engram_num_embeddings=())
_ROWS = torch.zeros(2, 6, 32)
BAD_INPUT = [  # engram: (call, part of the message)
    (lambda: _HASHER(torch.tensor([[5, 512]])), 'token ids: id 512 is out of range; expected 0..511'),
    (lambda: _HASHER(torch.tensor([[-1, 3]])), 'token ids: id -1 is out of range; expected 0..511'),
    (lambda: _HASHER(torch.tensor([[1.0, 3.0]])), 'token ids: expected an integer tensor'),
    (lambda: _HASHER(torch.tensor([[1, 3]]), history=torch.tensor([[1, 2, 3, 4]])),
     'history of 4 tokens; an n-gram of order 4 looks back at most 3'),
    (lambda: _HASHER(torch.tensor([[1]]), history=torch.tensor([[600]])),
     'token ids: id 600 is out of range; expected -1..'),
    (lambda: _HASHER.hashes(torch.zeros(2, 5, dtype=torch.long)),
     'n-gram window of 5 tokens; this config hashes orders 2..4'),
    (lambda: _HASHER.hashes(torch.zeros(2, 3, dtype=torch.long)), 'n-gram window of 3 tokens'),
    (lambda: _HASHER.hashes(torch.full((2, 4), 400)), 'window ids: id 400 is out of range; expected 0..399'),
    (lambda: NgramHasher(TINY, TINY_MAP[0], 401), 'the token map has 401 compressed ids, the config expects 400'),
    (lambda: NgramHasher(TINY, TINY_MAP[0][:2], 400), 'expected a 1-d map covering the pad id 2'),
    (lambda: NgramHasher('tiny', *TINY_MAP), 'NgramHasher: expected a ModelConfig'),
    (lambda: NgramHasher(_NO_ENGRAM, *TINY_MAP), 'no Engram layers'),
    (lambda: compressed_token_map(['a', '\ufffd']), 'token 1 decodes to a partial UTF-8 sequence'),
    (lambda: compressed_token_map(['a', 'b'], ['a']), 'raw has 1 entries for 2 token texts'),
    (lambda: compressed_token_map(['a', 3]), 'token 1: expected its text as a str'),
    (lambda: normalize_token(b'the'), 'normalize_token: expected a str'),
    (lambda: synthetic_token_strings(100, 10), 'at most 5 texts per key'),
    (lambda: synthetic_token_strings(5, 10), 'vocab_size = 5; expected at least 10'),
    (lambda: hash_spread(_HASHER, torch.zeros(3, 2, 6, dtype=torch.long), bins=1), 'bins = 1; expected at least 2'),
]

BAD_TABLE_INPUT = [  # engram_table: (call, part of the message)
    (lambda: engram_row_codec('full'), 'engram_row_codec: expected a ModelConfig'),
    (lambda: EngramTable(torch.zeros(4, 65, dtype=torch.uint8), 64), 'expected records of 66 bytes'),
    (lambda: EngramTable(torch.zeros(4, 66), 64), 'expected uint8 records'),
    (lambda: EngramTable(torch.zeros(4, 41, dtype=torch.uint8), 40), 'head_dim = 40 is not a multiple of 32'),
    (lambda: EngramTable(torch.zeros(4, 66, dtype=torch.uint8), 64, -3), 'row_start = -3; expected at least 0'),
    (lambda: EngramTable.from_checkpoint(torch.zeros(4, 64), torch.zeros(4, 2)), 'expected float8_e4m3fn weight'),
    (lambda: EngramTable.from_checkpoint(torch.zeros(4, 64).to(torch.float8_e4m3fn),
                                         torch.zeros(4, 3).to(torch.float8_e8m0fnu)), 'needs scale (4, 2), got (4, 3)'),
    (lambda: EngramTable.from_values(torch.zeros(64)), 'expected (rows, head_dim) values, got (64,)'),
    (lambda: _TABLE.shard(40, 60), '[40, 60) is not inside the table'),
    (lambda: _TABLE.placed('disk'), "placement 'disk'; expected 'gpu' or 'host'"),
    (lambda: engram_lookup(_TABLE, torch.tensor([-2])), 'negative row id -2'),
    (lambda: engram_lookup(_TABLE, torch.tensor([0.5])), 'expected int32/int64 row ids'),
    (lambda: engram_lookup(torch.zeros(3), torch.tensor([1])), 'expected an EngramTable'),
    (lambda: engram_kv(_ROWS, torch.zeros(320, 100), 4), 'does not fit rows'),
    (lambda: engram_gate(torch.zeros(2, 4, 8), torch.zeros(2, 4, 6), torch.ones(4, 8), torch.ones(4, 8), 1e-20),
     'engram_gate: expected h and key of one shape'),
    (lambda: engram_gate(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.ones(8), torch.ones(4, 8), 1e-20),
     'weights (8,) and (4, 8)'),
    (lambda: engram_gate(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.ones(4, 8), torch.ones(4, 8), 0.0),
     'eps = 0.0 and clamp = 1e-06; both must be > 0'),
    (lambda: engram_update(torch.zeros(2, 4, 8), torch.zeros(2, 3), torch.zeros(2, 8)),
     'engram_update: expected h (..., hc_mult, dim), gate (..., hc_mult)'),
    (lambda: engram_update(torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(2, 8), torch.ones(2)),
     'token_mask must be bool of shape (2,), got torch.float32'),
    (lambda: Engram(TINY, 3, _TABLE, None, None, None), 'layer 3 is not in engram_layer_ids (1, 4)'),
    (lambda: Engram(TINY, 1, _TABLE, torch.zeros(3, 3), torch.zeros(4, 64), torch.zeros(4, 64)),
     'wkv has shape (3, 3), expected (320, 192)'),
    (lambda: Engram(TINY, 1, _TABLE, torch.zeros(320, 192), torch.zeros(4, 64), torch.zeros(4, 64)),
     'table rows hold 64 values, the config 32'),
    (lambda: head_shards(TINY, 7), '7 ranks for 6 hash heads'),
    (lambda: head_shards(TINY, 0), 'world_size = 0; expected at least 1'),
    (lambda: sharding_traffic(TINY, 2, -1), 'batch = -1; expected at least 0'),
    (lambda: sharding_traffic(TINY, 0, 1), 'world_size = 0; expected at least 1'),
]

@pytest.mark.parametrize('call,message', BAD_INPUT, ids=[m[:40] for _, m in BAD_INPUT])
def test_bad_input_raises_a_clear_error(call, message):
    fails_with(call, contains=message)

@pytest.mark.parametrize('call,message', BAD_TABLE_INPUT, ids=[m[:40] for _, m in BAD_TABLE_INPUT])
def test_bad_table_input_raises_a_clear_error(call, message):
    fails_with(call, contains=message)
