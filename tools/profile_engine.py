#!/usr/bin/env python
"""Where a decode step's time goes on one GPU at 128 and 256 requests: \
kernel time per component against the host's part.

    python tools/profile_engine.py OUT_DIR [--batches 128 256] [--prompt-len 128] [--steps 8] [--experts N]
                                           [--prefill] [--fp8-mma ROWS] [--quick]

The engine is the `bench` one of `tools/bench_engine.py` (the paged path with random weights, CUDA graphs, async
scheduling). For each batch size B: B random byte prompts are prefilled, every remaining capture size up to B is
captured, and then

- `--steps` decode steps are timed: the wall time per step (the GPU's, since under async scheduling the host's part of
  step n + 1 runs while step n computes) and the host's part by phase (`StepTimer` of 13a_engine_speed: schedule,
  inputs, model host (padding, staging, launching the graph), sample, update, outputs; `wait` is the host waiting for
  a step's ids), and the model host's part by part (`model_host_us`: the step model's prepare, the staged inputs' copy
  with its wait for the last transfer, the ids filled on the device, the graph's launch, the rest); then as many steps
  each started with the GPU idle (`host_idle_us`, `model_host_idle_us`): the host's own work, no launch waiting behind
  a step;
- four decode steps are profiled with torch.profiler, launched without programmatic dependent launch (the graphs
  captured again) so that a kernel's time is its own: the GPU time per step by component, each Triton kernel named by
  the module that defines it (sparse decode, indexer, compressor, MoE, FP8 linear, mHC, Engram, ...), cuBLAS and PyTorch
  kernels apart; and the host's time per step inside each CUDA runtime and driver call (`runtime_us`: graph launches,
  copies, kernel launches), which is where the host part of a replayed step goes beyond Python's;
- the step floor at B (`step_floor` of 01a_floors, at the measured copy bandwidth) for scale.

`--prefill` adds one eager prefill step of 64 prompts (8,192 tokens), timed and profiled the same way, with the
PyTorch operators that launched kernels and their input shapes (`ops`: the 40 with the most GPU time). Writes
OUT_DIR/profile_engine.json and OUT_DIR/profile_engine.txt (the summary printed). Takes about three minutes on one H200
for the bench config. `--quick` runs tiny on the CPU (emulated graphs, no kernels to profile): a check of the script."""
import argparse, dataclasses, datetime, importlib, json, os, statistics, sys, time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import paged_llm, pdl_off, git_commit
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import machine_name, copy_bandwidth
from dsv41_nb.floors import step_floor, HARDWARE
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.host_steps import StepTimer, HOST_PHASES
from dsv41_nb import cuda_graphs, fp8_linear
from dsv41_nb.cuda_graphs import CUDAGraphModel
from dsv41_nb.__main__ import random_prompts

COMPONENTS = {'sparse_decode': 'sparse decode', 'csa2': 'window attention', 'indexer': 'indexer',
              'indexer_kernels': 'indexer',
              'compressor': 'compressor', 'compressor_kernel': 'compressor',
              'moe_gemv': 'MoE', 'fused_moe': 'MoE', 'moe_split': 'MoE',
              'moe_planes': 'MoE',
              'router': 'MoE router', 'fp8_linear': 'FP8 linear', 'mhc': 'mHC', 'mhc_kernel': 'mHC',
              'engram': 'Engram',
              'rope_norm': 'RoPE / norm', 'formats': 'quantise', 'sampler': 'sampler'}


def triton_kernels() -> dict:
    "Triton kernel name -> the component of the package module that defines it (its own name if COMPONENTS has none)"
    import pkgutil, dsv41_nb
    from triton.runtime.interpreter import InterpretedFunction      # what @triton.jit makes under TRITON_INTERPRET
    kinds, out = (triton.runtime.JITFunction, InterpretedFunction), {}
    for info in pkgutil.iter_modules(dsv41_nb.__path__):
        if info.name.startswith('_'): continue
        try: mod = importlib.import_module(f'dsv41_nb.{info.name}')
        except ImportError: continue
        for v in vars(mod).values():
            while not isinstance(v, kinds) and hasattr(v, 'fn'): v = v.fn   # autotuners wrap one
            if isinstance(v, kinds):
                home = v.fn.__module__.rsplit('.', 1)[-1]
                out[v.fn.__name__] = COMPONENTS.get(home, home)
    return out


def component(kernel: str, triton_names: dict) -> str:
    if kernel in triton_names: return triton_names[kernel]
    k = kernel.lower()
    if 'memcpy' in k or 'memset' in k: return 'copies'
    if 'gemm' in k or 'cutlass' in k or 'cublas' in k or k.startswith(('sm90_', 'nvjet')): return 'GEMM (cuBLAS)'
    return 'PyTorch ops'


def sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize(device)


