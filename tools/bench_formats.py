#!/usr/bin/env python
"""Check and time the Triton store/gather kernels of `dsv41_nb.formats`: both kernel versions in one run.

    python tools/bench_formats.py [--records N] [--config full|bench|tiny] [--sweep] [--ceiling] [--sizes]
                                  [--exhaustive] [--json out.json]
    TRITON_INTERPRET=1 python tools/bench_formats.py --quick      # a CPU smoke test of the same code path

First every codec's store and gather, in each version, is compared with the PyTorch reference (version 2 byte for byte,
version 1 by value: its FP4 gathers return +0 for -0 on the GPU) on edge-case inputs (BF16 subnormals, signed zeros,
rounding ties, saturating rows); `--exhaustive` adds every BF16 and FP16 value against every E4M3 scale for the DS-FP4
record. Then the tables: median time, the floor (bytes moved / measured copy bandwidth), achieved GB/s, fraction of the
copy bandwidth, the reference's time, for shuffled and sequential slots; the version 1 -> version 2 table; with
`--sweep` the launch shapes of version 2; with `--sizes` a size sweep."""
import argparse, datetime, json, sys, time
import torch, triton
import triton.language as tl
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import use_kernels, median_time, copy_bandwidth, triton_interpreting, machine_name
from dsv41_nb.record_codecs import cache_codecs, cache_format
from dsv41_nb.records import (store_records, gather_records, benchmark_store_gather,
                              format_benchmark, before_after, size_sweep,
                              edge_case_vectors, every_value_blocks, KERNEL_TUNING, KERNEL_VERSIONS)

def machine(device) -> str:
    return f'{machine_name(device)}, torch {torch.__version__}, Triton {triton.__version__}, {datetime.date.today()}'

def check_exact(codec, x, device, versions=KERNEL_VERSIONS, seed=0) -> list[str]:
    "Store `x` and gather it back with every version; return the mismatches against the PyTorch reference"
    g = torch.Generator().manual_seed(seed)
    n, num_slots = x.shape[0], x.shape[0] + 16
    slots = torch.randperm(num_slots, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.1] = -1
    slots, x = slots.to(device), x.to(device)
    stale = codec.pack(torch.randn(num_slots, codec.dim, generator=g)).to(device)
    idx = torch.cat([slots, torch.randint(-1, num_slots, (16,), generator=g).to(device)])
    ref = stale.clone()
    with use_kernels('torch'):
        store_records(codec, x, ref, slots)
        want = {dt: gather_records(codec, ref, idx, dt) for dt in (torch.bfloat16, torch.float32)}
    bad = []
    for v in versions:
        got = stale.clone()
        with use_kernels('triton'):
            store_records(codec, x, got, slots, version=v)
            if not torch.equal(got, ref):
                bad.append(f'{codec.name} v{v} store {x.dtype}: {int((got != ref).any(-1).sum())} records differ')
            for dt, w in want.items():
                got_v = gather_records(codec, ref, idx, dt, version=v)
                a, b = torch.nan_to_num(got_v).float(), torch.nan_to_num(w).float()
                # version 1 is held to values: it loses -0
                diff = (a != b) | ((torch.signbit(a) != torch.signbit(b)) & (v == 2))
                if diff.any():
                    i = diff.nonzero()[:3].tolist()
                    bad.append(f'{codec.name} v{v} gather {x.dtype}->{dt}: {int(diff.sum())} values differ, e.g. '
                               + ', '.join(f'{w[r, c].item()!r} vs {got_v[r, c].item()!r}' for r, c in i))
    return bad

@triton.jit
def _move_store_kernel(x_ptr, slot_ptr, cache_ptr, n_rows, XW: tl.constexpr, RW: tl.constexpr, RW_P2: tl.constexpr,
                       TAIL_P2: tl.constexpr, ROWS: tl.constexpr):
    "The store's memory traffic without its arithmetic: read XW words of a row, write RW words to its slot"
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    live = (rows < n_rows) & (slot >= 0)
    c, t = tl.arange(0, RW_P2), tl.arange(0, TAIL_P2)
    head = tl.load(x_ptr + rows.to(tl.int64)[:, None] * XW + c[None, :],
                   mask=live[:, None] & (c < RW)[None, :], other=0)
    tail = tl.load(x_ptr + rows.to(tl.int64)[:, None] * XW + RW + t[None, :],
                   mask=live[:, None] & (t < XW - RW)[None, :], other=0)
    tl.store(cache_ptr + slot[:, None] * RW + c[None, :], head ^ tl.sum(tail, axis=1)[:, None],
             mask=live[:, None] & (c < RW)[None, :])

