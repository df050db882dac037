"""The data-parallel engine of 15a and its front (15b) on two gloo ranks, against the one-process `LLM` of 13_engine.

Every two-rank scenario runs in one spawn of two processes per module (the `ranks` fixture); each test reads its part.
The oracle of every scenario is the existing one-process `LLM` over all the prompts at once, with the scenario's engine
arguments and one rank's share of the cores (fp32 GEMMs sum in a thread-dependent order): greedy tokens must be equal,
token for token. Scenarios: prompts of uneven lengths over both ranks with a small token budget (one rank prefills an
encoder-only chunk of bounded replay while the other decodes), a rank with no requests at all (asynchronous
scheduling), an abort on one rank, preemptions on one rank (a small pool), the reference path (`runner='recompute'`:
one forward per sampling request, so the ranks make different numbers of forwards), n-gram drafts under
asynchronous scheduling, and a replicated MoE. Then the
front's balancing against a brute-force count, the launcher under torchrun in a subprocess, and one table of bad
inputs."""
import os, subprocess, sys
import pytest
import torch
from hypothesis import given, strategies as st
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.model import init_random
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.engine import LLM
from dsv41_nb.kv_manager import CacheCapacityError
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.paged import PagedModel
from dsv41_nb.paged_step import PagedStepModel
from dsv41_nb.serving import random_checkpoint
from dsv41_nb.distributed import run_ranks, rank_threads, free_port
from dsv41_nb import dp_engine as de, dp_front as dpf

pytestmark = pytest.mark.processes    # run apart from other pytest workers (see conftest)
TINY = ModelConfig.tiny()
MODEL = init_random(TINY, seed=7)
_G = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(1, 256, (n,), generator=_G).tolist() for n in (36, 6, 13, 9, 21)]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BASE = dict(max_model_len=128, kernels='torch')
CHUNKED = dict(BASE, max_num_batched_tokens=16)


def place(ids_per_rank):
    "requests[r] of the prompts with these indices, ids their index"
    return [[(str(i), PROMPTS[i], GREEDY) for i in ids] for ids in ids_per_rank]


FRONT = dpf.DPFront(2)
BALANCED = [[], []]
for i, p in enumerate(PROMPTS): BALANCED[FRONT.add(str(i))].append((str(i), p, GREEDY))

# name: (engine args, indices of the prompts it serves, the job's arguments)
SCENARIOS = dict(
    balanced=(CHUNKED, range(5), (MODEL, BALANCED, CHUNKED)),
    idle_async=(BASE, (1, 2, 3), (MODEL, place([(1, 2, 3), ()]), dict(BASE, async_scheduling=True))),
    abort=(BASE, range(4), (MODEL, place([(0, 1), (2, 3)]), BASE, True, {'0': 2})),
    preempt=(dict(BASE, num_gpu_blocks=12, enable_prefix_caching=False), range(4),
             (MODEL, place([(0, 2), (1, 3)]), dict(BASE, num_gpu_blocks=12, enable_prefix_caching=False))),
    recompute=(dict(BASE, runner='recompute'), (1, 2, 3),
               (MODEL, place([(1, 2), (3,)]), dict(BASE, runner='recompute'))),
    replicated=(BASE, (1, 3), (MODEL, place([(1,), (3,)]), BASE, False)),
    async_spec=(dict(BASE, runner='recompute'), (1, 2, 3),
                (MODEL, place([(1, 2), (3,)]),
                 dict(BASE, runner='recompute', async_scheduling=True, num_speculative_tokens=3))),
)


# the ranks kept running for a server (DPServingEngine on rank 0, `follow` on rank 1): request 0 aborted after step 2
SERVING = (MODEL, BASE, [(str(i), PROMPTS[i], GREEDY) for i in range(4)], {'0': 2})


@pytest.fixture(scope='module')
def ranks():
    "Every scenario on two gloo ranks, spawned once: {name: [rank 0 result, rank 1 result]}"
    jobs = [(de.dp_engine_job, s[2]) for s in SCENARIOS.values()] + [(dpf.dp_serving_job, SERVING)]
    return dict(zip([*SCENARIOS, 'serving'], run_ranks(jobs)))


