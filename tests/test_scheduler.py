"""The scheduler against independent computations: plain greedy generation of the toy model (no scheduler), the slot
arithmetic of the block pool, the n-gram proposer's one-comparison-at-a-time reference; and one table of bad inputs."""
import dataclasses
import random
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.block_pool import reference_slot_mapping, PAD_SLOT_ID, NULL_BLOCK_ID
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.kv_manager import CacheCapacityError, cache_snapshot
from dsv41_nb.scheduler import (SamplingParams, SchedulerConfig, Scheduler, ModelRunnerOutput,
                                toy_next_token, toy_next_tokens, toy_generate, check_stop)
from dsv41_nb.scheduler_run import ToyRunner, run_until_done
from dsv41_nb.decode_step import table_slot_mappings, DecodeOutput, DecodeCoreOutputs
from dsv41_nb.proposer import NgramProposer, reference_ngram_propose

TINY = ModelConfig.tiny()
V = 32           # the toy model's vocabulary: small, so that prompts share prefixes and n-grams match
EOS = 0


def tiny_cache(blocks=200, **kw):
    return get_kv_cache_config(TINY,
                               CacheConfig.for_model(TINY, num_gpu_blocks_override=blocks, max_model_len=512, **kw))


# ---------------------------------------------------------------- bad input, one table for the module
def _sched():
    s = Scheduler(tiny_cache(), SchedulerConfig())
    s.add_request('x', [1, 2, 3])
    return s

def _update(sampled, drafts=None, verified=None):
    s = _sched()
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled, drafts or {}, num_draft_tokens=verified))

def _applied_twice():
    s = _sched()
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({'x': [7]}))
    s.update_from_output(out, ModelRunnerOutput({'x': [7]}))

def _decode_step(sampled=None, **columns):
    "x and y prefilled and sampled once, then a one-pass decode step answered with `sampled` (or columns)"
    s = Scheduler(tiny_cache(), SchedulerConfig())
    for r in 'xy': s.add_request(r, [1, 2, 3], SamplingParams(ignore_eos=True))
    s.update_from_output(s.schedule(), ModelRunnerOutput({'x': [7], 'y': [7]}))
    out = s.schedule()
    assert type(out) is DecodeOutput
    s.update_from_output(out, ModelRunnerOutput(sampled, **columns))

