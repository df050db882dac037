#!/usr/bin/env python
"""Time the sparse MLA decode kernel per query token per layer against its floor and the PyTorch reference.

    python tools/bench_sparse_decode.py [--json out.json] [--quick] [--sweep] [--ncu PROFILE.json]

Default (a GPU): the `bench` geometry (64 heads, 128 window records of `window_fp8` + 512 selected `ds_fp4` records, one
decode token per request at 32K context), batches 1, 16, 64, 256: time per query token per layer (replayed from a CUDA
graph, and one eager call), the floor (the larger of bytes / copy bandwidth and FLOPs / BF16 matmul rate, both measured
in the same run, and which one applies), the fraction of the floor reached, the PyTorch reference in the same run; then
sparse against dense attention (every compressed entry) at 8K, 128K and 512K context with the indexer's full scan beside
it (batch 16). `--sweep` then runs tools/sweep_sparse_decode.py, which checks and times every launch shape of the kernel
at batches 1, 64 and 256 (its JSON next to this one's, `_sweep` added to the name). `--ncu PATH` profiles one launch at
batch 64 with Nsight Compute and writes a summary to PATH (read by 06a_sparse_decode_speed's profile cell).
`--quick` runs a small geometry on small sizes, which also works on a CPU under TRITON_INTERPRET=1 (bandwidth and
matmul rate are then the CPU's, so the floor means little)."""
import argparse, csv, datetime, io, json, pathlib, shutil, subprocess, sys
from dataclasses import replace
import torch, triton
from dsv41_nb.config import ModelConfig
from bench_engine import git_commit        # tools/ is on the path when this runs as a script
from dsv41_nb.dispatch import copy_bandwidth, kernel_backend, median_time, machine_name
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.sparse_decode import decode_inputs, decode_cost, sparse_decode
from dsv41_nb.sparse_decode_speed import (benchmark_sparse_decode, format_decode_benchmark, benchmark_context,
                                          profile_summary)

NCU_SECTIONS = ('SpeedOfLight', 'ComputeWorkloadAnalysis', 'MemoryWorkloadAnalysis', 'Occupancy', 'LaunchStats')


def matmul_rate(n: int, device) -> float:
    "Dense BF16 matmul FLOP/s of an n x n x n product, measured here"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / median_time(lambda: a @ a)


def ncu_child():
    "The profiled process: one warm-up launch, then the batch-64 launch Nsight Compute records"
    cfg = ModelConfig.bench()
    args = decode_inputs(cfg, 64, 32768, cfg.index_topk, exact=False, device='cuda')
    for _ in range(3): sparse_decode(*args, check_indices=False)
    torch.cuda.synchronize()


