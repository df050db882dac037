"The package as a user meets it: imports without a GPU, its docstring and version, the `dsv41` command"
import configparser, importlib.metadata, os, shutil, subprocess, sys, tempfile
import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def run(code, env_extra=None):
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': '', **(env_extra or {})}
    env.pop('TRITON_INTERPRET', None)
    return subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd=ROOT)

def cli(*args, exe=None):
    "Run the command line (`python -m dsv41_nb` unless `exe` is given) and return the finished process"
    cmd = [exe] if exe else [sys.executable, '-m', 'dsv41_nb']
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=ROOT)

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
    code = ("import torch\nfrom dsv41_nb.dispatch import kernel_backend\n"
            "from dsv41_nb.record_codecs import cache_format\n"
            "from dsv41_nb.records import store_records, gather_records\n"
            "from dsv41_nb.config import ModelConfig\n"
            "assert kernel_backend(torch.zeros(1)) == 'torch'\n"
            "c = cache_format(ModelConfig.tiny(), 'window_fp8')\n"
            "cache = torch.zeros(2, 4, c.record_bytes, dtype=torch.uint8); x = torch.randn(3, c.dim)\n"
            "store_records(c, x, cache, torch.tensor([5, -1, 0]))\n"
            "y = gather_records(c, cache, torch.tensor([5, 0]), torch.float32)\n"
            "assert ((y - x[[0, 2]]).norm() / x[[0, 2]].norm()) < 0.05\nprint('ok')")
    r = run(code)
    assert r.returncode == 0 and 'ok' in r.stdout, r.stderr

def test_data_parallel_llm_needs_no_extra_import():
    "LLM(..., data_parallel_size=N) is the data-parallel front whichever module the user imports LLM from"
    code = ("from dsv41_nb.engine import LLM\n"
            "from dsv41_nb.config import ModelConfig\n"
            "from dsv41_nb.model import init_random\n"
            "m = init_random(ModelConfig.tiny(), seed=0)\n"
            "print(type(LLM(m, data_parallel_size=1, max_model_len=64)).__name__)\n"
            "try: LLM(m, data_parallel_size=0)\n"
            "except ValueError as e: print(e)")
    r = run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ['LLM', 'LLM: data_parallel_size = 0; expected at least 1']

def test_docstring_and_version():
    "help(dsv41_nb) shows what the package is; __version__ is settings.ini's"
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT / 'settings.ini')
    r = run("import dsv41_nb, pydoc; print(dsv41_nb.__version__); print(pydoc.render_doc(dsv41_nb, "
            "renderer=pydoc.plaintext))")
    assert r.returncode == 0, r.stderr
    version, doc = r.stdout.split('\n', 1)
    assert version == cfg['DEFAULT']['version']
    assert "DeepSeek-V4.1-Flash's inference path" in doc.split('FILE')[0], doc[:500]

def test_cli_prints_accounting_and_layer_map():
    r = cli()
    assert r.returncode == 0, r.stderr
    assert 'global KV per token' in r.stdout and '890' in r.stdout
    assert '== layer map: tiny ==' in r.stdout and 'Reindex' in r.stdout
    for column in ('kv_src', 'idx_src', 'candidates', 'dspark_tap', 'ratio'):  # the legend explains each column
        assert any(line.split()[:1] == [column] for line in r.stdout.splitlines()), column
    r = cli('--config', str(ROOT / 'nbs/reference/deepseek_v41_config.json'))
    assert r.returncode == 0 and '1,460' in r.stdout, r.stderr
    r = cli('--config', 'nope.json')
    assert (r.returncode == 2 and "no preset or config file named 'nope.json'" in r.stderr
            and 'Traceback' not in r.stderr)

def test_cli_stops_quietly_when_the_reader_does():
    "`python -m dsv41_nb | head -1`: no BrokenPipeError trace once the reader has gone"
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}  # each line reaches the pipe as it is printed
    p = subprocess.Popen([sys.executable, '-m', 'dsv41_nb'], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT, env=env)
    assert p.stdout.readline().startswith(b'== accounting')
    p.stdout.close()  # the reader goes away while the program still has the accounting and the layer map to print
    err = p.stderr.read().decode(); p.wait(timeout=60)
    assert 'Traceback' not in err and 'BrokenPipeError' not in err, err

def _installed() -> bool:
    "Whether pip installed this package (a GPU machine may import it from the source tree instead)"
    try: importlib.metadata.distribution('dsv41_nb'); return True
    except importlib.metadata.PackageNotFoundError: return False

def test_console_script_names_itself():
    "The installed `dsv41` script says `dsv41` in its usage line; `python -m dsv41_nb` says that"
    exe = Path(sys.executable).parent / 'dsv41'
    if not exe.exists() and not _installed(): pytest.skip('the package is imported from the source tree, not installed')
    assert exe.exists(), f'the dsv41 console script is not installed next to {sys.executable}'
    r = cli('--help', exe=str(exe))
    assert r.returncode == 0 and r.stdout.startswith('usage: dsv41 '), r.stdout
    r = cli('--help')
    assert r.returncode == 0 and r.stdout.startswith('usage: python -m dsv41_nb '), r.stdout

def test_wheel_carries_the_trained_checkpoint(tmp_path):
    "A wheel built from the checkout, installed elsewhere, serves the trained small checkpoint from any folder"
    src = tmp_path / 'src'                       # a copy: building in the checkout would leave build/ there
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns('.git', '.venv*', 'build', '*.egg-info', '_docs', 'images',
                                                             'nbs', 'tests', '.whl', '__pycache__'))
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', str(src), '--no-deps', '-q', '-w', str(tmp_path / 'whl')],
                       capture_output=True, text=True)
    if r.returncode and ('No matching distribution' in r.stderr or 'Could not find a version' in r.stderr):
        pytest.skip('the build backend (setuptools) cannot be installed here: no package index')
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((tmp_path / 'whl').glob('dsv41_nb-*.whl'))
    site = tmp_path / 'site'
    r = subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--target', str(site), str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    # as a user runs it
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'} | dict(PYTHONPATH=str(site))
    code = "import dsv41_nb.__main__ as m; print(m.shipped_checkpoint())"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
    assert r.stdout.strip() == str(site / 'dsv41_nb' / 'checkpoints' / 'small'), r.stdout + r.stderr
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', 'generate', 'Return the', '--max-tokens', '4'],
                       capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env, timeout=600)
    assert r.returncode == 0 and 'no trained checkpoint' not in r.stderr, r.stderr[-2000:]
