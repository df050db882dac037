"""The engine against independent computations: the one-row-at-a-time sampling oracle, chi-square tests of the draws,
plain greedy generation of the reference model (`generate_greedy`, no scheduler, no cache), the byte tokenizer's
decode; the pool's free count around rejected and aborted requests; the command line in a subprocess; one table of bad
inputs."""
import functools, json, os, random, subprocess, sys
from types import SimpleNamespace
from dataclasses import replace
from pathlib import Path
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.launches import HostReads
from machine import DEV
from dsv41_nb.model import init_random, ByteTokenizer
from dsv41_nb.model_forward_block import generate_greedy
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.block_pool import PAD_SLOT_ID
from dsv41_nb.scheduler import SamplingParams, Scheduler, SchedulerConfig, ModelRunnerOutput
from dsv41_nb.scheduler_run import run_until_done
from dsv41_nb.decode_step import DecodeCoreOutputs
from dsv41_nb.proposer import NgramProposer
from dsv41_nb.sampler import reference_probs, sampling_batch, sampling_probs, draw, chi_square_pvalue, argmax_rows
from dsv41_nb.runner import RecomputeModel, InputBuffers, RING, TapContexts, ReferenceTapContexts
from dsv41_nb.model_runner import ModelRunner
from dsv41_nb.engine import (IncrementalDetokenizer, EngineArgs, LLMEngine, LLM, SPECULATIVE_METHODS,
                             register_speculative, NGRAM_TOKENS, kv_pool_blocks)
from dsv41_nb.engine_runs import (prefix_gap, greedy_shortfall, assert_greedy_match, warm_up_lengths,
                                  warm_up_steps, step_sizes, graphs_held)
from dsv41_nb.host_steps import host_engine, host_step_times, HOST_PHASES, StepTimer, NullStepModel
from dsv41_nb.engine_load import load_shape, random_byte_prompts
from dsv41_nb.kv_manager import KVCacheManager
from dsv41_nb.paged_step import step_model as paged_step_model
from dsv41_nb.cuda_graphs import (CUDAGraphModel, padded_batch_size, pad_decode_batch, StagedInputs, fill_token_ids,
                                  capture_sizes)
from dsv41_nb.serving import random_checkpoint, percentiles
from dsv41_nb.__main__ import random_prompts

ROOT = Path(__file__).resolve().parent.parent
TINY = ModelConfig.tiny()
torch.set_num_threads(1)            # tensors this small gain nothing from threads, and other processes share the cores
MODEL = init_random(TINY, seed=0)
TOK = ByteTokenizer(TINY)
PROMPTS = [TOK.encode('the cat sat'), TOK.encode('a'),
           TOK.encode('on the mat, the cat sat on the mat'), [256, 7, 7, 7, 7]]
N_OUT = 6
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
EXPECTED = [generate_greedy(MODEL, p, N_OUT)[len(p):] for p in PROMPTS]
# how far a shape change moves the logits: computed once, by the first check that finds a token changed
MARGIN = functools.cache(lambda: prefix_gap(MODEL, torch.tensor([PROMPTS[2] + EXPECTED[2]])))


def match(prompts, got, want=None):
    "The paged path's greedy tokens are the reference's, up to near ties (GEMM shapes differ; see 13_engine_runs)"
    assert_greedy_match(MODEL, prompts, got, EXPECTED[:len(prompts)] if want is None else want, MARGIN)
    return True
EXACT = dict(max_model_len=256, bounded_replay=False, kernels='torch')   # the paged path, comparable with the reference


def free_blocks(llm): return llm.llm_engine.scheduler.kv.block_pool.get_num_free_blocks()


# ---------------------------------------------------------------- bad input, one table for the module
_LLM = LLM(MODEL, runner='recompute', max_model_len=64)
BAD = [
    (lambda: _LLM.generate('', use_tqdm=False), ValueError, 'prompt 0: the prompt is empty'),
    (lambda: _LLM.generate({'prompt_token_ids': []}, use_tqdm=False), ValueError, 'the prompt is empty'),
    (lambda: _LLM.generate(['ok', [1, 512]], use_tqdm=False), ValueError, 'prompt 1: token id 512 at position 1'),
    (lambda: _LLM.generate([[1.5]], use_tqdm=False), TypeError, 'token id 1.5 at position 0'),
    (lambda: _LLM.generate([7] * 65, use_tqdm=False), ValueError, 'more than max_model_len = 64'),
    (lambda: _LLM.generate(['a', 'b', 'c'], [GREEDY] * 2, use_tqdm=False), ValueError,
     '3 prompts but 2 sampling params'),
    (lambda: _LLM.generate({'prompt': 3}, use_tqdm=False), TypeError, "'prompt' must be a str, got int"),
    (lambda: _LLM.generate(None, use_tqdm=False), TypeError, 'expected a str, dict, or list, got NoneType'),
    (lambda: _LLM.generate('\udcff', use_tqdm=False), ValueError,
     "prompt 0: the prompt is not valid text: '\\udcff' at"),
    (lambda: _LLM.generate(['a', 'b\udcff'], use_tqdm=False), ValueError, 'prompt 1: the prompt is not valid text'),
    (lambda: _LLM.generate('a', SamplingParams(stop_token_ids=[999]), use_tqdm=False), ValueError, 'stop token id 999'),
    (lambda: _LLM.llm_engine.abort_request('nope'), ValueError, "no unfinished request 'nope'"),
    (lambda: LLM(MODEL, kernels='cuda'), ValueError, "kernels = 'cuda'"),
    (lambda: LLM(MODEL, max_model_len=0), ValueError, 'max_model_len = 0; expected at least 1'),
    (lambda: LLM(MODEL, max_model_len=10**9), ValueError,
     'max_model_len = 1,000,000,000 is more than the model allows'),
    (lambda: LLM(MODEL, runner='paged', async_scheduling=True, num_speculative_tokens=RING), ValueError,
     f'async_scheduling with num_speculative_tokens = {RING}: at most {RING - 1}'),
    (lambda: LLM(MODEL, num_speculative_tokens=-1), ValueError, 'num_speculative_tokens = -1'),
    (lambda: LLM(MODEL, max_cudagraph_capture_size=0), ValueError, 'max_cudagraph_capture_size = 0'),
    (lambda: LLM(MODEL, runner='paged', num_speculative_tokens=8), ValueError,
     'num_speculative_tokens = 8: the paged step keeps a request\'s last 8 rows of a step to undo rejected drafts'),
    (lambda: LLM(MODEL, proposer=SimpleNamespace(num_speculative_tokens=2, propose=list, temperature=0.7)),
     ValueError, 'drafts drawn at temperature 0.7; the runner verifies drafts as point masses'),
    (lambda: LLM(MODEL, speculative='medusa'), ValueError, "speculative = 'medusa'; expected one of"),
    (lambda: LLM(MODEL, speculative=3), TypeError, "speculative = 3; expected a method's name"),
    (lambda: LLM(MODEL, speculative='ngram', proposer=NgramProposer(2)), ValueError,
     'a proposer or speculative, not both'),
    (lambda: register_speculative('', print), ValueError, "name = ''"),
    (lambda: register_speculative('x', 'not callable'), TypeError, 'make: expected a callable, got str'),
    (lambda: LLMEngine(MODEL, args=dict(runner='paged')), TypeError, 'args must be EngineArgs, got dict'),
    (lambda: LLM('/no/such/checkpoint'), FileNotFoundError, '/no/such/checkpoint'),
    (lambda: ModelRunner(RecomputeModel(MODEL), 'layout'), TypeError, 'expected a KVCacheConfig'),
    (lambda: ModelRunner(RecomputeModel(MODEL), _LLM.llm_engine.kv_cache_config, seed=-1), ValueError, 'seed = -1'),
    (lambda: sampling_batch([GREEDY], [None] * 3), ValueError, '1 rows but 3 generators'),
    (lambda: argmax_rows(torch.zeros(2, 5, dtype=torch.long)), ValueError, 'argmax_rows: expected float logits'),
    (lambda: argmax_rows(torch.zeros(2, 5), chunk=True), ValueError, 'argmax_rows: chunk = True'),
    (lambda: padded_batch_size(-2), ValueError, 'n = -2'),
    (lambda: CUDAGraphModel(RecomputeModel(MODEL), _LLM.llm_engine.kv_cache_config, 64), ValueError,
     'does not support CUDA graphs'),
    (lambda: ModelRunner(RecomputeModel(MODEL), _LLM.llm_engine.kv_cache_config,
                         proposer=NgramProposer(2)).execute_model_async(None),
     TypeError, 'execute_model_async: expected a SchedulerOutput, got NoneType'),
    (lambda: ModelRunner(paged_step_model(MODEL, _LLM.llm_engine.kv_cache_config), _LLM.llm_engine.kv_cache_config,
                         proposer=SimpleNamespace(tap_layers=(1,), tap_window=0)), TypeError,
     'reads tap layers (1,) but its tap_window is 0'),
    (lambda: ModelRunner(RecomputeModel(MODEL), _LLM.llm_engine.kv_cache_config).execute_model_async('so'), TypeError,
     'expected a SchedulerOutput, got str'),
    (lambda: fill_token_ids(torch.zeros(3, dtype=torch.long), [(3, torch.arange(4), 0)]),
     IndexError, "outside the batch's 3"),
    (lambda: StagedInputs({'a': 1}, 'cpu'), ValueError, 'holds no tensors'),
    (lambda: StagedInputs(SimpleNamespace(a=torch.zeros(2)), 'cpu').load(SimpleNamespace(a=torch.zeros(3))), ValueError,
     'shaped and typed as the staged ones'),
    (lambda: percentiles([[1, 2], [3, 4]]), ValueError, 'expected a 1-D sequence of numbers, got shape (2, 2)'),
    (lambda: percentiles(torch.ones(2, 3)), ValueError, 'expected a 1-D sequence of numbers, got shape (2, 3)'),
    (lambda: percentiles(torch.ones(2, 3).numpy()), ValueError, 'got shape (2, 3)'),
    (lambda: percentiles(torch.tensor(3.0)), ValueError, 'got shape ()'),
    (lambda: percentiles(3), TypeError, 'expected a 1-D sequence of numbers, got int'),
    (lambda: percentiles(['a', 'b']), TypeError, "expected a flat list of numbers, got ['a', 'b']"),
    (lambda: percentiles([1.0], qs=(101,)), ValueError, 'q = 101: expected a number in [0, 100]'),
    (lambda: StepTimer('engine'), TypeError, 'StepTimer: expected an LLMEngine, got str'),
    (lambda: StepTimer(_LLM.llm_engine, clock=3), TypeError, 'clock must be callable'),
    (lambda: host_step_times(_LLM, 0), ValueError, 'host_step_times: n = 0'),
    (lambda: host_step_times(_LLM, 2, steps=60), ValueError, 'do not fit max_model_len = 64'),
    (lambda: NullStepModel(_LLM.llm_engine.kv_cache_config, TINY, vocab=0), ValueError, 'vocab = 0'),
    (lambda: InputBuffers(_LLM.llm_engine.kv_cache_config.groups, rows=0), ValueError, 'rows = 0'),
    (lambda: InputBuffers(_LLM.llm_engine.kv_cache_config.groups).assign(['nope'], [None]), RuntimeError,
     "request 'nope' was never started in this runner"),
    (lambda: TapContexts(0), ValueError, 'window = 0'),
    (lambda: TapContexts(4).keep([0, 1], [0], [1, 1], torch.zeros(2, 3)), ValueError, '2 rows, 1 starts and 2 counts'),
    (lambda: TapContexts(4).keep([0], [0], [0], torch.zeros(0, 3)), ValueError, 'counts >= 1'),
    (lambda: TapContexts(4).keep([2, 2], [0, 0], [1, 1], torch.zeros(2, 3)), ValueError, 'a row twice'),
    (lambda: TapContexts(4).keep([0], [0], [2], torch.zeros(3, 3)), ValueError,
     'taps of shape (3, 3); expected (2, width)'),
    (lambda: TapContexts(4).read([0, 1], [3]), ValueError, '2 rows and 1 ends'),
    (lambda: LLM(MODEL, gpu_memory_utilization=1.5), ValueError, 'gpu_memory_utilization = 1.5'),
    (lambda: LLM(MODEL, gpu_memory_utilization=True), ValueError, 'gpu_memory_utilization = True'),
    (lambda: kv_pool_blocks(_LLM.llm_engine.kv_cache_config, 0, 0.9, 1, 2), ValueError, 'max_num_seqs = 0'),
    (lambda: kv_pool_blocks(_LLM.llm_engine.kv_cache_config, 4, 0.0, 1, 2), ValueError, 'utilization = 0.0'),
    (lambda: kv_pool_blocks(_LLM.llm_engine.kv_cache_config, 4, True, 1, 2), ValueError, 'utilization = True'),
    (lambda: kv_pool_blocks(_LLM.llm_engine.kv_cache_config, 4, 0.9, 3, 2), ValueError, 'free_bytes = 3'),
    (lambda: kv_pool_blocks(_LLM.llm_engine.kv_cache_config, 4, 0.9, 10**6, 10**9), ValueError,
     'gpu_memory_utilization = 0.9 leaves 0 B of the GPU'),
    (lambda: LLM(MODEL, warm_up_prefill='yes'), TypeError, "warm_up_prefill = 'yes'; expected None or a bool"),
    (lambda: LLM(MODEL, check_values=1), TypeError, "check_values = 1; expected a bool"),
    (lambda: warm_up_lengths(0, 8), ValueError, 'warm_up_lengths: budget = 0'),
    (lambda: warm_up_lengths(8, 2.5), TypeError, 'warm_up_lengths: longest must be an int'),
    (lambda: _LLM.llm_engine.warm_up_prefill([4, 64]), ValueError,
     'a length of 64 tokens; at most max_model_len - 1 = 63'),
    (lambda: _LLM.llm_engine.warm_up_prefill([0]), ValueError, 'a length = 0; expected at least 1'),
    (lambda: _LLM.llm_engine.warm_up_prefill(8), TypeError, 'expected a list of prompt lengths, got int'),
    (lambda: _LLM.llm_engine.warm_up_prefill([[]]), ValueError, 'a step of 0 prompts; expected 1 to max_num_seqs'),
    (lambda: _LLM.llm_engine.warm_up_prefill([[1] * 257]), ValueError, 'a step of 257 prompts'),
    (lambda: _LLM.llm_engine.warm_up_prefill([[8000, 8000, 8000]]), ValueError,
     'a length of 8000 tokens; at most max_model_len - 1 = 63'),
    (lambda: LLM(MODEL, runner='recompute', max_model_len=64, max_num_batched_tokens=32).llm_engine
     .warm_up_prefill([[20, 20]]), ValueError, 'a step of 40 tokens; at most the step\'s budget'),
    (lambda: warm_up_steps(64, 0, 4), ValueError, 'warm_up_steps: longest = 0'),
    (lambda: warm_up_steps(-1, 8, 4), ValueError, 'warm_up_steps: budget = -1'),
    (lambda: warm_up_steps(64, 8, None), TypeError, 'warm_up_steps: max_seqs must be an int'),
    (lambda: graphs_held(_LLM), TypeError, 'graphs_held: expected an LLMEngine, got LLM'),
    (lambda: step_sizes(_LLM).__enter__(), TypeError, 'step_sizes: expected an LLMEngine, got LLM'),
    (lambda: load_shape(0, 4, cfg=TINY), ValueError, 'load_shape: budget = 0'),
    (lambda: load_shape(64, 0, cfg=TINY), ValueError, 'load_shape: n = 0'),
    (lambda: load_shape(64, 4, prompt_len=2.0, cfg=TINY), TypeError, 'load_shape: prompt_len must be an int'),
    (lambda: load_shape(64, 4, max_tokens=0, cfg=TINY), ValueError, 'load_shape: max_tokens = 0'),
    (lambda: load_shape(64, 4, cfg='tiny'), TypeError, 'load_shape: cfg must be a ModelConfig or None, got str'),
    (lambda: random_byte_prompts(0, 8), ValueError, 'random_byte_prompts: n = 0'),
    (lambda: random_byte_prompts(2, True), TypeError, 'random_byte_prompts: length must be an int'),
    (lambda: random_byte_prompts(2, 8, seed=-1), ValueError, 'random_byte_prompts: seed = -1'),
]

