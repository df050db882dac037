"""The fused MoE's gate/up stage split along K (version 3): one slice is version 2 bit for bit, more slices agree within
FP8 flips, the layer passes the fused MoE's oracle, the slice count rule, and the bad inputs."""
from dataclasses import replace
from functools import partial
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import kernel_backend
from dsv41_nb.moe import MoEWeights, route
from dsv41_nb.fused_moe import (ExpertAlignment, align_by_expert, fp8_act_quant, expert_gate_up, expert_gate_up_torch,
                                assert_fp8_close, check_fused_moe, moe_launch_shape, _fused_stages)
from dsv41_nb.moe_split import expert_gate_up_split, split_count, SPLIT_MAX, DenseShared
from dsv41_nb import moe_split as ms_mod
from machine import DEV, needs_triton

WIDE = replace(ModelConfig.tiny(), dim=256)          # K = 256: 8 steps of 32 to split
SHAPE = dict(moe_launch_shape(16, WIDE.n_routed_experts), block_k=32)
W = MoEWeights.random(WIDE, 0, DEV)

def _inputs(T, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, WIDE.dim, generator=g)).to(DEV)
    tw, ti = route(x, W.gate, W.bias, WIDE.n_activated_experts, WIDE.route_scale)
    return x, tw, ti, fp8_act_quant(x)

@needs_triton
@settings(max_examples=examples(10), deadline=None)
@given(T=st.integers(1, 12), split=st.sampled_from([1, 2, 4, 8]), shared=st.booleans(), seed=st.integers(0, 2**31))
def test_split_agrees_with_version_2_and_the_twin(T, split, shared, seed):
    x, tw, ti, xq = _inputs(T, seed,
                            scale=float(torch.rand(1, generator=torch.Generator().manual_seed(seed)) * 100 + 0.01))
    if shared: w1, w3, al, wts = W.shared_w1, W.shared_w3, ExpertAlignment.identity(T, 16), None
    else: w1, w3, al, wts = W.w1, W.w3, align_by_expert(ti, WIDE.n_routed_experts, 16), tw
    h = expert_gate_up_split(xq, w1, w3, al, wts, WIDE.swiglu_limit, SHAPE, split)
    v2 = expert_gate_up(xq, w1, w3, al, wts, WIDE.swiglu_limit, SHAPE)
    if split == 1: assert torch.equal(h, v2)
    assert_fp8_close(h, v2)
    assert_fp8_close(h, expert_gate_up_torch(xq, w1, w3, al, wts, WIDE.swiglu_limit))

@needs_triton
@pytest.mark.parametrize('T,split,shape', [(1, 8, SHAPE), (5, 4, SHAPE), (9, 2, SHAPE), (33, None, None)])
def test_layer_with_split_gate_up_passes_the_oracle(T, split, shape):
    x, tw, ti, _ = _inputs(T, T)
    check_fused_moe(x, tw, ti, W, WIDE.swiglu_limit, shape,
                    stages=partial(_fused_stages, gate_up=partial(expert_gate_up_split, split=split)))

@needs_triton
def test_the_split_kernels_run_and_one_slice_is_version_2(monkeypatch):
    "More than one slice launches the partial and finishing kernels (not version 2); one slice is version 2's launch"
    import dsv41_nb.moe_split as ms
    x, tw, ti, xq = _inputs(2, 0)
    al = align_by_expert(ti, WIDE.n_routed_experts, 16)
    calls = []
    monkeypatch.setattr(ms, 'expert_gate_up', lambda *a, **k: calls.append(1) or expert_gate_up(*a, **k))
    expert_gate_up_split(xq, W.w1, W.w3, al, tw, WIDE.swiglu_limit, SHAPE, 4)
    assert calls == []
    expert_gate_up_split(xq, W.w1, W.w3, al, tw, WIDE.swiglu_limit, SHAPE, 1)
    assert calls == [1]

@pytest.mark.parametrize('tiles,steps,sms,want',
                         [(216, 40, 132, 8), (36, 40, 132, 8), (2592, 40, 132, 1), (36, 6, 132, 2),
                          (864, 40, 132, 2), (1, 1, 1, 1), (1, 1024, 1, 8), (17, 40, 1, 1)])