@pytest.fixture(scope='module')
def want():
    "{name: {request id: greedy tokens}} of the one-process LLM with each scenario's arguments, over all the prompts"
    runs = {}
    with rank_threads(2):
        for args, _, _ in SCENARIOS.values():
            key = tuple(sorted(args.items()))
            if key not in runs:
                got = LLM(MODEL, **args).generate(PROMPTS, GREEDY, use_tqdm=False)
                runs[key] = {str(i): o.outputs[0].token_ids for i, o in enumerate(got)}
    return {name: {str(i): runs[tuple(sorted(args.items()))][str(i)] for i in ids}
            for name, (args, ids, _) in SCENARIOS.items()}


def tokens(ran): return {k: o.outputs[0].token_ids for r in ran for k, o in r['outputs'].items()}
def stats(ran, key): return [r['stats'][key] for r in ran]


def test_outputs_equal_the_one_process_llm(ranks, want):
    "Prompts of 36, 6, 13, 9 and 21 tokens placed by the front, 16 tokens a step: the one-process engine's tokens"
    assert tokens(ranks['balanced']) == want['balanced']
    assert stats(ranks['balanced'], 'steps')[0] == stats(ranks['balanced'], 'steps')[1]


def test_an_encoder_only_chunk_completes_its_exchanges(ranks):
    "The 36-token prompt's first chunk stops before the decoder (bounded replay): its rank makes those exchanges empty"
    rank_of_long = FRONT.rank_of['0']
    made_empty = stats(ranks['balanced'], 'made_empty')
    assert made_empty[rank_of_long] >= TINY.n_layers // 2 and made_empty[1 - rank_of_long] == 0


def test_a_rank_without_requests_keeps_stepping(ranks, want):
    "Three requests on rank 0, none on rank 1 (asynchronous scheduling): rank 1 runs a dummy batch every step with work"
    r0, r1 = ranks['idle_async']
    assert tokens(ranks['idle_async']) == want['idle_async']
    assert r1['outputs'] == {} and r1['stats']['forwards'] == 0
    assert r1['stats']['dummy_forwards'] == r0['stats']['forwards'] > 0
    assert r0['stats']['dummy_forwards'] == 0 and r0['stats']['steps'] == r1['stats']['steps']


def test_async_scheduling_with_drafts_on_both_ranks(ranks, want):
    "n-gram drafts under async scheduling on each rank: the one-process engine's tokens without speculation"
    assert tokens(ranks['async_spec']) == want['async_spec']
    assert stats(ranks['async_spec'], 'steps')[0] == stats(ranks['async_spec'], 'steps')[1]


def test_an_abort_on_one_rank_stalls_neither(ranks, want):
    "Request 0 aborted on rank 0 after its second step: rank 1's requests and rank 0's other one as the reference"
    got, ref = tokens(ranks['abort']), want['abort']
    assert ranks['abort'][0]['outputs']['0'].outputs[0].finish_reason == 'abort'
    assert got['0'] == ref['0'][:len(got['0'])] and len(got['0']) < len(ref['0'])
    assert {k: v for k, v in got.items() if k != '0'} == {k: v for k, v in ref.items() if k != '0'}


def test_preemption_on_one_rank(ranks, want):
    "A pool of 12 blocks: the rank with the 36-token prompt preempts, the other does not; tokens as the reference"
    assert tokens(ranks['preempt']) == want['preempt']
    assert stats(ranks['preempt'], 'preemptions')[0] > 0 == stats(ranks['preempt'], 'preemptions')[1]


def test_reference_path_pads_forwards_to_the_most(ranks, want):
    "One forward per sampling request: two on rank 0, one on rank 1; rank 1 pads, both make the same number"
    r0, r1 = ranks['recompute']
    assert tokens(ranks['recompute']) == want['recompute']
    made = [r['stats']['forwards'] + r['stats']['dummy_forwards'] for r in (r0, r1)]
    assert made[0] == made[1] and r0['stats']['forwards'] > r1['stats']['forwards']
    assert r1['stats']['dummy_forwards'] > 0


