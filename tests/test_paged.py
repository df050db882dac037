"""The paged model against the reference path and against itself: greedy parity (both attention cores summed in fp64, so
that the order of their sums cannot matter), chunked prefill against one-shot prefill, bounded replay on and off against
each other on every encoder and global cache, the window floor against a per-token loop, the engine's entry point
against the runner, and bad inputs. Everything runs the PyTorch references (`use_kernels('torch')`); the kernels have
their own tests.

CPU fp32 GEMMs take another MKL kernel for fewer than four rows and round differently in the last bit, so the exact
comparisons keep every step (and every decoder sub-batch) at a multiple of four rows."""
import types
from dataclasses import replace
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples, SLOW
from fastcore import test as fct
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels, triton_interpreting
from dsv41_nb.launches import HostReads, as_captured
from dsv41_nb.model import init_random, ByteTokenizer
from dsv41_nb.csa2 import SparseIndices
from dsv41_nb.paged import PagedModel, PagedLinear, truncate_window
from dsv41_nb import paged_runner
from dsv41_nb.model import Attention
from dsv41_nb.model_forward import dense_attention
from dsv41_nb.paged_runner import (PagedRunner, fp64_attention, logits_tolerance, context_blocks,
                                   single_request_steps)
from dsv41_nb.paged_step import PagedStepModel, step_model
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config, kv_bytes_per_token
from dsv41_nb.accounting import global_kv_bytes_per_token

TINY = ModelConfig.tiny()


# Bit-level parity of the paged path with the reference, both in PyTorch on the CPU. It holds on the CPUs CI runs on; on
# the H200 machine's host CPU (torch 2.11) both tests below missed by up to 0.26 in the logits (cause not established:
# its BF16 GEMM rows are batch-invariant), so the GPU tier, which tests the compiled kernels, deselects them.
exact_cpu = pytest.mark.cpu_exact

@pytest.fixture(scope='module')
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                       # tensors this small lose time to threads on a shared machine
    model = init_random(TINY, seed=0).requires_grad_(False)
    yield model, PagedModel.from_model(model)
    torch.set_num_threads(threads)


def caches(pm, n):
    "Every cache tensor after a prefill of n tokens; of a ring only the entry still open (the others are scratch)"
    out = {(k, l): t.clone() for k in ('window', 'compressed', 'index_keys') for l, t in getattr(pm.state, k).items()}
    # ring block 1 (local ids), entry p % ratio of the open pair
    for l, ring in pm.state.rings.items():
        r = pm.cfg.compress_ratios[l]
        out['ring', l] = ring[r + (n - 1) % r].clone() if n % r else None
    return out


def same(a, b): return (a is None and b is None) or torch.equal(a, b)


@exact_cpu
def test_greedy_parity_with_the_reference(models):
    "Every paged greedy token is the argmax of the reference's logits over the same prefix (so generate_greedy's token)"
    model, pm = models
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in (70, 9, 33, 48)]
    with use_kernels('torch'), fp64_attention(pm):
        seqs, logits = PagedRunner(pm, 64, bounded_replay=False).generate(prompts, 12)
        for p, s, lg in zip(prompts, seqs, logits):
            # (12, vocab), the reference at every step
            want = model(torch.tensor([s[:-1]]))[0, len(p) - 1:]
            assert want.argmax(-1).tolist() == s[len(p):]
            assert (want - lg).abs().max().item() <= logits_tolerance(pm)



def test_fp64_attention_reaches_a_forward_defined_elsewhere(models, monkeypatch):
    """fp64_attention swaps the core every reference `forward` attends through, whatever namespace that forward reads
    its names from: here a copy of `Attention.forward` with globals of its own, as a notebook that re-ran
    10_model_forward's cells leaves behind in its process. Each layer then attends in fp64 once, and the core is back
    after the block"""
    model, pm = models
    f = Attention.forward
    monkeypatch.setattr(Attention, 'forward', types.FunctionType(f.__code__, dict(f.__globals__), f.__name__,
                                                                 f.__defaults__, f.__closure__))
    calls, attend = [], paged_runner._attend_fp64
    monkeypatch.setattr(paged_runner, '_attend_fp64', lambda *a: calls.append(1) or attend(*a))
    with use_kernels('torch'), fp64_attention(pm): model(torch.tensor([[1, 2, 3, 4]]))
    assert len(calls) == TINY.n_layers
    assert Attention.attend is dense_attention


