#!/usr/bin/env python
"""Time the hyper-connection seams of 07_mhc as 07b_mhc_speed does: the eager PyTorch reference \
against the fused Triton kernels, each launched
op by op and replayed from a CUDA graph, per block (two seams), with kernel launches per block and the byte floor.

    python tools/bench_mhc.py [--config bench] [--tokens 1 64 1024 8192] [--layers 8] [--version 2] [--json out.json]
                              [--sweep] [--quick] [--ncu PROFILE.json] [--maxnreg 128 168]

--version picks the seam kernel (07a_mhc_kernel's `SEAM_VERSIONS`; the default is the current one, 2).
--sweep first times one fused seam over launch shapes (tokens per program x columns per tile x warps, set on the launch
table's range that each token count falls in) and prints the best.
tools/bench_layer_kernels.py times one seam on both versions side by side.
--ncu PATH runs Nsight Compute on one full seam at each --tokens count (every kernel it launches, after a warm-up
call) and writes, per launch, the report's figures, DRAM bytes read and written against the seam's byte floor, and
the reasons its warps wait, to PATH.
--maxnreg N [N ...] times one seam at each --tokens count from a CUDA graph at the launch table's shape as the
compiler allocates it (the table's own cap, MHC_TUNING['big_maxnreg'], off), then with its registers capped at each N
(Triton's `maxnreg` launch option: more programs an SM, values spilled), after checking that a capped launch gives
the same bits; with --json, its rows are the record.
--quick runs the tiny config on two small batches on whatever is there (the Triton interpreter on a CPU), to check the
script itself; its times mean nothing."""
import argparse, datetime, json, math, os, shutil, subprocess, sys
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument('--config', default='bench', help='ModelConfig preset (full, bench, tiny)')
ap.add_argument('--tokens', type=int, nargs='+', default=[1, 64, 1024, 8192])
ap.add_argument('--layers', type=int, default=8, help='blocks in the timed stack')
ap.add_argument('--version', type=int, default=2, help='seam kernel version (07a_mhc_kernel SEAM_VERSIONS)')
ap.add_argument('--json', help='write the rows here')
ap.add_argument('--sweep', action='store_true')
ap.add_argument('--quick', action='store_true')
ap.add_argument('--ncu', metavar='PATH', help='Nsight Compute on one seam per token count; the record to PATH')
ap.add_argument('--ncu-child', type=int, metavar='T', help=argparse.SUPPRESS)
ap.add_argument('--maxnreg', type=int, nargs='+', metavar='N', help='registers a thread allowed, compared')
args = ap.parse_args()

import torch
if not torch.cuda.is_available():
    if not args.quick:
        raise SystemExit('this benchmark needs a GPU (or --quick, which runs the Triton interpreter on a CPU)')
    os.environ.setdefault('TRITON_INTERPRET', '1')                 # before the kernels are defined
import triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import median_time, use_kernels, machine_name, copy_bandwidth
from dsv41_nb.launches import cuda_graph
from dsv41_nb import mhc_kernel
from dsv41_nb.mhc import mhc_seam, random_hc_layer, sinkhorn
from dsv41_nb.mhc_kernel import MHC_TUNING, seam_version, _big
from dsv41_nb.mhc_speed import benchmark_hc_layers, format_hc_benchmark, seam_floor
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_mix import ncu_command, ncu_reports, stall_reasons  # noqa: E402  (an ncu report, read)
from bench_engine import git_commit                              # noqa: E402

def one_seam(cfg, T, device):
    "A full seam (update, prediction, mix, FP8) on random inputs, as a no-argument function on the fused path"
    g = torch.Generator().manual_seed(0)
    n, dim = cfg.hc_mult, cfg.dim
    layer = random_hc_layer(cfg, 1.0, g, device)
    x, f = (torch.randn(T, n, dim, generator=g).to(device, torch.bfloat16),
            torch.randn(T, dim, generator=g).to(device, torch.bfloat16))
    post, pre = (2 * torch.rand(T, n, generator=g)).to(device), torch.rand(T, n, generator=g).to(device)
    comb = sinkhorn(torch.randn(T, n, n, generator=g), cfg.hc_sinkhorn_iters, cfg.hc_eps).to(device)
    def run():
        with use_kernels('triton'): return mhc_seam(x, f, post, comb, pre, layer.attn, layer.attn_norm, cfg, fp8=True)
    return run

