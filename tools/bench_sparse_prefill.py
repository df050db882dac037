#!/usr/bin/env python
"""Sparse attention over prefill steps: the sparse decode kernel (06_sparse_decode, its launch as served) against
`sparse_prefill` (06b_sparse_prefill: each chunk of a request's tokens attending to its distinct records), checked,
then timed in one run.

    python tools/bench_sparse_prefill.py [--layouts 64x128 16x512 4x2048] [--json PATH] [--quick]

A layout RxN is R requests of N prompt tokens each from position 0, in one step, at the `bench` geometry (64 heads,
head dim 512, window records `window_fp8`, compressed records `ds_fp4` in a ratio-1 layer, window 128, top-k 512 drawn
at random from the entries each token sees: past the top-k the least sharing real lists could have). Each layout's first
request (up to 512 tokens) is checked first, both paths against the PyTorch reference; then the kernel,
`sparse_prefill` and `served_attend` with the union on (its split, plan and guard included) are each timed eagerly, as a
prefill step runs them (`median_time`), with the plan's scores a head per record read and the union's extra memory.
`--quick` runs a small geometry, which also works on a CPU under TRITON_INTERPRET=1 (the timings then mean nothing)."""
import argparse, datetime, json, sys
from dataclasses import replace
from pathlib import Path
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import kernel_backend, machine_name, median_time
from dsv41_nb.sparse_decode import check_decode, sparse_decode
from dsv41_nb.sparse_prefill import (PREFILL_CHUNK, PREFILL_MAX_WORK, check_prefill, plan_prefill, prefill_inputs,
                                     served_attend, sparse_prefill, take_tokens)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit        # noqa: E402  (DSV41_COMMIT overrides it)


def layout(text: str) -> tuple:
    try:
        r, n = (int(v) for v in text.lower().split('x'))
    except ValueError: raise argparse.ArgumentTypeError(f"layout {text!r}: expected RxN, e.g. 64x128")
    if r < 1 or n < 1: raise argparse.ArgumentTypeError(f"layout {text!r}: R and N must be >= 1")
    return r, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--layouts', type=layout, nargs='+', default=[(64, 128), (16, 512), (4, 2048)])
    ap.add_argument('--json', help='write the record here')
    ap.add_argument('--quick', action='store_true', help='small sizes (runs under TRITON_INTERPRET=1)')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if kernel_backend(torch.zeros(1, device=device)) != 'triton':
        raise SystemExit('needs a GPU, or TRITON_INTERPRET=1 on a CPU')
    cfg = (replace(ModelConfig.bench(), window_size=16, index_topk=24, n_heads=16) if args.quick
           else ModelConfig.bench())
    rec = dict(machine=machine_name(device), date=f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
               torch=torch.__version__, triton=triton.__version__, commit=git_commit() or 'unknown',
               chunk=PREFILL_CHUNK, max_work=PREFILL_MAX_WORK, rows=[])
    print(rec['machine'], rec['date'], f"torch {rec['torch']}, Triton {rec['triton']}, commit {rec['commit']}")
    for R, N in args.layouts:
        inputs = prefill_inputs(cfg, [(0, N)] * R, 'window_fp8', 'ds_fp4', 1, device=device, seed=R + N)
        q, window, compressed, idx, sink, scale = inputs
        first = torch.arange(len(q), device=q.device) < min(N, 64 if args.quick else 512)
        sub = (q[first], window, compressed, take_tokens(idx, first), sink, scale)
        worst_union = check_prefill(sub, chunk=PREFILL_CHUNK)
        worst_kernel, *_ = check_decode(sub)
        plan = plan_prefill(window, compressed, idx, PREFILL_CHUNK)
        records = int((plan.rchunk < plan.n).sum())           # the stand-in of dead entries left out
        calls = {'kernel': lambda: sparse_decode(*inputs, check_indices=False),
                 'union': lambda: sparse_prefill(*inputs, PREFILL_CHUNK, check_indices=False, plan=plan),
                 'union and plan': lambda: sparse_prefill(*inputs, PREFILL_CHUNK, check_indices=False),
                 'served': lambda: served_attend(*inputs, union=True)}
        times = {k: median_time(f) for k, f in calls.items()}
        extra = None
        if device == 'cuda':
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated(); calls['union']()
            extra = torch.cuda.max_memory_allocated() - base
        row = dict(requests=R, tokens=N, steps_tokens=R * N, worst_union=worst_union, worst_kernel=worst_kernel,
                   chunks=plan.n, width=plan.width, reads=plan.reads, records=records,
                   work_per_read=plan.work / plan.reads, reads_per_record=plan.reads / records,
                   kernel_ms=1e3 * times['kernel'], union_ms=1e3 * times['union'],
                   union_plan_ms=1e3 * times['union and plan'], served_ms=1e3 * times['served'],
                   union_extra_bytes=extra)
        rec['rows'].append(row)
        print(f"{R:4d} x {N:5d}: checked (union {worst_union:.2f}, kernel {worst_kernel:.2f} of the bound); "
              f"kernel {row['kernel_ms']:8.3f} ms, union {row['union_ms']:8.3f} ms "
              f"(+plan {row['union_plan_ms']:8.3f}), served {row['served_ms']:8.3f} ms; "
              f"{row['work_per_read']:.2f} scores a head per read, {row['reads_per_record']:.1f} reads a record",
              flush=True)
    if args.json:
        with open(args.json, 'w') as f: json.dump(rec, f, indent=1)


if __name__ == '__main__':
    main()