@pytest.mark.parametrize('f,exc,msg', BAD, ids=[m for *_, m in BAD])
def test_bad_input(f, exc, msg):
    free = free_blocks(_LLM)
    fails_with(f, contains=msg)
    with pytest.raises(exc): f()
    assert free_blocks(_LLM) == free and not _LLM.llm_engine.has_unfinished_requests()   # nothing leaked


# ---------------------------------------------------------------- the sampler
@given(st.integers(1, 4), st.integers(1, 300), st.sampled_from([0, 1, 7, 64, 299, None]),
       st.integers(0, 2**31 - 1), st.booleans())
def test_argmax_rows_equals_argmax(N, V, chunk, seed, ties):
    "The two-pass argmax gives argmax's index, first maximum on ties, whatever the chunk (None: the device's default)"
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (N, V), generator=g).float() if ties else torch.randn(N, V, generator=g)
    x[0, torch.randint(0, V, (1,), generator=g)] = -torch.inf
    assert torch.equal(argmax_rows(x, chunk), x.argmax(-1))

def test_argmax_chunk_divides_the_row_when_it_can():
    from dsv41_nb.sampler import _argmax_chunk
    assert (_argmax_chunk(129280, 1024) == 1280 and _argmax_chunk(4096, 1024) == 1024
            and _argmax_chunk(1031, 1024) == 1031)
    # a prime: no divisor in [1024, 2048), pad instead
    assert _argmax_chunk(4099, 1024) == 1024

params_st = st.builds(
    lambda t, k, p, m, greedy: SamplingParams(temperature=0 if greedy else t, top_k=k, top_p=p, min_p=m),
    st.floats(0.05, 3), st.one_of(st.just(-1), st.integers(1, 20)), st.one_of(st.just(1.0), st.floats(0.01, 1)),
    st.one_of(st.just(0.0), st.floats(0, 1)), st.booleans())

@given(st.integers(2, 64), st.lists(params_st, min_size=1, max_size=8), st.integers(0, 2**31 - 1), st.booleans())
def test_batched_probs_equal_reference(V, params, seed, ties):
    """Every mask as the oracle defines it; probabilities to float32 accuracy (the sum's V and the
    logits' 2|x| units of roundoff)"""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(-3, 4, (len(params), V), generator=g).float() if ties
              else torch.randn(len(params), V, generator=g) * 4)
    got = sampling_probs(logits, sampling_batch(params, vocab_size=V))
    ref = torch.stack([reference_probs(l, p) for l, p in zip(logits, params)])
    assert not (got[ref == 0] > 0).any() and (got[ref > 1e-30] > 0).all()     # masks; float32 may underflow below 1e-38
    x = max((l / (p.temperature or 1)).abs().max().item() for l, p in zip(logits, params))      # largest tempered logit
    torch.testing.assert_close(got.double(), ref, rtol=4 * (V + 2 * x) * 2 ** -24, atol=1e-12)

def test_probs_at_the_edges_of_top_k_and_top_p():
    "top_k 1 and the vocabulary size, and top_p exactly the mass of the tokens kept so far (exact binary fractions)"
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, -1.0, 3.0, 0.5]])
    cases = [(SamplingParams(top_p=0.5), [[0.5, 0.5, 0, 0], None]),        # ties: the lower ids first
             (SamplingParams(top_p=0.75), [[1 / 3, 1 / 3, 1 / 3, 0], None]),
             (SamplingParams(top_k=1), [[0.25] * 4, [0, 0, 1, 0]]),             # ties at the k-th value stay
             (SamplingParams(top_k=4), [[0.25] * 4, None])]
    for sp, want in cases:
        ref = torch.stack([reference_probs(l, sp) for l in logits])
        got = sampling_probs(logits, sampling_batch([sp] * 2, vocab_size=4)).double()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-12)
        for r, w in zip(ref, want):
            if w is not None: torch.testing.assert_close(r, torch.tensor(w, dtype=torch.float64))
    assert torch.equal(reference_probs(logits[1], SamplingParams(top_k=4)), logits[1].double().softmax(0))

@pytest.mark.parametrize('sp', [SamplingParams(temperature=0.8), SamplingParams(top_k=3), SamplingParams(top_p=0.6),
                                SamplingParams(min_p=0.2, temperature=1.5),
                                SamplingParams(top_k=5, top_p=0.9, min_p=0.05)])
def test_draws_follow_the_distribution(sp):
    "Chi-square on 8 tokens: plain draws, and draws that verify a fixed draft, both follow the oracle's distribution"
    n, logits = 40_000, torch.tensor([1.5, 1.0, 0.7, 0.2, 0.0, -0.4, -1.0, -2.0])
    p = reference_probs(logits, sp)
    sb = sampling_batch([sp] * n, vocab_size=8)
    P = sampling_probs(logits.expand(n, -1), sb)
    _, plain = draw(P, torch.full((n,), -1), sb, torch.Generator().manual_seed(11))
    acc, tok = draw(P, torch.full((n,), 1), sb, torch.Generator().manual_seed(12))
    for t in (plain, torch.where(acc, 1, tok)):
        assert chi_square_pvalue(torch.bincount(t, minlength=8), p) > 1e-3
    assert chi_square_pvalue(torch.bincount(plain, minlength=8), torch.full((8,), 1 / 8)) < 1e-3    # the test has power