def sweep(cfg, tokens, device, grid):
    "Median µs of one seam per launch shape; returns {T: [(us, block_t, block_d, warps)]}"
    default, res = dict(MHC_TUNING), {}
    for T in tokens:
        run = one_seam(cfg, T, device)
        for bt, bd, w in grid:                                         # the range of the table T falls in
            if _big(T): MHC_TUNING.update(big_block_t=bt, big_block_d=bd, big_warps=w)
            else: MHC_TUNING.update(block_t=bt, block_d=bd, num_warps=w)
            res.setdefault(T, []).append((median_time(run) * 1e6, bt, bd, w))
    MHC_TUNING.update(default)
    return res

def capped(caps, cfg, tokens, device) -> list[dict]:
    "One seam per token count, as compiled and with each register cap: us from a CUDA graph, same bits, % of floor"
    k, rows = mhc_kernel._mhc_seam2_kernel, []
    bw = copy_bandwidth(device=device) if device == 'cuda' else float('nan')
    launch = k.run
    interpreted = os.environ.get('TRITON_INTERPRET') == '1'          # the interpreter has no registers to cap
    default = MHC_TUNING['big_maxnreg']
    MHC_TUNING['big_maxnreg'] = None                                  # "as compiled": the launch table's cap off
    try:
        for T in tokens:
            run, want = one_seam(cfg, T, device), None
            for cap in (None, *caps):
                k.run = (launch if cap is None or interpreted
                         else (lambda *a, _c=cap, **kw: launch(*a, maxnreg=_c, **kw)))
                got = [t.clone() for t in run() if isinstance(t, torch.Tensor)]
                want = want or got
                same = all(torch.equal(a, b) for a, b in zip(want, got))
                us = 1e6 * median_time(cuda_graph(run) if device == 'cuda' else run)
                rows.append(dict(tokens=T, maxnreg=cap, same_bits=same, us=us,
                                 of_floor=seam_floor(cfg, T) / bw / (us * 1e-6)))
                print(f"{T:6d} tokens, registers {cap or 'as compiled':>11}: {us:8.1f} us, "
                      f"{rows[-1]['of_floor']:6.1%} of the floor, same bits {same}", flush=True)
    finally: k.run, MHC_TUNING['big_maxnreg'] = launch, default
    return rows


def ncu_child(T: int):
    "The profiled process: one seam of T tokens run once (compiled, warmed), then once between profiler start and stop"
    run = one_seam(ModelConfig.bench(), T, 'cuda')
    run(); torch.cuda.synchronize()
    torch.cuda.profiler.start(); run(); torch.cuda.synchronize(); torch.cuda.profiler.stop()


def ncu_profile(path: str, tokens, version: int):
    "One Nsight Compute run per token count; each launch's figures and the seam's floor, as one record at `path`"
    ncu = shutil.which('ncu')
    if ncu is None: raise SystemExit('--ncu: ncu is not on PATH')
    cfg, rows = ModelConfig.bench(), []
    for T in tokens:
        child = [sys.executable, __file__, '--version', str(version), '--ncu-child', str(T)]
        res = subprocess.run(ncu_command(ncu, '_mhc_', child), capture_output=True, text=True)
        launches = [dict(m, stalls=stall_reasons(m)) for m in ncu_reports(res.stdout)]
        if res.returncode or not launches or any('Duration' not in m for m in launches):
            raise SystemExit(f'--ncu: {T} tokens: {(res.stderr or res.stdout)[-1500:]}')
        moved = sum(m.get('dram__bytes_read.sum', 0) + m.get('dram__bytes_write.sum', 0) for m in launches)
        rows.append(dict(tokens=T, floor_bytes=seam_floor(cfg, T), dram_bytes=moved, launches=launches))
        for m in launches:
            print(f"{T:5d} tokens  {m['kernel']:20s} {m['Duration'] / 1e3:8.1f} us  DRAM {m.get('DRAM Throughput')}%"
                  f"  occupancy {m.get('Achieved Occupancy')}%  registers {m.get('Registers Per Thread')}  stalls "
                  + ', '.join(f'{r} {v:.1f}' for r, v in m['stalls']))
    rec = dict(machine=torch.cuda.get_device_name(), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}',
               commit=git_commit(), config='bench', version=version, tuning=dict(MHC_TUNING),
               what='one full seam (update, prediction, mix, FP8) per token count, every launch, after a warm-up '
                    'call; ncu --clock-control none, figures in base units (ns, bytes)', rows=rows)
    Path(path).write_text(json.dumps(rec, indent=1))
    print('wrote', path)


