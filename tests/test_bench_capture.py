"""tools/bench_capture.py on this CPU, its graphs emulated: built lazily, the first bursts capture their padded sizes;
built with capture_at_start, the engine holds them all before the first request and the bursts capture none."""
import sys
from pathlib import Path
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.model import init_random
from dsv41_nb.engine import LLM
from dsv41_nb.cuda_graphs import CUDAGraphModel
from dsv41_nb.paged_step import step_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tools'))
from bench_capture import bursts, captured, compiled, MODES

MODEL = init_random(ModelConfig.tiny(), seed=0)


def engine(mode: str) -> LLM:
    def build(kc): return CUDAGraphModel(step_model(MODEL, kc), kc, 256, (1, 2, 4, 8), emulate=True)
    return LLM(MODEL, step_model=build, max_num_seqs=4, max_model_len=128, kernels='torch',
               async_scheduling=True, max_num_batched_tokens=16, **MODES[mode])


def test_lazy_bursts_capture_and_start_up_bursts_do_not():
    lazy, start = engine('lazy'), engine('start')
    assert [engine(m).llm_engine.start_up.get('prefill') for m in MODES] == [None, None, [1, 2, 3, 4, 5, 8, 9, 16]]
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
