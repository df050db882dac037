"""The GPU tier's own checks: every launch shape the code can choose, compiled, against its reference, and the engine's
greedy tokens the same through CUDA graphs (waiting for each step or not) as eagerly, and the reference's argmax.

A launch shape is chosen from a table by the number of tokens (sparse decode's `DECODE_TUNING`, the fused MoE's
`MOE_TUNING`, the FP8 projections' `FP8_GEMV_TUNING` / `FP8_LINEAR_TUNING` / `FP8_LINEAR_WT_TUNING`, mHC's small and
large token programs, the MoE GEMVs up to `GEMV_MAX_TOKENS`): the token counts below are read off those tables (each
row's bound and the count past it), so a new row is tested without touching this file. The interpreter runs every
kernel correctly where the compiled code may not (a launch shape once decoded DS-FP4 records wrongly only when
compiled), so these run on a GPU alone; `tools/gpu_tests.sh` runs them with the rest of the suite compiled."""
import os, random
from dataclasses import replace
from functools import partial
from pathlib import Path
import pytest
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.sparse_decode import DECODE_TUNING, check_decode_grid, decode_inputs, sparse_decode
from dsv41_nb.moe import MoEWeights, route
from dsv41_nb.fused_moe import (MOE_TUNING, MOE_TILES, moe_launch_shape, check_fused_moe, _fused_stages,
                                fused_moe_experts, expert_down, expert_gate_up)
from dsv41_nb.moe_planes import plane_gate_up, planes_moe, expert_down_planes
from dsv41_nb.moe_planes_served import (gemv_gate_up_planes, PLANE_READ, PLANE_READ_ONCE, PLANE_READ_PAIRS,
                                        gemv_down_planes)
from dsv41_nb.moe_split import expert_gate_up_split, DenseShared
from dsv41_nb.moe_fp8 import fp8_gate_up, act_codes, act_codes_torch, fp8_moe, expert_down_fp8, FP8_MMA_BITS
from dsv41_nb.moe_gemv import GEMV_MAX_TOKENS, gemv_stages, gemv_gate_up
from dsv41_nb.fused_moe import align_by_expert_torch, expert_gate_up_torch, assert_fp8_close, fp8_act_quant
from dsv41_nb.moe import quantize_weight
from dsv41_nb.fp8_linear import (fp8_linear, assert_linear_close, FP8_GEMV_TUNING, FP8_LINEAR_TUNING,
                                 FP8_LINEAR_WT_TUNING, SHORT_K)
from dsv41_nb.mhc import mhc_seam
from dsv41_nb.mhc_kernel import MHC_TUNING, check_seam
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.indexer import index_logits_reference, pool_mask
from dsv41_nb.indexer_kernels import index_logits, logits_error_bound, key_decoding
from dsv41_nb.indexer_speed import _decode_batch
from dsv41_nb.checkpoint_files import load_model
from dsv41_nb.model import ByteTokenizer
from dsv41_nb.engine import LLM
from dsv41_nb.scheduler import SamplingParams
from test_mhc import seam_args
import dsv41_nb.drafter_graphs  # noqa: F401,E402  (an engine serves the DSpark drafter: fused kernels, CUDA graphs)

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason='the GPU tier: compiled kernels and CUDA graphs need a GPU')
DEV = torch.device('cuda' if GPU else 'cpu')
TINY = ModelConfig.tiny()
SMALL = Path(__file__).resolve().parents[1] / 'checkpoints' / 'small'


def row_counts(bounds, low: int = 1) -> list:
    "Token counts that reach every row of a table keyed by upper bounds: `low`, each bound, and one past it"
    ks = [k for k in bounds if k is not None]
    return sorted({low, *ks, *(k + 1 for k in ks)})


def test_row_counts():
    assert row_counts({8: 0, 128: 0, None: 0}) == [1, 8, 9, 128, 129]


@pytest.mark.parametrize('main', ['ds_fp4', 'fp8_ds_mla'])
@pytest.mark.parametrize('window', ['window_fp8', 'fp8_ds_mla'])
def test_decode_every_tuning_row(window, main):
    "Sparse decode at each `DECODE_TUNING` row, 16 / 64 / 128 heads, ragged lists with -1 entries"
    rows = check_decode_grid(DEV, (window,), (main,), batches=row_counts(DECODE_TUNING))
    assert all(r['worst'] <= 1 for r in rows)


