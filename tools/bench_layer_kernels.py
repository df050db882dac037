#!/usr/bin/env python
"""Two layer kernels on one GPU, each version against the other: the mHC seam (07a_mhc_kernel) and the compressor's
decode step (03b_compressor_kernel). One run, one JSON record.

    python tools/bench_layer_kernels.py OUT_DIR [--quick] [--sweep] [--parts mhc compressor]

In the `bench` geometry: one full seam (update, prediction, input mix, FP8) at 1 to 8,192 tokens through
`benchmark_seam`, and a decode step of 1 to 256 requests on the ratio-2 and the ratio-1 layer through
`benchmark_decode_step`, the functions the notebooks' GPU cells run. Each version is first checked against its
reference (a failed check is recorded in its row, not timed), then timed launched and replayed from a CUDA graph
(Triton's `do_bench`, median), with the launches a call makes (the profiler's count, and the count by construction),
the compressor's reads of device values, the bytes of the floor, the rate they imply and the fraction of the floor at
`HARDWARE['H200 (measured copy)']`'s bandwidth. The record also keeps the copy bandwidth measured in the same run and
the registers, spills and shared memory of every kernel variant that was compiled. It is written to
OUT_DIR/layer_kernels.json after each part, so a run cut short keeps what it measured.

`--parts copy` times a plain device copy of the floor's bytes at each size of the seam and of the sparse MLA decode
kernel (06_sparse_decode, bench geometry, 128 window and 512 selected records a token), replayed from a CUDA graph
(`copy_time`): the most of its floor a launch of that size reaches when it does nothing else.

`--sweep` also times version 2 of the seam at 1,024 and 8,192 tokens over a few tile shapes (a compile each).
`--quick` runs the `tiny` geometry at two sizes under the Triton interpreter on a CPU: a check of the script, whose
times mean nothing."""
import argparse, datetime, json, math, os, sys, time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument('out_dir', help='the directory that receives layer_kernels.json')
ap.add_argument('--quick', action='store_true', help='tiny geometry on the CPU interpreter (checks the script)')
ap.add_argument('--sweep', action='store_true', help='also time a few tile shapes of the seam, version 2')
ap.add_argument('--parts', nargs='+', default=['mhc', 'compressor'], choices=['mhc', 'compressor', 'copy'],
                help='what to measure (the two kernels by default; one at a time halves the compiles); copy: '
                     'a plain copy of each size\'s floor bytes')
args = ap.parse_args()

import torch
if not torch.cuda.is_available():
    if not args.quick: sys.exit('this benchmark needs a GPU (or --quick, which runs the Triton interpreter on a CPU)')
    os.environ.setdefault('TRITON_INTERPRET', '1')                 # before the kernels are defined
import triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.floors import HARDWARE
from dsv41_nb.dispatch import copy_bandwidth, machine_name
from dsv41_nb.launches import copy_time
from dsv41_nb import mhc_kernel, mhc_speed, compressor_kernel as comp
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.sparse_decode import decode_cost

T0 = time.time()
HW = HARDWARE['H200 (measured copy)']


def say(msg: str): print(f'[{time.time() - T0:6.1f} s] {msg}', flush=True)


def commit() -> str | None:
    "The checkout's commit (short; '+modified' if files changed since); DSV41_COMMIT overrides it"
    from bench_engine import git_commit                    # tools/ is on the path when this runs as a script
    return os.environ.get('DSV41_COMMIT') or git_commit()


def clean(v):
    "JSON-safe: NaN and infinities as null, tuples as lists"
    if isinstance(v, float) and not math.isfinite(v): return None
    if isinstance(v, dict): return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)): return [clean(x) for x in v]
    return v


def compiled(kernels) -> list[dict]:
    "Registers, spills, shared memory and warps of every compiled variant of `kernels` (on a GPU; best effort)"
    rows = []
    for k in kernels:
        try: variants = [kv for caches in k.device_caches.values() for kv in caches[0].items()]
        except Exception as e:                                         # another Triton's layout
            rows.append(dict(kernel=k.fn.__name__, error=f'{type(e).__name__}: {e}'[:200])); continue
        for key, ck in variants:
            try:
                ck._init_handles()
                rows.append(dict(kernel=k.fn.__name__, regs=ck.n_regs, spills=ck.n_spills,
                                 shared=ck.metadata.shared, num_warps=ck.metadata.num_warps,
                                 specialization=str(key)[:600]))
            except Exception as e: rows.append(dict(kernel=k.fn.__name__, error=f'{type(e).__name__}: {e}'[:200]))
    return rows


def sweep(cfg, device, rep) -> list[dict]:
    "Version 2 of the seam over a few tile shapes (tokens x columns x warps) and splits, at 1,024 and 8,192 tokens"
    rows, shapes = [], [(64, 16, 4), (128, 16, 8), (32, 32, 4), (64, 32, 8)]
    for T in (1024, 8192):
        for (bt, bd, w), split in [(s, 'auto') for s in shapes] + [((64, 16, 4), 1)]:
            with mhc_kernel.seam_version(2):
                old = dict(mhc_kernel.MHC_TUNING)
                mhc_kernel.MHC_TUNING.update(big_block_t=bt, big_block_d=bd, big_warps=w, split=split)
                try: r = mhc_speed.benchmark_seam(cfg, (T,), (2,), device, HW.bandwidth, rep=rep)[0]
                finally: mhc_kernel.MHC_TUNING.clear(); mhc_kernel.MHC_TUNING.update(old)
            rows.append(dict(r, tile=f'{bt}x{bd}', warps=w, split_asked=split))
            say(f"sweep T={T} {bt}x{bd} warps {w} split {split}: "
                + (r['error'] if 'error' in r else f"{r['graph_us']:.1f} us, {r['of_floor']:.1%} of the floor"))
    return rows


