"""The notebooks as a reader runs them: `jupyter nbconvert --execute`, top to bottom, in a Jupyter kernel on a CPU (the
`#| gpu` cells turn into one-line notes there; `nbdev_test` skips them instead). One notebook with GPU cells runs by
default; `DSV41_SLOW=1` runs all of them. Outputs go to a temporary folder, and the checkout must be left unchanged."""
import json, os, subprocess, sys, tempfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
SLOW = bool(os.environ.get('DSV41_SLOW'))
QUICK = ['03a_rope_norm']        # has `#| gpu` cells and runs in seconds
NOTEBOOKS = sorted(p.stem for p in (ROOT / 'nbs').glob('*.ipynb')) if SLOW else QUICK
pytest.importorskip('nbconvert', reason='running notebooks needs nbconvert (jupyterlab brings it)')


def git_status() -> str:
    "Changes to what a notebook could write by mistake: figures, records, checkpoints, anything new in the checkout"
    paths = ['images', 'records', 'checkpoints', '.hypothesis']
    return subprocess.run(['git', 'status', '--porcelain', '--untracked-files=all', '--', *paths],
                          capture_output=True, text=True, cwd=ROOT).stdout


def has_gpu_cells(path) -> bool:
    return any(c['cell_type'] == 'code' and ''.join(c['source']).lstrip().startswith('#| gpu')
               for c in json.loads(path.read_text())['cells'])


@pytest.mark.parametrize('name', NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name):
    before = git_status()
    env = {k: v for k, v in os.environ.items() if k not in ('DSV41_SAVE_FIGURES', 'IN_TEST')}
    env.setdefault('TRITON_INTERPRET', '1')
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, '-m', 'jupyter', 'nbconvert', '--to', 'notebook', '--execute',
                            '--ExecutePreprocessor.timeout=1800', '--output-dir', out,
                            str(ROOT / 'nbs' / f'{name}.ipynb')],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        text = (Path(out) / f'{name}.ipynb').read_text()
    if has_gpu_cells(ROOT / 'nbs' / f'{name}.ipynb') and not _has_gpu():
        assert 'Skipped without a GPU' in text, 'a GPU cell ran without a GPU'
    assert git_status() == before, 'running the notebook changed the checkout'


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError: return False
