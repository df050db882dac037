"""tools/bench_capture.py on this CPU, its graphs emulated: built lazily, the first bursts capture their padded sizes;
built with capture_at_start, the engine holds them all before the first request and the bursts capture none."""
import json, sys
from pathlib import Path
import pytest
import torch
import triton
import triton.language as tl
from dsv41_nb.config import ModelConfig
from dsv41_nb.model import init_random
from dsv41_nb.engine import LLM
from dsv41_nb.cuda_graphs import CUDAGraphModel
from dsv41_nb.paged_step import step_model
from dsv41_nb.dispatch import kernel_backend, check_device
from dsv41_nb.launches import launch_keys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tools'))
import bench_capture
from bench_capture import bursts, captured, compiled, MODES

MODEL = init_random(ModelConfig.tiny(), seed=0)


def engine(mode: str) -> LLM:
    def build(kc): return CUDAGraphModel(step_model(MODEL, kc), kc, 256, (1, 2, 4, 8), emulate=True)
    return LLM(MODEL, step_model=build, max_num_seqs=4, max_model_len=128, kernels='torch',
               async_scheduling=True, max_num_batched_tokens=16, **MODES[mode])


def test_lazy_bursts_capture_and_start_up_bursts_do_not():
    lazy, start = engine('lazy'), engine('start')
    want = [None, None, [[n] for n in (1, 2, 3, 4, 5, 8, 9, 16)]]          # one prompt a step, each class
    assert [engine(m).llm_engine.start_up.get('prefill') for m in MODES] == want
    assert (captured(lazy), captured(start)) == (0, 3)           # 4 requests: sizes 1, 2 and 4
    a = bursts(lazy, [1, 3], 8, 3, torch.device('cpu'))
    b = bursts(start, [1, 3], 8, 3, torch.device('cpu'))
    assert [r['captured'] for r in a] == [1, 1] and [r['captured'] for r in b] == [0, 0]
    assert all(r['seconds'] > 0 and r['ttft_s'][99] >= r['ttft_s'][50] for r in a + b)


def test_compiled_counts_kernels_by_name(tmp_path):
    "One folder per specialization, named by its `<kernel>.json` (the group file is not a kernel); no cache: none"
    for d, names in {'a1': ['_fp8_gemm', '__grp___fp8_gemm'], 'b2': ['_fp8_gemm'], 'c3': ['_route']}.items():
        (tmp_path / d).mkdir()
        for n in names: (tmp_path / d / f'{n}.json').write_text('{}')
    assert compiled(tmp_path) == {'_fp8_gemm': 2, '_route': 1}
    assert compiled(tmp_path / 'none') == {} and compiled(None) == {}
    rows = bursts(engine('start'), [1], 8, 2, torch.device('cpu'), tmp_path)
    assert rows[0]['compiled'] == {}                       # nothing new in the cache while the burst ran


@triton.jit
def _count_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def test_bursts_name_the_specializations_each_meets_first(monkeypatch):
    "With `seen`, each burst's row lists the launch keys no earlier burst (or the build) met: 1, odd, then 16's"
    x = torch.zeros(64, device=check_device())
    if kernel_backend(x) != 'triton': pytest.skip('no Triton here (a CPU without TRITON_INTERPRET=1)')
    def load_test(llm, prompts, sp):       # a burst of n requests: one launch over n elements
        _count_kernel[(1,)](x, len(prompts), BLOCK=64)
        return dict(seconds=1.0, ttft_s={50: 0.1, 99: 0.2}, tpot_s={50: 0.01, 99: 0.02}, output_tokens_per_s=1.0)
    monkeypatch.setattr(bench_capture, 'load_test', load_test)
    llm = engine('lazy')
    with launch_keys() as at_build: _count_kernel[(1,)](x, 2, BLOCK=64)             # the build met an odd n
    rows = bursts(llm, [1, 3, 5, 32, 48], 4, 1, torch.device('cpu'), seen=set(at_build))
    new = [r['new_keys'] for r in rows]
    assert [len(k) for k in new] == [1, 0, 0, 1, 0] and "('constexpr', 1)" in new[0][0] and "'D')" in new[3][0]
    assert all('new_keys' not in r for r in bursts(llm, [1], 4, 1, torch.device('cpu')))   # not asked: not noted
    assert x[:6].tolist() == [7, 5, 4, 3, 3, 2]                    # every launch ran: 7 with n >= 1, 5 with n >= 2...


def test_merge_run_keeps_the_other_runs(tmp_path):
    path = tmp_path / 'r.json'
    bench_capture.merge_run(path, 'modes', 'a', {'x': 1}, machine='m1', settings={'s': 1})
    bench_capture.merge_run(path, 'modes', 'b', {'x': 2}, machine='m2')
    rec = json.loads(path.read_text())
    assert rec['modes'] == {'a': {'x': 1}, 'b': {'x': 2}} and rec['machine'] == 'm2' and rec['settings'] == {'s': 1}
    assert {'torch', 'commit', 'date'} <= set(rec)