@pytest.mark.parametrize('fmt', ['ds_fp4', 'fp8_ds_mla'])
def test_compress_step_at_the_bench_geometry(fmt):
    """The compressor's decode step in one launch (`compress_step`, version 2) at the `bench` head dim: 64 requests
    prefilled, then one token each, the reference's bits in the cache, the latents and the open groups left in the
    rings, and the same bits launch after launch"""
    from test_compressor import Harness, same_bits
    from dsv41_nb.compressor import Compressor, compress_reference
    from dsv41_nb.compressor_kernel import compress_step
    c = Compressor(ModelConfig.bench(), 2, fmt).to(DEV)
    c.norm.weight.data = torch.rand(c.head_dim, generator=torch.Generator().manual_seed(1)).to(DEV) + 0.5
    lengths = [2 + 7 * q % 23 for q in range(64)]
    steps = [[(q, 0, n - 1) for q, n in enumerate(lengths)], [(q, n - 1, 1) for q, n in enumerate(lengths)]]
    h = Harness(c, lengths, 0)
    (ca, ra, la), (cb, rb, lb) = h.run(compress_reference, steps), h.run(compress_step, steps)
    assert same_bits(ca, cb) and all(same_bits(a, b) for a, b in zip(la, lb))
    for q, n in enumerate(lengths):                                   # the open group each request leaves in its ring
        if n % 2: assert same_bits(ra[h.rings[q] * 2], rb[h.rings[q] * 2]), q
    cache, ring = h.caches()
    args = h.step(steps[1])

    def launch():
        r, k = ring.clone(), cache.clone()
        return compress_step(c, *args, r, k), r, k
    assert not _launches_differ(launch, 30)


def _moe_case(T, E, k, seed):
    cfg = replace(TINY, n_routed_experts=E, n_activated_experts=k, dim=128, moe_inter_dim=96)
    W = MoEWeights.random(cfg, seed, DEV)
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(T, cfg.dim, generator=g)).to(DEV)
    x[0, :7] = torch.tensor([1e-39, -1e-39, 0.0, -0.0, 448.0, -448.0, 1e4])    # subnormal, zeros, the FP8 edge
    return cfg, W, x, *route(x, W.gate, W.bias, k, cfg.route_scale)


@pytest.mark.parametrize('tiles', MOE_TILES)
@pytest.mark.parametrize('entry', list(MOE_TUNING))
def test_moe_every_tuning_entry(entry, tiles):
    """The fused MoE at a batch that picks each `MOE_TUNING` entry, both weight tiles, plain and
    with gate/up split along K"""
    E, k = 8, 2
    T = next(t for t in (1, 8, 64, 256, 1024) if moe_launch_shape(t * k, E) == MOE_TUNING[entry])
    cfg, W, x, tw, ti = _moe_case(T, E, k, seed=T)
    shape = dict(MOE_TUNING[entry], tiles=tiles)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, shape)
    split = partial(_fused_stages, gate_up=expert_gate_up_split)              # the serving path above the GEMVs
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, shape, stages=split)


@pytest.mark.parametrize('entry', list(MOE_TUNING))
def test_moe_planes_every_tuning_entry(entry):
    """Version 3 of the gate/up stage (codes in planes, the upcast in BF16 arithmetic, subnormals included) bit for bit
    equal to version 2 at each `MOE_TUNING` entry, and the layer within the reference"""
    E, k = 8, 2
    T = next(t for t in (1, 8, 64, 256, 1024) if moe_launch_shape(t * k, E) == MOE_TUNING[entry])
    cfg, W, x, tw, ti = _moe_case(T, E, k, seed=T)
    y2 = fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, check_ids=False)
    y3 = fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, check_ids=False, gate_up=plane_gate_up(W))
    assert torch.equal(y3, y2)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=partial(_fused_stages, gate_up=plane_gate_up(W)))
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit,                  # and the shared expert on cuBLAS, as served
                    stages=partial(_fused_stages, gate_up=plane_gate_up(W), shared=DenseShared(W)))
    for split in (1, None):                                          # version 4: its PTX multiply, its cap
        check_fused_moe(x, tw, ti, W, cfg.swiglu_limit,
                        stages=partial(_fused_stages, gate_up=plane_gate_up(W, split=split, slots=True)))


