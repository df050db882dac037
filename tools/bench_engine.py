#!/usr/bin/env python
"""The engine (13_engine) on one GPU: throughput and latency against concurrency, the batch-1 decode step against its
byte floor (with and without CUDA graphs), and the engine against the naive loop that recomputes every sequence each
token.

    python tools/bench_engine.py [--config bench|small|tiny] [--experts N] [--concurrency 1 4 16 32 64 128 256]
                                 [--prompt-len 128] [--max-tokens 32] [--seed 0]
                                 [--sections concurrency decode profile graphs naive]
                                 [--async-scheduling] [--max-num-batched-tokens N] [--codes] [--planes-down] [--slots]
                                 [--shared-fp8] [--fp8] [--fp8-mma ROWS] [--prefill-union]
                                 [--json out.json] [--quick]

The model is the paged path of 10b_paged with random weights (`PagedModel.init_random`, built one layer at a time on the
GPU: the `bench` geometry's BF16 masters would not fit as a whole `Transformer`), served through `LLM` with its
`step_model` hook; `--experts N` scales the routed experts down if memory asks for it. Four measurements:

1. concurrency: for each level c, c random byte prompts at once (`load_test` of the command line): output tokens/s and
   TTFT / TPOT / end-to-end percentiles, and the step floor at c requests (`step_floor` of 01a_floors) with TPOT p50
   over it; one table row per level. After the first warm-up every CUDA graph a level can pad to is captured
   (`capture_all`), and each level is warmed up first with c other prompts of 3 tokens each (Triton compiles a kernel
   again for new argument specialisations), so the row times serving, not compiling or capturing.
2. the decode step at batch 1: the engine's time per output token of one request (scheduler, runner, sampler included)
   against the floor of that step, with the runner waiting for each step's tokens and (async scheduling) not waiting:
   the bytes it must read (the checkpoint's weights a token touches, `decode_floor` of 01a_floors with one rank,
   plus the KV records it attends to and the index keys it scores) over the measured copy bandwidth (`copy_bandwidth`).
   Goal: at most 3x the floor. With CUDA graphs when the model supports them (the wrapper is swapped in and out of the
   same engine), otherwise the eager step alone and the reason.
3. profile: the GPU time of one eager decode step of one request, by kernel (`torch.profiler`); and `graphs`: the
   kernels of decode steps replayed from CUDA graphs at a few batch sizes (count, GPU busy time, the kernels under
   3 us, the largest), which is where a replayed step's time goes. Both are taken with programmatic dependent launch
   switched off (and the graphs captured again), so that each kernel's time is its own, not its wait for the one before.
4. the naive loop: `generate_greedy` of 10_model_forward_block on a (32, prompt) batch, recomputing the whole sequence
   every token, against the engine serving the same 32 prompts (`--naive-config`, default `small`: the dense
   `Transformer` must fit; the trained small model of 11_train when its checkpoint is in the repository). Goal: the
   engine at least 5x the naive loop's tokens/s. Both are warmed up first on other prompts of the same shape (kernels
   compiled, CUDA graphs captured, no prefix-cache hits).

Each section is timed after a warm-up; a section that fails records its error and the run goes on. The JSON is rewritten
after every section. `--quick` runs tiny on the CPU with the PyTorch kernels: a check of the script, not a
measurement."""
import argparse, dataclasses, datetime, json, os, subprocess, sys, time, traceback
from contextlib import contextmanager
from pathlib import Path
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name, copy_bandwidth, median_time, gpu_memory
from dsv41_nb.launches import PDL
from dsv41_nb.accounting import memory_table, GiB
from dsv41_nb.floors import decode_floor, decode_kv_read_bytes, step_floor, Hardware, HARDWARE
from dsv41_nb.model import Transformer, init_random
from dsv41_nb.model_forward_block import generate_greedy
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.engine import LLM
from dsv41_nb.cuda_graphs import CUDAGraphModel
from dsv41_nb import paged, fp8_linear, sparse_prefill
from dsv41_nb.paged import PagedModel
from dsv41_nb.moe_planes import PlaneWeight
from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
from dsv41_nb.engine import kv_pool_blocks
from dsv41_nb.paged_step import PagedStepModel
from dsv41_nb.__main__ import load_test, load_summary, random_prompts
from dsv41_nb.checkpoint_files import load_model


