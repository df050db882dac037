"""The FP8 projection kernel: within the summation-order bound of the BF16-grid reference for every shape, slice count
and group count; the PyTorch path is that reference bit for bit; the launch rule; the module; the bad inputs."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.moe import QuantWeight, quantize_weight
from dsv41_nb.model import weight_qdq
from dsv41_nb.fused_moe import fp8_act_quant
from dsv41_nb.fp8_linear import (fp8_linear, fp8_linear_torch, fp8_linear_launch, fp8_gemv_launch, assert_linear_close,
                                 FP8Linear, FP8_LINEAR_MAX_T, FP8_GEMV_TUNING, SHORT_K, SPLIT_MAX, SPLIT_PROGRAMS,
                                 fp8_linear_norm, fp8_linear_rope)
from dsv41_nb.rope_norm import rms_norm_fused, rope
from machine import DEV, needs_triton


def _weight(G, N, K, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = quantize_weight(scale * torch.randn(G, N, K, generator=g) / K ** 0.5, 'fp8')
    return QuantWeight(w.codes.to(DEV), w.scales.to(DEV), 'fp8')

def _x(T, G, K, seed, scale=3.0):
    x = (scale * torch.randn(T, G, K, generator=torch.Generator().manual_seed(seed + 1))).to(torch.bfloat16).to(DEV)
    return x[:, 0] if G == 1 else x

@needs_triton
@settings(max_examples=examples(12), deadline=None)
@given(T=st.integers(1, 40), G=st.sampled_from([1, 1, 2]),
       N=st.sampled_from([32, 64, 96]), K=st.sampled_from([32, 64, 160, 256]),
       act=st.booleans(), split=st.sampled_from([None, 1, 2, 4]), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), mma=st.sampled_from([1, 2]))
def test_kernel_within_the_summation_bound(T, G, N, K, act, split, seed, scale, mma):
    w, x = _weight(G, N, K, seed), _x(T, G, K, seed, scale)
    y = fp8_linear(x, w, act, split, max_t=64, mma=mma)
    assert y.dtype == x.dtype and y.shape == ((T, N) if G == 1 else (T, G, N))
    assert_linear_close(y, x, w, act)

@needs_triton
def test_bound_catches_a_wrong_scale():
    w, x = _weight(1, 64, 128, 3), _x(4, 1, 128, 3)
    wrong = QuantWeight(w.codes, w.scales.clone(), 'fp8')
    wrong.scales.view(torch.uint8)[0, 1, 2] += 1                 # one 32 x 32 block twice as large
    with pytest.raises(AssertionError): assert_linear_close(fp8_linear(x, wrong), x, w)

def test_torch_path_is_the_bf16_grid_bit_for_bit():
    w, x = _weight(1, 64, 96, 5), _x(7, 1, 96, 5)
    with use_kernels('torch'):
        assert torch.equal(fp8_linear(x, w),
                           F.linear(fp8_act_quant(x).to(torch.bfloat16), w.dequantize()[0].bfloat16()))
    wg, xg = _weight(2, 32, 64, 6), _x(3, 2, 64, 6)
    with use_kernels('torch'):
        assert torch.equal(fp8_linear(xg, wg, act_quant=False),
                           torch.einsum('tgi,gri->tgr', xg, wg.dequantize().bfloat16()))

def test_large_batches_and_empty_ones_take_the_reference():
    w = _weight(1, 32, 64, 7)
    x = _x(FP8_LINEAR_MAX_T + 1, 1, 64, 7)
    assert torch.equal(fp8_linear(x, w), fp8_linear_torch(x, w))
    assert fp8_linear(x[:0], w).shape == (0, 32)

def test_module_takes_the_kernel_for_few_rows_and_its_bf16_values_for_more():
    lin = FP8Linear.from_master(torch.randn(64, 96, generator=torch.Generator().manual_seed(4)).to(DEV))
    x = _x(FP8_LINEAR_MAX_T + 3, 1, 96, 4)
    assert torch.equal(lin(x), fp8_linear_torch(x, lin.weight))           # the cached values: the reference bit for bit
    d = lin.dense()
    assert lin.dense() is d and d.dtype == torch.bfloat16 and torch.equal(d.float(), lin.weight.dequantize())
    assert_linear_close(lin(x[:1]), x[:1], lin.weight)
    with torch.no_grad(): lin.codes.view(torch.uint8)[0, 0, 0] ^= 1          # a changed weight: the cache is rebuilt
    assert lin.dense() is not d and torch.equal(lin.dense().float(), lin.weight.dequantize())

def test_from_master_holds_the_model_grid():
    g = torch.Generator().manual_seed(8)
    master = torch.randn(128, 96, generator=g).to(torch.bfloat16)
    lin = FP8Linear.from_master(master)
    assert torch.equal(lin.weight.dequantize()[0], weight_qdq(master, 'fp8').float())
    grouped = FP8Linear.from_master(master, act_quant=False, groups=4)
    assert grouped.weight.shape == (4, 32, 96)
    assert torch.equal(grouped.weight.dequantize().flatten(0, 1), weight_qdq(master, 'fp8').float())
    assert sum(p.numel() for p in lin.parameters()) == 128 * 96 + 4 * 3

@pytest.mark.parametrize('T,G,N,K', [(1, 1, 1280, 5120), (1, 1, 512, 5120), (1, 1, 32768, 1280),
                                     (1, 8, 1024, 4096), (64, 1, 5120, 8192), (3, 1, 64, 96)])
def test_launch_rule(T, G, N, K):
    s = fp8_linear_launch(T, G, N, K, 132)
    assert K % s['block_k'] == 0 and 1 <= s['split'] <= min(SPLIT_MAX, K // s['block_k'])
    assert s['steps'] == -(-(K // s['block_k']) // s['split'])            # every K step in some slice, none twice
    tiles = s['grid'][0] * s['grid'][2]
    assert s['grid'][1] == s['split'] and s['grid'][2] == -(-T // s['block_m']) * G
    if s['split'] > 1: assert tiles * s['split'] // 2 < SPLIT_PROGRAMS * 132   # doubled only while the grid was short

@pytest.mark.parametrize('T,G,N,K', [(1, 1, 1280, 5120), (1, 1, 512, 5120), (1, 1, 32768, 1280),
                                     (2, 8, 1024, 4096), (2, 1, 5120, 8192),
                                     (1, 1, 96, 96), (2, 2, 32, 160)])
def test_gemv_launch_rule(T, G, N, K):
    s = fp8_gemv_launch(T, G, N, K, 132)
    want = dict(FP8_GEMV_TUNING[T], **(dict(block_n=64, block_k=256) if K <= SHORT_K else {}))
    assert s['block_n'] <= want['block_n'] and N % s['block_n'] == 0 and 2 * s['block_n'] > min(want['block_n'], N & -N)
    assert s['block_k'] <= want['block_k'] and K % s['block_k'] == 0
    assert 1 <= s['split'] <= min(SPLIT_MAX, K // s['block_k']) and s['steps'] == -(-(K // s['block_k']) // s['split'])
    assert s['grid'] == (N // s['block_n'], s['split'], T * G)
    tiles = s['grid'][0] * s['grid'][2]
    if s['split'] > 1: assert tiles * s['split'] <= s['programs'] * 132                # doubled only while it fit

@needs_triton
def test_one_or_two_rows_take_the_gemv(monkeypatch):
    "Up to FP8_LINEAR_MAX_T rows launch the GEMV kernel, more (with max_t) the MMA kernel of version mma"
    import dsv41_nb.fp8_linear as fl
    launched = []
    def spy(name, k):   # records each launch: the kernel, and which version of the MMA kernel
        def launch(*a, **kw):
            launched.append(name + ('', ' v2' if kw.get('W_LEFT') else ' v1')['W_LEFT' in kw])
            return k[grid[0]](*a, **kw)
        grid = [None]
        return type('K', (), {'__getitem__': lambda self, g: grid.__setitem__(0, g) or launch})()
    for name in ('_fp8_gemv_kernel', '_fp8_linear_kernel'): monkeypatch.setattr(fl, name, spy(name, getattr(fl, name)))
    w = _weight(1, 64, 96, 11)
    for T in (1, FP8_LINEAR_MAX_T, FP8_LINEAR_MAX_T + 1):
        x = _x(T, 1, 96, T)
        assert_linear_close(fp8_linear(x, w, max_t=64), x, w)
    assert_linear_close(fp8_linear(x, w, max_t=64, mma=1), x, w)
    assert launched == ['_fp8_gemv_kernel', '_fp8_gemv_kernel', '_fp8_linear_kernel v2', '_fp8_linear_kernel v1']

def test_bad_inputs_are_named():
    w, x = _weight(1, 64, 96, 9), _x(2, 1, 96, 9)
    cases = [(dict(w=w.dequantize()), 'QuantWeight'), (dict(w=QuantWeight(w.codes, w.scales, 'mxfp4')), "'mxfp4'"),
             (dict(x=x.int()), 'floating-point'), (dict(x=x[:, :64]), 'takes (T, 96)'),
             (dict(x=[1.0]), 'floating-point'), (dict(act_quant='yes'), 'bool'),
             (dict(max_t=257), 'max_t = 257'), (dict(max_t=-1), 'max_t = -1'),
             (dict(mma=3), 'mma = 3'), (dict(mma=True), 'mma = True'),
             (dict(split=0), 'split = 0'), (dict(split=2.0), 'split = 2.0')]
    for kw, msg in cases: fails_with(lambda: fp8_linear(**{**dict(x=x, w=w), **kw}), contains=msg)
    fails_with(lambda: fp8_linear_launch(8, 1, 64, 96, 132, mma=0), contains='mma = 0')
    fails_with(lambda: FP8Linear.from_master(torch.randn(96, 64), groups=5), contains='divisible')
    fails_with(lambda: FP8Linear.from_master(torch.randn(96)), contains='expected (out, in)')
    fails_with(lambda: FP8Linear(w.dequantize()), contains='QuantWeight')


@needs_triton
@pytest.mark.parametrize('T', [1, 2, 3])
@pytest.mark.parametrize('split', [None, 3])
def test_fused_norm_and_rope_are_the_separate_launches_bit_for_bit(T, split):
    """fp8_linear_norm = rms_norm_fused(fp8_linear), then rope; fp8_linear_rope = rope of
    fp8_linear's heads (3 rows: the functions)"""
    w, nw = _weight(1, 128, 192, 21), (1 + torch.randn(128, generator=torch.Generator().manual_seed(3)) / 4).to(DEV)
    x, pos = _x(T, 1, 192, 22), torch.tensor([5, 300, 4000][:T], device=DEV)
    inv = (1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)).float().to(DEV)
    want = rms_norm_fused(fp8_linear(x, w, split=split), nw, 1e-6)
    assert torch.equal(fp8_linear_norm(x, w, nw, 1e-6, split=split), want)
    assert torch.equal(fp8_linear_norm(x, w, nw, 1e-6, inv_freq=inv, positions=pos, split=split), rope(want, inv, pos))
    heads = rope(fp8_linear(x, w, split=split).unflatten(-1, (-1, 64)), inv, pos).flatten(1)
    assert torch.equal(fp8_linear_rope(x, w, inv, pos, 64, split=split), heads)