def test_replicated_moe_needs_no_dummy_forwards(ranks, want):
    "enable_expert_parallel=False: every rank holds every expert, exchanges nothing, pads nothing"
    assert tokens(ranks['replicated']) == want['replicated']
    assert stats(ranks['replicated'], 'dummy_forwards') == [0, 0]


def test_no_rank_leaks_blocks(ranks):
    for name, ran in ranks.items():
        if name == 'serving': continue             # its own test below
        for r in ran: assert r['stats']['free_after'] == r['stats']['free_before'], (name, r['stats'])


def test_serving_engine_over_two_ranks(ranks, want):
    """Rank 0's DPServingEngine steps both ranks as one engine: requests on both ranks, the one-process tokens, the
    aborted request a prefix of its own, both pools whole and both ranks idle at the end, the same number of steps"""
    r0, r1 = ranks['serving']
    got = {rid: sum((o.outputs[0].token_ids for o in outs), []) for rid, outs in r0['outputs'].items()}
    ref = want['abort']                                     # the one-process LLM over prompts 0-3, BASE
    assert {k: v for k, v in got.items() if k != '0'} == {k: v for k, v in ref.items() if k != '0'}
    assert got['0'] == ref['0'][:len(got['0'])] and len(got['0']) < len(ref['0'])
    assert r0['outputs']['0'][-1].outputs[0].finish_reason == 'abort'
    assert all(outs[-1].finished for outs in r0['outputs'].values())
    assert sorted(r0['placed'].values()) == [0, 0, 1, 1]
    for s in r0['stats']:
        assert (s['free_blocks'], s['running'], s['waiting'], s['busy']) == (s['usable_blocks'], 0, 0, False), s
    assert [s['added'] for s in r0['stats']] == [2, 2] and r0['stats'][0]['steps'] == r0['stats'][1]['steps']
    assert r1['last'] == r0['stats'][1]                   # what rank 1 held when the stop came: what rank 0 last read


# ---------------------------------------------------------------- the front, against a brute-force count
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=60), st.integers(1, 5))
def test_front_places_on_the_least_loaded_rank(ops, world):
    front, live, placed = dpf.DPFront(world), {}, 0
    for add, k in ops:
        if add or not live:
            counts = [sum(r == q for r in live.values()) for q in range(world)]
            best = min(range(world), key=lambda q: (counts[q], q))
            rid = f'r{placed}'; placed += 1
            assert front.add(rid) == best
            live[rid] = best
        else:
            rid = sorted(live)[k % len(live)]
            assert front.finish(rid) == live.pop(rid)
        assert front.running == [sum(r == q for r in live.values()) for q in range(world)]