BAD = [
    (lambda: SamplingParams(temperature=-1), ValueError, 'temperature = -1'),
    (lambda: SamplingParams(top_p=1.5), ValueError, 'top_p = 1.5'),
    (lambda: SamplingParams(top_p=0), ValueError, 'top_p = 0'),
    (lambda: SamplingParams(top_p='0.5'), ValueError, "top_p = '0.5'"),
    (lambda: SamplingParams(temperature=float('inf')), ValueError, 'temperature = inf'),
    (lambda: SamplingParams(temperature=True), ValueError, 'temperature = True'),
    (lambda: SamplingParams(min_p=1.01), ValueError, 'min_p = 1.01'),
    (lambda: SamplingParams(top_k=0), ValueError, 'top_k = 0'),
    (lambda: SamplingParams(min_p=-0.1), ValueError, 'min_p = -0.1'),
    (lambda: SamplingParams(max_tokens=0), ValueError, 'max_tokens = 0'),
    (lambda: SamplingParams(max_tokens=2, min_tokens=3), ValueError, 'min_tokens = 3'),
    (lambda: SamplingParams(seed='7'), TypeError, "seed = '7'"),
    (lambda: SamplingParams(ignore_eos=1), TypeError, 'ignore_eos = 1'),
    (lambda: SamplingParams(stop_token_ids=[1.5]), ValueError, 'stop_token_ids holds 1.5'),
    (lambda: SamplingParams(stop_token_ids=3), TypeError, 'stop_token_ids = 3'),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), ValueError, 'max_num_batched_tokens = 0'),
    (lambda: SchedulerConfig(bounded_replay='yes'), TypeError, "bounded_replay = 'yes'"),
    (lambda: SchedulerConfig(long_prefill_token_threshold='8'), ValueError, "long_prefill_token_threshold = '8'"),
    (lambda: _sched().add_request(5, [1]), TypeError, 'request_id must be a non-empty str, got 5'),
    (lambda: _sched().add_request('y', [1], eos_token_id=512), ValueError, 'eos_token_id = 512; expected a token id'),
    (lambda: ModelRunnerOutput(req_ids=['a']), ValueError, 'expected sampled_token_ids, or req_ids and token_ids'),
    (lambda: SchedulerConfig(long_prefill_token_threshold=8, enable_chunked_prefill=False), ValueError,
     'needs enable_chunked_prefill'),
    (lambda: Scheduler(tiny_cache(), SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=64)),
     ValueError, 'without chunked prefill'),
    (lambda: Scheduler(None), TypeError, 'expected a KVCacheManager or KVCacheConfig'),
    (lambda: _sched().add_request('x', [1]), ValueError, "request id 'x' is already in the scheduler"),
    (lambda: _sched().add_request('y', [1, 600]), ValueError, 'token id 600 at position 1'),
    (lambda: _sched().add_request('y', [1], SamplingParams(stop_token_ids=[512])), ValueError, 'stop token id 512'),
    (lambda: _sched().add_request('y', [1], eos_token_id=-1), ValueError, 'eos_token_id = -1'),
    (lambda: _sched().add_request('y', [1] * 513), ValueError, 'exceeds max_model_len = 512'),
    (lambda: Scheduler(tiny_cache(20)).add_request('y', [1] * 400), CacheCapacityError, "request 'y' can never fit"),
    (lambda: _sched().abort('y'), ValueError, "abort: no unfinished request 'y'"),
    (lambda: _sched().preempt('x'), ValueError, "preempt: 'x' is not a running request"),
    (lambda: _update({}), ValueError, "no sampled tokens for request 'x'"),
    (lambda: _update({'x': []}), ValueError, '0 sampled tokens'),
    (lambda: _update({'x': [7]}, {'x': [999]}), ValueError, 'token id 999'),
    (lambda: _update({'x': [7]}, verified={'x': 2}), ValueError, "request 'x': 2 drafts verified of the 0 planned"),
    (lambda: _update({'x': [7]}, verified={'x': -1}), ValueError, '-1 drafts verified'),
    (lambda: _decode_step({}), ValueError, "no sampled tokens for request 'x'"),
    (lambda: _decode_step({'x': [7], 'y': [512]}), ValueError, 'token id 512 at position 0 is outside the vocab'),
    (lambda: _decode_step(req_ids=['x', 'y'], token_ids=[512, 7]), ValueError, 'token id 512 at position 0'),
    (lambda: _decode_step({'x': [7], 'y': [-1]}), ValueError, 'token id -1 at position 0 is outside the vocabulary'),
    (lambda: _decode_step({'x': [7.0], 'y': [7]}), TypeError, 'token id 7.0 at position 0 has type float'),
    (lambda: _decode_step(req_ids=['x', 'y'], token_ids=['7', 7]), TypeError, "token id '7' at position 0 has"),
    (lambda: _applied_twice(), ValueError, 'step 0 is not its oldest step in flight (applied twice, or out of order)'),
    (lambda: _sched().schedule(drafts='no'), TypeError, "schedule: drafts = 'no'"),
    (lambda: NgramProposer(2, 0), ValueError, 'prompt_lookup_min = 0'),
    (lambda: NgramProposer(2, 3, 2), ValueError, 'prompt_lookup_max = 2; expected an integer >= prompt_lookup_min = 3'),
    (lambda: ToyRunner(tiny_cache(), 0), ValueError, 'vocab_size = 0'),
    (lambda: ModelRunnerOutput(), ValueError, 'expected sampled_token_ids, or req_ids and token_ids'),
    (lambda: ModelRunnerOutput(req_ids=['a', 'b'], token_ids=[1]), ValueError, 'of the same length'),
    (lambda: table_slot_mappings(tiny_cache().groups, [np.ones((1, 2), np.int32)] * 3,
                                 np.zeros(1, int), np.array([40])),
     ValueError, 'position 40 needs block 2'),
    (lambda: table_slot_mappings(tiny_cache().groups, [np.zeros((1, 4), np.int32)] * 3,
                                 np.zeros(1, int), np.array([3])),
     ValueError, 'position 3 falls in a released (null) block'),
    (lambda: table_slot_mappings(tiny_cache().groups, [np.array([[1, 0] + [2] * 30], np.int32)] * 3,
                                 np.zeros(2, int), np.array([0, 20])),
     ValueError, 'position 20 falls in a released (null) block'),
]

@pytest.mark.parametrize('f, exc, msg', BAD, ids=[m for _, _, m in BAD])
def test_bad_input(f, exc, msg):
    fails_with(f, contains=msg)
    with pytest.raises(exc): f()


def test_sampling_params_edges_are_accepted():
    sp = SamplingParams(top_p=1, top_k=1, min_p=1, stop_token_ids=[0])
    assert (sp.top_k, sp.min_p, sp.stop_token_ids) == (1, 1, (0,)) and not sp.greedy
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(top_p=1e-9, min_p=0, max_tokens=1, min_tokens=1).top_p == 1e-9


