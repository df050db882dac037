#!/usr/bin/env python
"""DSpark acceptance and throughput at several concurrencies, speculation off, fixed at 5 drafts, and adaptive.

    python tools/bench_dspark.py [--checkpoint checkpoints/small] [--drafter PATH] [--concurrency 1 8 32 128]
                                 [--new-tokens 32] [--prompt-len 64] [--paths loop engine] [--json PATH [--merge]]
                                 [--async-scheduling] [--quick]

Two paths, each decoding greedily (ignore EOS) from held-out windows of the training corpus:
- 'loop': `dsv41_nb.dspark.speculative_generate`, the reference decode loop: one dense forward per step re-runs every
  live sequence with its drafts (fp32) and hands the drafter its input from that same forward (no KV cache: the step
  cost grows with the sequence, so drafting looks cheaper than it is);
- 'engine': `dsv41_nb.engine.LLM` (runner 'auto': the paged path when the package has one, BF16; CUDA graphs for its
  decode-only steps on a GPU) with `DSparkProposer`; the runner keeps the target's taps from its own step (eager or
  replayed) and hands them to the drafter. Steps with drafts run synchronously (their verification graphs replayed);
  a step that drafts nothing (adaptive, its drafting paused) runs as a plain decode step (column plain/steps). The KV
  pool holds every request at once, so that c requests decode together.
Adaptive verification uses a step-cost curve measured here: in the loop, the target's forward over c sequences with
k + 1 new rows, k = 0..5; in the engine, the engine's own steps (`profile_step_costs`: c requests verifying 0, 1, c, 2c,
... 5c drafts in all; --costs stores it per machine). A loop row runs once for 2 new tokens first (its shapes
compiled), then timed; an engine row runs its whole decode on one engine (prefix caching off) until a run captures no
new CUDA graph (at most three runs), then once more, timed; the row counts the graphs captured while timed. Each row
reports tokens/s, tokens per request-step (1 + accepted drafts) and the mean drafts verified; the
per-slot acceptance measured with fixed 5 drafts is also priced on the eight-GPU layout of the full model (the
notebook's roofline model) as modelled tokens/s per GPU. Prints a table with the machine and date; --json writes it.
--merge keeps the rows of the existing --json file that this run did not measure (another path or concurrency), so a
table can be completed over several runs; the record lists every run that contributed (settings.runs).
--quick: concurrency 1 and 2, 8 new tokens, on the CPU."""
import argparse, copy, datetime, functools, json, os, sys, time
from pathlib import Path
import numpy as np
import torch
from dsv41_nb.dispatch import machine_name
from dsv41_nb.config import ModelConfig
from dsv41_nb.model import ByteTokenizer, init_random
from dsv41_nb.checkpoint_files import load_model
from dsv41_nb.floors import HARDWARE
from dsv41_nb.train import load_corpus, split_documents, byte_data
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.__main__ import load_summary
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit     # noqa: E402  (the checkout's commit, as every record names it)
import dsv41_nb.drafter_graphs  # noqa: F401  (an engine serves the drafter: fused kernels, CUDA graphs)
from dsv41_nb.dspark import Drafter
from dsv41_nb.dspark_decode import (DSparkProposer, SpecStats, speculative_generate, expected_accepted,
                                    choose_verify_lengths, roofline_step_cost)
from dsv41_nb.dspark_serving import load_drafter
from dsv41_nb.dspark_serving_measured import profile_step_costs, load_step_costs

POLICIES = ('off', 'fixed 5', 'adaptive')


def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize()


@torch.no_grad()
def measured_cost(model, c, length, block, device, reps=3):
    "c(T) from timing the target's forward over c sequences of length + k + 1 rows, k = 0..block; T = c (k + 1)"
    T, secs = [], []
    for k in range(block + 1):
        x = torch.randint(0, 256, (c, length + k + 1), device=device)
        model(x, return_hidden=True); sync(device)
        t0 = time.perf_counter()
        for _ in range(reps): model(x, return_hidden=True)
        sync(device); T.append(c * (k + 1)); secs.append((time.perf_counter() - t0) / reps)
    cost = lambda t: torch.as_tensor(np.interp(np.asarray(t, dtype=np.float64), T, secs))
    return cost, dict(tokens=T, seconds=secs)


