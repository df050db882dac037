#!/usr/bin/env python
"""The sparse MLA decode kernel with and without its prefetching top-k pass (`prefetch`, 06_sparse_decode), checked,
then timed against the floor in one run.

    python tools/bench_sparse_prefetch.py [--batches 1 16 64 256] [--rounds 2] [--json PATH]

Each batch's `DECODE_TUNING` launch, with `prefetch=False` (byte tiles) and `prefetch=True`, is first checked against
the PyTorch reference at the `bench` geometry on that many tokens (64 heads, 128 `window_fp8` + 512 `ds_fp4` records,
ragged lists with -1 entries, one split and the default split count), then timed per query token per layer at 32K
context (`benchmark_sparse_decode`: replayed from a CUDA graph over enough decode steps that the records come from
HBM), alternating the two launches for `--rounds` rounds, against the floor (bytes over the copy bandwidth and FLOPs
over the BF16 matmul rate, both measured here). Each row carries the compiled kernel's registers and spilled bytes.
`--quick` runs a small geometry, which also works on a CPU under TRITON_INTERPRET=1 (the timings then mean nothing)."""
import argparse, datetime, json, sys
from pathlib import Path
from dataclasses import replace
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import copy_bandwidth, kernel_backend, machine_name, median_time
from dsv41_nb.sparse_decode import check_decode, decode_inputs, decode_kernel_resources
from dsv41_nb.sparse_decode_speed import benchmark_sparse_decode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit        # noqa: E402  (DSV41_COMMIT overrides it)

MODES = {'byte tiles': dict(prefetch=False), 'prefetch': dict(prefetch=True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--batches', type=int, nargs='+', default=[1, 16, 64, 256])
    ap.add_argument('--rounds', type=int, default=2, help='times each launch is timed, alternating')
    ap.add_argument('--json', help='write the record here')
    ap.add_argument('--quick', action='store_true', help='small sizes (runs under TRITON_INTERPRET=1)')
    args = ap.parse_args()
    if args.rounds < 1 or any(b < 1 for b in args.batches):
        raise SystemExit('--rounds and --batches must be >= 1')
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if kernel_backend(torch.zeros(1, device=device)) != 'triton':
        raise SystemExit('needs a GPU, or TRITON_INTERPRET=1 on a CPU')
    cfg = replace(ModelConfig.bench(), window_size=16) if args.quick else ModelConfig.bench()
    context, topk = (300, 24) if args.quick else (32768, cfg.index_topk)
    rec = dict(machine=machine_name(device), date=f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
               torch=torch.__version__, triton=triton.__version__, commit=git_commit() or 'unknown', checks=[], rows=[])
    print(rec['machine'], rec['date'], f"torch {rec['torch']}, Triton {rec['triton']}, commit {rec['commit']}")
    for B in args.batches:
        for name, launch in MODES.items():
            # the batch's own launch (a few tokens under the interpreter)
            inputs = decode_inputs(cfg, min(B, 3) if args.quick else B, 300 if args.quick else 2048, topk,
                                   ragged=True, device=device, seed=B)
            for splits in (1, None):
                worst, *_ = check_decode(inputs, num_splits=splits, launch=launch)
                rec['checks'].append(dict(batch=B, mode=name, splits=splits, worst=worst))
        print(f"batch {B}: both launches within the reference's bound", flush=True)
    bw = copy_bandwidth(device=device)
    n = 1024 if args.quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    peak = 2 * n ** 3 / median_time(lambda: a @ a); del a
    rec.update(bandwidth=bw, peak=peak)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, BF16 matmul {peak / 1e12:.0f} TFLOP/s")
    print(f"{'batch':>5} {'launch':>9} {'round':>5} {'us/token':>9} {'of floor':>9} {'regs':>5} {'local B':>8}")
    for B in args.batches:
        for rnd in range(args.rounds):
            for name, launch in MODES.items():
                r = benchmark_sparse_decode(cfg, B, bw, peak, context, topk, reference=False,
                                            device=device, rep=5, launch=launch)
                res = decode_kernel_resources(decode_inputs(cfg, B, 300 if args.quick else 2048, topk,
                                                            exact=False, device=device),
                                              launch=launch)
                row = dict(batch=B, mode=name, round=rnd, us=r['us'], floor_us=r['floor_us'], bound=r['bound'],
                           of_floor=r['of_floor'], **res)
                rec['rows'].append(row)
                print(f"{B:>5} {name:>9} {rnd:>5} {r['us']:>9.3f} {r['of_floor']:>9.1%} "
                      f"{res.get('registers', -1):>5} {res.get('local_bytes', -1):>8}", flush=True)
    if args.json:
        with open(args.json, 'w') as f: json.dump(rec, f, indent=1)


if __name__ == '__main__':
    main()