def test_fused_forms_bad_inputs_are_named():
    w, x, nw = _weight(1, 64, 96, 9), _x(2, 1, 96, 9), torch.ones(64, device=DEV)
    inv, pos = torch.ones(4, device=DEV), torch.tensor([1, 2], device=DEV)
    cases = [(lambda: fp8_linear_norm(x, w, nw[:10], 1e-6), 'norm_weight must have shape (64,)'),
             (lambda: fp8_linear_norm(x, w, nw, -1.0), 'eps = -1.0'),
             (lambda: fp8_linear_norm(x, w, nw, 1e-6, inv_freq=inv), 'inv_freq and positions come together'),
             (lambda: fp8_linear_norm(_x(2, 2, 64, 9), _weight(2, 64, 64, 9), nw, 1e-6), 'takes an ungrouped weight'),
             (lambda: fp8_linear_norm(x, w, nw, 1e-6, inv_freq=inv, positions=pos[:1]),
              'positions must be integers of shape (2,)'),
             (lambda: fp8_linear_rope(x, w, inv, pos, 48), 'an even head_dim dividing N = 64'),
             (lambda: fp8_linear_rope(x, w, inv, pos, 0), 'head_dim = 0'),
             (lambda: fp8_linear_rope(x, w, torch.ones(20, device=DEV), pos, 32),
              'at most head_dim / 2 = 16 frequencies'),
             (lambda: fp8_linear_rope(x.int(), w, inv, pos, 32), 'floating-point')]
    for f, msg in cases: fails_with(f, contains=msg)