def test_scheduler_edges_are_accepted():
    assert SchedulerConfig(max_num_seqs=1).max_num_seqs == 1
    s = _sched()
    assert s.add_request('m', [1] * 512).num_tokens == 512                # exactly max_model_len
    assert s.add_request('e', [1], eos_token_id=TINY.vocab_size - 1).eos_token_id == TINY.vocab_size - 1
    out, why = toy_generate([1] * 10, SamplingParams(max_tokens=16), V, max_model_len=12)
    assert (len(out), why) == (2, 'length')


def test_block_tables_of_different_lengths_pad_to_the_longest():
    s = Scheduler(tiny_cache(), SchedulerConfig())
    s.add_request('a', [1] * 5); s.add_request('b', [2] * 40)
    t = s.schedule().block_table(0)                                     # global blocks of 16 tokens: 1 and 3
    assert t.shape == (2, 3) and t[0, 1:].tolist() == [NULL_BLOCK_ID, NULL_BLOCK_ID] and (t[1] != NULL_BLOCK_ID).all()


def test_stop_ids_and_the_length_limit():
    s = _sched()
    r = s.add_request('e', [1, 2], SamplingParams(stop_token_ids=[3], ignore_eos=True), eos_token_id=5)
    assert r.stop_ids == {3}                                   # EOS ignored
    assert s.add_request('n', [1, 2], SamplingParams(stop_token_ids=[3])).stop_ids == {3}
    assert s.add_request('f', [1, 2], eos_token_id=5).stop_ids == {5}
    r.append_output_token_ids(5)
    assert check_stop(r, 10) is None and check_stop(r, 3) == ('length', None)   # 3 tokens: at the limit


def test_failed_update_changes_nothing():
    s = _sched()
    out = s.schedule()
    before = (s.requests['x'].num_tokens, s.requests['x'].num_computed_tokens, list(s.requests['x'].in_flight))
    with pytest.raises(ValueError): s.update_from_output(out, ModelRunnerOutput({'x': [1, 2]}))
    assert (s.requests['x'].num_tokens, s.requests['x'].num_computed_tokens, list(s.requests['x'].in_flight)) == before


# ---------------------------------------------------------------- the pieces against their references
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 4), st.integers(0, 3), st.integers(1, 6))
def test_ngram_matches_reference(tokens, lo, extra, k):
    assert NgramProposer(k, lo, lo + extra).propose_one(tokens) == reference_ngram_propose(tokens, lo, lo + extra, k)


def test_ngram_drafts_stop_at_max_model_len():
    t = [1, 2, 3, 4, 5, 6, 7, 1, 2]                                   # '1 2' seen before: drafts 3 4 5 ...
    assert NgramProposer(4, 2, 2).propose_one(t) == [3, 4, 5, 6]
    assert [NgramProposer(4, 2, 2, max_model_len=m).propose_one(t) for m in (11, 9, 8)] == [[3, 4], [], []]


@given(st.lists(st.integers(0, 200), min_size=1, max_size=80), st.integers(1, 300))
def test_toy_rows_match_reference(hist, vocab):
    h = np.array(hist)
    assert (toy_next_tokens(h, np.arange(len(h)), vocab).tolist()
            == [toy_next_token(hist[:q + 1], vocab) for q in range(len(h))])


# --------------------------------------------------------------- every step's plan, checked against the slot arithmetic
def check_plan(out, s):
    "Budget, seats, slots and decoder rows of one SchedulerOutput, recomputed from its block tables"
    cfg, kc = s.config, s.kv.kv_cache_config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens and len(out.requests) <= cfg.max_num_seqs
    sm, row = out.slot_mappings, 0
    groups = {g.manager: g for g in kc.groups}
    for sr in out.requests:
        pos = list(range(sr.start, sr.start + sr.num_tokens))
        assert sm.positions[row:row + len(pos)].tolist() == pos
        g, w = groups['global'], groups['sliding_window']
        assert (sm.swa[row:row + len(pos)].tolist()
                == reference_slot_mapping(sr.block_ids[w.group_id], pos, w.block_size))
        for r in g.ratios:
            want = reference_slot_mapping(sr.block_ids[g.group_id], pos, g.block_size, r)
            want = [PAD_SLOT_ID if p < sr.num_cached_tokens else x for p, x in zip(pos, want)]
            assert sm.compressed[r][row:row + len(pos)].tolist() == want
        if cfg.long_prefill_token_threshold and sr.num_draft_tokens == 0 and sr.start < sr.request.prefill_len:
            assert sr.num_tokens <= cfg.long_prefill_token_threshold
        row += len(pos)
    dec = [i for i, p in enumerate(sm.positions.tolist()) if p >= _replay_start_of_row(out, i)]
    assert out.decoder_rows.tolist() == dec


