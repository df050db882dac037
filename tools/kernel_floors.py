#!/usr/bin/env python
"""The layer's kernels against their floors and goals, all taken in one run on one GPU (one commit, one record).

    python tools/kernel_floors.py OUT_DIR [--parts moe layer sparse indexer] [--limit-s 900] [--quick]
    python tools/kernel_floors.py OUT_DIR --summary        # the table again, from OUT_DIR's records

Each kernel's own benchmark runs in turn, as a child process under the same commit label (`DSV41_COMMIT`, else the
checkout's), each writing its record into OUT_DIR:

  moe      tools/bench_moe.py --peer: the served MoE layer (router, GEMVs, fused MoE on planes) against
           `torch._grouped_mm` on BF16 weights, 1 to 8,192 tokens, each against the layer's floor
  layer    tools/bench_layer_kernels.py --parts copy mhc compressor: mHC's seam at 1 to 8,192 tokens, the compressor's
           decode step at 1 to 256 requests, and a plain copy of each size's floor bytes (what one launch of that
           size reaches when it does nothing else)
  sparse   tools/bench_sparse_decode.py: sparse MLA decode per query token at batch 1 to 256, and by context
  indexer  tools/bench_indexer.py --sections scan sparse: the full scan at 8K to 512K, pool-only scoring against it

Then the records are read back into OUT_DIR/kernel_floors.json and printed: for each goal, the fraction of its floor
at every size it applies to, the least of them, and whether the goal is met (the peer's fraction beside the MoE's;
the compressor's goal is a time and a launch count). The records must name one machine and one commit: a record from
another run is refused by name rather than merged. A part that fails, or runs past its share of `--limit-s`, is
named in the summary and its goals are reported as not measured. `--quick` runs every benchmark's own `--quick` (tiny
shapes, the Triton interpreter on a CPU): a check of the plumbing, whose numbers mean nothing."""
import argparse, datetime, json, os, subprocess, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# part -> (script, arguments, the record it writes, its share of the time limit)
PARTS = {
    'moe': ('bench_moe.py', ['--peer', '--sizes', '1', '16', '64', '256', '1024', '2048', '8192'], 'moe.json', 0.3),
    'layer': ('bench_layer_kernels.py', ['--parts', 'copy', 'mhc', 'compressor'], 'layer_kernels.json', 0.25),
    'sparse': ('bench_sparse_decode.py', [], 'sparse_decode.json', 0.25),
    'indexer': ('bench_indexer.py', ['--sections', 'scan', 'sparse'], 'indexer.json', 0.2),
}
# (goal name, part, the rows' kernel, least fraction of the floor, the sizes it applies to): the kernels' goals
GOALS = [('fused MoE', 'moe', 'moe', 0.6, (64, 2048)),
         ('mHC seam', 'layer', 'mhc', 0.4, (1, 8192)),
         ('sparse decode, batch', 'sparse', 'sparse', 0.4, (64, 256)),
         ('sparse decode, small batch', 'sparse', 'sparse', 0.1, (1, 16)),
         ('indexer full scan', 'indexer', 'indexer', 0.4, (131072, 524288))]
COMPRESSOR_GOAL = dict(batch=64, us=30.0, launches=2)


def command(part: str, out: Path, quick: bool) -> list:
    "The child process that measures `part`, writing its record into `out`"
    if part not in PARTS: raise ValueError(f"kernel_floors: unknown part {part!r}; expected one of {list(PARTS)}")
    script, extra, record, _ = PARTS[part]
    cmd = [sys.executable, str(HERE / script)]
    if part == 'layer': return cmd + [str(out)] + extra + (['--quick'] if quick else [])
    if part == 'moe' and quick: extra = ['--peer']          # its --quick picks its own sizes
    return cmd + extra + ['--json', str(out / record)] + (['--quick'] if quick else [])


def machine_of(rec: dict) -> str | None: return rec.get('machine') or rec.get('device')


def curves(records: dict) -> dict:
    """kernel -> [(size, fraction of the floor)] from each part's record (absent parts give none), with the MoE's peer
    as 'moe peer' and the copy's reach at the seam's and sparse decode's sizes as 'mhc copy' and 'sparse copy'"""
    out = {}
    if (m := records.get('moe')) is not None:
        rows = m.get('rows') or []
        out['moe'] = [(r['tokens'], r['of_floor']) for r in rows]
        out['moe peer'] = [(r['tokens'], r['peer_of_floor']) for r in rows if 'peer_of_floor' in r]
    if (lk := records.get('layer')) is not None:
        out['mhc'] = [(r['tokens'], r['of_floor']) for r in lk.get('mhc', [])
                      if r.get('version') == 2 and 'error' not in r]
        for kernel, name in (('mhc seam', 'mhc copy'), ('sparse decode', 'sparse copy')):
            out[name] = [(r['size'], r['of_floor']) for r in lk.get('copy', []) if r['kernel'] == kernel]
    if (sd := records.get('sparse')) is not None:
        best = {}                       # the faster launch at each batch, as the launch table chooses
        for r in sd.get('rows', []): best[r['batch']] = max(best.get(r['batch'], 0.0), r['of_floor'])
        out['sparse'] = sorted(best.items())
    if (ix := records.get('indexer')) is not None:
        out['indexer'] = [(r['context'], r['of_floor']) for r in ix.get('full_scan', [])]
    return out


