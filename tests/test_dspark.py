"""DSpark against independent computations: the one-request, slot-by-slot drafter; walking drafts one at a time
(greedy and rejection sampling with the same uniforms); the output distribution of rejection sampling (chi-square);
every vector of verify lengths tried by brute force; plain greedy decoding of the target; the scheduler and its toy
runner driven by the proposer (a state machine); and one table of bad inputs."""
import functools, itertools, math
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from hypothesis.stateful import initialize
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.model import init_random
from dsv41_nb.model_forward_block import generate_greedy
from dsv41_nb.accounting import active_params_per_token
from dsv41_nb.floors import HARDWARE, decode_floor
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.kv_manager import CacheCapacityError
from dsv41_nb.sampler import chi_square_pvalue
from test_scheduler_state_machine import SchedulerMachine, V, MAX_LEN      # the same rules, another proposer
from dsv41_nb.scheduler import SamplingParams, SchedulerConfig, Scheduler, RequestStatus, toy_generate
from dsv41_nb.scheduler_run import ToyRunner, run_until_done
from dsv41_nb.dspark import (Drafter, window_positions, reference_draft, accept_greedy, reference_accept_greedy,
                             accept_sampled, reference_accept_sampled, accept_block, reference_accept_block,
                             block_stops)
from dsv41_nb.dspark_decode import (DSparkProposer, SpecStats, prefix_survival, expected_accepted,
                                    best_verify_length, choose_verify_lengths, brute_force_verify_lengths,
                                    roofline_step_cost, speculative_generate)
from dsv41_nb.dspark_serving import (greedy_training_data, drafter_anchors, drafter_loss, train_drafter,
                                     drafter_state, save_drafter, load_drafter, set_successor_markov,
                                     walk_anchors)
from dsv41_nb.dspark_serving_measured import (StepCostProfile, profile_drafts, profile_step_costs,
                                              load_step_costs, ScriptedDrafts)

TINY = ModelConfig.tiny()


pytestmark = pytest.mark.usefixtures('one_thread')   # conftest: tiny tensors, one thread


def fp32_target(seed=0):
    "The tiny model in fp32 without FP8 rounding: batch-invariant enough for token-for-token checks"
    m = init_random(TINY, seed=seed, max_seq_len=4096).float()
    m.quant = False
    return m


@pytest.fixture(scope='module')
def drafter():
    return Drafter(fp32_target())


# ---------------------------------------------------------------- the drafter
@settings(max_examples=examples(8), deadline=None)
@given(seed=st.integers(0, 10 ** 6), n_ctx=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_batched_draft_matches_one_request_reference(drafter, seed, n_ctx):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(max(n_ctx) + 1, drafter.hidden_dim, generator=g)              # one sequence's drafter input
    tokens = torch.randint(0, TINY.vocab_size, (max(n_ctx) + 1,), generator=g)
    last = torch.tensor(n_ctx) - 1
    with torch.no_grad():
        dr = drafter.draft(*drafter.windows(drafter.context(hidden), last), tokens[last + 1])
    for j, n in enumerate(n_ctx):
        want_tokens, want_logits = reference_draft(drafter, hidden[:n], int(tokens[n]))
        assert dr.tokens[j].tolist() == want_tokens.tolist()
        torch.testing.assert_close(dr.logits[j], want_logits)        # fp32 defaults: padding only reorders sums


@pytest.mark.parametrize('temperature', [0.0, 0.7])
def test_teacher_forcing_equals_slot_by_slot(drafter, temperature):
    g = torch.Generator().manual_seed(11)
    hidden, tokens = torch.randn(30, drafter.hidden_dim, generator=g), torch.randint(0, 256, (30,), generator=g)
    w = drafter.windows(drafter.context(hidden), torch.tensor([3, 17, 28]))
    with torch.no_grad():
        dr = drafter.draft(*w, tokens[[4, 18, 29]], temperature, g)
        logits, conf = drafter.teacher_forced(*w, tokens[[4, 18, 29]], dr.tokens)
    torch.testing.assert_close(logits, dr.logits); torch.testing.assert_close(conf, dr.confidence)   # one GEMM vs five


def test_window_is_exactly_window_size(drafter):
    g = torch.Generator().manual_seed(12)
    p, W = 40, drafter.window
    hidden, tok = torch.randn(p + 1, drafter.hidden_dim, generator=g), torch.tensor([7])
    pos, valid = window_positions(torch.tensor([p]), W)
    def run(h):
        with torch.no_grad(): return drafter.trunk(drafter.context(h)[pos], pos, valid, tok)
    base = run(hidden)
    outside, inside = hidden.clone(), hidden.clone()
    outside[p - W] += 1
    inside[p - W + 1] += 1
    assert torch.equal(run(outside), base)
    assert (run(inside) - base).abs().amax(-1).min() > 1e-3   # every slot sees the oldest window position


def test_block_is_bidirectional(drafter):
    "Slot 0's output depends on the block's later positions: the noise id changes every slot"
    g = torch.Generator().manual_seed(13)
    hidden = torch.randn(10, drafter.hidden_dim, generator=g)
    w = drafter.windows(drafter.context(hidden), torch.tensor([8]))
    with torch.no_grad():
        base = drafter.trunk(*w, torch.tensor([5]))
        drafter.noise = 3
        try: other = drafter.trunk(*w, torch.tensor([5]))
        finally: drafter.noise = TINY.dspark_noise_token_id
    assert (base[:, 0] - other[:, 0]).abs().max() > 1e-3      # far above fp32 rounding (~1e-6 through three blocks)


# ---------------------------------------------------------------- verification
@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 40), k=st.integers(0, 6), vocab=st.integers(1, 5))
def test_accept_greedy_matches_walk(seed, n, k, vocab):
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(0, vocab, (n, k + 1), generator=g)
    drf = torch.randint(0, vocab, (n, k), generator=g)
    assert accept_greedy(drf, tgt).tolist() == [reference_accept_greedy(a, b)
                                                for a, b in zip(drf.tolist(), tgt.tolist())]


