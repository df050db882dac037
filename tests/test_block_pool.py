"Exact cases for block_pool and prefix_cache: prefix hashes, the pool's eviction rules, slot arithmetic, and bad input"
import os, random, subprocess, sys
import numpy as np
import pytest
import torch
import fastcore.test as fct
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.config import ModelConfig
from dsv41_nb.block_pool import (BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, slot_mapping, compressed_slot_mapping,
                                 compressed_state_slots, ring_slot_mapping, reference_slot_mapping, PAD_SLOT_ID)
from dsv41_nb.prefix_cache import (Request, RequestBlockHasher, ImageSpan, BlockStored, BlockRemoved, check_token_ids,
                                   hash_block_tokens, reference_block_hash, pool_snapshot)

FULL = ModelConfig.full()


def toks(n, seed=0, vocab=FULL.vocab_size):
    r = random.Random(seed)
    return [r.randrange(vocab) for _ in range(n)]


# ---------------------------------------------------------------- hashing
def test_hash_chain_matches_independent_serialisation():
    t = toks(200)
    req = Request('r', t, RequestBlockHasher(32, FULL.vocab_size), cache_salt='salt',
                  mm_features=[ImageSpan(70, 10, 'imgA')])
    parent = None
    for i in range(6):
        extra = (['imgA'] if i == 2 else []) + (['salt'] if i == 0 else [])
        parent = reference_block_hash(parent, t[32 * i:32 * (i + 1)], extra)
        assert req.block_hashes[i] == parent
    assert len(req.block_hashes) == 200 // 32


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 2 ** 32 - 1), max_size=40),
       st.lists(st.one_of(st.text(max_size=8), st.binary(max_size=8),
                          st.integers(-2 ** 63, 2 ** 63 - 1)), max_size=3))
def test_hash_block_tokens_matches_reference(tokens, extra):
    parent = reference_block_hash(None, [7])
    assert hash_block_tokens(parent, tokens, extra) == reference_block_hash(parent, tokens, extra)
    assert hash_block_tokens(None, np.asarray(tokens, dtype=np.int64)) == reference_block_hash(None, tokens)


def test_hashes_are_the_same_in_another_process():
    code = ("from dsv41_nb.prefix_cache import Request, RequestBlockHasher; "
            "print(Request('r', list(range(1000, 1300)), RequestBlockHasher(32, 129280)).block_hashes[-1].hex())")
    outs = {subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                           env={**os.environ, 'PYTHONHASHSEED': seed}).stdout.strip() for seed in ('1', '2')}
    here = Request('r', list(range(1000, 1300)), RequestBlockHasher(32, 129280)).block_hashes[-1].hex()
    assert outs == {here}


@pytest.mark.parametrize('bad,pos', [(129280, 5), (-1, 5), (10 ** 12, 5)])
def test_token_outside_vocabulary(bad, pos):
    t = list(range(40)); t[pos] = bad
    with pytest.raises(ValueError, match=f'token id {bad} at position {pos} is outside the vocabulary'):
        Request('r', t, RequestBlockHasher(32, FULL.vocab_size))
    with pytest.raises(ValueError, match=f'token id {bad} at position {pos}'):
        hash_block_tokens(None, t[:32], vocab_size=FULL.vocab_size)
    req = Request('r', list(range(40)), RequestBlockHasher(32, FULL.vocab_size))
    with pytest.raises(ValueError, match=f'token id {bad} at position 40'):
        req.append_output_token_ids(bad)
    with pytest.raises(ValueError, match=f'token id {bad} at position 41'):
        req.append_output_token_ids([1, bad])
    assert req.num_tokens == 40 and len(req.block_hashes) == 1           # nothing stored


def test_incremental_hashing_equals_bulk():
    t = toks(300, 3, vocab=512)
    h = RequestBlockHasher(4, 512)
    bulk, grown = Request('a', t, h), Request('b', t[:7], h)
    for i in range(7, 300, 5): grown.append_output_token_ids(t[i:i + 5])
    assert grown.block_hashes == bulk.block_hashes