def engine_costs(model, c, block, path, machine):
    "The engine's step costs at c requests: read from `path` if measured here for that size, else profiled (and stored)"
    if path and (p := load_step_costs(path, machine)) is not None and c in p.sizes:
        i = p.sizes.index(c)
        return type(p)((c,), (p.drafts[i],), (p.seconds[i],), p.machine)
    p = profile_step_costs(model, (c,), block, steps=4)
    if path:
        old = load_step_costs(path, machine)
        rows = {} if old is None else dict(zip(old.sizes, zip(old.drafts, old.seconds)))
        rows[c] = (p.drafts[0], p.seconds[0])
        s = sorted(rows)
        type(p)(tuple(s), tuple(rows[n][0] for n in s), tuple(rows[n][1] for n in s), machine).save(path)
    return p


def held_out_windows(cfg, n, length):
    "n windows of `length` ids from the held-out documents of the training corpus (seeded): the benchmark's prompts"
    docs = load_corpus()
    _, val_docs = split_documents(docs, seed=0)
    data = byte_data(docs[:1], val_docs, ByteTokenizer(cfg))
    starts = torch.randint(0, len(data.val) - length, (n,), generator=torch.Generator().manual_seed(1))
    return data.windows('val', starts, length)[0].tolist()


def proposer(drafter, policy, cost):
    if policy == 'off': return None
    return DSparkProposer(drafter, 5, adaptive=policy == 'adaptive', step_cost=cost)


def run_loop(model, drafter, prompts, n, policy, cost, device):
    st = SpecStats()
    prop = proposer(drafter, policy, cost)
    sync(device); t0 = time.perf_counter()
    speculative_generate(model, prompts, n, prop, stats=st)
    sync(device); dt = time.perf_counter() - t0
    return dict(seconds=dt, tokens_per_s=len(prompts) * n / dt,
                tokens_per_request_step=st.emitted / max(1, st.request_steps), steps=st.steps,
                drafted=st.drafted, accepted=st.accepted, mean_k=st.drafted / max(1, st.request_steps),
                target_s=st.target_s, draft_s=st.draft_s, slot_acceptance=st.slot_acceptance)


def captures(eng) -> int:
    "CUDA graphs the engine has captured so far: its steps' and its drafter's"
    g = getattr(eng.proposer, 'graphs', None)
    return getattr(eng.runner.model, 'stats', {}).get('captured', 0) + (g.stats['captured'] if g is not None else 0)


def run_engine(model, drafter, prompts, n, policy, cost, device, asyn=False, warmups=3):
    """One engine for the row, run several times on the same prompts: warm-up runs (greedy, so each meets the token
    counts of the one before) until one captures no new CUDA graph (at most `warmups`; an adaptive proposer's pacer
    carries its state over, so a run may draft in other steps than the run before), then a timed run, timed once more
    if it captured a graph (`timed_runs`). The row counts the graphs captured in the run it reports (`captured`, 0
    when the warm-up covered every size). Prefix caching is off, so every run prefills as the first did."""
    from dsv41_nb.engine import LLM
    prop = proposer(drafter, policy, cost)
    L = max(map(len, prompts)) + n + 8
    llm = LLM(model, proposer=prop, max_model_len=L, max_num_seqs=max(len(prompts), 1), enable_prefix_caching=False,
              async_scheduling=asyn, gpu_memory_utilization=0.9)   # a GPU's pool holds them all
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    eng = llm.llm_engine
    for _ in range(warmups):                                                            # warm-up
        c0 = captures(eng)
        llm.generate(prompts, sp, use_tqdm=False)
        if captures(eng) == c0: break
    for timed in range(1, 3):           # timed again (once) if the run captured a graph: its time held a capture
        before, plain, steps, c0 = dict(eng.scheduler.stats), eng.runner.plain_steps, eng.scheduler.step, captures(eng)
        sync(device); t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        sync(device); dt = time.perf_counter() - t0
        if captures(eng) == c0: break
    lat = load_summary(outs, dt)                                    # the requests' TTFT and TPOT percentiles
    stats = {k: v - before.get(k, 0) for k, v in llm.llm_engine.scheduler.stats.items()}
    emitted = sum(len(o.outputs[0].token_ids) for o in outs)
    # each request-step emits one non-draft token
    request_steps = emitted - stats['accepted_tokens']
    return dict(seconds=dt, tokens_per_s=emitted / dt, tokens_per_request_step=emitted / max(1, request_steps),
                drafted=stats['draft_tokens'], accepted=stats['accepted_tokens'],
                mean_k=stats['draft_tokens'] / max(1, request_steps), outputs=[o.outputs[0].token_ids for o in outs],
                steps=eng.scheduler.step - steps, plain_steps=eng.runner.plain_steps - plain,
                captured=captures(eng) - c0, timed_runs=timed, pacer=repr(getattr(prop, 'pacer', None)),
                ttft_s=lat['ttft_s'], tpot_s=lat['tpot_s'])