def seam(rec, cfg, tokens, device, rep):
    "The seam on every version, and what each version's launch table plans"
    rec['mhc_plans'] = {}
    for v in mhc_kernel.SEAM_VERSIONS:
        with mhc_kernel.seam_version(v):
            sms = mhc_kernel.sm_count(device, default=0)
            rec['mhc_plans'][v] = [mhc_speed.seam_plan(cfg, T, sms) for T in tokens]
    versions = tuple(mhc_kernel.SEAM_VERSIONS)
    rec['mhc'] = mhc_speed.benchmark_seam(cfg, tokens, versions, device, HW.bandwidth, rep=rep)
    say(f'mHC seam, one full seam (update, prediction, mix, FP8), versions {versions} side by side:')
    print(mhc_speed.format_seam_benchmark(rec['mhc']))
    for T in tokens:
        rs = {r['version']: r for r in rec['mhc'] if r['tokens'] == T and 'error' not in r}
        if args.quick: continue
        print(f'{T:6d} tokens: ' + '; '.join(
            f'version {v} {rs[v - 1]["graph_us"] / r["graph_us"]:.2f}x version {v - 1} from a graph '
            f'({r["of_floor"]:.1%} of the floor)' for v, r in sorted(rs.items()) if v - 1 in rs))


def copies(rec, cfg, tokens, batches, device, rep) -> list[dict]:
    "A plain copy of each size's floor bytes, from a CUDA graph, against that floor at the bandwidth measured here"
    bw, rows = rec['copy_bandwidth_measured'], []
    per_token = decode_cost(cfg, cfg.window_size, cfg.index_topk, cache_format(cfg, 'window_fp8'),
                            cache_format(cfg, 'ds_fp4'))['bytes']
    sizes = ([('mhc seam', T, mhc_speed.seam_floor(cfg, T)) for T in tokens]
             + [('sparse decode', B, B * per_token) for B in batches])
    for kernel, n, nbytes in sizes:
        t = copy_time(int(nbytes), device, rep=rep)
        rows.append(dict(kernel=kernel, size=n, bytes=int(nbytes), copy_us=t * 1e6, floor_us=nbytes / bw * 1e6,
                         of_floor=nbytes / bw / t))
        say(f"copy of the {kernel}'s floor at {n}: {nbytes / 1e6:8.2f} MB in {t * 1e6:7.2f} us, "
            f"{rows[-1]['of_floor']:.1%} of the floor")
    return rows


def main():
    out = Path(args.out_dir); out.mkdir(parents=True, exist_ok=True)
    path = out / 'layer_kernels.json'
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    tokens = (1, 5) if args.quick else (1, 16, 64, 256, 1024, 4096, 8192)
    batches = (1, 4) if args.quick else (1, 16, 64, 256)
    ratio1 = next(l for l in cfg.kv_source_layers if cfg.compress_ratios[l] == 1)
    rep = 10 if args.quick else 40                                     # ms of do_bench per timing on a GPU
    machine = machine_name(device)
    rec = dict(machine=machine, date=datetime.datetime.now().strftime('%Y-%m-%d %H:%M'), commit=commit(),
               torch=torch.__version__, triton=triton.__version__, config='tiny' if args.quick else 'bench',
               floor_bandwidth=HW.bandwidth, floor_source=HW.source)
    save = lambda: path.write_text(json.dumps(clean(rec), indent=1))
    say(f'{machine}, torch {torch.__version__}, triton {triton.__version__}, commit {rec["commit"]}, '
        f'config {rec["config"]}; floor at {HW.bandwidth / 1e12:.2f} TB/s ({HW.name})')
    rec['copy_bandwidth_measured'] = copy_bandwidth(nbytes=(1 << 24) if args.quick else (1 << 30), device=device)
    say(f"copy bandwidth measured in this run: {rec['copy_bandwidth_measured'] / 1e12:.2f} TB/s")

    if 'copy' in args.parts: rec['copy'] = copies(rec, cfg, tokens, batches, device, rep); save()
    if 'mhc' in args.parts: seam(rec, cfg, tokens, device, rep); save()
    if 'compressor' in args.parts:
        rec['compressor'] = [r for layer in (cfg.kv_source_layers[0], ratio1)
                             for r in comp.benchmark_decode_step(cfg, layer, batches, (1, 2), device=device,
                                                                 bandwidth=HW.bandwidth, rep=rep,
                                                                 count=None if args.quick
                                                                 else mhc_speed.count_launches)]
        save()
        say('compressor, one decode step (pool, normalise, rotate, quantise, store, ring), version 1 against 2:')
        print(comp.format_decode_benchmark(rec['compressor']))

    if args.sweep and not args.quick:
        rec['mhc_sweep'] = sweep(cfg, device, rep)
        save()
    rec['compiled'] = compiled([mhc_kernel._mhc_seam_kernel, mhc_kernel._mhc_seam2_kernel,
                                mhc_kernel._mhc_finish_kernel, comp._compress_kernel, comp._compress_step_kernel])
    for r in rec['compiled']:
        if 'error' not in r: print(f"  {r['kernel']:24s} {r['num_warps']} warps: {r['regs']} registers, "
                                   f"{r['spills']} spills, {r['shared']} B of shared memory")
    rec['elapsed_s'] = time.time() - T0
    save()
    say(f'wrote {path}')


if __name__ == '__main__':
    main()
