"""What holds version 5 of the MoE's gate/up stage (FP8 products, 08g) behind version 4 (08f's slots) on one GPU.

    python tools/moe_fp8_limits.py --run {4,5} [--tokens 128]     the stage in fused_moe_experts, three calls (for ncu)
    python tools/moe_fp8_limits.py --registers --json OUT.json      version 5 with its registers capped, timed
    python tools/moe_fp8_limits.py --ncu V4.txt V5.txt --json OUT.json   two `ncu` reports into the record
    python tools/moe_fp8_limits.py --compile OUT_DIR --json OUT.json  version 5 compiled for sm_90, with no GPU
    python tools/moe_fp8_limits.py --quick                          the GPU modes on a small layer on the CPU

On the bench layer (random weights, 128 tokens routed unless --tokens says otherwise). `--ncu` reads the last report of
each file (the third call) with kernel_mix's reader, stall reasons included when ncu was asked for them:
    ncu --clock-control none -k regex:_gate_up_planes --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio' \\
        python3 tools/moe_fp8_limits.py --run 4 > v4.txt           (and -k regex:_gate_up_fp8 ... --run 5 > v5.txt)
`--registers` times version 4 and version 5 as compiled, then with `maxnreg` 168 and 128 (the registers a thread may
hold: fewer let more programs share a multiprocessor, at the cost of spills), with 8 warps a program (the same tile
over twice the threads) and in two K loops (the gate's, then the up's: `loops=2`), each checked against the reference
(`check_fused_moe`, with the FP8 MMA's kept bits) before it is timed, and records each launch's registers and spills.
`--compile` needs Triton's compiler for sm_90 (the GPU's Triton version gives the GPU's code); it merges its table
into an existing record.
"""
import argparse, datetime, json, os, re, sys
if '--quick' in sys.argv: os.environ.setdefault('TRITON_INTERPRET', '1')   # before Triton is imported
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
import torch, triton
sys.path.insert(0, str(Path(__file__).parent))
from kernel_mix import ncu_metrics
from bench_engine import git_commit
from dsv41_nb.config import ModelConfig
from dsv41_nb.moe import MoEWeights, route
from dsv41_nb.fused_moe import fused_moe_experts, moe_launch_shape, check_fused_moe, _fused_stages
from dsv41_nb.moe_planes import plane_gate_up
from dsv41_nb import moe_fp8
from dsv41_nb.moe_fp8 import fp8_gate_up, FP8_MMA_BITS
from dsv41_nb.dispatch import median_time, machine_name, triton_interpreting

CAPS = (None, 168, 128)   # maxnreg: as compiled, then capped


def layer(quick: bool):
    "(config, device): the bench layer on the GPU, a small one (dim 256) on the CPU"
    if quick: return replace(ModelConfig.tiny(), dim=256, moe_inter_dim=256), 'cpu'
    return ModelConfig.bench(), 'cuda'


def routed(cfg, W, T: int, dev):
    torch.manual_seed(T)
    x = (3 * torch.randn(T, cfg.dim, device=dev)).to(torch.bfloat16)
    tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
    return x, tw, ti


def run(cfg, W, dev, version: str, T: int):
    "The stage of `version` in fused_moe_experts, three calls"
    x, tw, ti = routed(cfg, W, T, dev)
    gu = plane_gate_up(W, slots=True) if version == '4' else fp8_gate_up(W)
    sh = moe_launch_shape(ti.numel(), W.n_experts)
    for _ in range(3): fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, sh, check_ids=False, gate_up=gu, down=None)
    if dev == 'cuda': torch.cuda.synchronize()
    print(f"version {version}, {T} tokens, launch {sh}", flush=True)


class Capped:
    "`_gate_up_fp8_kernel` launched with maxnreg (None: as compiled); the compiled kernels' registers and spills"
    def __init__(self, kernel, cap): self.kernel, self.cap, self.seen = kernel, cap, None
    def __getitem__(self, grid):
        def launch(*a, **k):
            if self.cap and not triton_interpreting(): k['maxnreg'] = self.cap
            c = self.kernel[grid](*a, **k)
            self.seen = dict(registers=getattr(c, 'n_regs', None), spills=getattr(c, 'n_spills', None))
            return c
        return launch


