#!/usr/bin/env python
"""The instruction mix of a compiled Triton kernel's inner loop (from its PTX) and one launch's Nsight Compute figures,
as a record a notebook can read.

    python tools/kernel_mix.py --ptx KERNEL.ptx [--ncu NCU.txt] --json OUT.json [--machine NAME] [--commit SHA]
                               [--launch JSON]

--ptx: the kernel's PTX (`CompiledKernel.asm['ptx']`); the record counts each opcode of the longest loop's body once
(the instructions one thread runs per K step). --ncu: the text report of one `ncu` run on the kernel (its sections:
SpeedOfLight, LaunchStats, Occupancy, SchedulerStats, WarpStateStats, MemoryWorkloadAnalysis); the record keeps its
numeric metrics by name. --launch: a JSON object describing the launch (tokens, launch shape), stored as given.
--machine and --commit name where the files came from (default: this machine, this checkout). --quick: a check of the
script on a small PTX and report it writes itself."""
import argparse, datetime, json, re, sys, tempfile
from collections import Counter
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit     # noqa: E402  (the checkout's commit, as every record names it)


def loop_body(ptx: str) -> list[str]:
    "The instructions of the longest loop in `ptx`: from a label to the last branch back to it"
    lines = ptx.split('\n')
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r'^(\$L__BB\d+_\d+):', l))}
    loops = []
    for j, l in enumerate(lines):
        m = re.search(r'\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);', l)
        if m and m.group(1) in labels and labels[m.group(1)] < j: loops.append((labels[m.group(1)], j))
    if not loops: raise ValueError('the PTX has no loop (no branch back to an earlier label)')
    start, end = max(loops, key=lambda se: se[1] - se[0])
    return [l.strip() for l in lines[start + 1:end + 1]]


def opcode_counts(body: list[str]) -> dict:
    "Opcode (guard dropped, modifiers kept) -> count, for the instructions of `body`"
    ops = Counter()
    for l in body:
        if not l or l.startswith(('//', '.', '{', '}', '$')): continue
        words = l.split()
        op = words[1] if words[0].startswith('@') and len(words) > 1 else words[0]
        ops[op.rstrip(';')] += 1
    return dict(ops.most_common())


def ncu_metrics(text: str) -> dict:
    "Numeric metrics of an `ncu` text report: name -> value ('1,234.5' read as 1234.5; a repeated name gets its unit)"
    out = {}
    for l in text.split('\n'):
        m = re.match(r'^\s{4}(\S.*?)\s{2,}(?:(\S+)\s+)?([\d,]+(?:\.\d+)?)\s*$', l)
        if m and not l.strip().startswith(('OPT', 'INF', 'WRN', '---')):
            name = m.group(1).strip()
            if name in out and m.group(2): name = f'{name} ({m.group(2)})'   # e.g. Memory Throughput: % and TB/s
            out[name] = float(m.group(3).replace(',', ''))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--ptx')
    ap.add_argument('--ncu')
    ap.add_argument('--json')
    ap.add_argument('--machine')
    ap.add_argument('--commit')
    ap.add_argument('--launch', help='a JSON object describing the launch')
    ap.add_argument('--quick', action='store_true', help='check the script on a PTX and a report it writes')
    args = ap.parse_args(argv)
    if args.quick:
        d = Path(tempfile.mkdtemp())
        (d / 'k.ptx').write_text('$L__BB0_1:\n\tld.shared.b8 %r1, [%r2];\n\tprmt.b32 %r3, %r1, 0, 0;\n'
                                 '\tprmt.b32 %r4, %r1, 0, 1;\n\t@%p1 bra \t$L__BB0_1;\n\tret;\n')
        (d / 'n.txt').write_text('    Duration                         us       684.16\n'
                                 '    Registers Per Thread             register/thread             218\n')
        args.ptx, args.ncu, args.json = str(d / 'k.ptx'), str(d / 'n.txt'), str(d / 'out.json')
    if not args.ptx or not args.json: ap.error('--ptx and --json are required (or --quick)')
    try: launch = json.loads(args.launch) if args.launch else None
    except json.JSONDecodeError as e: ap.error(f'--launch: not JSON ({e})')
    try:
        body = loop_body(Path(args.ptx).read_text())
        ncu = ncu_metrics(Path(args.ncu).read_text()) if args.ncu else None
    except (OSError, ValueError) as e: ap.error(str(e))
    ops = opcode_counts(body)
    rec = dict(machine=args.machine, commit=args.commit or git_commit(), date=str(datetime.date.today()),
               launch=launch, loop_instructions=sum(ops.values()), loop_opcodes=ops, ncu=ncu)
    Path(args.json).write_text(json.dumps(rec, indent=1))
    top = ', '.join(f'{k} {v}' for k, v in list(ops.items())[:6])
    print(f"loop body: {rec['loop_instructions']} instructions per thread and step ({top}, ...)")
    if ncu: print(f"ncu: {len(ncu)} metrics, e.g. Duration {ncu.get('Duration')}")
    print('wrote', args.json)


if __name__ == '__main__':
    main()
