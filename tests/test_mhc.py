"""Properties of the Sinkhorn normalisation and of the two hyper-connection forms, and fuzzing of the fused seam kernel
against the reference seam (`check_seam`, with its derived bounds).

Kernel tests need Triton: a GPU, or TRITON_INTERPRET=1 on a CPU (as CI runs them); without either they are skipped."""
from dataclasses import replace
import pytest
import torch
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
import triton, triton.language as tl
from dsv41_nb.formats import _hw_cvt
from dsv41_nb import mhc
from dsv41_nb.mhc import (HCWeights, hc_expand, hc_collapse, hc_mixes, mhc_seam, random_hc_layer,
                          random_hc_weights, register_seam_triton, run_hc_stack, sinkhorn, _rms_norm)
from dsv41_nb.mhc_kernel import (MHC_TUNING, SEAM_VERSIONS, check_seam, seam_version, _bf16_pieces,
                                 _mhc_seam_triton)
from dsv41_nb.mhc_speed import seam_plan
from machine import DEV, HAS_TRITON, needs_triton

TINY = ModelConfig.tiny()
ITERS, EPS = TINY.hc_sinkhorn_iters, TINY.hc_eps

@st.composite
def comb_logits(draw, n=None):
    """Batches of (n, n) logits: Gaussian of any spread, ±1e4, all equal, with -inf entries, rows
    and columns sprinkled in"""
    n = n or draw(st.sampled_from([2, 3, 4, 8]))
    b = draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(['gauss', 'pm1e4', 'equal', 'mixed']))
    if kind == 'gauss': z = torch.randn(b, n, n, generator=g) * draw(st.floats(0, 30))
    elif kind == 'pm1e4': z = (torch.randint(0, 2, (b, n, n), generator=g) * 2 - 1) * 1e4
    elif kind == 'equal': z = torch.full((b, n, n), draw(st.sampled_from([0.0, 1.0, -7.5, 1e4, -1e4])))
    else: z = torch.randn(b, n, n, generator=g) * 3 + (torch.rand(b, n, n, generator=g) < 0.3) * 1e4
    ninf = draw(st.sampled_from(['none', 'entries', 'row', 'column', 'all']))
    if ninf == 'entries': z[torch.rand(b, n, n, generator=g) < 0.4] = float('-inf')
    elif ninf == 'row': z[:, draw(st.integers(0, n - 1))] = float('-inf')
    elif ninf == 'column': z[:, :, draw(st.integers(0, n - 1))] = float('-inf')
    elif ninf == 'all': z[:] = float('-inf')
    return z.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))

@given(comb_logits())
def test_sinkhorn_invariants(z):
    "Every input: finite, non-negative, columns sum to 1 within 1e-3, row sums in [1/n, n] and adding up to n"
    c, n = sinkhorn(z, ITERS, EPS), z.shape[-1]
    assert c.dtype == torch.float32 and torch.isfinite(c).all() and (c >= 0).all()
    assert ((c.sum(-2) - 1).abs() <= 1e-3).all()
    rows = c.sum(-1)
    assert (rows >= 1 / n - 1e-3).all() and (rows <= n + 1e-3).all()
    assert ((rows.sum(-1) - n).abs() <= n * 1e-3).all()

@settings(max_examples=examples(25))
@given(comb_logits(n=4))
def test_sinkhorn_converges(z):
    "Given enough iterations, rows also sum to 1 within 1e-3, whatever the logits (4 x 4, as the model uses)"
    c = sinkhorn(z, 2000, EPS)
    assert ((c.sum(-1) - 1).abs() <= 1e-3).all() and ((c.sum(-2) - 1).abs() <= 1e-3).all()

@given(st.integers(0, 2**31), st.sampled_from([torch.float32, torch.bfloat16]), st.floats(0, 0.5),
       st.sampled_from(['none', 'equal', 'permutation', 'ninf-column']))
