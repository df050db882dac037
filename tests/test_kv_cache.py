"""Exact cases for dsv41_nb.kv_cache, in the manner of vLLM's prefix-caching tests, plus the worked numbers of
"The Life of a DeepSeek V4.1 Flash KV Cache in vLLM" and bad input"""
import random
import numpy as np
import pytest
import torch
import fastcore.test as fct
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.config import ModelConfig
from dsv41_nb.block_pool import BlockPool, reference_slot_mapping, ring_slot_mapping
from dsv41_nb.prefix_cache import Request, RequestBlockHasher, BlockStored, AllBlocksCleared
from dsv41_nb.kv_cache import (CacheConfig, get_kv_cache_config, KVCacheCoordinator, cdiv, reference_longest_hit,
                               kv_bytes_per_token, kv_cache_layout_table)
from dsv41_nb.accounting import global_kv_bytes_per_token
from dsv41_nb.kv_manager import KVCacheManager, CacheCapacityError, cache_snapshot
from dsv41_nb.kv_walk import admit, prefill_rest

FULL, TINY = ModelConfig.full(), ModelConfig.tiny()
GLOBAL, SWA, RING = 0, 1, 2


def tiny_kv(num_blocks=64, events=False, **cc):
    "A tiny-config manager: global blocks of 16 tokens, SWA blocks of 4 (window 16), one ring per request"
    return KVCacheManager(get_kv_cache_config(TINY,
                                              CacheConfig.for_model(TINY, num_gpu_blocks_override=num_blocks, **cc)),
                          enable_kv_cache_events=events)


def toks(n, seed=0, vocab=TINY.vocab_size):
    r = random.Random(seed)
    return [r.randrange(vocab) for _ in range(n)]


def run(kv, req, chunk=10 ** 9):
    "Admit with a prefix hit, then prefill every known token; returns the hit length"
    n = admit(kv, req, chunk)
    prefill_rest(kv, req, chunk)
    return n


def free_order(kv):
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


# ---------------------------------------------------------------- layout and config
def test_full_layout_matches_the_blog_post():
    kc = get_kv_cache_config(FULL)
    g, s, r = kc.groups
    assert (g.block_size, s.block_size, kc.hash_block_size, kc.resume_alignment) == (128, 32, 32, 128)
    assert ([m.kind for m in g.members] == ['main_kv', 'index_k'] * 4
            and [m.layer for m in g.members][::2] == [2, 8, 14, 20])
    assert len(s.members) == 43 and {m.record_bytes for m in s.members} == {528}
    assert [m.layer for m in r.members] == [2, 8, 14] and r.bytes_per_block == 3 * 2 * 1024 * 4
    assert r.block_size == max(m.ratio for m in r.members) == 2                 # the ring's length
    # a page per member, each as wide as the widest (layer 20's 128 main KV records), x 43 members
    assert f'would need {128 * 288 * 43:,} B per block id' in kv_cache_layout_table(kc)
    assert g.bytes_per_block == 64 * 3 * (288 + 68) + 128 * (288 + 68)
    assert kc.page_bytes == 43 * 32 * 528 == max(x.bytes_per_block for x in kc.groups)
    assert [x.prefix_caching for x in kc.groups] == ['yes', 'retained tails only', 'never']
    fp8 = get_kv_cache_config(FULL, CacheConfig(main_kv_format='fp8_ds_mla', index_key_format='index_fp8'))
    assert fp8.groups[0].bytes_per_block == 64 * 3 * (584 + 132) + 128 * (584 + 132)



@pytest.mark.parametrize('cfg', [FULL, TINY])
@pytest.mark.parametrize('main,index', [('ds_fp4', 'index_mxfp4'), ('fp8_ds_mla', 'index_fp8')])
def test_kv_bytes_per_token(cfg, main, index):
    "The shared pool charges every block a page of the widest group; per-group blocks cost the accounting's bytes"
    kc = get_kv_cache_config(cfg, CacheConfig.for_model(cfg, main_kv_format=main, index_key_format=index))
    g, s, _ = kc.groups
    shared, own = kv_bytes_per_token(kc), kv_bytes_per_token(kc, 'per_group')
    assert set(shared) == set(own) == {'global', 'swa'}                     # the ring is no per-token cost
    assert own['global'] == global_kv_bytes_per_token(cfg, main, index) == g.bytes_per_block / g.block_size
    for x in (g, s):
        assert shared[x.name] == kc.page_bytes / x.block_size >= own[x.name]
        # only the widest fills its page
        assert (shared[x.name] == own[x.name]) == (x.bytes_per_block == kc.page_bytes)
    if cfg is FULL and main == 'ds_fp4':
        assert own['global'] == 890 and shared['global'] == 43 * 32 * 528 / 128      # ~890 B vs ~5.7 KB
    with pytest.raises(ValueError, match="layout = 'packed'"): kv_bytes_per_token(kc, 'packed')
    with pytest.raises(TypeError, match='expected a KVCacheConfig'): kv_bytes_per_token(cfg)

