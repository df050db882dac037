"""The MoE as GEMVs for one or two tokens: each stage against its PyTorch twin, the layer through the fused MoE's oracle
with forced slices, the decode step's dispatch to it, the slice rule, and the bad inputs."""
from dataclasses import replace
from functools import partial
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import kernel_backend
from dsv41_nb.moe import MoEWeights, route, moe_experts_reference
from dsv41_nb.fused_moe import (ExpertAlignment, align_by_expert_torch, fp8_act_quant, expert_gate_up_torch,
                                expert_down_torch, check_fused_moe)
import dsv41_nb.moe_gemv as mg
from dsv41_nb.moe_gemv import gemv_gate_up, gemv_down, gemv_split, gemv_stages, moe_gemv_experts, moe_gemv_forward
from machine import DEV, needs_triton

TINY = ModelConfig.tiny()
WIDE = replace(TINY, dim=128)                       # gate/up K = 128: 4 steps of 32; down K = 64: 2 steps
SMALL = dict(block_n=32, block_k=32, num_warps=4, programs=32)
W_T, W_W = MoEWeights.random(TINY, 0, DEV), MoEWeights.random(WIDE, 1, DEV)

def _inputs(cfg, W, T, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, cfg.dim, generator=g)).to(DEV)
    return (x, *route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale))

@needs_triton
@pytest.mark.parametrize('T', [1, 2, 3])
def test_stages_equal_their_twins(T):
    "Gate/up rows: routed then shared, each the twin's bits; down: the twin's combination of them"
    x, tw, ti = _inputs(TINY, W_T, T, T)
    h = gemv_gate_up(x, tw, ti, W_T, TINY.swiglu_limit)
    xq, al, sh = fp8_act_quant(x), align_by_expert_torch(ti, TINY.n_routed_experts, 16), ExpertAlignment.identity(T, 16)
    k = ti.shape[1]
    assert torch.equal(h[:T * k], expert_gate_up_torch(xq, W_T.w1, W_T.w3, al, tw, TINY.swiglu_limit))
    assert torch.equal(h[T * k:], expert_gate_up_torch(xq, W_T.shared_w1, W_T.shared_w3, sh, None, TINY.swiglu_limit))
    want = expert_down_torch(h[T * k:], W_T.shared_w2, sh, expert_down_torch(h[:T * k], W_T.w2, al))
    assert torch.equal(gemv_down(h, ti, W_T), want)

@needs_triton
@settings(max_examples=examples(6), deadline=None)
@given(T=st.integers(1, 3), split=st.sampled_from([1, 2]),
       scale=st.sampled_from([0.01, 3.0, 100.0]), seed=st.integers(0, 2**31))
def test_layer_passes_the_oracle_with_slices(T, split, scale, seed):
    x, tw, ti = _inputs(WIDE, W_W, T, seed, scale)
    old = {k: dict(v) for k, v in mg.GEMV_TUNING.items()}
    mg.GEMV_TUNING.update(gate_up=dict(SMALL), down=dict(SMALL))
    try: check_fused_moe(x, tw, ti, W_W, WIDE.swiglu_limit, stages=partial(gemv_stages, split=split))
    finally: mg.GEMV_TUNING.update(old)

@needs_triton
def test_forward_matches_the_reference_and_empty_batch():
    x, tw, ti = _inputs(TINY, W_T, 2, 5)
    assert torch.equal(moe_gemv_forward(x, W_T, TINY), moe_experts_reference(x, tw, ti, W_T, TINY.swiglu_limit))
    y = moe_gemv_experts(x[:0], tw[:0], ti[:0], W_T, TINY.swiglu_limit)
    assert y.shape == (0, TINY.dim) and y.dtype == torch.bfloat16