def weight_bytes(cfg: ModelConfig) -> int:
    "About what the random-weight model holds on a GPU: its checkpoint's bytes (`memory_table` of 01a_accounting)"
    return int(memory_table(cfg)['total'] * GiB)


def pool_blocks(cfg: ModelConfig, kc, max_num_seqs: int, free: int, total: int, utilization: float = 0.9) -> int:
    """KV pool blocks for `max_num_seqs` requests (`kv_pool_blocks`) at `utilization` of a GPU with `free` of `total`
    bytes, the weights still to be built (`weight_bytes`) counted as taken; where they leave too little, the error says
    how much they take and what to pass"""
    w = weight_bytes(cfg)
    try: return kv_pool_blocks(kc, max_num_seqs, utilization, max(0, free - w), total)
    except ValueError as e:
        raise ValueError(f"{e}, after about {w / GiB:.1f} GiB of weights ({cfg.n_routed_experts} routed experts a "
                         f"layer): fewer experts (--experts) or a larger GPU") from None


def paged_llm(cfg: ModelConfig, seed: int, device, **engine_args) -> LLM:
    """An LLM over a random-weight PagedModel built on `device` for the engine's own cache layout. On a GPU the KV pool
    holds the blocks the requests can need (`pool_blocks` at 0.9 of the GPU, sized here since the engine sees only a
    meta model, with the weights to be built counted as taken), not the fixed default budget; a model that does not
    fit beside it says so and names `--experts`"""
    if torch.device(device).type == 'cuda' and 'num_gpu_blocks' not in engine_args:
        mml = engine_args.get('max_model_len') or CacheConfig.for_model(cfg).max_model_len
        kc = get_kv_cache_config(cfg, CacheConfig.for_model(cfg, max_model_len=mml))
        engine_args['num_gpu_blocks'] = pool_blocks(cfg, kc, engine_args.get('max_num_seqs', 256),
                                                    *gpu_memory(device))
    built = {}
    def build(kc):
        try: m = PagedModel.init_random(cfg, seed=seed, device=device, kv_cache_config=kc)
        except torch.OutOfMemoryError as e:
            raise MemoryError(f"the random-weight model ({cfg.n_routed_experts} routed experts a layer, about "
                              f"{weight_bytes(cfg) / GiB:.1f} GiB) did not fit on {device} beside a KV pool of "
                              f"{kc.num_blocks:,} blocks: pass --experts with fewer ({e})") from None
        built['planes'] = sum(isinstance(l.moe.w1, PlaneWeight) for l in m.layers)
        built['planes_down'] = sum(isinstance(l.moe.w2, PlaneWeight) for l in m.layers)
        return PagedStepModel(m)
    llm = LLM(Transformer(cfg, device='meta'), step_model=build, **engine_args)
    llm.planes_layers = built.get('planes')    # layers holding the routed gate/up in planes (08f)
    llm.planes_down_layers = built.get('planes_down')      # ... and the routed down weights
    return llm


def git_commit() -> str | None:
    """The checkout's commit (short), or None outside a git checkout; DSV41_COMMIT overrides it. With tracked files
    changed since that commit (or a copy whose git metadata is older than its files) the commit does not describe
    the code, and '+modified' says so"""
    if os.environ.get('DSV41_COMMIT'): return os.environ['DSV41_COMMIT']
    here = Path(__file__).parent
    r = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=here)
    if not r.stdout.strip(): return None
    changed = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], capture_output=True, text=True,
                             cwd=here).stdout.strip()
    return r.stdout.strip() + ('+modified' if changed else '')


def sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize(device)