def main():
    cfg = getattr(ModelConfig, 'tiny' if args.quick else args.config)()
    tokens, layers = ([1, 17] if args.quick else args.tokens), (2 if args.quick else args.layers)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  '
          f'triton {triton.__version__}  config {"tiny" if args.quick else args.config} (dim '
          f'{cfg.dim}, {cfg.hc_mult} copies), {layers} blocks, seam version {args.version}, '
          f'tuning {MHC_TUNING}')
    sweep_rows = None
    if args.sweep:
        grid = ([(16, 64, 4), (32, 32, 4)] if args.quick
                else [(bt, bd, w) for bt in (16, 32, 64) for bd in (16, 32, 64) for w in (4, 8)])
        sweep_rows = sweep(cfg, tokens, device, grid)
        print('one seam, µs by launch shape (tokens per program / columns per tile / warps):')
        print(f"{'tokens':>7s}  " + '  '.join(f'{bt}/{bd}/{w}'.rjust(9) for bt, bd, w in grid))
        for T, r in sweep_rows.items():
            best = min(r)
            print(f'{T:7d}  ' + '  '.join(f'{us:9.1f}' for us, *_ in r) + f'   best {best[1]}/{best[2]}/{best[3]}')
    rows = benchmark_hc_layers(cfg, tokens, layers, device=device)
    print(format_hc_benchmark(rows))
    for T in tokens:
        ref, fused = (next(r for r in rows if r['tokens'] == T and r['path'] == p)
                      for p in ('eager reference', 'fused'))
        best = lambda r: r['graph_us'] if math.isfinite(r['graph_us']) else r['us']
        print(f'{T:7d} tokens: fused {ref["us"] / fused["us"]:.1f}x faster launched, '
              f'{best(ref) / best(fused):.1f}x with graphs; '
              f'{ref["launches"] / fused["launches"]:.0f}x fewer launches')
    if args.json:                                                    # NaN (no graph or floor on a CPU) as null
        clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v
        rows = [{k: clean(v) for k, v in r.items()} for r in rows]
        with open(args.json, 'w') as fh:
            json.dump(dict(machine=machine, date=str(datetime.date.today()),
                           torch=torch.__version__, triton=triton.__version__,
                           config=args.config if not args.quick else 'tiny', layers=layers, version=args.version,
                           tuning=MHC_TUNING, rows=rows,
                           sweep={str(k): v for k, v in (sweep_rows or {}).items()}), fh, indent=1, default=str)


if __name__ == '__main__':
    with seam_version(args.version):
        if args.ncu_child: ncu_child(args.ncu_child)
        elif args.maxnreg:
            cfg = getattr(ModelConfig, 'tiny' if args.quick else args.config)()
            dev = 'cuda' if torch.cuda.is_available() else 'cpu'
            rows = capped(args.maxnreg, cfg, [1, 17] if args.quick else args.tokens, dev)
            if args.json:
                Path(args.json).write_text(json.dumps(dict(
                    machine=machine_name(dev), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', commit=git_commit(),
                    config=args.config, triton=triton.__version__, version=args.version, tuning=dict(MHC_TUNING),
                    rows=rows), indent=1, default=str))
        elif args.ncu:
            if not torch.cuda.is_available(): raise SystemExit('--ncu needs a GPU')
            ncu_profile(args.ncu, args.tokens, args.version)
        else: main()