RULES = {'token': (accept_sampled, reference_accept_sampled), 'block': (accept_block, reference_accept_block)}


@settings(max_examples=examples(120), deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 30), k=st.integers(0, 5), vocab=st.integers(2, 9),
       same=st.booleans(), rule=st.sampled_from(sorted(RULES)))
def test_verification_matches_walk(seed, n, k, vocab, same, rule):
    "Each rule, batched, against the plain walk of each request with the same uniforms"
    batched, walk = RULES[rule]
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=g) * 2, -1)
    # p == q: every weight 1, empty residuals
    q = p[:, :k].clone() if same else torch.softmax(torch.randn(n, k, vocab, generator=g) * 2, -1)
    d = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(n, k) if k else torch.zeros(n, 0, dtype=torch.int64)
    u, v = torch.rand(n, k, generator=g), torch.rand(n, generator=g)
    a, t = batched(d, q, p, None, u, v)
    assert (list(zip(a.tolist(), t.tolist()))
            == [walk(d[i].tolist(), q[i], p[i], u[i].tolist(), float(v[i])) for i in range(n)])


@pytest.mark.parametrize('seed,vocab,greedy_drafts', [(0, 8, False), (1, 8, True), (2, 5, False)])
def test_rejection_sampling_gives_the_target_distribution(seed, vocab, greedy_drafts):
    """Each emitted position follows the target's row; a fixed seed, p-value > 1e-3 (a correct
    sampler fails 1 time in 1000)"""
    g = torch.Generator().manual_seed(seed)
    k, N = 3, 120_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    if greedy_drafts: q = torch.nn.functional.one_hot(q.argmax(-1), vocab).float()   # argmax drafts: q is a point mass
    d = torch.multinomial(q, N, replacement=True, generator=g).T
    n, last = accept_sampled(d, q.expand(N, -1, -1), p.expand(N, -1, -1), g)
    out = torch.cat([d, torch.zeros_like(d[:, :1])], 1)
    out[torch.arange(N), n] = last
    for j in range(k + 1):
        reached = n >= j
        if reached.sum() < 1000: continue                      # too few to test (point-mass drafts are often rejected)
        assert chi_square_pvalue(torch.bincount(out[reached, j], minlength=vocab), p[j]) > 1e-3, j


def test_the_distribution_test_can_fail():
    "The classic mistake, drawing from p instead of the residual after a rejection, is caught by the same test"
    g = torch.Generator().manual_seed(3)
    N, vocab = 120_000, 8
    p, q = (torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1) for _ in range(2))
    d = torch.multinomial(q[0], N, replacement=True, generator=g)
    ok = torch.rand(N, generator=g) * q[0, d] < p[0, d]
    out = torch.where(ok, d, torch.multinomial(p[0], N, replacement=True, generator=g))
    assert chi_square_pvalue(torch.bincount(out, minlength=vocab), p[0]) < 1e-6



