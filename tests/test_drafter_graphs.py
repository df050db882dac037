"""The drafter on the serving path against the reference: its served MoE against the block's own, its drafts through
the (emulated) graphs against the drafter alone, padded or above the largest size, and the engine's greedy tokens with
the served drafter against the engine without speculation; one table of bad inputs."""
import tempfile
from dataclasses import replace
import pytest
import torch
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.model import init_random, ByteTokenizer
from dsv41_nb.model_forward import DenseRun
from dsv41_nb.dspark import Drafter, window_positions
from dsv41_nb.dspark_decode import DSparkProposer
from dsv41_nb.dspark_serving import save_drafter
from dsv41_nb.paged import block_seam
from dsv41_nb.drafter_graphs import ServedMoE, DrafterGraphs, DraftPacer, simulate_pacer
from dsv41_nb.checkpoint import DRAFTER_NAME
from dsv41_nb.engine import LLM
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.dispatch import use_kernels

TINY = ModelConfig.tiny()
pytestmark = pytest.mark.usefixtures('one_thread')   # conftest: tiny tensors, one thread


@pytest.fixture(scope='module')
def model():
    m = init_random(TINY, seed=0, max_seq_len=4096)
    m.quant = True
    return m


def windows(N, seed=0):
    "Random drafter inputs of N requests: contexts (N, W, dim), positions, validity, newest tokens"
    g, W = torch.Generator().manual_seed(seed), TINY.window_size
    x = torch.randn(N, W, TINY.dim, generator=g).to(torch.bfloat16)
    pos, valid = window_positions(torch.randint(0, 60, (N,), generator=g), W)
    return x, pos, valid, torch.randint(1, TINY.vocab_size, (N,), generator=g)


def test_served_moe_is_the_block_moe_on_a_cpu():
    """On a CPU the served MoE is the reference loop over weights dequantised once: the block's own MoE exactly, with
    the drafter's top-k (here 3 of 4), not the backbone's"""
    cfg = replace(TINY, dspark_n_activated_experts=3)
    m = init_random(cfg, seed=1, max_seq_len=4096)
    blk, y = m.mtp[1], torch.randn(3, 5, cfg.dim).to(torch.bfloat16)
    run = DenseRun(cfg, torch.arange(5), True)
    served = ServedMoE(blk.ffn, cfg)
    assert served.n_activated == 3 != cfg.n_activated_experts
    with torch.no_grad(): assert torch.equal(served(y, run), blk.ffn(y, run))


def test_a_served_drafter_drafts_as_the_reference(model):
    "Serving swaps kernels, not arithmetic, on a CPU: the same drafts and confidence; the reference drafter untouched"
    ref, served = Drafter(model), Drafter(model).serve()
    assert ref.moes is None and ref.seams is None
    assert len(served.moes) == len(served.seams) == TINY.n_mtp_layers
    a = windows(5)
    with torch.no_grad(): want, got = ref.draft(*a), served.draft(*a)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.confidence, want.confidence)


def test_emulated_graphs_pad_and_replay(model):
    "Padded sizes draft as the requests alone; a captured size is reused; above the largest size runs eagerly"
    d = Drafter(model).serve()
    graphs, a = DrafterGraphs(d, sizes=(2, 4), emulate=True), windows(6, seed=1)
    with torch.no_grad(), use_kernels('torch'):     # the padding and buffers, not the kernels, are under test
        for n in (3, 6, 1):
            want, got = d.draft(*(t[:n] for t in a)), graphs(*(t[:n] for t in a))
            assert torch.equal(got.tokens, want.tokens) and (got.logits is None) == (n <= 4)
            torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-4, atol=1e-4)
    assert sorted(graphs.graphs) == [2, 4] and graphs.stats == dict(replayed=2, eager=1, captured=0)


def test_capture_all_captures_every_size_once(model):
    "capture_all: every size, largest first, in the weights' dtype; then replays draft as the drafter alone"
    d = Drafter(model).serve()
    graphs, a = DrafterGraphs(d, sizes=(1, 2, 4), emulate=True), windows(3, seed=4)
    with torch.no_grad(), use_kernels('torch'):
        assert graphs.capture_all() == [4, 2, 1] and graphs.capture_all() == []
        assert graphs.graphs[4][1][0].dtype == model.embed.weight.dtype
        got, want = graphs(*a), d.draft(*a)
    assert torch.equal(got.tokens, want.tokens) and graphs.stats['replayed'] == 1


