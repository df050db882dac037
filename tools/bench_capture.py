#!/usr/bin/env python
"""A fresh engine's first bursts of requests, its CUDA graphs captured when each padded size is first needed (lazily)
or all of them when the engine is built (`capture_at_start`, as vLLM does), with or without its prefill warm-up.

    python tools/bench_capture.py --mode lazy|graphs|start [--checkpoint checkpoints/small] [--bursts 1 8 64]
                                  [--prompt-len 64] [--max-tokens 32] [--json out.json [--label KEY]] [--quick]

The engine serves the small checkpoint on the GPU (CUDA graphs, async scheduling, up to 256 requests). It is built,
then sent bursts of requests one after another (each burst: that many random prompts at once, greedy, EOS ignored),
each burst a load test of its own: TTFT and TPOT percentiles, and the graphs captured while it ran. Lazily, a burst
that meets a new padded size waits for its capture (and for the Triton kernels it compiles). Mode `graphs`: built
with `capture_at_start` but no prefill warm-up, the engine holds every graph before the first request, but a prefill
shape compiles its kernels the first time a burst meets it; mode `start` (what `dsv41 bench` and `dsv41 serve` build):
graphs captured and prefill shapes warmed (`warm_up_prefill`). Run each mode in a process of its own. With an
empty TRITON_CACHE_DIR every kernel is compiled on first sight too (a first start); run again on the same cache, the
kernels load from it (a restart) and what is left of a burst's pause is the capture. The record counts the files in
the cache at the start. Writes the run to --json under --label (default: the mode), merged into the file's other runs.
--quick: the tiny config on the CPU, a check of the script (no graphs there)."""
import argparse, collections, contextlib, datetime, json, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit
from dsv41_nb.__main__ import load_test, random_prompts
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name
from dsv41_nb.launches import launch_keys
from dsv41_nb.engine import LLM
from dsv41_nb.engine_runs import graphs_held
from dsv41_nb.model import init_random
from dsv41_nb.scheduler import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
# each mode's engine arguments
MODES = dict(lazy=dict(capture_at_start=False, warm_up_prefill=False),
             graphs=dict(capture_at_start=True, warm_up_prefill=False),
             start=dict(capture_at_start=True, warm_up_prefill=True))


def captured(llm) -> int:
    "CUDA graphs the engine holds now, of every kind (`graphs_held`; 0 without graphs)"
    return sum(graphs_held(llm.llm_engine).values())