@pytest.mark.parametrize('fmt', ['index_mxfp4', 'index_fp8'])
@pytest.mark.parametrize('version', [1, 2, 3])
def test_index_logits_bench_geometry(version, fmt):
    """The indexer's logits kernel at the bench geometry (32 heads x 128) in its compiled tile shape (LOGITS_TUNING),
    each key decoding, in each mode (every entry; the kept blocks; the pool's entries alone), against the reference;
    launched again and again on the same inputs, the same bits"""
    cfg = ModelConfig.bench()
    codec, cbs = cache_format(cfg, fmt), cfg.candidate_block_size
    q, w, cache, ib = _decode_batch(cfg, codec, 4, 5000, DEV, seed=version)
    ib.positions[1], ib.positions[2] = 1234, 5                  # a shorter context; one that sees 6 entries
    ref, bound = index_logits_reference(q, w, cache, ib, codec), logits_error_bound(q, w, cache, ib, codec)
    g = torch.Generator(device=DEV).manual_seed(version)
    pool = torch.randint(0, 5000 // cbs, (4, 64), device=DEV, generator=g, dtype=torch.int32)
    keep = pool_mask(pool, (5000 + cbs - 1) // cbs, 1)
    with key_decoding(version), use_kernels('triton'):
        full = index_logits(q, w, cache, ib, codec)
        kept = index_logits(q, w, cache, ib, codec, keep=keep, cbs=cbs)
        sparse = index_logits(q, w, cache, ib, codec, pool=pool, cbs=cbs)
        assert not _launches_differ(lambda: index_logits(q, w, cache, ib, codec), 30)     # the same bits each time
    inside = keep.repeat_interleave(cbs, 1)[:, :ref.shape[1]]
    e = (pool.long()[:, :, None] * cbs + torch.arange(cbs, device=DEV)).flatten(1)
    for got, want, ok in ((full, ref, bound), (kept, ref.masked_fill(~inside, -torch.inf), bound),
                          (sparse, ref.gather(1, e.clamp_max(ref.shape[1] - 1)).masked_fill(e >= ref.shape[1],
                                                                                             -torch.inf),
                           bound.gather(1, e.clamp_max(ref.shape[1] - 1)))):
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got))
        assert ((got - want)[fin].abs() <= ok[fin]).all()


def test_moe_planes_bench_layer():
    """Version 3 on the bench layer's geometry (64 experts, dim 5120, inter 2304) at a decode batch, a serving batch,
    the `mid` regime (the down stage's own shape, MOE_DOWN_TUNING) and the `large` one (version 3's, PLANES_TUNING),
    where the column blocks are not halved as on a small layer; the shared expert on cuBLAS (DenseShared) within the
    oracle"""
    cfg = ModelConfig.bench()
    W = MoEWeights.random(cfg, 0, DEV)
    stage, shared = plane_gate_up(W), DenseShared(W)
    for T in (1, 128, 512, 2048):
        x = (3 * torch.randn(T, cfg.dim, device=DEV)).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        y2 = fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, check_ids=False)
        assert torch.equal(fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, check_ids=False, gate_up=stage), y2)
        if T in (128, 512):            # the down stage's own shape at 512; the shared expert on cuBLAS
            check_fused_moe(x, tw, ti, W, cfg.swiglu_limit)
            check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=partial(_fused_stages, gate_up=stage, shared=shared))


def test_moe_slots_bench_layer():
    """Version 4 of the gate/up stage (`slots`) on the bench layer at a decode batch, a serving batch (the launch's
    register cap), the `mid` regime and the `large` one, in one tile and with K split, within the reference"""
    cfg = ModelConfig.bench()
    W = MoEWeights.random(cfg, 0, DEV)
    # two draws that once failed on an H100 (the down stage at 2,048 tokens, a race at eight warps: see
    # test_moe_stages_repeat_exactly), then new activations each run, their seed named by a failure:
    # DSV41_MOE_SEED=S runs that case alone
    seeds = ([int(os.environ['DSV41_MOE_SEED'])] if 'DSV41_MOE_SEED' in os.environ
             else [500103725, 1212549319, random.SystemRandom().randrange(2 ** 31)])
    for seed in seeds:
        g = torch.Generator(device=DEV).manual_seed(seed)
        for T in (1, 128, 512, 2048):
            x = (3 * torch.randn(T, cfg.dim, device=DEV, generator=g)).to(torch.bfloat16)
            tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
            for split in (1, None):
                try:
                    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit,
                                    stages=partial(_fused_stages, gate_up=plane_gate_up(W, split=split, slots=True)))
                except AssertionError as e:
                    raise AssertionError(f"{T} tokens, split={split}, DSV41_MOE_SEED={seed}: {e}") from None
    from dsv41_nb import moe_planes
    assert moe_planes._check_slots.checked     # every kernel compiled here had its move's layout read and passed