def concurrency_rows(llm: LLM, levels, prompt_len: int, max_tokens: int, seed: int, res: dict, path,
                     cfg: ModelConfig | None = None, device='cpu') -> list:
    """One row per level, with (given `cfg`) the step floor at that many requests (`step_floor` at the run's mean
    context and the copy bandwidth measured on `device`); each row goes into `res['concurrency']` (and the JSON) as soon
    as it is measured"""
    sp, rows = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), []
    warm = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    res['concurrency'] = rows
    bw = (copy_bandwidth(device=device) if torch.device(device).type == 'cuda'
          else HARDWARE['H200 (measured copy)'].bandwidth)
    hw, ctx = dataclasses.replace(HARDWARE['H200'], bandwidth=bw), prompt_len + max_tokens // 2
    # warm-up: compile, fill
    load_test(llm, random_prompts(2, prompt_len, seed=seed), sp)
    model = llm.llm_engine.runner.model
    # every size a level can pad to, before timing
    if isinstance(model, CUDAGraphModel) and model._template is not None:
        t0 = time.perf_counter()
        got = model.capture_all([s for s in model.sizes if s <= max(levels)])
        print(f"captured the graphs of {got} in {time.perf_counter() - t0:.1f} s", flush=True)
    for c in levels:
        # this level's shapes
        load_test(llm, random_prompts(c, prompt_len, seed=seed + 10**6 + c), warm)
        s = load_test(llm, random_prompts(c, prompt_len, seed=seed + c), sp)
        floor = step_floor(cfg, hw, c, ctx)['seconds'] if cfg is not None else float('nan')
        rows.append(dict(concurrency=c, **s, floor_s=floor, copy_bandwidth=bw))
        print(f"{c:6d} {s['output_tokens_per_s']:12.1f} {1e3 * s['ttft_s'][50]:9.1f} {1e3 * s['ttft_s'][99]:9.1f} "
              f"{1e3 * s['tpot_s'][50]:9.2f} {1e3 * s['tpot_s'][99]:9.2f} {s['e2e_s'][50]:8.2f} {1e3 * floor:9.2f} "
              f"{s['tpot_s'][50] / floor:8.1f}", flush=True)
        if path: json.dump(res, open(path, 'w'), indent=1, default=str)
    return rows