def _replay_start_of_row(out, i):
    for sr in out.requests:
        if i < sr.num_tokens: return sr.replay_start
        i -= sr.num_tokens


def make_workload(seed, n_req, long=False):
    r = random.Random(seed)
    base = [r.randrange(V) for _ in range(r.randrange(16, 80))]
    work = []
    for i in range(n_req):
        tail = [r.randrange(V) for _ in range(r.randrange(1, 90 if long else 40))]
        prompt = base[:r.randrange(len(base) + 1)] + tail if r.random() < 0.6 else tail
        mt = r.randrange(1, 50)
        sp = SamplingParams(temperature=0, max_tokens=mt, min_tokens=r.randrange(0, mt + 1) if r.random() < 0.3 else 0,
                            ignore_eos=r.random() < 0.3, stop_token_ids=[r.randrange(1, V)] if r.random() < 0.3 else [])
        work.append((f'r{i}', prompt, sp))
    return work


CONFIGS = st.fixed_dictionaries(dict(
    budget=st.sampled_from([8, 24, 64, 512]), threshold=st.sampled_from([0, 0, 8, 20]),
    seqs=st.sampled_from([2, 4, 64]), asyn=st.booleans(), k=st.sampled_from([0, 0, 1, 3]),
    bounded=st.booleans(), caching=st.sampled_from([True, True, False]),
    blocks=st.sampled_from([24, 40, 200]), chunked=st.sampled_from([True, True, True, False])))


@settings(max_examples=examples(40))
@given(CONFIGS, st.integers(0, 10 ** 6), st.integers(1, 8))
def test_outputs_equal_plain_generation(c, seed, n_req):
    """Any configuration (budget, prefill cap, seats, async, drafts, replay, caching, a pool small enough to preempt, no
    chunking) gives exactly the tokens and finish reasons of generation without a scheduler, and returns every block"""
    chunked = c['chunked'] or c['threshold'] > 0
    cfg = SchedulerConfig(max_num_seqs=c['seqs'], max_num_batched_tokens=c['budget'] if chunked else 512,
                          long_prefill_token_threshold=c['threshold'], enable_chunked_prefill=chunked,
                          async_scheduling=c['asyn'], num_speculative_tokens=c['k'], bounded_replay=c['bounded'])
    s = Scheduler(tiny_cache(c['blocks'], enable_prefix_caching=c['caching']), cfg)
    work = make_workload(seed, n_req)
    want = {}
    for rid, prompt, sp in work:
        try: s.add_request(rid, prompt, sp, eos_token_id=EOS)
        except CacheCapacityError: continue
        want[rid] = toy_generate(prompt, sp, V, EOS, 512)
    runner = ToyRunner(s.kv.kv_cache_config, V, NgramProposer(c['k'], 1, 3) if c['k'] else None)
    got = run_until_done(s, runner, max_steps=20_000, on_step=lambda o, r: check_plan(o, s))
    assert got == want
    assert s.kv.num_free_blocks == s.kv.block_pool.num_usable_blocks
    assert not s.running and not s.waiting and not s.requests


def test_preemption_keeps_outputs_and_every_request_finishes():
    "A pool that holds barely one long request at a time: many preemptions, the same answers"
    work = make_workload(3, 8, long=True)
    s = Scheduler(tiny_cache(24),
                  SchedulerConfig(max_num_batched_tokens=16, async_scheduling=True, num_speculative_tokens=2))
    for rid, p, sp in work: s.add_request(rid, p, sp, eos_token_id=EOS)
    got = run_until_done(s, ToyRunner(s.kv.kv_cache_config, V, NgramProposer(2, 1, 3)))
    assert got == {rid: toy_generate(p, sp, V, EOS, 512) for rid, p, sp in work}
    assert s.stats['preemptions'] > 0