def _chain_tables(V, depth, seed, scale=1.5):
    "Target and drafter distributions (prefixes, V) for every prefix up to `depth` tokens; a prefix's row index"
    g = torch.Generator().manual_seed(seed)
    offset = [(V ** n - 1) // (V - 1) for n in range(depth + 2)]
    P, Q = (torch.softmax(scale * torch.randn(offset[-1], V, generator=g, dtype=torch.float64), -1) for _ in range(2))
    return P, Q, offset


def _emitted_law_pvalue(verify, V=3, k=3, L=4, N=60_000, seed=2):
    """Decode N sequences block after block with `verify` on a chain whose every prefix has its own target and drafter
    distribution; the chi-square p-value of their first L tokens against the target's law over all V^L sequences"""
    P, Q, off = _chain_tables(V, L + k, seed=seed)
    off, g = torch.tensor(off), torch.Generator().manual_seed(1)
    digits, length = torch.zeros(N, dtype=torch.int64), torch.zeros(N, dtype=torch.int64)   # the emitted prefix
    while (live := (length < L).nonzero()[:, 0]).numel():
        dg, ln, rows, drafts = digits[live], length[live], [], []
        for i in range(k + 1):                   # each draft drawn from the drafter at its own prefix
            rows.append(off[ln + i] + dg)
            if i == k: break
            drafts.append(torch.multinomial(Q[rows[-1]], 1, generator=g)[:, 0]); dg = dg * V + drafts[-1]
        r, d = torch.stack(rows, 1), torch.stack(drafts, 1)
        n, last = verify(d, Q[r[:, :k]], P[r], g)
        out = torch.cat([d, torch.zeros_like(d[:, :1])], 1)
        out[torch.arange(len(live)), n] = last
        for j in range(k + 1):                   # drafts 0 .. n-1, then the draw, up to L tokens
            m = (j <= n) & (length[live] < L)
            digits[live[m]] = digits[live[m]] * V + out[m, j]; length[live[m]] += 1
    want = torch.ones(V ** L, dtype=torch.float64)
    for s in range(V ** L):
        toks = [s // V ** (L - 1 - i) % V for i in range(L)]
        for i in range(L): want[s] *= P[off[i] + sum(t * V ** (i - 1 - j) for j, t in enumerate(toks[:i])), toks[i]]
    return chi_square_pvalue(torch.bincount(digits, minlength=V ** L), want)


@pytest.mark.parametrize('rule', ['token', 'block'])
def test_verification_emits_the_targets_law(rule):
    "Both rules emit the target's law of the first four tokens (fixed seeds, p-value > 1e-3)"
    assert _emitted_law_pvalue(RULES[rule][0]) > 1e-3


def test_the_law_test_sees_an_unweighted_residual(monkeypatch):
    "Block verification drawing its last token from max(0, p - q), the classic rule's residual, fails the same test"
    from dsv41_nb import dspark
    stops = dspark.block_stops
    monkeypatch.setattr(dspark, 'block_stops', lambda d, q, p: (torch.ones(len(d), d.shape[1] + 1), stops(d, q, p)[1]))
    assert _emitted_law_pvalue(dspark.accept_block) < 1e-6


def test_block_verification_at_temperature_0_is_greedy():
    "Point masses for p (the target's argmax) and q (greedy drafts): accept_greedy's drafts and the argmax after them"
    g = torch.Generator().manual_seed(6)
    tgt = torch.randint(0, 4, (400, 6), generator=g)
    drf = torch.where(torch.rand(400, 5, generator=g) < 0.8, tgt[:, :5], torch.randint(0, 4, (400, 5), generator=g))
    n, t = accept_block(drf, torch.nn.functional.one_hot(drf, 4).double(),
                        torch.nn.functional.one_hot(tgt, 4).double(), g)
    assert torch.equal(n, accept_greedy(drf, tgt)) and torch.equal(t, tgt.gather(1, n[:, None])[:, 0])


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10 ** 6), k=st.integers(0, 5), vocab=st.integers(2, 6))
def test_block_keep_is_block_verification_of_point_masses(seed, k, vocab):
    """The sampler's point-mass form (`block_keep` on each draft's p(draft)) keeps the drafts `accept_block` keeps with
    the same uniforms, drafts as point masses; `block_keep` with probabilities of exactly 0 and 1 included"""
    from dsv41_nb.sampler import block_keep
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(50, k + 1, vocab, generator=g, dtype=torch.float64) * 2, -1)
    p[::7] = torch.nn.functional.one_hot(p[::7].argmax(-1), vocab).double()
    d = torch.randint(0, vocab, (50, k), generator=g)
    eta = torch.rand(50, k, generator=g, dtype=torch.float64)
    n, _ = accept_block(d, torch.nn.functional.one_hot(d, vocab).double(), p, eta=eta, v=torch.rand(50, generator=g))
    a = p[:, :k].gather(-1, d[..., None])[..., 0]
    assert n.tolist() == [block_keep(a[i].tolist(), eta[i].tolist()) for i in range(50)]