@pytest.mark.parametrize('main,index', [('ds_fp4', 'index_mxfp4'), ('fp8_ds_mla', 'index_fp8')])
def test_allocated_bytes_per_token_are_the_layouts(models, main, index):
    "allocate's tensors charge each group its own block bytes: kv_bytes_per_token's 'per_group', not the shared pool"
    model, _ = models
    kc = get_kv_cache_config(TINY, CacheConfig.for_model(TINY, main_kv_format=main, index_key_format=index))
    pm = PagedModel.from_model(model, kc)
    counts = {'global': 9, 'swa': 7, 'compressor': 3}
    pm.allocate(counts)
    got, want, shared = pm.cache_bytes(), kv_bytes_per_token(kc, 'per_group'), kv_bytes_per_token(kc)
    for g in kc.groups:
        assert got[g.name] == counts[g.name] * g.bytes_per_block
        if g.name in want:
            measured = got[g.name] / (counts[g.name] * g.block_size)
            assert measured == want[g.name]
    assert want['global'] == global_kv_bytes_per_token(TINY, main, index) <= shared['global']
    assert (want['global'] < shared['global']) == (main == 'ds_fp4')      # fp8 records: the global group is the widest

@exact_cpu
@settings(max_examples=examples(3), deadline=None)
@given(st.integers(10, 30), st.integers(1, 12), st.integers(0, 2**31))
def test_chunked_prefill_is_one_shot_prefill(models, n4, chunk4, seed):
    _, pm = models
    n, chunk = 4 * n4, 4 * chunk4
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    blocks = context_blocks(pm.kv_cache_config, n, n)                                  # room for both: the same tables
    with use_kernels('torch'):
        one = pm.prefill(ids, n, True, blocks); c_one = caches(pm, n)
        many = pm.prefill(ids, chunk, True, blocks); c_many = caches(pm, n)
    assert torch.equal(one, many)
    for k in c_one: assert same(c_one[k], c_many[k]), k


@settings(max_examples=examples(3), deadline=None)
@given(st.integers(20, 150), st.integers(4, 64), st.integers(0, 2**31))
def test_bounded_replay_leaves_the_encoder_and_global_caches_alone(models, n, chunk, seed):
    _, pm = models
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
    blocks = context_blocks(pm.kv_cache_config, n, n)
    with use_kernels('torch'):
        pm.prefill(ids, chunk, False, blocks); full = caches(pm, n)
        pm.prefill(ids, chunk, True, blocks); rep = caches(pm, n)
    decoder_windows = {('window', l) for l in range(pm.first_decoder, TINY.n_layers)}
    for k in full:
        if k not in decoder_windows: assert same(full[k], rep[k]), k
    # the decoder windows were really replayed
    if n > TINY.window_size:
        assert any(not torch.equal(full[k], rep[k]) for k in decoder_windows)


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(-5, 70), st.booleans()), min_size=1, max_size=6),
       st.integers(1, 12), st.integers(0, 2**31))
@settings(max_examples=examples(15), deadline=None)
def test_window_with_a_floor_is_the_truncated_window(toks, W, seed):
    """window_indices with floors (the kernel under TRITON_INTERPRET=1 or on a GPU, else the tensor
    path) == truncate_window of the full window"""
    from dsv41_nb.csa2 import CSA2Step, window_indices, random_block_tables
    from dsv41_nb.dispatch import use_kernels
    pos = torch.tensor([p for p, _, _ in toks]); floor = torch.tensor([f for _, f, _ in toks])
    rows = torch.tensor([i if live else -1 for i, (_, _, live) in enumerate(toks)], dtype=torch.int32)
    bt = random_block_tables(len(toks), 16, 16 * len(toks) + 1, torch.Generator().manual_seed(seed))
    step = CSA2Step(pos, rows, bt, bt, 4, 16, torch.zeros(0), {}, None)
    with use_kernels('torch'):
        s0, l0 = window_indices(step, W)
        z = torch.zeros(len(pos), dtype=torch.int32)
        want = truncate_window(SparseIndices(s0, l0, torch.zeros(len(pos), 0, dtype=torch.int32), z, rows, bt, 16),
                               pos, floor)
    got = window_indices(step, W, floor)
    assert torch.equal(got[0], want.window_slots) and torch.equal(got[1], want.window_lens)

