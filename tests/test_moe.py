"""Properties of the MoE router, weight formats and expert alignment, and fuzzing of the fused Triton MoE against the
per-expert loop (stage by stage, through `check_fused_moe`).

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either the same checks run
the PyTorch path."""
from dataclasses import replace
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.config import ModelConfig
from dsv41_nb.moe import route, quantize_weight, MoEWeights, fp8_qdq, moe_experts_reference
from dsv41_nb.fused_moe import (MOE_TILES, moe_launch_shape, ExpertAlignment,
                                align_by_expert, align_by_expert_torch, fp8_act_quant,
                                fused_moe_experts, moe_forward,
                                check_fused_moe, expert_gate_up, expert_down, MOE_TUNING,
                                MOE_DOWN_TUNING, stage_shape)
from dsv41_nb.fused_moe_measured import benchmark_moe
from machine import DEV, HAS_TRITON

TINY = ModelConfig.tiny()

def _gen(seed): return torch.Generator().manual_seed(seed)

@settings(max_examples=examples(40))
@given(st.integers(1, 12), st.integers(2, 24), st.integers(1, 6), st.integers(8, 48), st.integers(0, 2**31))
def test_route_matches_brute_force(T, E, k, D, seed):
    "Top-k of the biased scores (image rows with the image bias), weights from the unbiased scores, normalised, scaled"
    k, g = min(k, E), _gen(seed)
    x, gate = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) / D ** 0.5
    bias, bias_img, img = (torch.randn(E, generator=g) * 0.3, torch.randn(E, generator=g) * 0.3,
                           torch.rand(T, generator=g) < 0.4)
    w, ids = route(x, gate, bias, k, 1.5, bias_img, img)
    s = torch.log1p(torch.exp(x.double() @ gate.double().T)).sqrt()                   # independent: float64, log1p(exp)
    biased = s + torch.where(img[:, None], bias_img.double(), bias.double())
    order = biased.argsort(-1, descending=True)
    assert ids.shape == (T, k) and (ids.sort(-1).values[:, 1:] != ids.sort(-1).values[:, :-1]).all()
    for t in range(T):
        vals = biased[t, order[t]]
        if k < E and vals[k - 1] - vals[k] < 1e-5: continue                           # a near tie: either pick is right
        assert set(ids[t].tolist()) == set(order[t, :k].tolist())
    want = s.gather(1, ids) / (s.gather(1, ids).sum(-1, keepdim=True) if k > 1 else 1) * 1.5
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)               # fp32 scores: ~1e-7 relative

@settings(max_examples=examples(20))
@given(st.sampled_from(['mxfp4', 'fp8']), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3),
       st.integers(0, 2**31))
def test_quantize_weight_roundtrip(fmt, e, o, i, seed):
    """Each element within half a step of its block's grid: MXFP4 max(s/4, |w|/4), FP8 max(|w|/16,
    s/1024), s the block scale"""
    w = (torch.randn(e, 32 * o, 32 * i, generator=_gen(seed))
         * torch.exp2(torch.randint(-8, 8, (e, 32 * o, 1), generator=_gen(seed)).float()))
    q = quantize_weight(w, fmt)
    assert q.shape == w.shape
    if fmt == 'mxfp4':
        amax = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
        s = torch.exp2(torch.ceil(torch.log2(amax / 6))).expand(-1, -1, -1, 32).flatten(-2)
        bound = torch.maximum(s / 4, w.abs() / 4)
    else:
        amax = w.reshape(e, o, 32, i, 32).abs().amax((2, 4), keepdim=True).clamp_min(1e-4)
        s = torch.exp2(torch.ceil(torch.log2(amax / 448))).expand(-1, -1, 32, -1, 32).reshape(w.shape)
        bound = torch.maximum(w.abs() / 16, s / 1024)
    assert ((q.dequantize() - w).abs() <= bound).all()