def test_seeded_rows_ignore_their_neighbours():
    "A seeded row's token and acceptance come from its own generator only"
    def run(others):
        sps = [SamplingParams(seed=3, temperature=0.9)] + [SamplingParams(temperature=0.5)] * others
        gens = [torch.Generator().manual_seed(3)] + [None] * others
        logits = torch.randn(1 + others, 50, generator=torch.Generator().manual_seed(others))
        logits[0] = torch.linspace(-2, 2, 50)
        sb = sampling_batch(sps, gens, 50)
        return [x[0].item()
                for x in draw(sampling_probs(logits, sb), torch.full((1 + others,), 40), sb, torch.Generator())]
    assert len({tuple(run(k)) for k in (0, 1, 4, 31)}) == 1

@given(st.lists(st.integers(0, 258), max_size=200), st.integers(1, 9))
def test_incremental_text_equals_decode(ids, chunk):
    d = IncrementalDetokenizer()
    pieces = ([d.add(ids[i:i + chunk], final=i + chunk >= len(ids)) for i in range(0, len(ids), chunk)]
              or [d.add([], final=True)])
    assert ''.join(pieces) == d.text == TOK.decode(ids)


# ---------------------------------------------------------------- the engine against plain greedy generation
def outputs(llm, prompts=PROMPTS, sp=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

@pytest.mark.parametrize('kw', [dict(runner='recompute', num_speculative_tokens=3, max_num_batched_tokens=8),
                                dict(runner='recompute', async_scheduling=True, max_num_batched_tokens=16),
                                dict(runner='paged', max_num_batched_tokens=16),
                                dict(runner='paged', num_speculative_tokens=2, enable_prefix_caching=False)],
                         ids=['recompute-chunked-ngram', 'recompute-async', 'paged-chunked', 'paged-ngram'])
def test_greedy_equals_generate_greedy(kw):
    llm = LLM(MODEL, **{**EXACT, **kw})
    got = outputs(llm)
    assert got == EXPECTED if kw['runner'] == 'recompute' else match(PROMPTS, got)     # recompute: the same arithmetic
    assert (free_blocks(llm) == llm.llm_engine.kv_cache_config.num_usable_blocks
            or llm.llm_engine.args.enable_prefix_caching)

def test_decode_columns_are_applied_as_columns_whatever_class_carries_them(monkeypatch):
    """The engine applies an all-decode step's answer as columns because the answer says so (`columns`), not because of
    its class: answers of a copy of DecodeCoreOutputs (what a notebook that re-ran 12a_decode_step's cells leaves
    `_update_decode` handing out) are applied without reading one EngineCoreOutput out of them, and the tokens are the
    reference's"""
    Copy = type('DecodeCoreOutputs', DecodeCoreOutputs.__bases__,
                {k: v for k, v in vars(DecodeCoreOutputs).items() if k not in ('__dict__', '__weakref__')})
    made, read, update = [], [], Scheduler._update_decode
    monkeypatch.setattr(Copy, '__getitem__', lambda self, i: read.append(i) or DecodeCoreOutputs.__getitem__(self, i))
    def copied(self, so, mro):
        got = update(self, so, mro)
        return got if got is None else made.append(1) or Copy(got.req_ids, got.token_ids, got.finished)
    monkeypatch.setattr(Scheduler, '_update_decode', copied)
    assert outputs(LLM(MODEL, **{**EXACT, 'runner': 'recompute'})) == EXPECTED
    assert made and not read


def test_speculative_by_name():
    "speculative='ngram' builds the n-gram proposer (its default count, or the one asked for) and decodes as it does"
    assert {'ngram'} <= set(SPECULATIVE_METHODS)
    default, three = (LLM(MODEL, runner='recompute', max_model_len=64, speculative='ngram', **kw).llm_engine
                      for kw in ({}, dict(num_speculative_tokens=3)))
    assert isinstance(default.proposer, NgramProposer) and default.proposer.num_speculative_tokens == NGRAM_TOKENS
    assert three.proposer.num_speculative_tokens == 3 and three.scheduler.config.num_speculative_tokens == 3
    by_name = outputs(LLM(MODEL,
                          **{**EXACT, 'runner': 'recompute', 'speculative': 'ngram', 'num_speculative_tokens': 3}))
    assert by_name == EXPECTED

def test_a_registered_method_gets_the_engine_and_the_count():
    "A method registered by name is called with the engine (model, args, max_model_len) and num_speculative_tokens"
    seen = []
    def make(eng, k):
        seen.append((eng.model is MODEL, eng.max_model_len, eng.args.drafter, k)); return NgramProposer(k or 1)
    register_speculative('test-method', make)
    try: eng = LLM(MODEL, runner='recompute', max_model_len=64, speculative='test-method', num_speculative_tokens=2,
                   drafter='d.safetensors').llm_engine
    finally: del SPECULATIVE_METHODS['test-method']
    assert seen == [(True, 64, 'd.safetensors', 2)] and eng.proposer.num_speculative_tokens == 2

class WrongDrafts:
    "A proposer whose drafts the model rarely picks: nearly every step rolls rejected rows back"
    num_speculative_tokens = 2
    def propose(self, requests): return [[(r[-1] + 1) % 256] * 2 for r in requests]

@pytest.mark.parametrize('runner', ['recompute', 'paged'])
def test_rejected_drafts_roll_back(runner):
    llm = LLM(MODEL, proposer=WrongDrafts(), **{**EXACT, 'runner': runner})
    got = outputs(llm, PROMPTS[:2])
    assert got == EXPECTED[:2] if runner == 'recompute' else match(PROMPTS[:2], got)
    assert llm.llm_engine.scheduler.stats['draft_tokens'] > llm.llm_engine.scheduler.stats['accepted_tokens']

LONG = [generate_greedy(MODEL, p, 16) for p in PROMPTS[:2]]       # prompt, then 16 greedy tokens

class PartlyRightDrafts:
    """Drafts whose first (length // 3 % 4) tokens are the greedy continuation, the rest wrong: 0 to
    3 accepted, every ring parity"""
    num_speculative_tokens = 3
    def propose(self, requests):
        out = []
        for r in map(list, requests):
            full = next((f for f in LONG if f[:len(r)] == r), [])           # [] once a run has left the greedy path
            nxt = lambda j: full[j] if j < len(full) else 0
            k = len(r) // 3 % 4
            out.append([nxt(j) for j in range(len(r), len(r) + k)]
                       + [(nxt(j) + 1) % 256 for j in range(len(r) + k, len(r) + 3)])
        return out

def test_partly_accepted_drafts_roll_back():
    "The paged path over drafts accepted 0 to 3 at a time: the same tokens as plain greedy decoding"
    llm = LLM(MODEL, proposer=PartlyRightDrafts(), **{**EXACT, 'runner': 'paged'})
    match(PROMPTS[:2], outputs(llm, PROMPTS[:2], replace(GREEDY, max_tokens=16)),
          [f[len(p):] for f, p in zip(LONG, PROMPTS)])
    st = llm.llm_engine.scheduler.stats
    assert 0 < st['accepted_tokens'] < st['draft_tokens']
    assert llm.llm_engine.runner.model.ring_restores > 0          # some steps started in the middle of a ring pair

@pytest.mark.parametrize('async_scheduling', [False, True])
def test_verification_steps_replay_from_graphs(async_scheduling):
    """Steps that verify drafts (each request's row and its drafts, every row sampled) replay from graphs of their
    own, which record the ring rows a rollback restores: plain greedy decoding's tokens, as the eager path gives"""
    from dsv41_nb.paged_step import step_model
    box = {}
    def build(kc):
        box['cg'] = CUDAGraphModel(step_model(MODEL, kc), kc, 256, capture_sizes=(1, 2, 4, 8), emulate=True)
        return box['cg']
    kw, sp = {**EXACT, 'runner': 'paged', 'max_model_len': 256}, replace(GREEDY, max_tokens=16)
    want = outputs(LLM(MODEL, proposer=PartlyRightDrafts(), **kw), PROMPTS[:2], sp)
    llm = LLM(MODEL, proposer=PartlyRightDrafts(), step_model=build, async_scheduling=async_scheduling, **kw)
    got = outputs(llm, PROMPTS[:2], sp)
    assert got == want
    match(PROMPTS[:2], got, [f[len(p):] for f, p in zip(LONG, PROMPTS)])
    cg = box['cg']
    assert 8 in cg.journaled and cg.stats['replayed'] > 0 and cg.model.ring_restores > 0, cg

@pytest.mark.parametrize('async_scheduling', [False, True])
def test_graphs_captured_at_start(async_scheduling):
    """capture_at_start: every decode graph up to max_num_seqs requests and every verifying graph up to their rows are
    held before the first request, the warm-up request leaves no request or block behind, serving captures nothing
    more, and the tokens are the eager engine's"""
    box = {}
    def build(kc):
        box['cg'] = CUDAGraphModel(paged_step_model(MODEL, kc), kc, 256, capture_sizes(3, 3), emulate=True)
        return box['cg']
    kw, sp = {**EXACT, 'runner': 'paged', 'max_num_seqs': 3}, replace(GREEDY, max_tokens=16)
    eager = LLM(MODEL, proposer=PartlyRightDrafts(), async_scheduling=async_scheduling, **kw)
    llm = LLM(MODEL, proposer=PartlyRightDrafts(), step_model=build, async_scheduling=async_scheduling,
              capture_at_start=True, **kw)
    cg, eng = box['cg'], llm.llm_engine
    # 3 requests pad to 4 rows; with 3 drafts each, 12 rows pad to 16
    assert (sorted(cg.graphs), sorted(cg.journaled)) == ([1, 2, 4], [1, 2, 4, 8, 16]), cg
    assert graphs_held(eng) == dict(decode=3, verify=5, drafter=0)
    assert not eng.has_unfinished_requests() and not eng.tracked and free_blocks(llm) == free_blocks(eager)
    held = [{s: id(g) for s, g in d.items()} for d in (cg.graphs, cg.journaled)]
    got = outputs(llm, PROMPTS[:2], sp)
    assert got == outputs(eager, PROMPTS[:2], sp)
    assert [{s: id(g) for s, g in d.items()} for d in (cg.graphs, cg.journaled)] == held
    assert cg.stats['replayed'] > 0 and eng.scheduler.stats['accepted_tokens'] > 0, cg
    assert eng.capture_graphs() == dict(decode=[], verify=[])     # all held: nothing captured again

def test_capture_graphs_refuses_a_busy_engine():
    "Graphs are captured before requests come: with one queued, capture_graphs names why and the request stays"
    def build(kc): return CUDAGraphModel(paged_step_model(MODEL, kc), kc, 256, (1, 2), emulate=True)
    llm = LLM(MODEL, step_model=build, **EXACT)
    eng, free = llm.llm_engine, free_blocks(llm)
    eng.add_request('a', PROMPTS[0], GREEDY)
    fails_with(eng.capture_graphs, contains='the engine is serving requests')
    assert eng.has_unfinished_requests() and 'a' in eng.tracked
    eng.abort_request('a')
    assert free_blocks(llm) == free and not eng.has_unfinished_requests()
    assert LLM(MODEL, **EXACT).llm_engine.capture_graphs() == {}           # no graphs on this CPU: none to capture


def test_warm_up_lengths():
    "Each power-of-two class of token counts up to the top: its top (a multiple of 16 from 16 on) and its bottom"
    assert warm_up_lengths(16384, 255) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 255]
    assert warm_up_lengths(20, 100) == warm_up_lengths(100, 20) == [1, 2, 3, 4, 5, 8, 9, 16, 17, 20]
    assert warm_up_lengths(1, 1) == [1] and warm_up_lengths(64, 1000)[-3:] == [32, 33, 64]


