#!/usr/bin/env python
"""The host's time to launch each captured decode graph of the bench engine, alone: each graph replayed with the GPU
idle before it, timed from the call to its return (the launch) and to the GPU's end (launch and run).

    python tools/graph_launch.py [--experts 8] [--repeats 7] [--sizes 128 256] [--json out.json] [--quick]

The engine is `tools/bench_engine.py`'s (`paged_llm`: random weights, CUDA graphs, async scheduling) with 256 requests
decoding; every capture size is captured, and then the largest that 256 requests use (256) is captured again last, to
tell a graph's size from its place in the capture order. Beside each launch: a small kernel launched right behind it and
a second launch of the graph behind the first, whose host times say whether a launch waits for room behind queued work.
Medians of `--repeats` launches. Needs a GPU; `--quick` runs the tiny config on the CPU (emulated graphs, 8 requests):
a check of the script, not a measurement."""
import argparse, contextlib, dataclasses, datetime, json, statistics, sys, time
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import paged_llm, git_commit
from profile_engine import decode_ready, sync
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name, use_kernels
from dsv41_nb.cuda_graphs import CUDAGraphModel


def launch_times(replay, repeats: int, device='cuda') -> dict:
    """Medians of `repeats` replays of `replay`, the GPU idle before each: the launch (`launch_us`, host time), then one
    small kernel launched behind it (`after_us`: whether a launch waits for room behind the graph's work), launch and
    run (`run_ms`); and a second launch right behind the first, before it has run (`behind_us`)"""
    x, rows = torch.zeros(1, device=device), []
    for _ in range(repeats):
        sync(device); a = time.perf_counter(); replay(); b = time.perf_counter()
        x.add_(1); c = time.perf_counter(); sync(device); d = time.perf_counter()
        replay(); e = time.perf_counter(); replay(); f = time.perf_counter(); sync(device)
        rows.append(dict(launch_us=(b - a) * 1e6, after_us=(c - b) * 1e6, run_ms=(d - a) * 1e3,
                         behind_us=(f - e) * 1e6))
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def described(r: dict) -> str:
    return (f"size {r.get('size', 256):4d}: launch {r['launch_us']:7.1f} us, a kernel behind it "
            f"{r['after_us']:7.1f} us, launch and run {r['run_ms']:6.2f} ms, a launch behind a launch "
            f"{r['behind_us']:7.1f} us")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--experts', type=int, default=8, help='routed experts a layer (the launch, not the MoE, is timed)')
    ap.add_argument('--repeats', type=int, default=7)
    ap.add_argument('--sizes', type=int, nargs='+', help='capture sizes to time (default: all up to 512)')
    ap.add_argument('--json')
    ap.add_argument('--quick', action='store_true', help='tiny config on the CPU: a check of the script')
    args = ap.parse_args(argv)
    if args.experts < 1 or args.repeats < 1: ap.error('--experts and --repeats must be at least 1')
    if not (args.quick or torch.cuda.is_available()): ap.error('graph_launch needs a GPU (or --quick)')
    # on the CPU every kernel the PyTorch reference (the interpreter would take minutes)
    with use_kernels('torch') if args.quick else contextlib.nullcontext(): return measure(args, ap)


def measure(args, ap) -> dict:
    "The launches of `main`'s arguments, timed; the record (written to --json if given)"
    device = 'cpu' if args.quick else 'cuda'
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    cfg = dataclasses.replace(cfg, n_routed_experts=args.experts)
    n, mml = (8, 64) if args.quick else (256, 256)
    llm = paged_llm(cfg, 0, device, max_num_seqs=n, async_scheduling=True, max_model_len=mml,
                    **(dict(kernels='torch') if args.quick else {}))
    eng = llm.llm_engine
    if args.quick:                                          # no GPU: the graph wrapper emulated
        eng.runner.model = CUDAGraphModel(eng.runner.model, eng.kv_cache_config, mml, emulate=True)
    model = eng.runner.model
    decode_ready(eng, n, 16 if args.quick else 128, 40 if args.quick else 60, seed=1)
    bad = [s for s in args.sizes or () if s not in model.sizes or s > 2 * n]
    if bad: ap.error(f'--sizes {bad}: not capture sizes up to {2 * n} ({model.sizes})')
    model.capture_all(args.sizes or [s for s in model.sizes if s <= 2 * n])
    rows = []
    for size in sorted(args.sizes or model.graphs):
        rows.append(dict(size=size, **launch_times(model.graphs[size][0], args.repeats, device)))
        print(described(rows[-1]), flush=True)
    del model.graphs[n]; model.capture_all([n])
    again = launch_times(model.graphs[n][0], args.repeats, device)
    print(f'{n} captured again, last:', described(dict(again, size=n)))
    res = dict(machine=machine_name(device), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', commit=git_commit(),
               torch=torch.__version__, triton=triton.__version__, experts=args.experts, sizes=rows,
               **{f'recaptured_{n}': again})
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1) + '\n')
    return res


if __name__ == '__main__': main()
