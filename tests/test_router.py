"""The fused router against `route`: equal ids but at near ties, weights within 1e-6 relative plus the slack of the
order of summation (random inputs; at the bench width and with logits exact in any order, -80 to 40, within 1e-6
outright), no launch for an empty batch, image spans and the PyTorch path left to `route`, the softplus device function,
the rounding of the GPU build, and the bad inputs."""
import math
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.moe import route
import dsv41_nb.router as router
from dsv41_nb.router import fused_route, check_fused_route, softplus_errors, route_ptx, TILE_ELEMS, _route_blocks
from machine import DEV, needs_triton


def _inputs(T, E, D, scale, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, D, generator=g)).to(dtype)
    gate = (torch.randn(E, D, generator=g) / D ** 0.5).to(torch.bfloat16)
    return x.to(DEV), gate.to(DEV), (0.1 * torch.randn(E, generator=g)).to(DEV)

def _exact_inputs(T, E, D, offset, seed):
    "Logits offset + a sum of multiples of 2^-10: exact in fp32 in any order of summation"
    g = torch.Generator().manual_seed(seed)
    x, gate = torch.randint(-4, 5, (T, D), generator=g) / 16., torch.randint(-4, 5, (E, D), generator=g) / 64.
    x[:, 0], gate[:, 0] = offset, 1.0
    return x.to(torch.bfloat16).to(DEV), gate.to(torch.bfloat16).to(DEV), (0.1 * torch.randn(E, generator=g)).to(DEV)

class _NoLaunch:
    "Stands in for the kernel where no launch may happen"
    def __getitem__(self, grid): raise AssertionError('the router kernel was launched')

@needs_triton
@settings(max_examples=examples(30), deadline=None)
@given(T=st.integers(0, 20), E=st.sampled_from([8, 48, 64, 100]), D=st.sampled_from([64, 200, 1000]),
       k=st.integers(1, 8), scale=st.sampled_from([0.05, 1.0, 30.0]), fp32=st.booleans(),
       seed=st.integers(0, 2**31), one=st.booleans())
# chosen logits far below zero: 1.8e-6, within the slack
@example(T=1, E=8, D=200, k=4, scale=30.0, fp32=False, seed=1, one=True)
def test_kernel_agrees_with_route(T, E, D, k, scale, fp32, seed, one):
    x, gate, bias = _inputs(T, E, D, scale, seed, torch.float32 if fp32 else torch.bfloat16)
    r = check_fused_route(x, gate, bias, min(k, E), 1.5, one_launch=one)
    assert r['tokens'] == T

@needs_triton
@settings(max_examples=examples(12), deadline=None)
@given(T=st.integers(0, 5), E=st.sampled_from([8, 48, 64]), D=st.sampled_from([64, 200, 1000]), k=st.integers(1, 8),
       scale=st.sampled_from([0.05, 1.0, 30.0]), seed=st.integers(0, 2**31))
def test_split_k_logits_pass_the_oracle(T, E, D, k, scale, seed):
    """The logits in K slices of ROUTE_SLICE columns (another order of sums): ids equal but at near
    ties, weights within the slack"""
    r = check_fused_route(*_inputs(T, E, D, scale, seed), min(k, E), 1.5, split_k=True)
    assert r['tokens'] == T

@needs_triton
@pytest.mark.parametrize('T,E,k', [(1, 64, 6), (17, 48, 6), (64, 64, 1)])
def test_bench_width(T, E, k):
    r = check_fused_route(*_inputs(T, E, 5120, 3.0, T + E + k), k, 1.5)
    assert r['differ'] == 0 and r['max_rel'] <= 1e-6

@needs_triton
@pytest.mark.parametrize('offset', [-80, -20, 0, 20, 40])
def test_exact_logits_from_log1p_to_the_threshold(offset):
    "Same logits bit for bit: softplus (both branches), sqrt, top-k and normalisation within 1e-6"
    x, gate, bias = _exact_inputs(5, 48, 640, offset, 100 + offset)
    assert torch.equal(x.float() @ gate.float().T, (x.double() @ gate.double().T).float())
    assert check_fused_route(x, gate, bias, 6, 1.5)['max_rel'] <= 1e-6

@needs_triton
def test_a_nan_expert_ranks_first_as_in_topk():
    x, gate, bias = _inputs(4, 48, 64, 1.0, 0, torch.float32)
    gate[7, 3] = float('nan')
    for one in (False, True):
        w, ids = fused_route(x, gate, bias, 3, 1.5, one_launch=one)
        assert (ids[:, 0] == 7).all() and torch.equal(ids, route(x, gate, bias, 3, 1.5)[1]) and w.isnan().all()

@needs_triton
def test_empty_batch_launches_nothing(monkeypatch):
    x, gate, bias = _inputs(3, 64, 128, 1.0, 1)
    monkeypatch.setattr(router, '_route_kernel', _NoLaunch())
    monkeypatch.setattr(router, '_select_kernel', _NoLaunch())
    w, ids = fused_route(x[:0], gate, bias, 6, 1.5)
    assert w.shape == ids.shape == (0, 6) and w.dtype == torch.float32 and ids.dtype == torch.int64