def decode_step(llm: LLM, cfg: ModelConfig, device, prompt_len: int, max_tokens: int, seed: int) -> dict:
    eng = llm.llm_engine
    bw = (copy_bandwidth(device=device) if torch.device(device).type == 'cuda'
          else HARDWARE['H200 (measured copy)'].bandwidth)
    hw = Hardware(machine_name(device), HARDWARE['H200'].hbm_bytes, bw, 'copy_bandwidth on this machine')
    weights = decode_floor(cfg, hw, batch=1, world_size=1)
    # the mean context of the run
    context = prompt_len + max_tokens // 2
    cc = eng.kv_cache_config.cache_config
    kv = decode_kv_read_bytes(cfg, context, cc.main_kv_format, cc.index_key_format)
    floor = weights['seconds'] + kv / bw
    inner = eng.runner.model
    graphs, args0, config0 = (inner if isinstance(inner, CUDAGraphModel) else None), eng.args, eng.scheduler.config
    modes = [('eager', inner.model if graphs else inner), ('cuda graphs', graphs), ('cuda graphs, async', graphs)]
    out = dict(context=context, copy_bandwidth=bw, weight_bytes=weights['dense_bytes'] + weights['expert_bytes'],
               kv_bytes=kv, floor_s=floor,
               held_weight_bytes=getattr(getattr(inner, 'model', None), 'weight_bytes', lambda: None)(), modes={})
    sp, prompt = (SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                  random_prompts(1, prompt_len, seed=seed))
    for mode, m in modes:
        if m is None:
            why = 'not on a GPU' if torch.device(device).type != 'cuda' else 'supports_cuda_graphs is False'
            out['modes'][mode] = dict(note=f"{type(inner).__name__} runs without CUDA graphs ({why})")
            print(f"  {mode:12s} {out['modes'][mode]['note']}"); continue
        # async: the runner does not wait for a step's tokens
        eng.runner.model, asyn = m, mode.endswith('async')
        # (switched while no request is in flight)
        eng.args = dataclasses.replace(eng.args, async_scheduling=asyn)
        eng.scheduler.config = dataclasses.replace(eng.scheduler.config, async_scheduling=asyn)
        # warm-up (captures graphs)
        load_test(llm, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        s = load_test(llm, prompt, sp)
        step = s['tpot_s'][50]
        out['modes'][mode] = dict(step_s=step, times_floor=step / floor, ttft_s=s['ttft_s'][50])
        print(f"  {mode:12s} {1e3 * step:9.3f} ms per decode step = {step / floor:6.1f}x the floor "
              f"of {1e6 * floor:8.1f} us ({(out['weight_bytes']) / 1e9:.2f} GB weights + "
              f"{kv / 1e6:.2f} MB KV at {bw / 1e12:.2f} TB/s)")
        # the GPU's part alone: the batch-1 graph replayed
        if mode == 'cuda graphs' and 1 in getattr(m, 'graphs', {}):
            out['modes'][mode]['replay_s'] = rep = median_time(m.graphs[1][0], warmup=50, rep=300)
            print(f"  {'':12s} {1e3 * rep:9.3f} ms of it the graph's replay alone; "
                  f"the other {1e3 * (step - rep):.3f} ms the host's (scheduling, inputs, "
                  "sampling) while the GPU waits")
    eng.runner.model, eng.args, eng.scheduler.config = inner, args0, config0                   # as it was built
    return out


TRAINED = Path(__file__).resolve().parent.parent / 'checkpoints' / 'small'


@contextmanager
def pdl_off(llm: LLM):
    """Kernels launched without programmatic dependent launch, graphs captured afresh: under PDL a profiler counts each
    kernel's wait for the one before it as its own time, so a per-kernel table is taken without it (the step itself is
    timed with it)"""
    model = llm.llm_engine.runner.model
    drop = lambda: (model.graphs.clear(), setattr(model, 'pool', None)) if isinstance(model, CUDAGraphModel) else None
    old = PDL['enabled']
    PDL['enabled'] = False; drop()
    try: yield
    finally: PDL['enabled'] = old; drop()


def kernel_profile(llm: LLM, prompt_len: int, top: int = 20) -> dict:
    "GPU time of one eager decode step of one request, by kernel (torch.profiler): where the step's device time goes"
    from torch.profiler import profile, ProfilerActivity
    eng, inner = llm.llm_engine, llm.llm_engine.runner.model
    # eager: one launch per op
    eng.runner.model = inner.model if isinstance(inner, CUDAGraphModel) else inner
    eng.add_request('profiled', random_prompts(1, prompt_len, seed=1)[0],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    # prefill, two decode steps
    for _ in range(3): eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step(); torch.cuda.synchronize()
    while eng.has_unfinished_requests(): eng.step()
    eng.runner.model = inner
    us, calls = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name] = us.get(e.name, 0.0) + e.device_time_total; calls[e.name] = calls.get(e.name, 0) + 1
    total = sum(us.values())
    rows = [dict(kernel=k[:80], calls=calls[k], us=v) for k, v in sorted(us.items(), key=lambda kv: -kv[1])[:top]]
    out = dict(kernels=sum(calls.values()), gpu_us=total, top=rows)
    print(f"  one eager decode step: {out['kernels']} kernels, {total / 1e3:.2f} ms of GPU time")
    for r in rows: print(f"    {r['us'] / 1e3:8.3f} ms {r['calls']:6d}x  {r['kernel']}")
    return out


def graph_profile(llm: LLM, prompt_len: int, batches=(1, 4), steps: int = 4, top: int = 15) -> list:
    """Kernels of decode steps replayed from CUDA graphs, per step: how many, GPU busy time, those
    under 3 us, the largest"""
    from torch.profiler import profile, ProfilerActivity
    eng, rows = llm.llm_engine, []
    for B in batches:
        for i, p in enumerate(random_prompts(B, prompt_len, seed=2 + B)):
            eng.add_request(f'graphs-{B}-{i}', p, SamplingParams(temperature=0, max_tokens=steps + 12, ignore_eos=True))
        # (--quick: no GPU, no kernels)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        # prefill, then decode steps whose graph is captured
        for _ in range(8): eng.step()
        sync()
        acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps): eng.step()
            sync()
            wall = (time.perf_counter() - t0) / steps
        while eng.has_unfinished_requests(): eng.step()
        us, calls, small_n, small_us = {}, {}, 0, 0.0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us[e.name] = us.get(e.name, 0.0) + e.device_time_total / steps
                calls[e.name] = calls.get(e.name, 0) + 1 / steps
                if e.device_time_total < 3.0:
                    small_n, small_us = small_n + 1 / steps, small_us + e.device_time_total / steps
        r = dict(batch=B, wall_profiled_s=wall, kernels=round(sum(calls.values())), gpu_us=sum(us.values()),
                 small_kernels=round(small_n), small_us=small_us,
                 top=[dict(kernel=k[:80], calls=round(calls[k]), us=v)
                      for k, v in sorted(us.items(), key=lambda kv: -kv[1])[:top]])
        rows.append(r)
        print(f"  batch {B}: {r['kernels']} kernels a replayed step, {r['gpu_us'] / 1e3:.2f} ms of "
              f"GPU time; {r['small_kernels']} under 3 us take {small_us / 1e3:.2f} ms; "
              "the largest: " + ', '.join(f"{t['kernel'][:24]} {t['us'] / 1e3:.2f} ms"
                                         for t in r['top'][:4]), flush=True)
    return rows