def test_dummy_batch_writes_nowhere():
    "The idle rank's batch through the paged step model: logits for one row, every cache byte unchanged"
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, max_model_len=128))
    step = PagedStepModel(PagedModel.from_model(MODEL, kc))
    st_ = step.model.state
    before = [t.clone() for d in (st_.window, st_.compressed, st_.index_keys, st_.rings) for t in d.values()]
    with use_kernels('torch'): assert tuple(step.forward(de.dummy_batch(kc)).shape) == (1, TINY.vocab_size)
    after = [t for d in (st_.window, st_.compressed, st_.index_keys, st_.rings) for t in d.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_projection_follows_the_bytes_sent():
    "At 2 -> 8 ranks a token's rows leave its rank 7/8 of the time instead of 1/2: the all-to-all time x 1.75"
    p = de.project_world(10.0, 0.4, TINY, batch=3)
    step = 0.6 + 0.4 * (7 / 8) / (1 / 2)
    assert p['per_rank_tokens_per_s'] == pytest.approx(10.0 / step)
    assert p['tokens_per_s'] == pytest.approx(80.0 / step) and p['a2a_share'] == pytest.approx(0.7 / step)


def test_llm_hook():
    "LLM's two new keywords: one rank is the one-process LLM, more a DPLLM (nothing spawned until generate)"
    assert type(LLM(MODEL, data_parallel_size=1, enable_expert_parallel=True, **BASE)) is LLM
    llm = LLM(MODEL, data_parallel_size=2, enable_expert_parallel=True, **BASE)
    assert isinstance(llm, dpf.DPLLM) and llm.world_size == 2 and llm.backend == 'gloo'
    rids, placed = llm._place(PROMPTS[:3], GREEDY)
    assert rids == ['0', '1', '2'] and [[r for r, *_ in p] for p in placed] == [['0', '2'], ['1']]


# ---------------------------------------------------------------- torchrun
SCRIPT = """
import sys, argparse
from dsv41_nb.dp_front import dp_generate, dp_bench
from dsv41_nb.__main__ import _rank_exit
common = dict(checkpoint={ckpt!r}, speculative=0, device='cpu', threads=1, kernels='torch', seed=0,
              async_scheduling=False, data_parallel_size=None)
def error(msg): sys.exit(msg)
dp_generate(argparse.Namespace(prompt='the cat', max_tokens=6, temperature=0.0, top_p=1.0, top_k=-1, **common), error)
# the command line's end under torchrun: leave the group, then exit without the interpreter's shutdown
_rank_exit(dp_bench(argparse.Namespace(num_prompts=3, prompt_len=5, max_tokens=3, max_num_seqs=8,
                                       max_num_batched_tokens=64, json=None, **common), error))
"""

def test_torchrun_generate_and_bench(tmp_path):
    "Two processes started by torchrun, each one rank: rank 0 prints the one-process engine's text, then a bench line"
    ckpt = random_checkpoint()
    (tmp_path / 'run.py').write_text(SCRIPT.format(ckpt=str(ckpt)))
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2',
                        '--master-port', str(free_port()), str(tmp_path / 'run.py')],
                       capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 0, r.stderr[-3000:]
    with rank_threads(os.cpu_count()):
        text = LLM(str(ckpt), kernels='torch').generate('the cat', SamplingParams(temperature=0, max_tokens=6),
                                                        use_tqdm=False)[0].outputs[0].text
    lines = r.stdout.splitlines()
    assert lines[0] == 'the cat' + text and len(lines) == 2, r.stdout
    assert '3 requests, 9 tokens' in lines[1] and 'all-to-all' in lines[1]


def test_init_dp_group_leaves_at_exit(monkeypatch):
    "A process torchrun started joins the group once, registers leave_dp_group for exit; leaving destroys the group"
    import atexit, torch.distributed as dist
    monkeypatch.setattr(os, 'environ', {**os.environ, **ENV, 'WORLD_SIZE': '1', 'MASTER_ADDR': '127.0.0.1',
                                        'MASTER_PORT': str(free_port())})
    registered = []
    monkeypatch.setattr(atexit, 'register', registered.append)
    assert dpf.init_dp_group() == torch.device('cpu') and dist.is_initialized()
    dpf.init_dp_group()
    assert registered == [dpf.leave_dp_group]
    dpf.leave_dp_group(timeout_s=5)
    assert not dist.is_initialized()
    dpf.leave_dp_group()


# ---------------------------------------------------------------- bad input, one table for the module
ENV = dict(RANK='0', WORLD_SIZE='2', LOCAL_RANK='0', MASTER_ADDR='h', MASTER_PORT='1')
_LLM2 = dpf.DPLLM(MODEL, data_parallel_size=2, **BASE)
_LLM1, _LLM_SMALL_POOL = LLM(MODEL, **BASE), LLM(MODEL, **BASE, num_gpu_blocks=4)
def _error(msg): raise ValueError(msg)
_CLI = dict(prompt='a', max_tokens=2, temperature=0.0, top_p=1.0, top_k=-1, seed=0, checkpoint=None, speculative=0,
            device='cpu', threads=1, kernels='torch', async_scheduling=False, data_parallel_size=2)