def test_point_mass_drafts_keep_as_many_under_both_rules():
    """Drafts as point masses: block verification keeps i drafts or more with probability w_i = a_1 ... a_i, the
    row-by-row rule's (the stop probabilities telescope)"""
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(200, 5, 6, generator=g, dtype=torch.float64), -1)
    d = torch.randint(0, 6, (200, 4), generator=g)
    w, h = block_stops(d, torch.nn.functional.one_hot(d, 6).double(), p)
    at_least = 1 - (1 - h[:, 1:]).flip(1).cumprod(1).flip(1)              # P(tau >= i), i = 1 .. k
    assert torch.allclose(at_least, p[:, :4].gather(-1, d[..., None])[..., 0].cumprod(1)) and torch.allclose(
        at_least, w[:, 1:])


def test_block_stops_weights():
    "w carries min(1, w p/q) along the drafts; h_0 = 1, h_k = w_k, and no stop where the residual is empty"
    p = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]], dtype=torch.float64)
    q = torch.tensor([[[0.25, 0.75], [0.9, 0.1]]], dtype=torch.float64)
    w, h = block_stops(torch.tensor([[0, 0]]), q, p)
    assert torch.allclose(w, torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64))
    assert h[0, 0] == 1 and h[0, 2] == w[0, 2] and h[0, 1] == 0    # row 1: p == q with weight 1, nothing left


# ---------------------------------------------------------------- adaptive verification
@settings(max_examples=examples(40), deadline=None)
@given(a=st.lists(st.floats(0, 1), min_size=1, max_size=6))
def test_expected_accepted_is_the_sum_of_survivals(a):
    t = torch.tensor(a, dtype=torch.float64)
    want, s = [0.0], 1.0
    for x in a: s *= x; want.append(want[-1] + s)
    assert torch.allclose(expected_accepted(t), torch.tensor(want, dtype=torch.float64))
    assert (expected_accepted(t).diff() >= 0).all() and (expected_accepted(t) <= torch.arange(len(a) + 1)).all()


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 3), b=st.integers(1, 3), slope=st.floats(0, 1),
       curve=st.floats(0, 0.1), fixed=st.floats(0.1, 2))
def test_choose_verify_lengths_is_optimal(seed, n, b, slope, curve, fixed):
    a = torch.rand(n, b, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    cost = lambda T: fixed + slope * T.double() + curve * T.double() ** 2
    E = expected_accepted(a)
    value = lambda ks: float((n + sum(E[r, int(k)] for r, k in enumerate(ks))) / cost(torch.tensor(n + int(sum(ks)))))
    best = max(value(ks) for ks in itertools.product(range(b + 1), repeat=n))
    assert math.isclose(value(choose_verify_lengths(a, cost)), best, rel_tol=1e-12)
    assert math.isclose(value(brute_force_verify_lengths(a, cost)), best, rel_tol=1e-12)
    if n == 1: assert int(choose_verify_lengths(a, cost)[0]) == best_verify_length(a[0], cost(1 + torch.arange(b + 1)))


def test_roofline_step_cost_is_the_larger_of_bytes_and_flops():
    full, hw = ModelConfig.full(), HARDWARE['H200 (measured copy)']
    cost = roofline_step_cost(full, hw, 790e12, world_size=8, fixed=1e-3)
    T = torch.tensor([1, 5, 50, 500, 5000])
    flops = 2 * active_params_per_token(full, 'decode')['total']
    want = [1e-3 + max(decode_floor(full, hw, int(t) * 8, 8)['seconds'], flops * int(t) / 790e12) for t in T]
    assert torch.allclose(cost(T), torch.tensor(want, dtype=torch.float64))
    assert (cost(torch.arange(1, 2000)).diff() >= 0).all()


# ---------------------------------------------------------------- the decode loop
class OracleProposer:
    "Proposes the target's true greedy continuation, with one slot corrupted at a random place (or none)"
    def __init__(self, truth: dict, k: int, seed: int):
        self.truth, self.k, self.rng, self.expected = truth, k, np.random.default_rng(seed), []
    def propose_with_probs(self, requests, hidden):
        out = []
        for r in requests:
            full = next(t for t in self.truth.values() if t[:len(r)] == list(r))
            d = list(full[len(r):len(r) + self.k])
            bad = int(self.rng.integers(0, len(d) + 1))
            if bad < len(d): d[bad] = (d[bad] + 1) % TINY.vocab_size
            out.append(d); self.expected.append(bad)
        return out, [torch.nn.functional.one_hot(torch.tensor(d, dtype=torch.int64), TINY.vocab_size).float()
                     for d in out]


def test_loop_accepts_exactly_the_correct_prefix():
    model = fp32_target(1)
    prompts = [[256, 5, 6, 7], [256, 40, 41, 42, 43, 44]]
    want = {i: generate_greedy(model, p, 16) for i, p in enumerate(prompts)}
    prop, st_ = OracleProposer(want, 4, seed=0), SpecStats()
    assert speculative_generate(model, prompts, 16, prop, stats=st_) == list(want.values())
    assert st_.accepted > 0 and st_.accepted <= sum(prop.expected)        # the last step's drafts may be cut by n
    assert st_.steps < 16


@pytest.mark.parametrize('kind', ['fixed 5', 'fixed 2', 'adaptive'])
def test_greedy_speculation_equals_greedy_decoding(drafter, kind):
    model = drafter.model
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9)]
    want = [generate_greedy(model, p, 10) for p in prompts]
    prop = {'fixed 5': DSparkProposer(drafter), 'fixed 2': DSparkProposer(drafter, 2),
            'adaptive': DSparkProposer(drafter, adaptive=True, step_cost=lambda T: 1 + 0.2 * T.double())}[kind]
    assert speculative_generate(model, prompts, 10, prop) == want


