#!/usr/bin/env python
"""The instruction mix of a compiled Triton kernel's inner loop (from its PTX) and one launch's Nsight Compute figures,
as a record a notebook can read.

    python tools/kernel_mix.py --ptx KERNEL.ptx [--sass KERNEL.sass] [--ncu NCU.txt] --json OUT.json
                               [--machine NAME] [--commit SHA] [--launch JSON]
    python tools/kernel_mix.py --compile-gate-up OUT_DIR [--prefetch | --planes] [--json OUT.json]
    python tools/kernel_mix.py --compile-gate-up-versions OUT_DIR --json OUT.json
    python tools/kernel_mix.py --compile-gemv OUT_DIR --json OUT.json
    python tools/kernel_mix.py --compile-gate-up-fp8 OUT_DIR --json OUT.json
    python tools/kernel_mix.py --compile-index OUT_DIR --json OUT.json
    python tools/kernel_mix.py --compile-sparse-decode OUT_DIR --json OUT.json
    python tools/kernel_mix.py --compile-fp8-linear OUT_DIR --json OUT.json
    python tools/kernel_mix.py --compile-mhc-seam OUT_DIR --json OUT.json

--ptx: the kernel's PTX (`CompiledKernel.asm['ptx']`); the record counts each opcode of the longest loop's body once
(the instructions one thread runs per K step). --sass: the kernel's machine code as `cuobjdump -sass` prints it; the
record counts its longest loop the same way (opcodes without their modifiers). --ncu: the text report of one `ncu`
run on the kernel (its sections: SpeedOfLight, LaunchStats, Occupancy, SchedulerStats, WarpStateStats,
MemoryWorkloadAnalysis); the record keeps its numeric metrics by name. --launch: a JSON object describing the launch
(tokens, launch shape), stored as given. --machine and --commit name where the files came from (default: this
machine, this checkout). --compile-gate-up compiles the fused MoE's gate/up kernel (08b_fused_moe) for a Hopper GPU
(sm_90) at the `bench` layer's 128-token launch, with no GPU: Triton's own compiler, ptxas and cuobjdump; it writes
OUT_DIR/gate_up.ptx, .cubin and .sass (the same Triton version as the GPU's gives the GPU's code), and with --json
their record; --planes compiles version 3 (08f_moe_planes) instead. --compile-gemv compiles the decode GEMV
(08e_moe_gemv) of the bench layer's gate/up and down stages on codes and through each reading of the planes
(08f_moe_planes_served), and records each one's routed loop (SASS instructions) and registers. --compile-index does
the same for the full-scan index logits kernel (04b_indexer_kernels): its tile loop through each version of the
MXFP4 key decoding, and at FP8 keys; --compile-sparse-decode for the sparse MLA decode kernel (06_sparse_decode):
the tile loop of each of its two passes.
--compile-gate-up-versions compiles 08f_moe_planes' gate/up and down stages, versions 3 and 4, at 32 to 2,048 tokens.
--compile-gate-up-fp8 compiles 08g_moe_fp8's stages (version 5) beside version 4's, at 32 to 512 tokens.
--compile-fp8-linear compiles 09a_fp8_linear's MMA kernel at each of its row tiles on the bench layer's wq_b.
--compile-mhc-seam compiles 07a_mhc_kernel's seam kernel (version 2) at several launch shapes: its registers and the
warps an SM keeps by them.
--quick: a check of the script on a small PTX and
report it writes itself."""
import argparse, datetime, itertools, json, math, re, sys, tempfile
from collections import Counter
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit     # noqa: E402  (the checkout's commit, as every record names it)


def loop_body(ptx: str) -> list[str]:
    "The instructions of the longest loop in `ptx`: from a label to the last branch back to it"
    lines = ptx.split('\n')
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r'^(\$L__BB\d+_\d+):', l))}
    loops = []
    for j, l in enumerate(lines):
        m = re.search(r'\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);', l)
        if m and m.group(1) in labels and labels[m.group(1)] < j: loops.append((labels[m.group(1)], j))
    if not loops: raise ValueError('the PTX has no loop (no branch back to an earlier label)')
    start, end = max(loops, key=lambda se: se[1] - se[0])
    return [l.strip() for l in lines[start + 1:end + 1]]


def opcode_counts(body: list[str]) -> dict:
    "Opcode (guard dropped, modifiers kept) -> count, for the instructions of `body`"
    ops = Counter()
    for l in body:
        if not l or l.startswith(('//', '.', '{', '}', '$')): continue
        words = l.split()
        op = words[1] if words[0].startswith('@') and len(words) > 1 else words[0]
        ops[op.rstrip(';')] += 1
    return dict(ops.most_common())