BAD = [
    (lambda: LLM(MODEL, data_parallel_size=0), ValueError, 'data_parallel_size = 0; expected at least 1'),
    (lambda: LLM(MODEL, data_parallel_size=2.0), TypeError, 'data_parallel_size must be an int, got 2.0'),
    (lambda: LLM(MODEL, data_parallel_size=3, enable_expert_parallel=True), ValueError,
     '8 routed experts do not split evenly over 3 ranks'),
    (lambda: LLM(MODEL, data_parallel_size=2, enable_expert_parallel=True, num_speculative_tokens=-1), ValueError,
     'num_speculative_tokens = -1'),
    (lambda: LLM(MODEL, data_parallel_size=2, enable_expert_parallel=None), TypeError,
     'enable_expert_parallel must be a bool'),
    (lambda: LLM(MODEL, data_parallel_size=2, step_model=print), ValueError, 'a step_model cannot travel'),
    (lambda: LLM(MODEL, data_parallel_size=2, max_num_seqs=0), ValueError, 'max_num_seqs'),
    (lambda: dpf.DPLLM(MODEL, tokenizer=object()), ValueError, 'a tokenizer cannot travel'),
    (lambda: dpf.DPLLM('/no/such/checkpoint'), FileNotFoundError, '/no/such/checkpoint'),
    (lambda: dpf.DPLLM(3.5), TypeError, 'expected a checkpoint directory, a Transformer or a ModelConfig, got float'),
    (lambda: _LLM2.generate(''), ValueError, 'prompt 0: the prompt is empty'),
    (lambda: _LLM2.generate([[1, 2], [7] * 129]), ValueError, 'prompt 1: the prompt has 129 tokens'),
    (lambda: _LLM2.generate(['a', 'b'], [GREEDY] * 3), ValueError, '2 prompts but 3 sampling params'),
    (lambda: _LLM2.generate('a', {'temperature': 0}), TypeError, 'sampling params 0: expected a SamplingParams'),
    (lambda: _LLM2.bench([2], prompt_len=0), ValueError, 'prompt_len = 0'),
    (lambda: dpf.DPFront(-1), ValueError, 'world_size = -1'),
    (lambda: dpf.DPFront(2).finish('x'), ValueError, "no running request 'x'"),
    (lambda: dpf.DPFront(2).add(''), TypeError, "request_id must be a non-empty str, got ''"),
    (lambda: de.dummy_batch(None), TypeError, 'expected a KVCacheConfig, got NoneType'),
    (lambda: de.serve_rank(None, []), TypeError, 'expected a DPLLMEngine, got NoneType'),
    (lambda: de.rank_model(7, 'cpu'), TypeError, 'expected a Transformer, a checkpoint directory or a ModelConfig'),
    (lambda: de.DPLLMEngine(MODEL), RuntimeError, 'torch.distributed is not initialised'),
    (lambda: de.dp_engine_job(MODEL, [[], []], BASE), RuntimeError, 'torch.distributed is not initialised'),
    (lambda: de.EPPagedModel.from_model(MODEL)(None), RuntimeError, 'shard the model first'),
    (lambda: dpf.torchrun_env(dict(RANK='0', WORLD_SIZE='2', LOCAL_RANK='0')), ValueError,
     'not MASTER_ADDR, MASTER_PORT'),
    (lambda: dpf.torchrun_env({**ENV, 'WORLD_SIZE': 'two'}), ValueError, 'expected integers'),
    (lambda: dpf.torchrun_env({**ENV, 'RANK': '-1'}), ValueError, 'RANK -1 outside 0..1'),
    (lambda: dpf.init_dp_group(), RuntimeError, 'was not started by torchrun'),
    (lambda: dpf.leave_dp_group(0), ValueError, 'leave_dp_group: timeout_s 0; expected > 0'),
    (lambda: de.project_world(0, 0.1, TINY, 1), ValueError, 'per_rank_tokens_per_s = 0'),
    (lambda: de.project_world(5.0, -0.1, TINY, 1), ValueError, 'a2a_share = -0.1'),
    (lambda: de.project_world(5.0, 0.1, TINY, 0), ValueError, 'batch = 0'),
    (lambda: de.project_world(5.0, 0.1, TINY, 1, world=1), ValueError, 'world = 1; expected at least 2'),
    (lambda: de.project_world(5.0, 0.1, TINY, 1, to=16), ValueError, '8 routed experts do not split evenly over 16'),
    (lambda: dpf.dp_generate(argparse_ns(prompt=''), _error), ValueError, 'the prompt is empty'),
    (lambda: dpf.dp_generate(argparse_ns(device='cuda:7'), _error), ValueError, '--device cuda:7'),
    (lambda: dpf.dp_bench(argparse_ns(device='mps'), _error), ValueError, "--device 'mps'"),
    (lambda: dpf.DPServingEngine(None), TypeError, 'DPServingEngine: expected a DPLLMEngine, got NoneType'),
    (lambda: dpf.follow('e'), TypeError, 'follow: expected a DPLLMEngine, got str'),
    (lambda: dpf.rank_turn(None, {}), TypeError, 'rank_turn: expected a DPLLMEngine, got NoneType'),
    (lambda: dpf.core_stats(_LLM1), TypeError, 'core_stats: expected an LLMEngine, got LLM'),
    (lambda: dpf.control_group(), RuntimeError, 'torch.distributed is not initialised'),
    (lambda: dpf.check_request(_LLM1.llm_engine, '', 'a'), TypeError, "request_id must be a non-empty str, got ''"),
    (lambda: dpf.check_request(_LLM1.llm_engine, 'x', 'a', {'temperature': 0}), TypeError,
     'sampling_params must be a SamplingParams, got dict'),
    (lambda: dpf.check_request(_LLM1.llm_engine, 'x', [1, 999]), ValueError, 'token id 999'),
    (lambda: dpf.check_request(_LLM1.llm_engine, 'x', 'a', SamplingParams(stop_token_ids=[999])), ValueError,
     'stop token id 999'),
    (lambda: dpf.check_request(_LLM_SMALL_POOL.llm_engine, 'x', [1] * 100, SamplingParams(max_tokens=20)),
     CacheCapacityError, "request 'x' can never fit"),
]