def test_steps_planned_without_drafts_keep_the_answers():
    """Synchronous n-gram speculation where a random half of the steps are planned with drafts=False: those plan
    one row per request (the one-pass path when all decode), the drafts they drop are never verified, the outputs
    are plain generation's"""
    work, rng, plain = make_workload(4, 9), random.Random(5), []
    s = Scheduler(tiny_cache(), SchedulerConfig(num_speculative_tokens=3))
    for rid, p, sp in work: s.add_request(rid, p, sp, eos_token_id=EOS)
    schedule = s.schedule
    def coin():
        d = rng.random() < 0.5
        out = schedule(drafts=d)
        if not d:
            plain.append(out.all_decode)
            assert all(r.num_draft_tokens == 0 for r in out.requests) and not any(r.spec_token_ids for r in s.running)
        return out
    s.schedule = coin
    got = run_until_done(s, ToyRunner(s.kv.kv_cache_config, V, NgramProposer(2, 1, 3)))
    assert got == {rid: toy_generate(p, sp, V, EOS, 512) for rid, p, sp in work}
    assert sum(plain) > 5 and s.stats['accepted_tokens'] > 0, (sum(plain), s.stats)


def test_abort_mid_flight_frees_everything():
    s = Scheduler(tiny_cache(), SchedulerConfig(async_scheduling=True, num_speculative_tokens=2))
    runner = ToyRunner(s.kv.kv_cache_config, V, NgramProposer(2, 1, 3))
    for rid, p, sp in make_workload(5, 4): s.add_request(rid, p, sp, eos_token_id=EOS)
    o1 = s.schedule(); r1 = runner.execute_model(o1)
    o2 = s.schedule(); r2 = runner.execute_model(o2)                  # two steps planned, one output applied below
    s.update_from_output(o1, r1)
    for rid in list(s.requests): s.abort(rid)
    assert s.update_from_output(o2, r2) == []                         # the aborted requests' outputs are dropped
    assert s.kv.num_free_blocks == s.kv.block_pool.num_usable_blocks
    o3 = s.schedule()
    assert o3.requests == [] and o3.finished_req_ids == {rid for rid, _, _ in make_workload(5, 4)}


def test_bounded_replay_hits_where_hybrid_search_cannot():
    "A shared system prompt followed by different questions: only the global groups remember it"
    r = random.Random(0)
    system = [r.randrange(V) for _ in range(50)]
    hits = {}
    for bounded in (False, True):
        s = Scheduler(tiny_cache(), SchedulerConfig(bounded_replay=bounded))
        runner = ToyRunner(s.kv.kv_cache_config, V)
        s.add_request('a', system + [r.randrange(V) for _ in range(30)], SamplingParams(max_tokens=2))
        run_until_done(s, runner)
        s.add_request('b', system + [r.randrange(V) for _ in range(30)], SamplingParams(max_tokens=2))
        out = s.schedule()
        hits[bounded] = (out.requests[0].num_cached_tokens, out.requests[0].start)
    assert hits == {False: (0, 0), True: (48, 32)}


def test_bounded_replay_leaves_the_last_token_and_counts_the_lookup():
    "A prompt of exactly two resume points seen again: the hit stops one alignment short, so one token is computed"
    prompt = [random.Random(1).randrange(V) for _ in range(32)]            # the tiny layout resumes every 16 tokens
    s = Scheduler(tiny_cache(), SchedulerConfig(bounded_replay=True))
    s.add_request('a', prompt, SamplingParams(max_tokens=2)); run_until_done(s, ToyRunner(s.kv.kv_cache_config, V))
    before = dataclasses.replace(s.kv.prefix_cache_stats)
    s.add_request('b', prompt, SamplingParams(max_tokens=2))
    r = s.schedule().requests[0]
    assert (r.num_cached_tokens, r.start) == (16, 0)                       # 16 hit, the window replayed from 0
    st = s.kv.prefix_cache_stats
    assert (st.requests - before.requests, st.queries - before.queries, st.hits - before.hits) == (1, 31, 16)


def test_whole_prompt_admission_at_the_pool_edge():
    "Without chunked prefill a prompt is admitted when its one step needs every usable block, and not one more"
    cfg = SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)
    need = 64 // 16 + 64 // 4 + 1                                          # global, window and ring blocks of 64 tokens
    s = Scheduler(tiny_cache(need + 1), cfg)
    s.add_request('a', [1] * 64, SamplingParams(max_tokens=1))
    assert [len(r.token_ids) for r in s.schedule().requests] == [64]
    fails_with(lambda: Scheduler(tiny_cache(need), cfg).add_request('b', [1] * 64, SamplingParams(max_tokens=1)),
               contains="request 'b': without chunked prefill, 64 tokens in one step need 21 blocks")