def merge_run(path, group: str, label: str, run: dict, **about):
    """Write `run` into the JSON record at `path` as `record[group][label]`, beside the runs already there, and the
    record's torch, commit and date (now) with `about` (machine, settings) at its top level"""
    path = Path(path)
    out = json.loads(path.read_text()) if path.exists() else {}
    out.update(torch=torch.__version__, commit=git_commit(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M'), **about)
    out.setdefault(group, {})[label] = run
    path.write_text(json.dumps(out, indent=1))


def compiled(cache: Path | None) -> collections.Counter:
    "Kernels compiled into a Triton cache, by name: one per specialization (a folder holding `<name>.json`)"
    if cache is None or not cache.is_dir(): return collections.Counter()
    return collections.Counter(f.stem for f in cache.glob('*/*.json') if not f.name.startswith('__grp__'))


def bursts(llm, sizes: list, prompt_len: int, max_tokens: int, device, cache: Path | None = None,
           seen: set | None = None) -> list:
    """One load test per burst size, in order, on the same engine: its summary, the graphs captured during it, and the
    kernels compiled into Triton's `cache` during it (by name: how many specializations). With `seen` (the launch keys
    met so far, `launch_keys`), also the keys each burst meets first, as text: what it compiles on a fresh cache"""
    sp, rows = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), []
    for i, n in enumerate(sizes):
        before, kernels = captured(llm), compiled(cache)
        with launch_keys() if seen is not None else contextlib.nullcontext({}) as keys:
            s = load_test(llm, random_prompts(n, prompt_len, seed=i), sp)
            if device.type == 'cuda': torch.cuda.synchronize()
        rows.append(dict(requests=n, seconds=s['seconds'], ttft_s=s['ttft_s'], tpot_s=s['tpot_s'],
                         tokens_per_s=s['output_tokens_per_s'], captured=captured(llm) - before,
                         compiled=dict(compiled(cache) - kernels)))
        if seen is not None:
            rows[-1]['new_keys'] = sorted(map(str, set(keys) - seen)); seen |= set(keys)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--mode', choices=tuple(MODES), required=True)
    ap.add_argument('--checkpoint', default=str(ROOT / 'checkpoints' / 'small'))
    ap.add_argument('--bursts', type=int, nargs='+', default=[1, 8, 64])
    ap.add_argument('--prompt-len', type=int, default=64)
    ap.add_argument('--max-tokens', type=int, default=32)
    ap.add_argument('--json', help='write (merge) the record here')
    ap.add_argument('--label', help="the run's key in the record (default: the mode)")
    ap.add_argument('--keys', action='store_true',
                    help="note every kernel launch's specialization (`launch_keys`; slows eager steps): the ones "
                         "each burst meets first are what it compiles on a fresh cache")
    ap.add_argument('--quick', action='store_true', help='tiny config on the CPU: checks the script')
    args = ap.parse_args()
    if any(n < 1 for n in args.bursts): ap.error(f"--bursts: each must be >= 1, got {args.bursts}")
    device = torch.device('cpu' if args.quick or not torch.cuda.is_available() else 'cuda')
    cache = Path(os.environ.get('TRITON_CACHE_DIR') or Path.home() / '.triton' / 'cache')
    cached = sum(1 for f in cache.rglob('*') if f.is_file()) if cache.is_dir() else 0
    model = init_random(ModelConfig.tiny(), seed=0) if args.quick else args.checkpoint
    t0 = time.perf_counter()
    with launch_keys() if args.keys else contextlib.nullcontext({}) as at_build:
        llm = LLM(model, device=device, max_num_seqs=256, async_scheduling=True, **MODES[args.mode],
                  **({'kernels': 'torch', 'max_num_batched_tokens': 64} if args.quick else {}))
        if device.type == 'cuda': torch.cuda.synchronize()
    build = time.perf_counter() - t0
    rec = dict(mode=args.mode, build_s=build, captured_at_build=captured(llm), triton_cache_files=cached,
               warmed_prefill=llm.llm_engine.start_up.get('prefill', []),
               rows=bursts(llm, args.bursts, args.prompt_len, args.max_tokens, device, cache,
                           set(at_build) if args.keys else None))
    if args.keys: rec['keys_at_build'] = len(at_build)
    print(f"{machine_name(device)}, {args.mode}, {cached} files in the Triton cache: built in {build:.1f} s, "
          f"{rec['captured_at_build']} graphs, {len(rec['warmed_prefill'])} prefill steps warmed")
    for r in rec['rows']:
        t, p = r['ttft_s'], r['tpot_s']
        print(f"  {r['requests']:4d} requests: {r['seconds']:6.2f} s, TTFT p50/p99 {1e3 * t[50]:7.1f}/"
              f"{1e3 * t[99]:7.1f} ms, TPOT p50 {1e3 * p[50]:6.2f} ms, {r['captured']} graphs captured, "
              f"{sum(r['compiled'].values())} kernels compiled {r['compiled'] or ''}")
        for k in r.get('new_keys', []): print('    first met:', k)
    if args.json:
        merge_run(args.json, 'modes', args.label or args.mode, rec, machine=machine_name(device),
                  settings=dict(bursts=args.bursts, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                                checkpoint=Path(args.checkpoint).name, async_scheduling=True))


if __name__ == '__main__':
    main()