@needs_triton
def test_mma_kernel_takes_more_than_one_row_block():
    "Past a row tile (max_t up to 256) both MMA kernels run several row blocks, each against the reference"
    for T, G, act, N in ((65, 1, True, 32), (130, 2, False, 96), (200, 1, True, 160)):
        w, x = _weight(G, N, 64, T), _x(T, G, 64, T)
        for mma in (1, 2): assert_linear_close(fp8_linear(x, w, act, max_t=256, mma=mma), x, w, act)

@needs_triton
def test_fp8linear_reads_the_codes_up_to_the_mma_rows(monkeypatch):
    "With FP8_LINEAR_MMA_T raised, FP8Linear runs the MMA kernel on the codes up to it (no BF16 copy), cuBLAS past it"
    import dsv41_nb.fp8_linear as fl
    lin = FP8Linear.from_master(torch.randn(64, 96, generator=torch.Generator().manual_seed(4)).to(DEV))
    monkeypatch.setattr(fl, 'FP8_LINEAR_MMA_T', 8)
    x = _x(8, 1, 96, 4)
    assert_linear_close(lin(x), x, lin.weight)
    assert not hasattr(lin, '_dense')
    x = _x(9, 1, 96, 5)
    assert_linear_close(lin(x), x, lin.weight)
    assert hasattr(lin, '_dense')
    monkeypatch.setattr(fl, 'FP8_LINEAR_MMA_T', 300)
    fails_with(lambda: lin(x), contains='max_t = 300')
