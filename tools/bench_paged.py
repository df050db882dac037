#!/usr/bin/env python
"""Prefill time and cache memory of the paged model (10b_paged) on `bench`: bounded replay against full-stack prefill.

    python tools/bench_paged.py [--sizes 8192 32768 131072] [--chunk 8192] [--seed 0] [--json out.json] [--quick]

Builds `bench` with `PagedModel.init_random` directly on the GPU (one layer's BF16 masters at a time: routed experts
MXFP4, shared experts FP8, Engram tables FP8, attention projections as BF16 values of their FP8 grid) and prints what it
holds by kind next to the checkpoint's bytes from the accounting. Every size is first prefilled once in each mode,
untimed, so that no timed run pays for a kernel compiled or tuned, or memory reserved, for a shape met for the first
time (a single short warm-up left that to the first timed size). Then one request of each size is prefilled in chunks of
`--chunk` rows, full stack and with bounded replay (the decoder over the last `window` tokens only), each with fresh
caches sized by `context_blocks`. A row per run: seconds, tokens per second, peak memory, the cache tensors' bytes by
group; per size the speed-up and whether both modes pick the same first token.
The largest context's caches are checked: every group's tensors hold exactly its layout bytes per block, and the global
group's bytes per context token equal the accounting's `global_kv_bytes_per_token`. The JSON is rewritten after every
size, so a run cut short keeps what it measured. `--quick` runs tiny on the CPU (Triton's interpreter when
TRITON_INTERPRET=1): a check of the script, not a measurement."""
import argparse, datetime, json, sys, time
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name
from dsv41_nb.accounting import checkpoint_manifest, global_kv_bytes_per_token
from dsv41_nb.paged import PagedModel
from dsv41_nb.paged_runner import context_blocks


