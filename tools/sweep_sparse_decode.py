#!/usr/bin/env python
"""Check and time every launch shape of the sparse MLA decode kernel (`decode_variants`), or compile them for Hopper
without a GPU.

    python tools/sweep_sparse_decode.py [--json PATH] [--batches 1 64 256] [--jobs N] [--quick] [--compile-only]

On a GPU: each launch shape is first compiled and checked against the PyTorch reference (ragged lists, -1 entries, one
split and several), in `--jobs` processes at once; a shape that fails to compile or to match is reported with the first
line of its error and left out of the timing. Then, at the bench geometry (64 heads, 128 `window_fp8` + 512 `ds_fp4`
records, 32K context), each shape is timed per query token per layer, replayed from a CUDA graph over enough decode
steps that the records come from HBM, at each batch size (the default split count, and the default shape at fixed split
counts too), against the floor (bytes over the copy bandwidth, FLOPs over the BF16 matmul rate, both measured here). It
prints a table per batch, sorted by time, and the `DECODE_TUNING` table the winners make; `--json` writes everything
(06a_sparse_decode_speed reads it). `--quick` runs a small geometry on two tokens, which also works on a CPU under
TRITON_INTERPRET=1 (each distinct kernel once). `--compile-only` compiles every shape for sm_90 with this machine's
Triton (no GPU needed) and prints registers, spilled bytes, shared memory and the matrix instructions, read from the
binary with the `cuobjdump` Triton ships."""
import argparse, datetime, json, math, os, re, subprocess, sys, time
from dataclasses import replace
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import copy_bandwidth, kernel_backend, machine_name, median_time
from dsv41_nb.launches import graph_time
from dsv41_nb.record_codecs import cache_format
from dsv41_nb import sparse_decode as sd
from dsv41_nb.sparse_decode_speed import input_sets

TUNED_BATCH = {1: 1, 8: 1, 128: 64, None: 256}      # DECODE_TUNING class -> the batch whose winner fills it


def check_shape(i: int, launch: dict, quick: bool) -> dict:
    "Compile one launch shape (one split and several) and check it against the reference; runs in a worker process"
    t0 = time.time()
    try:
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
        cfg = replace(ModelConfig.bench(), window_size=16) if quick else ModelConfig.bench()
        args = sd.decode_inputs(cfg, 2 if quick else 3, 300 if quick else 2048,
                                16 if quick else cfg.index_topk, ragged=True,
                                device=device, seed=100 + i)
        worst = max(sd.check_decode(args, num_splits=s, launch=launch)[0] for s in (1, None if device == 'cuda' else 2))
        return dict(ok=True, worst=worst, error='', seconds=time.time() - t0)
    except Exception as e:
        # a compile error or a wrong answer: report, go on
        text = str(e).strip().splitlines()
        return dict(ok=False, worst=float('nan'),
                    error=f"{type(e).__name__}: {text[0][:200] if text else ''}",
                    seconds=time.time() - t0)


def _check_child(conn, i, launch, quick):
    conn.send(check_shape(i, launch, quick))
    conn.close()


def check_all(variants, jobs, quick):
    """`check_shape` for every shape, each in a fresh process (a compiler abort or a GPU fault stays with its shape),
    `jobs` at a time; the compiled kernels land in Triton's on-disk cache, where the timing process finds them"""
    if jobs <= 1: return [check_shape(i, v, quick) for i, v in enumerate(variants)]
    import multiprocessing as mp
    ctx, results, running, todo = mp.get_context('spawn'), [None] * len(variants), {}, list(range(len(variants)))
    while todo or running:
        while todo and len(running) < jobs:
            i = todo.pop(0)
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_check_child, args=(send, i, variants[i], quick))
            proc.start(); send.close()
            running[i] = (proc, recv)
        for i, (proc, recv) in list(running.items()):
            if recv.poll(): results[i] = recv.recv()
            elif not proc.is_alive():
                results[i] = dict(ok=False, worst=float('nan'),
                                  error=f'the checking process died (exit code {proc.exitcode})',
                                  seconds=0.0)
            else: continue
            proc.join(); del running[i]
        time.sleep(0.1)
    return results


def matmul_rate(n: int, device) -> float:
    "Dense BF16 matmul FLOP/s of an n x n x n product, measured here"
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / median_time(lambda: a @ a)