def _check_alignment(al: ExpertAlignment, ids: torch.Tensor, E: int, bm: int):
    flat, A = ids.flatten().cpu(), ids.numel()
    s, be = al.sorted_ids.cpu().long(), al.block_expert.cpu().long()
    assert s.numel() == be.numel() * bm and al.n_assign == A and al.topk == ids.shape[1]
    real = s < A
    assert torch.equal(s[real].sort().values, torch.arange(A))                         # every assignment exactly once
    row_expert = be.repeat_interleave(bm)
    # each in a block of its own expert
    assert (flat[s[real]] == row_expert[real]).all()
    used = (be >= 0).sum().item()
    assert (be[:used] >= 0).all() and (be[used:] == -1).all() and not real[used * bm:].any()
    counts = torch.bincount(flat, minlength=E)
    for e in range(E):
        rows = s[(row_expert == e) & real]
        assert (rows.diff() > 0).all()                                                 # token order within an expert
        assert (be == e).sum() == -(-counts[e] // bm)                                  # whole blocks, no empty ones

@settings(max_examples=examples(25))
@given(st.integers(0, 40), st.integers(1, 4), st.integers(1, 12), st.sampled_from([16, 32]), st.integers(0, 2**31))
def test_align_by_expert(T, k, E, bm, seed):
    "Both versions: a padded, stable grouping by expert (duplicate experts per token allowed); Triton equals PyTorch"
    ids = torch.randint(0, E, (T, k), generator=_gen(seed))
    ref = align_by_expert_torch(ids, E, bm)
    _check_alignment(ref, ids, E, bm)
    got = align_by_expert(ids.to(DEV), E, bm)
    assert torch.equal(got.sorted_ids.cpu(), ref.sorted_ids) and torch.equal(got.block_expert.cpu(), ref.block_expert)

@pytest.mark.skipif(not HAS_TRITON, reason='needs a GPU or TRITON_INTERPRET=1')
@settings(max_examples=examples(10))
@given(st.integers(1, 9), st.sampled_from([32, 96, 160]), st.floats(-30, 30), st.integers(0, 2**31))
def test_act_quant_bit_exact(T, D, log_mag, seed):
    """The activation-quantisation kernel equals the public act_quant (fp8_qdq) bit for bit, zeros
    and wide ranges included"""
    g = _gen(seed)
    x = (torch.randn(T, D, generator=g)
         * torch.exp2(log_mag + 12 * torch.rand(T, D // 32, 1, generator=g)).repeat_interleave(32, 1).view(T, D))
    x[torch.rand(T, D, generator=g) < 0.1] = 0.0
    assert torch.equal(fp8_act_quant(x.to(DEV)).float().cpu(), fp8_qdq(x))

def _layer(E, k, D, I, seed):
    cfg = replace(TINY, n_routed_experts=E, n_activated_experts=k, dim=D, moe_inter_dim=I)
    return cfg, MoEWeights.random(cfg, seed, DEV)

@settings(max_examples=examples(6), deadline=None)
@given(st.sampled_from([1, 3, 8]), st.integers(1, 3), st.sampled_from([32, 96]), st.sampled_from([32, 64, 96]),
       st.integers(1, 33), st.sampled_from(['router', 'random', 'one']),
       st.sampled_from([0.5, 4.0]), st.integers(0, 2**31))
def test_fused_moe_matches_loop(E, k, D, I, T, mode, scale, seed):
    """Fuzz the fused MoE against the per-expert loop: every stage within its derived bound, the
    output within rounding + flips"""
    k = min(k, E)
    cfg, W = _layer(E, k, D, I, seed % 1000)
    g = _gen(seed)
    x = (scale * torch.randn(T, D, generator=g)).to(DEV)
    tw, ti = route(x, W.gate, W.bias, k, cfg.route_scale)
    # ragged expert loads
    if mode == 'random': ti = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    # all on k experts
    if mode == 'one': ti = (torch.arange(k) + seed % E).remainder(E).expand(T, k).contiguous().to(DEV)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit)

@settings(max_examples=examples(4), deadline=None)
@given(st.sampled_from([3, 8]), st.integers(1, 3), st.sampled_from([32, 96]), st.integers(1, 40), st.integers(0, 2**31))
def test_tile_versions_agree(E, k, I, T, seed):
    "Version 1 (dequantised tiles) and version 2 (tl.dot_scaled): each within bounds of the loop, and of each other"
    k = min(k, E)
    cfg, W = _layer(E, k, 64, I, seed % 1000)
    x = (3 * torch.randn(T, 64, generator=_gen(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, k, cfg.route_scale)
    outs = []
    for tiles in MOE_TILES:
        shape = dict(moe_launch_shape(T * k, E), tiles=tiles)
        check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, shape)
        outs.append(fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, shape))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2 ** -6, atol=0.05)

@pytest.mark.parametrize('T', [1, 20])
def test_scales_prefetched_a_step_ahead(T):
    """The gate/up loop with each step's scales loaded a step ahead (`prefetch`): the same bits as loading them
    in their step, over two K steps, for the routed MXFP4 and the shared FP8 experts"""
    cfg, W = _layer(8, 2, 64, 96, T)
    x = (3 * torch.randn(T, 64, generator=_gen(T))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    shapes = [dict(moe_launch_shape(T * 2, 8), block_k=32, prefetch=p) for p in (False, True)]
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, shapes[1])
    a, b = (fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, s) for s in shapes)
    assert torch.equal(a, b)

@pytest.mark.parametrize('T, mode', [(1, 'router'), (40, 'one'), (17, 'few')])
def test_fused_moe_edge_cases(T, mode):
    """A batch of one; every token on one expert (several blocks of it, seven experts empty); three
    experts used, five empty"""
    cfg = replace(TINY, n_activated_experts=1) if mode == 'one' else TINY
    W = MoEWeights.random(cfg, 7, DEV)
    x = (3 * torch.randn(T, cfg.dim, generator=_gen(T))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
    if mode == 'one': ti = torch.full_like(ti, 5)
    if mode == 'few': ti[:, 0], ti[:, 1] = 2, torch.where(ti[:, 1] % 2 == 0, 1, 6)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit)

def test_fused_moe_batch_independence():
    """Tokens do not interact: the fused output of a batch equals each token run alone (bit for bit:
    rows are independent)"""
    W = MoEWeights.random(TINY, 3, DEV)
    x = torch.randn(6, TINY.dim, generator=_gen(3)).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, 1.5)
    batch = fused_moe_experts(x, tw, ti, W, 10.)
    single = torch.cat([fused_moe_experts(x[i:i + 1], tw[i:i + 1], ti[i:i + 1], W, 10.) for i in range(6)])
    assert torch.equal(batch, single)