def test_warm_up_steps():
    "Every class of the budget, in steps of prompts no longer than the longest, as few and as even as can be"
    assert warm_up_steps(40, 255, 256) == [[n] for n in warm_up_lengths(40, 40)]
    steps = warm_up_steps(16384, 223, 256)
    assert [sum(s) for s in steps] == warm_up_lengths(16384, 16384)           # every class of the budget
    assert all(max(s) <= 223 and max(s) - min(s) <= 1 and len(s) == -(-sum(s) // 223) for s in steps)
    assert steps[-1] == [222] * 30 + [221] * 44                                # 16,384 tokens in 74 prompts
    assert [sum(s) for s in warm_up_steps(16384, 159, 8)][-2:] == [1025, 1272]  # 8 prompts hold 1,272 tokens


@pytest.mark.parametrize('async_scheduling', [False, True], ids=['sync', 'async'])
def test_warm_up_prefill(async_scheduling):
    """warm_up_prefill: one prefill step of each length, no request, block or cached prefix left behind, and the
    engine serves afterwards as a fresh one; built with warm_up_prefill=True it warms every class of the budget"""
    kw = {**EXACT, 'runner': 'paged', 'async_scheduling': async_scheduling, 'max_num_batched_tokens': 40}
    llm, fresh = LLM(MODEL, warm_up_prefill=True, **kw), LLM(MODEL, **kw)
    eng = llm.llm_engine
    assert eng.start_up == dict(graphs={}, prefill=[[n] for n in warm_up_lengths(40, 40)])
    assert 'prefill' not in fresh.llm_engine.start_up              # on a CPU, only when asked
    assert 'prefill' not in LLM(MODEL, capture_at_start=True, **kw).llm_engine.start_up
    with step_sizes(eng) as seen: assert eng.warm_up_prefill([7, 33, [20, 20]]) == [[7], [33], [20, 20]]
    assert [n for n in seen if n] == [7, 33, 40]                    # async: a step of none while one is in flight
    assert 'schedule' not in vars(eng.scheduler)                    # the scheduler's own method again
    assert not eng.has_unfinished_requests() and not eng.tracked
    assert free_blocks(llm) == free_blocks(fresh)
    assert not eng.scheduler.kv.block_pool.cached_block_hash_to_block          # the prefix cache emptied
    assert outputs(llm, PROMPTS, GREEDY) == outputs(fresh, PROMPTS, GREEDY)
    assert eng.scheduler.stats['prefix_hit_tokens'] == 0


def test_warm_up_refuses_a_busy_engine_and_leaves_nothing_when_a_step_fails():
    llm = LLM(MODEL, **EXACT)
    eng, free = llm.llm_engine, free_blocks(llm)
    eng.add_request('a', PROMPTS[0], GREEDY)
    fails_with(lambda: eng.warm_up_prefill([3]), contains='LLMEngine.warm_up_prefill: the engine is serving')
    assert 'a' in eng.tracked
    eng.abort_request('a')
    def broken(): raise RuntimeError('the step broke')
    eng.step = broken
    with step_sizes(eng) as seen:
        fails_with(lambda: eng.warm_up_prefill([3, 5]), contains='the step broke')
    del eng.step
    assert seen == [] and 'schedule' not in vars(eng.scheduler)
    assert not eng.has_unfinished_requests() and not eng.tracked and free_blocks(llm) == free


def test_preempted_requests_give_the_same_tokens():
    "A pool too small for all four requests at once: some are preempted, recompute, and still match"
    llm = LLM(MODEL, **{**EXACT, 'max_model_len': 64}, num_gpu_blocks=12, enable_prefix_caching=False)
    match(PROMPTS, outputs(llm))
    assert llm.llm_engine.scheduler.stats['preemptions'] > 0

def test_seeded_requests_reproducible_whatever_the_batch():
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=8)
    llm = LLM(MODEL, **EXACT)
    alone = outputs(llm, [PROMPTS[0]], sp)[0]
    crowd = outputs(llm, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], [SamplingParams(seed=1), sp, SamplingParams()])
    assert crowd[1] == alone

def test_steps_verifying_drafts_replay_past_256_rows():
    """The engine's capture sizes reach past 256 rows when requests verify drafts (vLLM's default cap, 512, or
    max_cudagraph_capture_size); a verifying step of 33 requests x 8 rows replays from its graph (emulated), journaled,
    and greedy output is the eager engine's"""
    eng = LLM(MODEL, max_model_len=64, num_speculative_tokens=3).llm_engine
    assert eng.capture_sizes == capture_sizes(256, 3) and eng.capture_sizes[-1] == 512
    assert LLM(MODEL, max_model_len=64, max_cudagraph_capture_size=40).llm_engine.capture_sizes[-1] == 40
    class Seven:            # seven drafts a request, the most a paged step can undo: wrong ones, verified all the same
        num_speculative_tokens = 7
        def propose(self, lists): return [[(t[-1] + 1 + j) % TINY.vocab_size for j in range(7)] for t in lists]
    box, prompts = {}, [[3 + i % 200, 7, 11 + i % 100] for i in range(33)]     # 33 x 8 = 264 rows
    def graphs(kc):
        box['cg'] = CUDAGraphModel(paged_step_model(MODEL, kc), kc, 256, capture_sizes(33, 7), emulate=True)
        return box['cg']
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)   # room for seven drafts after the first
    got = outputs(LLM(MODEL, **EXACT, proposer=Seven(), step_model=graphs), prompts, sp)
    assert got == outputs(LLM(MODEL, **EXACT), prompts, sp)
    assert padded_batch_size(264, capture_sizes(33, 7)) in box['cg'].journaled, box['cg']


def test_abort_frees_blocks():
    llm = LLM(MODEL, **EXACT)
    eng, free = llm.llm_engine, free_blocks(llm)
    eng.add_request('a', PROMPTS[2], SamplingParams(max_tokens=40))
    eng.add_request('b', PROMPTS[0], GREEDY)
    eng.step(); eng.step()
    assert free_blocks(llm) < free
    assert eng.abort_request('a').outputs[0].finish_reason == 'abort'
    while eng.has_unfinished_requests(): eng.step()
    assert free_blocks(llm) == free

def test_rejected_prompts_leak_nothing():
    "A batch whose last prompt is bad: none of it is queued; the pool and the engine are as before"
    llm = LLM(MODEL, **EXACT)
    free = free_blocks(llm)
    for bad in ([7] * 257, [], [1, 2, 600], ''):
        with pytest.raises(ValueError): llm.generate([PROMPTS[0], PROMPTS[1], bad], GREEDY, use_tqdm=False)
        assert free_blocks(llm) == free and not llm.llm_engine.has_unfinished_requests()

def test_stream_deltas_add_up_and_closing_aborts():
    llm = LLM(MODEL, **EXACT)
    got = {}
    for o in llm.stream(PROMPTS[:2], GREEDY): got.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    match(PROMPTS[:2], [got[k] for k in sorted(got, key=int)])
    free, s = free_blocks(llm), llm.stream(PROMPTS[0], SamplingParams(max_tokens=50))
    next(s); s.close()
    assert free_blocks(llm) == free and not llm.llm_engine.has_unfinished_requests()


# ---------------------------------------------------------------- CUDA graph padding (emulated on the CPU)
class TensorOnly:
    """Logits from each logits row's token, position, sequence length and first window block:
    tensors only, as a graph needs"""
    supports_cuda_graphs = True
    def __init__(self):
        self.table = torch.randn(TINY.vocab_size, TINY.vocab_size,
                                 generator=torch.Generator().manual_seed(0))
    def forward(self, b):
        r = b.logits_indices
        req = torch.searchsorted(b.query_start_loc[1:].long(), r, right=True)
        return (self.table[b.token_ids[r]] + 0.01 * b.positions[r, None]
                + 0.1 * b.block_tables[1][req, :1] + 0.001 * b.seq_lens[req, None])
    def release(self, ids): pass

@pytest.mark.parametrize('n', [1, 3, 7, 8, 11])
def test_padded_replay_equals_eager(n):
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, max_model_len=256))
    cg = CUDAGraphModel(TensorOnly(), kc, 256, capture_sizes=(2, 8), emulate=True)
    s, r = Scheduler(kc, SchedulerConfig()), ModelRunner(cg, kc)
    for i in range(n): s.add_request(f'q{i}', PROMPTS[i % 4][: 1 + i % 5], SamplingParams(max_tokens=4))
    o = s.schedule(); s.update_from_output(o, r.execute_model(o))                  # the prefill
    b, _ = r.prepare_inputs(s.schedule())
    torch.testing.assert_close(cg.forward(b), cg.model.forward(b), rtol=0, atol=0)
    assert cg.stats['replayed'] == (padded_batch_size(n, (2, 8)) is not None)
    padded = pad_decode_batch(b, 16, cg.widths)
    assert (padded.slot_mappings.swa[n:] == -1).all() and (padded.block_tables[0][n:] == 0).all()


class Prepared(TensorOnly):
    """TensorOnly split as a graph-capable step model is: prepare on the host, run on the device;
    token 7 is not replayable"""
    def prepare(self, b): return SimpleNamespace(batch=b, replayable=7 not in b.token_ids.tolist())
    def run(self, inputs): return self.forward(inputs.batch)


def test_unreplayable_decode_steps_run_eagerly():
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, max_model_len=256))
    cg = CUDAGraphModel(Prepared(), kc, 256, capture_sizes=(4,), emulate=True)
    s, r = Scheduler(kc, SchedulerConfig()), ModelRunner(cg, kc)
    for i in range(3): s.add_request(f'q{i}', PROMPTS[i][:4], SamplingParams(max_tokens=4))
    o = s.schedule(); s.update_from_output(o, r.execute_model(o))                  # the prefill
    b, _ = r.prepare_inputs(s.schedule())
    want = cg.model.forward(b)
    torch.testing.assert_close(cg.forward(b), want, rtol=0, atol=0)                  # replayed
    b.token_ids[1] = 7
    torch.testing.assert_close(cg.forward(b), cg.model.forward(b), rtol=0, atol=0)   # the padded step, run eagerly
    assert cg.stats == dict(replayed=1, eager=2, captured=0), cg.stats


class CopiesIds(Prepared):
    "A step model whose prepare copies the batch's ids: a graph model cannot fill rows of them on the device"
    def prepare(self, b): return SimpleNamespace(batch=replace(b, token_ids=b.token_ids.clone()), replayable=True)