@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=8), st.integers(1, 12))
def test_truncate_window_against_a_loop(pairs, W):
    pos = torch.tensor([p for p, _ in pairs])
    floor = torch.tensor([min(f, p) for p, f in pairs])
    lens = (pos + 1).clamp(max=W)
    slots = torch.stack([torch.where(torch.arange(W) < l, torch.arange(W) + 1000 * i, -1) for i, l in enumerate(lens)])
    z = torch.zeros(len(pos), dtype=torch.int32)
    idx = SparseIndices(slots.int(), lens.int(), torch.zeros(len(pos), 0, dtype=torch.int32), z, z,
                        torch.zeros(1, 1, dtype=torch.int32), 1)
    out = truncate_window(idx, pos, floor)
    for i, (p, f) in enumerate(zip(pos.tolist(), floor.tolist())):
        first = p + 1 - int(lens[i])                                               # the position of slot column 0
        want = [int(slots[i, q - first]) for q in range(max(first, f), p + 1)]
        assert out.window_slots[i, :len(want)].tolist() == want and int(out.window_lens[i]) == len(want)
        assert (out.window_slots[i, len(want):] == -1).all()


def test_the_engine_hook_matches_the_runner(models):
    """step_model (the engine's entry) with bounded replay gives the runner's tokens: decode steps
    keep the decoder's floor"""
    engine = pytest.importorskip('dsv41_nb.engine')
    from dsv41_nb.scheduler import SamplingParams
    model, pm = models
    tok = ByteTokenizer(TINY)
    prompts = ['The quick brown fox jumps over the lazy dog. The end.', 'Paged caches, replayed windows',
               'def f(x):\n    return 2 * x\n', 'Hello there, world!!']
    with use_kernels('torch'):
        want, _ = PagedRunner(pm, 64, bounded_replay=True).generate([tok.encode(p) for p in prompts], 10)
        eng = engine.LLMEngine(model, tok,
                               engine.EngineArgs(runner='paged', bounded_replay=True, max_num_batched_tokens=24))
        assert isinstance(eng.runner.model, PagedStepModel)
        for i, p in enumerate(prompts): eng.add_request(f'r{i}', p, SamplingParams(temperature=0, max_tokens=10))
        got = {}
        while eng.has_unfinished_requests():
            for o in eng.step(): got[o.request_id] = o.outputs[0].token_ids
    for i, p in enumerate(prompts): assert list(got[f'r{i}']) == want[i][len(tok.encode(p)):], i


def test_bad_inputs(models):
    model, pm = models
    good = next(single_request_steps(pm, torch.arange(40) + 60, 64, bounded_replay=True))
    pm.allocate(context_blocks(pm.kv_cache_config, 40, 64))
    BAD = [
        (lambda: PagedLinear(torch.zeros(2, 3, 4)), 'expected a 2-D float weight'),
        (lambda: PagedModel.init_random(TINY, seed=-1), 'seed = -1'),
        (lambda: pm.allocate({'swa': 8}), 'expected counts for the groups'),
        (lambda: pm(replace(good, token_ids=good.token_ids[:5])), 'PagedStep.rows: expected'),
        (lambda: pm(replace(good, rows=good.rows.float())), 'PagedStep.rows'),
        (lambda: pm(replace(good, logits_rows=torch.tensor([-1]))), 'PagedStep.logits_rows: holds'),
        (lambda: pm(replace(good, logits_rows=torch.tensor([3]))), 'runs the encoder only'),
        (lambda: PagedRunner(pm, bounded_replay=True).generate([[]], 2), 'each a non-empty list'),
        (lambda: PagedStepModel(model), 'expected a PagedModel'),
        (lambda: step_model(model, 'layout'), 'expected a KVCacheConfig'),
        (lambda: context_blocks(pm.kv_cache_config, 8, 0), 'chunk = 0'),
        (lambda: fp64_attention(model).__enter__(), 'fp64_attention: expected a PagedModel, got Transformer'),
    ]
    with use_kernels('torch'):
        for f, msg in BAD: fct.test_fail(f, contains=msg)