def modelled(a, c, policy, cost):
    "Tokens/s per GPU with c requests per GPU, per-slot acceptance a, on the eight-GPU layout (roofline cost)"
    a = torch.tensor(a, dtype=torch.float64).nan_to_num(0.0).clamp(0, 1)
    B = len(a)
    k = {'off': torch.zeros(c, dtype=torch.int64), 'fixed 5': torch.full((c,), B),
         'adaptive': choose_verify_lengths(a.expand(c, -1), cost) if B else torch.zeros(c, dtype=torch.int64)}[policy]
    return float((c + expected_accepted(a)[k].sum()) / cost(torch.tensor(c + int(k.sum()))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--checkpoint', default='checkpoints/small')
    ap.add_argument('--drafter', help='drafter weights (default: <checkpoint>/dspark.safetensors if present)')
    ap.add_argument('--concurrency', type=int, nargs='+', default=[1, 8, 32, 128])
    ap.add_argument('--new-tokens', type=int, default=32)
    ap.add_argument('--prompt-len', type=int, default=64)
    ap.add_argument('--paths', nargs='+', default=['loop', 'engine'], choices=['loop', 'engine'])
    ap.add_argument('--budget-minutes', type=float, default=6.0, help='skip the remaining rows after this long')
    ap.add_argument('--costs', help="the engine's step-cost profile: read if measured on this machine, else "
                                    "profiled and written (default: profiled each run, not stored)")
    ap.add_argument('--json', help='write the results here')
    ap.add_argument('--merge', action='store_true', help="keep the --json file's rows this run does not re-measure")
    ap.add_argument('--async-scheduling', action='store_true',
                    help="engine rows: the scheduler plans a step ahead, a plain step's ids are read back later")
    ap.add_argument('--quick', action='store_true', help='concurrency 1 and 2, 8 new tokens, on the CPU')
    args = ap.parse_args()
    device = torch.device('cuda' if torch.cuda.is_available() and not args.quick else 'cpu')
    if args.quick:
        torch.set_num_threads(1)
        args.concurrency, args.new_tokens, args.prompt_len = [1, 2], 8, 16
    t_start, ckpt = time.perf_counter(), Path(args.checkpoint)
    if (ckpt / 'config.json').exists(): model, source = load_model(ckpt, device=device), str(ckpt)
    else: model, source = init_random(ModelConfig.tiny(), seed=0, device=device, max_seq_len=4096), 'tiny (random)'
    engine_model = model.eval()                                      # BF16 masters, as loaded: the paged path's input
    # fp32 for the reference loop, as the drafter trained
    model = copy.deepcopy(model).float()
    engine_model.quant = model.quant = True
    drafter, engine_drafter = Drafter(model), Drafter(engine_model)
    dpath = Path(args.drafter) if args.drafter else ckpt / 'dspark.safetensors'
    trained = dpath.exists()
    if trained: load_drafter(drafter, dpath); load_drafter(engine_drafter, dpath)
    machine, date = machine_name(device), f'{datetime.datetime.now():%Y-%m-%d %H:%M}'
    print(f'{machine}  {date}  torch {torch.__version__}  target {source}, drafter {dpath if trained else "untrained"}')

    prompts = held_out_windows(model.cfg, max(args.concurrency), args.prompt_len)
    node = roofline_step_cost(ModelConfig.full(), HARDWARE['H200 (measured copy)'], 790e12)
    rows, costs, slots = [], {}, {}
    run_loop(model, drafter, prompts[:1], 4, 'fixed 5', None, device)                    # warm-up
    profiles = {}
    for c in args.concurrency:
        cost, costs[c] = measured_cost(model, c, args.prompt_len + args.new_tokens // 2, drafter.block_size, device)
        if 'engine' in args.paths:      # the engine's adaptive rows price steps with the engine's own costs
            profiles[c] = engine_costs(engine_model, c, drafter.block_size, args.costs, machine)
            costs[c]['engine'] = dict(drafts=profiles[c].drafts[0], seconds=profiles[c].seconds[0])
        for path in args.paths:
            for policy in POLICIES:
                if time.perf_counter() - t_start > args.budget_minutes * 60:
                    rows.append(dict(path=path, concurrency=c, policy=policy, skipped='time budget')); continue
                run, m, d = ((run_loop, model, drafter) if path == 'loop' else
                             (functools.partial(run_engine, asyn=args.async_scheduling), engine_model, engine_drafter))
                cost_here = profiles[c] if path == 'engine' else cost
                try:
                    # warm-up: this level's shapes compiled (the engine warms up on its own, a whole run)
                    if path == 'loop': run(m, d, prompts[:c], 2, policy, cost_here, device)
                    r = run(m, d, prompts[:c], args.new_tokens, policy, cost_here, device)
                except Exception as e:                                             # report it and go on
                    rows.append(dict(path=path, concurrency=c, policy=policy, error=repr(e)[:300]))
                    print(f'  {path} c={c} {policy}: ERROR {e!r}'[:300], flush=True)
                    continue
                if path == 'loop' and policy == 'fixed 5': slots[c] = r['slot_acceptance']
                r.pop('outputs', None)
                rows.append(dict(path=path, concurrency=c, policy=policy, **r))
                tpot = (f", TPOT p50/p99 {1e3 * r['tpot_s'][50]:.2f}/{1e3 * r['tpot_s'][99]:.2f} ms"
                        if r.get('tpot_s') else '')
                print(f"  {path} c={c} {policy}: {r['tokens_per_s']:.1f} tok/s, "
                      f"{r['tokens_per_request_step']:.2f} tokens per request-step, "
                      f"{r['seconds']:.1f} s{tpot}", flush=True)
    a = next(iter(slots.values()), [])
    for r in rows:
        r['modelled_tokens_per_s'] = modelled(slots.get(r['concurrency'], a), r['concurrency'],
                                              r['policy'], node)
    print(f"\n{'path':>6} {'conc':>5} {'policy':>9} {'tok/s':>9} {'tok/step':>8} {'mean k':>6} "
          f"{'s':>7} {'plain/steps':>11}   modelled tok/s/GPU (8 x H200, full model)")
    for r in rows:
        if 'tokens_per_s' not in r:
            print(f"{r['path']:>6} {r['concurrency']:5d} {r['policy']:>9}  {r.get('error', r.get('skipped'))}")
            continue
        print(f"{r['path']:>6} {r['concurrency']:5d} {r['policy']:>9} {r['tokens_per_s']:9.1f} "
              f"{r['tokens_per_request_step']:8.2f} {r['mean_k']:6.2f} {r['seconds']:7.2f} "
              f"{str(r.get('plain_steps', '-')) + '/' + str(r.get('steps', '-')):>11}   "
              f"{r['modelled_tokens_per_s']:9.0f}")
    print('per-slot acceptance (loop, fixed 5):', {c: [round(v, 3) for v in s] for c, s in slots.items()})
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        rec = dict(machine=machine, date=date, torch=torch.__version__,
                   commit=os.environ.get('DSV41_COMMIT') or git_commit(), target=source,
                   drafter=str(dpath) if trained else 'untrained',
                   settings=dict(vars(args), json=args.json and Path(args.json).name), rows=rows,
                   slot_acceptance=slots, step_costs=costs, total_seconds=time.perf_counter() - t_start)
        if args.merge and Path(args.json).exists(): rec = merge_runs(json.loads(Path(args.json).read_text()), rec)
        Path(args.json).write_text(json.dumps(rec, indent=1))
        print(f'results -> {args.json}')


def merge_runs(old: dict, new: dict) -> dict:
    "`new` with the rows of `old` it did not re-measure (same path and concurrency), and both runs listed"
    again = {(r['path'], r['concurrency']) for r in new['rows']}
    rows = [r for r in old['rows'] if (r['path'], r['concurrency']) not in again] + new['rows']
    runs = old['settings'].get('runs') or [dict(date=old['date'], settings=old['settings'])]
    out = dict(new, rows=sorted(rows, key=lambda r: (r['concurrency'], r['path'] != 'loop')),
               slot_acceptance={**old['slot_acceptance'], **new['slot_acceptance']},
               step_costs={**old['step_costs'], **new['step_costs']})
    out['settings'] = dict(new['settings'], paths=sorted({r['path'] for r in rows}),
                           concurrency=sorted({r['concurrency'] for r in rows}),
                           runs=runs + [dict(date=new['date'], settings=dict(new['settings']))])
    return out


if __name__ == '__main__':
    main()