def test_moe_forward_routes_image_tokens_by_id():
    "moe_forward marks image-span tokens by `image_token_id` and routes them with the image bias"
    W = MoEWeights.random(TINY, 4, DEV)
    x = torch.randn(6, TINY.dim, generator=_gen(4)).to(DEV)
    ids = torch.tensor([3, TINY.image_token_id, TINY.image_token_id, 9, 10, TINY.image_token_id], device=DEV)
    img = ids == TINY.image_token_id
    want = fused_moe_experts(x, *route(x, W.gate, W.bias, 2, 1.5, W.bias_image, img), W, 10.)
    assert torch.equal(moe_forward(x, W, TINY, ids), want)
    assert fused_moe_experts(x[:0], torch.zeros(0, 2, device=DEV),
                             torch.zeros(0, 2, dtype=torch.long, device=DEV), W, 10.).shape == (0, TINY.dim)

def test_bad_inputs():
    "Every public function names a bad argument instead of failing inside"
    W = MoEWeights.random(TINY)
    x, tw, ti = torch.randn(4, TINY.dim), torch.rand(4, 2), torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    al = align_by_expert(ti, 8, 16)
    cases = [
        (lambda: route(x[:, :10], W.gate, W.bias, 2, 1.5), 'x: expected shape (tokens, 64)'),
        (lambda: route(x, W.gate[0], W.bias, 2, 1.5), 'gate_weight: expected shape (n_experts, dim)'),
        (lambda: route(x, W.gate, W.bias.double()[:3], 2, 1.5), 'bias: expected a float tensor of shape (8,)'),
        (lambda: route(x, W.gate, W.bias, 0, 1.5), 'n_activated = 0; expected an int in 1..8'),
        (lambda: route(x, W.gate, W.bias, 2, 1.5, W.bias_image, torch.ones(4)),
         'image_mask: expected a bool tensor of shape (4,)'),
        (lambda: fused_moe_experts(x.int(), tw, ti, W, 10.), 'x: expected a floating-point tensor'),
        (lambda: fused_moe_experts(x, tw, ti.float(), W, 10.), 'topk_ids: expected an int32/int64 tensor'),
        (lambda: fused_moe_experts(x, tw.int(), ti, W, 10.), 'topk_weights: expected a float tensor of shape (4, 2)'),
        (lambda: fused_moe_experts(x, tw, ti + 1, W, 10.), 'expert id 8 outside 0..7'),
        (lambda: moe_experts_reference(x, tw, ti - 1, W, 10.), 'expert id -1 outside 0..7'),
        (lambda: moe_forward(x, W, TINY, torch.zeros(4, 1, dtype=torch.long)),
         'token_ids: expected an int tensor of shape (4,)'),
        (lambda: align_by_expert(ti.float(), 8, 16), 'topk_ids: expected an int32/int64 tensor'),
        (lambda: align_by_expert(ti, 8, 8), 'block_m = 8; expected a power of two >= 16'),
        (lambda: fp8_act_quant(torch.randn(4, 48)), 'dim a multiple of 32'),
        (lambda: fused_moe_experts(x, tw, ti, W, 10., dict(moe_launch_shape(8, 8), tiles='mxfp4')),
         "tiles = 'mxfp4'; expected one of ('scaled', 'dequantised')"),
        (lambda: fused_moe_experts(x, tw, ti, W, 10., dict(moe_launch_shape(8, 8), prefetch='yes')),
         "prefetch = 'yes'; expected True or False"),
        (lambda: fused_moe_experts(x, tw, ti, W, 10., {'block_m': 16, 'block_n': 32}),
         'shape: expected a dict with block_m, block_n, block_k'),
        (lambda: benchmark_moe(TINY, (1,), 'cpu', tiles='v3'), "tiles = 'v3'; expected one of"),
        (lambda: quantize_weight(torch.randn(32, 64), 'fp8'), 'expected float weights (experts, out, in)'),
        (lambda: quantize_weight(torch.randn(1, 32, 64), 'e2m1'), "expected one of ('mxfp4', 'fp8')"),
        (lambda: expert_gate_up(fp8_act_quant(x), W.w1, W.w3, 'rows', tw, 10.), 'align: expected an ExpertAlignment'),
        (lambda: expert_gate_up(fp8_act_quant(x)[:3], W.w1, W.w3, al, tw, 10.),
         'expected 4 rows for this alignment, got 3'),
        (lambda: expert_down(torch.zeros(8, 64), W.shared_w2, al), 'w2: expected mxfp4 weights, got fp8'),
        (lambda: expert_down(torch.zeros(8, 64), W.w2, al, routed=torch.zeros(8, 64)),
         "routed: expected (tokens * k, 64) outputs and the shared expert's identity alignment"),
        (lambda: W.check(replace(TINY, n_routed_experts=16)), 'gate: expected shape (16, 64)'),
        (lambda: stage_shape(moe_launch_shape(8, 8), {'huge': {}}), 'overrides: expected a dict keyed by regimes'),
        (lambda: replace(W, bias_image=torch.zeros(3)).check(TINY),
         'bias_image: expected a float tensor of shape (8,)'),
    ]
    for call, words in cases:
        try: call()
        except Exception as e: assert words in str(e), f"expected {words!r} in {str(e)!r}"
        else: raise AssertionError(f"no error; expected {words!r}")