# ---------------------------------------------------------------- the one-pass decode step against the general one
def _cache_state(kv):
    "The pool, every table, and what each group remembers per request"
    return cache_snapshot(kv), repr([(getattr(m, 'num_cached_block', None), getattr(m, 'next_checkpoint', None),
                                      getattr(m, 'last_checkpoint', None)) for m in kv.managers])

def _plan(o):
    sm = o.slot_mappings
    return ([(r.request_id, r.token_ids, r.start, r.num_draft_tokens, r.block_ids, r.new,
              r.num_cached_tokens, r.replay_start,
              r.sample) for r in o.requests], sm.positions.tolist(), sm.swa.tolist(),
            {k: v.tolist() for k, v in sm.compressed.items()}, None if sm.ring is None else sm.ring.tolist(),
            o.decoder_rows.tolist(), o.finished_req_ids, o.preempted_req_ids)

@settings(max_examples=examples(25), deadline=None)
@given(CONFIGS, st.integers(0, 10 ** 6), st.integers(1, 8))
def test_fast_decode_plans_every_step_as_the_general_path(c, seed, n_req):
    """A scheduler with the one-pass decode step and one without, side by side on the same workload: every step hands
    the runner the same rows, tables, slots and decoder rows, the cache is in the same state after every step, and the
    outputs are equal"""
    chunked = c['chunked'] or c['threshold'] > 0
    cfg = SchedulerConfig(max_num_seqs=c['seqs'], max_num_batched_tokens=c['budget'] if chunked else 512,
                          long_prefill_token_threshold=c['threshold'], enable_chunked_prefill=chunked,
                          async_scheduling=c['asyn'], bounded_replay=c['bounded'])
    pair = [Scheduler(tiny_cache(c['blocks'], enable_prefix_caching=c['caching']), cfg) for _ in range(2)]
    pair[1].fast_decode = False
    runners = [ToyRunner(s.kv.kv_cache_config, V) for s in pair]
    for s in pair:
        for rid, p, sp in make_workload(seed, n_req):
            try: s.add_request(rid, p, sp, eos_token_id=EOS)
            except CacheCapacityError: pass
    pending, fast, outs = [None, None], 0, [{}, {}]
    for _ in range(5000):
        if not any(s.has_unfinished_requests() for s in pair) and pending[0] is None: break
        o = [s.schedule() for s in pair]
        assert _plan(o[0]) == _plan(o[1])
        fast += o[0].all_decode
        res = [r.execute_model(x) for r, x in zip(runners, o)]
        for i, s in enumerate(pair):
            done = pending[i] if cfg.async_scheduling else (o[i], res[i])
            if done is not None:
                for e in s.update_from_output(*done): outs[i].setdefault(e.request_id, []).extend(e.new_token_ids)
            pending[i] = (o[i], res[i]) if cfg.async_scheduling and o[i].requests else None
        assert _cache_state(pair[0].kv) == _cache_state(pair[1].kv)
    assert outs[0] == outs[1] and not pair[0].has_unfinished_requests()


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(1, 300), st.integers(0, 10 ** 6), st.booleans(), st.booleans(), st.booleans())
def test_decode_horizon_is_exact(prompt_len, seed, caching, bounded, known_after):
    """Below `alloc_until` a one-row allocation changes nothing in the cache; the horizon is met,
    not passed, by a real change (a horizon behind the tokens would be safe, and slow). `known_after`: each row's
    token reaches the request only after its row is allocated, as under async scheduling"""
    r = random.Random(seed)
    s = Scheduler(tiny_cache(200, enable_prefix_caching=caching), SchedulerConfig(bounded_replay=bounded))
    req = s.add_request('h', [r.randrange(V) for _ in range(prompt_len)], SamplingParams(max_tokens=200))
    s._allocate(req, prompt_len); req.num_computed_tokens = prompt_len
    for c in range(prompt_len, min(prompt_len + 120, 511)):
        req.num_computed_tokens, h, before = c, req.alloc_until, _cache_state(s.kv)
        if not known_after: req.append_output_token_ids(r.randrange(V))
        s._allocate(req, 1)
        if known_after: req.append_output_token_ids(r.randrange(V))
        assert not (c < h and _cache_state(s.kv) != before), (c, h)
        # exact: met, never behind (but for the first horizon, taken at 0 computed tokens, and -1 with prefix caching:
        # a window group with no checkpoint yet, while too few tokens are known to hash, sends steps the general way)
        if c > prompt_len and not (caching and h == -1):
            assert h >= c and (c < h or _cache_state(s.kv) != before), (c, h)