def sass_loops(text: str) -> list[list[str]]:
    "The instructions of every loop in `cuobjdump -sass` output (a branch's target to the branch back), longest first"
    ins = [(int(m.group(1), 16), m.group(2).strip()) for l in text.split('\n')
           if (m := re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;', l))]
    loops = [(int(m.group(1), 16), a) for a, s in ins
             if (m := re.search(r'\bBRA\b.*?0x([0-9a-f]+)', s)) and int(m.group(1), 16) < a]
    if not loops: raise ValueError('the SASS has no loop (no branch back to an earlier address)')
    return sorted(([s for a, s in ins if lo <= a <= hi] for lo, hi in loops), key=len, reverse=True)


def sass_loop(text: str) -> list[str]:
    "The instructions of the longest loop in `cuobjdump -sass` output"
    return sass_loops(text)[0]


def sass_opcodes(body: list[str]) -> dict:
    "SASS opcode (guard and modifiers dropped: IMAD.MOV.U32 -> IMAD) -> count"
    ops = Counter()
    for s in body:
        w = s.split()
        ops[(w[1] if w[0].startswith('@') and len(w) > 1 else w[0]).split('.')[0]] += 1
    return dict(ops.most_common())


def compile_gate_up(out: Path, prefetch: bool = False, tokens: int = 128, planes: bool = False,
                    slots: bool = False, block_n: int | None = None) -> dict:
    ("PTX and SASS of the gate/up kernel (version 2, or version 3 of 08f_moe_planes with `planes`) for sm_90 at "
     "the bench layer's launch for `tokens`, compiled with no GPU; the launch, with the registers a thread holds")
    import triton, triton.language as tl
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.fused_moe import _gate_up_kernel, moe_launch_shape
    from dsv41_nb.moe_planes import _gate_up_planes_kernel, _stage_kernels
    cfg = ModelConfig.bench()
    shape = moe_launch_shape(tokens * cfg.n_activated_experts, cfg.n_routed_experts)
    if block_n: shape = {**shape, 'block_n': block_n}
    words = '*i32' if planes else '*u8'
    ptrs = dict(x_ptr='*bf16', w1_ptr=words, w1s_ptr=words, w3_ptr=words, w3s_ptr=words, h_ptr='*bf16',
                sorted_ptr='*i32', block_expert_ptr='*i32', weight_ptr='*fp32')
    const = dict(K=cfg.dim, N=cfg.moe_inter_dim, TOPK=cfg.n_activated_experts, BM=shape['block_m'],
                 BN=shape['block_n'], GROUP_M=8, CLAMP=True, HW_CVT=True)
    launch = {}
    if slots: (fn, _), launch = _stage_kernels(True, shape['block_m'])
    if planes or slots:
        fn, shape, prefetch = fn if slots else _gate_up_planes_kernel, {**shape, 'block_k': 128}, False
    else:
        fn = _gate_up_kernel
        const.update(BK=shape['block_k'], W_FP4=True, HAS_WEIGHT=True, IDENTITY=False, DOT=tl.bfloat16,
                     SCALED=True, PREFETCH=prefetch)
    sig = {**ptrs, 'n_assign': 'i32', 'num_m': 'i32', 'limit': 'fp32', **{k: 'constexpr' for k in const}}
    regs = _sm90(fn, sig, [*ptrs, 'n_assign'], const, shape['num_warps'], shape['num_stages'], out, 'gate_up',
                 launch.get('maxnreg'))['REG']
    return dict(kernel=('version 4' if slots else fn.fn.__name__ if hasattr(fn, 'fn') else fn.__name__),
                tokens=tokens, config='bench', **{**shape, 'prefetch': prefetch}, **launch,
                triton=triton.__version__, target='sm_90', registers=regs)


def compile_down(out: Path, tokens: int, slots: bool, block_n: int | None = None) -> dict:
    ("The routed down stage in planes (08f_moe_planes), version 3 or 4 (`slots`), for sm_90 at the bench layer's "
     "launch for `tokens`, with no GPU; the launch, with the registers a thread holds")
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.fused_moe import moe_launch_shape, stage_shape
    from dsv41_nb.moe_planes import _down_planes_kernel, _down_slots_kernel, PLANES_DOWN_TUNING
    cfg = ModelConfig.bench()
    shape = stage_shape(moe_launch_shape(tokens * cfg.n_activated_experts, cfg.n_routed_experts),
                        PLANES_DOWN_TUNING)
    if block_n: shape = {**shape, 'block_n': block_n}
    fn = _down_slots_kernel if slots else _down_planes_kernel
    ptrs = dict(h_ptr='*bf16', w_ptr='*i32', ws_ptr='*i32', out_ptr='*bf16', sorted_ptr='*i32',
                block_expert_ptr='*i32')
    const = dict(K=cfg.moe_inter_dim, N=cfg.dim, TOPK=cfg.n_activated_experts, BM=shape['block_m'],
                 BN=shape['block_n'], GROUP_M=8, HW_CVT=True)
    sig = {**ptrs, 'n_assign': 'i32', 'num_m': 'i32', **{k: 'constexpr' for k in const}}
    regs = _sm90(fn, sig, [*ptrs, 'n_assign'], const, shape['num_warps'], shape['num_stages'], out, 'down')['REG']
    return dict(block_m=shape['block_m'], block_n=shape['block_n'], num_warps=shape['num_warps'], registers=regs)


def compile_gate_up_versions(out: Path) -> list[dict]:
    ("08f_moe_planes' gate/up stage (two matrices) and routed down stage (one) for sm_90 at the bench layer, version "
     "3 and version 4 (`slots`, with its launch's register cap), at a decode batch, a serving batch and two larger "
     "ones, with no GPU: the K loop's SASS instructions per weight (BN x 128 weights a matrix and step, over the "
     "threads), registers, spills")
    from dsv41_nb.moe_planes import asm_layouts
    rows = []
    for stage, tokens in itertools.product(('gate/up', 'down'), (32, 128, 512, 2048)):
        # version 4 also at 32 weight rows a program, as the launch narrows a decode batch's on a GPU
        runs = [('version 3', False, None), ('version 4', True, None)]
        if tokens == 32: runs.append(('version 4 at 32 rows', True, 32))
        for name, slots, bn in runs:
            if stage == 'down': r, matrices, f = compile_down(out, tokens, slots, bn), 1, 'down'
            else: r, matrices, f = compile_gate_up(out, tokens=tokens, planes=True, slots=slots,
                                                   block_n=bn), 2, 'gate_up'
            loop = sass_loop((out / f'{f}.sass').read_text())
            ops = sass_opcodes(loop)
            weights = matrices * r['block_n'] * 128 / (32 * r['num_warps'])
            rows.append(dict(stage=stage, kernel=name, tokens=tokens, block_m=r['block_m'], block_n=r['block_n'],
                             num_warps=r['num_warps'], maxnreg=r.get('maxnreg'), loop_instructions=len(loop),
                             per_weight=round(len(loop) / weights, 3), registers=r['registers'],
                             spills=ops.get('STL', 0) + ops.get('LDL', 0), opcodes=ops))
            if slots: rows[-1]['asm_layouts'] = asm_layouts((out / f'{f}.ttgir').read_text())
    return rows


FP8_PTRS = {'gate/up': dict(x_ptr='*fp8e4nv', xs_ptr='*fp32', w1_ptr='*i32', w1s_ptr='*i32', w3_ptr='*i32',
                            w3s_ptr='*i32', out_ptr='*bf16', weight_ptr='*fp32', sorted_ptr='*i32',
                            block_expert_ptr='*i32'),
            'down': dict(x_ptr='*fp8e4nv', xs_ptr='*fp32', w_ptr='*i32', ws_ptr='*i32', out_ptr='*bf16',
                         sorted_ptr='*i32', block_expert_ptr='*i32')}


def compile_fp8(out: Path, stage: str, block_m: int, block_n: int, num_warps: int, num_stages: int = 3,
                loops: int = 1) -> int:
    ("One of 08g_moe_fp8's kernels (version 5: `stage` 'gate/up' or 'down') for sm_90 at the bench layer, with no "
     "GPU, into OUT/fp8.*; `loops` K loops for gate/up; the registers a thread holds")
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.moe_fp8 import _gate_up_fp8_kernel, _down_fp8_kernel
    cfg, gu, p = ModelConfig.bench(), stage == 'gate/up', FP8_PTRS[stage]
    const = dict(K=cfg.dim if gu else cfg.moe_inter_dim, N=cfg.moe_inter_dim if gu else cfg.dim,
                 TOPK=cfg.n_activated_experts, BM=block_m, BN=block_n, **({'SPLIT': 1} if gu else {}), GROUP_M=8,
                 **({'CLAMP': True} if gu else {}), HW_CVT=True, **({'LOOPS': loops} if gu else {}))
    sig = {**p, 'n_assign': 'i32', 'num_m': 'i32', **({'limit': 'fp32'} if gu else {}),
           **{k: 'constexpr' for k in const}}
    return _sm90(_gate_up_fp8_kernel if gu else _down_fp8_kernel, sig, [*p, 'n_assign'], const, num_warps,
                 num_stages, out, 'fp8')['REG']


def compile_gate_up_fp8(out: Path) -> list[dict]:
    ("08g_moe_fp8's stages (version 5: FP8 products) for sm_90 at the bench layer, with no GPU, beside version 4 at "
     "its launch: the gate/up stage and the routed down stage at a decode batch, a serving batch and a larger one, "
     "version 5 at 16-row blocks and at the regime's (the gate/up stage also at 64 weight rows a program once, and "
     "at 32, which the launch refuses, to show why); the "
     "K loop's SASS instructions per weight, registers, spills, and the scale step's FMUL + FFMA per weight")
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.fused_moe import moe_launch_shape
    from dsv41_nb.moe_fp8 import FP8_BLOCK_N
    from dsv41_nb.moe_planes import asm_layouts
    cfg, rows = ModelConfig.bench(), []
    for stage, tokens in itertools.product(('gate/up', 'down'), (32, 128, 512)):
        gu = stage == 'gate/up'
        r = compile_gate_up(out, tokens=tokens, planes=True, slots=True) if gu else compile_down(out, tokens, True)
        rows.append(_loop_row(out / ('gate_up.sass' if gu else 'down.sass'), stage, 'version 4', tokens, r))
        shape = moe_launch_shape(tokens * cfg.n_activated_experts, cfg.n_routed_experts)
        variants = [(bm, FP8_BLOCK_N.get(bm, shape['block_n'])) for bm in sorted({16, shape['block_m']})]
        if gu and tokens == 32: variants += [(16, 64), (16, 32)]   # 32: below FP8_MIN_BLOCK_N
        for bm, bn in variants:
            regs = compile_fp8(out, stage, bm, bn, shape['num_warps'], shape['num_stages'])
            kernel = 'version 5' if bn >= 64 else f'version 5 at {bn} rows (refused)'
            rows.append(_loop_row(out / 'fp8.sass', stage, kernel, tokens,
                                  dict(block_m=bm, block_n=bn, num_warps=shape['num_warps'], registers=regs)))
            rows[-1]['asm_layouts'] = asm_layouts((out / 'fp8.ttgir').read_text())
    return rows


def _loop_row(sass: Path, stage: str, kernel: str, tokens: int, r: dict) -> dict:
    ("A stage's record row: its K loop's SASS instructions per weight (BN x 128 weights a step and matrix, two "
     "matrices for gate/up), registers, spills")
    loop = sass_loop(sass.read_text())
    ops = sass_opcodes(loop)
    weights = (2 if stage == 'gate/up' else 1) * r['block_n'] * 128 / (32 * r['num_warps'])
    return dict(stage=stage, kernel=kernel, tokens=tokens, block_m=r['block_m'], block_n=r['block_n'],
                num_warps=r['num_warps'],
                maxnreg=r.get('maxnreg'), loop_instructions=len(loop), per_weight=round(len(loop) / weights, 3),
                registers=r['registers'], spills=ops.get('STL', 0) + ops.get('LDL', 0),
                scale_ops=round((ops.get('FMUL', 0) + ops.get('FFMA', 0)) / weights, 3), opcodes=ops)


def _sm90(fn, sig: dict, aligned: list, const: dict, num_warps: int, num_stages: int, out: Path, name: str,
          maxnreg: int | None = None):
    ("Compile `fn` for sm_90 with no GPU; write OUT/NAME.ttgir, .ptx, .cubin and .sass; its resources "
     "(`res_usage`: REG, the registers a thread holds, and the rest)")
    import subprocess
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # as a launch specialises them: 16-byte aligned pointers (and a row count divisible by 16)
    attrs = {(fn.arg_names.index(n),): [['tt.divisibility', 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    k = triton.compile(src, target=GPUTarget('cuda', 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages,
                                    **({'maxnreg': maxnreg} if maxnreg else {})))
    out.mkdir(parents=True, exist_ok=True)
    (out / f'{name}.ptx').write_text(k.asm['ptx']); (out / f'{name}.cubin').write_bytes(k.asm['cubin'])
    (out / f'{name}.ttgir').write_text(k.asm['ttgir'])
    tool = Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'cuobjdump'
    run = lambda *a: subprocess.run([str(tool), *a, str(out / f'{name}.cubin')], capture_output=True, text=True,
                                    check=True).stdout
    (out / f'{name}.sass').write_text(run('-sass'))
    return res_usage(out / f'{name}.cubin')


def compile_gemv(out: Path) -> list[dict]:
    ("The decode GEMV (08e_moe_gemv) of the bench layer's gate/up and down stages for sm_90, with no GPU, reading "
     "the routed weights as codes and through each reading of the planes (08f_moe_planes_served): "
     "the routed loop's SASS instructions and the registers a thread holds, one row each")
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.moe_gemv import _moe_gemv_kernel, GEMV_TUNING, _fp4_sums, _x_halves
    from dsv41_nb.moe_planes_served import PLANE_READ, PLANE_READ_ONCE, PLANE_READ_PAIRS
    cfg, fn, rows = ModelConfig.bench(), _moe_gemv_kernel, []
    readings = dict(codes=None, planes_x4=PLANE_READ, planes_once=PLANE_READ_ONCE, planes_pairs=PLANE_READ_PAIRS)
    for stage, K, N, gate_up in (('gate_up', cfg.dim, cfg.moe_inter_dim, True),
                                 ('down', cfg.moe_inter_dim, cfg.dim, False)):
        t = GEMV_TUNING[stage]
        for name, read in readings.items():
            w = '*i32' if read else '*u8'
            ptrs = dict(x_ptr='*bf16', ids_ptr='*i32', ra_ptr=w, ras_ptr='*u8', rb_ptr=w, rbs_ptr='*u8',
                        sa_ptr='*fp8e4nv', sas_ptr='*fp32', sb_ptr='*fp8e4nv', sbs_ptr='*fp32', part_ptr='*fp32')
            const = dict(K=K, N=N, TOPK=cfg.n_activated_experts, BN=t['block_n'], BK=math.gcd(K, t['block_k']),
                         SPLIT=1, PAIR=gate_up, PER_TOKEN=gate_up, QUANT=gate_up, HW_CVT=True, PDL=False,
                         X_PAIR=(read or {}).get('X_PAIR', _x_halves),
                         FP4_SUMS=(read or {}).get('FP4_SUMS', _fp4_sums))
            sig = {**ptrs, 'n_assign': 'i32', 'R': 'i32', **{k: 'constexpr' for k in const}}
            regs = _sm90(fn, sig, list(ptrs), const, t['num_warps'], 3, out, f'gemv_{stage}_{name}')['REG']
            loop = sass_loop((out / f'gemv_{stage}_{name}.sass').read_text())   # the routed loop: the longest
            rows.append(dict(stage=stage, reading=name, loop_instructions=len(loop), registers=regs))
    return rows


def compile_fp8_linear(out: Path, fn=None, extra: dict | None = None) -> list[dict]:
    ("The MMA kernels of the FP8 projections (09a_fp8_linear) for sm_90 with no GPU on the bench layer's `wq_b`, one "
     "slice: version 1 (`fn`, a kernel of an earlier commit, with `extra` constexprs, if given) at each row of "
     "FP8_LINEAR_TUNING, then (unless `fn` is given) version 2 at each row of FP8_LINEAR_WT_TUNING; the K loop's "
     "SASS instructions, the registers a thread holds, and warp instructions a weight")
    import triton.language as tl
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.fp8_linear import _fp8_linear_kernel, FP8_LINEAR_TUNING, FP8_LINEAR_WT_TUNING
    cfg, rows = ModelConfig.bench(), []
    N, K = cfg.n_heads * cfg.head_dim, cfg.q_lora_rank
    ptrs = dict(x_ptr='*bf16', w_ptr='*u8', s_ptr='*u8', y_ptr='*bf16', part_ptr='*fp32')
    ints = dict(stride_xt='i32', stride_xg='i32', stride_yt='i32', stride_yg='i32', T='i32', G='i32')
    v1 = dict(BN=32, W_LEFT=False) if fn is None else {}
    launches = [(1, fn or _fp8_linear_kernel, tokens, t, dict(BM=t['block_m'], **v1, **(extra or {})), 32)
                for tokens, t in FP8_LINEAR_TUNING.items()]
    if fn is None:
        launches += [(2, _fp8_linear_kernel, tokens, t, dict(BM=t['block_t'], BN=t['block_n'], W_LEFT=True),
                      t['block_n']) for tokens, t in FP8_LINEAR_WT_TUNING.items()]
    for version, kernel, tokens, t, tile, weight_rows in launches:
        bk = math.gcd(K, t['block_k'])
        const = dict(K=K, N=N, SPLIT=1, STEPS=K // bk, BK=bk, HW_CVT=True, DOT=tl.bfloat16, **tile)
        sig = {n: ptrs.get(n) or ints.get(n) or 'constexpr' for n in kernel.arg_names}
        name = f'fp8_linear_v{version}_{tokens}'
        regs = _sm90(kernel, sig, list(ptrs), const, t['num_warps'], t['num_stages'], out, name)['REG']
        sass = (out / f'{name}.sass').read_text()
        # Hopper's MMA (its left operand a register or a shared-memory descriptor), or Ampere's (registers)
        loop, mma = sass_loop(sass), re.search(r'(HGMMA|HMMA)\.(\w+)\S* R\d+, (\w+)', sass)
        rows.append(dict(stage='wq_b', kernel=f'version {version}', tokens=tokens, version=version,
                         mma=mma and f'{mma.group(1)}.{mma.group(2)}',
                         left_in_registers=bool(mma and mma.group(3).startswith('R')),
                         tile={k: v for k, v in t.items() if k.startswith('block')} | dict(block_k=bk),
                         num_warps=t['num_warps'], loop_instructions=len(loop), registers=regs,
                         per_weight=len(loop) * t['num_warps'] / (weight_rows * bk)))
    return rows


NCU_SECTIONS = ('SpeedOfLight', 'Occupancy', 'LaunchStats', 'SchedulerStats', 'WarpStateStats',
                'MemoryWorkloadAnalysis', 'ComputeWorkloadAnalysis')
# why warps wait: ncu's per-reason stall counts, warps per issued instruction (the WarpStateStats section's breakdown)
NCU_STALLS = ('long_scoreboard', 'short_scoreboard', 'mio_throttle', 'lg_throttle', 'barrier', 'math_pipe_throttle',
              'wait', 'not_selected', 'selected', 'dispatch_stall', 'no_instruction', 'branch_resolving', 'membar',
              'drain', 'imc_miss', 'tex_throttle', 'sleeping')
NCU_METRICS = (['dram__bytes_read.sum', 'dram__bytes_write.sum']
               + [f'smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio' for r in NCU_STALLS])


def ncu_command(ncu: str, kernels: str, child: list) -> list:
    """The `ncu` command line that profiles every launch of the kernels matching the regex `kernels` between the
    child's `cudaProfilerStart` and `cudaProfilerStop` (so warm-up launches and compilation are left out), every
    figure in its base unit (nanoseconds, bytes)"""
    return ([ncu, '--clock-control', 'none', '--profile-from-start', 'off', '--print-units', 'base',
             '--kernel-name', f'regex:{kernels}']
            + [a for s in NCU_SECTIONS for a in ('--section', s)] + ['--metrics', ','.join(NCU_METRICS)] + child)


def ncu_reports(text: str) -> list[dict]:
    """One `ncu_metrics` dict per profiled launch of a text report, with the kernel's name under 'kernel' (a report
    starts each launch with a line `  name(...) (grid) x (block), Context 1, Stream 7, Device 0, CC 9.0`)"""
    heads = [m for m in re.finditer(r'^  (\w+)\(?.*?, Context \d+, Stream \d+.*$', text, re.M)]
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return [dict(ncu_metrics(text[m.end():e]), kernel=m.group(1)) for m, e in zip(heads, ends)]


def stall_reasons(m: dict, top: int = 3) -> list[tuple]:
    "The `top` largest stall reasons of one launch's metrics: (reason, warps waiting per issued instruction)"
    got = [(r, m.get(f'smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio')) for r in NCU_STALLS]
    return sorted([(r, v) for r, v in got if v], key=lambda rv: -rv[1])[:top]


def ncu_metrics(text: str) -> dict:
    "Numeric metrics of an `ncu` text report: name -> value ('1,234.5' read as 1234.5; a repeated name gets its unit)"
    out = {}
    for l in text.split('\n'):
        m = re.match(r'^\s{4}(\S.*?)\s{2,}(?:(\S+)\s+)?([\d,]+(?:\.\d+)?)\s*$', l)
        if m and not l.strip().startswith(('OPT', 'INF', 'WRN', '---')):
            name = m.group(1).strip()
            if name in out and m.group(2): name = f'{name} ({m.group(2)})'   # e.g. Memory Throughput: % and TB/s
            out[name] = float(m.group(3).replace(',', ''))
    return out


def compile_index(out: Path) -> list[dict]:
    ("The full-scan index logits kernel (04b_indexer_kernels) for sm_90 at the bench geometry (32 heads x 128, "
     "MXFP4 keys, the ratio-1 source's pages), with no GPU, through each version of the key decoding and at FP8 "
     "keys: the tile loop's SASS instructions and opcodes, and the registers a thread holds, one row each")
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.indexer_kernels import _index_logits_kernel, LOGITS_TUNING
    from dsv41_nb.record_codecs import cache_format
    cfg, t, rows = ModelConfig.bench(), LOGITS_TUNING, []
    ptrs = dict(q_ptr='*bf16', w_ptr='*fp32', cache_ptr='*u8', bt_ptr='*i32', row_ptr='*i32', pos_ptr='*i32',
                aux_ptr='*fp32', out_ptr='*fp32')
    for name, fmt, version in (('version 1', 'index_mxfp4', 1), ('version 2', 'index_mxfp4', 2),
                               ('version 3', 'index_mxfp4', 3), ('fp8 keys', 'index_fp8', 2),
                               ('fp8 keys, version 3', 'index_fp8', 3)):
        codec = cache_format(cfg, fmt)
        const = dict(H=cfg.index_n_heads, H_P2=cfg.index_n_heads, DH=cfg.index_head_dim, RATIO=1, PER=128,
                     FP4=fmt == 'index_mxfp4', REC=codec.record_bytes, BLOCK_T=t['block_t'], TILES=t['tiles'],
                     BF16_DOT=True, MODE=0, CBS=cfg.candidate_block_size, VERSION=version)
        sig = {n: 'constexpr' if n in const else ptrs.get(n, 'i32') for n in _index_logits_kernel.arg_names}
        tag = f"index_{name.replace(' ', '_')}"
        regs = _sm90(_index_logits_kernel, sig, list(ptrs), const, t['num_warps'], 3, out, tag)['REG']
        loop = sass_loop((out / f'{tag}.sass').read_text())
        rows.append(dict(kernel=name, format=fmt, loop_instructions=len(loop), registers=regs,
                         block_t=t['block_t'], num_warps=t['num_warps'], opcodes=sass_opcodes(loop)))
    return rows


def compile_sparse_decode(out: Path) -> list[dict]:
    ("The sparse MLA decode kernel (06_sparse_decode) for sm_90 at the bench geometry (64 heads, 128 `window_fp8` + "
     "512 `ds_fp4` records) in DECODE_TUNING's shape for a large batch, with no GPU: each pass's tile loop (SASS "
     "instructions and opcodes) and the registers a thread holds. The window pass widens each E4M3 value through "
     "FP16 (one HADD2 a value), the top-k pass decodes FP4 with shifts: the loop with more HADD2 is the window's")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sweep_sparse_decode import POINTERS, ALIGNED
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.record_codecs import cache_format
    from dsv41_nb import sparse_decode as sd
    cfg = ModelConfig.bench()
    L = sd.decode_launch(256, cfg.n_heads, cfg.window_size, cfg.index_topk, 'cpu', 1)
    const = dict(D=cfg.head_dim, BLOCK_H=L['BLOCK_H'], BLOCK_N=L['BLOCK_N'], ONE_SPLIT=True,
                 SCALE_TILE=L['SCALE_TILE'], HW_CVT=True, F32_DOT=False,
                 **sd._format_meta(cache_format(cfg, 'window_fp8'), cfg.head_dim, 'W'),
                 **sd._format_meta(cache_format(cfg, 'ds_fp4'), cfg.head_dim, 'C'))
    if L['PREFETCH']: fn = sd._sparse_decode_prefetch if L['SEPARATE'] else sd._one_function_prefetch
    else: fn = sd._sparse_decode_separate if L['SEPARATE'] else sd._sparse_decode_kernel
    sig = {n: 'constexpr' if n in const else POINTERS.get(n, 'i32') for n in fn.arg_names}
    if L['PREFETCH']: sig['c_half'] = '*i32'        # the DS-FP4 codes read as words
    aligned = [n for n in fn.arg_names if sig[n].startswith('*') or n in ALIGNED]
    regs = _sm90(fn, sig, aligned, const, L['num_warps'], L['num_stages'], out, 'sparse_decode')['REG']
    loops = sass_loops((out / 'sparse_decode.sass').read_text())[:2]
    ops = [sass_opcodes(l) for l in loops]
    window = max(range(2), key=lambda i: ops[i].get('HADD2', 0))
    return [dict(kernel=name, loop_instructions=len(loops[i]), registers=regs, block_h=L['BLOCK_H'],
                 block_n=L['BLOCK_N'], num_warps=L['num_warps'], opcodes=ops[i])
            for name, i in (('window pass (FP8)', window), ('top-k pass (FP4)', 1 - window))]


# (tokens a program, columns a tile, warps, registers a thread allowed: None for the compiler's choice)
MHC_SHAPES = ((64, 16, 4, None), (64, 16, 8, None), (64, 32, 4, None), (64, 32, 8, None), (32, 16, 4, None),
              (32, 32, 4, None), (16, 32, 4, None), (64, 16, 4, 128), (32, 16, 4, 128),
              # version 3 (the new copies one at a time): the same kernel with STREAM on
              (64, 16, 4, None, 3), (64, 16, 8, None, 3), (32, 16, 4, None, 3), (16, 16, 4, None, 3),
              (16, 32, 4, None, 3), (2, 32, 1, None, 3), (2, 32, 1, None))


def res_usage(cubin: Path) -> dict:
    "A compiled kernel's resources as `cuobjdump -res-usage` prints them: REG, STACK, SHARED, LOCAL (bytes)"
    import subprocess, triton
    tool = Path(triton.__file__).parent / 'backends' / 'nvidia' / 'bin' / 'cuobjdump'
    text = subprocess.run([str(tool), '-res-usage', str(cubin)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r'\b(REG|STACK|SHARED|LOCAL):(\d+)', text)}


def programs_per_sm(registers: int, warps: int) -> int:
    """Programs of `warps` warps an sm_90 SM keeps by its 65,536 registers (a warp's allocated in units of 256),
    its 64 warps and 32 programs"""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 64 // warps, 32)


def compile_mhc_seam(out: Path, shapes=MHC_SHAPES) -> list[dict]:
    ("Versions 2 and 3 of the mHC seam kernel (07a_mhc_kernel) for sm_90 at the bench width (dim 5120, four copies, "
     "the update, prediction, input mix and FP8 all on), with no GPU, at each launch shape (tokens a program, columns "
     "a tile, warps, a register cap, the version: 2 unless a fifth item says 3): the registers a thread holds and the "
     "programs, and warps, an SM keeps by them")
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.mhc_kernel import _mhc_seam2_kernel as fn, MHC_TUNING
    cfg, rows = ModelConfig.bench(), []
    kinds = dict(x_ptr='*bf16', f_ptr='*bf16', xo_ptr='*bf16', w_ptr='*bf16', y_ptr='*bf16', q_ptr='*u8',
                 qs_ptr='*u8', T='i32', norm_eps='fp32', hc_eps='fp32', inv_max='fp32', SPLIT='i32', CHUNKS='i32')
    for bt, bd, w, cap, *v in shapes:
        v = v[0] if v else 2
        const = dict(D=cfg.dim, ITERS=cfg.hc_sinkhorn_iters, BLOCK_T=bt, BLOCK_D=bd, PROJ=2 if bt >= 16 else 0,
                     PDL=False, NORM_D=MHC_TUNING['norm_block_d'], HAS_PREV=True, PREDICT=True, MIX=True, FP8=True,
                     BF16=True, HW_CVT=True, STREAM=v == 3)
        sig = {n: 'constexpr' if n in const else kinds.get(n, '*fp32') for n in fn.arg_names}
        aligned = [n for n in fn.arg_names if sig[n].startswith('*')]
        name = f'mhc_seam_{bt}x{bd}_{w}w' + (f'_{cap}r' if cap else '') + ('_v3' if v == 3 else '')
        use = _sm90(fn, sig, aligned, const, w, 3, out, name, maxnreg=cap)
        regs = use['REG']
        p = programs_per_sm(regs, w)
        what = (f'version {v}, {bt} tokens x {bd} columns, {w} warps'
                + (f', at most {cap} registers' if cap else ''))
        rows.append(dict(kernel=what, version=v, block_t=bt, block_d=bd, num_warps=w, maxnreg=cap, registers=regs,
                         programs_per_sm=p, warps_per_sm=p * w, spill_bytes=use.get('STACK', 0) + use.get('LOCAL', 0),
                         current=(v, bt, bd, w, cap) == (MHC_TUNING['kernel'], MHC_TUNING['big_block_t'],
                                                         MHC_TUNING['big_block_d'], MHC_TUNING['big_warps'], None)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--ptx')
    ap.add_argument('--sass')
    ap.add_argument('--compile-gate-up', metavar='OUT_DIR')
    ap.add_argument('--prefetch', action='store_true', help='with --compile-gate-up: the scales a step ahead')
    ap.add_argument('--planes', action='store_true', help='with --compile-gate-up: version 3 (08f_moe_planes)')
    ap.add_argument('--compile-gate-up-versions', metavar='OUT_DIR')
    ap.add_argument('--compile-gemv', metavar='OUT_DIR')
    ap.add_argument('--compile-gate-up-fp8', metavar='OUT_DIR')
    ap.add_argument('--compile-index', metavar='OUT_DIR')
    ap.add_argument('--compile-sparse-decode', metavar='OUT_DIR')
    ap.add_argument('--compile-fp8-linear', metavar='OUT_DIR')
    ap.add_argument('--compile-mhc-seam', metavar='OUT_DIR')
    ap.add_argument('--ncu')
    ap.add_argument('--json')
    ap.add_argument('--machine')
    ap.add_argument('--commit')
    ap.add_argument('--launch', help='a JSON object describing the launch')
    ap.add_argument('--quick', action='store_true', help='check the script on a PTX and a report it writes')
    args = ap.parse_args(argv)
    if args.quick:
        d = Path(tempfile.mkdtemp())
        (d / 'k.ptx').write_text('$L__BB0_1:\n\tld.shared.b8 %r1, [%r2];\n\tprmt.b32 %r3, %r1, 0, 0;\n'
                                 '\tprmt.b32 %r4, %r1, 0, 1;\n\t@%p1 bra \t$L__BB0_1;\n\tret;\n')
        (d / 'n.txt').write_text('    Duration                         us       684.16\n'
                                 '    Registers Per Thread             register/thread             218\n')
        args.ptx, args.ncu, args.json = str(d / 'k.ptx'), str(d / 'n.txt'), str(d / 'out.json')
    compilers = dict(index=compile_index, gemv=compile_gemv, sparse_decode=compile_sparse_decode,
                     gate_up_versions=compile_gate_up_versions, gate_up_fp8=compile_gate_up_fp8,
                     fp8_linear=compile_fp8_linear, mhc_seam=compile_mhc_seam)
    which = next((k for k in compilers if getattr(args, f'compile_{k}')), None)
    if which:
        if not args.json: ap.error(f"--compile-{which.replace('_', '-')} needs --json")
        rows = compilers[which](Path(getattr(args, f'compile_{which}')))
        import triton
        rec = dict(machine=args.machine or 'compiled for sm_90, no GPU', commit=args.commit or git_commit(),
                   date=str(datetime.date.today()), config='bench', triton=triton.__version__, rows=rows)
        Path(args.json).write_text(json.dumps(rec, indent=1))
        for r in rows:
            name = (f"{r['stage']} {r['kernel']}, {r['tokens']}" if 'tokens' in r else r['kernel'] if 'kernel' in r
                    else f"{r['stage']:8s} {r['reading']}")
            loop = f"{r['loop_instructions']:5d} instructions, " if 'loop_instructions' in r else ''
            print(f"{name:22s} {loop}{r['registers']} registers")
        return
    if args.compile_gate_up:
        d = Path(args.compile_gate_up)
        launch = compile_gate_up(d, args.prefetch, planes=args.planes)
        print(f"wrote gate_up.ptx, .cubin and .sass to {d} ({json.dumps(launch)})")
        if not args.json: return
        args.ptx, args.sass, args.launch = str(d / 'gate_up.ptx'), str(d / 'gate_up.sass'), json.dumps(launch)
        args.machine = args.machine or 'compiled for sm_90, no GPU'
    elif args.prefetch or args.planes: ap.error('--prefetch and --planes go with --compile-gate-up')
    if not args.ptx or not args.json: ap.error('--ptx and --json are required (or --quick, --compile-gate-up)')
    try: launch = json.loads(args.launch) if args.launch else None
    except json.JSONDecodeError as e: ap.error(f'--launch: not JSON ({e})')
    try:
        body = loop_body(Path(args.ptx).read_text())
        sass = sass_opcodes(sass_loop(Path(args.sass).read_text())) if args.sass else None
        ncu = ncu_metrics(Path(args.ncu).read_text()) if args.ncu else None
    except (OSError, ValueError) as e: ap.error(str(e))
    ops = opcode_counts(body)
    regs = (launch or {}).get('registers') or (ncu or {}).get('Registers Per Thread')
    rec = dict(machine=args.machine, commit=args.commit or git_commit(), date=str(datetime.date.today()),
               launch=launch, registers=None if regs is None else int(regs),
               loop_instructions=sum(ops.values()), loop_opcodes=ops,
               sass_loop_instructions=sum(sass.values()) if sass else None, sass_loop_opcodes=sass, ncu=ncu)
    Path(args.json).write_text(json.dumps(rec, indent=1))
    top = ', '.join(f'{k} {v}' for k, v in list(ops.items())[:6])
    print(f"loop body: {rec['loop_instructions']} instructions per thread and step ({top}, ...)")
    if sass:
        print(f"SASS loop: {sum(sass.values())} instructions "
              f"({', '.join(f'{k} {v}' for k, v in list(sass.items())[:6])}, ...)")
    if ncu: print(f"ncu: {len(ncu)} metrics, e.g. Duration {ncu.get('Duration')}")
    print('wrote', args.json)


if __name__ == '__main__':
    main()