def argparse_ns(**kw):
    from types import SimpleNamespace
    return SimpleNamespace(**{**_CLI, 'num_prompts': 2, 'prompt_len': 4, 'max_num_seqs': 4,
                              'max_num_batched_tokens': 64, 'json': None, **kw})

@pytest.mark.parametrize('f,exc,msg', BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_input(f, exc, msg):
    with pytest.raises(exc) as e: f()
    assert msg in str(e.value), str(e.value)


def test_ngram_tokens_reads_the_speculation_arguments():
    """n-gram drafts from --speculative / --num-speculative-tokens; no count without a method,
    DSpark refused across ranks"""
    from argparse import Namespace
    from dsv41_nb.dp_front import ngram_tokens
    from dsv41_nb.engine import NGRAM_TOKENS
    def error(msg): raise ValueError(msg)
    ns = lambda **kw: Namespace(**{'speculative': None, 'num_speculative_tokens': None, **kw})
    assert [ngram_tokens(ns(), error), ngram_tokens(ns(speculative=0), error)] == [0, 0]
    assert [ngram_tokens(ns(speculative='ngram'), error),
            ngram_tokens(ns(speculative='ngram', num_speculative_tokens=2), error)] == [NGRAM_TOKENS, 2]
    for kw, msg in ((dict(num_speculative_tokens=2), 'needs --speculative'),
                    (dict(speculative='dspark'), 'not across data-parallel ranks'),
                    (dict(speculative='ngram', num_speculative_tokens=-1), 'k = -1')):
        with pytest.raises(ValueError, match=msg): ngram_tokens(ns(**kw), error)