@pytest.mark.parametrize('kw,msg', [
    (dict(prefix_cache_retention_interval=-1), 'expected 0'),
    (dict(prefix_cache_retention_interval=96), 'not a multiple of the resume alignment'),
    (dict(swa_block_size=127), 'lcm = 16256 tokens > max_resume_alignment'),
    (dict(main_kv_format='nvfp4'), "main_kv_format = 'nvfp4'"),
    (dict(num_gpu_blocks_override=1), 'num_gpu_blocks_override = 1'),
])
def test_cache_config_rejects(kw, msg):
    with pytest.raises(ValueError, match=msg.replace('(', r'\(')):
        CacheConfig(**kw)


def test_global_block_must_hold_whole_states():
    with pytest.raises(ValueError, match="not a multiple of KV source layer 2's compress_ratio 2"):
        get_kv_cache_config(TINY, CacheConfig(swa_block_size=3, global_block_size=9))


# ---------------------------------------------------------------- block pool: vLLM-style exact cases
def test_eviction_order_of_a_freed_prefix():
    kv = tiny_kv(40)
    req = kv.new_request('a', toks(40))                 # global: 2 full + 1 partial; SWA: tail 4..7 of checkpoint 32
    run(kv, req)
    (g, s, (ring,)) = kv.get_blocks('a').blocks
    never_used = [i for i in free_order(kv)]
    kv.free(req)
    order = free_order(kv)
    anonymous = [ring.block_id] + [s[i].block_id for i in (0, 1, 2, 3, 8, 9)] + [g[2].block_id]
    registered = [g[1].block_id, g[0].block_id] + [s[i].block_id for i in (7, 6, 5, 4)]
    assert order == anonymous + never_used + registered
    # handing blocks out: anonymous first, then never-used, then the registered prefix from its end
    n = len(anonymous) + len(never_used)
    kv.block_pool.get_new_blocks(n)
    assert kv.block_pool.get_cached_block(req.block_hashes[3], [GLOBAL]) is not None
    kv.block_pool.get_new_blocks(1)                     # evicts g[1], the prefix's last global block
    assert kv.block_pool.get_cached_block(req.block_hashes[7], [GLOBAL]) is None
    assert kv.block_pool.get_cached_block(req.block_hashes[3], [GLOBAL])[0].block_id == g[0].block_id


def test_two_blocks_sharing_a_hash():
    kv = tiny_kv(80)
    t = toks(40, 1)
    a, b = kv.new_request('a', t), kv.new_request('b', t)
    ha, na = kv.get_computed_blocks(a); hb, nb = kv.get_computed_blocks(b)   # both look up before either allocates
    assert na == nb == 0
    kv.allocate_slots(a, 40, na, ha); kv.allocate_slots(b, 40, nb, hb)
    key = (a.block_hashes[3], GLOBAL)
    both = kv.block_pool.cached_block_hash_to_block[key]
    assert isinstance(both, dict) and set(both) == {kv.get_block_ids('a')[0][0], kv.get_block_ids('b')[0][0]}
    kv.free(a)
    b_block = kv.block_pool.blocks[kv.get_block_ids('b')[0][0]]
    a_copy = [x for x in both.values() if x is not b_block][0]
    kv.block_pool._maybe_evict_cached_block(a_copy)      # a's copy is repurposed
    assert kv.block_pool.cached_block_hash_to_block[key] is b_block
    c = kv.new_request('c', t + [1, 2, 3])
    hit, n = kv.get_computed_blocks(c)
    assert n == 32 and hit.blocks[GLOBAL][0] is b_block


def test_failed_allocation_has_no_side_effect():
    kv = tiny_kv(24)
    a = kv.new_request('a', toks(40, 2)); run(kv, a)
    b = kv.new_request('b', toks(40, 2) + toks(60, 3))  # a hit on a's blocks, then far too much
    hit, n = kv.get_computed_blocks(b)
    assert n == 32
    before = cache_snapshot(kv)
    assert kv.allocate_slots(b, b.num_tokens - n, n, hit) is None
    assert cache_snapshot(kv) == before
    # a running request whose growth does not fit, even counting the SWA blocks its skip would release
    a.num_computed_tokens = 40
    before = cache_snapshot(kv)
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=200) is None
    assert cache_snapshot(kv) == before                         # the skippable SWA blocks were NOT released
    assert sum(not x.is_null for x in kv.get_blocks('a').blocks[SWA]) == 10


