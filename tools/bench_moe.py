#!/usr/bin/env python
"""Time the fused Triton MoE of 08b_fused_moe against the reference loop, a loop over BF16 weights, and the floor.

    python tools/bench_moe.py [--config bench] [--sizes 1 64 1024 8192] [--json out.json] [--sweep] [--tiles dot_scaled] [--quick]

One row per batch size, all measured in one run: the median time of `fused_moe_experts`, the floor (the larger of the
bytes the layer must move over the measured copy bandwidth and its FLOPs over the measured BF16 matmul rate), the
fraction of the floor reached, and the speed-ups over the reference loop (`moe_experts_reference`, each expert
dequantised per call) and over the same loop with every expert dequantised to BF16 once. `--sweep` first times a small
grid of launch shapes per size and prints the best (the shapes `MOE_TUNING` should hold). `--tiles dot_scaled` times a
candidate for the kernels' MXFP4 tiles: `tl.dot_scaled`, Triton's microscaling product (on Hopper an upcast to BF16 in
registers), in place of the element-by-element dequantisation; the run checks it against the reference loop first. `--quick` runs the tiny config
at small sizes, on a CPU under the Triton interpreter when there is no GPU: a check of the script, not a measurement."""
import os, sys
if '--quick' in sys.argv and not os.environ.get('TRITON_INTERPRET'):
    import torch
    if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'   # before triton is imported
import argparse, datetime, json
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import median_time, machine_name
from dsv41_nb.moe import MoEWeights, route
import triton.language as tl
from dsv41_nb import fused_moe
from dsv41_nb.fused_moe import MOE_TUNING, fused_moe_experts, benchmark_moe, format_moe_benchmark, check_fused_moe

_dequantising_gemm = fused_moe._expert_gemm       # the kernels' own tile loop, kept for the FP8 shared expert

@triton.jit
def _expert_gemm_dot_scaled(acc, a_row, valid, w_ptr, s_ptr, expert, n, n_mask, K: tl.constexpr, N: tl.constexpr,
                            BK: tl.constexpr, W_FP4: tl.constexpr, HW_CVT: tl.constexpr, DOT: tl.constexpr):
    "`fused_moe._expert_gemm` with its MXFP4 tiles multiplied by `tl.dot_scaled` (the FP8 shared expert unchanged)"
    if W_FP4:
        w_row = expert.to(tl.int64) * N * (K // 2) + n.to(tl.int64) * (K // 2)
        s_row = expert.to(tl.int64) * N * (K // 32) + n.to(tl.int64) * (K // 32)
        kk, kb, ks = tl.arange(0, BK), tl.arange(0, BK // 2), tl.arange(0, BK // 32)
        for k0 in range(0, K, BK):
            a = tl.load(a_row[:, None] + k0 + kk[None, :], mask=valid[:, None], other=0.0).to(tl.bfloat16)   # (BM, BK)
            w = tl.load(w_ptr + w_row[None, :] + (k0 // 2 + kb)[:, None], mask=n_mask[None, :], other=0)      # (BK/2, BN)
            sc = tl.load(s_ptr + s_row[:, None] + (k0 // 32 + ks)[None, :], mask=n_mask[:, None], other=127)  # (BN, BK/32)
            acc = tl.dot_scaled(a, None, 'bf16', w, sc, 'e2m1', acc)
    else: acc = _dequantising_gemm(acc, a_row, valid, w_ptr, s_ptr, expert, n, n_mask, K, N, BK, W_FP4, HW_CVT, DOT)
    return acc


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
                try: ms = median_time(lambda: fused_moe_experts(x, tw, ti, W, cfg.swiglu_limit, shape, check_ids=False)) * 1e3
                except Exception as e: ms = float('nan'); print(f'  {T} tokens {shape}: failed ({type(e).__name__}: {str(e)[:80]})')
                results.append((ms, shape))
        ok = [r for r in results if r[0] == r[0]]
        best[T] = min(ok, key=lambda r: r[0]) if ok else (float('nan'), None)
        print(f'{T:6d} tokens: ' + '  '.join(f"{s['block_m']}/{s['block_n']}/{s['block_k']}/{s['num_warps']}w {ms:.3f}" for ms, s in results))
        print(f'{"":14s}best {best[T][1]} at {best[T][0]:.3f} ms')
    return best

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--config', default='bench', choices=('bench', 'tiny', 'full'))
    ap.add_argument('--sizes', type=int, nargs='+', default=[1, 64, 1024, 8192])
    ap.add_argument('--json', help='write the rows (and the machine) to this file')
    ap.add_argument('--sweep', action='store_true', help='time a grid of launch shapes per size first')
    ap.add_argument('--tiles', default='dequantise', choices=('dequantise', 'dot_scaled'),
                    help="the MXFP4 tiles: dequantised element by element (the kernels' own), or through tl.dot_scaled")
    ap.add_argument('--quick', action='store_true', help='tiny config, sizes 1 8 32: checks the script on any machine')
    args = ap.parse_args()
    if args.tiles == 'dot_scaled': fused_moe._expert_gemm = _expert_gemm_dot_scaled      # before any kernel compiles
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.quick: args.config, args.sizes = 'tiny', [1, 8, 32]
    elif device == 'cpu': sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    cfg = getattr(ModelConfig, args.config)()
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  triton {triton.__version__}  '
          f'config {args.config}: {cfg.n_routed_experts} experts, top {cfg.n_activated_experts}, dim {cfg.dim}, inter {cfg.moe_inter_dim}')
    print('launch shapes:', {k: '/'.join(str(v[n]) for n in ('block_m', 'block_n', 'block_k', 'num_warps')) for k, v in MOE_TUNING.items()})
    print('MXFP4 tiles:', args.tiles)
    if args.tiles != 'dequantise':                                          # a candidate is checked before it is timed
        W = MoEWeights.random(cfg, 0, device)
        for T in [t for t in args.sizes if t <= 64]:
            x = (3 * torch.randn(T, cfg.dim, device=device)).to(torch.bfloat16)
            r = check_fused_moe(x, *route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale), W, cfg.swiglu_limit)
            print(f"  {T} tokens: checked against the reference, max error {r['max_err']:.3g}, exact {r['exact']}")
    best = sweep_shapes(cfg, args.sizes, device) if args.sweep else None
    rows = benchmark_moe(cfg, args.sizes, device)
    print(f"copy {rows[0]['copy_TBps'] * 1e3:.0f} GB/s, BF16 matmul {rows[0]['bf16_TFLOPs']:.1f} TFLOP/s (measured)")
    print(format_moe_benchmark(rows))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(device=machine, date=str(datetime.date.today()), torch=torch.__version__, triton=triton.__version__,
                           config=args.config, tiles=args.tiles, tuning=MOE_TUNING, sweep_best={str(k): v for k, v in (best or {}).items()},
                           rows=rows), f, indent=1)
