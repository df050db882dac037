#!/usr/bin/env python
"""Which single-line mutants of a module its tests let through.

    python tools/mutants.py block_pool.py tests/test_block_pool.py [more tests] [--lines 127,162] [-k EXPR]

Copies the package and the tests to a scratch directory, then for every mutable line of
`dsv41_nb/MODULE` makes one small change at a time (a comparison turned around or made strict,
`and`/`or` swapped, a `not` or a `+ 1`/`- 1` dropped, `min`/`max` swapped, `return True`/`False`
swapped) and runs the tests against it (`pytest -x`, Triton's interpreter, no bytecode cache, so a
mutant written in the same second as the last one is never run from the last one's bytecode); a
mutant whose tests run four times as long as the module's own (at least a minute) hangs, and counts as caught.
Prints each mutant that every test passed; `--json` writes them. Lines that raise, build a
message or call a `check_` validator are left alone: the bad-input tables check those. A survivor
is either a missing test or an equivalent mutant (one that cannot change what the code does); the
list says which to look at."""
import argparse, json, os, re, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = [(r' < ', ' <= '), (r' <= ', ' < '), (r' > ', ' >= '), (r' >= ', ' > '), (r' == ', ' != '),
       (r' != ', ' == '), (r' \+ 1\b', ''), (r' - 1\b', ''), (r' and ', ' or '), (r' or ', ' and '),
       (r'\bnot ', ''), (r'return True\b', 'return False'), (r'return False\b', 'return True'),
       (r'\bmin\(', 'max('), (r'\bmax\(', 'min(')]


def mutants(lines: list) -> list:
    "(line index, mutated line) for every operator of `OPS` on every line that is code"
    out = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s[0] in '#"\'' or (s[0] == '(' and s[1:2] in '"\''): continue
        if 'raise ' in s or 'check_' in s: continue
        code = re.split(r'\s#', line)[0]
        if re.search(r'\bf["\']', code): continue          # builds a message
        for pat, rep in OPS:
            out += [(i, line[:m.start()] + rep + line[m.end():]) for m in re.finditer(pat, code)]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('module', help="a file of dsv41_nb, e.g. block_pool.py")
    p.add_argument('tests', nargs='+', help="test files, relative to the repository")
    p.add_argument('--lines', help="only these 1-based line numbers, comma-separated")
    p.add_argument('--json', help="also write the survivors here")
    p.add_argument('-k', dest='select', help="only the tests this pytest -k expression selects")
    a = p.parse_args()
    src = ROOT / 'dsv41_nb' / a.module
    if not src.is_file(): p.error(f"no module dsv41_nb/{a.module}")
    if missing := [t for t in a.tests if not (ROOT / t).is_file()]: p.error(f"no test file {missing}")
    work = Path(tempfile.mkdtemp(prefix='mutants-'))
    try:
        shutil.copytree(ROOT / 'dsv41_nb', work / 'dsv41_nb',
                        ignore=shutil.ignore_patterns('__pycache__'))
        shutil.copytree(ROOT / 'tests', work / 'tests', ignore=shutil.ignore_patterns('__pycache__'))
        for name in ('settings.ini', 'pyproject.toml', 'checkpoints', 'records', 'nbs', 'images'):
            if (ROOT / name).exists(): os.symlink(ROOT / name, work / name)
        path, orig = work / 'dsv41_nb' / a.module, src.read_text().splitlines(keepends=True)
        todo = mutants(orig)
        if a.lines:
            keep = {int(x) for x in a.lines.split(',')}
            todo = [m for m in todo if m[0] + 1 in keep]
        env = dict(os.environ, PYTHONPATH=str(work), TRITON_INTERPRET='1', PYTHONDONTWRITEBYTECODE='1')
        select = ['-k', a.select] if a.select else []
        run = lambda limit=None: subprocess.run([sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider',
                                                 *select, *a.tests], cwd=work, env=env, capture_output=True,
                                                text=True, timeout=limit)
        t0 = time.time()
        if (base := run()).returncode:
            sys.exit(f"the tests fail on the module as it is:\n{base.stdout[-2000:]}")
        limit = max(60.0, 4 * (time.time() - t0))    # a mutant that runs past this hangs: the tests catch it
        print(f"{len(todo)} mutants of dsv41_nb/{a.module}", flush=True)
        survivors, t0 = [], time.time()
        for i, new in todo:
            path.write_text(''.join(orig[:i] + [new] + orig[i + 1:]))
            try: passed = run(limit).returncode == 0
            except subprocess.TimeoutExpired:
                print(f"hung (killed after {limit:.0f} s), line {i + 1}: {new.strip()}", flush=True); continue
            if passed:
                survivors.append(dict(line=i + 1, was=orig[i].strip(), now=new.strip()))
                print(f"survived, line {i + 1}: {new.strip()}", flush=True)
        print(f"{len(survivors)} of {len(todo)} survived ({time.time() - t0:.0f} s)")
        if a.json: Path(a.json).write_text(json.dumps(survivors, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__': main()