@pytest.mark.slow      # 10c_paged_step checks the same step in CI
@pytest.mark.skipif(not triton_interpreting(),
                    reason='the read-back free path is the Triton one (run under TRITON_INTERPRET=1)')
def test_a_captured_decode_step_reads_nothing_back(models):
    "A decode-only step run as a CUDA graph capture runs it: no value read back to the host, the eager step's logits"
    engine = pytest.importorskip('dsv41_nb.engine')
    from dsv41_nb.scheduler import SamplingParams
    model, _ = models
    g = torch.Generator().manual_seed(3)
    llm = engine.LLM(model, max_model_len=256, kernels='torch')  # the prefill on the PyTorch path: the same records
    eng, sm = llm.llm_engine, llm.llm_engine.runner.model
    for i, n in enumerate((75, 6)):                # 75 tokens: more entries than the top-k in the ratio-2 layers
        eng.add_request(str(i), torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=4))
    eng.step(); eng.step()                                                     # the prefill, a first decode step
    batch, _ = eng.runner.prepare_inputs(eng.scheduler.schedule())
    with use_kernels('triton'): inputs = sm.prepare(batch)
    assert inputs.step.decode_only and inputs.replayable
    with use_kernels('triton'):
        with HostReads() as eager: want = sm.run(inputs)
        with HostReads() as captured, as_captured(): got = sm.run(inputs)
    assert eager.count > 0 and captured.count == 0, dict(captured.sites)
    assert torch.equal(got, want)

class _ThreeDrafts:
    num_speculative_tokens = 3
    def propose(self, requests): return [[1, 2, 3] for _ in requests]


class _SevenDrafts:
    num_speculative_tokens = 7
    def propose(self, requests): return [[1, 2, 3, 4, 5, 6, 7] for _ in requests]


@pytest.mark.skipif(not triton_interpreting(),
                    reason='the read-back free path is the Triton one (run under TRITON_INTERPRET=1); the GPU tier '
                           'captures verification steps for real')
@pytest.mark.parametrize('lengths,proposer', [
    pytest.param((75, 6), _ThreeDrafts(), marks=pytest.mark.slow),
    pytest.param(tuple(6 + i % 9 for i in range(41)), _SevenDrafts(), id='328-rows',
                 marks=pytest.mark.skipif(not SLOW,
                                          reason='328 rows on the interpreter, about 12 minutes: DSV41_SLOW=1'))])
def test_a_captured_verification_step_reads_nothing_back(models, lengths, proposer):
    """A step that verifies drafts (each request's row and its drafts, every row sampled) is decode-only with its ring
    rows recorded: run as a capture it reads nothing back and gives the eager step's logits; with DSV41_SLOW=1 also a
    step of 41 requests and seven drafts each, 328 rows, past the 256 of a decode step"""
    engine = pytest.importorskip('dsv41_nb.engine')
    from dsv41_nb.scheduler import SamplingParams
    model, _ = models
    g = torch.Generator().manual_seed(3)
    llm = engine.LLM(model, max_model_len=256, kernels='torch', proposer=proposer, max_num_seqs=len(lengths))
    eng, sm = llm.llm_engine, llm.llm_engine.runner.model
    for i, n in enumerate(lengths):
        eng.add_request(str(i), torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=30))
    eng.step(); eng.step()                                                     # the prefill, a first verification
    batch, _ = eng.runner.prepare_inputs(eng.scheduler.schedule())
    with use_kernels('triton'): inputs = sm.prepare(batch)
    T, R = len(batch.token_ids), len(batch.request_ids)
    assert (T, R) == (len(lengths) * (1 + proposer.num_speculative_tokens), len(lengths))
    assert inputs.step.decode_only and inputs.replayable and inputs.journal
    assert all(len(t) == T for t in inputs.step.block_tables)                 # a row of tables per row
    rings = {l: r.clone() for l, r in sm.model.state.rings.items()}
    with use_kernels('triton'):
        with HostReads() as eager: want = sm.run(inputs)
        recorded = {l: r.rows.clone() for l, r in sm.ring_rows.items()}
        for l, r in rings.items(): sm.model.state.rings[l].copy_(r)              # as before the step
        with HostReads() as captured, as_captured(): got = sm.run(inputs)
    assert eager.count > 0 and captured.count == 0, dict(captured.sites)
    assert torch.equal(got, want) and all(torch.equal(r.rows, recorded[l]) for l, r in sm.ring_rows.items())