def test_sinkhorn_rows_at_20_iterations(seed, dtype, spread, kind):
    """Inputs that converge in the model's 20 iterations: rows too within 1e-3 (logits of small
    spread, all equal, one-hot on a permutation at ±1e4, a whole column at -inf)"""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(8, 4, 4, generator=g) * spread
    if kind == 'equal': z = torch.full((8, 4, 4), 1e4)
    elif kind == 'permutation':
        z = torch.stack([torch.eye(4)[torch.randperm(4, generator=g)] for _ in range(8)]) * 2e4 - 1e4
    elif kind == 'ninf-column': z[:, :, int(torch.randint(0, 4, (1,), generator=g))] = float('-inf')
    c = sinkhorn(z.to(dtype), ITERS, EPS)
    assert ((c.sum(-1) - 1).abs() <= 1e-3).all() and ((c.sum(-2) - 1).abs() <= 1e-3).all()

def test_sinkhorn_all_equal_is_uniform():
    for v in (0.0, 1e4, -1e4, float('-inf')):
        torch.testing.assert_close(sinkhorn(torch.full((2, 4, 4), v), ITERS, EPS),
                                   torch.full((2, 4, 4), 0.25), atol=1e-6, rtol=0)

def _constant_pre_layer(cfg, g, base):
    l = random_hc_layer(cfg, 1.0, g, dtype=torch.float32)
    for w in (l.attn, l.ffn): w.scale[0] = 0.0; w.base[:cfg.hc_mult] = base
    return l

@settings(max_examples=examples(10))
@given(st.integers(0, 2**31), st.integers(1, 3), st.integers(1, 9))
def test_forms_agree_when_pre_is_constant(seed, blocks, tokens):
    "With the same constant pre at every seam the single-pass and multi-step forms are one computation (fp32 copies)"
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(TINY.hc_mult, generator=g)
    layers = [_constant_pre_layer(TINY, g, base) for _ in range(blocks)]
    ws = [torch.randn(TINY.dim, TINY.dim, generator=g) / TINY.dim ** 0.5 for _ in range(2 * blocks)]
    subs = [(lambda w: lambda y, q, s: torch.tanh(y @ w))(w) for w in ws]
    h = torch.randn(tokens, TINY.dim, generator=g)
    with use_kernels('torch'):
        ys, ym = (run_hc_stack(h, layers, subs, torch.ones(TINY.dim), TINY, form)[0] for form in ('single', 'multi'))
    torch.testing.assert_close(ys, ym, atol=1e-5, rtol=1e-5)

def test_expand_then_collapse_is_the_final_norm():
    g = torch.Generator().manual_seed(0)
    h, w = (torch.randn(5, TINY.dim, generator=g).bfloat16().to(DEV),
            (1 + torch.rand(TINY.dim, generator=g)).bfloat16().to(DEV))
    ref = _rms_norm(h, w, TINY.norm_eps)
    with use_kernels('torch'):
        assert torch.equal(hc_collapse(*hc_expand(h, TINY.hc_mult), w, TINY), ref)
        assert torch.equal(run_hc_stack(h, [], [], w, TINY)[0], ref)
    if HAS_TRITON:      # the kernel's rsqrt and sum of squares may differ in the last fp32 bits: at most one BF16 ulp
        with use_kernels('triton'): got = hc_collapse(*hc_expand(h, TINY.hc_mult), w, TINY)
        ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2.0 ** -126))) - 7)
        assert ((got.float() - ref.float()).abs() <= ulp).all()

