"""Version 5 of the gate/up stage (08g_moe_fp8): the E2M1 -> E4M3 byte map on every code, the FP8 words read back
exactly and decoded to each weight's byte, the activations' codes equal to `act_quant`'s values, and the stage
through the whole layer within the reference, on the interpreter (CI) and compiled (the GPU test tier, where the
words reach the FP8 MMA through registers)."""
from dataclasses import replace
from functools import partial
import numpy as np
import pytest
from fastcore.test import test_fail as fails_with
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.moe import route, MoEWeights, QuantWeight
from dsv41_nb.formats import e2m1_values
from dsv41_nb.fused_moe import (moe_launch_shape, align_by_expert, fp8_act_quant, fused_moe_experts,
                                check_fused_moe, _fused_stages, ExpertAlignment)
from dsv41_nb.moe_fp8 import (FP8Words, FP8_SCALE_MAX, e2m1_e4m3, mxfp4_fp8_words, fp8_words_weight,
                              fp8_words_bytes, act_codes, act_codes_torch, expert_gate_up_fp8, fp8_gate_up,
                              fp8_moe, expert_down_fp8, by_row_block, fp8_launch_shape,
                              FP8_MIN_BLOCK_N, FP8_MMA_BITS, _check_move, _fp8_shape)
from dsv41_nb.moe_planes import asm_layouts
from test_moe_planes import compiled, LINEAR_32, bad_input_tests, _layer, DEV, random_mxfp4
from dsv41_nb import fused_moe as fm

def test_every_code_is_its_e4m3_byte():
    "Each of the 16 E2M1 codes, as an E4M3 byte, is worth the code's value times 2^-6 (zeros and 0.5 included)"
    c = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_e4m3(c).view(torch.float8_e4m3fn).float() * 64, e2m1_values(c))


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(1, 3), st.sampled_from([16, 48]), st.sampled_from([128, 256]), st.integers(0, 2**31))
def test_words_round_trip(E, N, K, seed):
    "Every code and scale comes back; the words decode to each column's E4M3 byte; the values are the checkpoint's"
    codes, scales, w = random_mxfp4(E, N, K, seed, scales=(0, FP8_SCALE_MAX))
    p = mxfp4_fp8_words(w)
    assert p.shape == (E, N, K) and p.words.dtype == p.scale_words.dtype == torch.int32
    back = fp8_words_weight(p)
    assert torch.equal(back.codes, codes) and torch.equal(back.scales, scales)
    nibbles = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)
    assert torch.equal(fp8_words_bytes(p), e2m1_e4m3(nibbles))
    assert torch.equal(p.dequantize(), w.dequantize())
    assert p.nbytes == codes.numel() + scales.numel()