def test_growth_that_fits_only_thanks_to_released_window_blocks():
    kv = tiny_kv(16)                                      # 15 usable: a holds 3 + 10 + 1 = 14
    a = kv.new_request('a', toks(40, 4)); run(kv, a)
    assert kv.num_free_blocks == 1
    a.append_output_token_ids(5)
    # 48 slots: 2 new SWA blocks, 1 free; the skip frees 6 (blocks 0..5)
    got = kv.allocate_slots(a, 1, num_lookahead_tokens=7)
    assert got is not None and got.num_blocks == (0, 2, 0)
    assert [x.is_null for x in kv.get_blocks('a').blocks[SWA]] == [True] * 6 + [False] * 6


def test_window_release_feeds_the_other_groups():
    "A global block that only the window release makes room for: the release comes before every group allocates"
    kv = tiny_kv(17)                                      # 16 usable: a 48-token prompt holds 3 + 12 + 1 = 16
    a = kv.new_request('a', toks(48, 15)); run(kv, a)
    assert kv.num_free_blocks == 0
    a.append_output_token_ids(3)
    # 49 slots: a 4th global and a 13th SWA block; the skip frees 8
    got = kv.allocate_slots(a, 1)
    assert got is not None and got.num_blocks == (1, 1, 0)
    assert sum(x.is_null for x in kv.get_blocks('a').blocks[SWA]) == 8 and kv.num_free_blocks == 6


def test_cached_blocks_survive_while_other_free_blocks_exist():
    kv = tiny_kv(60)
    a = kv.new_request('a', toks(40, 5)); run(kv, a); kv.free(a)
    registered = [k for k in kv.block_pool.cached_block_hash_to_block]
    anonymous = sum(1 for x in kv.block_pool.free_block_queue.get_all_free_blocks() if x.block_hash is None)
    kv.block_pool.get_new_blocks(anonymous)               # everything that is not a cached prefix
    assert sorted(kv.block_pool.cached_block_hash_to_block) == sorted(registered)
    kv.block_pool.get_new_blocks(1)
    assert len(kv.block_pool.cached_block_hash_to_block) == len(registered) - 1


def test_claimed_hit_blocks_cannot_be_evicted():
    kv = tiny_kv(30)
    t = toks(40, 6)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)
    b = kv.new_request('b', t + [1])
    hit, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, n, hit) is not None
    claimed = [x for g in hit.blocks for x in g if not x.is_null]
    c = kv.new_request('c', toks(300, 7))
    while c.num_computed_tokens < c.num_tokens and kv.allocate_slots(c, 4) is not None:
        c.num_computed_tokens += 4
    assert c.num_computed_tokens < c.num_tokens           # the pool ran dry ...
    assert all(x.ref_cnt == 1 and x.block_hash is not None for x in claimed)   # ... without touching b's prefix


def test_lookahead_slots_take_ceil_blocks():
    kv = tiny_kv(64)
    a = kv.new_request('a', toks(10, 8))
    got = kv.allocate_slots(a, 10, num_lookahead_tokens=7)   # 17 slots
    assert got.num_blocks == (cdiv(17, 16), cdiv(17, 4), 1)


# ---------------------------------------------------------------- hybrid hits
def test_roccos_worked_example():
    "Global through 32,768, SWA only through 24,576 -> resume at 24,576; then 256 + 8, 4 + 32, 1 blocks"
    t = toks(50_000, 9, FULL.vocab_size)
    for interval, expect in ((0, 24_576), (8192, 32_768)):
        kv = KVCacheManager(get_kv_cache_config(FULL, CacheConfig(num_gpu_blocks_override=4000,
                                                                  prefix_cache_retention_interval=interval)))
        t1 = kv.new_request('t1', t[:24_600]); run(kv, t1, 4096)
        for tok in t[24_600:32_800]:                      # decode: each sampled token computed in the next step
            t1.append_output_token_ids(tok)
            if t1.num_tokens < 32_800:
                assert kv.allocate_slots(t1, 1) is not None; t1.num_computed_tokens += 1
        kv.free(t1)
        rocco = kv.new_request('rocco', t)
        g = kv.managers[GLOBAL].find_longest_cache_hit(rocco.block_hashes, rocco.num_tokens - 1)
        assert len(g) * 128 == 32_768
        hit, n = kv.get_computed_blocks(rocco)
        assert n == expect
        if interval:
            asked = [m.get_num_blocks_to_allocate('rocco', n + 1024, h) for m, h in zip(kv.managers, hit.blocks)]
            assert asked == [256 + 8, 4 + 32, 1]
            new = kv.allocate_slots(rocco, 1024, n, hit)
            assert new.num_blocks == (8, 32, 1)
            assert [len(x) for x in kv.get_block_ids('rocco')] == [264, 1056, 1]