def time_shapes(cfg, batch, variants, checks, floor_us, device, quick, context):
    """Rows: each shape that passed, timed at `batch` with the default split count; then the default
    shape at fixed split counts"""
    k = 16 if quick else cfg.index_topk
    sets = input_sets(cfg, batch, context, k, device=device, max_sets=2 if quick else 8)
    tiles = math.ceil(cfg.window_size / variants[0]['block_n']) + math.ceil(k / variants[0]['block_n'])
    plans = [(v, None) for v, c in zip(variants, checks) if c['ok']]
    # the default shape at fixed split counts
    counts = {1, 2, 4, 8, 12, 16, tiles} if batch <= 8 else {1, 2, 3, 4}
    if checks[0]['ok']: plans += [(variants[0], s) for s in sorted(counts) if s <= tiles]
    rows = []
    for launch, num_splits in plans:
        call = lambda i: sd.sparse_decode(*sets[i % len(sets)], num_splits=num_splits, launch=launch,
                                          check_indices=False)
        t = graph_time(call, calls=2 if quick else max(8, len(sets)), reps=2 if quick else 10)
        res = sd.decode_kernel_resources(sets[0], num_splits, launch)
        L = sd.decode_launch(batch, sets[0][0].shape[1], cfg.window_size, k, device, num_splits, launch)
        rows.append(dict(batch=batch, name=sd.launch_name(launch), launch=launch,
                         splits=L['SPLITS'], auto_splits=num_splits is None,
                         us=t / batch * 1e6, of_floor=floor_us * batch / (t * 1e6), registers=res.get('registers', -1),
                         local_bytes=res.get('local_bytes', -1), shared_bytes=res.get('shared_bytes', -1)))
        print(f"  batch {batch:>4} {rows[-1]['name']:<36} splits {rows[-1]['splits']:>3}: "
              f"{rows[-1]['us']:8.3f} us/token", flush=True)
    return rows


def tuning_literal(rows) -> str:
    """DECODE_TUNING as a dict literal, each class filled by the fastest row at its batch (with its
    split count if that was fixed)"""
    lines = ['DECODE_TUNING = {   # tokens per launch, at most -> launch shape of a 64-head '
             'program (None: any larger batch)']
    for cls, B in TUNED_BATCH.items():
        cand = [r for r in rows if r['batch'] == B]
        if not cand: continue
        best = min(cand, key=lambda r: r['us'])
        launch = dict(best['launch'], **({} if best['auto_splits'] else dict(splits=best['splits'])))
        body = ', '.join(f'{k}={v!r}' for k, v in launch.items())
        lines.append(f"    {str(cls) + ':':<5} dict({body}),")
    return '\n'.join(lines + ['}'])


# ---- compile-only: resources of each shape for sm_90, no GPU needed --------------------------------------------------
POINTERS = dict(q_ptr='*bf16', w_ptr='*u8', w_half='*i16', w_slot_ptr='*i32', w_len_ptr='*i32',
                c_ptr='*u8', c_half='*i16', topk_ptr='*i32', k_len_ptr='*i32', bt_ptr='*i32',
                row_ptr='*i32', sink_ptr='*fp32', out_ptr='*bf16', lse_ptr='*fp32',
                po_ptr='*fp32', pl_ptr='*fp32', scale_log2='fp32')
# multiples of 16 at the bench geometry
ALIGNED = {'stride_qt', 'stride_qh', 'per_block', 'H', 'stride_ot', 'stride_oh'}


def compile_sm90(launch: dict, one_split: bool, window_format='window_fp8', main_format='ds_fp4') -> dict:
    """Compile the kernel for sm_90 as a launch at the bench geometry would; registers, local bytes,
    shared bytes, MMA instructions"""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cfg = ModelConfig.bench()
    L = sd.decode_launch(64, cfg.n_heads, cfg.window_size, cfg.index_topk, 'cpu', 1 if one_split else 2, launch)
    const = dict(D=cfg.head_dim, BLOCK_H=L['BLOCK_H'], BLOCK_N=L['BLOCK_N'], ONE_SPLIT=one_split,
                 SCALE_TILE=L['SCALE_TILE'], HW_CVT=True, F32_DOT=False,
                 **sd._format_meta(cache_format(cfg, window_format), cfg.head_dim, 'W'),
                 **sd._format_meta(cache_format(cfg, main_format), cfg.head_dim, 'C'))
    words = L['PREFETCH'] and const['C_FP4']
    if words: fn = sd._sparse_decode_prefetch if L['SEPARATE'] else sd._one_function_prefetch
    else: fn = sd._sparse_decode_separate if L['SEPARATE'] else sd._sparse_decode_kernel
    names = fn.arg_names
    sig = {n: 'constexpr' if n in const else POINTERS.get(n, 'i32') for n in names}
    if words: sig['c_half'] = '*i32'                # the compressed codes read as words
    attrs = {(names.index(n),): [['tt.divisibility', 16]] for n in names if sig[n].startswith('*') or n in ALIGNED}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    opts = dict(num_warps=L['num_warps'], num_stages=L['num_stages'],
                **({'maxnreg': L['maxnreg']} if L.get('maxnreg') else {}))
    k = triton.compile(src, target=GPUTarget('cuda', 90, 32), options=opts)
    tool = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump')
    path = f"/tmp/sparse_decode_{os.getpid()}.cubin"
    with open(path, 'wb') as f: f.write(k.asm['cubin'])
    usage = subprocess.run([tool, '--dump-resource-usage', path], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, '--dump-sass', path], capture_output=True, text=True).stdout
    os.remove(path)
    m = re.search(r'REG:(\d+) STACK:(\d+)', usage)
    return dict(registers=int(m[1]), local_bytes=int(m[2]), shared_bytes=k.metadata.shared,
                wgmma=len(re.findall(r'\bHGMMA', sass)), mma_sync=len(re.findall(r'\bHMMA', sass)))