def test_words_pair_columns_16_apart():
    """Byte j of a 32-column block holds column j at bits 7,4,3,2 (sign, exponent, mantissa) and column 16 + j with
    its sign at bit 5, its exponent at bits 6 and 1, its mantissa at bit 0"""
    codes = torch.zeros(1, 1, 64, dtype=torch.uint8)
    codes[0, 0, 3] = 0x0F                                 # column 6: code 15; column 7: 0
    codes[0, 0, 10] = 0x90                                # column 21 (16 + 5): code 9 (sign, mantissa)
    codes[0, 0, 9] = 0x40                                 # column 19 (16 + 3): code 4 (exponent's top bit)
    p = mxfp4_fp8_words(QuantWeight(codes, torch.full((1, 1, 4), 127, dtype=torch.uint8), 'mxfp4'))
    b = p.words.view(torch.uint8).view(-1)
    assert (b[6].item(), b[5].item(), b[3].item()) == (0x9C, 0x21, 0x40)
    assert b[[0, 1, 2, 4, 7]].sum().item() == 0


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(1, 9), st.sampled_from([32, 96, 256]), st.integers(0, 2**31))
def test_act_codes_are_act_quant(T, D, seed):
    "Codes x scales equal `fp8_act_quant`'s values bit for bit, from raw or already quantised activations"
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(T, D, generator=g) * torch.exp2(torch.randint(-20, 20, (T, 1), generator=g).float())
    x[0, :32] = 224 * 2.0 ** -5 * torch.sign(torch.randn(32, generator=g))   # a block at exactly 224 * 2^s
    if D > 32: x[-1, 32:64] = 0.0                                              # an empty block
    x = x.to(DEV)
    for src in (x, fp8_act_quant(x), x.to(torch.bfloat16)):
        c, s = act_codes(src)
        c_ref, s_ref = act_codes_torch(src)
        assert torch.equal(c, c_ref) and torch.equal(s, s_ref)
        v = (c.view(torch.float8_e4m3fn).float().view(T, D // 32, 32) * s[..., None]).view(T, D)
        assert torch.equal(v, fp8_act_quant(x).float())


@settings(max_examples=examples(6), deadline=None)
@given(st.sampled_from([3, 8]), st.integers(1, 3), st.sampled_from([128, 256]), st.sampled_from([32, 96]),
       st.integers(1, 40), st.sampled_from([1, None]), st.sampled_from([None, 16]), st.integers(0, 2**31))
def test_version_5_within_the_reference(E, k, D, I, T, split, block_m, seed):
    "Version 5's stage (one tile or K split, the regime's rows or 16) through the whole layer, within the reference"
    k = min(k, E)
    cfg, W = _layer(E, k, D, I, seed % 1000)
    x = (3 * torch.randn(T, D, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, k, cfg.route_scale)
    shape = moe_launch_shape(T * k, E)
    if block_m: shape['block_m'] = block_m
    stage = fp8_gate_up(W, split=split)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, shape, stages=partial(_fused_stages, gate_up=stage),
                    mma_bits=FP8_MMA_BITS)


@settings(max_examples=examples(5), deadline=None)
@given(st.sampled_from([3, 8]), st.integers(1, 3), st.sampled_from([128, 256]), st.integers(1, 40),
       st.sampled_from([None, 16]), st.integers(0, 2**31))
def test_both_stages_within_the_reference(E, k, I, T, block_m, seed):
    "Gate/up and down in version 5 on a layer whose routed weights are all FP8 words, within the reference"
    k = min(k, E)
    cfg, W = _layer(E, k, 128, I, seed % 1000)
    Wf = fp8_moe(W, down=True)
    assert torch.equal(Wf.w2.dequantize(), W.w2.dequantize()) and fp8_moe(Wf, down=True).w2 is Wf.w2
    x = (3 * torch.randn(T, 128, generator=torch.Generator().manual_seed(seed))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, k, cfg.route_scale)
    shape = moe_launch_shape(T * k, E)
    if block_m: shape['block_m'] = block_m
    stages = partial(_fused_stages, gate_up=fp8_gate_up(Wf), down=expert_down_fp8)
    check_fused_moe(x, tw, ti, Wf, cfg.swiglu_limit, shape, stages=stages,
                    mma_bits=FP8_MMA_BITS)


def test_launch_shape_takes_16_row_blocks_up_to_16_rows_an_expert():
    from dsv41_nb.fused_moe import moe_launch_shape
    for n_assign, E in ((6, 64), (768, 64), (1024, 64), (1088, 64), (1536, 64), (3072, 64), (80, 8), (200, 8)):
        rows, want = n_assign / min(E, n_assign), moe_launch_shape(n_assign, E)
        got = fp8_launch_shape(n_assign, E)
        assert got == (dict(want, block_m=16) if rows <= 16 else want), (n_assign, E)


def test_through_the_layer():
    "`fp8_gate_up` as the gate/up stage of `fused_moe_experts`: the pipeline's output, the shared expert its own"
    cfg, W = _layer(8, 2, 128, 64, 3)
    x = (3 * torch.randn(17, 128, generator=torch.Generator().manual_seed(3))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    st_ = partial(_fused_stages, gate_up=fp8_gate_up(W))
    y = fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, gate_up=fp8_gate_up(W))
    assert torch.equal(y, st_(x, tw, ti, W, cfg.swiglu_limit)['y'])



@pytest.mark.parametrize('split', [1, 2])
def test_two_loops_give_the_same_bits(split, monkeypatch):
    "Version 5 with the gate's K loop and then the up's: the same products in the same order, the same output"
    from dsv41_nb import moe_fp8
    cfg, W = _layer(8, 2, 256, 64, 4)
    x = (3 * torch.randn(23, 256, generator=torch.Generator().manual_seed(4))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    kernel, loops_run = moe_fp8._gate_up_fp8_kernel, []
    class Seen:                                     # the kernel as launched: which loop count it was given
        def __getitem__(self, grid):
            def launch(*a, **k): loops_run.append(k['LOOPS']); return kernel[grid](*a, **k)
            return launch
    monkeypatch.setattr(moe_fp8, '_gate_up_fp8_kernel', Seen())
    one, two = (fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, gate_up=fp8_gate_up(W, split=split, loops=n))
                for n in (1, 2))
    assert sorted(set(loops_run)) == [1, 2]
    assert torch.equal(one, two)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, mma_bits=FP8_MMA_BITS,
                    stages=partial(_fused_stages, gate_up=fp8_gate_up(W, split=split, loops=2)))


HOPPER = ('#ttg.dot_op<{opIdx = 0, parent = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, '
          'warpsPerCTA = [4, 1], instrShape = [16, 16, 32]}>, kWidth = 4}>')
AMPERE = ('#ttg.dot_op<{opIdx = 0, parent = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, '
          'warpsPerCTA = [1, 8], instrShape = [16, 8]}>, kWidth = 8}>')


def test_the_launch_refuses_the_move_in_another_layout():
    ("Hopper's MMA register operand passes (and is remembered); Ampere's operand or a plain layout is refused by "
     "name, and so is a kernel in which no move is found")
    _check_move(None)                                         # the interpreter's launch returns no kernel
    k = compiled(HOPPER)
    _check_move(k)
    k.asm = None                                              # checked once: not read again
    _check_move(compiled(HOPPER))
    for bad in ((AMPERE,), (LINEAR_32,), (HOPPER, AMPERE), (HOPPER.replace('kWidth = 4', 'kWidth = 2'),)):
        with pytest.raises(RuntimeError, match="version 5's move compiled in #ttg"):
            _check_move(compiled(*bad))
    with pytest.raises(RuntimeError, match="move not found"):  # a TTGIR the reader cannot parse: no silent pass
        _check_move(compiled())


def test_version_5_keeps_64_weight_rows_a_program(monkeypatch):
    "The launch narrows programs to fill a GPU, but never version 5's below FP8_MIN_BLOCK_N (Ampere's MMA below)"
    ti = torch.tensor([[0], [1], [2]])
    al = align_by_expert(ti, 64, 16)
    monkeypatch.setattr(fm, 'sm_count', lambda device, default=None: 132)
    shape = dict(moe_launch_shape(3, 64), block_n=128)
    cuda = torch.device('cuda')
    assert fm._launch(al, 2304, 5120, shape, cuda)[0]['BN'] == 32          # three blocks: narrowed
    assert fm._launch(al, 2304, 5120, shape, cuda, min_bn=FP8_MIN_BLOCK_N)[0]['BN'] == 64
    assert _fp8_shape(dict(shape, block_n=32), ExpertAlignment.identity(3, 32))['block_n'] == 64


def _bad_cases():
    cfg, W = _layer(4, 2, 128, 64, 0)
    _, W64 = _layer(4, 2, 64, 64, 0)
    x = torch.randn(5, 128, device=DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)
    xq, p, p3 = fp8_act_quant(x), mxfp4_fp8_words(W.w1), mxfp4_fp8_words(W.w3)
    al = align_by_expert(ti, 4, 16)
    scaled = lambda s: QuantWeight(W.w1.codes, torch.full_like(W.w1.scales, s), 'mxfp4')
    other = mxfp4_fp8_words(_layer(4, 2, 128, 32, 0)[1].w3)
    W128 = _layer(4, 2, 128, 128, 0)[1]                        # inter 128: down weights the words hold
    F2 = fp8_moe(W128, down=True).w2
    h = torch.zeros(al.n_assign, 128, dtype=torch.bfloat16, device=DEV)
    return [
        (lambda: e2m1_e4m3(torch.tensor([1, 16], dtype=torch.uint8)), 'e2m1_e4m3: codes are 4 bits (0..15), got 16'),
        (lambda: e2m1_e4m3(torch.tensor([1])), 'e2m1_e4m3: expected uint8 codes'),
        (lambda: mxfp4_fp8_words(W.shared_w1, 'shared_w1'), 'shared_w1: expected MXFP4 weights'),
        (lambda: mxfp4_fp8_words(W64.w1, 'w1'), 'w1: planes need in-features a multiple of 128, got 64'),
        (lambda: mxfp4_fp8_words(scaled(249)), 'FP8 words need block scale codes up to 248, got 249'),
        (lambda: fp8_words_weight(W.w1), 'fp8_words_weight: expected FP8Words, got QuantWeight'),
        (lambda: fp8_words_bytes(None), 'fp8_words_bytes: expected FP8Words, got NoneType'),
        (lambda: act_codes(torch.zeros(3, 48)), 'act_codes: expected floats (tokens, dim) with dim a multiple of 32'),
        (lambda: act_codes(torch.zeros(3, 64, dtype=torch.int32)), 'act_codes: expected floats'),
        (lambda: act_codes_torch(torch.zeros(64)), 'act_codes_torch: expected floats (tokens, dim)'),
        (lambda: expert_gate_up_fp8(xq, W.w1, p3, al, tw, 10.0), 'w1: expected FP8Words (mxfp4_fp8_words)'),
        (lambda: expert_gate_up_fp8(xq, p, p3, al, tw, 10.0, split=3), 'split = 3; expected an int >= 1 dividing'),
        (lambda: expert_gate_up_fp8(xq[:, :64], p, p3, al, tw, 10.0), 'activations: expected shape (tokens, 128)'),
        (lambda: expert_gate_up_fp8(xq.int(), p, p3, al, tw, 10.0), 'activations: expected a floating-point tensor'),
        (lambda: expert_gate_up_fp8(xq[:3], p, p3, al, tw, 10.0), 'activations: expected 5 rows for this alignment'),
        (lambda: expert_gate_up_fp8(xq, p, p3, al, tw[:, :1], 10.0), 'topk_weights: expected floats (5, 2)'),
        (lambda: expert_gate_up_fp8(xq, p, other, al, tw, 10.0), 'w3: expected the shape of w1 (4, 64, 128)'),
        (lambda: expert_gate_up_fp8(xq, p, p3, ExpertAlignment.identity(5, 16), tw, 10.0),
         "align: expected the routed experts' alignment"),
        (lambda: fp8_gate_up(W.w1), 'fp8_gate_up: expected MoEWeights, got QuantWeight'),
        (lambda: fp8_gate_up(W, split=0), 'split = 0; expected an int >= 1 dividing'),
        (lambda: fp8_gate_up(W, loops=3), 'fp8_gate_up: loops = 3; expected 1 (gate and up together) or 2'),
        (lambda: expert_gate_up_fp8(xq, p, p3, al, tw, 10.0, loops=True), 'expert_gate_up_fp8: loops = True'),
        (lambda: fused_moe_experts(x, tw, ti, W, 10.0, gate_up=fp8_gate_up(_layer(4, 2, 128, 64, 1)[1])),
         "fp8_gate_up: these words were made for another layer's weights"),
        (lambda: fp8_moe(W.w1), 'fp8_moe: expected MoEWeights, got QuantWeight'),
        (lambda: fp8_moe(W, down='yes'), "fp8_moe: down: expected a bool, got 'yes'"),
        (lambda: fp8_moe(W, down=True), 'w2: planes need in-features a multiple of 128, got 64'),
        (lambda: expert_down_fp8(h, W128.w2, al), 'w2: expected FP8Words (mxfp4_fp8_words), got QuantWeight'),
        (lambda: expert_down_fp8(h[1:], F2, al), 'h: expected BF16 (10, 128) rows for this alignment'),
        (lambda: expert_down_fp8(h.float(), F2, al), 'h: expected BF16 (10, 128) rows'),
        (lambda: expert_down_fp8(h[:, :64], F2, al), 'activations: expected shape (tokens, 128), got (10, 64)'),
        (lambda: expert_down_fp8(h, F2, ExpertAlignment.identity(5, 16)), "align: expected the routed experts'"),
        (lambda: by_row_block(None, len, 3), 'by_row_block: expected two stages (callables)'),
        (lambda: by_row_block(len, len, True), 'by_row_block: align_at = True; expected 3 (gate/up) or 2 (down)'),
        (lambda: asm_layouts(None), 'asm_layouts: expected TTGIR text, got NoneType'),
    ]


test_every_bad_case_is_run, test_bad_input = bad_input_tests(_bad_cases, 34)


def test_the_mma_allowance_keeps_its_teeth():
    "With the FP8 MMA's allowance a true layer passes, and a gate/up or down stage a column over still fails"
    from dsv41_nb.fused_moe import expert_gate_up, expert_down
    cfg, W = _layer(8, 2, 256, 128, 5)
    x = (3 * torch.randn(9, 256, generator=torch.Generator().manual_seed(5))).to(DEV)
    tw, ti = route(x, W.gate, W.bias, 2, cfg.route_scale)

    def shifted(xq, w1, w3, align, topk_weights, swiglu_limit, shape=None):
        h = expert_gate_up(xq, w1, w3, align, topk_weights, swiglu_limit, shape)
        return h if align.sorted_ids is None else h.roll(1, dims=1)      # routed rows: a column over
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, mma_bits=FP8_MMA_BITS)
    with pytest.raises(AssertionError, match='differ by more than one FP8 step'):
        check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, mma_bits=FP8_MMA_BITS,
                        stages=partial(_fused_stages, gate_up=shifted))

    def shifted_down(h, w2, align, shape=None):                         # the down sums a column over
        return expert_down(h, w2, align, shape=shape).roll(1, dims=1)
    with pytest.raises(AssertionError, match='beyond the BF16 rounding bound'):
        check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, mma_bits=FP8_MMA_BITS,
                        stages=partial(_fused_stages, down=shifted_down))


def test_groups_ok_reads_the_byte_move_rule():
    "Neighbouring columns of one row from a multiple of four pass; a swapped pair, a shifted start, another row fail"
    from dsv41_nb.moe_fp8_measured import groups_ok
    cols = np.arange(8)
    good = np.stack([np.zeros((2, 8), dtype=np.int64), cols + 8 * np.arange(2)[:, None]], -1)
    assert groups_ok(good)
    swapped, shifted, rows = good[:, [1, 0, 2, 3, 4, 5, 6, 7]], good.copy(), good.copy()
    shifted[..., 1] += 1; rows[0, 2, 0] = 5
    assert not any(map(groups_ok, (swapped, shifted, rows)))
    for bad in (np.zeros((2, 6, 2)), np.zeros((2, 8)), [[0, 1]]):
        fails_with(lambda: groups_ok(bad), contains='expected a (threads, registers, 2) array')