def test_moe_fp8_bench_layer():
    """Version 5 of the gate/up stage (FP8 products, the words through registers) on the bench layer at a decode batch,
    a serving batch and the `mid` regime, at the regime's row blocks and at 16, in one tile and with K split, in two
    K loops (gate, then up) and at eight warps a program, and both
    stages in version 5, within the reference (one request: where the launch narrowed programs to 32 weight rows); the
    activations' codes against their plain version"""
    cfg = ModelConfig.bench()
    W = MoEWeights.random(cfg, 0, DEV)
    Wf = fp8_moe(W, down=True)                     # both stages in version 5, at 16-row blocks
    for T in (1, 128, 512):
        x = (3 * torch.randn(T, cfg.dim, device=DEV)).to(torch.bfloat16)
        x[0, :7] = torch.tensor([1e-39, -1e-39, 0.0, -0.0, 448.0, -448.0, 1e4])
        c, s = act_codes(fp8_act_quant(x))
        c_ref, s_ref = act_codes_torch(fp8_act_quant(x))
        assert torch.equal(c, c_ref) and torch.equal(s, s_ref)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        shape = moe_launch_shape(ti.numel(), W.n_experts)
        for bm, split, loops, warps in ((shape['block_m'], 1, 1, 4), (16, 1, 1, 4), (16, None, 1, 4),
                                        (shape['block_m'], 1, 2, 4), (shape['block_m'], 1, 2, 8), (16, 1, 1, 8)):
            check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, dict(shape, block_m=bm, num_warps=warps),
                            stages=partial(_fused_stages, gate_up=fp8_gate_up(W, split=split, loops=loops)),
                            mma_bits=FP8_MMA_BITS)
        check_fused_moe(x, tw, ti, Wf, cfg.swiglu_limit, dict(shape, block_m=16),
                        stages=partial(_fused_stages, gate_up=fp8_gate_up(Wf), down=expert_down_fp8),
                        mma_bits=FP8_MMA_BITS)
    from dsv41_nb import moe_fp8
    assert moe_fp8._check_move.checked          # every kernel compiled here had its move's layout read and passed


def test_moe_down_planes_bench_layer():
    """The down stage on the bench layer's down weights in planes, compiled, under `check_fused_moe` at a serving batch
    and each regime (64 experts, dim 5120, inter 2304), with version 3's gate/up and the shared expert on cuBLAS; and
    both stages in version 4"""
    cfg = ModelConfig.bench()
    W = planes_moe(MoEWeights.random(cfg, 1, DEV), down=True)
    stages = partial(_fused_stages, gate_up=plane_gate_up(W), shared=DenseShared(W), down=expert_down_planes)
    v4 = partial(_fused_stages, gate_up=plane_gate_up(W, slots=True), shared=DenseShared(W),
                 down=partial(expert_down_planes, slots=True))
    for T in (5, 128, 512, 2048):
        x = (3 * torch.randn(T, cfg.dim, device=DEV)).to(torch.bfloat16)
        x[0, :7] = torch.tensor([1e-39, -1e-39, 0.0, -0.0, 448.0, -448.0, 1e4])
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=stages)
        check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=v4)          # both stages in version 4


@pytest.mark.parametrize('T', range(1, GEMV_MAX_TOKENS + 1))
def test_gemv_down_planes_bench_layer(T):
    "The decode GEMVs with all three routed weights of the bench layer in planes, compiled, under `check_fused_moe`"
    cfg = ModelConfig.bench()
    W = planes_moe(MoEWeights.random(cfg, 10 + T, DEV), down=True)
    x = (3 * torch.randn(T, cfg.dim, device=DEV)).to(torch.bfloat16)
    tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit,
                    stages=partial(gemv_stages, gate_up=gemv_gate_up_planes, down=gemv_down_planes))


@pytest.mark.parametrize('read', ['x4', 'once', 'pairs'])
@pytest.mark.parametrize('T', range(1, GEMV_MAX_TOKENS + 1))
def test_gemv_planes_bench_layer(T, read):
    "The decode GEMVs reading the bench layer's gate and up weights in planes, compiled, against the reference"
    cfg = ModelConfig.bench()
    W = MoEWeights.random(cfg, T, DEV)
    x = (3 * torch.randn(T, cfg.dim, device=DEV)).to(torch.bfloat16)
    x[0, :7] = torch.tensor([1e-39, -1e-39, 0.0, -0.0, 448.0, -448.0, 1e4])    # subnormal, zeros, the FP8 edge
    tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
    h = gemv_gate_up_planes(x, tw, ti, planes_moe(W), cfg.swiglu_limit,
                            read=dict(x4=PLANE_READ, once=PLANE_READ_ONCE, pairs=PLANE_READ_PAIRS)[read])
    n = T * cfg.n_activated_experts
    al = align_by_expert_torch(ti, cfg.n_routed_experts, 16)
    assert_fp8_close(h[:n], expert_gate_up_torch(fp8_act_quant(x), W.w1, W.w3, al, tw, cfg.swiglu_limit))
    assert torch.equal(h[n:], gemv_gate_up(x, tw, ti, W, cfg.swiglu_limit)[n:])


