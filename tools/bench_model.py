#!/usr/bin/env python
"""Run the reference model of 10_model_forward_block a layer at a time: activation RMS after every layer and seconds per
layer.

    python tools/bench_model.py [--config bench] [--tokens 1024] [--seed 0] [--json out.json] [--quick]

`streamed_layer_rms` builds one block at a time on the device (values from `init_value`, so the same model as
`init_random`), runs it on the residual streams, records the RMS of the copies it leaves, and frees it: the `bench`
geometry (about 100 B parameters, 194 GiB as BF16 masters) never has to fit at once. One row per layer: role, compress
ratio, RMS, seconds to initialise the layer and seconds to run it (the reference path: dense masked attention, the
per-expert loop, FP8/FP4 rounding on). `--quick` runs the tiny config on 64 tokens on the CPU: a check of the script,
not a measurement."""
import argparse, datetime, json, sys, time
import torch
from dsv41_nb.config import ModelConfig, layer_topology
from dsv41_nb.dispatch import machine_name
from dsv41_nb.model_forward_block import streamed_layer_rms

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--config', default='bench', choices=('bench', 'tiny'))
    ap.add_argument('--tokens', type=int, default=1024)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--json', help='write the rows (and the machine) to this file')
    ap.add_argument('--quick', action='store_true', help='tiny config, 64 tokens, on the CPU: checks the script')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() and not args.quick else 'cpu'
    if args.quick: args.config, args.tokens = 'tiny', 64
    elif device == 'cpu': sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    cfg = getattr(ModelConfig, args.config)()
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  '
          f'config {args.config}: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} '
          f'experts, {args.tokens} tokens, seed {args.seed}')
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    timings, t0 = [], time.perf_counter()
    rms = streamed_layer_rms(cfg, ids, args.seed, device, timings)
    total = time.perf_counter() - t0
    topo = layer_topology(cfg)
    rows = [dict(layer=i, role=topo[i].role, ratio=topo[i].ratio, engram=topo[i].engram, rms=r, init_s=a, run_s=b)
            for i, (r, (a, b)) in enumerate(zip(rms, timings))]
    print(f"{'layer':>5} {'role':8s} {'ratio':>5} {'engram':>6} {'rms':>6} {'init s':>8} {'run s':>8}")
    for r in rows:
        print(f"{r['layer']:5d} {r['role']:8s} {r['ratio']:5d} {'yes' if r['engram'] else '':>6} {r['rms']:6.3f} "
              f"{r['init_s']:8.3f} {r['run_s']:8.3f}")
    run_s = sum(r['run_s'] for r in rows)
    print(f'total {total:.1f} s; running the layers {run_s:.1f} s ({run_s / len(rows) * 1e3:.0f} ms per layer, '
          f'{args.tokens / run_s:,.0f} tokens/s through the reference path)')
    bad = [r['layer'] for r in rows if not 0.9 < r['rms'] < 2]
    print('RMS within (0.9, 2) after every layer' if not bad else f'RMS outside (0.9, 2) after layers {bad}')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(machine=machine, date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', torch=torch.__version__,
                           config=args.config, tokens=args.tokens, seed=args.seed, total_s=total, rows=rows),
                      f, indent=1)
        print('wrote', args.json)
