"""RoPE and RMSNorm as one launch each: bit for bit the PyTorch references on random shapes, and the bad inputs."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore.test import test_fail as fails_with
from dsv41_nb.config import ModelConfig
from dsv41_nb.compressor import layer_inv_freq, rms_norm
from dsv41_nb.rope_norm import rope, rope_torch, rms_norm_fused
from machine import DEV, needs_triton


@needs_triton
@settings(max_examples=examples(12), deadline=None)
@given(T=st.integers(1, 9), heads=st.sampled_from([(), (1,), (3,), (2, 2)]),
       d_rope=st.sampled_from([(64, 64), (80, 64), (512, 64), (130, 32)]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), inverse=st.booleans(),
       ratio=st.sampled_from([0, 4]), seed=st.integers(0, 2**31))
def test_rope_matches_reference_bit_for_bit(T, heads, d_rope, dtype, inverse, ratio, seed):
    d, rope_dim = d_rope
    cfg = ModelConfig.bench() if rope_dim == 64 else ModelConfig.tiny()
    f = layer_inv_freq(cfg, ratio).to(DEV)
    if 2 * f.numel() != rope_dim: f = f[:rope_dim // 2].contiguous()
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn((T, *heads, d), generator=g)).to(DEV, dtype)
    pos = torch.randint(0, 1 << 20, (T,), generator=g).to(DEV)
    assert torch.equal(rope(x, f, pos, inverse), rope_torch(x, f, pos, inverse))

@needs_triton
@settings(max_examples=examples(12), deadline=None)
@given(rows=st.sampled_from([(1,), (5,), (2, 3)]), d=st.sampled_from([32, 96, 512, 1280]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**31))
def test_rms_norm_matches_reference_bit_for_bit(rows, d, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn((*rows, d), generator=g)).to(DEV, dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(DEV)
    assert torch.equal(rms_norm_fused(x, w, 1e-20), rms_norm(x, w, 1e-20))

def test_gradients_take_the_reference():
    x = torch.randn(3, 16, requires_grad=True)
    rms_norm_fused(x, torch.ones(16), 1e-6).sum().backward()
    assert x.grad is not None

F8 = torch.ones(4)
@pytest.mark.parametrize('call, words', [
    (lambda: rope(torch.zeros(3, 8).long(), F8, torch.arange(3)), 'x must be a float tensor'),
    (lambda: rope(torch.zeros(8), F8, torch.arange(1)), 'x must be a float tensor (T, ..., d)'),
    (lambda: rope(torch.zeros(3, 8), F8.long(), torch.arange(3)), 'inv_freq must be a 1-D float tensor'),
    (lambda: rope(torch.zeros(3, 6), F8, torch.arange(3)), 'x has 6 dims, fewer than the 8 to rotate'),
    (lambda: rope(torch.zeros(3, 8), F8, torch.arange(4)), 'positions must be integers of shape (3,)'),
    (lambda: rope(torch.zeros(3, 8), F8, torch.tensor([0, 1, -2])), 'positions holds -2; expected >= 0'),
    (lambda: rms_norm_fused([1.0], torch.ones(1), 1e-6), 'x must be a float tensor'),
    (lambda: rms_norm_fused(torch.zeros(2, 8), torch.ones(2, 8), 1e-6), 'weight must have shape (8,)'),
    (lambda: rms_norm_fused(torch.zeros(2, 8), torch.ones(8), 'small'), "eps = 'small'; expected a float >= 0"),
])
def test_bad_inputs(call, words): fails_with(call, contains=words)


@needs_triton
def test_the_kernels_run_not_the_references(monkeypatch):
    """On the Triton backend both entry points launch their kernels (a broken dispatch would still
    pass the equality tests)"""
    import dsv41_nb.rope_norm as rn
    def boom(*a, **k): raise AssertionError('the reference ran')
    monkeypatch.setattr(rn, 'rope_torch', boom); monkeypatch.setattr(rn, 'rms_norm', boom)
    x = torch.randn(2, 3, 64, device=DEV).bfloat16()
    rope(x, layer_inv_freq(ModelConfig.bench(), 0).to(DEV), torch.tensor([1, 5], device=DEV))
    rms_norm_fused(x, torch.ones(64, device=DEV), 1e-6)