@pytest.mark.parametrize('T', range(1, GEMV_MAX_TOKENS + 1))
def test_moe_gemv_every_token_count(T):
    cfg, W, x, tw, ti = _moe_case(T, 8, 2, seed=100 + T)
    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=gemv_stages)


def _fp8_case(T, N, K, seed, scale):
    g = torch.Generator().manual_seed(seed)
    w = quantize_weight(torch.randn(1, N, K, generator=g) / K ** 0.5, 'fp8')
    w = type(w)(w.codes.to(DEV), w.scales.to(DEV), 'fp8')
    x = (scale * torch.randn(T, K, generator=g)).to(torch.bfloat16)
    if scale == 1.0: x[0, :3] = torch.tensor([1e-39, -0.0, 2.0 ** 118])     # a subnormal, -0, the GEMV's largest input
    return w, x.to(DEV)


@pytest.mark.parametrize('K', [512, SHORT_K * 2])
@pytest.mark.parametrize('T', sorted({*row_counts(FP8_GEMV_TUNING), *row_counts(FP8_LINEAR_TUNING, low=3),
                                     *row_counts(FP8_LINEAR_WT_TUNING, low=3)}))
def test_fp8_linear_every_row(T, K):
    "The FP8 GEMV (one or two rows, short and long K), both MMA kernels at each row of their tables, BF16 edge values"
    for scale, act in ((1.0, True), (1e-3, True), (50.0, False)):
        w, x = _fp8_case(T, 96, K, seed=T * K, scale=scale)
        for mma in (1, 2): assert_linear_close(fp8_linear(x, w, act, max_t=256, mma=mma), x, w, act)


@pytest.mark.parametrize('fp8', [False, True])
@pytest.mark.parametrize('T', row_counts({MHC_TUNING['small_t']: 0, MHC_TUNING['block_t']: 0}) + [300])
def test_mhc_every_token_program(T, fp8):
    "The mHC seam at the small-token programs, at one and past one token tile, and at many tokens, every step present"
    for dtype in (torch.bfloat16, torch.float32):
        args = seam_args(TINY, T, dtype, True, True, True, fp8, 3.0, seed=T)
        with use_kernels('triton'): got = mhc_seam(**args)
        check_seam(got, **args)


PROMPTS = ['Return the', 'def __init__(self', 'The module', 'import os', 'Raise ValueError if',
           'class Path', '# Copyright', 'A list of']


@pytest.fixture(scope='module')
def small():
    return load_model(SMALL, device=DEV)


def _serve(model, prompts, keep=None, **kw):
    "Greedy tokens of `prompts` (24 each); the engine goes into `keep` if given"
    llm = LLM(model, max_num_seqs=len(prompts), max_model_len=160, **kw)
    if keep is not None: keep.append(llm)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.mark.parametrize('batch', [1, 4, 64])