def test_sampled_loop_runs_and_counts():
    d = Drafter(fp32_target(2))
    g = torch.Generator().manual_seed(5)
    st_ = SpecStats()
    out = speculative_generate(d.model, [[256, 1, 2]], 8, DSparkProposer(d, temperature=1.0, generator=g), 1.0, g, st_)
    assert len(out[0]) == 11 and st_.emitted == 8 and st_.accepted <= st_.drafted
    assert all(0 <= t < TINY.vocab_size for t in out[0])


# ---------------------------------------------------------------- training
def test_training_moves_only_the_drafter_and_round_trips(tmp_path):
    d = Drafter(fp32_target(3))
    seqs, hidden = greedy_training_data(d.model, torch.tensor([[256, 10, 20, 30], [256, 7, 8, 9]]), 12)
    assert seqs[:, :5].tolist() == [generate_greedy(d.model, s[:4].tolist(), 1) for s in seqs]
    anchors = drafter_anchors(2, seqs.shape[1], 4, d.block_size)
    before = {k: v.clone() for k, v in d.model.state_dict().items()}
    hist = train_drafter(d, hidden, seqs, anchors, steps=8, lr=3e-3, gamma=1e-3)
    assert hist[-1]['ce'] < hist[0]['ce']
    after = d.model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith('mtp.') for k in moved)
    assert any(k.endswith('ffn.gate.bias') for k in moved)              # the drafter's routers were balanced
    save_drafter(d, tmp_path / 'd.safetensors')
    other = load_drafter(Drafter(fp32_target(4)), tmp_path / 'd.safetensors')
    torch.testing.assert_close(drafter_state(other), drafter_state(d), rtol=0, atol=0)


# ---------------------------------------------------------------- with the scheduler: a state machine
class DSparkSchedulerMachine(SchedulerMachine):
    """The scheduler state machine (its rules, invariants and drained-end checks) with a DSpark proposer in the toy
    runner, whose Markov head encodes the toy rule (t -> t + 1), fixed or adaptive verification lengths"""
    @initialize(blocks=st.sampled_from([24, 40, 200]), budget=st.sampled_from([8, 16, 64]), asyn=st.booleans(),
                k=st.integers(1, 5), adaptive=st.booleans(), slope=st.floats(0.01, 0.5), caching=st.booleans())
    def setup(self, blocks, budget, asyn, k, adaptive, slope, caching):
        d = Drafter(init_random(TINY, seed=1, max_seq_len=4096))
        set_successor_markov(d, V)
        table = torch.randn(TINY.vocab_size, d.hidden_dim, generator=torch.Generator().manual_seed(6))
        prop = DSparkProposer(d, k, adaptive, (lambda T: 1 + slope * T.double()) if adaptive else None,
                              hidden_fn=lambda t: table[t])
        cc = CacheConfig.for_model(TINY, num_gpu_blocks_override=blocks, max_model_len=MAX_LEN,
                                   enable_prefix_caching=caching)
        self.s = Scheduler(get_kv_cache_config(TINY, cc),
                           SchedulerConfig(max_num_batched_tokens=budget, async_scheduling=asyn,
                                           num_speculative_tokens=k))
        self.runner = ToyRunner(self.s.kv.kv_cache_config, V, prop)
        self.pending, self.n, self.prompts = None, 0, []
        self.want, self.got, self.aborted, self.forced, self.to_force = {}, {}, set(), set(), set()


TestDSparkScheduler = DSparkSchedulerMachine.TestCase
TestDSparkScheduler.settings = settings(max_examples=examples(10), stateful_step_count=20, deadline=None)


