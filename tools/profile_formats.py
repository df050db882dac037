#!/usr/bin/env python
"""One store and one gather per codec family at 1M records, for `ncu` (see the closing notes of issue #2):
    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats python3 tools/profile_formats.py"""
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.formats import cache_codecs, store_records, gather_records

n = 1 << 20
codecs = cache_codecs(ModelConfig.full())
with use_kernels('triton'):
    for name in ('window', 'compressed'):
        c = codecs[name]
        x = torch.randn(n, c.dim, device='cuda', dtype=torch.bfloat16)
        cache = torch.empty(n, c.record_bytes, dtype=torch.uint8, device='cuda')
        slots = torch.arange(n, device='cuda')
        store_records(c, x, cache, slots); gather_records(c, cache, slots)
torch.cuda.synchronize()