@pytest.mark.parametrize('room,tried,got', [(3, [5, 3], (3, 0)), (1, [5, 3, 2, 1], (1, 0)), (0, [5, 3, 2, 1], None)])
def test_a_prefill_chunk_that_does_not_fit_is_halved_rounding_up(monkeypatch, room, tried, got):
    "A chunk of 5 tokens on a pool with room for fewer: 5, then 3, 2 and 1 are asked for (halved, rounding up)"
    s, asked = _sched(), []
    def allocate(req, n, skip, hit, num_lookahead_tokens=0):
        asked.append(n)
        return [] if n <= room else None
    monkeypatch.setattr(s.kv, 'allocate_slots', allocate)
    monkeypatch.setattr(s.kv, 'get_block_ids', lambda rid: [])
    assert s._allocate(s.requests['x'], 5, may_preempt=False) == got and asked == tried


def _drafting(budget=8, k=8, prompt=4, **sp):
    "x (a prompt of `prompt` tokens) sampled once and handed k drafts; y, 20 tokens, admitted behind it"
    s = Scheduler(tiny_cache(), SchedulerConfig(max_num_batched_tokens=budget, num_speculative_tokens=k))
    s.add_request('x', list(range(1, prompt + 1)), SamplingParams(**sp))
    s.add_request('y', list(range(1, 21)))
    out = s.schedule()
    sampled = {r.request_id: [5] if r.sample else [] for r in out.requests}
    s.update_from_output(out, ModelRunnerOutput(sampled, {'x': [6] * k}))
    return s, s.schedule()


def test_drafts_stop_at_the_budget_and_nothing_runs_once_it_is_spent():
    """A decode row with drafts takes at most the whole budget (1 + budget - 1 drafts); behind it, no empty entry for
    the request still prefilling"""
    s, out = _drafting()
    assert s.requests['y'].num_computed_tokens == 4 < s.requests['y'].prefill_len
    assert [(r.request_id, len(r.token_ids), r.num_draft_tokens) for r in out.requests] == [('x', 8, 7)]


def test_drafts_stop_at_max_tokens_and_max_model_len():
    "Drafts never plan a token past max_tokens (the row's own token counts) or past max_model_len"
    s, out = _drafting(budget=64, max_tokens=4)          # one sampled, three to go: the row and two drafts
    assert [(r.request_id, r.num_draft_tokens) for r in out.requests][:1] == [('x', 2)]
    s, out = _drafting(budget=600, k=20, prompt=500)      # 501 tokens of 512: the row at 500, drafts to 511
    (x,) = [r for r in out.requests if r.request_id == 'x']
    assert (x.start, len(x.token_ids), x.num_draft_tokens) == (500, 12, 11)


def test_steps_count_up_and_each_sampling_step_waits_once_to_be_applied():
    """Steps are numbered 0, 1, 2...; under async scheduling a step that samples is listed once as not yet applied
    (a prefill chunk that samples nothing is not), in order, until its output is applied"""
    s = Scheduler(tiny_cache(), SchedulerConfig(async_scheduling=True, max_num_batched_tokens=4))
    s.add_request('x', [1, 2, 3, 4, 5])
    a = s.schedule()                                             # x's first chunk: 4 tokens, nothing sampled
    assert (a.step, list(s._unapplied)) == (0, [])
    s.update_from_output(a, ModelRunnerOutput({'x': []}))
    s.add_request('y', [1, 2])
    b, c = s.schedule(), s.schedule()                            # both sample, the second before the first is back
    assert (b.step, c.step, list(s._unapplied)) == (1, 2, [1, 2])
    for out in (b, c): s.update_from_output(out, ModelRunnerOutput({r: [7] for r in out.req_ids}))
    assert not s._unapplied and s.schedule().step == 3


def test_a_plain_decode_step_is_applied_in_one_pass():
    "Every all-decode step without drafts is applied by the one-pass path, not the general one"
    s = Scheduler(tiny_cache(), SchedulerConfig())
    for r in 'xyz': s.add_request(r, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    one_pass, orig = [], s._update_decode
    def spy(so, mro):
        got = orig(so, mro); one_pass.append(got is not None)
        return got
    s._update_decode = spy
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule(); steps += 1
        s.update_from_output(out, ModelRunnerOutput({r: [7] for r in out.req_ids}))
    assert steps == 4 and one_pass == [True] * 3


def test_replay_starts_a_window_before_the_prompts_end():
    "Bounded replay: the decoder layers run from a window before the prompt's end, from 0 on a prompt within a window"
    s = Scheduler(tiny_cache(), SchedulerConfig(bounded_replay=True))
    s.add_request('long', list(range(1, s.window + 11))); s.add_request('short', [1, 2, 3])
    assert [r.replay_start for r in s.schedule().requests] == [10, 0]


def test_without_chunking_a_prompt_as_long_as_the_budget_is_admitted():
    s = Scheduler(tiny_cache(), SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512))
    s.add_request('x', [1] * 512, SamplingParams(max_tokens=1))
    assert [len(r.token_ids) for r in s.schedule().requests] == [512]