def naive_vs_engine(cfg_name: str, cfg: ModelConfig, device, n: int, prompt_len: int,
                    max_tokens: int, seed: int, kernels, async_scheduling: bool = False) -> dict:
    trained = cfg_name == 'small' and (TRAINED / 'config.json').is_file()                      # the trained small model
    model = load_model(TRAINED, device=device) if trained else init_random(cfg, seed=seed, device=device)
    prompts = random_prompts(n, prompt_len, seed=seed)
    ids = torch.tensor(prompts, device=device)
    # warm-up, same shape
    generate_greedy(model, torch.tensor(random_prompts(n, prompt_len, seed=seed + 1), device=device), 2)
    sync(device); t0 = time.perf_counter()
    naive = generate_greedy(model, ids, max_tokens)[:, prompt_len:].tolist()
    sync(device); naive_s = time.perf_counter() - t0
    llm = LLM(model, max_num_seqs=n, kernels=kernels, max_model_len=prompt_len + max_tokens + 64,
              async_scheduling=async_scheduling)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    load_test(llm, random_prompts(n, prompt_len, seed=seed + 1),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # warm-up on other prompts of the same shape: kernels compiled and graphs captured, and no prefix-cache hits later
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    engine_s = time.perf_counter() - t0
    s = load_summary(outs, engine_s)
    same = sum(a == b for o, row in zip(outs, naive) for a, b in zip(o.outputs[0].token_ids, row)) / (n * max_tokens)
    runner = llm.llm_engine.runner.model
    r = dict(requests=n, tokens=n * max_tokens, weights='trained small checkpoint' if trained else 'random',
             naive_s=naive_s, engine_s=engine_s, naive_tok_s=n * max_tokens / naive_s,
             engine_tok_s=n * max_tokens / engine_s, speedup=naive_s / engine_s, same_tokens=same,
             engine_ttft_s=s['ttft_s'][50], engine_tpot_s=s['tpot_s'][50],
             runner=type(runner).__name__, graph_stats=getattr(runner, 'stats', None))
    print(f"  naive generate_greedy {r['naive_tok_s']:10.1f} tok/s   engine ({r['runner']}) "
          f"{r['engine_tok_s']:10.1f} tok/s   speed-up {r['speedup']:5.1f}x   "
          f"tokens equal to the naive loop's: {same:.1%} ({r['weights']} weights); "
          f"engine TTFT {1e3 * r['engine_ttft_s']:.0f} ms, TPOT {1e3 * r['engine_tpot_s']:.1f} ms, "
          f"graphs {r['graph_stats']}")
    return r


def section(res: dict, key: str, path, fn, stamp: dict | None = None):
    """Run one section; its result (or its error) goes into `res[key]`, with `stamp` (its date and
    arguments), and the JSON is rewritten"""
    try: res[key] = fn()
    except Exception as e:
        # keep what the other sections measure
        traceback.print_exc(); res[key] = dict(error=f"{type(e).__name__}: {e}")
    res.update(stamp or {})                                                           # stamped once it has a result
    if path: json.dump(res, open(path, 'w'), indent=1, default=str)


SECTIONS = ('concurrency', 'decode', 'profile', 'graphs', 'naive')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--config', default='bench', choices=('bench', 'small', 'tiny'))
    ap.add_argument('--experts', type=int, help="routed experts (default: the config's)")
    ap.add_argument('--concurrency', type=int, nargs='+', default=[1, 4, 16, 32, 64, 128, 256])
    ap.add_argument('--prompt-len', type=int, default=128)
    ap.add_argument('--max-tokens', type=int, default=32)
    ap.add_argument('--naive-config', default='small', choices=('small', 'tiny'))
    ap.add_argument('--naive-requests', type=int, default=32)
    ap.add_argument('--kernels', choices=('triton', 'torch'), help='force the kernels (default: Triton on the GPU)')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--max-num-batched-tokens', type=int,
                    help="the engine's token budget per step (default: EngineArgs')")
    ap.add_argument('--async-scheduling', action='store_true',
                    help="the engine's runner does not wait for each step's tokens (concurrency and naive sections)")
    ap.add_argument('--sections', nargs='+', default=list(SECTIONS), choices=SECTIONS,
                    help='what to measure; with --json, the sections not run keep what the file already holds')
    ap.add_argument('--json', help='write the results to this file')
    ap.add_argument('--check-values', action='store_true',
                    help="check every eager step's values (EngineArgs.check_values): a device sync per check")
    ap.add_argument('--codes', action='store_true',
                    help="layers keep the routed experts' codes (version 2 gate/up), not planes (08f), to compare")
    ap.add_argument('--planes-down', action='store_true',
                    help="layers hold the routed down weights in planes too (08f's down stage), not codes")
    ap.add_argument('--slots', action='store_true',
                    help="the planes' stages in 08f's version 4 (the activations in pair order), not version 3")
    ap.add_argument('--shared-fp8', action='store_true',
                    help="the shared expert through the MoE's kernels on its FP8 codes, not cuBLAS (08c), to compare")
    ap.add_argument('--fp8', action='store_true',
                    help="the fused MoE's routed stages in 08g's version 5 (FP8 products, 16-row blocks), the layers "
                         "holding FP8 words beside the planes")
    ap.add_argument('--fp8-mma', type=int, default=0, metavar='ROWS',
                    help="the FP8 projections on their codes through 09a's MMA kernel (version 2) up to ROWS rows "
                         "(at most 256), not cuBLAS on BF16 copies (FP8_LINEAR_MMA_T; 0: off)")
    ap.add_argument('--prefill-union', action='store_true',
                    help="runs of a request's tokens through 06b's sparse_prefill, not the sparse decode kernel")
    ap.add_argument('--quick', action='store_true', help='tiny config on the CPU, a few requests: checks the script')
    args = ap.parse_args()
    if not 0 <= args.fp8_mma <= 256: ap.error(f'--fp8-mma {args.fp8_mma}: expected 0 to 256 rows')
    fp8_linear.FP8_LINEAR_MMA_T = args.fp8_mma
    paged.SERVED_PLANES = not args.codes
    paged.SERVED_PLANES_DOWN = args.planes_down
    paged.SERVED_SHARED_DENSE = not args.shared_fp8
    paged.SERVED_SLOTS = args.slots
    paged.SERVED_FP8 = args.fp8
    sparse_prefill.PREFILL_UNION = args.prefill_union
    device = 'cuda' if torch.cuda.is_available() and not args.quick else 'cpu'
    if args.quick:
        (args.config, args.naive_config, args.concurrency, args.prompt_len,
         args.max_tokens) = 'tiny', 'tiny', [1, 4], 16, 4
        args.naive_requests, args.kernels = 4, args.kernels or 'torch'
    elif device == 'cpu': sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    if args.quick: torch.set_num_threads(1)         # tiny tensors: threads only wait for each other on a shared CPU
    from dsv41_nb.train import small_config
    configs = dict(bench=ModelConfig.bench, small=small_config, tiny=ModelConfig.tiny)
    cfg = configs[args.config]()
    if args.experts: cfg = dataclasses.replace(cfg, n_routed_experts=args.experts)
    machine, date = machine_name(device), f'{datetime.datetime.now():%Y-%m-%d %H:%M}'
    print(f"{machine}  {date}  torch {torch.__version__}  triton {triton.__version__}  "
          f"config {args.config}: {cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_routed_experts} "
          f"experts; prompts of {args.prompt_len} tokens, {args.max_tokens} out", flush=True)
    res = dict(machine=machine, date=date, torch=torch.__version__, triton=triton.__version__, config=args.config,
               commit=os.environ.get('DSV41_COMMIT') or git_commit(), args=vars(args))
    if args.json and set(args.sections) != set(SECTIONS) and Path(args.json).exists():
        kept = json.loads(Path(args.json).read_text())                          # the sections not run this time
        stamps = {sec: {f'{k}_{sec}': v for k, v in res.items() if k in ('date', 'commit', 'args')}
                  for sec in args.sections}
        res = dict(kept)
    else: stamps = {}
    if {'concurrency', 'decode', 'profile', 'graphs'} & set(args.sections):
        t0 = time.perf_counter()
        budget = dict(max_num_batched_tokens=args.max_num_batched_tokens) if args.max_num_batched_tokens else {}
        llm = paged_llm(cfg, args.seed, device, max_num_seqs=max(args.concurrency), kernels=args.kernels,
                        async_scheduling=args.async_scheduling, check_values=args.check_values,
                        max_model_len=args.prompt_len + args.max_tokens + 64, **budget)
        res.update(build_s=time.perf_counter() - t0, runner=type(llm.llm_engine.runner.model).__name__,
                   planes_layers=llm.planes_layers, planes_down_layers=llm.planes_down_layers)
        print(f"built in {res['build_s']:.1f} s; runner model {res['runner']}; "
              f"{llm.planes_layers} of {cfg.n_layers} layers with the routed gate/up in planes, "
              f"{llm.planes_down_layers} with the down weights too", flush=True)
    if 'concurrency' in args.sections:
        print(f"{'conc':>6} {'tok/s':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
              f"{'TPOT p99':>9} {'e2e p50':>8} {'floor':>9} {'x floor':>8}   (ms; e2e s; "
              "the step floor at that many requests, TPOT p50 over it)")
        section(res, 'concurrency', args.json,
                lambda: concurrency_rows(llm, args.concurrency, args.prompt_len, args.max_tokens,
                                           args.seed, res, args.json, cfg, device),
                stamps.get('concurrency'))
    if 'decode' in args.sections:
        print('decode step at batch 1:')
        section(res, 'decode_floor', args.json,
                lambda: decode_step(llm, cfg, device, args.prompt_len, 4 * args.max_tokens, args.seed),
                stamps.get('decode'))
    if 'profile' in args.sections and device == 'cuda':
        print('GPU time of one eager decode step, by kernel:')
        with pdl_off(llm):
            section(res, 'profile', args.json, lambda: kernel_profile(llm, args.prompt_len),
                    stamps.get('profile'))
    if 'graphs' in args.sections and (device == 'cuda' or args.quick):
        print('kernels of decode steps replayed from CUDA graphs:')
        with pdl_off(llm):
            section(res, 'graphs', args.json, lambda: graph_profile(llm, args.prompt_len),
                    stamps.get('graphs'))
    if {'concurrency', 'decode', 'profile', 'graphs'} & set(args.sections):
        del llm
        if device == 'cuda': torch.cuda.empty_cache()
    if 'naive' in args.sections:
        print(f'engine against the naive loop, {args.naive_requests} requests, config {args.naive_config}:')
        section(res, 'naive', args.json,
                lambda: naive_vs_engine(args.naive_config, configs[args.naive_config](), device, args.naive_requests,
                                        args.prompt_len, args.max_tokens, args.seed, args.kernels,
                                        args.async_scheduling), stamps.get('naive'))
    if args.json: print('wrote', args.json)


if __name__ == '__main__':
    main()
