"""The walk helpers of 02d_kv_walk: they play the scheduler against a KVCacheManager (admit with a prefix hit, prefill
in chunks, decode), say which blocks a request's tables hold, and name every bad argument; a pool that runs out raises
and leaves the cache as it was."""
import random
import pytest
from dsv41_nb.config import ModelConfig
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.kv_manager import KVCacheManager, cache_snapshot
from dsv41_nb.kv_walk import admit, prefill_rest, generate, block_status, plot_block_tables

TINY = ModelConfig.tiny()


def tiny_kv(num_blocks=64):
    "Global blocks of 16 tokens, window blocks of 4 (window 16), one ring per request"
    return KVCacheManager(get_kv_cache_config(TINY, CacheConfig.for_model(TINY, num_gpu_blocks_override=num_blocks)))


def request(kv, rid, n, seed=0):
    r = random.Random(seed)
    return kv.new_request(rid, [r.randrange(TINY.vocab_size) for _ in range(n)])


def test_a_second_request_hits_the_first_ones_prefix_and_decodes():
    kv = tiny_kv()
    a = request(kv, 'a', 70)
    assert admit(kv, a, 32) == 0 and a.num_computed_tokens == 32
    prefill_rest(kv, a, 16)
    assert a.num_computed_tokens == 70
    b = request(kv, 'b', 70)                               # the same prompt: it hits a's full blocks
    hit = admit(kv, b, 8)
    assert hit > 0 and hit % 16 == 0 and b.num_computed_tokens == min(hit + 8, 70)
    generate(kv, a, [1, 2, 3, 4])                           # 4 sampled, the first 3 computed
    assert a.num_computed_tokens == 73 and a.num_tokens == 74
    st = block_status(kv, 'b', hit)
    assert st[0][:hit // 16] == ['prefix hit'] * (hit // 16) and st[2] == ['ring']


def test_a_pool_that_runs_out_raises_and_changes_nothing():
    kv = tiny_kv(18)                                        # 17 usable blocks
    a = request(kv, 'a', 100)
    admit(kv, a, 16); prefill_rest(kv, a, 16)               # holds 13 of them
    b = request(kv, 'b', 100, seed=1)                       # 13 at most: it would fit alone
    before = cache_snapshot(kv)
    msg = "admit: the pool has 4 free blocks, too few for the next slots of request 'b'"
    with pytest.raises(ValueError, match=msg):
        admit(kv, b, 16)                                    # its first chunk needs 6
    assert cache_snapshot(kv) == before and b.num_computed_tokens == 0


def _bad_cases():
    kv = tiny_kv()
    a = request(kv, 'a', 20)
    admit(kv, a, 20)
    fresh = request(kv, 'f', 20)
    return [
        (lambda: admit(None, fresh, 4), TypeError, 'admit: kv must be a KVCacheManager, got NoneType'),
        (lambda: admit(kv, 'f', 4), TypeError, 'admit: req must be a Request, got str'),
        (lambda: admit(kv, fresh, 0), ValueError, 'admit: chunk = 0; expected at least 1'),
        (lambda: admit(kv, fresh, 2.0), TypeError, 'admit: chunk must be an int'),
        (lambda: prefill_rest(kv, a, -3), ValueError, 'prefill_rest: chunk = -3; expected at least 1'),
        (lambda: prefill_rest([], a, 4), TypeError, 'prefill_rest: kv must be a KVCacheManager'),
        (lambda: generate(kv, a, [1], lookahead=-1), ValueError, 'generate: lookahead = -1; expected at least 0'),
        (lambda: generate(kv, {}, [1]), TypeError, 'generate: req must be a Request, got dict'),
        (lambda: block_status(kv, 'nobody'), ValueError, "block_status: request 'nobody' holds no blocks"),
        (lambda: block_status(kv, 'a', -1), ValueError, 'block_status: num_hit_tokens = -1'),
        (lambda: block_status(object(), 'a'), TypeError, 'block_status: manager must be a KVCacheManager'),
        (lambda: plot_block_tables(kv, 'a'), TypeError, 'plot_block_tables: request must be a Request, got str'),
    ]


@pytest.mark.parametrize('i', range(len(_bad_cases())))
def test_bad_input_is_named(i):
    fn, exc, msg = _bad_cases()[i]
    with pytest.raises(exc, match=msg.replace('(', r'\(').replace(')', r'\)')):
        fn()
