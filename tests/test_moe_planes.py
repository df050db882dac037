"""Version 3 of the gate/up stage (08f_moe_planes): the plane layout read back exactly, and the kernel bit for bit equal
to version 2 (`expert_gate_up`) over random layers, on the interpreter (CI) and compiled (the GPU test tier, where the
BF16 path of the upcast runs). Version 4 (`slots`: the activations in `pair_order`) within the reference's bound. The
decode GEMVs on planes and the engine's stage (08f_moe_planes_served) as well."""
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from functools import partial
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.config import ModelConfig
from dsv41_nb.moe import route, MoEWeights, QuantWeight
from dsv41_nb.fused_moe import (moe_launch_shape, align_by_expert, fp8_act_quant, expert_gate_up,
                                fused_moe_experts, check_fused_moe, _fused_stages, ExpertAlignment)
from dsv41_nb.moe_planes import (PLANE_NIBBLE, PlaneWeight, mxfp4_planes, planes_values, planes_weight,
                                  expert_gate_up_planes, plane_gate_up, planes_moe, expert_down_planes,
                                  pair_order, layout_map, held, pairs_ok, SLOT_MOVE_LAYOUT, _check_slots)
from dsv41_nb.moe_planes_served import (fits_planes, served_gate_up, gemv_gate_up_planes, PLANE_READ,
                                        PLANE_READ_ONCE, PLANE_READ_PAIRS, gemv_down_planes)
from dsv41_nb.fused_moe import align_by_expert_torch, expert_gate_up_torch, assert_fp8_close
from dsv41_nb.moe_gemv import gemv_gate_up, GEMV_MAX_TOKENS, gemv_stages, moe_gemv_experts
from dsv41_nb import moe_planes, moe_planes_served
from dsv41_nb.dispatch import sm_count
from dsv41_nb.moe_split import expert_gate_up_split, _default_split
from machine import DEV



def _layer(E, k, D, I, seed):
    cfg = replace(ModelConfig.tiny(), n_routed_experts=E, n_activated_experts=k, dim=D, moe_inter_dim=I)
    return cfg, MoEWeights.random(cfg, seed, DEV)


def random_mxfp4(E, N, K, seed, scales=(0, 255)):
    "(codes, scales, their QuantWeight): E experts of N x K MXFP4 weights, every byte random; scales in a range"
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    sc = torch.randint(scales[0], scales[1] + 1, (E, N, K // 32), generator=g, dtype=torch.uint8)
    return codes, sc, QuantWeight(codes, sc, 'mxfp4')


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(1, 4), st.sampled_from([32, 96]), st.sampled_from([128, 256]), st.integers(0, 2**31))
def test_layout_round_trip(E, N, K, seed):
    "Every code and scale lands where the plane layout says, and comes back: values and the checkpoint's bytes"
    codes, scales, w = random_mxfp4(E, N, K, seed, scales=(2, 128))
    p = mxfp4_planes(w)
    assert p.shape == (E, N, K) and p.words.dtype == p.scale_words.dtype == torch.int32
    assert torch.equal(planes_values(p), w.dequantize())
    back = planes_weight(p)
    assert torch.equal(back.codes, codes) and torch.equal(back.scales, scales)


def test_plane_nibbles_are_a_permutation():
    assert sorted(PLANE_NIBBLE) == list(range(8))
    # planes 2i and 2i + 1 sit at bits 12-15 and 28-31 once the word is shifted left by 4i
    assert all((PLANE_NIBBLE[2 * i] + i, PLANE_NIBBLE[2 * i + 1] + i) == (3, 7) for i in range(4))


@settings(max_examples=examples(4), deadline=None)
@given(st.sampled_from([3, 8]), st.integers(1, 3), st.sampled_from([128, 256]), st.sampled_from([32, 96]),
       st.integers(1, 40), st.integers(0, 2**31))
def test_version_3_equals_version_2(E, k, D, I, T, seed):
    "The same products in the same order: the gate/up output bit for bit, and the whole layer within the reference"
    k = min(k, E)
    cfg, W = _layer(E, k, D, I, seed % 1000)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, k, cfg.route_scale)
    shape, xq = moe_launch_shape(T * k, E), fp8_act_quant(x)
    al = align_by_expert(ti, E, shape['block_m'])
    v2 = expert_gate_up(xq, W.w1, W.w3, al, tw, cfg.swiglu_limit, shape)
    v3 = expert_gate_up_planes(xq, mxfp4_planes(W.w1), mxfp4_planes(W.w3), al, tw, cfg.swiglu_limit, shape)
    assert torch.equal(v3, v2)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, shape, stages=partial(_fused_stages, gate_up=plane_gate_up(W)))


