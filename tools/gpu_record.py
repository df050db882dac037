"""The GPU test tier's record: pytest's JUnit XML summed per test file, with the commit, machine, date and wall time.

    python tools/gpu_record.py JUNIT_XML [JUNIT_XML ...] --out records/gpu_tier.json [--commit SHA] [--wall-s S]
                               [--setup-s S] [--machine TEXT] [--collected IDS.txt ...]

Several reports (the tier's phases) are summed into one record, which names the phases it holds (the reports' names
after gpu_tier_junit_) with each one's time (its test suites' own, `phase_s`), and is dated by when the first of them
started. Prints one line per file (passed / failed /
skipped / seconds) and the failures' names, and writes the JSON. --collected names files of the test ids each phase was
to run (`pytest --collect-only -q`): a test collected but absent from every report (the phase was stopped in it, or
before it) is recorded under `not_finished`, and counts as not passed."""
import argparse, json, os, subprocess, time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from collections import defaultdict
from pathlib import Path


def _module_at(case) -> tuple[list[str], int | None]:
    "A JUnit case's `classname` split at its dots, and where the last test_ module is among the parts (None: nowhere)"
    parts = (case.get('classname') or '').split('.')
    mods = [i for i, p in enumerate(parts) if p.startswith('test_')]
    return parts, (mods[-1] if mods else None)


def test_file(case) -> str:
    "A test case's file name: `file` if the report has it, else the test_ module in `classname` (tests.test_x.TestY)"
    if f := case.get('file'): return Path(f).name
    parts, m = _module_at(case)
    return f"{parts[m]}.py" if m is not None else '(skipped at collection)'


def summarise(*paths) -> tuple[dict, list]:
    "({file: {passed, failed, skipped, seconds}}, [failed test ids]) summed over JUnit XML reports"
    if not paths: raise ValueError('summarise needs at least one JUnit XML report')
    files, failed = defaultdict(lambda: dict(passed=0, failed=0, skipped=0, seconds=0.0)), []
    cases = [c for p in paths for c in ET.parse(p).getroot().iter('testcase')]
    for case in cases:
        row = files[test_file(case)]
        row['seconds'] += float(case.get('time') or 0)
        if case.find('failure') is not None or case.find('error') is not None:
            row['failed'] += 1; failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find('skipped') is not None: row['skipped'] += 1
        else: row['passed'] += 1
    return dict(sorted(files.items())), failed


def node_id(case) -> str:
    "A JUnit test case's pytest id: tests.test_x.TestY + test_z[p] -> tests/test_x.py::TestY::test_z[p]"
    parts, m = _module_at(case)
    if m is None: return case.get('name') or ''
    return '::'.join(['/'.join(parts[:m + 1]) + '.py', *parts[m + 1:], case.get('name') or ''])


def not_finished(collected, *paths) -> list[str]:
    "The ids in the `--collect-only -q` listings `collected` that no report holds, in collection order"
    ran = {node_id(c) for p in paths for c in ET.parse(p).getroot().iter('testcase')}
    ids = [line.strip() for f in collected for line in Path(f).read_text().splitlines() if '::' in line]
    return [i for i in ids if i not in ran]


def started(*paths) -> str | None:
    "When the earliest of the reports' test suites started (UTC), from their `timestamp`s; None if none has one"
    stamps = [t.get('timestamp') for p in paths for t in ET.parse(p).getroot().iter('testsuite') if t.get('timestamp')]
    if not stamps: return None
    first = min(datetime.fromisoformat(s) for s in stamps)
    first = first.astimezone(timezone.utc) if first.tzinfo else first
    return f'{first:%Y-%m-%d %H:%M} UTC'


def suite_seconds(path) -> float | None:
    "A report's own time: the sum of its test suites' `time` (pytest's run of that phase); None if none has one"
    times = [float(t.get('time')) for t in ET.parse(path).getroot().iter('testsuite') if t.get('time')]
    return round(sum(times), 2) if times else None


def machine() -> str:
    try:
        import torch, triton
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'
        return f"{gpu}, torch {torch.__version__}, Triton {triton.__version__}"
    except Exception as e: return f'unknown ({e})'


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('junit', nargs='+'); ap.add_argument('--out', required=True)
    ap.add_argument('--commit', default=os.environ.get('DSV41_COMMIT'))
    ap.add_argument('--wall-s', type=float, default=None); ap.add_argument('--setup-s', type=float, default=None)
    ap.add_argument('--machine', help='the GPU, torch and Triton the reports ran on (default: this machine\'s)')
    ap.add_argument('--collected', nargs='*', default=[], help='test ids each phase collected, one file a phase')
    a = ap.parse_args()
    commit = (a.commit or subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
              or None)
    files, failed = summarise(*a.junit)
    tot = {k: sum(r[k] for r in files.values()) for k in ('passed', 'failed', 'skipped')}
    rec = dict(commit=commit, machine=a.machine or machine(),
               date=started(*a.junit) or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
               phases=[Path(p).stem.removeprefix('gpu_tier_junit_') for p in a.junit],
               phase_s={Path(p).stem.removeprefix('gpu_tier_junit_'): suite_seconds(p) for p in a.junit},
               examples_scale=float(os.environ.get('DSV41_EXAMPLES', 1)), wall_s=a.wall_s, setup_s=a.setup_s,
               **tot, not_finished=not_finished(a.collected, *a.junit), failures=failed, files=files)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump(rec, open(a.out, 'w'), indent=1)
    for name, r in files.items():
        print(f"{name:38} {r['passed']:4d} passed {r['failed']:3d} failed {r['skipped']:3d} "
              f"skipped {r['seconds']:7.1f} s")
    print(f"GPU tier at {commit}: {tot['passed']} passed, {tot['failed']} failed, {tot['skipped']} skipped"
          + (f", {len(rec['not_finished'])} not finished" if rec['not_finished'] else '')
          + (f" in {a.wall_s:.0f} s" if a.wall_s else '') + f" ({rec['machine']})")
    for f in failed: print('FAILED', f)
    for f in rec['not_finished']: print('NOT FINISHED', f)


if __name__ == '__main__': main()
