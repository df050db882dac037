#!/usr/bin/env python
"""Time the fused Triton MoE of 08b_fused_moe against the reference loop, a loop over BF16 weights, and the floor
(the measurement of 08b_fused_moe_measured).

    python tools/bench_moe.py [--config bench] [--sizes 1 64 1024 8192] [--json out.json] [--sweep] [--prefetch]
                              [--planes] [--tiles dequantised] [--peer] [--quick]

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
`--peer` times only the served layer (`served_moe`: the router, GEMVs up to four tokens, the fused MoE on planes
above) against the same layer in PyTorch on BF16 weights (`torch._grouped_mm`), each checked against the reference
loop first, and records both against the served layer's floor.
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
                                check_fused_moe)
from dsv41_nb.fused_moe_measured import benchmark_moe, format_moe_benchmark

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

def grouped_peer(cfg, W):
    """The same MoE layer as PyTorch runs it on BF16 weights, the peer the fused kernels are held to: the router,
    `torch._grouped_mm` over the assignments sorted by expert (10_model_forward_block's `sort_by_expert`), gate and up
    as one grouped product on the stacked weights, the down product, and the shared expert on cuBLAS. It reads BF16
    weights: 16 bits a routed weight against the 4.25 of the MXFP4 codes and their scales."""
    import torch.nn.functional as F
    from dsv41_nb.model_forward_block import sort_by_expert
    deq = lambda n: torch.stack([getattr(W, n).dequantize(e).to(torch.bfloat16) for e in range(getattr(W, n).shape[0])])
    w13 = torch.cat([deq('w1'), deq('w3')], 1).transpose(1, 2)         # (E, dim, 2 inter): column-major per expert
    w2 = deq('w2').transpose(1, 2)                                      # (E, inter, dim)
    sw1, sw3, sw2 = (deq(f'shared_{n}')[0] for n in ('w1', 'w3', 'w2'))
    inter, lim = w2.shape[1], cfg.swiglu_limit

    def glu(g, u):
        g, u = g.float(), u.float()
        if lim > 0: g, u = g.clamp(max=lim), u.clamp(-lim, lim)
        return F.silu(g) * u

    def run(x, routing=None):                                        # routing: (weights, ids), else routed here
        tw, ti = routing or route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        order, offs = sort_by_expert(ti, W.n_experts)
        rows = order // ti.shape[1]
        gu = torch._grouped_mm(x[rows], w13, offs=offs)
        h = (glu(gu[:, :inter], gu[:, inter:]) * tw.flatten()[order, None]).to(torch.bfloat16)
        y = torch.zeros(x.shape, device=x.device).index_add_(0, rows, torch._grouped_mm(h, w2, offs=offs).float())
        hs = glu(F.linear(x, sw1), F.linear(x, sw3)).to(torch.bfloat16)
        return (y + F.linear(hs, sw2).float()).to(torch.bfloat16)
    return run

def rel_err(a, b) -> float: return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))

def peer_ab(cfg, sizes, device):
    """The served MoE layer (`served_moe` of 10b_paged: the router, GEMVs up to four tokens, else the fused MoE on
    planes) against `grouped_peer`, alternately at each size, both replayed from CUDA graphs and checked against the
    reference loop first; with the served layer's floor (`moe_bytes_flops`, measured copy and BF16 rates)"""
    from types import SimpleNamespace
    from dsv41_nb.moe import moe_bytes_flops, moe_experts_reference, fp8_qdq
    from dsv41_nb.dispatch import copy_bandwidth
    from dsv41_nb.launches import graph_time
    from dsv41_nb.fused_moe_measured import bf16_matmul_rate
    from dsv41_nb.paged import served_moe
    on_gpu = device == 'cuda'
    W = MoEWeights.random(cfg, 0, device)
    layer = SimpleNamespace(moe=MoEWeights.random(cfg, 0, device))   # served_moe turns its weights into planes
    peer = grouped_peer(cfg, W)
    bw = copy_bandwidth(2 * 2**30 if on_gpu else 2**24, device)
    rate = bf16_matmul_rate(8192 if on_gpu else 256, device)
    rows = []
    for T in sizes:
        g = torch.Generator(device=device).manual_seed(T)
        x = torch.randn(T, cfg.dim, device=device, generator=g).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        want = moe_experts_reference(x, tw, ti, W, cfg.swiglu_limit)
        # the reference rounds the activations to FP8 (the recipe's): the peer is checked on the same rounded input,
        # routed as x was (rounded, a token near a tie could choose another expert)
        e_peer = rel_err(peer(fp8_qdq(x).to(torch.bfloat16), (tw, ti)), want)
        e_served = rel_err(served_moe(layer, x, cfg), want)
        if max(e_served, e_peer) > 0.05:
            raise RuntimeError(f"{T} tokens: relative error against the reference loop: served {e_served:.3g}, "
                               f"peer {e_peer:.3g} (> 0.05)")
        t = {}
        for _ in range(2):                                   # in turn, the better of two graph medians each
            for k, fn in (('served', lambda i: served_moe(layer, x, cfg)), ('peer', lambda i: peer(x))):
                t[k] = min(t.get(k, float('inf')), graph_time(fn, calls=8) * 1e3)
        nbytes, flops = moe_bytes_flops(cfg, T, ti.unique().numel())
        floor = max(nbytes / bw, flops / rate) * 1e3
        rows.append(dict(tokens=T, served_ms=t['served'], peer_ms=t['peer'], floor_ms=floor,
                         bound='bytes' if nbytes / bw >= flops / rate else 'FLOPs',
                         of_floor=floor / t['served'], peer_of_floor=floor / t['peer'],
                         speedup=t['peer'] / t['served'], err_served=e_served, err_peer=e_peer))
        r = rows[-1]
        print(f"{T:6d} tokens: served {r['served_ms']:8.3f} ms ({r['of_floor']:4.0%} of floor), "
              f"grouped_mm BF16 {r['peer_ms']:8.3f} ms, served {r['speedup']:5.2f}x faster; "
              f"errors {e_served:.1e} / {e_peer:.1e}")
    return dict(copy_TBps=bw / 1e12, bf16_TFLOPs=rate / 1e12, rows=rows)

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
    ap.add_argument('--peer', action='store_true',
                    help="time the served layer against torch._grouped_mm on BF16 weights, every size alone")
    ap.add_argument('--quick', action='store_true', help='tiny config, sizes 1 8 32: checks the script on any machine')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.quick: args.config, args.sizes = 'tiny', [1, 8, 32]
    elif device == 'cpu': sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    cfg = getattr(ModelConfig, args.config)()
    machine = machine_name(device)
    if args.peer:
        pr = peer_ab(cfg, args.sizes, device)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(dict(device=machine, date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', commit=git_commit(),
                               torch=torch.__version__, triton=triton.__version__, config=args.config, **pr), f,
                          indent=1)
        sys.exit(0)
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