def test_stale_rows_never_leak_into_a_smaller_batch(model):
    "A size replayed for fewer requests than last time: the rows past N are padding again, the first N fresh"
    d = Drafter(model).serve()
    graphs, big, small = DrafterGraphs(d, sizes=(4,), emulate=True), windows(4, seed=2), windows(2, seed=3)
    with torch.no_grad(), use_kernels('torch'):
        graphs(*big)
        got, want = graphs(*small), d.draft(*small)
        x, pos, valid, tokens = graphs.graphs[4][1]
    assert torch.equal(got.tokens, want.tokens)
    assert not valid[2:].any() and not tokens[2:].any() and not x[2:].any()


def test_the_engine_serves_dspark_and_keeps_greedy_tokens(model):
    "LLM(speculative='dspark') serves its drafter (no graphs on a CPU); greedy tokens as without speculation"
    tok = ByteTokenizer(TINY)
    prompts = [tok.encode(s) for s in ('the cat sat', 'a', 'one two three four')]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(model, max_model_len=128, kernels='torch').generate(prompts, sp, use_tqdm=False)
    with tempfile.TemporaryDirectory() as d:
        save_drafter(Drafter(model), f'{d}/{DRAFTER_NAME}')
        llm = LLM(model, speculative='dspark', drafter=f'{d}/{DRAFTER_NAME}', num_speculative_tokens=3,
                  max_model_len=128, kernels='torch')
    with use_kernels('torch'): spec = llm.generate(prompts, sp, use_tqdm=False)     # the drafter's too
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    prop = llm.llm_engine.proposer
    assert prop.drafter.moes is not None and prop.graphs is None
    assert llm.llm_engine.scheduler.stats['draft_tokens'] > 0


def test_serve_takes_graphs_only_on_a_gpu(model):
    "serve(capture) on a CPU model: served, no graphs (nothing to capture on)"
    p = DSparkProposer(Drafter(model)).serve(capture=8)
    assert p.drafter.moes is not None and p.graphs is None


BAD = [
    (lambda m: ServedMoE(m.mtp[0].attn, TINY), TypeError, 'expected a MoE'),
    (lambda m: DrafterGraphs('drafter'), TypeError, 'expected a Drafter'),
    (lambda m: DrafterGraphs(Drafter(m)), ValueError, 'must be served first'),
    (lambda m: DrafterGraphs(Drafter(m).serve(), sizes=(0,), emulate=True), ValueError, 'size'),
    (lambda m: DrafterGraphs(Drafter(m).serve(), sizes=(), emulate=True), ValueError, 'no sizes'),
    (lambda m: DrafterGraphs(Drafter(m).serve()), ValueError, 'CUDA graphs need a GPU'),
    (lambda m: DrafterGraphs(Drafter(m).serve(), emulate=True)(*windows(2)[:3], torch.zeros(1, dtype=torch.int64)),
     ValueError, 'expected (N, 16, 64)'),
    (lambda m: DrafterGraphs(Drafter(m).serve(), emulate=True)(windows(2)[0][:, :3], *windows(2)[1:]),
     ValueError, 'expected (N, 16, 64)'),
    (lambda m: DrafterGraphs(Drafter(m).serve(), emulate=True).capture_all(torch.int8), TypeError,
     'expected a floating torch.dtype'),
    (lambda m: DSparkProposer(Drafter(m)).serve(-1), ValueError, 'capture'),
    (lambda m: DraftPacer(0), ValueError, 'max_backoff'),
    (lambda m: DraftPacer(tolerance=1.5), ValueError, 'tolerance = 1.5'),
    (lambda m: DraftPacer(tolerance=True), ValueError, 'tolerance = True'),
    (lambda m: DraftPacer().observe(-1.0, True, 1), ValueError, 'seconds = -1.0'),
    (lambda m: DraftPacer().observe(1.0, True, None), ValueError, 'tokens = None'),
    (lambda m: simulate_pacer('pacer', 1e-3, 1e-3, 1), TypeError, 'expected a DraftPacer, got str'),
    (lambda m: simulate_pacer(DraftPacer(), 1e-3, 1e-3, 1, steps=0), ValueError, 'steps = 0'),
    (lambda m: simulate_pacer(DraftPacer(), -1e-3, 1e-3, 1), ValueError, 'must be >= 0'),
    (lambda m: block_seam(m.mtp[0], 'moe'), ValueError, "expected 'attn' or 'ffn'"),
]