@needs_triton
def test_image_spans_and_the_torch_path_are_route(monkeypatch):
    x, gate, bias = _inputs(4, 64, 128, 1.0, 2)
    b_img, mask = bias.clone(), torch.tensor([False, True, True, False], device=DEV)
    b_img[5] = 100.
    ref = route(x, gate, bias, 6, 1.5, b_img, mask)
    assert not (ref[1][~mask] == 5).any() and (ref[1][mask] == 5).any(-1).all()
    launched = fused_route(x, gate, bias, 6, 1.5, bias_image=b_img)   # no mask: the bias alone, as route, in the kernel
    assert torch.equal(launched[1], route(x, gate, bias, 6, 1.5)[1])
    monkeypatch.setattr(router, '_route_kernel', _NoLaunch())
    monkeypatch.setattr(router, '_select_kernel', _NoLaunch())
    got = fused_route(x, gate, bias, 6, 1.5, b_img, mask)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with use_kernels('torch'):
        got = fused_route(x, gate, bias, 6, 1.5)
    ref = route(x, gate, bias, 6, 1.5)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

@needs_triton
def test_softplus_device_function():
    r = softplus_errors(torch.linspace(-100, 100, 200_001, device=DEV))
    assert (r['max_rel'] <= 1e-6 and r['max_abs_denormal'] <= 4 * 2.0 ** -149
            and r['max_ulps'] <= (2 if DEV.type == 'cuda' else 8))

def test_gpu_build_rounds_like_pytorch():
    "The sm_90 build: correctly rounded sqrt and division, no approximate ones"
    ptx = route_ptx(1, 64, 5120, 6)
    assert 'sqrt.rn.f32' in ptx and 'div.rn.f32' in ptx and 'sqrt.approx' not in ptx and 'div.full' not in ptx

@pytest.mark.parametrize('T,E,D',
                         [(1, 64, 5120), (64, 64, 5120), (64, 48, 5120), (1, 384, 5120), (3, 8, 16), (1000, 1, 7)])
def test_block_sizes(T, E, D):
    bt, be, bk = _route_blocks(T, E, D)
    assert be == 1 << (E - 1).bit_length() and bt >= 1 and bt * be <= max(be, 128) and bk >= 16
    assert bt * be * bk <= TILE_ELEMS or bk == 16

def test_bad_inputs_are_named():
    x, gate, bias = _inputs(3, 64, 128, 1.0, 3)
    base = dict(x=x, gate_weight=gate, bias=bias, n_activated=6, route_scale=1.5)
    table = [(dict(gate_weight=gate[0]), 'gate_weight: expected shape (n_experts, dim), got (128,)'),
             (dict(gate_weight=None), 'gate_weight: expected shape (n_experts, dim), got NoneType'),
             (dict(x=x[:, :100]), 'x: expected shape (tokens, 128), got (3, 100)'),
             (dict(x=x.int()), 'x: expected a floating-point tensor (tokens, 128), got torch.int32'),
             (dict(x=[[0.0] * 128]), 'x: expected a floating-point tensor (tokens, 128), got list'),
             (dict(bias=bias[:10]), 'bias: expected a float tensor of shape (64,), got (10,)'),
             (dict(bias=bias.long()), 'bias: expected a float tensor of shape (64,)'),
             (dict(n_activated=0), 'n_activated = 0; expected an int in 1..64'),
             (dict(n_activated=65), 'n_activated = 65; expected an int in 1..64'),
             (dict(n_activated='6'), "n_activated = '6'; expected an int in 1..64"),
             (dict(bias_image=bias[:3]), 'bias_image: expected a float tensor of shape (64,), got (3,)'),
             (dict(image_mask=torch.ones(3)), 'image_mask: expected a bool tensor of shape (3,)'),
             (dict(image_mask=torch.ones(2, dtype=torch.bool)),
              'image_mask: expected a bool tensor of shape (3,), got (2,)')]
    for kw, msg in table:
        fails_with(lambda: fused_route(**{**base, **kw}), contains=msg)
        fails_with(lambda: route(**{**base, **kw}), contains=msg)   # route's words
    for v in ('1.5', None, math.nan, True):
        fails_with(lambda: fused_route(**{**base, 'route_scale': v}),
                   contains=f'route_scale = {v!r}; expected a finite real number')
    fails_with(lambda: check_fused_route(x, gate, bias, 6, 1.5, rtol=-1e-6), contains='rtol must be a real number >= 0')
    fails_with(lambda: fused_route(**base, one_launch=1), contains='one_launch must be a bool')
    fails_with(lambda: fused_route(**base, split_k='yes'), contains="split_k must be a bool, got 'yes'")
    fails_with(lambda: softplus_errors(torch.zeros(2, 2)), contains='expected a 1-d fp32 tensor')
    fails_with(lambda: route_ptx(1, 8, 64, 0), contains='k must be an int >= 1')
    fails_with(lambda: route_ptx(1, 8, 64, 9), contains='k = 9 > E = 8')