@settings(max_examples=examples(6), deadline=None)
@given(st.sampled_from([3, 8]), st.integers(1, 3), st.sampled_from([128, 256]), st.sampled_from([32, 96]),
       st.integers(1, 40), st.sampled_from([1, None]), st.integers(0, 2**31))
def test_version_4_within_the_reference(E, k, D, I, T, split, seed):
    "Version 4's stage (one tile, or K split) through the whole layer, within the reference's bound"
    k = min(k, E)
    cfg, W = _layer(E, k, D, I, seed % 1000)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, k, cfg.route_scale)
    stage = plane_gate_up(W, split=split, slots=True)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=partial(_fused_stages, gate_up=stage))


def test_pair_order():
    "Slot 2j + h of each 32 columns holds column 16h + j"
    x = torch.arange(2 * 64).view(2, 64)
    y = pair_order(x)
    for c, j, h in ((0, 0, 0), (1, 5, 1), (1, 15, 0), (0, 15, 1)):
        assert torch.equal(y[:, 32 * c + 2 * j + h], x[:, 32 * c + 16 * h + j])


def test_through_the_layer():
    "`plane_gate_up` as the gate/up stage of `fused_moe_experts`: the same layer output as version 2"
    cfg, W = _layer(8, 2, 128, 64, 3)
    x = (3 * torch.randn(17, 128, generator=torch.Generator().manual_seed(3))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    y2 = fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit)
    y3 = fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, gate_up=plane_gate_up(W))
    assert torch.equal(y3, y2)