def test_down_stage_takes_its_own_mid_shape(monkeypatch):
    """The routed experts' down stage launches the `mid` regime with MOE_DOWN_TUNING's values; the shared expert's
    down stage, a shape the caller chose and the other regimes as given"""
    from dsv41_nb import fused_moe
    mid = moe_launch_shape(512 * 6, 64)
    assert stage_shape(mid, MOE_DOWN_TUNING) == {**mid, **MOE_DOWN_TUNING['mid']} != mid
    for other in (moe_launch_shape(6, 64), dict(mid, num_stages=4)):
        assert stage_shape(other, MOE_DOWN_TUNING) == other
    if not HAS_TRITON: pytest.skip('the kernel path (a GPU or the interpreter)')
    W = MoEWeights.random(TINY, 0, DEV)
    T = 200                                                     # 50 rows an expert: the mid regime
    x = torch.randn(T, TINY.dim).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, 1.5)
    shape = moe_launch_shape(T * 2, 8)
    assert shape == MOE_TUNING['mid']
    seen = []
    def spy(align, N, K, shape, device):
        seen.append((align.sorted_ids is None, shape)); raise RuntimeError('stop')
    monkeypatch.setattr(fused_moe, '_launch', spy)
    h = torch.zeros(T * 2, TINY.moe_inter_dim, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match='stop'):
        fused_moe.expert_down(h, W.w2, align_by_expert(ti, 8, shape['block_m']), shape=shape)
    with pytest.raises(RuntimeError, match='stop'):
        fused_moe.expert_down(h[:T], W.shared_w2, ExpertAlignment.identity(T, shape['block_m']),
                              torch.zeros(T * 2, TINY.dim, dtype=torch.bfloat16, device=DEV), shape)
    assert seen == [(False, {**shape, **MOE_DOWN_TUNING['mid']}), (True, shape)]