def test_check_token_ids_is_the_same_for_every_input_kind():
    """Valid ids in a tensor are valid; the message does not depend on the input's length or kind;
    non-integers are type errors"""
    # was reported as 'token id tensor(1) ... outside'
    check_token_ids(torch.tensor([1, 2]), 100)
    check_token_ids(np.arange(99), 100); check_token_ids(range(5), 100)
    short, long_ = [1, 100], [1] * 39 + [100]
    for ids, pos in ((short, 1), (long_, 39), (torch.tensor(short), 1), (np.asarray(long_), 39)):
        fct.test_fail(check_token_ids, args=[ids, 100], exc=ValueError,
                  contains=f'token id 100 at position {pos} is outside the vocabulary: '
                           'expected 0 <= id < vocab_size = 100')
    for ids, what in ((['a'], "token id 'a' at position 0 has type str"),
                      ([1.5], 'token id 1.5 at position 0 has type float'),
                      ([1] * 20 + ['a'], "token id 'a' at position 20 has type str"),
                      (torch.tensor([1.0]), 'dtype torch.float32'),
                      (None, 'got NoneType'), ('abc', 'got str')):
        fct.test_fail(check_token_ids, args=[ids, 100], exc=TypeError, contains=what)


# ---------------------------------------------------------------- the pool
def test_free_queue_against_a_list():
    rng = random.Random(1)
    blocks = [KVCacheBlock(i) for i in range(40)]
    fast, ref = FreeKVCacheBlockQueue(blocks), list(range(40))
    for _ in range(3000):
        op = rng.choice(['popleft', 'remove', 'append', 'prepend', 'popleft_n'])
        out = sorted(set(range(40)) - set(ref))
        if op == 'popleft' and ref: assert fast.popleft().block_id == ref.pop(0)
        elif op == 'popleft_n':
            k = rng.randint(0, min(4, len(ref)))
            assert [b.block_id for b in fast.popleft_n(k)] == [ref.pop(0) for _ in range(k)]
        elif op == 'remove' and ref: i = rng.choice(ref); fast.remove(blocks[i]); ref.remove(i)
        elif op == 'append' and out: i = rng.choice(out); fast.append(blocks[i]); ref.append(i)
        elif op == 'prepend' and out: i = rng.choice(out); fast.prepend(blocks[i]); ref.insert(0, i)
        assert [b.block_id for b in fast.get_all_free_blocks()] == ref and len(fast) == len(ref)


def test_partial_block_is_reused_first():
    pool = BlockPool(10)
    req = Request('a', list(range(10)), RequestBlockHasher(4, 100))
    blocks = pool.get_new_blocks(3)                     # 4 + 4 + 2 tokens
    pool.cache_full_blocks(req, blocks, range(2), 4, 1, 0)
    pool.free_blocks(reversed(blocks))
    assert pool.get_new_blocks(1)[0] is blocks[2]        # the partial, unregistered block comes back first


def test_hash_is_dropped_when_a_block_is_reused():
    pool = BlockPool(4, enable_kv_cache_events=True)
    req = Request('a', list(range(8)), RequestBlockHasher(4, 100))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, range(2), 4, 1, 0)
    assert [type(e) for e in pool.take_events()] == [BlockStored]
    pool.free_blocks(reversed(blocks))
    got = pool.get_new_blocks(3)                         # the never-used block, then blocks[1], then blocks[0]
    assert [b.block_id for b in got] == [3, blocks[1].block_id, blocks[0].block_id]
    assert all(b.block_hash is None and b.ref_cnt == 1 for b in got)
    assert pool.cached_block_hash_to_block == {}
    assert pool.take_events() == [BlockRemoved((req.block_hashes[1],), 0), BlockRemoved((req.block_hashes[0],), 0)]