def test_device_fills_need_the_ids_passed_through():
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, max_model_len=256))
    s = Scheduler(kc, SchedulerConfig())
    for i in range(2): s.add_request(f'q{i}', PROMPTS[i][:4], SamplingParams(max_tokens=4))
    r = ModelRunner(CUDAGraphModel(Prepared(), kc, 256, emulate=True), kc)
    o = s.schedule(); s.update_from_output(o, r.execute_model(o))                  # the prefill
    # a decode batch of 2, built on the host
    b, _ = r.prepare_inputs(s.schedule())
    b.token_fill = [(1, torch.tensor([5, 9]), 1)]
    ok = CUDAGraphModel(Prepared(), kc, 256, capture_sizes=(2,), emulate=True)
    torch.testing.assert_close(ok.forward(b),
                               ok.model.forward(replace(b, token_ids=torch.tensor([b.token_ids[0].item(), 9]))))
    with pytest.raises(RuntimeError, match='does not pass the batch'):
        CUDAGraphModel(CopiesIds(), kc, 256, capture_sizes=(2,), emulate=True).forward(b)


def test_paged_graph_replay_equals_eager():
    "The paged step model under CUDAGraphModel (emulated: each decode step run as a capture, on the captured buffers)"
    from dsv41_nb.paged_step import step_model
    g, box = torch.Generator().manual_seed(1), {}
    prompts = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (80, 5, 40)]
    def emulated(kc):
        box['cg'] = CUDAGraphModel(step_model(MODEL, kc), kc, 256, capture_sizes=(1, 2, 4), emulate=True)
        return box['cg']
    sp, args = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), dict(max_model_len=256, kernels='torch')
    eager = [o.outputs[0].token_ids for o in LLM(MODEL, **args).generate(prompts, sp, use_tqdm=False)]
    replayed = [o.outputs[0].token_ids
                for o in LLM(MODEL, step_model=emulated, **args).generate(prompts, sp, use_tqdm=False)]
    assert replayed == eager
    assert box['cg'].stats == dict(replayed=5, eager=1, captured=0) and sorted(box['cg'].graphs) == [4]


# ---------------------------------------------------------------- execution without waiting (async scheduling)
def _emulated_graphs(box):
    from dsv41_nb.paged_step import step_model
    def build(kc):
        box['cg'] = CUDAGraphModel(step_model(MODEL, kc), kc, 256, capture_sizes=(1, 2, 4), emulate=True)
        return box['cg']
    return build

@pytest.mark.parametrize('how', ['recompute', 'paged', 'graphs', 'graphs-seeded', 'graphs-preempted'])
def test_async_execution_gives_the_synchronous_tokens(how):
    """The runner not waiting for a step's ids (they reach the next step on the device): the tokens
    of synchronous execution"""
    g, box = torch.Generator().manual_seed(3), {}
    prompts = [torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist() for n in (30, 5, 17)]
    sp = [SamplingParams(temperature=0.9, seed=s, max_tokens=7) for s in (1, 2, 3)] if how == 'graphs-seeded' else \
         SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    kw = dict(EXACT, runner='recompute' if how == 'recompute' else 'paged', max_model_len=256)
    if how.startswith('graphs'): kw['step_model'] = _emulated_graphs(box)
    if how == 'graphs-preempted': kw.update(num_gpu_blocks=11, enable_prefix_caching=False)
    # synchronous, the same arithmetic (padded batches included)
    want = outputs(LLM(MODEL, **kw), prompts, sp)
    llm = LLM(MODEL, async_scheduling=True, **kw)
    assert outputs(llm, prompts, sp) == want
    eng = llm.llm_engine
    assert eng.runner.filled_rows > 0 and not eng.has_unfinished_requests()
    assert free_blocks(llm) == eng.kv_cache_config.num_usable_blocks or eng.args.enable_prefix_caching
    if how.startswith('graphs'): assert box['cg'].stats['replayed'] > 0
    if how == 'graphs-preempted': assert eng.scheduler.stats['preemptions'] > 0

# ---------------------------------------------------------------- speculation under async scheduling
@pytest.mark.parametrize('how', ['recompute-partly', 'recompute-wrong', 'paged-partly', 'paged-wrong',
                                 'paged-preempted'])
def test_async_speculation_gives_the_greedy_tokens(how):
    """Async scheduling with drafts: the scheduler plans each step as if every draft in flight were accepted, the
    runner moves the rows back to its own frontier; the tokens are plain greedy decoding's"""
    runner, what = how.split('-')
    kw = dict(EXACT, runner=runner, async_scheduling=True)
    if what == 'preempted': kw.update(max_model_len=64, num_gpu_blocks=12, enable_prefix_caching=False)
    kw['proposer'] = WrongDrafts() if what == 'wrong' else PartlyRightDrafts()
    prompts, n = (PROMPTS[:2], 16) if what == 'partly' else (PROMPTS, N_OUT)
    want = [f[len(p):] for f, p in zip(LONG, PROMPTS)] if n == 16 else EXPECTED
    llm = LLM(MODEL, **kw)
    got = outputs(llm, prompts, replace(GREEDY, max_tokens=n))
    assert got == want if runner == 'recompute' else match(prompts, got, want)
    eng = llm.llm_engine; st = eng.scheduler.stats
    assert st['draft_tokens'] > 0 and not eng.has_unfinished_requests()
    if what == 'partly': assert 0 < st['accepted_tokens'] < st['draft_tokens']
    if what == 'preempted': assert st['preemptions'] > 0
    assert free_blocks(llm) == eng.kv_cache_config.num_usable_blocks or eng.args.enable_prefix_caching

class FewerDrafts(PartlyRightDrafts):
    "PartlyRightDrafts cut to 0 to 3 drafts by the length of the request"
    def propose(self, requests): return [d[:len(r) % 4] for d, r in zip(super().propose(requests), requests)]

def test_async_speculation_runs_the_drafts_it_has():
    """A request whose proposer drafted fewer than the rows reserved runs only those: the runner's step has one row
    plus the drafts, at the runner's frontier; the scheduler counts the drafts verified"""
    llm = LLM(MODEL, **{**EXACT, 'runner': 'recompute'}, async_scheduling=True, proposer=FewerDrafts())
    eng, seen = llm.llm_engine, []
    run = eng.runner.execute_model
    eng.runner.execute_model = lambda so: (seen.append([(sr.start, sr.num_tokens, sr.num_draft_tokens)
                                                        for sr in so.requests]), run(so))[1]
    outputs(llm, PROMPTS[:1], replace(GREEDY, max_tokens=16))
    decode = [s for step in seen for s in step if s[0] >= len(PROMPTS[0])]
    assert decode and all(n == 1 + d and d <= 3 for _, n, d in decode)
    # each step starts after the last one's row and the drafts it accepted
    assert all(1 <= b[0] - a[0] <= 1 + a[2] for a, b in zip(decode, decode[1:]))
    assert any(b[0] - a[0] > 1 for a, b in zip(decode, decode[1:]))        # some drafts accepted
    assert any(d < 3 for *_, d in decode)                    # fewer than the 3 rows the scheduler reserved
    assert eng.scheduler.stats['draft_tokens'] == sum(d for *_, d in decode)

@use_kernels('torch')    # the mask is the model's, not a kernel's (the kernels are checked on their own)
def test_a_decode_step_masks_image_tokens_on_the_device():
    """A decode-only paged step reads no value back, yet an image token there still breaks Engram's
    n-grams (a mask on the device)"""
    from dsv41_nb.paged_step import step_model
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, max_model_len=256))
    s, m = Scheduler(kc, SchedulerConfig()), step_model(MODEL, kc)
    r = ModelRunner(m, kc)
    for i in range(2): s.add_request(f'q{i}', PROMPTS[i][:6], SamplingParams(max_tokens=4))
    o = s.schedule(); s.update_from_output(o, r.execute_model(o))                  # the prefill
    batch, _ = r.prepare_inputs(s.schedule())
    batch.token_ids[1] = TINY.image_token_id
    inputs = m.prepare(batch)
    assert inputs.step.decode_only
    # (the same caches, unwritten, for both)
    m.model.state = None; m.model.allocate()
    got = m.model(inputs.step)
    m.model.state = None; m.model.allocate()
    want = m.model(replace(inputs.step, decode_only=False))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------- the command line
@pytest.mark.parametrize('extra', [[], ['--async-scheduling']])
def test_cli_generate(tmp_path, extra):
    ck = random_checkpoint(tmp_path)
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', 'generate', 'the cat', '--checkpoint', str(ck),
                        '--max-tokens', '4', '--temperature', '0'] + extra, capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in os.environ.items()
                            if k != 'TRITON_INTERPRET'} | {'CUDA_VISIBLE_DEVICES': ''}, timeout=120)
    assert r.returncode == 0, r.stderr
    want = LLM(ck, kernels='torch').generate('the cat', SamplingParams(temperature=0, max_tokens=4),
                                             use_tqdm=False)[0].outputs[0]
    assert r.stdout == 'the cat' + want.text + '\n'
    assert f'{len(want.token_ids)} tokens in' in r.stderr and 'tokens/s' in r.stderr


def test_cli_bench_says_what_its_start_up_did(tmp_path):
    "bench's first line says how long the engine took to build and what it captured and warmed; the JSON keeps it"
    ck, js = random_checkpoint(tmp_path), tmp_path / 'b.json'
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', 'bench', '--checkpoint', str(ck), '--num-prompts', '2',
                        '--prompt-len', '4', '--max-tokens', '2', '--kernels', 'torch', '--no-progress',
                        '--json', str(js)], capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in os.environ.items()
                            if k != 'TRITON_INTERPRET'} | {'CUDA_VISIBLE_DEVICES': ''}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert ': 0 CUDA graphs held, 0 prefill steps warmed' in r.stdout.splitlines()[0], r.stdout
    rec = json.loads(js.read_text())['start_up']
    assert rec['graphs'] == {} and 'prefill' not in rec and rec['seconds'] > 0         # a CPU: nothing to warm


