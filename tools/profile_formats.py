#!/usr/bin/env python
"""One store and one gather per codec and kernel version, shuffled slots, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:'_(store|gather)_fp[48]_kernel' --section SpeedOfLight \\
        --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
dram__bytes_read.sum,dram__bytes_write.sum \\
        python3 tools/profile_formats.py [--records N] [--versions 1 2] [--codecs ds_fp4 ...] \
[--order random|sequential]

Each kernel is launched once per codec and version (compilation is not a launch)."""
import argparse
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.record_codecs import cache_format, CACHE_FORMATS
from dsv41_nb.records import store_records, gather_records

ap = argparse.ArgumentParser()
ap.add_argument('--records', type=int, default=1 << 20)
ap.add_argument('--versions', type=int, nargs='+', default=[1, 2])
ap.add_argument('--codecs', nargs='+', default=list(CACHE_FORMATS))
ap.add_argument('--order', default='random', choices=('random', 'sequential'))
args = ap.parse_args()
n = args.records
with use_kernels('triton'):
    for name in args.codecs:
        c = cache_format(ModelConfig.full(), name)
        x = torch.randn(n, c.dim, device='cuda', dtype=torch.bfloat16)
        cache = torch.empty(n, c.record_bytes, dtype=torch.uint8, device='cuda')
        perm = torch.randperm if args.order == 'random' else torch.arange
        slots, idx = perm(n, device='cuda'), perm(n, device='cuda')
        for v in args.versions:
            store_records(c, x, cache, slots, check_slots=False, version=v)
            gather_records(c, cache, idx, check_slots=False, version=v)
        torch.cuda.synchronize()
