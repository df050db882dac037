#!/usr/bin/env python
"""Measure the lightning indexer's kernels: the full-scan logits per query token against its floor, a Reindex layer's
sparse (candidate-pool) scoring against scoring the whole context and masking, and the candidate stage's recall.

    python tools/bench_indexer.py [--json out.json] [--quick] [--versions 2 3] [--ncu PROFILE.json]
                                  [--sections scan sparse recall]

Default (a GPU): the `bench` geometry (32 heads x 128, MXFP4 keys, 2,048 x 8 candidates) at the ratio-1 source, where a
context of N tokens is N entries; decode batches of 32 requests; the full scan at 8K, 128K and 512K, sparse vs dense at
128K and 512K, recall from 16K to 512K on random and clustered keys. `--versions` times the full scan with each of
those key decodings (default: the default one, LOGITS_TUNING['version']), each first checked against the PyTorch
reference (within the rounding bound of another summation order); `--ncu` profiles all three. `--sections` runs
some of the three measurements (default: all). `--quick` runs
the `tiny` geometry on small contexts, which also works on a CPU under TRITON_INTERPRET=1 (timings there mean
nothing; it checks that it all runs)."""
import argparse, datetime, json, shutil, subprocess, sys
from pathlib import Path
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import copy_bandwidth, kernel_backend, machine_name
from dsv41_nb.indexer_kernels import key_decoding, index_logits, LOGITS_TUNING
from dsv41_nb.indexer_speed import (benchmark_index_logits, benchmark_sparse_vs_dense, candidate_recall,
                                    _decode_batch)
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.dispatch import use_kernels
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_mix import ncu_metrics         # noqa: E402  (an ncu text report's numbers by name)
from bench_engine import git_commit        # noqa: E402

NCU_SECTIONS = ('SpeedOfLight', 'Occupancy', 'LaunchStats', 'SchedulerStats', 'WarpStateStats',
                'MemoryWorkloadAnalysis', 'ComputeWorkloadAnalysis')
NCU_CONTEXT, NCU_BATCH = 524288, 32
SECTIONS = ('scan', 'sparse', 'recall')


def ncu_child(version: int):
    "The profiled process: the full scan at 512K entries, decode batch 32, MXFP4 keys, twice (ncu records the second)"
    cfg = ModelConfig.bench()
    codec = cache_format(cfg, 'index_mxfp4')
    q, w, cache, ib = _decode_batch(cfg, codec, NCU_BATCH, NCU_CONTEXT, 'cuda')
    with key_decoding(version), use_kernels('triton'):
        for _ in range(2): index_logits(q, w, cache, ib, codec, width=NCU_CONTEXT)
    torch.cuda.synchronize()


def ncu_profile(path: str, versions=(1, 2, 3)):
    "One Nsight Compute run per version of the key decoding; their numbers by name, one row each, to `path`"
    ncu = shutil.which('ncu')
    if ncu is None: raise SystemExit('--ncu: ncu is not on PATH')
    rows = []
    for version in versions:
        cmd = ([ncu, '--clock-control', 'none', '--kernel-name', 'regex:_index_logits_kernel',
                '--launch-skip', '1', '--launch-count', '1']
               + [a for s in NCU_SECTIONS for a in ('--section', s)]
               + [sys.executable, __file__, '--ncu-child', str(version)])
        res = subprocess.run(cmd, capture_output=True, text=True)
        m = ncu_metrics(res.stdout)
        if res.returncode or 'Duration' not in m:
            raise SystemExit(f'--ncu: version {version}: {(res.stderr or res.stdout)[-1500:]}')
        rows.append(dict(launch=f'version {version}', ncu=m))
        print(f"version {version}: {m['Duration']} us, SM throughput {m.get('Compute (SM) Throughput')}%, "
              f"DRAM {m.get('DRAM Throughput')}%, issued warps per scheduler {m.get('Issued Warp Per Scheduler')}")
    rec = dict(machine=torch.cuda.get_device_name(), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}',
               commit=git_commit(), config='bench', context=NCU_CONTEXT, batch=NCU_BATCH,
               what=('one ncu run per version (--clock-control none; ' + ', '.join(NCU_SECTIONS)
                     + ') of the full-scan index logits, MXFP4 keys, second launch'), rows=rows)
    Path(path).write_text(json.dumps(rec, indent=1))
    print('wrote', path)

