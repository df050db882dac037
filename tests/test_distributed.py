"""Expert parallelism, data-parallel steps, the sharded Engram lookup and a whole-model step on two gloo processes,
against one process.

Every distributed scenario runs in a single spawn of two ranks per module (the `ranks` fixture); each test reads its
part. The oracles are 08_moe's `moe_reference` (the PyTorch path: the layer's output must be the same bits, since the
combine repeats the reference loop's fp32 additions in its order), `ep_moe_simulated` (the same exchange with lists in
one process: the same bits on any kernel path), 09_engram_table's `engram_lookup`, and brute-force enumeration for the
traffic formulas, and for the whole-model step 10_model_forward_block's `Transformer` forward in one process (with a
rank's share of the cores: fp32 GEMMs sum in a thread-dependent order). Under TRITON_INTERPRET=1 (as CI runs) the
default-path scenario runs the Triton kernels."""
import copy, itertools, math, os
from dataclasses import replace
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.moe import MoEWeights, moe_reference, route_layer, fp8_qdq
from dsv41_nb.model import init_random
from dsv41_nb.engram import NgramHasher, compressed_token_map, synthetic_token_strings
from dsv41_nb.engram_table import Engram, head_shards, engram_lookup
from dsv41_nb import distributed as dd
from dsv41_nb import distributed_model as dm

pytestmark = pytest.mark.processes    # run apart from other pytest workers (see conftest)

TINY = ModelConfig.tiny()
W = MoEWeights.random(TINY, seed=3)
_G = torch.Generator().manual_seed(11)
def _batch(n): return torch.randn(n, TINY.dim, generator=_G).bfloat16()

XS = [_batch(9), _batch(5)]
IDLE = [_batch(6), _batch(0)]                                                   # rank 1 has no tokens
TO_RANK1 = replace(W, bias=W.bias + 100 * (torch.arange(TINY.n_routed_experts) >= 4))   # every token to rank 1
WORK = [[_batch(3), _batch(0), _batch(4)], [_batch(2)]]
EXCHANGE = [[0, 3], [2, 1]]
HASHER = NgramHasher(TINY, *compressed_token_map(synthetic_token_strings(TINY.vocab_size,
                                                                         TINY.engram_compressed_vocab_size)))
