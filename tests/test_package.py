"The package imports and runs its CLI on a machine without a GPU"
import os, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def run(code, env_extra=None):
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': '', **(env_extra or {})}
    env.pop('TRITON_INTERPRET', None)
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd=ROOT)

def test_import_without_gpu_touches_no_device():
    code = ("import torch, importlib, pkgutil, dsv41_nb\n"
            "mods = [m.name for m in pkgutil.iter_modules(dsv41_nb.__path__) if m.name != '__main__']\n"
            "for m in mods: importlib.import_module('dsv41_nb.' + m)\n"
            "assert not torch.cuda.is_initialized(), 'CUDA was initialised at import time'\n"
            "print(len(mods), 'modules')")
    r = run(code)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[0]) >= 3

def test_reference_path_without_interpreter():
    "On a CPU without TRITON_INTERPRET the dispatch falls back to PyTorch and the codecs still work"
    code = ("import torch\nfrom dsv41_nb.dispatch import kernel_backend\nfrom dsv41_nb.formats import cache_codecs, store_records, gather_records\n"
            "from dsv41_nb.config import ModelConfig\n"
            "assert kernel_backend(torch.zeros(1)) == 'torch'\n"
            "c = cache_codecs(ModelConfig.tiny())['window']\n"
            "cache = torch.zeros(2, 4, c.record_bytes, dtype=torch.uint8); x = torch.randn(3, c.dim)\n"
            "store_records(c, x, cache, torch.tensor([5, -1, 0]))\n"
            "y = gather_records(c, cache, torch.tensor([5, 0]), torch.float32)\n"
            "assert ((y - x[[0, 2]]).norm() / x[[0, 2]].norm()) < 0.05\nprint('ok')")
    r = run(code)
    assert r.returncode == 0 and 'ok' in r.stdout, r.stderr

def test_cli_prints_accounting_and_layer_map():
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb'], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert 'global KV per token, DeepSeek layout (B)' in r.stdout and '890' in r.stdout
    assert '== layer map: tiny ==' in r.stdout and 'Reindex' in r.stdout
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', '--config', str(ROOT / 'nbs/reference/deepseek_v41_config.json')],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and '1,460' in r.stdout, r.stderr
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', '--config', 'nope.json'], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