def hybrid_setup():
    kv = tiny_kv(120, prefix_cache_retention_interval=16)   # a checkpoint every 16 tokens: every SWA block is in a tail
    t = toks(100, 10)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)
    return kv, a, kv.new_request('b', t + toks(20, 11))


def evict(kv, req, group, index, stride):
    b = kv.block_pool.get_cached_block(req.block_hashes[(index + 1) * stride - 1], [group])[0]
    assert kv.block_pool._maybe_evict_cached_block(b)


def test_hybrid_hit_lengths():
    kv, a, b = hybrid_setup()
    assert kv.get_computed_blocks(b)[1] == 96
    evict(kv, a, SWA, 0, 1)                               # out of the window of 96: the hit stays
    assert kv.get_computed_blocks(b)[1] == 96
    evict(kv, a, SWA, 22, 1)                              # inside the window before 96 (tokens 88..91)
    assert kv.get_computed_blocks(b)[1] == 80
    kv, a, b = hybrid_setup()
    evict(kv, a, GLOBAL, 5, 4)                            # the last global block (80..95)
    assert kv.get_computed_blocks(b)[1] == 80
    evict(kv, a, GLOBAL, 0, 4)                            # the first global block: a miss
    assert kv.get_computed_blocks(b)[1] == 0


def test_full_prompt_hit_recomputes_last_token():
    kv = tiny_kv(80, prefix_cache_retention_interval=16)  # checkpoints at 16, 32 and 48: all 48 tokens are cached
    t = toks(48, 12)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)
    assert kv.get_computed_blocks(kv.new_request('b', t + [1]))[1] == 48
    assert kv.get_computed_blocks(kv.new_request('c', t))[1] == 32   # the same prompt: 47 floors to 32, never 48


def test_lcm_flooring():
    cc = CacheConfig(swa_block_size=32, global_block_size=48, num_gpu_blocks_override=200)   # lcm 96, gcd 16
    kv = KVCacheManager(get_kv_cache_config(FULL, cc))
    assert (kv.kv_cache_config.hash_block_size, kv.kv_cache_config.resume_alignment) == (16, 96)
    t = toks(150, 13, FULL.vocab_size)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)    # 3 full global blocks (144 tokens), SWA checkpoint at 96
    b = kv.new_request('b', t + toks(50, 14, FULL.vocab_size))
    assert len(kv.managers[GLOBAL].find_longest_cache_hit(b.block_hashes, b.num_tokens - 1)) == 2   # 144 -> 96
    assert kv.get_computed_blocks(b)[1] == 96


def test_ring_state_is_never_cached():
    kv = tiny_kv(80, events=True)
    for i in range(3):
        r = kv.new_request(f'r{i}', toks(45, 20))
        run(kv, r)
        ring = kv.get_blocks(r.request_id).blocks[RING][0]
        assert ring.block_hash is None
        kv.free(r)
        assert free_order(kv)[0] == ring.block_id          # anonymous: first in line for reuse
        hit, n = kv.get_computed_blocks(kv.new_request('x', toks(45, 20)))
        assert hit.blocks[RING] == [] and n == 32
    assert all(k[1] != RING for k in kv.block_pool.cached_block_hash_to_block)
    assert all(e.group_id != RING for e in kv.take_events() if not isinstance(e, AllBlocksCleared))