ENGRAM = Engram.random(TINY, TINY.engram_layer_ids[1], seed=5)
PLAN = head_shards(TINY, 2)[1]
ROW_IDS = [HASHER(torch.randint(0, TINY.vocab_size, (n,), generator=_G))[:, 1] for n in (7, 0)]
MODEL = init_random(TINY, seed=4)
def _ids(b, n):
    ids = torch.randint(0, TINY.vocab_size, (b, n), generator=_G)
    ids[0, n // 2:n // 2 + 2] = TINY.image_token_id                            # an image span: masked routing, Engram
    return ids
REQUESTS = [[_ids(1, 9)], [_ids(2, 5), _ids(1, 4)]]                              # rank 0 idle in the second step

SCENARIOS = dict(default=(dd.ep_moe_job, (XS, W, TINY)), torch=(dd.ep_moe_job, (XS, W, TINY, 'torch')),
                 idle=(dd.ep_moe_job, (IDLE, W, TINY, 'torch')), skewed=(dd.ep_moe_job, (XS, TO_RANK1, TINY, 'torch')),
                 steps=(dd.dp_moe_job, (WORK, W, TINY, 'torch')),
                 engram=(dm.engram_shard_job, (ROW_IDS, ENGRAM.table, PLAN)),
                 exchange=(dd.exchange_job, (EXCHANGE,)), model=(dm.dp_model_job, (MODEL, REQUESTS)))

@pytest.fixture(scope='module')
def ranks():
    "Every scenario on two gloo ranks, spawned once: {name: [rank 0 result, rank 1 result]}"
    return dict(zip(SCENARIOS, dd.run_ranks(list(SCENARIOS.values()), world_size=2)))

@pytest.fixture(scope='module')
def one_process():
    "Each step of REQUESTS through the whole model in this process, with one rank's share of the cores"
    with dd.rank_threads(2): return [[dm.step_trace(MODEL, ids) for ids in steps] for steps in REQUESTS]

def _same(a, b): torch.testing.assert_close(a, b, rtol=0, atol=0)

def test_exchange_delivers_rows_in_rank_order(ranks):
    for r, got in enumerate(ranks['exchange']):
        assert got.tolist() == [[s, r, i] for s in range(2) for i in range(EXCHANGE[s][r])]

def test_routing_and_dispatch_counts_exact(ranks):
    "The replicated router's ids, rows per destination from the ids, and what each rank receives is what was sent"
    for name in ('default', 'torch', 'idle', 'skewed'):
        xs, Wl = {'idle': IDLE}.get(name, XS), TO_RANK1 if name == 'skewed' else W
        for r, got in enumerate(ranks[name]):
            ids = route_layer(xs[r], Wl, TINY)[1]
            _same(got['ids'], ids)
            assert got['send_counts'] == torch.bincount(ids.flatten() // 4, minlength=2).tolist()
            assert got['recv_counts'] == [ranks[name][s]['send_counts'][r] for s in range(2)]

def test_ep_equals_one_process_bit_for_bit(ranks):
    "PyTorch path: each rank's output is moe_reference on its batch alone (same fp32 additions, same order)"
    with use_kernels('torch'):
        for r in range(2): _same(ranks['torch'][r]['out'], moe_reference(XS[r], W, TINY))

def test_ep_default_path_equals_simulation(ranks):
    "This machine's default path (Triton interpreter in CI): the same rows through the same stages as in one process"
    sim = dd.ep_moe_simulated(XS, W, TINY)
    for r in range(2): _same(ranks['default'][r]['out'], sim['outs'][r])

def test_rank_with_zero_tokens(ranks):
    "An idle rank routes nothing but serves its experts: it receives rank 0's rows and joins every exchange"
    idle = ranks['idle']
    assert idle[1]['out'].shape == (0, TINY.dim) and idle[1]['send_counts'] == [0, 0]
    assert sum(idle[1]['recv_counts']) > 0
    with use_kernels('torch'): _same(idle[0]['out'], moe_reference(IDLE[0], W, TINY))

def test_uneven_expert_loads(ranks):
    "A bias that sends every token to rank 1's experts: rank 0's experts get nothing, outputs unchanged"
    skewed, k = ranks['skewed'], TINY.n_activated_experts
    assert [sum(r['recv_counts']) for r in skewed] == [0, k * sum(len(x) for x in XS)]
    with use_kernels('torch'):
        for r in range(2): _same(skewed[r]['out'], moe_reference(XS[r], TO_RANK1, TINY))

def test_data_parallel_steps_with_dummy_batches(ranks):
    steps = ranks['steps']
    assert [s['log'] for s in steps] == [[3, 0, 4], [2, 'dummy', 'dummy']]
    with use_kernels('torch'):
        for r in range(2):
            assert len(steps[r]['outs']) == len(WORK[r])
            for got, x in zip(steps[r]['outs'], WORK[r]): _same(got, moe_reference(x, W, TINY))

def test_sharded_engram_equals_unsharded(ranks):
    for r in range(2):
        assert ranks['engram'][r].shape == (len(ROW_IDS[r]), PLAN[-1][1], TINY.engram_head_dim)
        _same(ranks['engram'][r], engram_lookup(ENGRAM.table, ROW_IDS[r]))

def test_whole_model_step_equals_one_process(ranks, one_process):
    "Attention data-parallel, MoE expert-parallel, Engram sharded: each step's routing and logits are one process's"
    got = ranks['model']
    assert [g['log'] for g in got] == [[1, 'dummy'], [2, 1]]
    for r in range(2):
        assert len(got[r]['steps'][0]['routes']) == TINY.n_layers
        for step, ref in zip(got[r]['steps'], one_process[r]):
            _same(step['logits'], ref['logits'])
            for a, b in zip(step['routes'], ref['routes']): _same(a['ids'], b['ids'])

def test_whole_model_counts_and_zero_request_rank(ranks):
    "Rows sent follow the routing, rows received are what the peer sent; an idle rank sends none but serves its experts"
    got, per = ranks['model'], TINY.n_routed_experts // 2
    for s in range(2):
        for l in range(TINY.n_layers):
            routes = [got[r]['steps'][s]['routes'][l] for r in range(2)]
            for r in range(2):
                want = torch.bincount(routes[r]['ids'].flatten() // per, minlength=2).tolist()
                assert routes[r]['send_counts'] == want
                assert routes[r]['recv_counts'] == [routes[q]['send_counts'][r] for q in range(2)]
    idle = [got[0]['steps'][1]['routes'][l] for l in range(TINY.n_layers)]
    assert all(i['send_counts'] == [0, 0] and i['ids'].shape == (0, TINY.n_activated_experts) for i in idle)
    assert sum(sum(i['recv_counts']) for i in idle) > 0

def test_sharded_model_world_of_one(one_process):
    "One rank holds every expert and the whole table: the sharded forward is the model's own, bit for bit"
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{dd.free_port()}', rank=0, world_size=1)
    try:
        with dd.rank_threads(2), use_kernels('torch'):
            got = dm.step_trace(dm.shard_model_(copy.deepcopy(MODEL)), REQUESTS[0][0])
    finally: dist.destroy_process_group()
    _same(got['logits'], one_process[0][0]['logits'])

@settings(max_examples=examples(15), deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 6]), st.lists(st.integers(0, 6), min_size=8, max_size=8),
       st.integers(0, 2**31))
def test_simulated_exchange_equals_reference(world_size, k, sizes, seed):
    "Any world size, experts per token and batch sizes (zeros included): the exchange gives moe_reference's bits"
    cfg, g = replace(TINY, n_activated_experts=k), torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, TINY.dim, generator=g).bfloat16() for n in sizes[:world_size]]
    with use_kernels('torch'):
        sim = dd.ep_moe_simulated(xs, W, cfg)
        for got, x in zip(sim['outs'], xs): _same(got, moe_reference(x, W, cfg))
    assert sim['counts'].sum().item() == k * sum(sizes[:world_size])

