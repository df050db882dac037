#!/usr/bin/env python
"""Time the Triton store/gather kernels of 01_formats on a GPU against the copy bandwidth and the PyTorch reference.

    python tools/bench_formats.py [--records 1048576] [--config full|bench|tiny] [--json out.json]

Prints one row per codec and direction: median time, the floor (bytes moved / measured copy bandwidth), achieved
GB/s, fraction of the copy bandwidth, the reference's median time and the speed-up, all from one run."""
import argparse, datetime, json
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import median_time, copy_bandwidth, use_kernels
from dsv41_nb.formats import cache_codecs, benchmark_store_gather, format_benchmark, store_records, gather_records, KERNEL_TUNING

def sweep(codecs, n, grid):
    "Triton-only times for each launch shape in `grid`; returns {(codec, op): [(ms, shape), ...]}"
    bw, res = copy_bandwidth(), {}
    for name, codec in codecs.items():
        x = torch.randn(n, codec.dim, device='cuda', dtype=torch.bfloat16)
        cache = torch.empty(n, codec.record_bytes, dtype=torch.uint8, device='cuda')
        slots, idx = torch.randperm(n, device='cuda'), torch.randperm(n, device='cuda')
        moved = n * (codec.dim * 2 + codec.record_bytes + 8)
        for vpp, warps in grid:
            for fam in KERNEL_TUNING.values(): fam.update(values_per_program=vpp, num_warps=warps)
            with use_kernels('triton'):
                for op, fn in (('store', lambda: store_records(codec, x, cache, slots, check_slots=False)), ("gather", lambda: gather_records(codec, cache, idx, check_slots=False))):
                    t = median_time(fn)
                    res.setdefault((codec.name, op), []).append((t * 1e3, moved / t / bw, vpp, warps))
    return res

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--records', type=int, default=1 << 20)
    ap.add_argument('--config', default='full')
    ap.add_argument('--json')
    ap.add_argument('--sweep', action='store_true', help='time launch shapes (values per program x warps) first')
    args = ap.parse_args()
    assert torch.cuda.is_available(), 'this benchmark needs a GPU'
    cfg = getattr(ModelConfig, args.config)()
    print(f'{torch.cuda.get_device_name()}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  triton {triton.__version__}  '
          f'{args.records:,} records, config {args.config}')
    if args.sweep:
        default = {k: dict(v) for k, v in KERNEL_TUNING.items()}
        res = sweep(cache_codecs(cfg), args.records, [(v, w) for v in (1024, 2048, 4096, 8192) for w in (4, 8)])
        print(f"{'codec':18s} {'op':6s}  " + '  '.join(f'{v}/{w}' for _, _, v, w in next(iter(res.values()))) + '   (ms: values per program / warps)')
        for (name, op), r in res.items():
            print(f'{name:18s} {op:6s}  ' + '  '.join(f'{ms:8.3f}' for ms, *_ in r) + f'   best {min(r)[2]}/{min(r)[3]} at {min(r)[1]:.0%} of copy')
        KERNEL_TUNING.update(default)
    rows = benchmark_store_gather(cache_codecs(cfg), args.records) + benchmark_store_gather(cache_codecs(cfg), args.records, order='sequential')
    print(format_benchmark(rows))
    if args.json:
        with open(args.json, 'w') as f: json.dump(dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()), rows=rows), f, indent=1)