def test_toy_proposals_are_accepted():
    "Not only rejections: with the successor Markov head most drafts pass the toy model"
    d = Drafter(init_random(TINY, seed=1, max_seq_len=4096))
    set_successor_markov(d, V)
    table = torch.randn(TINY.vocab_size, d.hidden_dim, generator=torch.Generator().manual_seed(6))
    kvc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, num_gpu_blocks_override=60, max_model_len=MAX_LEN))
    s = Scheduler(kvc, SchedulerConfig(num_speculative_tokens=5))
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    s.add_request('a', [1, 2, 3], sp)
    got = run_until_done(s, ToyRunner(kvc, V, DSparkProposer(d, hidden_fn=lambda t: table[t])))
    assert got['a'][0] == toy_generate([1, 2, 3], sp, V)[0]
    assert s.stats['accepted_tokens'] > s.stats['draft_tokens'] / 2


# ---------------------------------------------------------------- bad input, one table for the module
@functools.lru_cache(1)
def _drafter(): return Drafter(init_random(TINY, seed=0, max_seq_len=4096))   # read only: built once

BAD = [
    (lambda: Drafter('model'), TypeError, 'expected a Transformer'),
    (lambda: _drafter().context(torch.zeros(4, 7)), ValueError, 'expected hidden states (..., S, 192)'),
    (lambda: _drafter().trunk(torch.zeros(1, 16, 64), *window_positions(torch.tensor([3, 4]), 16),
                              torch.zeros(2, dtype=torch.int64)), ValueError, 'do not fit'),
    (lambda: accept_greedy(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64)), ValueError,
     'expected (N, k) and (N, k + 1)'),
    (lambda: accept_sampled(torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2, 4), torch.ones(1, 2, 4)), ValueError,
     'expected (N, k), (N, k, V), (N, k + 1, V)'),
    (lambda: accept_block(torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2, 4), torch.ones(1, 2, 4)), ValueError,
     'accept_block: drafts (1, 2), q (1, 2, 4), p (1, 2, 4); expected (N, k), (N, k, V), (N, k + 1, V)'),
    (lambda: speculative_generate(_drafter().model, [[1]], 3, rejection='blocks'), ValueError,
     "rejection = 'blocks'; expected 'token' or 'block'"),
    (lambda: prefix_survival(torch.tensor([-0.1])), ValueError, 'values in [0, 1]'),
    (lambda: best_verify_length(torch.ones(3), torch.zeros(4)), ValueError, '(B + 1,) positive'),
    (lambda: choose_verify_lengths(torch.ones(2, 3), lambda T: T * 0.0), ValueError, 'positive seconds'),
    (lambda: roofline_step_cost(TINY, HARDWARE['H200'], 1e12, fixed=-1), ValueError, 'fixed = -1'),
    (lambda: roofline_step_cost(TINY, HARDWARE['H200'], 1e12, world_size=0), ValueError, 'world_size = 0'),
    (lambda: DSparkProposer(_drafter(), 0), ValueError, 'num_speculative_tokens = 0; expected 1..5'),
    (lambda: DSparkProposer(_drafter(), True), ValueError, 'num_speculative_tokens = True'),
    (lambda: DSparkProposer(_drafter(), temperature=-0.5), ValueError, 'temperature = -0.5'),
    (lambda: DSparkProposer(_drafter()).propose([[1, 2]], [torch.zeros(2, 192)]), ValueError,
     'expected (m, 192) of its last m positions, 1 <= m <= 1'),
    (lambda: DSparkProposer(_drafter()).propose([[1, 2]], []), ValueError, '0 hidden tensors for 1 requests'),
    (lambda: DSparkProposer(_drafter()).propose([[-1]]), ValueError, 'token ids must be in 0..511'),
    (lambda: speculative_generate(_drafter().model, [], 3), ValueError, 'expected non-empty prompts'),
    (lambda: speculative_generate(_drafter().model, [[1]], 3, temperature=-1), ValueError, 'temperature = -1'),
    (lambda: greedy_training_data(_drafter().model, torch.tensor([[1, 2]]), 3), ValueError,
     'n = 3; expected at least 7'),
    (lambda: drafter_anchors(1, 8, 4, 5), ValueError, 'hold no full block of 5'),
    (lambda: walk_anchors(torch.tensor([[1.5, 0.0]])), ValueError, 'counts >= 0'),
    (lambda: walk_anchors(torch.tensor([[1, -1]])), ValueError, 'counts >= 0'),
    (lambda: walk_anchors(torch.zeros(3)), ValueError, 'expected a non-empty (rows, anchors)'),
    (lambda: train_drafter(_drafter(), None, None, None, 0), ValueError, 'steps = 0'),
    (lambda: load_drafter(_drafter(), '/nonexistent/d.safetensors'), Exception, 'No such file'),
    (lambda: StepCostProfile((2, 1), ((0,), (0,)), ((1.0,), (1.0,))), ValueError, 'must be distinct and ascending'),
    (lambda: StepCostProfile((1,), ((0, 1),), ((1.0,),)), ValueError, 'must pair up'),
    (lambda: StepCostProfile((1,), ((1, 2),), ((1.0, 2.0),)), ValueError, 'must pair up'),
    (lambda: StepCostProfile((1,), ((0, 1),), ((1.0, -2.0),)), ValueError, 'seconds must be positive'),
    (lambda: StepCostProfile((1, 2), ((0,),), ((1.0,),)), ValueError, '2 sizes but 1 draft lists'),
    (lambda: StepCostProfile((1,), ((0,),), ((1.0,),)).for_batch(0), ValueError, 'N = 0'),
    (lambda: StepCostProfile((4,), ((0, 4),), ((1.0, 2.0),)).for_batch(4)(torch.tensor([3])), ValueError,
     'T = 3 < the 4 requests'),
    (lambda: profile_drafts(3, 0), ValueError, 'block = 0'),
    (lambda: profile_step_costs('model', (1,), 2), TypeError, 'expected a Transformer, got str'),
    (lambda: profile_step_costs(_drafter().model, (0,), 2), ValueError, 'size = 0'),
    (lambda: ScriptedDrafts(0), ValueError, 'k = 0'),
    (lambda: DSparkProposer(_drafter(), adaptive=True, step_cost=3.0), ValueError, 'or a StepCostProfile'),
]