def test_cli_generate_with_the_dspark_drafter(tmp_path):
    """`--speculative dspark` loads the drafter beside the checkpoint: the tokens of LLM with
    `dspark_proposer`, and the drafts counted"""
    from dsv41_nb.checkpoint_files import load_model
    from dsv41_nb.dspark import Drafter
    from dsv41_nb.dspark_serving import save_drafter, dspark_proposer
    from dsv41_nb.checkpoint import DRAFTER_NAME
    ck = random_checkpoint(tmp_path)
    save_drafter(Drafter(load_model(ck)), ck / DRAFTER_NAME)
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', 'generate', 'the cat', '--checkpoint', str(ck),
                        '--max-tokens', '6', '--temperature', '0', '--speculative', 'dspark',
                        '--num-speculative-tokens', '3'],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={k: v for k, v in os.environ.items()
                            if k != 'TRITON_INTERPRET'} | {'CUDA_VISIBLE_DEVICES': ''})
    assert r.returncode == 0, r.stderr
    model = load_model(ck)
    llm = LLM(model, proposer=dspark_proposer(model, ck / DRAFTER_NAME, 3), kernels='torch')
    want = llm.generate('the cat', SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert r.stdout == 'the cat' + want.text + '\n'
    st = llm.llm_engine.scheduler.stats
    assert st['draft_tokens'] > 0 and (f"dspark: {st['accepted_tokens']} of {st['draft_tokens']} "
                                       "drafts accepted") in r.stderr


def test_dspark_reads_the_targets_streams_from_the_paged_step(tmp_path, monkeypatch):
    """With DSpark the runner keeps each request's last taps from the paged step: the drafter's
    contexts are the dense model's streams at the same positions (within the paged path's rounding),
    the target never runs again for them, and greedy output is unchanged; without the taps (a
    replayed step) the proposer runs the target itself"""
    from dsv41_nb.dspark import Drafter
    from dsv41_nb.dspark_decode import DSparkProposer
    from dsv41_nb.dspark_serving import dspark_proposer, save_drafter
    model, path = init_random(TINY, seed=3), tmp_path / 'drafter.safetensors'
    save_drafter(Drafter(model), path)
    prompts = [list(range(40, 70)), list(range(5, 12)), [7] * 25]
    sp = SamplingParams(temperature=0, max_tokens=12)
    want = [o.outputs[0].token_ids for o in LLM(model, kernels='torch').generate(prompts, sp, use_tqdm=False)]
    runs, orig = [], DSparkProposer._target_hidden
    monkeypatch.setattr(DSparkProposer, '_target_hidden', lambda self, ids: runs.append(len(ids)) or orig(self, ids))
    for taps in (True, False):
        llm = LLM(model, proposer=dspark_proposer(model, path, 3), kernels='torch')
        runner = llm.llm_engine.runner
        assert (runner.tap_model is not None) and runner.tap_model.tap_layers == TINY.dspark_target_layer_ids
        if not taps: runner.tap_model = None
        runs.clear()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want and (runs == [] if taps else len(runs) > 0)
    eng = LLM(model, proposer=dspark_proposer(model, path, 3), kernels='torch').llm_engine
    eng.add_request('a', prompts[0], SamplingParams(temperature=0, max_tokens=20))
    for _ in range(4): eng.step()
    end, h = eng.runner.context('a')
    seq = eng.runner.requests['a'].request.all_token_ids[:end]
    assert len(h) == Drafter(model).window and end == len(eng.runner.requests['a'].request.all_token_ids) - 1
    for shift, ok in ((0, True), (1, False)):
        dense = model(torch.tensor([seq[:end - shift]]), return_hidden=True)[1][0, -len(h):].float()
        err = ((h.float() - dense).norm(dim=-1) / dense.norm(dim=-1)).median()
        assert (err < 0.1) == ok, (shift, float(err))


def test_dspark_reads_the_taps_a_replayed_graph_writes(tmp_path, monkeypatch):
    """Decode steps replayed from CUDA graphs (emulated) hand the drafter the taps the graph wrote:
    adaptive DSpark that verifies nothing (every step a replay) never runs the target again, its
    contexts are those of the eager engine, and greedy output is unchanged"""
    from dsv41_nb.dspark import Drafter
    from dsv41_nb.dspark_decode import DSparkProposer
    from dsv41_nb.dspark_serving import dspark_proposer, save_drafter
    from dsv41_nb.paged_step import step_model
    from dsv41_nb.drafter_graphs import DraftPacer
    model, path, box = init_random(TINY, seed=3), tmp_path / 'drafter.safetensors', {}
    save_drafter(Drafter(model), path)
    def graphs(kc):
        box['cg'] = CUDAGraphModel(step_model(model, kc), kc, 256, capture_sizes=(1, 2, 4), emulate=True)
        return box['cg']
    prompts, sp = [list(range(40, 70)), list(range(5, 12)), [7] * 25], SamplingParams(temperature=0, max_tokens=10)
    runs, orig = [], DSparkProposer._target_hidden
    monkeypatch.setattr(DSparkProposer, '_target_hidden', lambda self, ids: runs.append(len(ids)) or orig(self, ids))
    never = dict(adaptive=True, step_cost=lambda T: T.double() ** 2)    # verifying anything costs more than it gains
    def paced(p):   # the priced backoff alone (no measured ledger): probes in a run this short
        p.pacer = DraftPacer(tolerance=None); return p
    got, ctx = {}, {}
    for mode in ('eager', 'graphs'):
        kw = dict(step_model=graphs) if mode == 'graphs' else {}
        llm = LLM(model, proposer=paced(dspark_proposer(model, path, 3, **never)), kernels='torch', **kw)
        got[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        eng = llm.llm_engine
        eng.add_request('a', prompts[0], sp)
        for _ in range(4): eng.step()
        ctx[mode] = eng.runner.context('a')
    assert box['cg'].stats['replayed'] >= 10 and runs == [], (box['cg'].stats, runs)
    assert got['graphs'] == got['eager'] == [o.outputs[0].token_ids for o in
                                             LLM(model, kernels='torch').generate(prompts, sp, use_tqdm=False)]
    assert ctx['graphs'][0] == ctx['eager'][0]
    torch.testing.assert_close(ctx['graphs'][1], ctx['eager'][1])
    monkeypatch.setattr(CUDAGraphModel, '_tap_layers', lambda self: ())    # a graph that keeps no taps
    llm = LLM(model, proposer=paced(dspark_proposer(model, path, 3, **never)), kernels='torch', step_model=graphs)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == got['eager'] and runs



@pytest.mark.parametrize('asyn', [False, True], ids=['sync', 'async'])
def test_adaptive_dspark_runs_the_steps_that_draft_nothing_plain(tmp_path, monkeypatch, asyn):
    """Adaptive DSpark whose drafts never pay: between its probes the engine plans and runs plain decode steps (no
    draft rows, no proposer call; async: launched without waiting), the taps are kept all along (the target never
    runs again for them), a probe after plain steps drafts, and greedy output is plain decoding's"""
    from dsv41_nb.dspark import Drafter
    from dsv41_nb.dspark_decode import DSparkProposer
    from dsv41_nb.dspark_serving import dspark_proposer, save_drafter
    from dsv41_nb.drafter_graphs import DraftPacer
    model, path = init_random(TINY, seed=3), tmp_path / 'drafter.safetensors'
    save_drafter(Drafter(model), path)
    prompts, sp = [list(range(40, 70)), list(range(5, 12)), [7] * 25], SamplingParams(temperature=0, max_tokens=40)
    want = [o.outputs[0].token_ids for o in LLM(model, kernels='torch').generate(prompts, sp, use_tqdm=False)]
    runs, calls = [], []
    orig, propose = DSparkProposer._target_hidden, DSparkProposer.propose
    monkeypatch.setattr(DSparkProposer, '_target_hidden', lambda self, ids: runs.append(len(ids)) or orig(self, ids))
    monkeypatch.setattr(DSparkProposer, 'propose', lambda self, *a, **k: calls.append(1) or propose(self, *a, **k))
    never = dict(adaptive=True, step_cost=lambda T: T.double() ** 2)
    prop = dspark_proposer(model, path, 3, **never)
    prop.pacer = DraftPacer(tolerance=None)   # the priced backoff alone: probes in a run this short
    llm = LLM(model, proposer=prop, kernels='torch', async_scheduling=asyn)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    runner, pacer = llm.llm_engine.runner, llm.llm_engine.proposer.pacer
    assert got == want and runs == []
    steps = llm.llm_engine.scheduler.step
    assert runner.plain_steps >= steps // 2 and len(calls) + runner.plain_steps <= steps, (runner.plain_steps, steps)
    assert pacer.stats['drafted'] >= 3 and pacer.stats['skipped'] >= runner.plain_steps, pacer.stats


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(1, 9), st.lists(st.tuples(st.sets(st.integers(0, 11), min_size=1, max_size=6), st.integers(1, 20),
                                           st.booleans(), st.booleans()), min_size=1, max_size=30))
def test_tap_contexts_equal_the_list_per_row(window, ops):
    """The ring of taps against the list of (position, tap) per row: random keeps (single positions and runs longer
    than the window, following on or not), resets, and reads at the right and a wrong end, every read compared; a new
    width starts again"""
    ring, ref, pos, g = TapContexts(window), ReferenceTapContexts(window), {}, torch.Generator().manual_seed(0)
    for rows, run, gap, reset in ops:
        rows = sorted(rows)
        if reset: ring.reset(rows); ref.reset(rows); [pos.pop(r, None) for r in rows]; continue
        starts = [pos.get(r, 0) + gap for r in rows]
        counts = [run if r % 2 else 1 for r in rows]
        taps = torch.randn(sum(counts), 3, generator=g)
        ring.keep(rows, starts, counts, taps); ref.keep(rows, starts, counts, taps)
        pos.update({r: s + c for r, s, c in zip(rows, starts, counts)})
        q = list(range(12))
        for e in ([pos.get(r, 0) for r in q], [pos.get(r, 0) + 1 for r in q]):
            for a, b in zip(ring.read(q, e), ref.read(q, e)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    ring.keep([20], [0], [1], torch.ones(1, 5))                           # another width: the old taps are gone
    assert ring.read([rows[0]], [pos.get(rows[0], 0)]) == [None]
    assert torch.equal(ring.read([20], [1])[0], torch.ones(1, 5))


@pytest.fixture(scope='module')
def cli_checkpoint(tmp_path_factory): return random_checkpoint(tmp_path_factory.mktemp('cli'))

CLI_BAD = [
    (['generate', b'\xff\xfe'], "the prompt is not valid text: '\\udcff\\udcfe' at character 0"),   # bytes not UTF-8
    (['generate', 'x', '--kernels', 'triton'], '--kernels triton on the CPU needs TRITON_INTERPRET=1'),
    (['generate', 'x', '--device', 'cuda'], '--device cuda: no CUDA device is visible to torch here'),
    (['generate', 'x', '--threads', '0'], '--threads: threads = 0; expected at least 1'),
    (['generate', 'x', '--temperature', '-1'], 'temperature = -1.0'),
    (['bench', '--prompt-len', '100000'], '--prompt-len 100,000 is longer than the model allows'),
    (['bench', '--json', '{tmp}/no/x.json', '--checkpoint', '/no/such/dir'], '--json: cannot write'),  # before loading
    (['generate', 'x', '--speculative', 'dspark'], 'no drafter weights at'),     # the random checkpoint ships none
    (['bench', '--gpu-memory-utilization', '1.5'], 'gpu_memory_utilization = 1.5; expected a share in (0, 1]'),
]

@pytest.mark.parametrize('argv,msg', CLI_BAD, ids=[m for _, m in CLI_BAD])
def test_cli_bad_input(tmp_path, cli_checkpoint, argv, msg):
    "One line of error under the subcommand's usage, exit status 2, nothing on standard output, no trace"
    argv = [a.replace('{tmp}', str(tmp_path)) if isinstance(a, str) else a for a in argv]
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', *argv[:1], '--checkpoint', str(cli_checkpoint), *argv[1:]],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={k: v for k, v in os.environ.items()
                            if k != 'TRITON_INTERPRET'} | {'CUDA_VISIBLE_DEVICES': ''})
    command = argv[0]
    assert (r.returncode, r.stdout) == (2, ''), r.stderr
    assert r.stderr.startswith(f'usage: python -m dsv41_nb {command} '), r.stderr     # the subcommand's usage line
    assert r.stderr.splitlines()[-1].startswith(f'python -m dsv41_nb {command}: error: '), r.stderr
    assert msg in r.stderr.splitlines()[-1] and 'Traceback' not in r.stderr and 'prompt 0' not in r.stderr, r.stderr


