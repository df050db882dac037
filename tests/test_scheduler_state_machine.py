"""A hypothesis state machine over the scheduler driving the KV cache manager and the toy runner on a small pool.

Random adds (some sharing prefixes), steps (synchronous, or async with one step in flight), aborts, forced finishes
(the runner's next token for a request replaced by EOS) and preemptions, under a random configuration, with the
one-pass decode step on or off. After every
rule: each unfinished request is in exactly one line, exactly the running ones hold blocks, the pool's free queue and
the blocks held partition the usable blocks. At the end everything is drained: every request finished or was aborted,
the pool is whole again, and every output is what plain generation gives (a prefix of it for aborted requests, that
prefix plus EOS for forced finishes)."""
import random
from hypothesis import settings, strategies as st
from budget import examples
from hypothesis.stateful import RuleBasedStateMachine, rule, invariant, initialize, precondition
from dsv41_nb.config import ModelConfig
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.kv_manager import CacheCapacityError
from dsv41_nb.scheduler import (SamplingParams, SchedulerConfig, Scheduler, ModelRunnerOutput,
                                RequestStatus, toy_generate)
from dsv41_nb.scheduler_run import ToyRunner
from dsv41_nb.proposer import NgramProposer

TINY = ModelConfig.tiny()
V, EOS, MAX_LEN = 24, 0, 512


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(blocks=st.sampled_from([24, 32, 60, 200]), budget=st.sampled_from([8, 16, 48, 512]),
                threshold=st.sampled_from([0, 0, 6]), asyn=st.booleans(), k=st.sampled_from([0, 0, 2]),
                bounded=st.booleans(), caching=st.sampled_from([True, True, False]),
                seqs=st.sampled_from([2, 3, 64]), fast=st.booleans())
    def setup(self, blocks, budget, threshold, asyn, k, bounded, caching, seqs, fast):
        cc = CacheConfig.for_model(TINY, num_gpu_blocks_override=blocks, max_model_len=MAX_LEN,
                                   enable_prefix_caching=caching)
        cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                              async_scheduling=asyn, num_speculative_tokens=k, bounded_replay=bounded)
        self.s = Scheduler(get_kv_cache_config(TINY, cc), cfg)
        self.s.fast_decode = fast                      # the one-pass decode step, or the general path throughout
        self.runner = ToyRunner(self.s.kv.kv_cache_config, V, NgramProposer(k, 1, 3) if k else None)
        self.pending, self.n, self.prompts = None, 0, []
        self.want, self.got, self.aborted, self.forced, self.to_force = {}, {}, set(), set(), set()

    # ------------------------------------------------------------ helpers
    def _apply(self, out, res):
        for rid in self.to_force & set(res.sampled_token_ids):             # the runner's next token becomes EOS
            req = self.s.requests.get(rid)
            sp = req.sampling_params if req is not None else None
            ok = sp is not None and not sp.ignore_eos and req.num_output_tokens + 1 >= sp.min_tokens
            if res.sampled_token_ids[rid] and ok:
                res.sampled_token_ids[rid] = [EOS]
                self.to_force.discard(rid); self.forced.add(rid)
        for e in self.s.update_from_output(out, res):
            toks, _ = self.got.get(e.request_id, ([], None))
            self.got[e.request_id] = (toks + e.new_token_ids, e.finish_reason)

    def _step(self):
        out = self.s.schedule()
        res = self.runner.execute_model(out)
        if self.s.config.async_scheduling:
            prev, self.pending = self.pending, (out, res)
            if prev is not None: self._apply(*prev)
        else: self._apply(out, res)

    # ------------------------------------------------------------ rules
    @rule(tokens=st.lists(st.integers(0, V - 1), min_size=1, max_size=70), share=st.integers(0, 10 ** 6),
          keep=st.floats(0, 1), max_tokens=st.integers(1, 40), ignore_eos=st.booleans(),
          min_frac=st.sampled_from([0, 0, 0.5]))
    def add(self, tokens, share, keep, max_tokens, ignore_eos, min_frac):
        # half the time: extend an earlier prompt's prefix
        if self.prompts and share % 2:
            src = self.prompts[share % len(self.prompts)]
            tokens = src[:int(len(src) * keep)] + tokens
        tokens = tokens[:200]
        self.n += 1
        rid = f'r{self.n}'
        sp = SamplingParams(temperature=0, max_tokens=max_tokens,
                            min_tokens=int(max_tokens * min_frac), ignore_eos=ignore_eos)
        try: self.s.add_request(rid, tokens, sp, eos_token_id=EOS)
        except CacheCapacityError: return
        self.prompts.append(tokens)
        self.want[rid] = toy_generate(tokens, sp, V, EOS, MAX_LEN)

    @rule(times=st.integers(1, 6))
    def step(self, times):
        for _ in range(times): self._step()

    @precondition(lambda self: self.s.requests)
    @rule(pick=st.integers(0, 10 ** 6))
    def abort(self, pick):
        rid = sorted(self.s.requests)[pick % len(self.s.requests)]
        self.s.abort(rid); self.aborted.add(rid)

    @precondition(lambda self: self.s.running)
    @rule(pick=st.integers(0, 10 ** 6))
    def finish(self, pick):
        self.to_force.add(self.s.running[pick % len(self.s.running)].request_id)

    @precondition(lambda self: self.s.running)
    @rule(pick=st.integers(0, 10 ** 6))
    def preempt(self, pick):
        self.s.preempt(self.s.running[pick % len(self.s.running)].request_id)

    # ------------------------------------------------------------ invariants
    @invariant()
    def lines_and_blocks(self):
        s = self.s
        running, waiting = {r.request_id for r in s.running}, {r.request_id for r in s.waiting}
        assert not running & waiting and running | waiting == set(s.requests)
        assert all(r.status is RequestStatus.RUNNING for r in s.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in s.waiting)
        assert s.kv.live_requests == running and len(running) <= s.config.max_num_seqs
        held = {b.block_id for rid in running for g in s.kv.get_blocks(rid).blocks for b in g if not b.is_null}
        free = [b.block_id for b in s.kv.block_pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) and not held & set(free)
        assert len(held) + len(free) == s.kv.block_pool.num_usable_blocks

    def teardown(self):
        if not hasattr(self, 's'): return
        for _ in range(2000):
            if not self.s.has_unfinished_requests() and self.pending is None: break
            if self.pending is not None and not self.s.has_unfinished_requests():
                self._apply(*self.pending); self.pending = None
            else: self._step()
        assert not self.s.has_unfinished_requests(), 'requests left after draining'
        assert self.s.kv.num_free_blocks == self.s.kv.block_pool.num_usable_blocks
        for rid, (want, why) in self.want.items():
            toks, reason = self.got.get(rid, ([], None))
            if rid in self.aborted and reason in (None, 'abort'):
                assert toks == want[:len(toks)], rid
            elif rid in self.forced and toks != want:
                # stopped by the forced EOS ('length' if also the last)
                assert toks[-1] == EOS and reason in ('stop', 'length') and toks[:-1] == want[:len(toks) - 1], rid
            else:
                assert (toks, reason) == (want, why), rid


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=examples(50), stateful_step_count=30, deadline=None)