def registers(cfg, W, dev, tokens) -> list[dict]:
    "Versions 4 and 5 at each size and row block, version 5 at each cap; each checked, then timed"
    v4, rows = plane_gate_up(W, slots=True), []
    orig, table = moe_fp8._gate_up_fp8_kernel, moe_fp8.FP8_BLOCK_N
    for T in tokens:
        x, tw, ti = routed(cfg, W, T, dev)
        sh = moe_launch_shape(ti.numel(), W.n_experts)
        for bm in sorted({sh['block_m'], 16}):
            s = dict(sh, block_m=bm)
            call = lambda gu: fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, s, check_ids=False, gate_up=gu,
                                                down=None)
            row = dict(tokens=T, block_m=bm, version_4_ms=median_time(lambda: call(v4)) * 1e3, version_5=[])
            # (maxnreg, warps, weight rows by row block): as launched, capped, at 8 warps, and at 16-row blocks
            # with the launch shape's weight rows instead of FP8_BLOCK_N's
            # and in two K loops (gate, then up) at 4 and 8 warps
            runs = [(c, s['num_warps'], table, 1) for c in CAPS] + [(None, 8, table, 1)]
            if bm == 16: runs += [(None, 4, {}, 1), (None, 8, {}, 1)]
            runs += [(None, 4, table, 2), (None, 8, table, 2)]
            try:
                for cap, warps, rows_by_bm, loops in runs:
                    k, s, gu = Capped(orig, cap), dict(s, num_warps=warps), fp8_gate_up(W, loops=loops)
                    moe_fp8._gate_up_fp8_kernel, moe_fp8.FP8_BLOCK_N = k, rows_by_bm
                    bn = moe_fp8._fp8_shape(s, SimpleNamespace(block_m=bm))['block_n']   # before narrowing
                    check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, s, mma_bits=FP8_MMA_BITS,
                                    stages=partial(_fused_stages, gate_up=gu, down=None))
                    row['version_5'].append(dict(maxnreg=cap, num_warps=warps, block_n=bn, loops=loops,
                                                 ms=median_time(lambda: call(gu)) * 1e3, **k.seen))
            finally: moe_fp8._gate_up_fp8_kernel, moe_fp8.FP8_BLOCK_N = orig, table
            rows.append(row)
            print(f"{T:4d} tokens, {bm:3d} rows: version 4 {row['version_4_ms']:.3f} ms; version 5 " + ', '.join(
                f"maxnreg {r['maxnreg']}, {r['block_n']} weight rows, {r['num_warps']} warps, {r['loops']} loop(s): "
                f"{r['ms']:.3f} ms "
                f"({r['registers']} registers, "
                f"{r['spills']} spills)"
                for r in row['version_5']), flush=True)
    return rows


LAUNCHES = [(bm, bn, w, loops) for bm, bn in ((16, 64), (16, 128), (32, 64), (32, 128), (64, 64))
            for loops in (1, 2) for w in (4, 8)]
REGISTERS_PER_SM, MAX_WARPS_PER_SM = 65536, 64     # Hopper's register file and warp slots a multiprocessor