def seam_args(cfg, T, dtype, has_prev, predict, mix, fp8, strength, seed):
    "Random seam inputs: tokens of different magnitudes, a zero token, coefficients of the given strength"
    g = torch.Generator().manual_seed(seed)
    n, dim = cfg.hc_mult, cfg.dim
    x = torch.randn(T, n, dim, generator=g) * torch.exp2(torch.randn(T, 1, 1, generator=g) * 3)
    if T > 1: x[T // 2] = 0
    args = dict(x=x.to(DEV, dtype), cfg=cfg, fp8=fp8 and mix)
    if has_prev:
        args.update(f=torch.randn(T, dim, generator=g).to(DEV, dtype), post=(2 * torch.rand(T, n, generator=g)).to(DEV),
                    comb=sinkhorn(torch.randn(T, n, n, generator=g) * 3, 20, 1e-6).to(DEV))
    if mix:
        args.update(pre=torch.rand(T, n, generator=g).to(DEV),
                    norm_weight=(1 + 0.3 * torch.randn(dim, generator=g)).to(DEV, dtype))
    if predict: args['hc'] = random_hc_weights(cfg, strength, g, DEV)
    return args

# Compiled, every new width, stream count, block or step pattern is a new kernel (seconds each): on a GPU the fuzz draws
# the tuning's own blocks and two widths, and the GPU tier's test_mhc_every_token_program covers the shapes served.
GPU = DEV.type == 'cuda'
# launch tables the fuzz draws from: version 1 (16-token tiles, fp32 tl.dot), version 2 as tuned,
# and big tiles from a few tokens on
TILES = {'v1': SEAM_VERSIONS[1], 'v2': SEAM_VERSIONS[2], 'v3': SEAM_VERSIONS[3], 'v2 fp32 dot': dict(projection='fp32'),
         'big32': dict(big_t=5, big_block_t=32, big_block_d=64, big_warps=4),
         'big64': dict(big_t=3, big_block_t=64, big_block_d=16)}

@needs_triton
@settings(max_examples=examples(12 if GPU else 40))
@given(T=st.integers(0, 40), dim=st.sampled_from([64, 160] if GPU else [32, 64, 96, 160]),
       n=st.sampled_from([4] if GPU else [4, 8]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       steps=st.sampled_from([(1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 1), (1, 0, 0)]),
       fp8=st.booleans(), strength=st.floats(0, 10), block_d=st.sampled_from([64] if GPU else [32, 64]),
       split=st.sampled_from([1, 2, 3, 5, 'auto']), finish_sb=st.sampled_from([16] if GPU else [2, 16]),
       tiles=st.sampled_from(list(TILES)), seed=st.integers(0, 2**31))
def test_seam_kernel_matches_reference(T, dim, n, dtype, steps, fp8, strength, block_d, split, finish_sb, tiles, seed):
    cfg = replace(TINY, dim=dim, hc_mult=n)
    args = seam_args(cfg, T, dtype, *map(bool, steps), fp8, strength, seed)
    old = dict(MHC_TUNING)
    MHC_TUNING.update(TILES[tiles])
    MHC_TUNING.update(block_d=block_d, split=split, finish_sb=finish_sb, small_finish_sb=finish_sb)
    try:
        with use_kernels('triton'): got = mhc_seam(**args)
    finally: MHC_TUNING.update(old)
    check_seam(got, **args)
    if got.comb is not None and T:
        assert ((got.comb.sum(-2) - 1).abs() <= 1e-3).all() and (got.comb >= 0).all()
        assert (got.pre > 0).all() and (got.pre <= 1 + 1e-6).all() and (got.post >= 0).all() and (got.post <= 2).all()

@needs_triton
def test_seam_runs_the_registered_launcher_on_one_table(monkeypatch):
    """mhc_seam's Triton path is the launcher registered with mhc, and the launch table is the registry's one dict:
    registering its entries again (as a notebook that re-runs 07a_mhc_kernel's cells does) updates that dict in place,
    so a launcher defined anywhere reads the table the package's `seam_version` and `MHC_TUNING` change"""
    assert mhc.SEAM_TRITON['launch'] is _mhc_seam_triton and mhc.SEAM_TRITON['tuning'] is MHC_TUNING
    table = dict(MHC_TUNING)
    monkeypatch.setattr(mhc, 'SEAM_TRITON', dict(launch=None, tuning=MHC_TUNING))
    try:
        assert register_seam_triton(**dict(table, block_t=32)) is MHC_TUNING and MHC_TUNING['block_t'] == 32
        with seam_version(1): assert mhc.SEAM_TRITON['tuning']['kernel'] == 1
    finally: register_seam_triton(**table)
    assert MHC_TUNING == table
    calls, x = [], torch.randn(2, 4, 64, device=DEV)
    with use_kernels('triton'):
        with pytest.raises(RuntimeError, match='no Triton seam registered'): mhc_seam(x, cfg=TINY)
        register_seam_triton(lambda *a: calls.append(a) or 'ran')
        assert mhc_seam(x, cfg=TINY) == 'ran' and calls[0][0] is x and len(calls[0]) == 9
    with pytest.raises(TypeError, match='register_seam_triton: expected a callable launcher, got int'):
        register_seam_triton(3)


@needs_triton
def test_stack_on_kernels_stays_within_bf16_noise():
    "A 12-block single-pass stack on the kernels moves the head input by less than BF16 storage of the copies does"
    g = torch.Generator().manual_seed(7)
    layers = [random_hc_layer(TINY, 1.0, g, DEV) for _ in range(6)]
    ws = [(torch.randn(TINY.dim, TINY.dim, generator=g) / TINY.dim ** 0.5).to(DEV) for _ in range(12)]
    subs = [(lambda w: lambda y, q, s: torch.tanh(y.float() @ w).to(y.dtype))(w) for w in ws]
    h, final = torch.randn(20, TINY.dim, generator=g).to(DEV), torch.ones(TINY.dim, device=DEV)
    with use_kernels('torch'):
        ref, ref32 = (run_hc_stack(h.bfloat16(), layers, subs, final.bfloat16(), TINY, fp8=True)[0],
                      run_hc_stack(h, layers, subs, final, TINY)[0])
    with use_kernels('triton'): ker = run_hc_stack(h.bfloat16(), layers, subs, final.bfloat16(), TINY, fp8=True)[0]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert rel(ker, ref) < rel(ref, ref32)

@needs_triton
@pytest.mark.parametrize('dim,dtype', [(64, torch.bfloat16), (160, torch.float32)])
def test_seam_kernel_sinkhorn_exact_logits(dim, dtype):
    """With logits that both implementations compute exactly (copies of ±1, so the RMS factor is 1; integer multiples
    of 1/64 in hc_*_fn and hc_*_base; power-of-two scales), pre, post and comb differ only by the rounding of σ, exp
    and 39 normalisations of 4-element sums: a few ulps, far inside 2^-12 relative. The logits are spread wide enough
    that one Sinkhorn iteration more or less moves comb by more than 2^-10, so a kernel that ran another number of
    iterations, or another order, would fail."""
    cfg = replace(TINY, dim=dim)
    n, T, g = cfg.hc_mult, 24, torch.Generator().manual_seed(11)
    x = (torch.randint(0, 2, (T, n, dim), generator=g) * 2 - 1).to(DEV, dtype)
    fn = torch.randint(-4, 5, ((2 + n) * n, n * dim), generator=g).float() / 64
    hc = HCWeights(fn.to(DEV),
                   (torch.randint(-64, 65, ((2 + n) * n,), generator=g).float() / 64).to(DEV),
                   torch.tensor([1.0, 0.5, 8.0], device=DEV))
    args = dict(x=x, pre=torch.full((T, n), 0.25, device=DEV), hc=hc,
                norm_weight=torch.ones(dim, device=DEV, dtype=dtype), cfg=cfg)
    with use_kernels('triton'): got = mhc_seam(**args)
    with use_kernels('torch'): ref = mhc_seam(**args)
    u = 2.0 ** -24
    assert ((got.pre - ref.pre).abs() <= 32 * u).all() and ((got.post - ref.post).abs() <= 64 * u).all()
    assert ((got.comb - ref.comb).abs() <= ref.comb * 2.0 ** -12 + 4 * u).all()
    # on ref's device: a GPU's exp differs from the CPU's
    z = (hc_mixes(ref.x, hc.fn, cfg.norm_eps)[:, 2 * n:] * 8.0 + hc.base[2 * n:]).unflatten(-1, (n, n))
    torch.testing.assert_close(sinkhorn(z, ITERS, EPS), ref.comb, rtol=0, atol=0)
    step = max((sinkhorn(z, ITERS + k, EPS) - ref.comb).abs().max().item() for k in (-1, 1))
    assert step > 2.0 ** -10, step


@triton.jit
def _pieces_kernel(w_ptr, out_ptr, N: tl.constexpr, HW_CVT: tl.constexpr):
    i = tl.arange(0, N)
    hi, mid, lo = _bf16_pieces(tl.load(w_ptr + i), HW_CVT)
    tl.store(out_ptr + i, hi); tl.store(out_ptr + N + i, mid); tl.store(out_ptr + 2 * N + i, lo)

@needs_triton
def test_bf16_pieces_are_bf16_and_add_up_exactly():
    """The split behind the three BF16 products: every piece a BF16 value, hi + mid + lo == w bit
    for bit, at every magnitude"""
    g = torch.Generator().manual_seed(3)
    N = 4096
    w = torch.randn(N, generator=g) * torch.exp2(torch.randint(-100, 100, (N,), generator=g).float())
    # exact in one piece, the smallest normal, the last bit
    w[:4] = torch.tensor([1.0, -3.0, 2.0 ** -126, 1 + 2.0 ** -23])
    out = torch.empty(3 * N, device=DEV)
    _pieces_kernel[(1,)](w.to(DEV), out, N, _hw_cvt())
    hi, mid, lo = out.cpu().view(3, N)
    for p in (hi, mid, lo): assert torch.equal(p.bfloat16().float(), p)
    assert torch.equal((hi + mid) + lo, w)
    assert torch.equal(hi, w.bfloat16().float())                      # hi is round-to-nearest-even, as the GPU converts

@needs_triton
@pytest.mark.parametrize('version,tiles,T',
                         [(1, {}, 1), (1, {}, 17), (2, {}, 1), (2, {}, 3), (2, {}, 17), (2, dict(big_t=3), 65),
                          (2, dict(big_t=3, big_block_t=32, big_block_d=64), 33), (2, dict(projection='fp32'), 17),
                          (3, {}, 1), (3, dict(big_t=3), 33)])
def test_seam_versions_at_edge_sizes(version, tiles, T):
    """Both versions at one token, odd counts, and counts that leave a partial tile (17 of 16, 65 of
    64 or 32), full seam with FP8"""
    cfg = replace(TINY, dim=96)                                     # a width that is not a multiple of the column tiles
    args = seam_args(cfg, T, torch.bfloat16, True, True, True, True, 3.0, seed=T + version)
    with seam_version(version):
        old = dict(MHC_TUNING); MHC_TUNING.update(tiles, split=2)
        try:
            with use_kernels('triton'): got = mhc_seam(**args)
        finally: MHC_TUNING.clear(); MHC_TUNING.update(old)
    check_seam(got, **args)

@needs_triton
@pytest.mark.parametrize('T,steps,split',
                         [(3, (1, 1, 1), 1), (40, (1, 1, 1), 2), (40, (0, 1, 1), 1), (17, (1, 0, 1), 2)])
def test_seam_version_3_keeps_version_2s_bits(T, steps, split):
    """Version 3 makes the new copies one at a time with the same sums in the same order: at the same tiles every
    output is bitwise equal (other tiles may compile the projection to other matrix instructions, other bits)"""
    args = seam_args(replace(TINY, dim=96), T, torch.bfloat16, *map(bool, steps), True, 3.0, seed=T)
    outs = []
    for v in (2, 3):
        with seam_version(v):
            old = dict(MHC_TUNING); MHC_TUNING.update(big_t=3, big_block_t=32, split=split)
            try:
                with use_kernels('triton'): outs.append(mhc_seam(**args))
            finally: MHC_TUNING.clear(); MHC_TUNING.update(old)
    for name, a, b in zip(outs[0]._fields, *outs):
        assert (a is None) == (b is None), name
        if a is not None: assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name

def test_seam_plan_and_versions():
    """The plan follows the launch table: one launch once token blocks fill the machine, big tiles
    cut the reads of hc_*_fn"""
    full = ModelConfig.full()
    with seam_version(1): v1 = seam_plan(full, 8192)
    with seam_version(2): v2 = seam_plan(full, 8192)
    assert v1['launches'] == 1 and v1['programs'] == 512 and v1['projection'] == 'fp32 tl.dot'
    assert v2['fn_reads'] * 4 == v1['fn_reads'] and v2['projection'] == 'BF16 tl.dot x3'
    assert seam_plan(full, 1)['launches'] == 2 and seam_plan(full, 1, sms=0)['launches'] == 1
    assert MHC_TUNING['projection'] == 'bf16x3'                     # the context restored the table
    with pytest.raises(ValueError, match=r'seam version 4; expected one of \[1, 2, 3\]'):
        with seam_version(4): pass
    MHC_TUNING['projection'] = 'tf32'
    try:
        with pytest.raises(ValueError, match="expected one of \\['bf16x3', 'fp32'\\]"): seam_plan(full, 64)
    finally: MHC_TUNING['projection'] = 'bf16x3'


def test_register_cap_from_big_t(monkeypatch):
    """Compiled, version 2's programs from big_t on are capped at MHC_TUNING['big_maxnreg'] registers; smaller
    programs, version 3 and the interpreter launch without a cap, and a cap Triton cannot take is named"""
    from dsv41_nb import mhc_kernel
    big, cap = MHC_TUNING['big_t'], MHC_TUNING['big_maxnreg']
    monkeypatch.setattr(mhc_kernel, 'triton_interpreting', lambda: False)
    assert cap == 168 and mhc_kernel._register_cap(big, 2) == dict(maxnreg=168)
    assert mhc_kernel._register_cap(8192, 2) == dict(maxnreg=168)
    assert mhc_kernel._register_cap(big - 1, 2) == {} and mhc_kernel._register_cap(1, 2) == {}
    with seam_version(3): assert mhc_kernel._register_cap(big, 3) == {}
    with seam_version(1): assert mhc_kernel._register_cap(8192, 1) == {}
    monkeypatch.setattr(mhc_kernel, 'triton_interpreting', lambda: True)
    assert mhc_kernel._register_cap(big, 2) == {}
    for bad in (300, 0, 16, 168.0, '168'):
        monkeypatch.setitem(MHC_TUNING, 'big_maxnreg', bad)
        with pytest.raises(ValueError, match=r"MHC_TUNING\['big_maxnreg'\] = .*expected None or 24 to 255"):
            mhc_kernel._register_cap(big, 2)


@pytest.mark.parametrize('call, exc, msg', [
    (lambda m, c: m.seam_floor(c, -1), ValueError, 'seam_floor: T = -1; expected at least 0'),
    (lambda m, c: m.seam_floor(vars(c), 8), TypeError, 'seam_floor: cfg must be a ModelConfig, got dict'),
    (lambda m, c: m.seam_floor(c, 8, fp8=1), TypeError, 'seam_floor: fp8 must be a bool, got 1'),
    (lambda m, c: m.hc_layer_floor(c, 2.5), TypeError, 'seam_floor: T must be an int, got 2.5'),
    (lambda m, c: m.seam_plan(c, 0), ValueError, 'seam_plan: T = 0; expected at least 1'),
    (lambda m, c: m.seam_plan(c, 64, sms=-1), ValueError, 'seam_plan: sms = -1; expected at least 0'),
    (lambda m, c: m.count_launches(3), TypeError, 'count_launches: fn must be callable, got 3'),
    (lambda m, c: m.seam_inputs(c, 0, device='cpu'), ValueError, 'seam_inputs: T = 0; expected at least 1'),
], ids=lambda x: '' if callable(x) or isinstance(x, type) else x.split(':')[0] + ' ' + x.split('; ')[0][-6:])
def test_speed_helpers_name_bad_inputs(call, exc, msg):
    "07b's plans, floors and counts refuse a malformed argument with a message that names it"
    from dsv41_nb import mhc_speed
    with pytest.raises(exc) as e: call(mhc_speed, ModelConfig.tiny())
    assert msg in str(e.value)
    assert mhc_speed.seam_floor(ModelConfig.tiny(), 0) > 0 and mhc_speed.seam_plan(ModelConfig.tiny(), 1)['tokens'] == 1
