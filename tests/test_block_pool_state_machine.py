"""A hypothesis state machine over the KV cache manager on a tight pool.

Random admissions (with prefix hits), prefill chunks, decode steps with lookahead slots, shared prefixes, frees,
preemptions, double frees and cache resets; after every step the pool's bookkeeping is checked against an independent
model: free + used = total, the free queue holds each free block once and nothing else, every ref count equals the
number of block-table references, no block belongs to two groups, and every registered hash names a block whose content
(as the test recorded it when the block was written) hashes to it. Prefix-hit blocks are checked against that content
too.

Default: >= 10,000 operations. DSV41_SLOW=1: 10x more."""
import os
from collections import Counter
import pytest
from hypothesis import settings, strategies as st, HealthCheck, Phase
from budget import examples
from hypothesis.stateful import (RuleBasedStateMachine, rule, invariant, initialize, precondition,
                                 run_state_machine_as_test)
from dsv41_nb.config import ModelConfig
from dsv41_nb.prefix_cache import reference_block_hash
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config, cdiv
from dsv41_nb.kv_manager import KVCacheManager, CacheCapacityError, cache_snapshot

TINY = ModelConfig.tiny()
SLOW = bool(os.environ.get('DSV41_SLOW'))
OPS = Counter()
MAX_TOKENS = 240          # requests finish at this length
VOCAB = 24                # a small alphabet: shared prefixes also arise by chance