def test_served_moe_in_version_4(monkeypatch):
    """SERVED_SLOTS serves both stages on planes in 08f's version 4: the activations of each go through `pair_order`,
    and the layer's output is version 3's to within a few FP8 steps of its largest value"""
    from types import SimpleNamespace
    from dsv41_nb.moe import MoEWeights
    from dsv41_nb.moe_gemv import GEMV_MAX_TOKENS
    from dsv41_nb import paged, moe_planes
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if not (dev.type == 'cuda' or triton_interpreting()): pytest.skip('the kernel path (a GPU or the interpreter)')
    cfg = replace(ModelConfig.tiny(), dim=256, moe_inter_dim=128, n_routed_experts=8, n_activated_experts=2)
    codes = MoEWeights.random(cfg, 0, dev)
    y = torch.randn(GEMV_MAX_TOKENS + 9, cfg.dim, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    monkeypatch.setattr(paged, 'SERVED_PLANES_DOWN', True)
    out, calls = {}, []
    order = moe_planes.pair_order
    monkeypatch.setattr(moe_planes, 'pair_order', lambda x: calls.append(tuple(x.shape)) or order(x))
    for slots in (False, True):
        monkeypatch.setattr(paged, 'SERVED_SLOTS', slots)
        out[slots] = paged.served_moe(SimpleNamespace(moe=codes), y, cfg)
        assert len(calls) == (2 if slots else 0)         # the gate/up stage's activations, the down stage's
    assert (out[True].float() - out[False].float()).abs().max() <= 0.05 * out[False].float().abs().max()


@pytest.mark.slow
def test_served_moe_in_version_5(monkeypatch):
    """SERVED_FP8 serves both routed stages of the fused MoE in 08g's version 5 in 16-row blocks where experts get at
    most 16 rows, beside the planes (which the GEMVs still read): the layer's output is the default's to within a few
    FP8 steps of its largest value; with more rows it is the default's exactly, and a layer whose weights the words
    cannot hold keeps the default stages"""
    from types import SimpleNamespace
    from dsv41_nb.moe import MoEWeights
    from dsv41_nb.moe_gemv import GEMV_MAX_TOKENS
    from dsv41_nb.moe_planes import PlaneWeight
    from dsv41_nb import paged, fused_moe
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if not (dev.type == 'cuda' or triton_interpreting()): pytest.skip('the kernel path (a GPU or the interpreter)')
    cfg = replace(ModelConfig.tiny(), dim=256, moe_inter_dim=128, n_routed_experts=8, n_activated_experts=2)
    codes = MoEWeights.random(cfg, 0, dev)
    y = torch.randn(GEMV_MAX_TOKENS + 36, cfg.dim, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)
    blocks, align = [], fused_moe.align_by_expert
    monkeypatch.setattr(fused_moe, 'align_by_expert', lambda t, e, bm: blocks.append(bm) or align(t, e, bm))
    out, layers = {}, {}
    for fp8 in (False, True):
        monkeypatch.setattr(paged, 'SERVED_FP8', fp8)
        layers[fp8] = l = SimpleNamespace(moe=codes)
        out[fp8] = paged.served_moe(l, y, cfg)
        assert l._fp8 == fp8 and isinstance(l.moe.w1, PlaneWeight)          # the GEMVs' planes either way
    assert blocks == [32, 16]                 # 80 rows over 8 experts: the `batch` regime, in 16-row blocks
    assert (out[True].float() - out[False].float()).abs().max() <= 0.05 * out[False].float().abs().max()
    many = y.repeat(3, 1)[:100]               # 25 rows an expert: 32-row blocks and the default stages, exactly
    assert torch.equal(paged.served_moe(layers[True], many, cfg), paged.served_moe(layers[False], many, cfg))
    assert blocks[-2:] == [32, 32]
    small = y[:2]                             # the GEMVs' tokens: the same path with or without SERVED_FP8
    assert torch.equal(paged.served_moe(layers[True], small, cfg), paged.served_moe(layers[False], small, cfg))
    wide = replace(ModelConfig.tiny(), dim=64, moe_inter_dim=64, n_routed_experts=8, n_activated_experts=2)
    l = SimpleNamespace(moe=MoEWeights.random(wide, 0, dev))                # 64 columns: no words
    paged.served_moe(l, torch.randn(9, 64, device=dev).to(torch.bfloat16), wide)
    assert l._fp8 is False


@pytest.mark.slow
def test_served_moe_holds_planes_in_place_of_codes(monkeypatch):
    """The served MoE turns a layer's routed gate and up codes into planes once (SERVED_PLANES, weights the planes can
    hold) and keeps no codes for them; every path then reads the planes: the GEMVs, the fused MoE's stage and the
    PyTorch loop, each giving the layer of codes' output (the GEMVs to one FP8 step of a hidden value)"""
    from types import SimpleNamespace
    from dsv41_nb.moe import MoEWeights
    from dsv41_nb.fused_moe import moe_forward
    from dsv41_nb.moe_split import expert_gate_up_split, DenseShared
    from dsv41_nb.moe_gemv import GEMV_MAX_TOKENS, moe_gemv_forward
    from dsv41_nb.moe_planes import PlaneWeight
    from dsv41_nb.dispatch import use_kernels
    from dsv41_nb import paged
    from dsv41_nb.paged import served_moe, served_moe_caches
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if not (dev.type == 'cuda' or triton_interpreting()): pytest.skip('the kernel path (a GPU or the interpreter)')
    for dim, asked, planes in ((256, True, True), (64, True, False), (256, False, False)):
        monkeypatch.setattr(paged, 'SERVED_PLANES', asked)
        cfg = replace(ModelConfig.tiny(), dim=dim, moe_inter_dim=64, n_routed_experts=8, n_activated_experts=2)
        codes = MoEWeights.random(cfg, 0, dev)
        l = SimpleNamespace(moe=codes)
        g = torch.Generator().manual_seed(dim)
        y = torch.randn(GEMV_MAX_TOKENS + 3, dim, generator=g).to(dev, torch.bfloat16)
        got = served_moe(l, y, cfg)
        assert isinstance(l.moe.w1, PlaneWeight) == isinstance(l.moe.w3, PlaneWeight) == planes
        assert (l._gate_up is not expert_gate_up_split) == planes and l.moe.w2 is codes.w2
        stage, held = l._gate_up, l.moe
        assert torch.equal(served_moe(l, y, cfg), got) and l._gate_up is stage and l.moe is held   # made once
        c32 = replace(codes, gate=codes.gate.float())
        assert isinstance(l._shared, DenseShared)           # the shared expert on cuBLAS's BF16 values
        calls, dense = [], l._shared
        l._shared = lambda *a: calls.append(1) or dense(*a)
        assert torch.equal(served_moe(l, y, cfg), got) and calls == [1]      # ... and the fused path takes it
        l._shared = dense
        assert torch.equal(got, moe_forward(y, c32, cfg, gate_up=expert_gate_up_split, shared=DenseShared(c32)))
        small = y[:2]                                        # the GEMVs' tokens: planes read by the GEMVs
        gemv = moe_gemv_forward(small, c32, cfg).float()
        assert (served_moe(l, small, cfg).float() - gemv).abs().max() <= 0.05 * gemv.abs().max()
        with use_kernels('torch'):                           # the reference loop on the planes' values
            assert torch.equal(served_moe(l, y, cfg), served_moe(SimpleNamespace(moe=codes), y, cfg))
    monkeypatch.setattr(paged, 'SERVED_SHARED_DENSE', False)     # the shared expert through the MoE's kernels
    l = SimpleNamespace(moe=codes)
    got = served_moe(l, y, cfg)
    assert l._shared is None and torch.equal(got, moe_forward(y, c32, cfg, gate_up=l._gate_up))
    with pytest.raises(TypeError, match='served_moe_caches: expected a layer holding MoEWeights'):
        served_moe_caches(SimpleNamespace(moe=None))


@pytest.mark.slow
def test_served_moe_holds_the_down_weights_in_planes(monkeypatch):
    """Where the planes hold them (inter 128), the served MoE keeps the routed down weights in planes too
    (SERVED_PLANES_DOWN) and both paths read them, the fused MoE's down stage and the GEMVs, each within a BF16 step of
    the layer on codes; SERVED_PLANES_DOWN off keeps the codes and the layer on codes' bits"""
    from types import SimpleNamespace
    from dsv41_nb.moe import MoEWeights
    from dsv41_nb.fused_moe import moe_forward
    from dsv41_nb.moe_split import expert_gate_up_split, DenseShared
    from dsv41_nb.moe_gemv import GEMV_MAX_TOKENS, moe_gemv_forward
    from dsv41_nb.moe_planes import PlaneWeight
    from dsv41_nb import paged
    from dsv41_nb.paged import served_moe
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if not (dev.type == 'cuda' or triton_interpreting()): pytest.skip('the kernel path (a GPU or the interpreter)')
    cfg = replace(ModelConfig.tiny(), dim=256, moe_inter_dim=128, n_routed_experts=8, n_activated_experts=2)
    codes = MoEWeights.random(cfg, 3, dev)
    c32 = replace(codes, gate=codes.gate.float())
    y = torch.randn(GEMV_MAX_TOKENS + 3, 256, generator=torch.Generator().manual_seed(3)).to(dev, torch.bfloat16)
    want = moe_forward(y, c32, cfg, gate_up=expert_gate_up_split, shared=DenseShared(c32))
    gemv = moe_gemv_forward(y[:2], c32, cfg).float()
    close = lambda a, b: (a.float() - b.float()).abs().max() <= 0.02 * b.float().abs().max()
    for asked in (True, False):
        monkeypatch.setattr(paged, 'SERVED_PLANES_DOWN', asked)
        calls = []
        for name in ('expert_down_planes', 'gemv_down_planes'):
            f = getattr(paged, name)
            monkeypatch.setattr(paged, name, lambda *a, f=f, name=name, **k: calls.append(name) or f(*a, **k))
        l = SimpleNamespace(moe=codes)
        got, small = served_moe(l, y, cfg), served_moe(l, y[:2], cfg)
        assert isinstance(l.moe.w2, PlaneWeight) == asked and isinstance(l.moe.w1, PlaneWeight)
        assert calls == (['expert_down_planes', 'gemv_down_planes'] if asked else [])
        assert close(got, want) and close(small, gemv)
        if not asked: assert torch.equal(got, want)
        monkeypatch.undo()


@pytest.mark.skipif(not torch.cuda.is_available(), reason='a GPU')
def test_a_gpu_layer_holds_planes_when_built(monkeypatch):
    """On a GPU a layer's planes exist before any step, in place of its codes: the model holds the same bytes of
    weights either way (SERVED_PLANES off: codes and 08c's stage)"""
    from dsv41_nb import paged
    from dsv41_nb.moe_split import expert_gate_up_split
    from dsv41_nb.moe_planes import PlaneWeight
    cfg = replace(ModelConfig.tiny(), dim=256, moe_inter_dim=64)
    m = PagedModel.init_random(cfg, device='cuda')
    assert all(isinstance(l.moe.w1, PlaneWeight) and l._gate_up is not expert_gate_up_split for l in m.layers)
    monkeypatch.setattr(paged, 'SERVED_PLANES', False)
    m2 = PagedModel.init_random(cfg, device='cuda')
    assert all(not isinstance(l.moe.w1, PlaneWeight) and l._gate_up is expert_gate_up_split for l in m2.layers)
    assert m.weight_bytes() == m2.weight_bytes()