def test_graphs_sync_and_async_equal_eager(small, batch):
    "The engine's greedy tokens: CUDA graphs, waiting for each step or not, equal to the eager paged path"
    prompts = [PROMPTS[i % len(PROMPTS)] + ' ' * (i // len(PROMPTS)) for i in range(batch)]
    eager = _serve(small, prompts, cuda_graphs=False)
    assert _serve(small, prompts) == eager
    assert _serve(small, prompts, async_scheduling=True) == eager


@torch.no_grad()
def test_engine_steps_are_the_reference_argmax(small):
    """Without bounded replay, at least 90% of the engine's greedy steps are the argmax of the dense reference on the
    CPU given the same prefix. Not all: the GPU's kernels round differently from the CPU's, and the model's discrete
    steps (rounding to FP8, the indexer's top-k, the router) turn one ulp into logits that move by up to about one (the
    greedy_agreement tool measures 97% on the H200, where the dense reference's own GPU run reaches 98%); a launch
    shape that decodes wrongly drops far below."""
    outs = _serve(small, PROMPTS, bounded_replay=False, async_scheduling=True)
    agree, steps = _reference_argmax(PROMPTS, outs)
    assert agree >= 0.9 * steps, f'{agree} of {steps} steps are the reference argmax'


def _reference_argmax(prompts, outs) -> tuple:
    "(steps whose greedy token is the CPU reference's argmax given the same prefix, steps)"
    ref = load_model(SMALL, device='cpu')
    tok, agree, steps = ByteTokenizer(ref.cfg), 0, 0
    for p, out in zip(prompts, outs):
        ids = tok.encode(p)
        logits = ref(torch.tensor([ids + out]))[0, len(ids) - 1:-1]
        agree, steps = agree + int((logits.argmax(-1) == torch.tensor(out)).sum()), steps + len(out)
    return agree, steps


@torch.no_grad()
@pytest.mark.parametrize('batch', [4, 64])
def test_engine_on_the_fp8_codes_through_the_mma_kernel(small, monkeypatch, batch):
    """With FP8_LINEAR_MMA_T raised, the projections of steps up to that many rows read their FP8 codes through the MMA
    kernel (version 2) instead of cuBLAS on BF16 copies: the greedy tokens through CUDA graphs (async) equal the eager
    path's, and at least 90% of the steps are the CPU reference's argmax, as on the default path"""
    import dsv41_nb.fp8_linear as fl
    monkeypatch.setattr(fl, 'FP8_LINEAR_MMA_T', 64)
    prompts = [PROMPTS[i % len(PROMPTS)] + ' ' * (i // len(PROMPTS)) for i in range(batch)]
    outs = _serve(small, prompts, bounded_replay=False, async_scheduling=True)
    assert outs == _serve(small, prompts, bounded_replay=False, cuda_graphs=False)
    agree, steps = _reference_argmax(prompts, outs)
    assert agree >= 0.9 * steps, f'{agree} of {steps} steps are the reference argmax'


def _count_target_runs(monkeypatch) -> list:
    "The lengths of the sequences DSpark's proposer runs the target over itself (it lacked their taps)"
    from dsv41_nb.dspark_decode import DSparkProposer
    runs, orig = [], DSparkProposer._target_hidden
    monkeypatch.setattr(DSparkProposer, '_target_hidden', lambda self, ids: runs.append(len(ids)) or orig(self, ids))
    return runs


@pytest.mark.parametrize('async_scheduling', [False, True])
def test_dspark_reads_the_taps_captured_graphs_write(small, monkeypatch, async_scheduling):
    """Adaptive DSpark priced so that it verifies nothing: the steps between its probes run as plain decode steps
    replayed from CUDA graphs (async: launched without waiting), the drafter reads the taps the graphs wrote (the
    target never runs again for them), and the tokens are the engine's own"""
    from dsv41_nb.dspark_serving import dspark_proposer
    from dsv41_nb.drafter_graphs import DraftPacer
    runs, want, keep = _count_target_runs(monkeypatch), _serve(small, PROMPTS), []
    never = dspark_proposer(small, SMALL / 'dspark.safetensors', 3, adaptive=True, step_cost=lambda T: T.double() ** 2)
    never.pacer = DraftPacer(tolerance=None)   # the priced backoff alone: probes in a run this short
    assert _serve(small, PROMPTS, keep, proposer=never, async_scheduling=async_scheduling) == want and runs == []
    runner = keep[0].llm_engine.runner
    assert 0 < runner.plain_steps <= runner.model.stats['replayed'], (runner.plain_steps, runner.model.stats)


@pytest.mark.parametrize('async_scheduling', [False, True])
def test_dspark_fixed_drafts_keep_the_greedy_tokens(small, monkeypatch, async_scheduling):
    """Three drafts a step, verified in steps replayed from CUDA graphs, the scheduler planning ahead or not: the
    greedy tokens of the engine without speculation (synchronous, graphs), and no target re-run"""
    from dsv41_nb.dspark_serving import dspark_proposer
    runs, want, keep = _count_target_runs(monkeypatch), _serve(small, PROMPTS), []
    prop = dspark_proposer(small, SMALL / 'dspark.safetensors', 3)
    assert _serve(small, PROMPTS, keep, proposer=prop, async_scheduling=async_scheduling) == want
    assert runs == [] and keep[0].llm_engine.scheduler.stats['accepted_tokens'] > 0
    assert keep[0].llm_engine.runner.model.stats['replayed'] > 0


@pytest.mark.parametrize('async_scheduling', [False, True])
def test_dspark_verification_steps_replay_from_graphs(small, async_scheduling):
    """Three drafts a step, verified in steps replayed from CUDA graphs that record the rings' rows: the tokens of the
    same verification run eagerly, some ring groups restored from what the graphs recorded"""
    from dsv41_nb.dspark_serving import dspark_proposer
    prop = lambda: dspark_proposer(small, SMALL / 'dspark.safetensors', 3)
    eager, keep = _serve(small, PROMPTS, proposer=prop(), cuda_graphs=False), []
    assert _serve(small, PROMPTS, keep, proposer=prop(), async_scheduling=async_scheduling) == eager
    cg = keep[0].llm_engine.runner.model
    assert cg.journaled and cg.stats['replayed'] > 0 and cg.model.ring_restores > 0, cg
    graphs = keep[0].llm_engine.proposer.graphs      # the engine served the drafter: its drafts from graphs too
    assert graphs is not None and graphs.stats['replayed'] > 0 and graphs.stats['eager'] == 0, graphs.stats


@pytest.mark.parametrize('async_scheduling', [False, True])
def test_dspark_graphs_captured_at_start(small, async_scheduling):
    """capture_at_start with three DSpark drafts a step: every decode and verifying graph is captured before the first
    request (the drafter's too), every prefill size class up to what 8 prompts of the longest hold is warmed, serving
    captures none, and the tokens are those of the engine without speculation"""
    from dsv41_nb.dspark_serving import dspark_proposer
    from dsv41_nb.engine_runs import warm_up_steps, graphs_held
    want, keep = _serve(small, PROMPTS), []
    prop = dspark_proposer(small, SMALL / 'dspark.safetensors', 3)
    llm = LLM(small, max_num_seqs=len(PROMPTS), max_model_len=160, proposer=prop,
              async_scheduling=async_scheduling, capture_at_start=True)
    cg = llm.llm_engine.runner.model
    # 8 requests pad to 8 rows; with 3 drafts each, 32 rows
    assert (max(cg.graphs), max(cg.journaled)) == (8, 32), cg
    assert max(llm.llm_engine.proposer.graphs.graphs) == 8      # the drafter's graphs, up to 8 requests
    assert llm.llm_engine.start_up['prefill'] == warm_up_steps(16384, 159, 8)      # on a GPU: prefill shapes too
    assert graphs_held(llm.llm_engine) == dict(decode=len(cg.graphs), verify=len(cg.journaled),
                                               drafter=len(llm.llm_engine.proposer.graphs.graphs))
    captured, drafter = cg.stats['captured'], llm.llm_engine.proposer.graphs.stats['captured']
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == want
    assert (cg.stats['captured'], llm.llm_engine.proposer.graphs.stats['captured']) == (captured, drafter)
    assert cg.stats['replayed'] > 0 and llm.llm_engine.scheduler.stats['accepted_tokens'] > 0


def test_drafter_graphs_draft_as_the_served_drafter(small):
    """The small checkpoint's drafter, served: greedy drafts replayed from CUDA graphs of padded sizes against the same
    drafter run eagerly at exactly N (a padded GEMM may round a near-tie apart: nine in ten slots at least), and the
    confidence logits of every request whose drafts agree"""
    from dsv41_nb.dspark import Drafter, window_positions
    from dsv41_nb.dspark_serving import load_drafter
    from dsv41_nb.drafter_graphs import DrafterGraphs
    d = load_drafter(Drafter(small), SMALL / 'dspark.safetensors').serve()
    graphs, g = DrafterGraphs(d, sizes=(4, 8)), torch.Generator(device=DEV).manual_seed(0)
    for N in (3, 8, 11, 2):
        x = torch.randn(N, d.window, small.cfg.dim, generator=g, device=DEV).to(small.embed.weight.dtype)
        pos, valid = window_positions(torch.randint(0, 100, (N,), generator=g, device=DEV), d.window)
        t = torch.randint(1, small.cfg.vocab_size, (N,), generator=g, device=DEV)
        with torch.no_grad(): got, want = graphs(x, pos, valid, t), d.draft(x, pos, valid, t)
        same = (got.tokens == want.tokens)
        assert same.float().mean() >= 0.9, (N, got.tokens, want.tokens)
        rows = same.all(1)
        torch.testing.assert_close(got.confidence[rows], want.confidence[rows], rtol=0.05, atol=0.05)
    assert graphs.stats == dict(replayed=3, eager=1, captured=2), graphs.stats


def test_pool_sized_from_the_gpu_memory(small):
    "gpu_memory_utilization: the pool holds max_num_seqs requests of max_model_len (the need, well under the budget),"
    " and the engine's tokens are the default pool's"
    from dsv41_nb.kv_manager import KVCacheManager
    keep = []
    sized = _serve(small, PROMPTS[:4], keep, gpu_memory_utilization=0.9)
    kc = keep[0].llm_engine.kv_cache_config
    assert kc.num_blocks == 4 * sum(KVCacheManager(kc).min_blocks(160)) + 1
    assert sized == _serve(small, PROMPTS[:4])


def _same(a, b):
    "Bit for bit equal: tensors, or tuples of them (None where both are)"
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple): return isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    return a is None and b is None


def _launches_differ(fn, n):
    "How many of `n` launches of `fn` differ in any bit from its first"
    first = fn()
    return sum(not _same(fn(), first) for _ in range(n))


def test_moe_stages_repeat_exactly():
    """Every MoE stage, launched hundreds of times on the same inputs at the `mid` and `large` regimes of the bench
    layer, gives the same bits each time: a race in a compiled kernel (the down stage at eight warps once differed in
    one launch of 18) passes a single check against the reference most of the time"""
    cfg = ModelConfig.bench()
    W = MoEWeights.random(cfg, 2, DEV)
    P, F = planes_moe(W, down=True), fp8_moe(W, down=True)
    planes, slots, fp8 = plane_gate_up(P, split=None), plane_gate_up(P, split=None, slots=True), fp8_gate_up(F, None)
    g = torch.Generator(device=DEV).manual_seed(3)
    for T in (512, 2048):
        x = (3 * torch.randn(T, cfg.dim, device=DEV, generator=g)).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        s = _fused_stages(x, tw, ti, W, cfg.swiglu_limit)
        xq, h, al, shape, lim = s['xq'], s['h'], s['align'], moe_launch_shape(T * 6, 64), cfg.swiglu_limit
        stages = {
            'down': (300, lambda: expert_down(h, W.w2, al, shape=shape)),
            'shared down': (100, lambda: expert_down(s['hs'], W.shared_w2, s['shared'], s['routed'], shape)),
            'gate/up': (100, lambda: expert_gate_up(xq, W.w1, W.w3, al, tw, lim, shape)),
            'gate/up split': (100, lambda: expert_gate_up_split(xq, W.w1, W.w3, al, tw, lim, shape)),
            'planes down': (100, lambda: expert_down_planes(h, P.w2, al, shape=shape)),
            'slots down': (100, lambda: expert_down_planes(h, P.w2, al, shape=shape, slots=True)),
            'planes gate/up': (100, lambda: planes(xq, P.w1, P.w3, al, tw, lim, shape)),
            'slots gate/up': (100, lambda: slots(xq, P.w1, P.w3, al, tw, lim, shape)),
            'fp8 gate/up': (30, lambda: fp8(xq, F.w1, F.w3, al, tw, lim, shape)),
            'fp8 down': (100, lambda: expert_down_fp8(h, F.w2, al, shape))}
        differ = {name: _launches_differ(fn, n) for name, (n, fn) in stages.items()}
        assert not any(differ.values()), f"{T} tokens: launches that differ from the first: {differ}"


@pytest.mark.parametrize('T', [1, 4, 16, 64, 256])
def test_projections_seam_and_decode_repeat_exactly(T):
    """The FP8 projections (the GEMV and both MMA kernels) on a 4,096 x 4,096 weight, the mHC seam at the bench width
    and sparse decode at the full width (64 heads), launched 100 times on the same inputs at each serving batch, give
    the same bits each time (as the MoE's stages must)"""
    w, x = _fp8_case(T, 4096, 4096, seed=T, scale=1.0)
    for mma in (1, 2):
        assert not _launches_differ(lambda: fp8_linear(x, w, True, max_t=256, mma=mma), 100), f"MMA version {mma}"
    args = seam_args(ModelConfig.bench(), T, torch.bfloat16, True, True, True, True, 3.0, seed=T)
    with use_kernels('triton'):
        assert not _launches_differ(lambda: mhc_seam(**args), 100), "mHC seam"
    cfg = ModelConfig.full()
    q, window, compressed, idx, sink, scale = decode_inputs(cfg, T, 2048, cfg.index_topk, 'fp8_ds_mla', 'ds_fp4',
                                                            heads=64, ragged=True, device=DEV, seed=T)
    with use_kernels('triton'):
        assert not _launches_differ(lambda: sparse_decode(q, window, compressed, idx, sink, scale,
                                                          check_indices=False), 100), "sparse decode"