@triton.jit
def _move_gather_kernel(cache_ptr, idx_ptr, out_ptr, n_rows, XW: tl.constexpr, RW: tl.constexpr, RW_P2: tl.constexpr,
                        TAIL_P2: tl.constexpr, ROWS: tl.constexpr):
    "The gather's memory traffic without its arithmetic: read RW words at a slot, write XW words"
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inb = rows < n_rows
    idx = tl.load(idx_ptr + rows, mask=inb, other=-1).to(tl.int64)
    c, t = tl.arange(0, RW_P2), tl.arange(0, TAIL_P2)
    rec = tl.load(cache_ptr + idx[:, None] * RW + c[None, :],
                  mask=(inb & (idx >= 0))[:, None] & (c < RW)[None, :], other=0)
    orow = out_ptr + rows.to(tl.int64)[:, None] * XW
    tl.store(orow + c[None, :], rec, mask=inb[:, None] & (c < RW)[None, :])
    tl.store(orow + RW + t[None, :],
             tl.zeros((ROWS, TAIL_P2), tl.int32) + tl.sum(rec, axis=1)[:, None],
             mask=inb[:, None] & (t < XW - RW)[None, :])

def pattern_ceiling(codecs, n, device, order='random') -> list[dict]:
    "GB/s and fraction of copy of kernels that move each codec's bytes in its pattern but encode nothing (int32 words)"
    bw, rows = copy_bandwidth(device=device), []
    for codec in codecs.values():
        if codec.record_bytes % 4 or codec.dim % 2: continue
        xw, rw = codec.dim // 2, codec.record_bytes // 4
        meta = dict(XW=xw, RW=rw, RW_P2=triton.next_power_of_2(rw), TAIL_P2=triton.next_power_of_2(max(xw - rw, 1)),
                    ROWS=max(1, 2048 // triton.next_power_of_2(xw)))
        x = torch.randint(-2**31, 2**31 - 1, (n, xw), dtype=torch.int32, device=device)
        cache = torch.zeros(n, rw, dtype=torch.int32, device=device)
        out = torch.empty_like(x)
        perm = torch.randperm if order == 'random' else torch.arange
        slots, idx = perm(n, device=device), perm(n, device=device)
        grid = (triton.cdiv(n, meta['ROWS']),)
        moved = n * (codec.dim * 2 + codec.record_bytes + 8)
        for op, fn in (('store', lambda: _move_store_kernel[grid](x, slots, cache, n, **meta)),
                       ('gather', lambda: _move_gather_kernel[grid](cache, idx, out, n, **meta))):
            t = median_time(fn)
            rows.append(dict(codec=codec.name, op=op, order=order, ms=t * 1e3, GBps=moved / t / 1e9,
                             of_copy=moved / t / bw))
    return rows

def launch_sweep(codecs, n, grid, device) -> dict:
    "Version-2 times for each launch shape (values per program, warps): {(codec, op): [(ms, of_copy, vpp, warps), ...]}"
    saved, bw, res = {k: dict(v) for k, v in KERNEL_TUNING[2].items()}, copy_bandwidth(device=device), {}
    for vpp, warps in grid:
        for fam in KERNEL_TUNING[2].values(): fam.update(values_per_program=vpp, num_warps=warps)
        for r in benchmark_store_gather(codecs, n, device, versions=(2,), reference=False, bandwidth=bw):
            res.setdefault((r['codec'], r['op']), []).append((r['ms'], r['of_copy'], vpp, warps))
    KERNEL_TUNING[2].update(saved)
    return res

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--records', type=int, default=1 << 20)
    ap.add_argument('--config', default='full', choices=('full', 'bench', 'tiny'))
    ap.add_argument('--sweep', action='store_true', help='time version-2 launch shapes (values per program x warps)')
    ap.add_argument('--sizes', action='store_true', help='size sweep, 256 records to 4M')
    ap.add_argument('--ceiling', action='store_true',
                    help='time kernels that move the same bytes in the same pattern, no encoding')
    ap.add_argument('--exhaustive', action='store_true', help='every BF16/FP16 value against every E4M3 scale (DS-FP4)')
    ap.add_argument('--quick', action='store_true',
                    help='tiny sizes: a smoke test that also runs under TRITON_INTERPRET=1')
    ap.add_argument('--json')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cpu' and not triton_interpreting(): sys.exit('needs a GPU, or TRITON_INTERPRET=1 with --quick')
    n = 64 if args.quick else args.records
    codecs = cache_codecs(getattr(ModelConfig, args.config)())
    print(machine(device), f'| {n:,} records, config {args.config}', flush=True)
    out = dict(machine=machine(device), records=n, config=args.config,
               tuning={str(k): v for k, v in KERNEL_TUNING.items()})

    t0, bad = time.time(), []
    for codec in codecs.values():
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            x = edge_case_vectors(24 if args.quick else 300, codec.dim, dtype)
            if dtype == torch.float16: x = x.float().clamp(-6e4, 6e4).half()
            # the interpreter's BF16 conversions mangle subnormals (v1)
            versions = (2,) if triton_interpreting() else KERNEL_VERSIONS
            bad += check_exact(codec, x, device, versions)
    if args.exhaustive:
        ds = cache_format(getattr(ModelConfig, args.config)(), 'ds_fp4')
        for dtype in (torch.bfloat16, torch.float16):
            blocks = every_value_blocks(dtype, ds.block)
            x = torch.cat([blocks, blocks.new_zeros(-len(blocks) % (ds.dim // ds.block), ds.block)]).view(-1, ds.dim)
            bad += check_exact(ds, x, device)
            print(f'exhaustive: {len(blocks):,} blocks of {dtype} against every E4M3 scale', flush=True)
    print(f"bit-exactness against the PyTorch reference: {'all identical' if not bad else bad} "
          f"({time.time() - t0:.0f} s)", flush=True)
    out['mismatches'] = bad

    if args.sweep:
        grid = [(2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8)]
        res = launch_sweep(codecs, n, grid, device)
        print(f"\nversion-2 launch shapes, ms (values per program / warps)\n{'codec':12s} "
              f"{'op':6s} " + ' '.join(f'{v:>5d}/{w}' for v, w in grid))
        for (name, op), r in res.items():
            best = min(r)
            print(f'{name:12s} {op:6s} ' + ' '.join(f'{ms:7.3f}' for ms, *_ in r)
                  + f'   best {best[2]}/{best[3]}: {best[1]:.0%} of copy')
        out['launch_sweep'] = [dict(codec=c, op=op, ms=ms, of_copy=f, values_per_program=v, num_warps=w)
                               for (c, op), r in res.items() for ms, f, v, w in r]

    rows = []
    for order in ('random', 'sequential'):
        rows += benchmark_store_gather(codecs, n, device, order, reference=not args.quick)
    print('\n' + format_benchmark(rows) + '\n\n' + before_after(rows), flush=True)
    out['rows'] = rows
    if args.ceiling:
        ceil = [r for order in ('random', 'sequential') for r in pattern_ceiling(codecs, n, device, order)]
        v2 = {(r['codec'], r['op'], r['order']): r for r in rows if r['version'] == 2}
        print("\nthe same bytes in the same pattern, no encoding (the memory system's ceiling for "
              f"each kernel)\n{'codec':12s} {'op':6s} {'slots':10s} {'move ms':>8s} "
              f"{'of copy':>8s} {'v2 ms':>8s} {'v2 of move':>10s}")
        for r in ceil:
            k = v2[(r['codec'], r['op'], r['order'])]
            print(f"{r['codec']:12s} {r['op']:6s} {r['order']:10s} {r['ms']:8.3f} "
                  f"{r['of_copy']:8.0%} {k['ms']:8.3f} {r['ms'] / k['ms']:10.0%}")
        out['ceiling'] = ceil
    if args.sizes:
        sizes = (16, 64) if args.quick else tuple(256 * 4 ** k for k in range(8))
        sweep = size_sweep(codecs, sizes, device)
        print(f"\nsize sweep, GB/s (shuffled slots)\n{'codec':12s} {'op':6s} {'v':>2s} "
              + ' '.join(f'{s:>8,d}' for s in sizes))
        for key in dict.fromkeys((r['codec'], r['op'], r['version']) for r in sweep):
            print(f'{key[0]:12s} {key[1]:6s} {key[2]:2d} '
                  + ' '.join(f"{r['GBps']:8.0f}" for r in sweep if (r['codec'], r['op'], r['version']) == key))
        out['size_sweep'] = sweep
    if args.json:
        with open(args.json, 'w') as f: json.dump(out, f, indent=1)
    sys.exit(1 if bad else 0)