def test_greedy_match_oracle():
    "The near-tie check accepts the reference's own tokens, refuses a changed token, and names bad calls"
    assert assert_greedy_match(MODEL, PROMPTS, EXPECTED, EXPECTED, MARGIN) == 0
    assert all(v == 0 for v in greedy_shortfall(MODEL, PROMPTS[0], EXPECTED[0]))
    wrong = [e[:1] + [(e[1] + 1) % 256] + e[2:] for e in EXPECTED]
    with pytest.raises(AssertionError, match='below the reference'):
        assert_greedy_match(MODEL, PROMPTS, wrong, EXPECTED, MARGIN)
    with pytest.raises(AssertionError, match='has 5 tokens, the reference 6'):
        assert_greedy_match(MODEL, PROMPTS, [EXPECTED[0][:-1]] + EXPECTED[1:], EXPECTED, MARGIN)
    with pytest.raises(ValueError, match='4 prompts, 3 and 4'):
        assert_greedy_match(MODEL, PROMPTS, EXPECTED[:3], EXPECTED, MARGIN)
    calls = []
    def margin(): calls.append(1); return MARGIN()
    assert assert_greedy_match(MODEL, PROMPTS, EXPECTED, EXPECTED, margin) == 0 and calls == []   # not needed
    with pytest.raises(AssertionError, match='below the reference'):
        assert_greedy_match(MODEL, PROMPTS, wrong, EXPECTED, margin)
    assert calls == [1]                                          # computed once, at the first difference
    with pytest.raises(ValueError, match=r'shape \(1, L\)'): prefix_gap(MODEL, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match='outside'): greedy_shortfall(MODEL, [1], [999])

@given(st.integers(2, 64), st.integers(1, 8), st.integers(0, 2**31 - 1), st.booleans())
def test_all_greedy_short_path_equals_the_general_path(V, n, seed, ties):
    """A batch of greedy rows is flagged on the host, its short path returns the general path's one-hot rows bit for
    bit, and `draw` gives each row its argmax, ties to the first index: the one argmax an all-greedy step without drafts
    takes instead"""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (n, V), generator=g).float() if ties else torch.randn(n, V, generator=g) * 4
    sb = sampling_batch([SamplingParams(temperature=0)] * n, vocab_size=V)
    assert sb.all_greedy and not sampling_batch([SamplingParams(temperature=0), SamplingParams()],
                                                vocab_size=V).all_greedy
    fast, slow = sampling_probs(logits, sb), sampling_probs(logits, replace(sb, all_greedy=False))
    assert torch.equal(fast, slow) and torch.equal(fast.argmax(-1), logits.argmax(-1))
    accepted, token = draw(fast, torch.full((n,), -1), sb, g)
    assert not accepted.any() and torch.equal(token, logits.argmax(-1))


# -------------------------------------------------------- the runner's persistent rows against a rebuild from the plan
class Recorder:
    """A step model that keeps every batch and picks (id + position) % V at each logits row: tokens
    follow from the inputs"""
    supports_cuda_graphs = False
    def __init__(self, history_len=3): self.batches, self.history_len = [], history_len
    def forward(self, b):
        self.batches.append(b)
        r = b.logits_indices
        return torch.nn.functional.one_hot((b.token_ids[r] + b.positions[r]) % TINY.vocab_size, TINY.vocab_size).float()
    def release(self, ids): pass

def _same_batch(a, b):
    "Every input of two InputBatches equal (tables compared where either holds a block)"
    for f in ('request_ids', 'new_request_ids', 'prefix_token_ids'): assert getattr(a, f) == getattr(b, f), f
    for f in ('token_ids', 'positions', 'query_start_loc', 'seq_lens', 'logits_indices',
              'decoder_rows', 'num_cached_tokens', 'history'):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for x, y in zip(a.block_tables, b.block_tables): assert torch.equal(x, y)
    sa, sb = a.slot_mappings, b.slot_mappings
    assert torch.equal(sa.positions, sb.positions) and torch.equal(sa.swa, sb.swa) and torch.equal(sa.ring, sb.ring)
    assert (sa.compressed.keys() == sb.compressed.keys()
            and all(torch.equal(sa.compressed[r], sb.compressed[r]) for r in sa.compressed))

def _matches_the_cache(b, so, kv):
    """The batch's tables and slots against the cache manager's own (`block_table`,
    `slot_mappings`), asked right after planning"""
    reqs = so.requests
    for g in range(kv.num_groups): assert torch.equal(b.block_tables[g], kv.block_table(so.req_ids, g)), g
    sm = kv.slot_mappings([(sr.request_id, sr.start, sr.num_tokens) for sr in reqs])
    cached = torch.tensor([c for sr in reqs for c in [sr.num_cached_tokens] * sr.num_tokens], dtype=torch.long)
    assert torch.equal(b.slot_mappings.swa, sm.swa) and torch.equal(b.slot_mappings.ring, sm.ring)
    for r, v in sm.compressed.items():
        assert torch.equal(b.slot_mappings.compressed[r], torch.where(sm.positions < cached, PAD_SLOT_ID, v)), r

@pytest.mark.parametrize('asyn', [False, True], ids=['sync', 'async'])
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_persistent_rows_equal_a_rebuild(seed, asyn):
    """Random arrivals, aborts and preemptions (a small pool): every step's inputs from the runner's persistent rows
    (tables rewritten only where a snapshot changed, decode steps as arrays) equal the inputs rebuilt from the
    scheduler's plan, field by field, and the tables and slots equal the cache manager's own"""
    r = random.Random(seed)
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, num_gpu_blocks_override=40, max_model_len=256))
    s = Scheduler(kc, SchedulerConfig(max_num_batched_tokens=r.choice([16, 64]), async_scheduling=asyn))
    fast, plain = ModelRunner(Recorder(), kc), ModelRunner(Recorder(), kc)
    plain.fast = False
    pending, n, decode_steps = None, 0, 0
    for step in range(120):
        if r.random() < 0.25 or not s.has_unfinished_requests():
            n += 1
            s.add_request(f'q{n}', [r.randrange(1, 256) for _ in range(r.randrange(1, 40))],
                          SamplingParams(temperature=0, max_tokens=r.randrange(1, 30), ignore_eos=True))
        if s.requests and r.random() < 0.05: s.abort(r.choice(sorted(s.requests)))
        so = s.schedule()
        decode_steps += so.all_decode
        if asyn:
            fut, other = fast.execute_model_async(so), plain.execute_model_async(so)
            done = pending; pending = (so, fut, other) if so.req_ids else None
        else: done = (so, fast.execute_model(so), plain.execute_model(so))
        if so.req_ids:
            _same_batch(fast.model.batches[-1], plain.model.batches[-1])
            _matches_the_cache(fast.model.batches[-1], so, s.kv)
        if done is not None:
            mro = done[1].result() if asyn else done[1]
            assert mro.sampled_token_ids == (done[2].result() if asyn else done[2]).sampled_token_ids
            s.update_from_output(done[0], mro)
    assert decode_steps > 10 and s.stats['preemptions'] > 0


def test_host_only_engine_times_its_phases():
    "The host-only engine serves real steps (scheduler, runner, graph wrapper) with a null model; every phase is timed"
    llm = host_engine(TINY, 256)
    t = host_step_times(llm, 5, 4)
    assert set(t) == {name for name, *_ in HOST_PHASES} | {'wait', 'other', 'total'} and t['total'] > 0
    assert all(v >= 0 for k, v in t.items() if k != 'other') and not llm.llm_engine.has_unfinished_requests()
    # the decode steps went through the (emulated) graphs
    assert llm.llm_engine.runner.model.stats['replayed'] > 0


def test_host_step_times_staggers_its_prompts_and_times_decode_steps_alone(monkeypatch):
    """host_step_times adds prompts of staggered lengths (a third of max_model_len plus i modulo a quarter), finishes
    every prefill, chunked ones too, before it times a step, and takes the longest run that fits max_model_len"""
    from dsv41_nb import host_steps
    llm = host_engine(TINY, 256, max_num_batched_tokens=16)              # prefills in chunks of 16 tokens
    eng, lens, ready = llm.llm_engine, [], []
    add, enter = eng.add_request, host_steps.StepTimer.__enter__
    monkeypatch.setattr(eng, 'add_request', lambda rid, p, sp: (lens.append(len(p)), add(rid, p, sp))[1])
    def spy(timer):
        s = eng.scheduler
        ready.append(not s.waiting and all(r.num_computed_tokens >= r.prefill_len for r in s.running))
        return enter(timer)
    monkeypatch.setattr(host_steps.StepTimer, '__enter__', spy)
    host_step_times(llm, 5, 4)
    assert lens == [85, 86, 87, 88, 89] and ready == [True]
    host_step_times(llm, 1, 256 - 85 - 64 - 4)                           # prompts up to 149 tokens, 4 to spare
    assert not eng.has_unfinished_requests()


def test_load_shape_counts_the_prefill_rows_of_a_burst():
    """load_shape: the prefill rows add up to every prompt's tokens, no step carries more than the budget, decode-only
    steps follow the last prefill step, first tokens come in the order of arrival; one step when the budget holds all"""
    prefill, first = load_shape(64, 5, prompt_len=32, max_tokens=4, cfg=TINY)
    assert sum(prefill) == 5 * 32 and max(prefill) == 64 and prefill[:3] == [64, 62, 34]   # 2 decode rows ride along
    assert prefill[3:] == [0] * (len(prefill) - 3) and len(prefill) - 3 >= 4 - 1
    assert list(first) == [str(i) for i in range(5)] and list(first.values()) == sorted(first.values())
    prefill, first = load_shape(256, 5, prompt_len=32, max_tokens=4, cfg=TINY)
    assert prefill[0] == 160 and not any(prefill[1:]) and len(set(first.values())) == 1


def test_random_byte_prompts_are_bytes_and_seeded():
    a, b = random_byte_prompts(3, 40), random_byte_prompts(3, 40, seed=1)
    assert [len(p) for p in a] == [40] * 3 and all(0 <= t < 256 for p in a for t in p)
    assert a == random_byte_prompts(3, 40) and a != b and len({tuple(p) for p in a}) == 3