def ncu_profile(path):
    "Run Nsight Compute on the kernel at batch 64; write {metric: value} plus a few derived numbers to `path`"
    ncu = shutil.which('ncu')
    out = dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()))
    if ncu is None:
        out['error'] = 'ncu is not on PATH'
    else:
        cmd = ([ncu, '--clock-control', 'none', '--kernel-name', 'regex:_sparse_decode_kernel',
                '--launch-skip', '2', '--launch-count', '1', '--csv', '--page', 'details']
               + [a for s in NCU_SECTIONS for a in ('--section', s)] + [sys.executable, __file__, '--ncu-child'])
        res = subprocess.run(cmd, capture_output=True, text=True)
        rows = [r for r in csv.reader(io.StringIO(res.stdout)) if len(r) > 5]
        if res.returncode or len(rows) < 2:
            out['error'] = (res.stderr or res.stdout)[-2000:]
        else:
            head = rows[0]
            col = {k: head.index(k) for k in ('Section Name', 'Metric Name', 'Metric Unit', 'Metric Value')}
            metrics = {f"{r[col['Section Name']]} / {r[col['Metric Name']]} "
                       f"({r[col['Metric Unit']]})": r[col['Metric Value']] for r in rows[1:]}
            out['metrics'] = metrics
            dur = next((float(v.replace(',', '')) for k, v in metrics.items() if '/ Duration' in k), None)
            unit = next((k for k in metrics if '/ Duration' in k), '')
            if dur is not None:
                secs = dur * {'(nsecond)': 1e-9, '(usecond)': 1e-6, '(msecond)': 1e-3}.get(unit[unit.rfind('('):], 1e-9)
                cfg = ModelConfig.bench()
                cost = decode_cost(cfg, cfg.window_size, cfg.index_topk,
                                   cache_format(cfg, 'window_fp8'), cache_format(cfg, 'ds_fp4'))
                out['achieved TFLOP/s'] = round(64 * cost['flops'] / secs / 1e12, 1)
                out['achieved TB/s (bytes the kernel must move)'] = round(64 * cost['bytes'] / secs / 1e12, 2)
                out['us per query token'] = round(secs / 64 * 1e6, 3)
    with open(path, 'w') as f: json.dump(out, f, indent=1)
    print(profile_summary(out))


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--json', help='write the rows here')
    ap.add_argument('--quick', action='store_true', help='small sizes (runs under TRITON_INTERPRET=1)')
    ap.add_argument('--sweep', action='store_true',
                    help='then check and time every launch shape (tools/sweep_sparse_decode.py)')
    ap.add_argument('--ncu', metavar='PATH', help='profile the kernel at batch 64 with Nsight Compute, summary to PATH')
    ap.add_argument('--ncu-child', action='store_true', help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ncu_child: ncu_child(); sys.exit(0)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if kernel_backend(torch.zeros(1, device=device)) != 'triton':
        raise SystemExit('needs a GPU, or TRITON_INTERPRET=1 on a CPU')
    if args.ncu:
        if device != 'cuda': raise SystemExit('--ncu needs a GPU')
        ncu_profile(args.ncu); sys.exit(0)
    cfg = replace(ModelConfig.bench(), window_size=16) if args.quick else ModelConfig.bench()
    print(f'{machine_name(device)}  {datetime.datetime.now():%Y-%m-%d %H:%M}  '
          f'torch {torch.__version__}  triton {triton.__version__}  '
          f'config {"bench, window 16 (quick)" if args.quick else "bench"}')
    bw = copy_bandwidth(nbytes=(1 << 24) if args.quick else (2 << 30), device=device)
    peak = matmul_rate(256 if args.quick else 8192, device)
    print(f'copy bandwidth {bw / 1e12:.2f} TB/s, BF16 matmul {peak / 1e12:.1f} TFLOP/s')
    k = 16 if args.quick else cfg.index_topk
    rows = [benchmark_sparse_decode(cfg, B, bw, peak, context=300 if args.quick else 32768, n_topk=k, device=device,
                                    rep=5 if args.quick else 100) for B in ((1, 2) if args.quick else (1, 16, 64, 256))]
    print(format_decode_benchmark(rows), flush=True)
    ctx_rows = []
    def save():   # after the batch table, and again with the context rows: a run cut short keeps its batches
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(device=machine_name(device), date=str(datetime.date.today()),
                               commit=git_commit(), torch=torch.__version__,
                               triton=triton.__version__, copy_bandwidth=bw, bf16_matmul=peak, rows=rows,
                               context_rows=ctx_rows), f, indent=1)
    save()
    if not args.quick:
        ctx_rows = [benchmark_context(cfg, L, bw, peak, device=device) for L in (8192, 131072, 524288)]
        print(f"{'context':>8} {'sparse us':>10} {'indexer us':>11} {'dense us':>9} {'dense / (sparse + indexer)':>27}")
        for r in ctx_rows:
            print(f"{r['context']:>8d} {r['sparse_us']:>10.3f} {r['indexer_us']:>11.3f} "
                  f"{r['dense_us']:>9.2f} {r['dense_vs_sparse']:>26.1f}x")
        save()
    if args.sweep:
        extra = ((['--quick'] if args.quick else [])
                 + (['--json', args.json.replace('.json', '') + '_sweep.json'] if args.json else []))
        subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name('sweep_sparse_decode.py'))] + extra,
                       check=True)