if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--json', help='write the results here')
    ap.add_argument('--quick', action='store_true',
                    help='tiny geometry, small contexts (runs under TRITON_INTERPRET=1)')
    ap.add_argument('--ncu', metavar='PATH',
                    help='Nsight Compute on the full scan, every version (or --versions); summary to PATH')
    ap.add_argument('--ncu-child', type=int, choices=(1, 2, 3), help=argparse.SUPPRESS)
    ap.add_argument('--versions', type=int, nargs='+', choices=(1, 2, 3),
                    help='MXFP4 key decodings to time in the full scan (default: the default one)')
    ap.add_argument('--sections', nargs='+', choices=SECTIONS, default=list(SECTIONS),
                    help='which measurements to run (default: all)')
    args = ap.parse_args()
    if args.ncu_child: ncu_child(args.ncu_child); sys.exit(0)
    if args.ncu: ncu_profile(args.ncu, args.versions or (1, 2, 3)); sys.exit(0)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if kernel_backend(torch.zeros(1, device=device)) != 'triton':
        raise SystemExit('needs a GPU, or TRITON_INTERPRET=1 on a CPU')
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    scan, sparse, recall_at, batch, rep = (((256, 1024), (512, 1024), (64, 128, 256, 512), 4, 10) if args.quick else
                                           ((8192, 131072, 524288), (131072, 524288),
                                            (16384, 32768, 65536, 131072, 262144, 524288), 32, 100))
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  '
          f'triton {triton.__version__}  config {"tiny" if args.quick else "bench"}')
    bw = copy_bandwidth(nbytes=(1 << 24) if args.quick else (2 << 30), device=device)
    print(f'copy bandwidth {bw / 1e9:.0f} GB/s\n\nfull-scan index logits, decode batch {batch}, '
          'MXFP4 keys + 4 B of logits per entry')
    if 'scan' not in args.sections: scan = ()
    if 'sparse' not in args.sections: sparse = ()
    if 'recall' not in args.sections: recall_at = ()
    scan_rows = [benchmark_index_logits(cfg, n, batch=batch, device=device, bandwidth=bw, rep=rep, version=v)
                 for v in (args.versions or [LOGITS_TUNING['version']]) for n in scan]
    print(f"{'version':>7s} {'context':>8s} {'us/query':>9s} {'floor us':>9s} {'of floor':>9s} {'GB/s':>7s}")
    for r in scan_rows:
        print(f"{r['version']:7d} {r['context']:8d} {r['us_per_query']:9.2f} {r['floor_us']:9.2f} {r['of_floor']:9.0%} "
              f"{r['GBps']:7.0f}")
    print(f"\nReindex layer selection per query token: whole context scored and masked to the pool vs the pool only "
          f"({cfg.candidate_topk_blocks} x {cfg.candidate_block_size} entries), each + top-{cfg.index_topk}")
    sd_rows = [benchmark_sparse_vs_dense(cfg, n, batch=batch, device=device, rep=rep) for n in sparse]
    print(f"{'context':>8s} {'dense us':>9s} {'sparse us':>10s} {'speed-up':>9s} {'full scan us':>13s}  same selection")
    for r in sd_rows:
        print(f"{r['context']:8d} {r['dense_us']:9.2f} {r['sparse_us']:10.2f} {r['speedup']:8.1f}x "
              f"{r['full_scan_us']:13.2f}  {r['same_selection']}")
    print(f"\ncandidate-stage recall: share of a Reindex layer's full-scan top-{cfg.index_topk} "
          "inside the source's pool (queries of the two layers correlated 0.5)")
    recall = {kind: [candidate_recall(cfg, n, kind, device=device) for n in recall_at]
              for kind in ('random', 'clustered')}
    print(f"{'context':>8s} {'random':>8s} {'clustered':>10s} {'pool/context':>13s}")
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    for i, n in enumerate(recall_at):
        print(f"{n:8d} {recall['random'][i]:8.3f} {recall['clustered'][i]:10.3f} {min(1, pool / n):13.3f}")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(device=machine, date=f'{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC', commit=git_commit(),
                           sections=args.sections, torch=torch.__version__,
                           triton=triton.__version__, copy_bandwidth=bw, full_scan=scan_rows, sparse_vs_dense=sd_rows,
                           recall=dict(contexts=list(recall_at), **recall)), f, indent=1)