def decode_ready(eng, n: int, prompt_len: int, max_tokens: int, seed: int):
    "n requests added and prefilled, every one decoding"
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(random_prompts(n, prompt_len, seed=seed)): eng.add_request(f'p{seed}-{i}', p, sp)
    s = eng.scheduler
    while s.waiting or any(r.num_computed_tokens < r.prefill_len for r in s.running): eng.step('final')
    for _ in range(2): eng.step('final')                   # the first decode steps (a graph captured for n)


def drain(eng):
    for rid in list(eng.tracked): eng.abort_request(rid)
    while eng.has_unfinished_requests(): eng.step('final')


def kernels_of(prof, steps: int, triton_names: dict) -> dict:
    "GPU microseconds per step by component and by kernel, from a profile of `steps` steps"
    by_comp, by_kernel, n = defaultdict(float), defaultdict(float), 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA: continue
        by_comp[component(e.name, triton_names)] += e.device_time_total / steps
        by_kernel[e.name[:80]] += e.device_time_total / steps; n += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
    # the PyTorch operators that launched kernels, by input shapes (a profile that recorded them: the prefill step's)
    avg = [a for a in prof.key_averages(group_by_input_shape=True)
           if a.key.startswith('aten::') and getattr(a, 'self_device_time_total', 0) > 0]
    ops = [dict(op=a.key, shapes=str(a.input_shapes)[:240], calls=a.count / steps, us=a.self_device_time_total / steps)
           for a in sorted(avg, key=lambda a: -a.self_device_time_total)[:40]]
    # the host's time inside the CUDA runtime and driver (graph launches, copies, kernel launches), per step
    runtime = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith('cu'):
            runtime[e.name] += e.cpu_time_total / steps
    return dict(gpu_us=sum(by_comp.values()), kernels=round(n / steps),
                components=dict(sorted(by_comp.items(), key=lambda kv: -kv[1])),
                top=[dict(kernel=k, us=v) for k, v in top], ops=ops,
                runtime_us=dict(sorted(runtime.items(), key=lambda kv: -kv[1])))


def profile_steps(llm, device, steps: int, triton_names: dict) -> dict:
    "torch.profiler over `steps` engine steps (launched without programmatic dependent launch)"
    from torch.profiler import profile, ProfilerActivity
    eng = llm.llm_engine
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == 'cuda' else [])
    with pdl_off(llm):
        for _ in range(2): eng.step('final')               # graphs captured again, without PDL
        sync(device)
        with profile(activities=acts) as prof:
            for _ in range(steps): eng.step('final')
            sync(device)
    return kernels_of(prof, steps, triton_names)


MODEL_HOST_PARTS = ('prepare', 'staged', 'fill ids', 'replay')   # the replayed step's host work, in order


@contextmanager
def model_host_split(model, sync_before_replay: bool = False):
    """Host microseconds, summed while inside, in the parts of a CUDAGraphModel's forward: the step model's `prepare`,
    the staged inputs' copy (`StagedInputs.load` / `load_rows`, their wait for the last transfer included), the ids
    filled on the device (`fill_token_ids`) and the graphs' launches (the replay each captured graph's entry holds: a
    method bound at capture, so the graphs' entries are wrapped, not `CUDAGraph.replay`); the forward's total as
    'forward', the launches counted as 'replays'. `sync_before_replay`: the device synchronised before each launch's
    clock starts (the launch alone, with the step's copies and fills done). The methods and entries are wrapped in place
    and put back on exit"""
    times, undo, entries = defaultdict(float), [], []
    def timer(f, part):
        def timed(*a, **k):
            if part == 'replay':
                times['replays'] += 1
                if sync_before_replay: sync(torch.cuda.current_device())
            t = time.perf_counter_ns()
            try: return f(*a, **k)
            finally: times[part] += (time.perf_counter_ns() - t) / 1e3
        return timed
    def wrap(owner, name, part):
        f, own = getattr(owner, name), name in vars(owner)
        setattr(owner, name, timer(f, part)); undo.append((owner, name, f, own))
    inner = getattr(model, 'model', None)
    if hasattr(inner, 'prepare'): wrap(inner, 'prepare', 'prepare')
    for name in ('load', 'load_rows'): wrap(cuda_graphs.StagedInputs, name, 'staged')
    wrap(cuda_graphs, 'fill_token_ids', 'fill ids')
    for graphs in (getattr(model, 'graphs', None), getattr(model, 'journaled', None)):
        for size, entry in (graphs or {}).items():
            entries.append((graphs, size, entry))
            graphs[size] = (timer(entry[0], 'replay'),) + tuple(entry[1:])
    wrap(model, 'forward', 'forward')
    try: yield times
    finally:
        for graphs, size, entry in entries: graphs[size] = entry
        for owner, name, f, own in reversed(undo):
            if own: setattr(owner, name, f)
            else: delattr(owner, name)