def programs_by_registers(registers: int, warps: int) -> int:
    "Programs of `warps` warps a Hopper multiprocessor can hold by their registers (allocated 8 a thread at a time)"
    per = -(-registers // 8) * 8 * 32 * warps
    return min(REGISTERS_PER_SM // per, MAX_WARPS_PER_SM // warps)


def compile_launches(out: Path) -> list[dict]:
    """Version 5's gate/up kernel compiled for sm_90 with no GPU (`kernel_mix`'s way: Triton's compiler, ptxas,
    cuobjdump) at the bench layer, for each row block, weight rows, warps and K loops of `LAUNCHES`: registers, spill
    instructions and instructions in the K loop, the programs and warps a multiprocessor holds by registers, and
    whether every inline move compiled in the layout the launch accepts (`FP8_MOVE_LAYOUT`)"""
    from kernel_mix import compile_fp8, _loop_row
    from dsv41_nb.moe_planes import asm_layouts
    rows = []
    for bm, bn, warps, loops in LAUNCHES:
        regs = compile_fp8(out, 'gate/up', bm, bn, warps, loops=loops)
        loop = _loop_row(out / 'fp8.sass', 'gate/up', 'version 5', None,
                         dict(block_m=bm, block_n=bn, num_warps=warps, registers=regs))
        progs = programs_by_registers(regs, warps)
        layouts = asm_layouts((out / 'fp8.ttgir').read_text())
        rows.append(dict(block_m=bm, block_n=bn, num_warps=warps, loops=loops, registers=regs,
                         move_layout_ok=bool(layouts) and all(moe_fp8.FP8_MOVE_LAYOUT.fullmatch(l) for l in layouts),
                         spill_instructions=loop['spills'], loop_instructions=loop['loop_instructions'],
                         programs=progs, warps_per_sm=progs * warps))
        print(f"{bm:3d} rows x {bn:3d} weight rows, {warps} warps, {loops} loop(s): {regs} registers, "
              f"{rows[-1]['spill_instructions']} spill instructions in the loop, {progs} programs "
              f"({progs * warps} warps) a multiprocessor", flush=True)
    return rows


def last_report(text: str) -> dict:
    "The metrics of the last kernel report in an ncu text output, with the kernel's name"
    lines = text.split('\n')
    heads = [i for i, l in enumerate(lines) if re.match(r'^  \w+_kernel \(', l)]
    if not heads: raise ValueError("no kernel report found in the ncu output")
    i = heads[-1]
    return dict(kernel=lines[i].split()[0], **ncu_metrics('\n'.join(lines[i + 1:])))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--run', choices=('4', '5'))
    ap.add_argument('--tokens', type=int, default=128)
    ap.add_argument('--registers', action='store_true')
    ap.add_argument('--ncu', nargs=2, metavar=('V4', 'V5'))
    ap.add_argument('--compile', metavar='OUT_DIR', help="compile version 5's launches for sm_90 with no GPU")
    ap.add_argument('--json')
    ap.add_argument('--quick', action='store_true', help='a small layer on the CPU: a check of the script')
    args = ap.parse_args()
    if args.compile:
        res = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
        res.update(compiled=dict(date=f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC',
                                 commit=os.environ.get('DSV41_COMMIT') or git_commit(), triton=triton.__version__,
                                 target='sm_90', launches=compile_launches(Path(args.compile))))
        if args.json: Path(args.json).write_text(json.dumps(res, indent=1) + '\n'); print('wrote', args.json)
        return
    cfg, dev = layer(args.quick)
    needs_layer = args.run or args.registers or args.quick         # --ncu alone reads reports: any machine
    if needs_layer and dev == 'cuda' and not torch.cuda.is_available():
        sys.exit('this needs a GPU (--quick checks it on a CPU)')
    W = MoEWeights.random(cfg, 0, dev) if needs_layer else None
    if args.run: return run(cfg, W, dev, args.run, args.tokens)
    res = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    res.update(machine=machine_name(dev) if needs_layer or torch.cuda.is_available() else res.get('machine'),
               date=f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC',
               commit=os.environ.get('DSV41_COMMIT') or git_commit(), torch=torch.__version__,
               triton=triton.__version__, config='small check' if args.quick else 'bench')
    if args.registers or args.quick:
        res['registers'] = registers(cfg, W, dev, (8,) if args.quick else (32, 128, 512))
    if args.ncu:
        res['ncu'] = {v: last_report(Path(p).read_text()) for v, p in zip(('version 4', 'version 5'), args.ncu)}
        res['ncu_tokens'] = args.tokens
    if args.quick: run(cfg, W, dev, '5', 8)
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1) + '\n'); print('wrote', args.json)


if __name__ == '__main__':
    main()