def test_split_count(tiles, steps, sms, want):
    s = split_count(tiles, steps, sms)
    assert s == want and steps % s == 0 and s <= SPLIT_MAX and (s == 1 or tiles * s <= 16 * sms)

def test_bad_inputs_are_named():
    x, tw, ti, xq = _inputs(3, 1)
    al = align_by_expert(ti, WIDE.n_routed_experts, 16)
    call = lambda **k: expert_gate_up_split(**{**dict(xq=xq, w1=W.w1, w3=W.w3, align=al, topk_weights=tw,
                                                      swiglu_limit=WIDE.swiglu_limit, shape=SHAPE), **k})
    for kw, msg in [(dict(split=0), 'split = 0; expected an int >= 1 dividing the 8 K steps'),
                    (dict(split=-2), 'split = -2'), (dict(split=3), 'split = 3'), (dict(split=True), 'split = True'),
                    (dict(split=2.0), 'split = 2.0'), (dict(w1=W.shared_w1), 'w1: expected mxfp4 weights'),
                    (dict(w3=W.shared_w3), 'w3: expected mxfp4 weights'),
                    (dict(xq=xq[:2]), 'activations: expected 3 rows'),
                    (dict(shape={'block_m': 16}), 'shape: expected a dict with block_m, block_n, block_k'),
                    (dict(align='rows'), 'align: expected an ExpertAlignment')]:
        fails_with(lambda: call(**kw), contains=msg)
    ds, r6 = DenseShared(W), torch.zeros(6, WIDE.dim, dtype=torch.bfloat16, device=DEV)
    for fn, msg in [(lambda: DenseShared(W.shared_w1), 'DenseShared: expected MoEWeights, got QuantWeight'),
                    (lambda: ds(xq[:, :64], r6, 10.0), 'xq: expected BF16 (tokens, 256)'),
                    (lambda: ds(xq.float(), r6, 10.0), 'xq: expected BF16 (tokens, 256)'),
                    (lambda: ds(xq, r6[:5], 10.0), 'routed: expected BF16 (tokens * k, 256) for 3 tokens'),
                    (lambda: ds(xq, r6.float(), 10.0), 'routed: expected BF16')]:
        fails_with(fn, contains=msg)
    for args, msg in [((0, 8, 132), 'tiles must be an int >= 1'), ((8, 0, 132), 'steps must be an int >= 1'),
                      ((8, 8, -1), 'sms must be an int >= 1'), ((8.0, 8, 1), 'tiles must be an int >= 1')]:
        fails_with(lambda: split_count(*args), contains=msg)


@needs_triton
@settings(max_examples=examples(6), deadline=None)
@given(T=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_dense_shared_expert_passes_the_oracle(T, seed):
    """The shared expert on BF16 values through two GEMMs (cuBLAS on a GPU), SwiGLU and the combine in Triton: the
    layer within the fused MoE's oracle, stage by stage (the shared rows to an FP8 step) and end to end"""
    x, tw, ti, _ = _inputs(T, seed)
    r = check_fused_moe(x, tw, ti, W, WIDE.swiglu_limit, stages=partial(_fused_stages, shared=DenseShared(W)))
    assert r['max_err'] <= 0.05 * r['max_ref'] + 1e-3

@needs_triton
@pytest.mark.cpu_exact        # on a GPU cuBLAS adds the down sums in its own order
def test_dense_shared_combines_as_the_down_kernel():
    """The layer output adds the routed rows in slot order and then the shared expert's own BF16 row, as the down
    kernel's combine does: with the same shared rows and sums the two paths give the same bits; off the kernel path
    the PyTorch twins of the stages give the kernels' rows"""
    x, tw, ti, xq = _inputs(7, 3)
    s = _fused_stages(x, tw, ti, W, WIDE.swiglu_limit)
    ds = DenseShared(W)
    hs, y = ds(xq, s['routed'], WIDE.swiglu_limit)
    assert torch.equal(hs, s['hs'])                 # one slice of exact products: the twin's bits here
    assert torch.equal(y, s['y'])
    ms_mod_backend = ms_mod.kernel_backend
    try:
        ms_mod.kernel_backend = lambda *a: 'torch'
        hs_t, y_t = ds(xq, s['routed'], WIDE.swiglu_limit)
    finally: ms_mod.kernel_backend = ms_mod_backend
    assert torch.equal(hs_t, hs) and torch.equal(y_t, y)
