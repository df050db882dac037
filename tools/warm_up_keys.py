#!/usr/bin/env python
"""The kernel specializations a burst of requests meets that the engine's start-up warm-up did not: what a first
start compiles inside those requests' TTFT. Each Triton launch is noted by its specialization (`launch_keys`), during
the build and during the burst.

    python tools/warm_up_keys.py --warm-up steps|one-prompt [--max-model-len 40] [--budget 128] [--burst 8 16]
                                 [--config tiny] [--json out.json [--label KEY]]

`steps`: the engine's warm-up (`warm_up_steps`: every token-count class of the step's budget, several prompts in a
step above the longest prompt); `one-prompt`: one prompt a step, capped at the longest prompt (the warm-up as it was
first built). The burst is N prompts of L tokens sent at once, one token each (a prefill step, nothing decoded: on a
GPU the decode steps replay graphs captured at start). On a CPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1 is set when there is no GPU): slow (minutes at the tiny config) but the same launches."""
import argparse, os, sys, time
from pathlib import Path
import torch
if not torch.cuda.is_available(): os.environ.setdefault('TRITON_INTERPRET', '1')
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import merge_run
from dsv41_nb.__main__ import load_test, random_prompts
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name
from dsv41_nb.launches import launch_keys
from dsv41_nb.engine import LLM
from dsv41_nb.engine_runs import warm_up_lengths
from dsv41_nb.model import init_random
from dsv41_nb.scheduler import SamplingParams


def nearest_difference(key: tuple, seen) -> list:
    "Where `key` differs from the nearest key of the same kernel in `seen`: [(position, before, now)]"
    same = [k for k in seen if k[0] == key[0]]
    if not same: return []
    flat = lambda k: k[1] + k[2]
    best = min(same, key=lambda k: sum(a != b for a, b in zip(flat(k), flat(key))))
    return [(i, str(a), str(b)) for i, (a, b) in enumerate(zip(flat(best), flat(key))) if a != b]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--warm-up', choices=('steps', 'one-prompt'), required=True)
    ap.add_argument('--config', default='tiny', choices=('tiny', 'bench'))
    ap.add_argument('--max-model-len', type=int, default=40)
    ap.add_argument('--budget', type=int, default=128, help='max_num_batched_tokens')
    ap.add_argument('--burst', type=int, nargs=2, default=[8, 16], metavar=('N', 'L'))
    ap.add_argument('--json'); ap.add_argument('--label')
    args = ap.parse_args()
    if min(args.burst) < 1 or args.burst[1] >= args.max_model_len:
        ap.error(f"--burst {args.burst}: N >= 1 prompts of 1 to max_model_len - 1 tokens")
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    model = init_random(getattr(ModelConfig, args.config)(), seed=0, device=device)
    kw = dict(kernels='triton', runner='paged', max_num_seqs=256, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.budget, device=device, async_scheduling=True)
    t0 = time.perf_counter()
    with launch_keys() as at_build:
        llm = LLM(model, warm_up_prefill=args.warm_up == 'steps', **kw)
        if args.warm_up == 'one-prompt':
            llm.llm_engine.warm_up_prefill(warm_up_lengths(args.budget, args.max_model_len - 1))
    build = time.perf_counter() - t0
    n, L = args.burst
    t0 = time.perf_counter()
    with launch_keys() as burst:
        load_test(llm, random_prompts(n, L, seed=0), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    new = sorted(set(burst) - set(at_build))
    rec = dict(warm_up=args.warm_up, steps=[len(s) for s in llm.llm_engine.start_up.get('prefill', [])] or None,
               build_s=build, burst_s=time.perf_counter() - t0, keys_at_build=len(at_build),
               launches_at_build=sum(at_build.values()), keys_in_burst=len(burst),
               new=[dict(kernel=k[0], key=str(k), differs=nearest_difference(k, at_build)) for k in new])
    print(f"{machine_name(device)}, {args.config}, max_model_len {args.max_model_len}, budget {args.budget}, "
          f"warm-up {args.warm_up}: {len(at_build)} specializations at build ({build:.0f} s); a burst of {n} x {L} "
          f"tokens met {len(burst)}, {len(new)} of them new")
    for r in rec['new']: print(f"  {r['kernel']}: {r['differs'] or 'a kernel the build never launched'}")
    if args.json:
        merge_run(args.json, 'runs', args.label or args.warm_up, rec, machine=machine_name(device),
                  settings=dict(config=args.config, max_model_len=args.max_model_len, budget=args.budget,
                                burst=args.burst))


if __name__ == '__main__':
    main()