def test_draft_and_accepted_counts():
    "Three drafts verified, two accepted (the third replaced by the target's own token): the stats say 3 and 2"
    s = Scheduler(tiny_cache(), SchedulerConfig(num_speculative_tokens=3))
    s.add_request('x', [1, 2, 3], SamplingParams(ignore_eos=True))
    s.update_from_output(s.schedule(), ModelRunnerOutput({'x': [5]}, {'x': [6, 7, 8]}))
    s.update_from_output(s.schedule(), ModelRunnerOutput({'x': [6, 7, 9]}))
    assert (s.stats['draft_tokens'], s.stats['accepted_tokens']) == (3, 2)


def test_toy_runner_takes_every_vocabulary_its_cache_allows_and_refuses_rows_off_its_cache():
    kc = tiny_cache()
    for v in (1, kc.vocab_size): assert ToyRunner(kc, v).vocab_size == v
    sr = _sched().schedule().requests[0]
    runner = ToyRunner(kc, V); runner._inputs(sr)
    fails_with(lambda: runner._inputs(dataclasses.replace(sr, new=False, start=2)), contains="rows at 2")


def test_decode_steps_go_in_one_pass_from_the_first_even_with_every_seat_taken():
    """Two seats, three requests: x and y prefill, then decode in one pass while z waits for a seat (from the first
    decode step on), then z; the steps count up; a one-pass step's outputs compare equal to their list"""
    s = Scheduler(tiny_cache(), SchedulerConfig(max_num_seqs=2))
    for r in 'xyz': s.add_request(r, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    kinds, steps = [], []
    while s.has_unfinished_requests():
        out = s.schedule(); kinds.append(type(out).__name__); steps.append(out.step)
        got = s.update_from_output(out, ModelRunnerOutput({r: [7] for r in out.req_ids}))
        assert got == list(got)
    assert steps == list(range(6))
    assert kinds == ['SchedulerOutput', 'DecodeOutput', 'DecodeOutput'] * 2


def test_a_request_aborted_while_its_one_pass_step_is_in_flight_is_left_out_of_that_steps_outputs():
    "Async: x, y and z decode in one pass; y is aborted before that step comes back: its token is dropped, theirs kept"
    s = Scheduler(tiny_cache(), SchedulerConfig(async_scheduling=True))
    for r in 'xyz': s.add_request(r, [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    first = s.schedule()
    second = s.schedule()                                                   # all decode, before `first` is back
    assert type(second) is DecodeOutput
    s.update_from_output(first, ModelRunnerOutput({r: [7] for r in 'xyz'}))
    s.abort('y')
    got = s.update_from_output(second, ModelRunnerOutput({r: [r == 'x' and 8 or 9] for r in 'xyz'}))
    assert [(o.request_id, o.new_token_ids) for o in got] == [('x', [8]), ('z', [9])]
    assert type(got) is DecodeCoreOutputs and len(got) == 2 and got == list(got)


def test_a_stop_token_finishes_a_request_in_a_one_pass_step():
    "EOS, or a stop id, sampled in an all-decode step well before max_tokens: the request stops there"
    for kw, stop in (({}, EOS), ({'stop_token_ids': [5]}, 5)):
        s = Scheduler(tiny_cache(), SchedulerConfig())
        s.add_request('x', [1, 2, 3], SamplingParams(max_tokens=8, **kw), eos_token_id=EOS)
        s.update_from_output(s.schedule(), ModelRunnerOutput({'x': [7]}))
        out = s.schedule()
        (o,) = s.update_from_output(out, ModelRunnerOutput({'x': [stop]}))
        assert type(out) is DecodeOutput and o.finish_reason == 'stop'
        assert not s.has_unfinished_requests()


def test_as_many_decode_rows_as_the_budget_still_go_in_one_pass():
    s = Scheduler(tiny_cache(), SchedulerConfig(max_num_batched_tokens=2))
    for r in 'xy': s.add_request(r, [1], SamplingParams(max_tokens=2, ignore_eos=True))
    s.update_from_output(s.schedule(), ModelRunnerOutput({'x': [7], 'y': [7]}))
    assert type(s.schedule()) is DecodeOutput