def _bad_cases():
    cfg, W = _layer(4, 2, 128, 64, 0)
    _, W64 = _layer(4, 2, 64, 64, 0)
    x = torch.randn(5, 128, device=DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    xq, p = fp8_act_quant(x), mxfp4_planes(W.w1)
    al = align_by_expert(ti, 4, 16)
    scaled = lambda s: QuantWeight(W.w1.codes, torch.full_like(W.w1.scales, s), 'mxfp4')
    W128 = _layer(4, 2, 128, 128, 0)[1]                        # inter 128: down weights the planes hold
    P128 = planes_moe(W128, down=True)
    h = torch.zeros(al.n_assign, 128, dtype=torch.bfloat16, device=DEV)
    hg = torch.zeros(5 * 3, 128, dtype=torch.bfloat16, device=DEV)   # the GEMVs' rows: tokens x (k + 1)
    return [
        (lambda: mxfp4_planes(W.shared_w1, 'shared_w1'), "shared_w1: expected MXFP4 weights"),
        (lambda: mxfp4_planes(W64.w1, 'w1'), 'w1: planes need in-features a multiple of 128, got 64'),
        (lambda: mxfp4_planes(scaled(129)), 'planes need block scale codes 2..128 (scales 2^-125 to 2), got 129..129'),
        (lambda: mxfp4_planes(scaled(1)), 'got 1..1'),
        (lambda: expert_gate_up_planes(xq, W.w1, p, al, tw, 10.0), 'w1: expected a PlaneWeight (mxfp4_planes)'),
        (lambda: expert_gate_up_planes(xq[:, :64], p, p, al, tw, 10.0), 'activations: expected shape (tokens, 128)'),
        (lambda: expert_gate_up_planes(xq[:3], p, p, al, tw, 10.0), 'activations: expected 5 rows for this alignment'),
        (lambda: expert_gate_up_planes(xq, p, p, al, tw[:, :1], 10.0), 'topk_weights: expected floats (5, 2)'),
        (lambda: expert_gate_up_planes(xq, p, p, ExpertAlignment.identity(5, 16), tw, 10.0),
         "align: expected the routed experts' alignment"),
        (lambda: fused_moe_experts(x, tw, ti, W, 10.0, gate_up=plane_gate_up(_layer(4, 2, 128, 64, 1)[1])),
         "plane_gate_up: these planes were made for another layer's weights"),
        (lambda: served_gate_up(W.w1), 'served_gate_up: expected MoEWeights, got QuantWeight'),
        (lambda: served_gate_up(W, sms=0), 'sms'),
        (lambda: served_gate_up(W, slots=1), 'served_gate_up: slots must be a bool, got 1'),
        (lambda: gemv_gate_up_planes(x, tw, ti, W, 10.0), 'w1: expected a PlaneWeight'),
        (lambda: gemv_gate_up_planes(x, tw, ti, W.w1, 10.0), 'W: expected MoEWeights, got QuantWeight'),
        (lambda: planes_moe(W.w1), 'planes_moe: expected MoEWeights, got QuantWeight'),
        (lambda: gemv_gate_up_planes(x, tw, ti, planes_moe(W), 10.0, read={'X_PAIR': None}), "read: expected"),
        (lambda: planes_moe(W64), 'w1: planes need in-features a multiple of 128, got 64'),
        (lambda: expert_gate_up_planes(xq, p, p, al, tw, 10.0, split=3), 'split = 3; expected an int >= 1 dividing'),
        (lambda: gemv_gate_up_planes(x, tw, ti, replace(planes_moe(W), w3=mxfp4_planes(_layer(4, 2, 128, 32, 0)[1].w3)),
                                     10.0),
         'w3: expected planes of shape (4, 64, 128), got (4, 32, 128)'),
        (lambda: planes_moe(W, down=1), 'planes_moe: down: expected a bool, got 1'),
        (lambda: planes_moe(W, down=True), 'w2: planes need in-features a multiple of 128, got 64'),
        (lambda: expert_down_planes(h, W128.w2, al), 'w2: expected a PlaneWeight (mxfp4_planes), got QuantWeight'),
        (lambda: expert_down_planes(h[1:], P128.w2, al), 'h: expected BF16 (10, 128) rows for this alignment'),
        (lambda: expert_down_planes(h.float(), P128.w2, al), 'h: expected BF16 (10, 128) rows'),
        (lambda: expert_down_planes(h[:, :64], P128.w2, al), 'activations: expected shape (tokens, 128), got (10, 64)'),
        (lambda: expert_down_planes(h, P128.w2, ExpertAlignment.identity(5, 16)),
         "align: expected the routed experts'"),
        (lambda: gemv_down_planes(hg, ti, W128, 1), 'w2: expected a PlaneWeight'),
        (lambda: gemv_down_planes(hg, ti, W128.w2), 'W: expected MoEWeights, got QuantWeight'),
        (lambda: gemv_down_planes(hg, ti, P128, read={'FP4_SUMS': None}), 'read: expected'),
        (lambda: gemv_down_planes(hg[1:], ti, P128), 'h: expected BF16 (15, 128) rows from gemv_gate_up'),
        (lambda: pair_order(torch.zeros(4, 48)), 'pair_order: expected a (rows, K) tensor with K a multiple of 32'),
        (lambda: pair_order(torch.zeros(64)), 'got (64,)'),
        (lambda: expert_gate_up_planes(xq, p, p, al, tw, 10.0, slots=1), 'slots must be a bool, got 1'),
        (lambda: expert_down_planes(h, P128.w2, al, slots='yes'), "slots must be a bool, got 'yes'"),
        (lambda: layout_map('#ttg.blocked<{sizePerThread = [1, 4]}>', (64, 32)),
         'layout_map: expected a #ttg.dot_op or #ttg.linear layout'),
        (lambda: layout_map(LINEAR_32, (0, 32)), 'layout_map: shape[0] = 0; expected at least 1'),
        (lambda: layout_map(LINEAR_32, 32), 'layout_map: shape: expected (rows, columns), got 32'),
        (lambda: layout_map('#ttg.dot_op<{opIdx = 0, kWidth = 2}>', (64, 32)), 'layout_map: no versionMajor in'),
        (lambda: held(None), 'held: expected a linear layout (layout_map), got NoneType'),
        (lambda: pairs_ok(torch.zeros(4, 3, 2)), "pairs_ok: expected held's (threads, registers, 2)"),
    ]


def bad_input_tests(cases, n: int) -> tuple:
    """The two tests of a bad-input table (`cases()`: (call, message) pairs, built when run): that it holds `n`
    cases, and that each call raises a ValueError or TypeError naming its message"""
    def test_every_bad_case_is_run(): assert len(cases()) == n

    @pytest.mark.parametrize('case', range(n))
    def test_bad_input(case):
        fn, message = cases()[case]
        with pytest.raises((ValueError, TypeError)) as e: fn()
        assert message in str(e.value)
    return test_every_bad_case_is_run, test_bad_input


test_every_bad_case_is_run, test_bad_input = bad_input_tests(_bad_cases, 41)


def test_fits_planes():
    "What `mxfp4_planes` takes, and nothing else"
    _, W = _layer(4, 2, 128, 64, 0)
    _, W64 = _layer(4, 2, 64, 64, 0)
    assert fits_planes(W.w1) and fits_planes(W.w3)
    for s in (1, 129):
        assert not fits_planes(QuantWeight(W.w1.codes, torch.full_like(W.w1.scales, s), 'mxfp4'))
    assert not fits_planes(W64.w1) and not fits_planes(W.shared_w1) and not fits_planes(None)


@pytest.mark.parametrize('T,sms,sliced', [(1, None, True), (9, None, True), (40, 1, False)])
def test_served_gate_up_path(T, sms, sliced, monkeypatch):
    """The engine's stage: version 3 on the routed experts, K split where 08c would split it, 08c's bits for that
    split; the shared expert 08c's"""
    cfg, W = _layer(8, 2, 256, 64, 4)
    x = (3 * torch.randn(T, 256, generator=torch.Generator().manual_seed(T))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    shape = moe_launch_shape(2 * T, 8)
    xq, al = fp8_act_quant(x), align_by_expert(ti, 8, shape['block_m'])
    n = sms or sm_count(DEV, default=16)
    split = _default_split(al, 64, 256, shape, n)
    assert (split > 1) == sliced, split
    calls = []
    real = moe_planes.expert_gate_up_planes
    monkeypatch.setattr(moe_planes, 'expert_gate_up_planes', lambda *a, **k: calls.append(1) or real(*a, **k))
    h = served_gate_up(W, sms)(xq, W.w1, W.w3, al, tw, cfg.swiglu_limit, shape)
    assert torch.equal(h, expert_gate_up_split(xq, W.w1, W.w3, al, tw, cfg.swiglu_limit, shape, split))
    assert len(calls) == 1
    ident = ExpertAlignment.identity(T, shape['block_m'])
    shared = served_gate_up(W, sms)(xq, W.shared_w1, W.shared_w3, ident, None, cfg.swiglu_limit, shape)
    assert len(calls) == 1                             # the shared expert never takes the planes
    assert torch.equal(shared, expert_gate_up_split(xq, W.shared_w1, W.shared_w3, ident, None, cfg.swiglu_limit,
                                                    shape))


@settings(max_examples=examples(4), deadline=None)
@given(st.integers(1, 12), st.sampled_from([(256, 2), (512, 2), (512, 4)]), st.integers(0, 2**31))
def test_planes_split_is_08c_split(T, D_split, seed):
    "Version 3 with K split over programs: 08c's split stage on the checkpoint's codes, bit for bit"
    D, split = D_split
    cfg, W = _layer(8, 2, D, 64, seed % 1000)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    shape = moe_launch_shape(2 * T, 8)
    xq, al = fp8_act_quant(x), align_by_expert(ti, 8, shape['block_m'])
    h = expert_gate_up_planes(xq, mxfp4_planes(W.w1), mxfp4_planes(W.w3), al, tw, cfg.swiglu_limit, shape, split)
    assert torch.equal(h, expert_gate_up_split(xq, W.w1, W.w3, al, tw, cfg.swiglu_limit, shape, split))


def test_served_gate_up_without_planes():
    "Weights the planes cannot hold: 08c's stage, whole"
    _, W64 = _layer(4, 2, 64, 64, 0)
    assert served_gate_up(W64) is expert_gate_up_split


@settings(max_examples=examples(4), deadline=None)
@given(st.integers(1, GEMV_MAX_TOKENS), st.sampled_from([128, 384, 512]), st.sampled_from([32, 64]),
       st.integers(0, 2**31), st.sampled_from(['x4', 'once']))
def test_gemv_planes(T, D, I, seed, read):
    """The decode GEMVs with the routed gate and up weights in planes: the reference's routed rows up to one FP8 step
    (each group of 32 is summed in another order), the shared expert's rows those of the GEMVs on the codes"""
    cfg, W = _layer(4, 2, D, I, seed % 1000)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    reading = dict(x4=PLANE_READ, once=PLANE_READ_ONCE)[read]     # each word read four times, or once
    h = gemv_gate_up_planes(x, tw, ti, planes_moe(W), cfg.swiglu_limit, read=reading)
    al = align_by_expert_torch(ti, 4, 16)
    ref = expert_gate_up_torch(fp8_act_quant(x), W.w1, W.w3, al, tw, cfg.swiglu_limit)
    assert_fp8_close(h[:T * 2], ref)
    assert torch.equal(h[T * 2:], gemv_gate_up(x, tw, ti, W, cfg.swiglu_limit)[T * 2:])


def test_gemv_reads_pairs_in_place_by_default(monkeypatch):
    "gemv_gate_up_planes hands the GEMV the reading that takes each pair where it lies unless told otherwise"
    cfg, W = _layer(4, 2, 128, 32, 0)
    x = torch.randn(2, 128).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    seen = []
    def spy(*args, routed=None, **kw):
        seen.append(routed[2]); raise RuntimeError('stop')
    monkeypatch.setattr(moe_planes_served, 'gemv_gate_up', spy)
    for read in (None, PLANE_READ):
        with pytest.raises(RuntimeError, match='stop'):
            gemv_gate_up_planes(x, tw, ti, planes_moe(W), cfg.swiglu_limit, read=read)
    assert seen[0] is PLANE_READ_PAIRS and seen[1] is PLANE_READ


def test_planes_take_their_own_large_shape(monkeypatch):
    """Version 3 launches the `large` regime with PLANES_TUNING's values, both called directly and as the
    engine's stage; a shape the caller chose, and the other regimes, as given"""
    cfg, W = _layer(4, 2, 128, 64, 0)
    P = planes_moe(W)
    shapes = []
    def spy(align, N, K, shape, device):
        shapes.append(shape); raise RuntimeError('stop')
    monkeypatch.setattr(moe_planes, '_launch', spy)
    T = 160                                                     # 80 rows an expert: the large regime
    x = torch.randn(T, 128).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    large, mine = moe_launch_shape(T * 2, 4), dict(moe_launch_shape(T * 2, 4), num_stages=2)
    al = align_by_expert(ti, 4, large['block_m'])
    for call in (lambda: expert_gate_up_planes(fp8_act_quant(x), P.w1, P.w3, al, tw, 10.0, large),
                 lambda: plane_gate_up(P)(fp8_act_quant(x), P.w1, P.w3, al, tw, 10.0, large),
                 lambda: expert_gate_up_planes(fp8_act_quant(x), P.w1, P.w3, al, tw, 10.0, mine)):
        with pytest.raises(RuntimeError, match='stop'): call()
    assert shapes[0] == shapes[1] == {**large, **moe_planes.PLANES_TUNING['large']} != large
    assert shapes[2] == mine


@settings(max_examples=examples(2), deadline=None)
@given(st.integers(1, GEMV_MAX_TOKENS), st.sampled_from([128, 256]), st.sampled_from([32, 96]), st.integers(0, 2**31))
def test_pairs_in_place_equal_each_word_once(T, D, I, seed):
    "The pair taken where it lies in its word gives the sums of the word read once, bit for bit"
    cfg, W = _layer(4, 2, D, I, seed % 1000)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    P = planes_moe(W)
    once, pairs = (gemv_gate_up_planes(x, tw, ti, P, cfg.swiglu_limit, read=r)
                   for r in (PLANE_READ_ONCE, PLANE_READ_PAIRS))
    assert torch.equal(pairs, once)


@pytest.mark.slow   # ~30 s interpreted; the GPU tier runs it compiled, and test_gemv_down_on_planes stays quick
@settings(max_examples=examples(3), deadline=None)
@given(st.sampled_from([3, 8]), st.sampled_from([128, 256]), st.integers(1, 40), st.integers(0, 2**31))
def test_down_stage_on_planes(E, D, T, seed):
    """The fused MoE with the routed down weights in planes (and version 3's gate/up) passes `check_fused_moe`: the
    down stage's rows within the BF16 bound of the reference's; the layer equals the pipeline's stages; and the same
    with both stages in version 4"""
    cfg, W = _layer(E, 2, D, 128, seed % 1000)
    P = planes_moe(W, down=True)
    assert isinstance(P.w2, PlaneWeight) and torch.equal(planes_weight(P.w2).codes, W.w2.codes)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    stages = partial(_fused_stages, gate_up=plane_gate_up(P), down=expert_down_planes)
    s = check_fused_moe(x, tw, ti, P, cfg.swiglu_limit, stages=stages)
    y = fused_moe_experts(x, tw, ti, P, cfg.swiglu_limit, gate_up=plane_gate_up(P), down=expert_down_planes)
    assert torch.equal(y, stages(x, tw, ti, P, cfg.swiglu_limit)['y'])
    v4 = partial(_fused_stages, gate_up=plane_gate_up(P, slots=True), down=partial(expert_down_planes, slots=True))
    check_fused_moe(x, tw, ti, P, cfg.swiglu_limit, stages=v4)              # both stages in version 4


@pytest.mark.parametrize('T', [1, 2])           # compiled, the GPU tier takes 1 to GEMV_MAX_TOKENS
def test_gemv_down_on_planes(T):
    "The decode GEMVs with all three routed weights in planes pass `check_fused_moe`; the layer equals its stages"
    cfg, W = _layer(4, 2, 128, 128, T)
    P = planes_moe(W, down=True)
    x = (3 * torch.randn(T, 128, generator=torch.Generator().manual_seed(T))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    stages = partial(gemv_stages, gate_up=gemv_gate_up_planes, down=gemv_down_planes)
    check_fused_moe(x, tw, ti, P, cfg.swiglu_limit, stages=stages)
    y = moe_gemv_experts(x, tw, ti, P, cfg.swiglu_limit, gate_up=gemv_gate_up_planes, down=gemv_down_planes)
    assert torch.equal(y, stages(x, tw, ti, P, cfg.swiglu_limit)['y'])


def test_down_stage_takes_its_own_shapes(monkeypatch):
    """The planes down stage launches the `mid` and `large` regimes with PLANES_DOWN_TUNING's values (128 columns a
    program), the other regimes and a shape the caller chose as given"""
    cfg, W = _layer(4, 2, 128, 128, 0)
    P = planes_moe(W, down=True)
    shapes = []
    def spy(align, N, K, shape, device):
        shapes.append(shape); raise RuntimeError('stop')
    monkeypatch.setattr(moe_planes, '_launch', spy)
    for T in (160, 48, 8):                                      # 80, 24 and 4 rows an expert: large, batch, decode
        x = torch.randn(T, 128).to(DEV)
        tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
        shape = moe_launch_shape(T * 2, 4)
        al = align_by_expert(ti, 4, shape['block_m'])
        h = torch.zeros(T * 2, 128, dtype=torch.bfloat16, device=DEV)
        with pytest.raises(RuntimeError, match='stop'): expert_down_planes(h, P.w2, al)
    mid = moe_launch_shape(60 * 4, 4)                           # 60 rows an expert
    al = align_by_expert(torch.arange(240).view(120, 2).to(DEV) % 4, 4, mid['block_m'])
    for s in (mid, dict(mid, num_stages=2)):
        with pytest.raises(RuntimeError, match='stop'):
            expert_down_planes(torch.zeros(240, 128, dtype=torch.bfloat16, device=DEV), P.w2, al, s)
    large, batch, decode = (moe_launch_shape(n, 4) for n in (320, 96, 16))
    assert shapes[0] == {**large, 'block_n': 128, 'num_warps': 4} != large
    assert shapes[1] == batch and shapes[2] == decode
    assert shapes[3] == {**mid, 'block_n': 128} != mid and shapes[4] == dict(mid, num_stages=2)


# where Triton 3.6 ran version 5's move at 32 weight rows (08g_moe_fp8): register pairs (0, 16), (1, 17)
LINEAR_32 = ('#ttg.linear<{register = [[0, 16], [0, 1], [0, 2]], lane = [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], '
             'warp = [[8, 0], [16, 0]], block = []}>')


def _recorded_slot_layouts():
    "(layout, weight rows) of every launch of version 4 compiled for Hopper (tools/kernel_mix.py's record)"
    rec = json.loads((Path(__file__).parent.parent / 'records' / 'moe_slots_sm90.json').read_text())
    return sorted({(l, r['block_n']) for r in rec['rows'] for l in r.get('asm_layouts', [])})


def test_version_4_moves_in_register_pairs():
    ("Every layout version 4's move was compiled in (a narrowed launch's included) holds slots 2j, 2j + 1 of a row in "
     "each pair of registers, by Triton's own linear map; the layout version 5 failed in does not, nor a pair swapped")
    recorded = _recorded_slot_layouts()
    assert any('versionMajor = 2' in l for l, _ in recorded) and any('versionMajor = 3' in l for l, _ in recorded)
    for layout, rows in recorded:
        e = held(layout_map(layout, (rows, 32)))
        assert pairs_ok(e), layout
        assert len({tuple(x) for x in e.reshape(-1, 2)}) == rows * 32          # each element held once
        assert SLOT_MOVE_LAYOUT.fullmatch(layout)
    assert not pairs_ok(e[:, [1, 0, *range(2, e.shape[1])]])
    assert not pairs_ok(held(layout_map(LINEAR_32, (32, 32))))


def compiled(*layouts, out='bf16'):
    ("A compiled kernel as a move's check (`_move_check`) reads it: a hash and a TTGIR with one inline assembly per "
     "layout, whose result is `out`")
    lines = [f'#l{i} = {l}' for i, l in enumerate(layouts)] + [
        f'%c{i} = tt.elementwise_inline_asm "..." %s : tensor<64x32xi32, #l{i}> -> tensor<64x32x{out}, #l{i}> '
        'loc(#loc1)' for i in range(len(layouts))]
    return SimpleNamespace(hash='|'.join(layouts), asm={'ttgir': '\n'.join(lines)})


def test_version_4_refuses_its_move_in_another_layout():
    "The recorded operands pass (once a kernel); a plain layout, 8 elements a run, or no move found are refused"
    ok = [l for l, _ in _recorded_slot_layouts()]
    _check_slots(None)                                          # the interpreter's launch returns no kernel
    k = compiled(*ok)
    _check_slots(k)
    k.asm = None                                                # checked once: not read again
    _check_slots(compiled(*ok))
    hopper = next(l for l in ok if 'kWidth = 2' in l)
    for bad in ((LINEAR_32,), (hopper, LINEAR_32), (hopper.replace('kWidth = 2', 'kWidth = 8'),)):
        with pytest.raises(RuntimeError, match="version 4's move compiled in #ttg"):
            _check_slots(compiled(*bad))
    with pytest.raises(RuntimeError, match="version 4's move not found"):
        _check_slots(compiled())


def test_version_4_launches_check_their_move(monkeypatch):
    "Each launch of version 4 (gate/up in one tile and split, down) hands its kernel to `_check_slots`; version 3 not"
    cfg, W = _layer(4, 2, 256, 128, 0)
    P = planes_moe(W, down=True)
    calls = []
    monkeypatch.setattr(moe_planes, '_check_slots', lambda k: calls.append(k))
    x = torch.randn(6, 256).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    al = align_by_expert(ti, 4, 16)
    xq = fp8_act_quant(x)
    for slots in (False, True):
        for split in (1, 2): expert_gate_up_planes(xq, P.w1, P.w3, al, tw, 10.0, split=split, slots=slots)
        expert_down_planes(torch.zeros(12, 128, dtype=torch.bfloat16, device=DEV), P.w2, al, slots=slots)
        assert len(calls) == (3 if slots else 0)