def test_stored_events_split_into_runs():
    pool, seen = BlockPool(12), []
    pool.subscribe(seen.append)
    req = Request('a', list(range(40)), RequestBlockHasher(4, 100))
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, blocks, [0, 1, 3, 4], 8, 2, 0)          # 8-token blocks over 4-token hashes
    assert [e.block_hashes for e in seen] == [(req.block_hashes[1], req.block_hashes[3]),
                                              (req.block_hashes[7], req.block_hashes[9])]
    assert [e.parent_block_hash for e in seen] == [None, req.block_hashes[5]]
    assert [e.token_ids for e in seen] == [tuple(range(16)), tuple(range(24, 40))]


# ---------------------------------------------------------------- slot arithmetic
@settings(max_examples=examples(100), deadline=None)
@given(st.data())
def test_slot_mappings_match_definition(data):
    bs = data.draw(st.sampled_from([4, 16, 32, 128]))
    nb = data.draw(st.integers(1, 20))
    ids = data.draw(st.lists(st.integers(1, 10_000), min_size=nb, max_size=nb, unique=True))
    pos = data.draw(st.lists(st.integers(0, nb * bs - 1), min_size=0, max_size=50))
    assert slot_mapping(ids, pos, bs).tolist() == reference_slot_mapping(ids, pos, bs)
    for r in (1, 2):
        assert compressed_slot_mapping(ids, pos, bs, r).tolist() == reference_slot_mapping(ids, pos, bs, r)
    states = [p // 2 for p in pos] + [-1]
    assert compressed_state_slots(ids, states, bs, 2).tolist()[-1] == PAD_SLOT_ID
    assert ring_slot_mapping(ids[0], pos, 2).tolist() == [ids[0] * 2 + p % 2 for p in pos]


def test_negative_positions_do_not_wrap():
    "slot_mapping([1, 2], [-1], 16) used to index the table from its end and answer 47, a real slot of block 2"
    for f, args in ((slot_mapping, ([1, 2], [-1], 16)), (compressed_slot_mapping, ([1, 2], [-3], 16, 2)),
                    (ring_slot_mapping, (1, [-1], 2))):
        fct.test_fail(f, args=args, exc=ValueError, contains='positions contains -')


# ---------------------------------------------------------------- bad input, one table
def test_bad_input():
    pool = BlockPool(6)
    req = Request('a', list(range(14)), RequestBlockHasher(4, 100))
    held = pool.get_new_blocks(2); pool.cache_full_blocks(req, held, [0], 4, 1, 0)
    before = pool_snapshot(pool)
    for f, exc, msg in [
            (lambda: BlockPool(1), ValueError, 'num_blocks = 1; the pool needs the null block plus at least one more'),
            (lambda: BlockPool(True), ValueError, 'num_blocks = True'),
            (lambda: pool.get_new_blocks(-1), ValueError, 'num_blocks = -1; expected an integer >= 0'),
            (lambda: pool.get_new_blocks(1.0), ValueError, 'num_blocks = 1.0; expected an integer >= 0'),
            (lambda: pool.get_new_blocks(9), ValueError, 'cannot get 9 free blocks from the pool: only 3 are free'),
            (lambda: pool.free_block_queue.popleft_n(-1), ValueError, 'n = -1; expected an integer >= 0'),
            (lambda: pool.free_blocks([pool.blocks[5]]), ValueError, 'block 5 freed with ref_cnt 0: freed twice'),
            (lambda: pool.free_block_queue.remove(held[0]), ValueError,
             f'block {held[0].block_id} is not in the free queue'),
            (lambda: pool.cache_full_blocks(req, held, [1], 4, 0, 0), ValueError,
             'hash_stride = 0; expected a positive integer'),
            (lambda: pool.cache_full_blocks(req, held, [1], 16, 4, 0), ValueError,
             "block 1 needs hash 7 but request 'a' has 3"),
            (lambda: pool.subscribe(None), TypeError, 'is not callable'),
            (lambda: hash_block_tokens(None, [-1]), ValueError,
             'token id -1 at position 0 is outside the vocabulary: expected 0 <= id < 2**32'),
            (lambda: hash_block_tokens(b'short', [1]), TypeError, 'parent_block_hash must be None or a 32-byte hash'),
            (lambda: hash_block_tokens(None, [1], 'salt'), TypeError, 'extra keys must be a sequence of keys'),
            (lambda: hash_block_tokens(None, [1], [1.5]), TypeError, 'extra key 1.5 has type float'),
            (lambda: Request('e', None), TypeError,
             "request 'e': prompt_token_ids must be a sequence of token ids, got NoneType"),
            (lambda: Request('x', []), ValueError, "request 'x': the prompt is empty"),
            (lambda: Request('x', ['a']), TypeError, "token id 'a' at position 0 has type str"),
            (lambda: Request(7, [1]), TypeError, 'request_id must be a non-empty str'),
            (lambda: Request('x', [1], max_tokens=-1), ValueError, 'max_tokens = -1'),
            (lambda: Request('x', [1], cache_salt=3), TypeError, 'cache_salt must be a str or None'),
            (lambda: ImageSpan(-1, 4, 'img'), ValueError, 'expected offset >= 0 and length >= 1'),
            (lambda: RequestBlockHasher(0, 100), ValueError, 'hash_block_size = 0; expected a positive integer'),
            (lambda: slot_mapping([1, 2], [3], 0), ValueError,
             'slot_mapping: block_size = 0; expected a positive integer'),
            (lambda: slot_mapping([1, 2], [1.5], 4), TypeError, 'positions must be integers'),
            (lambda: slot_mapping([1, 2], [[1]], 4), ValueError, 'positions must be 1-D'),
            (lambda: slot_mapping([0, 5], [3], 4), ValueError, 'table entry 0 is the null block'),
            (lambda: slot_mapping([3, 5], [9], 4), ValueError, 'needs table entry 2 but the block table has 2 entries'),
            (lambda: compressed_slot_mapping([1, 2], [3], 16, 0), ValueError, 'ratio = 0; expected a positive integer'),
            (lambda: compressed_slot_mapping([1, 2], [3], 16, 3), ValueError,
             'block_size 16 is not a multiple of ratio 3'),
            (lambda: compressed_state_slots([1, 2], [-2], 16, 2), ValueError,
             'state_indices contains -2; expected values >= -1'),
            (lambda: ring_slot_mapping(0, [3], 2), ValueError, 'ring_block_id = 0; the request has no ring block'),
            (lambda: ring_slot_mapping(3, [3], 0), ValueError, 'ratio = 0')]:
        fct.test_fail(f, exc=exc, contains=msg)
    assert pool_snapshot(pool) == before


# ---------------------------------------------------------------- edges: the last valid input, the first bad one
def test_valid_edges():
    "The smallest valid value of each argument is accepted (the bad-input table has the first invalid one)"
    pool = BlockPool(2)                                   # the null block and one more
    assert pool.get_num_free_blocks() == 1 and pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 1
    assert ImageSpan(0, 1, 'img').offset == 0             # an image at the prompt's first token
    assert RequestBlockHasher(4, 1 << 32).vocab_size == 1 << 32   # every uint32 id
    assert RequestBlockHasher(1 << 20, 100).hash_block_size == 1 << 20


def test_bad_edges():
    "Bad values that only the first or the last element of an input carries, or of a type close to a valid one"
    held = BlockPool(6)
    req = Request('a', list(range(14)), RequestBlockHasher(4, 100))      # 3 full blocks of 4: 3 hashes
    blocks = held.get_new_blocks(1)
    for f, exc, msg in [
            (lambda: slot_mapping([1, 2], torch.tensor([True]), 4), TypeError, 'positions must be integers'),
            (lambda: check_token_ids(torch.tensor([True, False]), 100), TypeError, 'torch.bool'),
            (lambda: compressed_state_slots([1, 2], [3, -2], 16, 2), ValueError, 'state_indices contains -2'),
            (lambda: slot_mapping([3, 5], [1, 9], 4), ValueError,
             'needs table entry 2 but the block table has 2 entries'),
            (lambda: check_token_ids([1, 2 ** 70], None), ValueError,
             f'token id {2 ** 70} at position 1 is outside the vocabulary'),
            (lambda: check_token_ids([1, -2 ** 70], 100), ValueError, 'at position 1 is outside the vocabulary'),
            # ids beyond int64 take Python's ints: the first bad one is still the one named
            (lambda: check_token_ids([1 << 32, 2 ** 70], None), ValueError, f'token id {1 << 32} at position 0'),
            (lambda: check_token_ids([0, 2 ** 70], None), ValueError, f'token id {2 ** 70} at position 1'),
            (lambda: held.cache_full_blocks(req, blocks, [0], 16, 4, 0), ValueError,
             "block 0 needs hash 3 but request 'a' has 3"),
            (lambda: RequestBlockHasher(4, (1 << 32) + 1), ValueError, 'vocab_size = 4294967297'),
            (lambda: RequestBlockHasher((1 << 20) + 1, 100), ValueError, 'hash_block_size = 1048577')]:
        fct.test_fail(f, exc=exc, contains=msg)
    held.free_blocks(blocks)


def test_a_block_is_hashed_by_the_token_that_fills_it():
    "One sampled token at a time: the block's hash exists as soon as its last token is appended"
    h = RequestBlockHasher(4, 100)
    r = Request('r', [1, 2, 3], h)
    for t in range(20):
        r.append_output_token_ids(t)
        assert len(r.block_hashes) == r.num_tokens // 4
    assert r.block_hashes == Request('s', [1, 2, 3] + list(range(20)), h).block_hashes


def test_tokens_appended_without_a_hasher():
    r = Request('r', [1, 2])
    r.append_output_token_ids([3, 4]); r.append_output_token_ids(np.arange(5, 30))
    r.append_output_token_ids(30); r.append_output_token_ids([])
    assert r.all_token_ids == list(range(1, 31)) and r.block_hashes == []
    hashed = Request('h', [1, 2], RequestBlockHasher(2, 100))
    hashed.append_output_token_ids([]); assert hashed.num_tokens == 2 and len(hashed.block_hashes) == 1


def test_images_enter_the_hashes_of_the_blocks_they_overlap():
    "Same tokens, different images: different hashes exactly for the blocks an image overlaps"
    h, t = RequestBlockHasher(4, 100), list(range(16))
    plain = Request('p', t, h).block_hashes
    for span, touched in ((ImageSpan(4, 4, 'x'), {1}),          # block 1 exactly
                          (ImageSpan(3, 2, 'x'), {0, 1}),       # across the boundary of 0 and 1
                          (ImageSpan(7, 1, 'x'), {1}),          # block 1's last token
                          (ImageSpan(8, 1, 'x'), {2})):         # block 2's first token
        a, b = (Request(n, t, h, mm_features=[ImageSpan(span.offset, span.length, n)]).block_hashes
                for n in ('imgA', 'imgB'))
        first = min(touched)
        assert a[:first] == b[:first] == plain[:first]          # before the image: as without it
        assert all(x != y for x, y in zip(a[first:], b[first:]))  # from it on: the chain differs
        for i in range(4):
            assert Request('q', t, h, mm_features=[span]).block_extra_keys(4 * i, 4 * i + 4) == \
                (('x',) if i in touched else ())


def test_a_block_cached_twice_stays_one_entry():
    "Registering a block that already holds its hash (a prefix hit) changes nothing"
    pool = BlockPool(6)
    req = Request('a', list(range(8)), RequestBlockHasher(4, 100))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, [0, 1], 4, 1, 0)
    before = dict(pool.cached_block_hash_to_block)
    pool.cache_full_blocks(req, blocks, [0, 1], 4, 1, 0)
    assert pool.cached_block_hash_to_block == before
    assert all(type(v) is KVCacheBlock for v in pool.cached_block_hash_to_block.values())
