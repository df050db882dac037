#!/usr/bin/env python
"""Time the compressor's fused Triton kernel against its floor and the PyTorch path, per emitted entry.

    python tools/bench_compressor.py [--json out.json] [--version 2] [--quick]

Default (a GPU): the `bench` geometry (head_dim 512, DS-FP4 records), a ratio-2 layer (2) and the ratio-1 layer (20),
each for a 32K-token prefill of one request and a decode step of 64 requests. Prints the kernel's time, time per emitted
entry, the floor per entry (bytes moved / copy bandwidth measured in the same run), the fraction of it reached, and the
PyTorch path's time measured in the same run. `--quick` runs the `tiny` geometry on small sizes, which also works on a
CPU under TRITON_INTERPRET=1 (the copy bandwidth is then measured on the CPU, so the floor means little). `--version`
picks the kernel `emit` launches (03b_compressor_kernel's `COMPRESS_VERSIONS`: 2, one launch, by default; 1, two at
ratio 2); tools/bench_layer_kernels.py times the decode step on both side by side."""
import argparse, datetime, json
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import copy_bandwidth, kernel_backend, machine_name
from dsv41_nb.compressor_kernel import benchmark_compressor, compress_version, format_compressor_benchmark

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--json', help='write the rows here')
    ap.add_argument('--quick', action='store_true', help='tiny geometry, small sizes (runs under TRITON_INTERPRET=1)')
    ap.add_argument('--version', type=int, default=2, help='the kernel version emit launches (1 or 2)')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if kernel_backend(torch.zeros(1, device=device)) != 'triton':
        raise SystemExit('needs a GPU, or TRITON_INTERPRET=1 on a CPU')
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    layers = (cfg.kv_source_layers[0], next(l for l in cfg.kv_source_layers if cfg.compress_ratios[l] == 1))
    sizes = (('prefill', 32), ('decode', 4)) if args.quick else (('prefill', 32768), ('decode', 64))
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  '
          f'triton {triton.__version__}  config {"tiny" if args.quick else "bench"}, '
          f'kernel version {args.version}')
    bw = copy_bandwidth(nbytes=(1 << 24) if args.quick else (2 << 30), device=device)
    print(f'copy bandwidth {bw / 1e9:.0f} GB/s')
    with compress_version(args.version):
        rows = [benchmark_compressor(cfg, layer, mode, n, device=device, bandwidth=bw, rep=10 if args.quick else 100)
                for layer in layers for mode, n in sizes]
    print(format_compressor_benchmark(rows))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(device=machine, date=str(datetime.date.today()), torch=torch.__version__,
                           triton=triton.__version__,
                           version=args.version, copy_bandwidth=bw, rows=rows), f, indent=1)