def test_coordinator_agrees_with_brute_force():
    @settings(max_examples=examples(150), deadline=None)
    @given(st.data())
    def check(data):
        sizes = data.draw(st.sampled_from([(4, 16), (4, 8), (8, 8), (2, 16)]))
        kc = get_kv_cache_config(TINY,
                                 CacheConfig(swa_block_size=sizes[0], global_block_size=sizes[1],
                                             num_gpu_blocks_override=300))
        pool = BlockPool(kc.num_blocks); coord = KVCacheCoordinator(kc, pool)
        n = data.draw(st.integers(1, 120))
        req = Request('r', list(range(n)), RequestBlockHasher(kc.hash_block_size, TINY.vocab_size))
        for m in coord.managers[:2]:
            blocks = pool.get_new_blocks(max(1, n // m.block_size))
            keep = [i for i in range(n // m.block_size) if data.draw(st.booleans())]
            pool.cache_full_blocks(req, blocks, keep, m.block_size, m.hash_stride, m.group_id)
        limit = data.draw(st.integers(0, n))
        (g, s, _), L = coord.find_longest_cache_hit(req.block_hashes, limit)
        gm, sm = coord.managers[:2]
        assert L == reference_longest_hit(coord, req.block_hashes, limit)
        assert len(g) * gm.block_size == L and len(s) * sm.block_size == L
        assert all(not b.is_null for b in g)
        assert all(not b.is_null for b in s[max(0, len(s) - sm.tail_blocks):])
        for m in (gm, sm):                                 # each manager alone stays within the limit
            assert len(m.find_longest_cache_hit(req.block_hashes, limit)) * m.block_size <= limit
    check()


# ---------------------------------------------------------------- slot mappings
def test_batch_slot_mappings_against_reference():
    kv = tiny_kv(120)
    reqs = [kv.new_request(f'r{i}', toks(n, 30 + i)) for i, n in enumerate((37, 5, 64))]
    sched = []
    for r in reqs:
        kv.allocate_slots(r, r.num_tokens); sched.append((r.request_id, 0, r.num_tokens))
    sm = kv.slot_mappings(sched)
    exp_swa, exp_c2, exp_c1, exp_ring = [], [], [], []
    for r in reqs:
        g, s, (ring,) = kv.get_block_ids(r.request_id); pos = range(r.num_tokens)
        exp_swa += reference_slot_mapping(s, pos, 4)
        exp_c2 += reference_slot_mapping(g, pos, 16, 2)
        exp_c1 += reference_slot_mapping(g, pos, 16, 1)
        exp_ring += ring_slot_mapping(ring, pos, 2).tolist()
    assert sm.swa.tolist() == exp_swa and sm.compressed[2].tolist() == exp_c2 and sm.compressed[1].tolist() == exp_c1
    assert sm.ring.tolist() == exp_ring
    bt = kv.block_table([r.request_id for r in reqs], SWA)
    assert bt.shape == (3, 16) and bt.dtype == torch.int32 and bt[1, 2:].eq(0).all()
    as_numpy = [(rid, np.int64(a), np.int32(n)) for rid, a, n in sched]   # a scheduler keeping positions in arrays
    assert kv.slot_mappings(as_numpy).swa.tolist() == exp_swa


def test_slot_mapping_refuses_released_blocks():
    kv = tiny_kv(64)
    a = kv.new_request('a', toks(40, 40)); run(kv, a)
    a.append_output_token_ids(1); kv.allocate_slots(a, 1)   # releases SWA blocks 0..5
    with pytest.raises(ValueError, match='null'):
        kv.slot_mappings([('a', 0, 4)])
    assert kv.slot_mappings([('a', 40, 1)]).swa.numel() == 1


# ---------------------------------------------------------------- bad input, events, reset
def test_request_that_can_never_fit_is_refused_at_admission():
    kv = tiny_kv(20)
    before = cache_snapshot(kv)
    with pytest.raises(CacheCapacityError,
                       match=r"request 'big' can never fit: at 400 tokens it needs 31 blocks "
                             r"\(global 25 \+ swa 5 \+ compressor 1\) but the pool has only 19"):
        kv.allocate_slots(kv.new_request('big', toks(400)), 8)
    with pytest.raises(CacheCapacityError):
        kv.allocate_slots(kv.new_request('greedy', toks(50), max_tokens=350), 8)
    assert cache_snapshot(kv) == before


def test_double_free():
    kv = tiny_kv(40)
    a = kv.new_request('a', toks(20)); run(kv, a); kv.free(a)
    before = cache_snapshot(kv)
    with pytest.raises(ValueError, match="request 'a' holds no KV blocks: freed twice"):
        kv.free(a)
    kv.free(a, missing_ok=True)
    with pytest.raises(ValueError, match='freed twice'):
        kv.block_pool.free_blocks([kv.block_pool.blocks[1]])
    assert cache_snapshot(kv) == before


def test_events_and_reset():
    kv = tiny_kv(60, events=True)
    seen = []
    kv.subscribe(seen.append)
    a = kv.new_request('a', toks(40, 50)); run(kv, a)
    assert [(type(e), e.group_id, len(e.block_hashes)) for e in seen] == [(BlockStored, GLOBAL, 2),
                                                                          (BlockStored, SWA, 4)]
    assert seen[0].token_ids == tuple(a.all_token_ids[:32]) and seen[0].parent_block_hash is None
    assert seen[1].parent_block_hash == a.block_hashes[3] and seen[1].token_ids == tuple(a.all_token_ids[16:32])
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True and seen[-1] == AllBlocksCleared()
    assert kv.take_events() == seen
    assert kv.get_computed_blocks(kv.new_request('b', toks(40, 50)))[1] == 0


def test_prefix_caching_disabled():
    kv = tiny_kv(60, enable_prefix_caching=False)
    t = toks(40, 60)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)
    assert kv.block_pool.cached_block_hash_to_block == {} and a.block_hashes == []
    assert kv.get_computed_blocks(kv.new_request('b', t))[1] == 0
    assert kv.num_free_blocks == 59


def test_duplicate_request_id():
    """A second request under a live id used to be accepted; allocate_slots then grew the first's
    tables and free blamed a double free"""
    kv = tiny_kv(60)
    a = kv.new_request('a', toks(20)); run(kv, a)
    twin = Request('a', toks(30, 1), kv.block_hasher)                 # made directly, past new_request's check
    before = cache_snapshot(kv)
    fct.test_fail(lambda: kv.new_request('a', toks(5)), exc=ValueError,
                  contains="request id 'a' is already live in this cache")
    fct.test_fail(lambda: kv.allocate_slots(twin, 30), exc=ValueError,
                  contains="request id 'a' belongs to another live request")
    fct.test_fail(lambda: kv.free(twin), exc=ValueError, contains="request id 'a' belongs to another live request")
    assert cache_snapshot(kv) == before
    kv.free(a)
    assert kv.allocate_slots(twin, 30) is not None and kv.live_requests == {'a'}   # the id is free again
    kv.free(twin)
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


def test_block_table_refuses_what_it_cannot_draw():
    "block_table(['nope'], 0) used to return a row of null blocks; a narrow width silently cut tables"
    kv = tiny_kv(60)
    a = kv.new_request('a', toks(40)); run(kv, a)
    fct.test_fail(lambda: kv.block_table(['nope'], 0), exc=ValueError,
                  contains="block_table: request 'nope' holds no KV blocks")
    fct.test_fail(lambda: kv.block_table(['a'], 1, width=3), exc=ValueError,
                  contains='width = 3 is narrower than the longest table (10 blocks)')
    assert kv.block_table(['a'], 1, width=12)[0].tolist() == kv.get_block_ids('a')[1] + [0, 0]


def test_bad_input():
    kv = tiny_kv(20)
    ok = kv.new_request('ok', toks(40, 2)); kv.allocate_slots(ok, 40)
    before = cache_snapshot(kv)
    for f, exc, msg in [
            (lambda: CacheConfig(swa_block_size=0), ValueError, 'swa_block_size = 0; expected a positive integer'),
            (lambda: CacheConfig(global_block_size=0), ValueError,
             'global_block_size = 0; expected a positive integer'),
            (lambda: CacheConfig(swa_block_size=2.5), ValueError, 'swa_block_size = 2.5; expected a positive integer'),
            (lambda: CacheConfig(index_key_format='mxfp4'), ValueError,
             "index_key_format = 'mxfp4'; expected one of ('index_mxfp4', 'index_fp8')"),
            (lambda: CacheConfig(kv_cache_memory_bytes=-1), ValueError, 'kv_cache_memory_bytes = -1'),
            (lambda: CacheConfig.for_model('tiny'), TypeError, 'expected a ModelConfig'),
            (lambda: get_kv_cache_config(TINY, dict(swa_block_size=4)), TypeError, 'cc must be a CacheConfig'),
            (lambda: get_kv_cache_config(TINY, CacheConfig(kv_cache_memory_bytes=100)), ValueError,
             'the pool needs at least 2'),
            (lambda: KVCacheManager(CacheConfig()), TypeError, 'expected a KVCacheConfig'),
            (lambda: kv.new_request('e', None), TypeError,
             'prompt_token_ids must be a sequence of token ids, got NoneType'),
            (lambda: kv.new_request('x', [1, 2, 512]), ValueError,
             'token id 512 at position 2 is outside the vocabulary'),
            (lambda: kv.new_request('ok', [1]), ValueError, "request id 'ok' is already live"),
            (lambda: kv.allocate_slots('ok', 1), TypeError, 'expected a Request, got str'),
            (lambda: kv.allocate_slots(ok, 0), ValueError,
             'num_new_tokens = 0, num_lookahead_tokens = 0; expected >= 1 and >= 0'),
            (lambda: kv.allocate_slots(ok, 1, num_lookahead_tokens=-1), ValueError, 'num_lookahead_tokens = -1'),
            (lambda: kv.allocate_slots(ok, 1, num_new_computed_tokens=-16), ValueError,
             'num_new_computed_tokens = -16'),
            (lambda: kv.allocate_slots(ok, 1 << 20), ValueError, 'exceed max_model_len'),
            (lambda: kv.allocate_slots(kv.new_request('big', toks(400)), 8), CacheCapacityError,
             "request 'big' can never fit"),
            (lambda: kv.free(kv.new_request('never', [1])), ValueError, "request 'never' holds no KV blocks"),
            (lambda: kv.block_table('ok', 0), TypeError, 'request_ids must be a sequence of ids'),
            (lambda: kv.block_table(['ok'], 3), ValueError, 'group_id = 3; expected 0..2'),
            (lambda: kv.block_table(['nope'], 0), ValueError, "request 'nope' holds no KV blocks"),
            (lambda: kv.slot_mappings([('nope', 0, 1)]), ValueError,
             "slot_mappings: request 'nope' holds no KV blocks"),
            (lambda: kv.slot_mappings([('ok', -1, 2)]), ValueError, 'scheduled at position -1 for 2 tokens'),
            (lambda: kv.slot_mappings([('ok', True, 2)]), ValueError, 'scheduled at position True for 2 tokens'),
            (lambda: kv.slot_mappings([('ok', 0, 2.0)]), ValueError, 'for 2.0 tokens; expected integers >= 0'),
            (lambda: kv.slot_mappings([('ok', 0, 41)]), ValueError, 'need 11 blocks but the table has 10')]:
        fct.test_fail(f, exc=exc, contains=msg)
    assert cache_snapshot(kv) == before


# ---------------------------------------------------------------- the window's edges, by brute force
def swa_manager(swa=4, interval=0, blocks=400):
    "The SWA manager of a tiny-config coordinator (window 16) with window blocks of `swa` tokens"
    kc = get_kv_cache_config(TINY, CacheConfig(swa_block_size=swa, global_block_size=4 * swa,
                                               num_gpu_blocks_override=blocks,
                                               prefix_cache_retention_interval=interval))
    pool = BlockPool(kc.num_blocks)
    return KVCacheCoordinator(kc, pool).managers[SWA], pool


def test_skipped_tokens_are_those_no_later_query_sees():
    m, _ = swa_manager()
    for c in range(0, 3 * m.window):
        # the query at position q >= c sees keys q - window + 1 .. q
        unseen = sum(1 for t in range(c) if all(t < q - m.window + 1 for q in range(c, c + 2 * m.window)))
        assert m.num_skipped_tokens(c) == unseen, c


@pytest.mark.parametrize('swa', [1, 2, 3, 4, 5, 8, 16])
def test_window_release_against_brute_force(swa):
    "After every step the released blocks are exactly those wholly behind the window, counted first"
    m, pool = swa_manager(swa)
    r = random.Random(swa)
    for trial in range(6):
        rid, n, c = f'r{trial}', r.randrange(1, 120), 0
        m.allocate_new_blocks(rid, n)
        blocks = m.req_to_blocks[rid]
        shared = [b for b in blocks if r.random() < 0.3]
        pool.touch(shared)                                 # held by a second request too
        while c < n:
            c = min(n, c + r.choice([1, 1, 2, 3, swa, 2 * swa, 17]))
            was_null = [b.is_null for b in blocks]
            held = list(blocks)
            free_before = pool.get_num_free_blocks()
            gone = [j for j in range(len(blocks)) if (j + 1) * swa <= max(0, c - m.window + 1)]
            new = [j for j in gone if not was_null[j]]
            want = sum(1 for j in new if held[j].ref_cnt == 1)
            assert m.get_num_blocks_freed_by_skip(rid, c) == want, (trial, c)
            m.remove_skipped_blocks(rid, c)
            assert [j for j, b in enumerate(blocks) if b.is_null] == gone, (trial, c)
            assert pool.get_num_free_blocks() - free_before == want
            assert all(held[j].ref_cnt == 1 for j in new if held[j] in shared)
        m.free(rid)
        pool.free_blocks(shared)
        assert pool.get_num_free_blocks() == pool.num_usable_blocks


def brute_checkpoints(m, num_prompt_tokens, lo, hi):
    k, a = m.retention_interval, m.alignment
    return [p for p in range(lo + 1, hi + 1)
            if (k and p % k == 0) or p == (num_prompt_tokens - 1) // a * a]


@pytest.mark.parametrize('swa,interval', [(4, 0), (4, 16), (4, 48), (2, 8), (8, 32)])
def test_checkpoints_against_brute_force(swa, interval):
    m, _ = swa_manager(swa, interval)
    r = random.Random(interval)
    for _ in range(200):
        P = r.randrange(1, 100)
        req = Request('x', list(range(P)))
        lo = r.randrange(0, 110); hi = r.randrange(lo, 120)
        assert m.checkpoints(req, lo, hi) == brute_checkpoints(m, P, lo, hi), (P, lo, hi)


@pytest.mark.parametrize('swa,interval', [(4, 0), (4, 16), (2, 8), (8, 32), (1, 4), (1, 0), (3, 0), (5, 0)])
def test_checkpoint_tails_registered_as_tokens_become_known(swa, interval):
    "After each call, the window-sized tail before every checkpoint reached is registered, and nothing else"
    m, pool = swa_manager(swa, interval)
    r = random.Random(swa * 100 + interval)
    for trial, P in enumerate(range(1, 70)):
        n = P + r.randrange(0, 40)
        t = toks(n, trial)
        req = Request(f'r{trial}', t[:P], RequestBlockHasher(m.hash_block_size, TINY.vocab_size))
        if n > P: req.append_output_token_ids(t[P:])
        m.allocate_new_blocks(req.request_id, n)
        blocks, known = m.req_to_blocks[req.request_id], 0
        while known < n:
            known = min(n, known + r.choice([1, 2, swa, 3 * swa, 13]))
            m.cache_blocks(req, known)
            hi = min(known, len(blocks) * swa)
            want = set()
            for p in brute_checkpoints(m, P, 0, hi):      # the blocks holding keys p - window + 1 .. p - 1
                want |= {j for j in range(p // swa) if (j + 1) * swa > p - m.window + 1}
            got = {j for j, b in enumerate(blocks) if b.block_hash is not None}
            assert got == want, (trial, P, known)
        m.free(req.request_id)
        pool.reset_prefix_cache()


def test_cache_config_edges_are_accepted():
    assert get_kv_cache_config(TINY, CacheConfig.for_model(TINY, num_gpu_blocks_override=2)).num_usable_blocks == 1
    assert CacheConfig(swa_block_size=64, global_block_size=256, max_resume_alignment=256).resume_alignment == 256
    with pytest.raises(ValueError, match='lcm = 256 tokens > max_resume_alignment = 255'):
        CacheConfig(swa_block_size=64, global_block_size=256, max_resume_alignment=255)
    page = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, num_gpu_blocks_override=9)).page_bytes
    assert get_kv_cache_config(TINY, CacheConfig.for_model(TINY, kv_cache_memory_bytes=2 * page)).num_blocks == 2
    with pytest.raises(ValueError, match='holds 1 page'):
        get_kv_cache_config(TINY, CacheConfig.for_model(TINY, kv_cache_memory_bytes=2 * page - 1))
    assert FULL.window_size == 128 and CacheConfig.for_model(FULL).max_model_len == CacheConfig().max_model_len


# ---------------------------------------------------------------- the manager's switches and counters
def test_skip_prefix_cache_and_delayed_registration():
    kv = tiny_kv(80)
    t = toks(40, 70)
    a = kv.new_request('a', t)
    assert kv.allocate_slots(a, 40, delay_cache_blocks=True) is not None
    assert kv.block_pool.cached_block_hash_to_block == {}          # delayed: nothing registered yet
    kv.free(a)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)
    b = kv.new_request('b', t + [1], skip_prefix_cache=True)
    assert kv.get_computed_blocks(b)[1] == 0                       # its prefix is cached, but not for b
    assert kv.get_computed_blocks(kv.new_request('c', t + [1]))[1] == 32


def test_prefix_cache_stats_count_every_lookup():
    kv = tiny_kv(80)
    t = toks(40, 71)
    a = kv.new_request('a', t); run(kv, a); kv.free(a)
    lookups = [kv.get_computed_blocks(kv.new_request(f'q{n}', t[:n])) for n in (1, 17, 33, 40)]
    s = kv.prefix_cache_stats
    assert (s.requests, s.queries) == (1 + 4, 39 + 0 + 16 + 32 + 39)
    assert s.hits == sum(n for _, n in lookups) == 0 + 0 + 32 + 32      # resumes at the checkpoint 32


def test_a_request_needing_every_usable_block_is_admitted():
    kv = tiny_kv(16)                                               # 15 usable blocks
    n = 48
    while sum(kv.min_blocks(n + 1)) <= 15: n += 1
    assert sum(kv.min_blocks(n)) == 15
    a = kv.new_request('a', toks(n, 72))
    assert run(kv, a, chunk=1) == 0                                # one token a step: it fits
    b = kv.new_request('b', toks(n + 1, 73))
    fct.test_fail(lambda: kv.allocate_slots(b, 1), exc=CacheCapacityError, contains="request 'b' can never fit")
