#!/usr/bin/env python
"""Time the fused Triton MoE of 08b_fused_moe against the reference loop, a loop over BF16 weights, and the floor.

    python tools/bench_moe.py [--config bench] [--sizes 1 64 1024 8192] [--json out.json] [--sweep] [--prefetch]
                              [--planes] [--tiles dequantised] [--quick]

One row per batch size, all measured in one run: the median time of `fused_moe_experts`, the floor (the larger of the
bytes the layer must move over the measured copy bandwidth and its FLOPs over the measured BF16 matmul rate), the
fraction of the floor reached, and the speed-ups over the reference loop (`moe_experts_reference`, each expert
dequantised per call) and over the same loop with every expert dequantised to BF16 once. `--sweep` first times a small
grid of launch shapes per size and prints the best (the shapes `MOE_TUNING` should hold). `--tiles dequantised` times
the kernels' version 1 weight tiles (dequantised element by element) in place of version 2's (`tl.dot_scaled`); the run
checks the chosen tiles against the reference loop first. `--prefetch` also times each size's launch shape with the
gate/up loop's scales loaded a step ahead and in their step (`prefetch` on and off, alternating, the best of two
medians each). `--planes` times the layer with the gate/up stage of 08f_moe_planes (version 3: codes in planes;
version 4: the activations in pair order) against version 2 the same way, each checked against the reference first.
`--quick` runs the tiny config at small sizes, on a CPU under the Triton interpreter when there is no GPU: a check
of the script, not a measurement."""
import os, sys
if '--quick' in sys.argv and not os.environ.get('TRITON_INTERPRET'):
    import torch
    if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'   # before triton is imported
import argparse, datetime, json
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import median_time, machine_name
from dsv41_nb.moe import MoEWeights, route
from dsv41_nb.fused_moe import (MOE_TUNING, MOE_TILES, moe_launch_shape, fused_moe_experts,
                                benchmark_moe, format_moe_benchmark, check_fused_moe)

def sweep_shapes(cfg, sizes, device):
    "Fused-MoE median ms per launch shape of a small grid, per batch size; prints a table and returns the best per size"
    W, best = MoEWeights.random(cfg, 0, device), {}
    for T in sizes:
        x = torch.randn(T, cfg.dim, device=device).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        rows_per_expert = T * cfg.n_activated_experts / min(cfg.n_routed_experts, T * cfg.n_activated_experts)
        bms = [bm for bm in (16, 32, 64, 128) if bm <= 2 * max(16, rows_per_expert)][-2:]
        results = []
        for bm in bms:
            for bn, bk, warps in ((64, 128, 4), (32, 128, 4), (128, 64, 8), (64, 64, 8)):
                shape = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=3)
                try:
                    ms = median_time(lambda: fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit,
                                                               shape, check_ids=False)) * 1e3
                except Exception as e:
                    ms = float('nan')
                    print(f'  {T} tokens {shape}: failed ({type(e).__name__}: {str(e)[:80]})')
                results.append((ms, shape))
        ok = [r for r in results if r[0] == r[0]]
        best[T] = min(ok, key=lambda r: r[0]) if ok else (float('nan'), None)
        print(f'{T:6d} tokens: ' + '  '.join(f"{s['block_m']}/{s['block_n']}/{s['block_k']}/{s['num_warps']}w "
                                             f"{ms:.3f}" for ms, s in results))
        print(f'{"":14s}best {best[T][1]} at {best[T][0]:.3f} ms')
    return best

def alternately(calls: dict, rounds: int = 2) -> dict:
    "name -> the best of `rounds` medians (ms) of each call, the calls timed in turn"
    t = {k: [] for k in calls}
    for _ in range(rounds):
        for k, fn in calls.items(): t[k].append(median_time(fn) * 1e3)
    return {k: min(v) for k, v in t.items()}

def prefetch_ab(cfg, sizes, device):
    "Fused-MoE ms per size with the launch shape's `prefetch` off and on, measured alternately in one run"
    W, rows = MoEWeights.random(cfg, 0, device), []
    for T in sizes:
        x = (3 * torch.randn(T, cfg.dim, device=device)).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        shape = moe_launch_shape(ti.numel(), W.n_experts)
        t = alternately({p: lambda p=p: fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, dict(shape, prefetch=p),
                                                          check_ids=False) for p in (False, True)})
        rows.append(dict(tokens=T, block_m=shape['block_m'], default=shape.get('prefetch', False),
                         off_ms=t[False], on_ms=t[True]))
        r = rows[-1]
        print(f"{T:6d} tokens, {r['block_m']:3d}-row blocks: prefetch off {r['off_ms']:.3f} ms, "
              f"on {r['on_ms']:.3f} ms ({r['off_ms'] / r['on_ms']:.2f}x); default {'on' if r['default'] else 'off'}")
    return rows