def judge(records: dict) -> list[dict]:
    ("Each goal: the least fraction of the floor over the sizes it applies to, and whether it is met "
     "(None: not measured)")
    cs, rows = curves(records), []
    for name, part, kernel, goal, (lo, hi) in GOALS:
        at = [(n, f) for n, f in cs.get(kernel, []) if lo <= n <= hi]
        least = min((f for _, f in at), default=None)
        rows.append(dict(goal=name, part=part, sizes=[n for n, _ in at], of_floor=[f for _, f in at], least=least,
                         target=goal, met=None if least is None else least >= goal))
    lk = (records.get('layer') or {}).get('compressor', [])
    cp = [r for r in lk if r['batch'] == COMPRESSOR_GOAL['batch'] and r.get('version') == 2]
    us = max((r['graph_us'] for r in cp), default=None)
    launches = max((r['launches'] for r in cp), default=None)
    rows.append(dict(goal=f"compressor decode step, {COMPRESSOR_GOAL['batch']} requests", part='layer',
                     us=us, launches=launches, target=COMPRESSOR_GOAL['us'],
                     met=None if us is None else us <= COMPRESSOR_GOAL['us']
                     and launches <= COMPRESSOR_GOAL['launches']))
    return rows


def one_run(records: dict) -> tuple:
    "(machine, commit) every record names; ValueError naming the part that names another"
    seen = {}
    for part, rec in records.items():
        if rec is None: continue
        seen[part] = (machine_of(rec), rec.get('commit'))
    if len(set(seen.values())) > 1:
        raise ValueError("kernel_floors: the records are not one run: "
                         + '; '.join(f"{p}: {m}, commit {c}" for p, (m, c) in seen.items()))
    return next(iter(seen.values()), (None, None))


def read_records(out: Path, parts) -> dict:
    "part -> its record in `out` (None where it wrote none)"
    got = {}
    for p in parts:
        path = out / PARTS[p][2]
        got[p] = json.loads(path.read_text()) if path.exists() else None
    return got


def table(summary: dict) -> str:
    "The summary as printed"
    lines = [f"{summary['machine']}, commit {summary['commit']}, {summary['date']}: the layer's kernels against "
             f"their floors (one run)"]
    for r in summary['goals']:
        if 'us' in r:
            got = 'not measured' if r['us'] is None else f"{r['us']:.1f} us in {r['launches']} launches"
            lines.append(f"  {r['goal']:28s} {got:>30s}   goal {r['target']:.0f} us, met: {r['met']}")
            continue
        got = ('not measured' if r['least'] is None else
               ', '.join(f"{n:,}: {f:.0%}" for n, f in zip(r['sizes'], r['of_floor'])))
        lines.append(f"  {r['goal']:28s} {got}   goal {r['target']:.0%}, met: {r['met']}")
    cs = summary['curves']
    for name in ('moe peer', 'mhc copy', 'sparse copy'):
        if cs.get(name):
            lines.append(f"  {name:28s} " + ', '.join(f"{n:,}: {f:.0%}" for n, f in cs[name]))
    for part, why in summary['failed'].items(): lines.append(f"  {part}: {why}")
    return '\n'.join(lines)


def summarize(out: Path, parts, failed: dict | None = None) -> dict:
    "Read the parts' records from `out`, check they are one run, judge the goals; kernel_floors.json written"
    records = read_records(out, parts)
    machine, commit = one_run(records)
    failed = dict(failed or {})
    for p, rec in records.items():
        if rec is None: failed.setdefault(p, 'wrote no record')
    summary = dict(machine=machine, commit=commit, date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}',
                   parts=list(parts), curves=curves(records), goals=judge(records), failed=failed)
    (out / 'kernel_floors.json').write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('out', help='the directory that receives every record and kernel_floors.json')
    ap.add_argument('--parts', nargs='+', default=list(PARTS), choices=list(PARTS))
    ap.add_argument('--limit-s', type=float, default=900.0, help='seconds for all parts, shared as PARTS says')
    ap.add_argument('--summary', action='store_true', help="only read OUT's records and print the table")
    ap.add_argument('--quick', action='store_true', help="every benchmark's --quick: checks the plumbing")
    args = ap.parse_args(argv)
    if args.limit_s <= 0: ap.error(f'--limit-s {args.limit_s}: expected seconds > 0')
    out = Path(args.out); out.mkdir(parents=True, exist_ok=True)
    failed = {}
    if not args.summary:
        from bench_engine import git_commit
        env = dict(os.environ, DSV41_COMMIT=os.environ.get('DSV41_COMMIT') or git_commit() or 'unknown')
        if args.quick: env['TRITON_INTERPRET'] = '1'
        for p in args.parts:
            limit, t0 = PARTS[p][3] * args.limit_s, time.perf_counter()
            print(f"{p}: {' '.join(command(p, out, args.quick)[1:])}", flush=True)
            try:
                r = subprocess.run(command(p, out, args.quick), env=env, timeout=limit, cwd=HERE.parent,
                                   capture_output=True, text=True)
                (out / f'{p}.log').write_text(r.stdout + r.stderr)
                if r.returncode: failed[p] = f'exit status {r.returncode} (see {p}.log)'
            except subprocess.TimeoutExpired:
                failed[p] = f'stopped after {limit:.0f} s, its share of --limit-s'
            print(f"  {time.perf_counter() - t0:.0f} s{'; ' + failed[p] if p in failed else ''}", flush=True)
    print(table(summarize(out, args.parts, failed)))


if __name__ == '__main__':
    sys.path.insert(0, str(HERE))
    main()