def split_per_step(times: dict, steps: int) -> dict:
    "Microseconds a step by part of the model's host work, the forward's time outside the parts as 'rest'"
    parts = {k: times.get(k, 0.0) / steps for k in MODEL_HOST_PARTS}
    return parts | {'rest': times.get('forward', 0.0) / steps - sum(parts.values()),
                    'replays': times.get('replays', 0.0) / steps}


def idle_steps(eng, model, device, steps: int, sync_before_replay: bool = False) -> tuple:
    """(median microseconds by phase, model host parts summed) of `steps` steps each started with the GPU idle (synced
    before it): the host's own work, with no launch waiting for room behind a step still running"""
    rows = []
    with StepTimer(eng) as timer, model_host_split(model, sync_before_replay and device != 'cpu') as parts:
        for _ in range(steps): sync(device); rows.append(timer.step())
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}, parts


def measure(llm, cfg, device, B: int, args, bw: float, triton_names: dict) -> dict:
    eng = llm.llm_engine
    decode_ready(eng, B, args.prompt_len, args.steps * 3 + 16, seed=B)
    model = eng.runner.model
    if isinstance(model, CUDAGraphModel) and model._template is not None:
        t0 = time.perf_counter(); new = model.capture_all([s for s in model.sizes if s <= B])
        print(f"  captured {new} in {time.perf_counter() - t0:.1f} s", flush=True)
    with StepTimer(eng) as timer, model_host_split(model) as parts:
        sync(device); t0 = time.perf_counter()
        rows = [timer.step() for _ in range(args.steps)]
        sync(device); wall = (time.perf_counter() - t0) / args.steps
    host = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    idle, idle_parts = idle_steps(eng, model, device, args.steps)
    # and with the device synchronised again right before each launch: the launch alone, nothing queued before it
    _, synced_parts = idle_steps(eng, model, device, args.steps, sync_before_replay=True)
    prof = profile_steps(llm, device, 4, triton_names)
    drain(eng)
    ctx = args.prompt_len + args.steps
    floor = step_floor(cfg, dataclasses.replace(HARDWARE['H200'], bandwidth=bw), B, ctx)['seconds']
    work = sum(v for k, v in host.items() if k not in ('wait', 'total'))
    return dict(batch=B, wall_step_s=wall, host_us=host, host_work_us=work,
                model_host_us=split_per_step(parts, args.steps), host_idle_us=idle,
                model_host_idle_us=split_per_step(idle_parts, args.steps),
                model_host_synced_us=split_per_step(synced_parts, args.steps), floor_s=floor, **prof)


def prefill_profile(llm, device, args, triton_names: dict) -> dict:
    "One eager step of 64 prompts: wall time (the profiler's overhead included), kernels, the operators behind them"
    from torch.profiler import profile, ProfilerActivity
    eng, n = llm.llm_engine, 64
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(random_prompts(n, args.prompt_len, seed=7)): eng.add_request(f'pre-{i}', p, sp)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == 'cuda' else [])
    with pdl_off(llm):
        sync(device); t0 = time.perf_counter()
        # the operators and their shapes too, so that the kernels PyTorch launched are named by what launched them
        with profile(activities=acts, record_shapes=True) as prof:
            eng.step('final'); sync(device)
        wall = time.perf_counter() - t0
    drain(eng)
    return dict(prompts=n, tokens=n * args.prompt_len, wall_s=wall, **kernels_of(prof, 1, triton_names))


def host_parts(d: dict) -> str:
    "The model host's parts in microseconds, then the graph launches a step"
    us = ', '.join(f"{k} {v:.0f}" for k, v in d.items() if k != 'replays')
    return us + " us" + (f" ({d['replays']:.2f} launches a step)" if 'replays' in d else '')


