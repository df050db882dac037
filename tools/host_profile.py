#!/usr/bin/env python
"""The host's part of a decode step, phase by phase, with no model: microseconds per step at each number of requests.

    python tools/host_profile.py [--config bench|tiny] [--requests 1 64 128 256] [--steps 60] [--clock wall|cpu]
                                 [--sync] [--general] [--json out.json]

The engine is `host_engine` of 13a_engine_speed: the real scheduler, runner, step-model bookkeeping and CUDA-graph
wrapper on the config's cache layout, with `NullStepModel.run` returning one-column logits at once, so that every
microsecond counted is the host's. `host_step_times` adds the requests (prompts of staggered lengths, so that block
boundaries spread over the steps as in serving), runs them into decode, and times `--steps` steps with `StepTimer`
(the engine's own methods: schedule, inputs, model host, sample, update, outputs, the wait for a step's ids, the
rest). `--clock cpu` counts the thread's CPU time instead of wall time (on a machine shared with other work the wall
clock also counts what they take). `--general` switches the one-pass decode paths off (the scheduler's `fast_decode`,
the runner's `fast`): the reference the fast paths replace."""
import argparse, datetime, json, os, platform, sys, time
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.host_steps import host_engine, host_step_times


def cpu_name() -> str:
    "The CPU, as the OS names it"
    try:
        with open('/proc/cpuinfo') as f:
            return next(l.split(':', 1)[1].strip() for l in f if l.startswith('model name'))
    except (OSError, StopIteration): return platform.processor() or platform.machine()


def loop_ms() -> float:
    "Milliseconds for a million turns of a plain Python loop, best of three: how fast the CPU is now"
    def once():
        t, s = time.perf_counter(), 0
        for i in range(1_000_000): s += i
        return time.perf_counter() - t
    return 1e3 * min(once() for _ in range(3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--config', default='bench', choices=('bench', 'tiny'))
    ap.add_argument('--requests', type=int, nargs='+', default=[1, 64, 128, 256])
    ap.add_argument('--steps', type=int, default=60)
    ap.add_argument('--max-model-len', type=int, default=224, help='the bench load test: 128 + 32 + 64')
    ap.add_argument('--clock', default='wall', choices=('wall', 'cpu'))
    ap.add_argument('--sync', action='store_true', help='synchronous scheduling (default: async)')
    ap.add_argument('--general', action='store_true', help='the general paths instead of the one-pass decode step')
    ap.add_argument('--json', help='write the table to this file')
    args = ap.parse_args()
    torch.set_num_threads(1)            # host work is one thread's; torch's pool would only add noise
    cfg = getattr(ModelConfig, args.config)()
    clock = time.thread_time_ns if args.clock == 'cpu' else time.perf_counter_ns
    rows, speed = {}, [loop_ms()]
    for n in args.requests:
        llm = host_engine(cfg, args.max_model_len, async_scheduling=not args.sync)
        if args.general: llm.llm_engine.scheduler.fast_decode = llm.llm_engine.runner.fast = False
        rows[n] = host_step_times(llm, n, args.steps, clock=clock)
    speed.append(loop_ms())
    head = (f"{cpu_name()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}; {args.config} layout, "
            f"{'sync' if args.sync else 'async'}, {'general paths' if args.general else 'fast paths'}, "
            f"{args.clock} clock, medians of {args.steps} steps; a million-turn Python loop took {speed[0]:.0f} ms "
            f"before, {speed[1]:.0f} ms after (this machine's speed now)")
    print(head)
    print(f"  {'us per step':14s}" + ''.join(f"{n:>9d}" for n in rows))
    for k in next(iter(rows.values())):
        print(f"  {k:14s}" + ''.join(f"{rows[n][k]:9.0f}" for n in rows))
    if args.json:
        json.dump(dict(header=head, machine=cpu_name(), args=vars(args), loop_ms=speed, rows=rows),
                  open(args.json, 'w'), indent=1)
        print('wrote', args.json)


if __name__ == '__main__':
    main()