def test_a_prefill_step_applies_the_step_before_it_first():
    """Async: a step with prefill rows is launched only after the previous step's tokens are applied
    (its first tokens not held back)"""
    llm = host_engine(TINY, 256, async_scheduling=True, max_num_batched_tokens=16)
    eng, events = llm.llm_engine, []
    launch, update = eng.runner.execute_model_async, eng.scheduler.update_from_output
    eng.runner.execute_model_async = lambda so: (events.append(('launch', so.step, so.all_decode)), launch(so))[1]
    eng.scheduler.update_from_output = lambda so, mro: (events.append(('apply', so.step, None)), update(so, mro))[1]
    for i, p in enumerate(random_prompts(3, 16, vocab=200)): eng.add_request(str(i), p, GREEDY)
    while eng.has_unfinished_requests(): eng.step('final')
    for i, (kind, step, decode) in enumerate(events):
        if kind == 'launch' and not decode and step > 0:       # a prefill step: the step before it applied already
            assert ('apply', step - 1, None) in events[:i], events[:i + 1]


def test_final_outputs_are_the_whole_outputs():
    "delta='final' returns only finished requests, each exactly the whole (cumulative) output"
    a, b = LLM(MODEL, **EXACT), LLM(MODEL, **EXACT)
    for llm in (a, b):
        for i, p in enumerate(PROMPTS): llm.llm_engine.add_request(str(i), p, GREEDY)
    whole, final = {}, {}
    while a.llm_engine.has_unfinished_requests():
        whole.update({o.request_id: o for o in a.llm_engine.step() if o.finished})
        outs = b.llm_engine.step('final'); assert all(o.finished for o in outs)
        final.update({o.request_id: o for o in outs})
    assert {k: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for k, o in whole.items()} == \
           {k: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for k, o in final.items()}


def test_capture_all_and_staged_rows():
    """capture_all captures every size once a decode step was seen; load_rows puts the staged
    padding back in rows it leaves"""
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, max_model_len=256))
    cg = CUDAGraphModel(TensorOnly(), kc, 256, capture_sizes=(2, 4, 8), emulate=True)
    with pytest.raises(RuntimeError, match='no decode batch has been seen'): cg.capture_all()
    s, run = Scheduler(kc, SchedulerConfig()), ModelRunner(cg, kc)
    for i in range(3): s.add_request(f'q{i}', PROMPTS[i][:4], SamplingParams(max_tokens=4))
    o = s.schedule(); s.update_from_output(o, run.execute_model(o))
    b, _ = run.prepare_inputs(s.schedule())
    torch.testing.assert_close(cg.forward(b), cg.model.forward(b), rtol=0, atol=0)
    assert cg.capture_all() == [8, 2] and sorted(cg.graphs) == [2, 4, 8] and cg.capture_all() == []
    with pytest.raises(ValueError, match=r'\[3\] are not capture sizes'): cg.capture_all([3])
    st_ = StagedInputs(SimpleNamespace(t=torch.full((4, 3), -1)), 'cpu')           # staged: all padding
    st_.load_rows(SimpleNamespace(t=torch.ones(3, 2, dtype=torch.long)), 3)
    st_.load_rows(SimpleNamespace(t=torch.full((1, 3), 5)), 1)
    assert st_.inputs.t.tolist() == [[5, 5, 5], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match='in rows of 2'):
        st_.load_rows(SimpleNamespace(t=torch.ones(3, 3, dtype=torch.long)), 2)
    with pytest.raises(ValueError, match='typed as the staged ones'):
        st_.load_rows(SimpleNamespace(t=torch.ones(2, 3)), 2)
    ids = torch.zeros(5, dtype=torch.long)
    fill_token_ids(ids, [(np.array([1, 4]), torch.tensor([7, 8, 9]), np.array([2, 0])), (2, torch.tensor([3]), 0)])
    assert ids.tolist() == [0, 9, 3, 0, 7]


def test_kv_pool_blocks_fill_the_budget_up_to_the_need():
    "The pool from a GPU's memory: what `utilization` leaves, whole pages, at most max_num_seqs full requests"
    kc = _LLM.llm_engine.kv_cache_config
    per, page, total = sum(KVCacheManager(kc).min_blocks(64)), kc.page_bytes, 10 ** 10
    for seqs in (1, 3, 50):
        for left_pages in (per + 1, per + 7, 10 * per + 3, 10 ** 5):   # the budget, in pages
            free = total - int(0.5 * total) + left_pages * page   # in use: all but half, less the budget
            assert kv_pool_blocks(kc, seqs, 0.5, free, total) == min(seqs * per + 1, left_pages)


def test_engine_on_a_cpu_keeps_the_cache_budget():
    "The knob reads a GPU's memory; a model on a CPU keeps `CacheConfig`'s budget"
    a = LLM(MODEL, runner='recompute', max_model_len=64).llm_engine.kv_cache_config.num_blocks
    b = LLM(MODEL, runner='recompute', max_model_len=64, gpu_memory_utilization=0.5).llm_engine.kv_cache_config
    assert b.num_blocks == a


@pytest.mark.parametrize('asyn', [False, True], ids=['sync', 'async'])
def test_the_engine_tells_an_adaptive_proposer_its_decode_steps(tmp_path, asyn):
    """Every decode step reaches the pacer's ledger (seconds, plain or not, tokens a request), prompt steps do not;
    a drafter measured to lose is held back, and greedy output is plain decoding's"""
    from dsv41_nb.dspark import Drafter
    from dsv41_nb.dspark_decode import DSparkProposer
    from dsv41_nb.dspark_serving import dspark_proposer, save_drafter
    model, path = init_random(TINY, seed=3), tmp_path / 'drafter.safetensors'
    save_drafter(Drafter(model), path)
    prompts, sp = [list(range(40, 70)), [7] * 25], SamplingParams(temperature=0, max_tokens=30)
    want = [o.outputs[0].token_ids for o in LLM(model, kernels='torch').generate(prompts, sp, use_tqdm=False)]
    prop = dspark_proposer(model, path, 3, adaptive=True, step_cost=lambda T: T.double())
    seen = []
    llm = LLM(model, proposer=prop, kernels='torch', async_scheduling=asyn)
    observe = prop.pacer.observe
    prop.pacer.observe = lambda s, plain, k: seen.append((s, plain, k)) or observe(s, plain, k)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    steps = llm.llm_engine.scheduler.step
    assert 20 <= len(seen) < steps and all(s > 0 and k >= 1 for s, _, k in seen), (len(seen), steps)
    plain = llm.llm_engine.runner.plain_steps   # async: a step that applied no tokens yet is not told
    assert plain - (2 if asyn else 0) <= sum(p for _, p, _ in seen) <= plain, (seen, plain)
    led = prop.pacer
    assert led.rate is not None and led.time == pytest.approx(sum(s for s, _, _ in seen))
    assert led.stats['held'] > 0, led


@pytest.mark.parametrize('forced', ['torch', 'triton'])
def test_forced_kernels_reach_the_proposer(forced, monkeypatch):
    """`kernels` forces the backend in the proposer's drafting (a drafter with a model of its own runs
    kernels) as in the model's step; under the interpreter the default would be Triton's"""
    from dsv41_nb.dispatch import kernel_backend
    monkeypatch.setenv('TRITON_INTERPRET', '1')
    class Spy:
        num_speculative_tokens = 2
        def __init__(self): self.seen = []
        def propose(self, lists):
            self.seen.append(kernel_backend(torch.zeros(1))); return [[] for _ in lists]
    spy = Spy()
    host_engine(TINY, 256, proposer=spy, kernels=forced).generate(
        [[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert spy.seen and set(spy.seen) == {forced}, spy.seen


def test_sweep_verdict_says_rising_and_within():
    from dsv41_nb.__main__ import sweep_verdict
    row = lambda c, tps, tpot, floor: dict(concurrency=c, output_tokens_per_s=tps, tpot_s={50: tpot}, floor_s=floor)
    rows = [row(1, 10, 0.03, 0.01), row(8, 60, 0.02, 0.01), row(32, 70, 0.021, 0.01)]
    assert sweep_verdict(rows) == ("throughput rises at every level: yes; "
                                   "TPOT p50 within 2x the step floor at 1 of 3 levels (8)")
    assert sweep_verdict(rows, within=3).endswith('at 3 of 3 levels (1, 8, 32)')
    flat = rows[:2] + [row(32, 60, 0.02, 0.01)]                 # equal is not rising
    assert sweep_verdict(flat).startswith('throughput rises at every level: no')
    nan = [row(1, 10, 0.03, float('nan'))]                      # no floor: no level meets it
    assert sweep_verdict(nan).endswith('at 0 of 1 levels')
    for bad, kw, msg in [(rows[::-1], {}, 'levels must increase'), (rows + rows[-1:], {}, 'levels must increase'),
                         (rows, dict(within=0), 'positive number'), (rows, dict(within=True), 'positive number'),
                         (rows, dict(within='2'), 'positive number')]:
        with pytest.raises(ValueError, match=msg): sweep_verdict(bad, **kw)


def test_eager_steps_trust_their_values_unless_asked():
    """An eager step skips the checks that read values back (check_values False, the default) and gives the same
    tokens as one that checks every slot and position (check_values True); on the Triton path (the one a GPU runs)
    the prompts' eager step then reads back a fraction of what it did"""
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(20 + 9 * i)] for i in range(3)]
    reads, texts = {}, {}
    for check in (False, True):
        eng = LLM(MODEL, max_model_len=128, kernels='torch', check_values=check).llm_engine
        for i, p in enumerate(prompts): eng.add_request(str(i), p, sp)
        with HostReads() as r: eng.step()                     # the prompts: an eager step
        reads[check], out = r.sites, []
        while eng.has_unfinished_requests(): out += eng.step()
        texts[check] = sorted((o.request_id, o.outputs[0].token_ids) for o in out if o.finished)
    assert texts[False] == texts[True]
    checks = ('_check_rope', '_check_slots', '_check_ranges', ' check')
    for check, sites in reads.items():   # the checks' reads: there with check_values, gone without
        assert any(k.endswith(checks) for k in sites) == check, (check, sites)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get('TRITON_INTERPRET') and not torch.cuda.is_available(),
                    reason='the Triton kernels need a GPU or TRITON_INTERPRET=1')
def test_an_eager_triton_step_reads_back_little():
    "The prompts' eager step on the Triton kernels: at least four times fewer read-backs without the value checks"
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reads, model = {}, init_random(TINY, seed=0, device=DEV)     # on the GPU where there is one
    for check in (False, True):
        eng = LLM(model, max_model_len=64, kernels='triton', check_values=check).llm_engine
        for i in range(2): eng.add_request(str(i), list(range(1, 18 + 5 * i)), sp)
        with HostReads() as r: eng.step()
        reads[check] = r.count
    assert reads[True] >= 4 * reads[False], reads