def benchmark_prefill(model: PagedModel, sizes, chunk: int, seed: int = 0) -> list:
    """Per size and mode: prefill seconds, tokens/s, the caches' bytes by group; per size the
    speed-up and first-token agreement"""
    dev, rows = model.embed.device, []
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == 'cuda' else (lambda: None)
    for n in sizes:
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed + n)).to(dev)
        last = {}
        for mode in (False, True):
            sync(); t0 = time.perf_counter()
            last[mode] = model.prefill(ids, chunk, bounded_replay=mode)
            sync(); dt = time.perf_counter() - t0
            rows.append(dict(tokens=n, mode='bounded replay' if mode else 'full stack', seconds=dt, tokens_per_s=n / dt,
                             cache_bytes=model.cache_bytes(), blocks=dict(model.num_blocks)))
        rows[-1].update(speedup=rows[-2]['seconds'] / rows[-1]['seconds'],
                        same_token=bool(last[0].argmax() == last[1].argmax()),
                        max_logit_diff=(last[0] - last[1]).abs().max().item())
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--sizes', type=int, nargs='+', default=[8192, 32768, 131072], help='prompt lengths in tokens')
    ap.add_argument('--chunk', type=int, default=8192, help='prefill rows per step')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--json', help='write the rows (and the machine) to this file')
    ap.add_argument('--quick', action='store_true', help='tiny config on the CPU, two short prompts: checks the script')
    args = ap.parse_args()
    device = 'cuda' if torch.cuda.is_available() and not args.quick else 'cpu'
    if args.quick: args.sizes, args.chunk = [32, 48], 32
    elif device == 'cpu': sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    machine, date = machine_name(device), f'{datetime.datetime.now():%Y-%m-%d %H:%M}'
    print(f'{machine}  {date}  torch {torch.__version__}  triton {triton.__version__}  '
          f'config {"tiny" if args.quick else "bench"}: {cfg.n_layers} layers, dim {cfg.dim}, '
          f'{cfg.n_routed_experts} experts, window {cfg.window_size}, chunk {args.chunk}', flush=True)

    t0 = time.perf_counter()
    pm = PagedModel.init_random(cfg, seed=args.seed, device=device)
    build_s = time.perf_counter() - t0
    held = pm.weight_bytes()
    ckpt = sum(s.nbytes for s in checkpoint_manifest(cfg) if not s.name.startswith('mtp.'))
    print(f'built in {build_s:.1f} s; weights held, by kind:')
    for k, v in held.items(): print(f'  {k:36s} {v / 2**20:12,.1f} MiB')
    print(f'  {"total held":36s} {sum(held.values()) / 2**20:12,.1f} MiB  '
          f'(the backbone in checkpoint format: {ckpt / 2**20:,.1f} MiB)')
    if device == 'cuda':
        print(f'  allocated on the GPU after the build: {torch.cuda.memory_allocated() / 2**30:.2f} GiB', flush=True)

    out = dict(machine=machine, date=date, torch=torch.__version__, triton=triton.__version__,
               config='tiny' if args.quick else 'bench', chunk=args.chunk, seed=args.seed,
               build_s=build_s, weights=held, checkpoint_backbone_bytes=ckpt, rows=[])
    t0 = time.perf_counter(); benchmark_prefill(pm, sizes=args.sizes, chunk=args.chunk, seed=args.seed)
    out['warmup_s'] = time.perf_counter() - t0
    print(f'warmed up: every size prefilled once per mode, untimed, in {out["warmup_s"]:.1f} s', flush=True)
    print(f"{'tokens':>8} {'mode':15s} {'seconds':>8} {'tokens/s':>10} {'peak GiB':>9} "
          f"{'global MiB':>11} {'window MiB':>11}  speed-up, same first token, max |logit diff|")
    for n in args.sizes:
        if device == 'cuda': torch.cuda.reset_peak_memory_stats()
        rows = benchmark_prefill(pm, sizes=(n,), chunk=args.chunk, seed=args.seed)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == 'cuda' else float('nan')
        for r in rows:
            r['peak_gib'] = peak
            extra = f"  x{r['speedup']:.2f}, {r['same_token']}, {r['max_logit_diff']:.3f}" if 'speedup' in r else ''
            print(f"{r['tokens']:8,} {r['mode']:15s} {r['seconds']:8.2f} "
                  f"{r['tokens_per_s']:10,.0f} {peak:9.1f} "
                  f"{r['cache_bytes']['global'] / 2**20:11.1f} "
                  f"{r['cache_bytes']['swa'] / 2**20:11.1f}{extra}", flush=True)
        out['rows'] += rows
        if args.json:
            with open(args.json, 'w') as f: json.dump(out, f, indent=1)

    n, kc = max(args.sizes), pm.kv_cache_config
    blocks = context_blocks(kc, n, args.chunk)
    pm.allocate(blocks, device)
    got = pm.cache_bytes()
    cc = kc.cache_config
    acct = global_kv_bytes_per_token(cfg, cc.main_kv_format, cc.index_key_format)
    print(f'caches of one {n:,}-token request, chunks of {args.chunk:,} rows:')
    for g in kc.groups:
        assert got[g.name] == blocks[g.name] * g.bytes_per_block, (g.name, got[g.name],
                                                                   blocks[g.name] * g.bytes_per_block)
        print(f'  {g.name:10s} {blocks[g.name]:6,} blocks x {g.bytes_per_block:9,} B = '
              f'{got[g.name] / 2**20:9.1f} MiB allocated')
    per_token = (got['global'] - kc.groups[0].bytes_per_block) / n                 # the null block apart
    print(f'  global group: {per_token:.1f} B per context token allocated; accounting {acct:g} B per token')
    if n % kc.groups[0].block_size == 0: assert per_token == acct, (per_token, acct)
    out['memory'] = dict(tokens=n, blocks=blocks, cache_bytes=got, global_bytes_per_token=per_token,
                         accounting_bytes_per_token=acct)
    if args.json:
        with open(args.json, 'w') as f: json.dump(out, f, indent=1)
        print('wrote', args.json)


if __name__ == '__main__':
    main()