def planes_ab(cfg, sizes, device):
    "Fused-MoE ms per size with the gate/up stage of versions 2, 3 (codes in planes) and 4 (pair order), alternately"
    from functools import partial
    from dsv41_nb.fused_moe import _fused_stages
    from dsv41_nb.moe_planes import plane_gate_up, PLANE_STEP
    if cfg.dim % PLANE_STEP:
        print(f"version 3 needs the model dim a multiple of {PLANE_STEP} (this config's is {cfg.dim}): not timed")
        return None
    W, rows = MoEWeights.random(cfg, 0, device), []
    stages = dict(v2=None, v3=plane_gate_up(W), v4=plane_gate_up(W, slots=True))
    for T in sizes:
        x = (3 * torch.randn(T, cfg.dim, device=device)).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        for g in list(stages.values())[1:]:
            check_fused_moe(x, tw, ti, W, cfg.swiglu_limit, stages=partial(_fused_stages, gate_up=g))
        t = alternately({v: lambda g=g: fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, check_ids=False,
                                                          gate_up=g) for v, g in stages.items()})
        rows.append(dict(tokens=T, v2_ms=t['v2'], v3_ms=t['v3'], v4_ms=t['v4']))
        print(f"{T:6d} tokens: version 2 {t['v2']:.3f} ms, version 3 {t['v3']:.3f} ms "
              f"({t['v2'] / t['v3']:.2f}x), version 4 {t['v4']:.3f} ms ({t['v2'] / t['v4']:.2f}x)")
    return rows

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--config', default='bench', choices=('bench', 'tiny', 'full'))
    ap.add_argument('--sizes', type=int, nargs='+', default=[1, 64, 1024, 8192])
    ap.add_argument('--json', help='write the rows (and the machine) to this file')
    ap.add_argument('--sweep', action='store_true', help='time a grid of launch shapes per size first')
    ap.add_argument('--prefetch', action='store_true', help="time the launch shapes with prefetch on and off")
    ap.add_argument('--planes', action='store_true',
                    help="time versions 3 and 4 of the gate/up stage against version 2")
    ap.add_argument('--tiles', default=MOE_TILES[0], choices=MOE_TILES,
                    help="the weight tiles: 'scaled' (version 2, tl.dot_scaled) or 'dequantised' (version 1)")
    ap.add_argument('--quick', action='store_true', help='tiny config, sizes 1 8 32: checks the script on any machine')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.quick: args.config, args.sizes = 'tiny', [1, 8, 32]
    elif device == 'cpu': sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    cfg = getattr(ModelConfig, args.config)()
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  '
          f'triton {triton.__version__}  config {args.config}: {cfg.n_routed_experts} experts, '
          f'top {cfg.n_activated_experts}, dim {cfg.dim}, inter {cfg.moe_inter_dim}')
    print('launch shapes:',
          {k: '/'.join(str(v[n]) for n in ('block_m', 'block_n', 'block_k', 'num_warps'))
           for k, v in MOE_TUNING.items()})
    print('weight tiles:', args.tiles)
    W = MoEWeights.random(cfg, 0, device)                                 # the tiles are checked before they are timed
    for T in [t for t in args.sizes if t <= 64]:
        x = (3 * torch.randn(T, cfg.dim, device=device)).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        r = check_fused_moe(x, tw, ti, W, cfg.swiglu_limit,
                            dict(moe_launch_shape(ti.numel(), W.n_experts), tiles=args.tiles))
        print(f"  {T} tokens: checked against the reference, max error {r['max_err']:.3g}, exact {r['exact']}")
    best = sweep_shapes(cfg, args.sizes, device) if args.sweep else None
    pf = prefetch_ab(cfg, args.sizes, device) if args.prefetch else None
    pl = planes_ab(cfg, args.sizes, device) if args.planes else None
    del W
    rows = benchmark_moe(cfg, args.sizes, device, tiles=args.tiles)
    print(f"copy {rows[0]['copy_TBps'] * 1e3:.0f} GB/s, BF16 matmul {rows[0]['bf16_TFLOPs']:.1f} TFLOP/s (measured)")
    print(format_moe_benchmark(rows))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(device=machine, date=str(datetime.date.today()), commit=git_commit(),
                           torch=torch.__version__, triton=triton.__version__, config=args.config,
                           tiles=args.tiles, tuning=MOE_TUNING,
                           sweep_best={str(k): v for k, v in (best or {}).items()}, prefetch=pf, planes=pl,
                           rows=rows), f, indent=1)