def compile_only(variants):
    print(f"Triton {triton.__version__}, compiled for sm_90 at the bench geometry (window_fp8 + ds_fp4); no GPU used")
    print(f"{'launch shape':<36} {'splits':>6} {'regs':>5} {'local B':>8} {'shared KB':>9} "
          f"{'wgmma':>6} {'mma.sync':>8}")
    for v in variants:
        for one in (True, False):
            try: r = compile_sm90(v, one)
            except Exception as e:
                print(f"{sd.launch_name(v):<36} {'1' if one else '>1':>6} failed: "
                      f"{str(e).strip().splitlines()[0][:100]}"); continue
            print(f"{sd.launch_name(v):<36} {'1' if one else '>1':>6} {r['registers']:>5} {r['local_bytes']:>8} "
                  f"{r['shared_bytes'] / 1024:>9.0f} {r['wgmma']:>6} {r['mma_sync']:>8}", flush=True)


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--json', help='write the checks and timings here')
    ap.add_argument('--batches', type=int, nargs='+', help='query tokens per launch (default 1 64 256; quick: 1 2)')
    ap.add_argument('--jobs', type=int, default=min(12, os.cpu_count() or 1),
                    help='processes that compile and check in parallel')
    ap.add_argument('--quick', action='store_true', help='small sizes (runs under TRITON_INTERPRET=1)')
    ap.add_argument('--compile-only', action='store_true',
                    help='compile each shape for sm_90 and print its resources (no GPU)')
    args = ap.parse_args()
    variants = sd.decode_variants()
    if args.compile_only: compile_only(variants); sys.exit(0)
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if kernel_backend(torch.zeros(1, device=device)) != 'triton':
        raise SystemExit('needs a GPU, or TRITON_INTERPRET=1 on a CPU')
    # the interpreter runs warps, stages and register caps alike: one shape per kernel
    if args.quick and device == 'cpu':
        variants = list(sd.distinct_kernels(variants))
    cfg = replace(ModelConfig.bench(), window_size=16) if args.quick else ModelConfig.bench()
    batches = args.batches or ([1, 2] if args.quick else [1, 64, 256])
    context = 300 if args.quick else 32768
    stamp = f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
    print(f"{machine_name(device)}  {stamp}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{len(variants)} launch shapes, batches {batches}", flush=True)
    t0 = time.time()
    checks = check_all(variants, 1 if device == 'cpu' else args.jobs, args.quick)
    for v, c in zip(variants, checks):
        if not c['ok']: print(f"  {sd.launch_name(v)}: {c['error']}")
    print(f"compiled and checked in {time.time() - t0:.0f} s: {sum(c['ok'] for c in checks)} of {len(checks)} "
          f"match the reference (worst {max((c['worst'] for c in checks if c['ok']), default=float('nan')):.2f} "
          "of the bound)", flush=True)
    bw = copy_bandwidth(nbytes=(1 << 24) if args.quick else (2 << 30), device=device)
    peak = matmul_rate(256 if args.quick else 8192, device)
    k = 16 if args.quick else cfg.index_topk
    cost = sd.decode_cost(cfg, cfg.window_size, k, cache_format(cfg, 'window_fp8'), cache_format(cfg, 'ds_fp4'))
    floor_us = max(cost['bytes'] / bw, cost['flops'] / peak) * 1e6
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, BF16 matmul {peak / 1e12:.0f} TFLOP/s: "
          f"floor {floor_us:.3f} us per query token", flush=True)
    rows = [r for B in batches for r in time_shapes(cfg, B, variants, checks, floor_us, device, args.quick, context)]
    for B in batches:
        print(f"\nbatch {B} ({machine_name(device)}, {stamp})\n{'launch shape':<36} {'splits':>6} "
              f"{'us/token':>9} {'of floor':>9} {'regs':>5} {'local B':>8}")
        for r in sorted((r for r in rows if r['batch'] == B), key=lambda r: r['us']):
            print(f"{r['name']:<36} {r['splits']:>6} {r['us']:>9.3f} {r['of_floor']:>9.1%} "
                  f"{r['registers']:>5} {r['local_bytes']:>8}")
    print('\n' + tuning_literal(rows))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(device=machine_name(device), date=stamp, torch=torch.__version__,
                           triton=triton.__version__, copy_bandwidth=bw,
                           bf16_matmul=peak, floor_us=floor_us, context=context,
                           variants=[dict(name=sd.launch_name(v), launch=v, **c) for v, c in zip(variants, checks)],
                           rows=rows, tuning=tuning_literal(rows)), f, indent=1)