def chain_hash(salt, tokens, hbs, memo={}):
    "The documented chain, block by block through the reference serialiser, the salt on block 0 (memoised per prefix)"
    key = (salt, tokens)
    if key not in memo:
        n = len(tokens)
        parent = None if n == hbs else chain_hash(salt, tokens[:n - hbs], hbs)
        memo[key] = reference_block_hash(parent, tokens[n - hbs:], (salt,) if n == hbs and salt is not None else ())
    return memo[key]


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(24, 120), interval=st.sampled_from([0, 0, 16, 16, 48]),
                caching=st.sampled_from([True] * 5 + [False]))
    def setup(self, num_blocks, interval, caching):
        cc = CacheConfig.for_model(TINY, num_gpu_blocks_override=num_blocks, prefix_cache_retention_interval=interval,
                                   enable_prefix_caching=caching)
        self.kv = KVCacheManager(get_kv_cache_config(TINY, cc))
        self.pool = self.kv.block_pool
        self.hbs = self.kv.kv_cache_config.hash_block_size
        self.running, self.waiting, self.finished, self.history = {}, [], [], []
        # block id -> (group id, salt, tokens up to the block's end): what the "GPU" wrote there
        self.content = {}
        self.n = 0

    # ------------------------------------------------------------ helpers
    def _new(self, tokens, salt):
        self.n += 1
        return self.kv.new_request(f'r{self.n}', tokens, cache_salt=salt)

    def _snapshot(self): return cache_snapshot(self.kv)

    def _write(self, req, start, n):
        "The forward pass wrote positions [start, start + n): record full blocks' content"
        end = min(start + n, req.num_tokens)
        for m in self.kv.managers:
            if not m.spec.prefix_cacheable: continue
            bs, blocks = m.block_size, m.req_to_blocks[req.request_id]
            for i in range(start // bs, end // bs):
                if (i + 1) * bs > start and not blocks[i].is_null:
                    self.content[blocks[i].block_id] = (m.group_id, req.cache_salt,
                                                        tuple(req.all_token_ids[:(i + 1) * bs]))

    def _forget_new(self, new):
        for g in new.blocks:
            for b in g: self.content[b.block_id] = None

    def _check_hits(self, req, hit):
        swa = self.kv.managers[1]
        need = cdiv(TINY.window_size - 1, swa.block_size)                 # the window before the resume point
        assert not any(b.is_null for b in hit.blocks[1][-need:]), 'a hit without the window before it'
        for m, blocks in zip(self.kv.managers, hit.blocks):
            for i, b in enumerate(blocks):
                if b.is_null: continue
                want = (m.group_id, req.cache_salt, tuple(req.all_token_ids[:(i + 1) * m.block_size]))
                assert self.content.get(b.block_id) == want, (f'hit block {b.block_id} (group {m.group_id}, entry {i}) '
                                                              'holds other content')

    def _admit(self, req, chunk):
        before = self._snapshot()
        hit, n = self.kv.get_computed_blocks(req)
        assert n % self.kv.kv_cache_config.resume_alignment == 0 and n < req.num_tokens
        OPS['(prefix hits)'] += n > 0
        self._check_hits(req, hit)
        k = min(chunk, req.num_tokens - n)
        try:
            new = self.kv.allocate_slots(req, k, n, hit)
        except CacheCapacityError:
            assert self._snapshot() == before
            self.finished.append(req); return
        if new is None:
            assert self._snapshot() == before
            OPS['(no room)'] += 1
            self.waiting.append(req); return
        self._forget_new(new)
        req.num_computed_tokens = n + k
        self._write(req, n, k)
        self.running[req.request_id] = req

    # ------------------------------------------------------------ rules
    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=12, max_size=90),
          salt=st.sampled_from([None, None, None, 'tenant']),
          chunk=st.sampled_from([4, 16, 37, 200]))
    def add(self, tokens, salt, chunk):
        OPS['add'] += 1
        self._admit(self._new(tokens, salt), chunk)

    @precondition(lambda self: self.history or self.running)
    @rule(pick=st.integers(0, 10 ** 6), keep=st.one_of(st.just(1.0), st.floats(0.2, 1.0)),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=40),
          chunk=st.sampled_from([8, 64, 200]))
    def share_prefix(self, pick, keep, tail, chunk):
        OPS['share_prefix'] += 1
        pool = self.history + [(r.cache_salt, tuple(r.all_token_ids)) for r in self.running.values()]
        salt, src = pool[pick % len(pool)]
        tokens = list(src[:max(1, int(len(src) * keep))]) + tail
        self._admit(self._new(tokens[:MAX_TOKENS], salt), chunk)

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 10 ** 6), chunk=st.sampled_from([4, 16, 200]))
    def resume_waiting(self, pick, chunk):
        OPS['resume_waiting'] += 1
        self._admit(self.waiting.pop(pick % len(self.waiting)), chunk)

    def _step(self, req, chunk, lookahead, sampled):
        "Advance one running request: a prefill chunk, or (all known tokens computed) sample a token and compute it"
        if req.num_computed_tokens >= MAX_TOKENS - 1: return self._finish(req)
        if req.num_computed_tokens == req.num_tokens: req.append_output_token_ids(sampled)
        k = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = self._snapshot()
        new = self.kv.allocate_slots(req, k, num_lookahead_tokens=lookahead)
        if new is None:
            assert self._snapshot() == before; OPS['(no room)'] += 1; return
        assert all(len(g) == 0 for g in new.blocks[2:])   # the ring never grows
        self._forget_new(new)
        self._write(req, req.num_computed_tokens, k)
        req.num_computed_tokens += k

    def _finish(self, req):
        del self.running[req.request_id]
        self.kv.free(req)
        self.finished.append(req)
        self.history.append((req.cache_salt, tuple(req.all_token_ids)))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10 ** 6), chunk=st.sampled_from([1, 4, 13, 64]), lookahead=st.sampled_from([0, 0, 5]),
          sampled=st.integers(0, VOCAB - 1))
    def step(self, pick, chunk, lookahead, sampled):
        OPS['step'] += 1
        self._step(list(self.running.values())[pick % len(self.running)], chunk, lookahead, sampled)

    @precondition(lambda self: self.running)
    @rule(lookahead=st.sampled_from([0, 5]), sampled=st.integers(0, VOCAB - 1))
    def step_all(self, lookahead, sampled):
        "One scheduler iteration: every running request advances (a 16-token prefill chunk, or one decode token)"
        OPS['step_all'] += 1
        for req in list(self.running.values()): self._step(req, 16, lookahead, sampled)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10 ** 6))
    def finish(self, pick):
        OPS['finish'] += 1
        self._finish(list(self.running.values())[pick % len(self.running)])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10 ** 6))
    def preempt(self, pick):
        OPS['preempt'] += 1
        req = self.running.pop(list(self.running)[pick % len(self.running)])
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: self.finished)
    @rule(pick=st.integers(0, 10 ** 6))
    def double_free(self, pick):
        OPS['double_free'] += 1
        before = self._snapshot()
        with pytest.raises(ValueError, match='freed twice'):
            self.kv.free(self.finished[pick % len(self.finished)])
        assert self._snapshot() == before

    @precondition(lambda self: self.n % 6 == 5)                      # now and then, not every few steps
    @rule()
    def reset(self):
        OPS['reset'] += 1
        before = self._snapshot()
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.kv.live_requests)
        if ok: assert self.pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in self.pool.blocks)
        else: assert self._snapshot() == before

    # ------------------------------------------------------------ invariants
    @invariant()
    def bookkeeping(self):
        pool, q = self.pool, self.pool.free_block_queue
        free = q.get_all_free_blocks()
        ids = [b.block_id for b in free]
        assert len(ids) == len(set(ids)) == q.num_free_blocks, 'a block twice in the free queue, or a wrong count'
        assert 0 not in ids, 'the null block is in the free queue'
        refs, group_of = Counter(), {}
        for rid in self.kv.live_requests:
            for m in self.kv.managers:
                for b in m.req_to_blocks[rid]:
                    if b.is_null: continue
                    refs[b.block_id] += 1
                    assert (group_of.setdefault(b.block_id, m.group_id)
                            == m.group_id), f'block {b.block_id} in two groups'
        assert set(self.kv.live_requests) == set(self.running)
        used = {b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}
        assert len(ids) + len(used) == pool.num_usable_blocks, 'free + used != total'
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], (f'block {b.block_id}: ref_cnt {b.ref_cnt}, {refs[b.block_id]} table '
                                                   'references')
            assert ((b.ref_cnt == 0)
                    == (b.prev_free_block is not None)), f'block {b.block_id} in the free queue iff ref_cnt == 0'
        self._check_cached(group_of)
        OPS['checks'] += 1

    def _check_cached(self, group_of=None):
        for (h, gid), v in self.pool.cached_block_hash_to_block.items():
            for b in (v.values() if isinstance(v, dict) else [v]):
                assert b.block_hash == (h, gid)
                assert gid != 2, 'a compressor ring block was registered'
                if group_of is not None: assert group_of.get(b.block_id, gid) == gid
                c = self.content.get(b.block_id)
                assert c is not None and c[0] == gid, (f'block {b.block_id} is registered but holds no content of '
                                                       f'group {gid}')
                assert chain_hash(c[1], c[2], self.hbs) == h, (f'block {b.block_id} registered under a hash its tokens '
                                                               'do not have')

    def teardown(self):
        if not hasattr(self, 'kv'): return
        for req in list(self.running.values()): self.kv.free(req)
        assert (self.pool.get_num_free_blocks()
                == self.pool.num_usable_blocks), 'the pool is not whole after freeing everything'
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        self._check_cached()


def test_block_pool_state_machine():
    OPS.clear()
    n_examples, steps = (2000, 100) if SLOW else (examples(180), 100)
    run_state_machine_as_test(KVCacheMachine, settings=settings(
        max_examples=n_examples, stateful_step_count=steps, deadline=None, database=None,
        # mutation runs: report, don't shrink
        phases=[Phase.generate] if os.environ.get('DSV41_NO_SHRINK') else list(Phase),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    ops = sum(v for k, v in OPS.items() if not k.startswith('(') and k != 'checks')
    print(dict(OPS), 'operations:', ops)
    assert ops >= (100_000 if SLOW else min(10_000, examples(10_000))), f'only {ops} operations ran'
    for k in ('add', 'share_prefix', 'resume_waiting', 'step', 'step_all', 'finish', 'preempt',
              'double_free', 'reset', '(prefix hits)', '(no room)'):
        assert OPS[k] > 0, f'rule {k} never ran'
