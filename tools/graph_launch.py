#!/usr/bin/env python
"""The host's time to launch each captured decode graph of the bench engine, alone: each graph replayed with the GPU
idle before it, timed from the call to its return (the launch) and to the GPU's end (launch and run).

    python tools/graph_launch.py [--experts 8] [--repeats 7] [--json out.json]

The engine is `tools/bench_engine.py`'s (`paged_llm`: random weights, CUDA graphs, async scheduling) with 256 requests
decoding; every capture size is captured, and then the largest that 256 requests use (256) is captured again last, to
tell a graph's size from its place in the capture order. Medians of `--repeats` launches. Needs a GPU."""
import argparse, dataclasses, datetime, json, statistics, sys, time
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import paged_llm, git_commit
from profile_engine import decode_ready
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name


def launch_times(replay, repeats: int) -> tuple:
    "(median launch microseconds, median launch-and-run milliseconds) of `replay`, the GPU idle before each"
    launch, run = [], []
    for _ in range(repeats):
        torch.cuda.synchronize(); a = time.perf_counter(); replay(); b = time.perf_counter()
        torch.cuda.synchronize(); launch.append((b - a) * 1e6); run.append((time.perf_counter() - a) * 1e3)
    return statistics.median(launch), statistics.median(run)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--experts', type=int, default=8, help='routed experts a layer (the launch, not the MoE, is timed)')
    ap.add_argument('--repeats', type=int, default=7)
    ap.add_argument('--json')
    args = ap.parse_args()
    if not torch.cuda.is_available(): sys.exit('graph_launch needs a GPU')
    if args.experts < 1 or args.repeats < 1: sys.exit('--experts and --repeats must be at least 1')
    cfg = dataclasses.replace(ModelConfig.bench(), n_routed_experts=args.experts)
    llm = paged_llm(cfg, 0, 'cuda', max_num_seqs=256, async_scheduling=True, max_model_len=256)
    eng = llm.llm_engine; model = eng.runner.model
    decode_ready(eng, 256, 128, 60, seed=1)
    model.capture_all()
    rows = []
    for size in sorted(model.graphs):
        us, ms = launch_times(model.graphs[size][0], args.repeats)
        rows.append(dict(size=size, launch_us=us, run_ms=ms)); print(f"size {size:4d}: launch {us:7.1f} us, "
                                                                     f"launch and run {ms:7.2f} ms", flush=True)
    del model.graphs[256]; model.capture_all([256])
    us, ms = launch_times(model.graphs[256][0], args.repeats)
    print(f"256 captured again, last: launch {us:.1f} us, launch and run {ms:.2f} ms")
    res = dict(machine=machine_name('cuda'), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', commit=git_commit(),
               torch=torch.__version__, triton=triton.__version__, experts=args.experts, sizes=rows,
               recaptured_256=dict(launch_us=us, run_ms=ms))
    if args.json: Path(args.json).write_text(json.dumps(res, indent=1) + '\n')


if __name__ == '__main__': main()