@given(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=30), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
@settings(max_examples=examples(50), deadline=None)
def test_walk_anchors_follows_a_decode(rows):
    "Each row walked as greedy decoding would take its blocks: from anchor a, a + accepted + 1 further on"
    walk = lambda row: [row[0]] + walk(row[row[0] + 1:]) if row else []   # the first block, then the rest
    want = [a for row in rows for a in walk(row)]
    got = walk_anchors(torch.tensor(rows))
    assert got == want
    # the tokens a walk's blocks cover reach each row's last anchor, and no block starts past it
    n = len(rows[0])
    assert sum(a + 1 for a in got) >= len(rows) * n and len(got) >= len(rows)


@pytest.mark.parametrize('f,exc,msg', BAD, ids=[m for _, _, m in BAD])
def test_bad_input(f, exc, msg):
    fails_with(f, contains=msg)
    with pytest.raises(exc): f()


def test_load_drafter_rejects_another_config(tmp_path):
    save_drafter(_drafter(), tmp_path / 'd.safetensors')
    from dataclasses import replace
    other = Drafter(init_random(replace(TINY, dspark_markov_rank=8), seed=0, max_seq_len=4096))
    fails_with(lambda: load_drafter(other, tmp_path / 'd.safetensors'), contains='does not fit this model')


def test_a_profile_where_drafts_are_dear_never_speculates_and_one_where_they_are_free_always_does():
    """Under an engine profile with the jump of a step that verifies any draft, adaptive verification chooses no
    speculation even for drafts sure to be accepted (it cannot lose to speculation off); with drafts nearly free it
    verifies them all; between the profiled points it is the brute-force optimum"""
    dear = StepCostProfile((2, 8), ((0, 1, 2, 4), (0, 1, 8, 16)), ((1.0, 9.0, 9.5, 10.0), (2.0, 12.0, 13.0, 14.0)))
    free = StepCostProfile((8,), ((0, 1, 8, 16),), ((1.0, 1.001, 1.01, 1.02),))
    for n in (1, 2, 5, 8):
        assert choose_verify_lengths(torch.ones(n, 2), dear).tolist() == [0] * n
        assert choose_verify_lengths(torch.ones(n, 2), free).tolist() == [2] * n
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3):
        for _ in range(10):
            a = torch.rand(n, 2, generator=g) ** 0.2
            for prof in (dear, free):
                want = brute_force_verify_lengths(a, prof.for_batch(n)).tolist()
                assert choose_verify_lengths(a, prof).tolist() == want
    # sizes between and past the profiled ones take the smallest size at least as large (as graphs pad), else the last
    assert dear.for_batch(3)(torch.tensor([3])).item() == 2.0
    assert dear.for_batch(9)(torch.tensor([9, 10])).tolist() == [2.0, 12.0]