@pytest.mark.parametrize('make,exc,msg', BAD)
def test_bad_inputs(model, make, exc, msg):
    fails_with(lambda: make(model), contains=msg)
    with pytest.raises(exc): make(model)


def _flat(T): return torch.full(torch.as_tensor(T).shape, 1e-3, dtype=torch.float64)   # every step 1 ms


def test_the_pacer_backs_off_while_drafting_costs_more_than_it_earns(model):
    """A drafter costing 10 ms against 1 ms steps never pays: probes at steps 1, 3, 6, 11, 20, 29 (backoff
    doubling to 8); a free one always pays; one that pays again resets the backoff"""
    prop = DSparkProposer(Drafter(model), adaptive=True, step_cost=_flat)
    with torch.no_grad(): dr = prop.drafter.draft(*windows(2))
    k, slow, free = torch.tensor([3, 2]), DraftPacer(max_backoff=8), DraftPacer()
    drafted = []
    for step in range(1, 31):
        if slow.draft_now(): slow.update(prop, dr, k, 10e-3); drafted.append(step)
        if free.draft_now(): free.update(prop, dr, k, 0.0)
    assert drafted == [1, 3, 6, 11, 20, 29] and slow.backoff == 8
    assert free.stats == dict(drafted=30, skipped=0, paid=30, held=0)
    while not slow.draft_now(): pass
    slow.update(prop, dr, k, 0.0)
    assert slow.backoff == 1 and slow.skip == 0 and slow.draft_now()


def test_an_adaptive_engine_proposer_skips_steps_and_keeps_greedy_tokens(model):
    "Served in the engine, an adaptive proposer whose drafter cannot pay (1 ms steps) skips steps; tokens unchanged"
    tok = ByteTokenizer(TINY)
    prompts = [tok.encode(s) for s in ('the cat sat', 'one two three four')]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = LLM(model, max_model_len=128, kernels='torch').generate(prompts, sp, use_tqdm=False)
    prop = DSparkProposer(Drafter(model), 3, adaptive=True, step_cost=_flat)
    llm = LLM(model, proposer=prop, max_model_len=128, kernels='torch')
    with use_kernels('torch'): spec = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert prop.pacer is not None and prop.pacer.stats['skipped'] > 0 and prop.pacer.stats['paid'] == 0
    assert DSparkProposer(Drafter(model), 3).serve().pacer is None          # fixed: drafts every step


@pytest.mark.parametrize('tolerance', [0.02, 0.1])
def test_the_ledger_bounds_what_a_losing_drafter_costs_and_lets_a_paying_one_draft(tolerance):
    "Measured steps: a drafter that loses costs at most the tolerance plus one run; one that pays drafts nearly always"
    loses = DraftPacer(tolerance=tolerance)
    ratio = simulate_pacer(loses, 2e-3, 3e-3, 0.5)
    assert 1 - tolerance - 6e-3 / 3 <= ratio < 1 and 0 < loses.stats['drafted'], (ratio, loses)
    pays = DraftPacer(tolerance=tolerance)
    assert simulate_pacer(pays, 0.3e-3, 0.5e-3, 2.5) > 1.5 and pays.stats['held'] < 100, pays
    assert simulate_pacer(DraftPacer(tolerance=None), 2e-3, 3e-3, 0.5, steps=300) < 0.5   # the ledger is what holds it


def test_the_ledger_credits_tokens_told_late_to_the_run_they_belong_to():
    "Under async scheduling a run's last gains arrive with the next plain step: they lower the run's measured loss"
    p = DraftPacer()
    p.observe(1e-3, True, 1)                  # the plain price: 1 ms
    p.observe(3e-3, False, 1); p.observe(3e-3, False, 1)   # a run: 6 ms for 2 tokens told so far
    assert p.loss == pytest.approx(4e-3) and p.run == pytest.approx(4e-3)
    p.observe(1e-3, True, 4)                  # 3 more tokens of the run, told late
    assert p.loss == pytest.approx(1e-3) and p.probe == pytest.approx(1e-3) and p.run is None
    assert p.time == pytest.approx(8e-3)