@needs_triton
def test_the_decode_step_takes_the_gemvs(monkeypatch):
    "The paged model's MoE calls the GEMVs up to GEMV_MAX_TOKENS tokens and the fused MoE above"
    import dsv41_nb.paged as pg
    calls = []
    monkeypatch.setattr(pg, 'moe_gemv_forward', lambda *a, **k: calls.append('gemv') or moe_gemv_forward(*a, **k))
    monkeypatch.setattr(pg, 'moe_forward',
                        lambda *a, **k: calls.append('fused') or torch.zeros(a[0].shape[0], TINY.dim))
    layer = type('L', (), {'moe': W_T})()
    model = type('M', (), {'cfg': TINY})()
    for T in (1, mg.GEMV_MAX_TOKENS, mg.GEMV_MAX_TOKENS + 1):
        pg.PagedModel._moe(model, layer, torch.randn(T, TINY.dim, device=DEV).bfloat16())
    assert calls == ['gemv', 'gemv', 'fused']

def test_gemv_split_rule():
    assert [gemv_split(20, 1008, 132, 32), gemv_split(20, 2016, 132, 32), gemv_split(4, 2240, 132, 32),
            gemv_split(7, 10**6, 132, 32), gemv_split(12, 1, 1, 6)] == [4, 2, 1, 1, 6]
    fails_with(lambda: gemv_split(0, 1, 132, 32), contains='gemv_split: steps = 0; expected at least 1')
    fails_with(lambda: gemv_split(4, 1, 132, True), contains='gemv_split: programs must be an int, got True')

@needs_triton
def test_bad_inputs_are_named():
    x, tw, ti = _inputs(TINY, W_T, 3, 7)
    h = gemv_gate_up(x, tw, ti, W_T, TINY.swiglu_limit)
    call = lambda **kw: moe_gemv_experts(**{**dict(x=x, topk_weights=tw, topk_ids=ti,
                                                   W=W_T, swiglu_limit=TINY.swiglu_limit), **kw})
    I = TINY.moe_inter_dim
    bad = [(lambda: call(x=x[:, :10]), f'x: expected shape (tokens, {TINY.dim}), got (3, 10)'),
           (lambda: call(x=x.int()), 'x: expected a floating-point tensor'),
           (lambda: call(topk_ids=ti[:2]), 'topk_ids: expected shape (3, k >= 1)'),
           (lambda: call(topk_ids=ti.float()), 'topk_ids: expected an int32/int64 tensor'),
           (lambda: call(topk_ids=ti + TINY.n_routed_experts), 'topk_ids: expert id'),
           (lambda: call(topk_weights=tw[:, :1]), 'topk_weights: expected a float tensor of shape (3, 2)'),
           (lambda: call(W='weights'), 'W: expected MoEWeights, got str'),
           (lambda: call(swiglu_limit=-1.0), 'swiglu_limit = -1.0; expected a real number >= 0'),
           (lambda: call(swiglu_limit='10'), "swiglu_limit = '10'"),
           (lambda: call(split=3), 'split = 3; expected an int >= 1 dividing the 1 K steps of 64'),
           (lambda: call(split=1.0), 'split = 1.0'),
           (lambda: gemv_gate_up(x, tw, ti, W_T, 10.0, tuning=dict(SMALL, block_n=48)),
            'tuning: block_n = 48; expected a power of two dividing 64'),
           (lambda: gemv_gate_up(x, tw, ti, W_T, 10.0, tuning={'block_n': 16}), 'tuning: expected a dict of ints >= 1'),
           (lambda: gemv_down(h[:4], ti, W_T),
            f'h: expected BF16 (9, {I}) rows from gemv_gate_up, got torch.bfloat16 (4, {I})'),
           (lambda: gemv_down(h.float(), ti, W_T), 'h: expected BF16'),
           (lambda: gemv_down(h, ti[0], W_T), 'topk_ids: expected a (tokens, k) tensor'),
           (lambda: gemv_down(h, ti, 'weights'), 'W: expected MoEWeights, got str')]
    if DEV.type == 'cuda': bad.append((lambda: call(x=x.cpu()), 'x is on cpu'))
    for fn, msg in bad: fails_with(fn, contains=msg)

def test_torch_path_is_the_reference():
    "Without a GPU or the interpreter the layer is the reference loop"
    if kernel_backend(torch.zeros(1, device=DEV)) == 'triton': pytest.skip('the kernels run here')
    x, tw, ti = _inputs(TINY, W_T, 2, 3)
    assert torch.equal(moe_gemv_experts(x, tw, ti, W_T, TINY.swiglu_limit),
                       moe_experts_reference(x, tw, ti, W_T, TINY.swiglu_limit))
