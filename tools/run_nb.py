#!/usr/bin/env python
"""Execute notebooks top to bottom and save their outputs in place (what `nbdev_test` runs, but kept).

    python tools/run_nb.py nbs/00_config.ipynb [more.ipynb ...] [--flags gpu slow]

Cells marked `#| gpu` / `#| slow` are skipped unless their flag is given, as in `nbdev_test`; a
skipped cell keeps the outputs it already had (so a CPU re-run does not erase H200 numbers).
Stops at the first exception. Run `nbdev_clean` afterwards. The notebooks' figures are saved to images/ too
(DSV41_SAVE_FIGURES=1, unless it is set to something else)."""
import argparse, os, re, sys, time
from pathlib import Path
from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell
from fastcore.xtras import working_directory

SKIPPABLE = {'gpu', 'slow'}
os.environ.setdefault('DSV41_SAVE_FIGURES', '1')   # refreshing a notebook's outputs refreshes its figures

def cell_flags(source):
    "The `#| word` directives at the top of a cell"
    flags = set()
    for line in source.splitlines():
        m = re.match(r'^#\|\s*(\S+)', line)
        if m: flags.add(m.group(1))
        elif line.strip() and not line.startswith('#'): break
    return flags

def run_notebook(path, flags=(), save_each=False):
    path = Path(path).resolve()
    nb = read_nb(path)
    skip = SKIPPABLE - set(flags)
    shell = CaptureShell(path)
    start = time.time()
    with working_directory(path.parent):
        for cell in nb.cells:
            if cell.cell_type != 'code' or cell_flags(cell.source) & skip: continue
            if 'nbdev_export(' in cell.source: continue
            cell.outputs = []                                  # a cell that now prints nothing keeps nothing
            shell.cell(cell)
            if save_each: write_nb(nb, path)                  # a run cut short keeps what it computed
            if shell.exc:
                sys.stderr.write(shell.prettytb(fname=path) + '\n')
                raise SystemExit(f'{path.name}: cell failed')
    write_nb(nb, path)
    return time.time() - start

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('notebooks', nargs='+')
    ap.add_argument('--flags', nargs='*', default=[])
    ap.add_argument('--save-each', action='store_true', help='write the notebook after every cell')
    args = ap.parse_args()
    for nb in args.notebooks:
        print(f'{nb}: {run_notebook(nb, args.flags, args.save_each):.1f} s', flush=True)