def summary(res: dict) -> str:
    out = [f"{res['machine']}, {res['date']}, commit {res['commit']}, torch {res['torch']}, Triton {res['triton']}; "
           f"{res['config']} config, prompts of {res['args']['prompt_len']}, async scheduling, CUDA graphs"]
    for r in res['decode']:
        h = r['host_us']
        out.append(f"decode step, {r['batch']} requests: {1e3 * r['wall_step_s']:.2f} ms wall, GPU busy "
                   f"{r['gpu_us'] / 1e3:.2f} ms in {r['kernels']} kernels, floor {1e3 * r['floor_s']:.2f} ms "
                   f"({r['wall_step_s'] / r['floor_s']:.1f}x); host work {r['host_work_us'] / 1e3:.2f} ms "
                   f"(" + ', '.join(f"{k} {h[k]:.0f}" for k, *_ in HOST_PHASES)
                   + f" us), waiting {h['wait'] / 1e3:.2f} ms")
        if 'model_host_us' in r:
            out.append("  model host a step (mean of the timed steps): " + host_parts(r['model_host_us']))
        if 'host_idle_us' in r:
            hi = r['host_idle_us']
            out.append("  each step started on an idle GPU: host work " + ', '.join(
                f"{k} {hi[k]:.0f}" for k, *_ in HOST_PHASES) + " us; model host "
                + host_parts(r["model_host_idle_us"]))
        if 'model_host_synced_us' in r:
            out.append("  and synchronised again right before each launch: model host "
                       + host_parts(r['model_host_synced_us']))
        out += [f"    {v / 1e3:8.3f} ms  {v / r['gpu_us']:5.1%}  {k}" for k, v in r['components'].items()]
        rt = list(r.get('runtime_us', {}).items())[:5]
        if rt: out.append("  host time in the CUDA runtime a step (profiled steps): "
                          + ', '.join(f"{k} {v:.0f} us" for k, v in rt))
    if 'prefill' in res:
        p = res['prefill']
        out.append(f"eager prefill step, {p['prompts']} prompts ({p['tokens']} tokens): "
                   f"{p['wall_s']:.2f} s wall, GPU busy {p['gpu_us'] / 1e6:.2f} s in "
                   f"{p['kernels']} kernels")
        out += [f"    {v / 1e3:9.1f} ms  {v / p['gpu_us']:5.1%}  {k}" for k, v in p['components'].items()]
        if p.get('ops'): out.append("  the PyTorch operators with the most GPU time (their own kernels), by shapes:")
        out += [f"    {o['us'] / 1e3:9.2f} ms  {o['calls']:5.0f} calls  {o['op']} {o['shapes'][:90]}"
                for o in p.get('ops', [])[:15]]
    return '\n'.join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', help='directory for profile_engine.json and profile_engine.txt')
    ap.add_argument('--batches', type=int, nargs='+', default=[128, 256])
    ap.add_argument('--prompt-len', type=int, default=128)
    ap.add_argument('--steps', type=int, default=8, help='decode steps timed per batch size')
    ap.add_argument('--experts', type=int, help="routed experts (default: the config's)")
    ap.add_argument('--prefill', action='store_true', help='also one eager prefill step of 64 prompts')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--fp8-mma', type=int, default=0, metavar='ROWS',
                    help="the FP8 projections on their codes through 09a's MMA kernel up to ROWS rows (0: off)")
    ap.add_argument('--quick', action='store_true', help='tiny config on the CPU: a check of the script')
    args = ap.parse_args()
    if not 0 <= args.fp8_mma <= 256: ap.error(f'--fp8-mma {args.fp8_mma}: expected 0 to 256 rows')
    fp8_linear.FP8_LINEAR_MMA_T = args.fp8_mma
    device = 'cuda' if torch.cuda.is_available() and not args.quick else 'cpu'
    if device == 'cpu' and not args.quick:
        sys.exit('this profile needs a GPU (use --quick to check the script on a CPU)')
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    if args.quick: args.batches, args.prompt_len, args.steps = [2, 4], 16, 3; torch.set_num_threads(1)
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    if args.experts: cfg = dataclasses.replace(cfg, n_routed_experts=args.experts)
    mml = args.prompt_len + 3 * args.steps + 64
    t0 = time.perf_counter()
    llm = paged_llm(cfg, args.seed, device, max_num_seqs=max(args.batches), async_scheduling=True, max_model_len=mml,
                    **(dict(kernels='torch') if args.quick else {}))
    if args.quick:                                          # no GPU: the graph wrapper emulated
        eng = llm.llm_engine
        eng.runner.model = CUDAGraphModel(eng.runner.model, eng.kv_cache_config, mml, emulate=True)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    bw = copy_bandwidth(device=device) if device == 'cuda' else HARDWARE['H200 (measured copy)'].bandwidth
    names = triton_kernels()
    res = dict(machine=machine_name(device), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', torch=torch.__version__,
               triton=triton.__version__, commit=os.environ.get('DSV41_COMMIT') or git_commit(),
               config='tiny' if args.quick else 'bench', args=vars(args), copy_bandwidth=bw, decode=[])
    for B in args.batches:
        print(f"batch {B}:", flush=True)
        res['decode'].append(measure(llm, cfg, device, B, args, bw, names))
        json.dump(res, open(out / 'profile_engine.json', 'w'), indent=1, default=str)
    if args.prefill: res['prefill'] = prefill_profile(llm, device, args, names)
    json.dump(res, open(out / 'profile_engine.json', 'w'), indent=1, default=str)
    text = summary(res)
    (out / 'profile_engine.txt').write_text(text + '\n')
    print(text)
    print('wrote', out / 'profile_engine.json', 'and', out / 'profile_engine.txt')


if __name__ == '__main__':
    main()