def test_adaptive_under_a_dear_profile_serves_exactly_as_without_speculation(tmp_path):
    "Through the engine: no draft is ever verified, and the greedy tokens are those of the engine without a proposer"
    from dsv41_nb.engine import LLM
    model = init_random(TINY, seed=3)
    dear = StepCostProfile((4,), ((0, 1, 4, 8, 12, 16, 20),), ((1.0, 9.0, 9.2, 9.4, 9.6, 9.8, 10.0),))
    prompts, sp = [list(range(40, 60)), [7] * 9, list(range(3, 30))], SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(model, kernels='torch').generate(prompts, sp, use_tqdm=False)]
    llm = LLM(model, proposer=DSparkProposer(Drafter(model), adaptive=True, step_cost=dear), kernels='torch')
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert llm.llm_engine.scheduler.stats['draft_tokens'] == 0
    # under async scheduling the scheduler reserves draft rows anyway; the runner verifies none of them
    llm = LLM(model, proposer=DSparkProposer(Drafter(model), adaptive=True, step_cost=dear), kernels='torch',
              async_scheduling=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert llm.llm_engine.scheduler.stats['draft_tokens'] == 0


def test_async_speculation_with_the_drafter_equals_greedy():
    "The untrained drafter under async scheduling, fixed at 3 drafts a step: the greedy tokens of no speculation"
    from dsv41_nb.engine import LLM
    from dsv41_nb.engine_runs import prefix_gap, assert_greedy_match
    model = init_random(TINY, seed=3)
    prompts, sp = [list(range(40, 60)), [7] * 9, list(range(3, 30))], SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(model, kernels='torch', bounded_replay=False).generate(
        prompts, sp, use_tqdm=False)]
    llm = LLM(model, proposer=DSparkProposer(Drafter(model), 3), kernels='torch', async_scheduling=True,
              bounded_replay=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    # equal up to near ties: a verify step's rows are other GEMM shapes than a decode step's (13_engine_runs)
    assert_greedy_match(model, prompts, got, want, lambda: prefix_gap(model, torch.tensor([prompts[2] + want[2]])))
    assert llm.llm_engine.scheduler.stats['draft_tokens'] > 0


def test_profile_measures_the_engine_and_round_trips(tmp_path):
    """A profile of the tiny model's engine has every point, positive seconds, prices its own points exactly, and is
    read back on the machine it was measured on only"""
    prof = profile_step_costs(init_random(TINY, seed=1), (1, 3), 2, steps=1, prompt_len=6, kernels='torch')
    assert prof.sizes == (1, 3) and prof.drafts == ((0, 1, 2), (0, 1, 3, 6))
    assert all(s > 0 for row in prof.seconds for s in row)
    assert prof.for_batch(3)(torch.tensor([3, 4, 6, 9])).tolist() == list(prof.seconds[1])
    path = prof.save(tmp_path / 'costs.json')
    assert load_step_costs(path, prof.machine) == prof and load_step_costs(path, 'elsewhere') is None
    assert load_step_costs(tmp_path / 'none.json') is None
    assert ScriptedDrafts(2, 1).propose([[5, 6], [7]]) == [[6, 6], []]


def test_profile_times_decode_steps_of_every_request(monkeypatch):
    """The profile times only steps where all N requests decode: with a token budget that chunks their prompts over
    several steps, the timed steps (the last `steps`) and the warm-up before them prefill nothing; a pool that cannot
    hold all N at once is refused by name"""
    from dsv41_nb.engine import LLMEngine
    seen, step = [], LLMEngine.step
    def logged(self, *a, **k):
        s = self.scheduler
        seen.append((len(s.waiting), len(s.running), sum(r.num_computed_tokens < r.prefill_len for r in s.running)))
        return step(self, *a, **k)
    monkeypatch.setattr(LLMEngine, 'step', logged)
    model = init_random(TINY, seed=1)
    profile_step_costs(model, (3,), 1, steps=2, prompt_len=6, kernels='torch', max_num_batched_tokens=8)
    per_point = len(seen) // 3                     # three points: 0, 1 and 3 drafts
    for k in range(3):
        point = seen[k * per_point:(k + 1) * per_point]
        assert point[0][0] == 3 and any(p[2] for p in point)          # chunked prefill happened
        assert point[-4:] == [(0, 3, 0)] * 4                          # warm-up and timed: decode of all 3
    seen.clear()                                   # one request, its prompt over three steps
    profile_step_costs(model, (1,), 1, steps=1, prompt_len=6, kernels='torch', max_num_batched_tokens=2)
    assert seen[:4] == [(1, 0, 0), (0, 1, 1), (0, 1, 1), (0, 1, 0)]
    with pytest.raises(RuntimeError, match='3 requests of 6 tokens do not all run at once'):
        profile_step_costs(model, (3,), 1, steps=1, prompt_len=6, kernels='torch', num_gpu_blocks=10)
