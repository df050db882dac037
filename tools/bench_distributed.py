#!/usr/bin/env python
"""Time the expert-parallel MoE of 15_distributed on two GPUs (NCCL): the all-to-alls, the layer, and one GPU alone.

    python tools/bench_distributed.py [--world-size 2] [--config bench] [--sizes 1 64 1024 8192] [--json PATH] [--quick]

One row per batch size (tokens per rank), all measured in one run of `world_size` processes, one GPU each: the dispatch
all-to-all (FP8 token records with expert id and weight) and the combine all-to-all (BF16 expert outputs) timed alone,
with the bytes each rank sends to the others and the bandwidth that implies; the expert-parallel layer
(`ep_moe_forward`); and 08b_fused_moe's `moe_forward` on one GPU holding every expert, for the same per-rank batch and
for all ranks' batches together. Every call starts with all ranks at a barrier; each rank takes the median over the
repetitions and the table reports the slowest rank. Each size also checks that the layer's output equals the
one-process simulation (`ep_moe_simulated`) bit for bit, and reports its largest difference from one GPU's layer.
`--quick` runs the tiny config at small sizes with gloo on CPU processes (under the Triton interpreter when there is no
GPU): a check of the script, not a measurement."""
import os, sys
if '--quick' in sys.argv and not os.environ.get('TRITON_INTERPRET'):
    import torch
    if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'   # before triton is imported
import argparse, datetime, json, statistics, time
import torch, triton
import torch.distributed as dist
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name
from dsv41_nb.moe import MoEWeights, route_layer
from dsv41_nb.fused_moe import moe_forward
from dsv41_nb.distributed import (run_ranks, rank_device, local_experts, dispatch_order, pack_dispatch, exchange,
                                  ep_moe_forward, ep_moe_simulated)

def timed(fn, reps: int, warmup: int) -> float:
    "Median seconds of `fn` on this rank, every call started by all ranks together; the slowest rank's median"
    dev = rank_device()
    sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
    for _ in range(warmup): fn()
    times = []
    for _ in range(reps):
        dist.barrier(); sync()
        t = time.perf_counter(); fn(); sync(); times.append(time.perf_counter() - t)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()

