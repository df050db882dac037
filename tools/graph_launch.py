#!/usr/bin/env python
"""The host's time to launch each captured decode graph of the bench engine, alone: each graph replayed with the GPU
idle before it, timed from the call to its return (the launch) and to the GPU's end (launch and run).

    python tools/graph_launch.py [--experts 8] [--repeats 7] [--sizes 128 256] [--json out.json]

The engine is `tools/bench_engine.py`'s (`paged_llm`: random weights, CUDA graphs, async scheduling) with 256 requests
decoding; every capture size is captured, and then the largest that 256 requests use (256) is captured again last, to
tell a graph's size from its place in the capture order. Beside each launch: a small kernel launched right behind it and
a second launch of the graph behind the first, whose host times say whether a launch waits for room behind queued work.
Medians of `--repeats` launches. Needs a GPU."""
import argparse, dataclasses, datetime, json, statistics, sys, time
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import paged_llm, git_commit
from profile_engine import decode_ready
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name


def launch_times(replay, repeats: int) -> dict:
    """Medians of `repeats` replays of `replay`, the GPU idle before each: the launch (`launch_us`, host time), then one
    small kernel launched behind it (`after_us`: whether a launch waits for room behind the graph's work), launch and
    run (`run_ms`); and a second launch right behind the first, before it has run (`behind_us`)"""
    x, rows = torch.zeros(1, device='cuda'), []
    for _ in range(repeats):
        torch.cuda.synchronize(); a = time.perf_counter(); replay(); b = time.perf_counter()
        x.add_(1); c = time.perf_counter(); torch.cuda.synchronize(); d = time.perf_counter()
        replay(); e = time.perf_counter(); replay(); f = time.perf_counter(); torch.cuda.synchronize()
        rows.append(dict(launch_us=(b - a) * 1e6, after_us=(c - b) * 1e6, run_ms=(d - a) * 1e3,
                         behind_us=(f - e) * 1e6))
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def described(r: dict) -> str:
    return (f"size {r.get('size', 256):4d}: launch {r['launch_us']:7.1f} us, a kernel behind it "
            f"{r['after_us']:7.1f} us, launch and run {r['run_ms']:6.2f} ms, a launch behind a launch "
            f"{r['behind_us']:7.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--experts', type=int, default=8, help='routed experts a layer (the launch, not the MoE, is timed)')
    ap.add_argument('--repeats', type=int, default=7)
    ap.add_argument('--sizes', type=int, nargs='+', help='capture sizes to time (default: all up to 512)')
    ap.add_argument('--json')
    args = ap.parse_args()
    if not torch.cuda.is_available(): sys.exit('graph_launch needs a GPU')
    if args.experts < 1 or args.repeats < 1: sys.exit('--experts and --repeats must be at least 1')
    cfg = dataclasses.replace(ModelConfig.bench(), n_routed_experts=args.experts)
    llm = paged_llm(cfg, 0, 'cuda', max_num_seqs=256, async_scheduling=True, max_model_len=256)
    eng = llm.llm_engine; model = eng.runner.model
    decode_ready(eng, 256, 128, 60, seed=1)
    bad = [s for s in args.sizes or () if s not in model.sizes]
    if bad: sys.exit(f'--sizes {bad}: not capture sizes {model.sizes}')
    model.capture_all(args.sizes)
    rows = []
    for size in sorted(args.sizes or model.graphs):
        rows.append(dict(size=size, **launch_times(model.graphs[size][0], args.repeats)))
        print(described(rows[-1]), flush=True)
    del model.graphs[256]; model.capture_all([256])
    again = launch_times(model.graphs[256][0], args.repeats)
    print('256 captured again, last:', described(again))
    res = dict(machine=machine_name('cuda'), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', commit=git_commit(),
               torch=torch.__version__, triton=triton.__version__, experts=args.experts, sizes=rows,
               recaptured_256=again)
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
