"""tools/bench_mhc.py --maxnreg: the seam as compiled against capped registers, checked bit for bit, as a record."""
import json, os, subprocess, sys
from pathlib import Path
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow   # the interpreter ignores the cap: the GPU tier, which compiles, is where it means something
def test_capped_registers_give_the_same_bits(tmp_path):
    "Each token count as compiled, then at each cap: same bits, a time, the caps in order (compiled on a GPU)"
    out = tmp_path / 'cap.json'
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    if not torch.cuda.is_available(): env['TRITON_INTERPRET'] = '1'      # a check of the script alone
    argv = ['tools/bench_mhc.py', '--quick', '--maxnreg', '128', '--json', str(out)]
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())['rows']
    assert [(x['tokens'], x['maxnreg']) for x in rows] == [(t, c) for t in (1, 17) for c in (None, 128)]
    assert all(x['same_bits'] and x['us'] > 0 for x in rows)