def mean_over_ranks(v: float) -> float:
    t = torch.tensor([float(v)], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()

def max_over_ranks(v: float) -> float:
    t = torch.tensor([float(v)], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()

def bench_rank(config: str, sizes: list, reps: int, warmup: int, seed: int = 0) -> list:
    "Job run on every rank: one row per size (identical on every rank after the reductions)"
    rank, world_size, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    cfg = getattr(ModelConfig, config)()
    W = MoEWeights.random(cfg, seed, dev)                 # one seed: the same layer on every rank
    mine = local_experts(W, rank, world_size)
    rows = []
    for B in sizes:
        gens = [torch.Generator(device=dev).manual_seed(seed + 7919 * r + B) for r in range(world_size)]
        xs = [torch.randn(B, cfg.dim, generator=g, device=dev).to(torch.bfloat16) for g in gens]   # every rank's batch
        x = xs[rank]
        y = ep_moe_forward(x, mine, cfg)
        exact = mean_over_ranks(torch.equal(y, ep_moe_simulated(xs, W, cfg)['outs'][rank])) == 1
        one = moe_forward(x, W, cfg).float()
        rel = max_over_ranks((y.float() - one).abs().max().item() / max(one.abs().max().item(), 1e-30) if B else 0.0)
        weights, ids = route_layer(x, W, cfg)
        order, send = dispatch_order(ids, cfg.n_routed_experts, world_size)
        recv = torch.empty_like(send); dist.all_to_all_single(recv, send)
        sc, rc = send.tolist(), recv.tolist()
        records = pack_dispatch(x, weights, ids, order, mine.w1.shape[0])
        outputs = torch.randn(sum(rc), cfg.dim, device=dev).to(torch.bfloat16)      # what the experts send back
        off_rank = sum(sc) - sc[rank]
        out_bytes = mean_over_ranks(off_rank * records.shape[1])
        back_bytes = mean_over_ranks((sum(rc) - rc[rank]) * 2 * cfg.dim)
        t_out = timed(lambda: exchange(records, sc, rc), reps, warmup)
        t_back = timed(lambda: exchange(outputs, rc, sc), reps, warmup)
        t_ep = timed(lambda: ep_moe_forward(x, mine, cfg), reps, warmup)
        t_one = timed(lambda: moe_forward(x, W, cfg), reps, warmup)
        x_all = torch.cat(xs)
        t_all = timed(lambda: moe_forward(x_all, W, cfg), reps, warmup)
        rows.append(dict(tokens=B, rows_off_rank=mean_over_ranks(off_rank), dispatch_bytes=out_bytes,
                         combine_bytes=back_bytes, dispatch_ms=t_out * 1e3, combine_ms=t_back * 1e3,
                         dispatch_GBps=out_bytes / t_out / 1e9, combine_GBps=back_bytes / t_back / 1e9,
                         ep_ms=t_ep * 1e3, one_gpu_ms=t_one * 1e3, one_gpu_all_ms=t_all * 1e3,
                         equals_simulation=exact, max_rel_diff_one_gpu=rel))
    return rows

def format_table(rows) -> str:
    cols = ('tokens/rank', 'rows out', 'out MB', 'out ms', 'out GB/s', 'back MB', 'back ms', 'back GB/s', 'EP ms',
            '1 GPU ms', '1 GPU all', 'EP/1 GPU')
    line = lambda r: (f"{r['tokens']:>11d} {r['rows_off_rank']:>9.1f} {r['dispatch_bytes'] / 1e6:>9.2f} "
                      f"{r['dispatch_ms']:>9.3f} {r['dispatch_GBps']:>9.1f} {r['combine_bytes'] / 1e6:>9.2f} "
                      f"{r['combine_ms']:>9.3f} {r['combine_GBps']:>9.1f} {r['ep_ms']:>9.3f} {r['one_gpu_ms']:>9.3f} "
                      f"{r['one_gpu_all_ms']:>9.3f} {r['ep_ms'] / r['one_gpu_ms']:>8.2f}x")
    same = all(r['equals_simulation'] for r in rows)
    note = (f"EP output equals the one-process simulation bit for bit at every size: {same}; "
            "largest difference from one GPU's moe_forward, relative to its largest output: "
            f"{max(r['max_rel_diff_one_gpu'] for r in rows):.1e}")
    return '\n'.join([' '.join(f'{c:>9s}' for c in cols)] + [line(r) for r in rows] + [note])

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--world-size', '--world', type=int, default=2, help='ranks, one GPU each')
    ap.add_argument('--config', default='bench', choices=('bench', 'tiny'))
    ap.add_argument('--sizes', type=int, nargs='+', default=[1, 64, 1024, 8192], help='tokens per rank')
    ap.add_argument('--reps', type=int, default=20)
    ap.add_argument('--json', help='write the rows (and the machine) to this file')
    ap.add_argument('--quick', action='store_true', help='tiny config, sizes 1 8 32, gloo: checks the script anywhere')
    args = ap.parse_args()
    backend = 'nccl' if torch.cuda.is_available() and not args.quick else 'gloo'
    if args.quick: args.config, args.sizes, args.reps = 'tiny', [1, 8, 32], 2
    elif not torch.cuda.is_available():
        sys.exit('this benchmark needs GPUs (use --quick to check the script on a CPU)')
    elif torch.cuda.device_count() < args.world_size:  # a one-GPU machine has nothing to measure here: not a failure
        print(f'expert parallelism over {args.world_size} ranks needs {args.world_size} GPUs, this machine has '
              f'{torch.cuda.device_count()}: nothing measured')
        sys.exit(0)
    cfg = getattr(ModelConfig, args.config)()
    machine = machine_name('cuda' if backend == 'nccl' else 'cpu')
    print(f'{machine} x{args.world_size} ({backend})  {datetime.datetime.now():%Y-%m-%d %H:%M}  '
          f'torch {torch.__version__}  '
          f'triton {triton.__version__}  config {args.config}: {cfg.n_routed_experts} experts, '
          f'top {cfg.n_activated_experts}, dim {cfg.dim}, inter {cfg.moe_inter_dim}')
    rows = run_ranks([(bench_rank, (args.config, args.sizes, args.reps, 1 if args.quick else 5))],
                     world_size=args.world_size, backend=backend, timeout_s=600)[0][0]
    table = format_table(rows)
    print(table)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(machine=machine, world=args.world_size, backend=backend, date=str(datetime.date.today()),
                           torch=torch.__version__, triton=triton.__version__, config=args.config, table=table,
                           rows=rows), f, indent=1)