@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 20), st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**31))
def test_dispatch_order_and_records(T, world_size, seed):
    "Sorted by owner, stable within an owner, counted per owner; records carry FP8 rows, local ids and weights"
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, 8, generator=g).topk(2).indices                             # (T, 2) distinct experts
    weights, x = torch.rand(T, 2, generator=g), torch.randn(T, TINY.dim, generator=g)
    order, counts = dd.dispatch_order(ids, 8, world_size)
    owner = (ids.flatten() // (8 // world_size))[order]
    assert (owner.tolist() == sorted(owner.tolist())
            and counts.tolist() == torch.bincount(owner, minlength=world_size).tolist())
    for r in range(world_size): assert order[owner == r].tolist() == sorted(order[owner == r].tolist())
    xq, expert, weight = dd.unpack_dispatch(dd.pack_dispatch(x, weights, ids, order, 8 // world_size), TINY.dim)
    _same(xq.float(), fp8_qdq(x)[order // 2])
    _same(expert, ids.flatten()[order] % (8 // world_size)); _same(weight, weights.flatten()[order])

@pytest.mark.parametrize('world_size', [1, 2, 4, 8])
def test_traffic_formulas_by_enumeration(world_size):
    "Every set of k of E experts and every own rank: the mean rows leaving a rank and ranks reached, exactly"
    E, k, per, L = TINY.n_routed_experts, TINY.n_activated_experts, TINY.n_routed_experts // world_size, TINY.n_layers
    sets = list(itertools.combinations(range(E), k))
    off = [sum(e // per != own for e in s) for s in sets for own in range(world_size)]
    reached = [len({e // per for e in s} - {own}) for s in sets for own in range(world_size)]
    t = dm.ep_traffic(TINY, world_size, 3)
    out_row = dd.dispatch_codec(TINY.dim).record_bytes + dd.DISPATCH_META
    assert math.isclose(t['dispatch_bytes'], L * 3 * sum(off) / len(off) * out_row, rel_tol=1e-12)
    assert math.isclose(t['combine_bytes'], L * 3 * sum(off) / len(off) * 2 * TINY.dim, rel_tol=1e-12)
    assert math.isclose(t['remote_ranks_per_token'], sum(reached) / len(reached), rel_tol=1e-12, abs_tol=1e-15)

def test_bad_inputs():
    "Each refused with its reason: before any collective, so a bad rank cannot leave its peers waiting"
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{dd.free_port()}', rank=0, world_size=1)
    try:
        x, half = XS[0], dd.local_experts(W, 0, 2)
        sharded, unquantised = dm.shard_model_(copy.deepcopy(MODEL)), copy.copy(MODEL)
        unquantised.quant = False
        shard = ENGRAM.table.shard(*PLAN[0][2:])
        cases = [
            (lambda: dd.expert_range(8, 0, 3), 'do not split evenly over 3 ranks'),
            (lambda: dd.expert_range(8, -1, 2), 'rank -1 outside 0..1'),
            (lambda: dd.local_experts(half, 0, 4), 'world size mismatch: the weights hold 4 of 8'),
            (lambda: dd.local_experts(None, 0, 2), 'expected MoEWeights'),
            (lambda: dd.run_ranks([], backend='mpi'), "backend 'mpi'"),
            (lambda: dd.run_ranks([dd.exchange_job]), 'jobs must be a list of (function, args tuple) pairs'),
            (lambda: dd.run_ranks([], world_size=0), 'world_size = 0'),
            (lambda: dd.exit_rank(-1), 'exit_rank: code = -1; expected at least 0'),
            (lambda: dd.exit_rank(1.0), 'exit_rank: code must be an int, got 1.0'),
            (lambda: dd.ep_moe_forward(x, half, TINY), 'world size mismatch'),
            (lambda: dd.ep_moe_forward(x[:, :32], W, TINY), 'x: expected shape (tokens, 64)'),
            (lambda: dd.ep_moe_forward(x, W, TINY, token_ids=torch.zeros(3, dtype=torch.int64)), 'token_ids'),
            (lambda: dd.exchange(torch.zeros(4, 2), [3], [3]), 'send counts add up to 3, rows has 4'),
            (lambda: dd.unpack_dispatch(torch.zeros(1, 74), 64), 'expected uint8 records (n, 74)'),
            (lambda: dd.dispatch_codec(48), 'dim = 48 is not a multiple of 32'),
            (lambda: dd.dispatch_order(torch.zeros(3, 2), 8, 2), 'expected int expert ids (tokens, k)'),
            (lambda: dd.dispatch_order(torch.tensor([[0, 8]]), 8, 2), 'expert ids 0..8 outside 0..7'),
            (lambda: dd.pack_dispatch(x, torch.rand(9, 2), torch.zeros(8, 2, dtype=torch.int64),
                                      torch.arange(16), 4), 'do not describe one batch'),
            (lambda: dd.ep_combine(torch.zeros(4, 64), torch.arange(4), torch.zeros(2, 2, dtype=torch.int64),
                                   torch.zeros(3, 64)), 'expected outputs (4, dim), order (4,) and shared (2, dim)'),
            (lambda: dm.sharded_engram_lookup(shard, ROW_IDS[0], PLAN),
             'splits the table over 2 ranks, the group has 1'),
            (lambda: dm.sharded_engram_lookup(ENGRAM.table, ROW_IDS[0], PLAN[:1]), 'rank 0 holds rows [0, '),
            (lambda: dm.sharded_engram_lookup(ENGRAM.table, ROW_IDS[0][:, :2], [(0, 6, 0, ENGRAM.table.rows)]),
             'expected int ids (tokens, 6)'),
            (lambda: dm.check_engram_plan('table', PLAN, 0, 2), 'expected an EngramTable'),
            (lambda: dm.ep_traffic(TINY, 3, 1), '8 routed experts do not split evenly over 3 ranks'),
            (lambda: dm.ep_traffic(TINY, 2, -1), 'batch = -1'),
            (lambda: dm.shard_model_(W), 'expected a Transformer, got MoEWeights'),
            (lambda: dm.shard_model_(sharded), 'the model is already sharded'),
            (lambda: dm.shard_model_(unquantised), 'set model.quant = True'),
            (lambda: dm.dummy_step(MODEL), 'expected a sharded model'),
            (lambda: dd.rank_threads(-1).__enter__(), 'world_size = -1'),
        ]
        for f, msg in cases: fails_with(f, contains=msg)
    finally: dist.destroy_process_group()
    fails_with(lambda: dd.ep_moe_forward(x, W, TINY), contains='torch.distributed is not initialised')
    fails_with(lambda: dd.exchange(torch.zeros(1), [1], [1]), contains='torch.distributed is not initialised')
    fails_with(lambda: dm.shard_model_(copy.deepcopy(MODEL)), contains='torch.distributed is not initialised')


def test_a_rank_cuts_and_runs_experts_held_in_planes():
    """A served layer's routed gate and up weights may be planes (10b): a rank's slice of them is the planes of its
    slice of the codes, and its experts' outputs are those of the codes"""
    from dsv41_nb.moe_planes import planes_moe
    from dsv41_nb.fused_moe import fp8_act_quant
    cfg = replace(TINY, dim=256, moe_inter_dim=64)
    Wc = MoEWeights.random(cfg, seed=5)
    mine = dd.local_experts(planes_moe(Wc), 1, 2)
    want = planes_moe(dd.local_experts(Wc, 1, 2))
    assert all(torch.equal(getattr(mine, n).words, getattr(want, n).words)
               and torch.equal(getattr(mine, n).scale_words, getattr(want, n).scale_words) for n in ('w1', 'w3'))
    g = torch.Generator().manual_seed(5)
    xq = fp8_act_quant(torch.randn(6, cfg.dim, generator=g).bfloat16())
    expert, weight = torch.tensor([0, 3, 1, 0, 2, 3]), torch.rand(6, generator=g)
    assert torch.equal(dd.local_expert_outputs(xq, expert, weight, mine, cfg.swiglu_limit),
                       dd.local_expert_outputs(xq, expert, weight, dd.local_experts(Wc, 1, 2), cfg.swiglu_limit))


def _sum_all(xs): return sum(float(x.sum()) for x in xs)


def test_ranks_leave_no_descriptors_behind():
    ("The jobs' tensors reach the ranks through a file: passed as spawn arguments they would move into shared memory, "
     "each keeping a file descriptor of this process open while it lives (hundreds per model: past 1,023, `select` "
     "and other calls fail)")
    xs = [torch.full((4,), float(i)) for i in range(64)]          # 64 storages
    fds = lambda: len(os.listdir('/proc/self/fd'))
    before = fds()
    assert dd.run_ranks([(_sum_all, (xs,))]) == [[_sum_all(xs)] * 2]
    assert fds() - before < 8
    assert all(not x.is_shared() for x in xs)
