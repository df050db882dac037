"""tools/kernel_mix.py: the instruction mix of a kernel's inner loop, and an Nsight Compute report's metrics."""
import importlib.util, json, os, subprocess, sys
from pathlib import Path
import pytest
import torch
from dsv41_nb.moe_planes import asm_layouts

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('kernel_mix', ROOT / 'tools' / 'kernel_mix.py')
km = importlib.util.module_from_spec(spec); spec.loader.exec_module(km)

PTX = """\tmov.u32 %r1, 0;
$L__BB0_1:
\tadd.s32 %r1, %r1, 1;
\t@%p1 bra \t$L__BB0_1;
$L__BB0_2:                              // =>This Inner Loop Header: Depth=1
\t.loc 1 2 3
\tld.shared.b8 %rs1, [%r2];
\tprmt.b32 %r3, %r4, 0, 0;
\tprmt.b32 %r5, %r4, 0, 1;
\tmul.bf16 %rs2, %rs3, %rs4;
\t{
\t@%p2 mul.bf16 %rs5, %rs3, %rs4;
\t}
\t@%p3 bra \t$L__BB0_2;
\tret;
"""

NCU = """    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    SM Frequency                    Ghz         1.80
    Elapsed Cycles                cycle    1,232,124
    Memory Throughput                 %        39.47
    Issued Warp Per Scheduler                        0.50
    Memory Throughput                          Tbyte/s         1.20
    OPT   This workload exhibits low compute throughput 60.0
"""


def test_the_longest_loop_and_its_opcodes():
    "The second loop is the longer; guards, directives, braces and labels are not instructions"
    ops = km.opcode_counts(km.loop_body(PTX))
    assert ops == {'mul.bf16': 2, 'prmt.b32': 2, 'ld.shared.b8': 1, 'bra': 1}


def test_ncu_metrics():
    "Thousands separators read, units dropped, a repeated name kept apart by its unit, advice lines skipped"
    m = km.ncu_metrics(NCU)
    assert m == {'SM Frequency': 1.8, 'Elapsed Cycles': 1232124.0, 'Memory Throughput': 39.47,
                 'Issued Warp Per Scheduler': 0.5, 'Memory Throughput (Tbyte/s)': 1.2}


REPORT = """==PROF== Connected to process 7 (/usr/bin/python3.12)
==PROF== Profiling "_mhc_seam2_kernel" - 0: 0%....50%....100% - 9 passes
  _mhc_seam2_kernel (66, 2, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Duration                    nsecond        9,120
    DRAM Throughput                   %        12.50
    Section: Command line profiler metrics
    dram__bytes_read.sum                                             byte    1,048,576
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio             0.40
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio     3.20
    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio                0.90
    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio            1.00
  _mhc_finish_kernel (8, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Duration                    nsecond        4,000
"""


def test_ncu_reports_split_a_report_by_launch():
    "Each launch's figures under its kernel's name; its three largest stall reasons, largest first"
    seam, finish = km.ncu_reports(REPORT)
    assert (seam['kernel'], seam['Duration'], seam['dram__bytes_read.sum']) == ('_mhc_seam2_kernel', 9120.0, 1048576.0)
    assert finish == {'kernel': '_mhc_finish_kernel', 'Duration': 4000.0}
    assert km.stall_reasons(seam) == [('long_scoreboard', 3.2), ('selected', 1.0), ('wait', 0.9)]
    assert km.stall_reasons(finish) == [] and km.ncu_reports('no launch here') == []


def test_ncu_command_profiles_between_start_and_stop():
    cmd = km.ncu_command('/x/ncu', '_mhc_', ['python3', 'child.py'])
    assert cmd[0] == '/x/ncu' and cmd[-2:] == ['python3', 'child.py']
    flags = dict(zip(cmd[1:-2:2], cmd[2:-2:2]))
    got = flags['--profile-from-start'], flags['--kernel-name'], flags['--print-units']
    assert got == ('off', 'regex:_mhc_', 'base')
    assert 'dram__bytes_write.sum' in flags['--metrics'].split(',')


@pytest.mark.parametrize('registers, warps, programs', [
    (243, 4, 2), (217, 8, 1), (178, 4, 2), (128, 4, 4), (255, 4, 2), (32, 1, 32), (16, 32, 2)])
def test_programs_per_sm(registers, warps, programs):
    "By registers (a warp's in units of 256 of the SM's 65,536), by the SM's 64 warps, by its 32 programs"
    assert km.programs_per_sm(registers, warps) == programs


def test_compiled_seam_holds_its_registers(tmp_path):
    """The seam kernel compiled for sm_90 with no GPU (in a process of its own: the interpreter, which this suite
    runs in, does not compile): its resources read back; a cap on registers is kept"""
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, 'tools'); import kernel_mix as km\n"
            f"out = Path({str(tmp_path)!r})\n"
            "(row,) = km.compile_mhc_seam(out, shapes=((16, 32, 4, 128),))\n"
            "print(json.dumps(dict(row, use=km.res_usage(out / 'mhc_seam_16x32_4w_128r.cubin'))))")
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.splitlines()[-1])
    assert row['registers'] <= 128 and row['programs_per_sm'] == km.programs_per_sm(row['registers'], 4)
    use = row['use']
    assert use['REG'] == row['registers'] and row['spill_bytes'] == use.get('STACK', 0) + use.get('LOCAL', 0)



def test_seam_version_3_never_needs_more_registers(tmp_path):
    """Version 3 of the seam (the new copies one at a time) compiled for sm_90 beside version 2 at 32 tokens x 16
    columns, 4 warps: no more registers a thread, no fewer warps an SM, nothing spilled. How many fewer is the
    compiler's to say: Triton 3.9's gives 142 against 178 (12 warps an SM against 8), Triton 3.6's 168 each"""
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, 'tools'); import kernel_mix as km\n"
            f"out = Path({str(tmp_path)!r})\n"
            "print(json.dumps(km.compile_mhc_seam(out, shapes=((32, 16, 4, None), (32, 16, 4, None, 3)))))")
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    v2, v3 = json.loads(r.stdout.splitlines()[-1])
    assert (v2['version'], v3['version']) == (2, 3) and v3['kernel'].startswith('version 3')
    print(f"registers: version 2 {v2['registers']}, version 3 {v3['registers']}")
    assert v3['registers'] <= v2['registers'] and v3['warps_per_sm'] >= v2['warps_per_sm'] and v3['spill_bytes'] == 0

def test_record(tmp_path):
    (tmp_path / 'k.ptx').write_text(PTX); (tmp_path / 'n.txt').write_text(NCU)
    out = tmp_path / 'r.json'
    km.main(['--ptx', str(tmp_path / 'k.ptx'), '--ncu', str(tmp_path / 'n.txt'), '--json', str(out),
             '--machine', 'a GPU', '--commit', 'abc1234', '--launch', '{"tokens": 128}'])
    r = json.loads(out.read_text())
    assert (r['machine'], r['commit'], r['launch'], r['loop_instructions']) == ('a GPU', 'abc1234', {'tokens': 128}, 6)
    assert r['ncu']['Elapsed Cycles'] == 1232124.0


@pytest.mark.parametrize('ptx, argv, message', [
    ('\tadd.s32 %r1, %r1, 1;\n\tret;\n', [], 'the PTX has no loop'),
    (PTX, ['--launch', '{tokens'], '--launch: not JSON'),
    (PTX, ['--ncu', '/nonexistent/ncu.txt'], 'No such file'),
    (PTX, ['--planes'], '--prefetch and --planes go with --compile-gate-up'),
])
def test_bad_input(tmp_path, capsys, ptx, argv, message):
    (tmp_path / 'k.ptx').write_text(ptx)
    with pytest.raises(SystemExit):
        km.main(['--ptx', str(tmp_path / 'k.ptx'), '--json', str(tmp_path / 'r.json'), *argv])
    assert message in capsys.readouterr().err


SASS = """        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, 0x1 ;
.L_x_0:
        /*0020*/                   PRMT R5, R4, 0x7610, R5 ;
        /*0030*/                   HMUL2.BF16_V2 R6, R5, R7 ;
        /*0040*/               @P0 PRMT R8, R4, 0x7632, R8 ;
        /*0050*/               @P1 BRA `(.L_x_0) ;
        /*0060*/                   EXIT ;
"""


def test_sass_loop():
    "The branch's target address starts the loop; guards and modifiers dropped (HMUL2.BF16_V2 -> HMUL2)"
    body = km.sass_loop(SASS.replace('`(.L_x_0)', '0x20'))
    assert km.sass_opcodes(body) == {'PRMT': 2, 'HMUL2': 1, 'BRA': 1}
    with pytest.raises(ValueError, match='the SASS has no loop'): km.sass_loop(SASS)


def test_profile_names_every_kernel_of_the_package():
    """tools/profile_engine.py puts each Triton kernel of the package in its module's component: the MoE's version 3
    (08f) among the MoE's, none of them among PyTorch's own kernels"""
    spec = importlib.util.spec_from_file_location('profile_engine', ROOT / 'tools' / 'profile_engine.py')
    pe = importlib.util.module_from_spec(spec); spec.loader.exec_module(pe)
    names = pe.triton_kernels()
    assert names['_gate_up_planes_kernel'] == names['_down_kernel'] == names['_moe_gemv_kernel'] == 'MoE'
    assert pe.component('_gate_up_planes_kernel', names) == 'MoE'
    assert 'PyTorch ops' not in names.values()


def test_profile_counts_the_host_time_in_the_cuda_runtime():
    """kernels_of: the GPU's time per step by component from the device's events, and the host's time per step in each
    CUDA runtime or driver call from the CPU's (PyTorch's own CPU ops left out), and the PyTorch operators that launched
    kernels, by their own GPU time"""
    from types import SimpleNamespace
    spec = importlib.util.spec_from_file_location('profile_engine', ROOT / 'tools' / 'profile_engine.py')
    pe = importlib.util.module_from_spec(spec); spec.loader.exec_module(pe)
    CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ev = lambda name, dev, gpu=0.0, cpu=0.0: SimpleNamespace(name=name, device_type=dev, device_time_total=gpu,
                                                             cpu_time_total=cpu)
    prof = SimpleNamespace(events=lambda: [
        ev('_down_kernel', CUDA, gpu=40.0), ev('Memcpy HtoD', CUDA, gpu=4.0), ev('cudaGraphLaunch', CPU, cpu=300.0),
        ev('cudaMemcpyAsync', CPU, cpu=20.0), ev('cuLaunchKernel', CPU, cpu=8.0), ev('aten::copy_', CPU, cpu=50.0)],
        key_averages=lambda group_by_input_shape: [
            SimpleNamespace(key='aten::mul', input_shapes=[[8, 4], []], count=4, self_device_time_total=6.0),
            SimpleNamespace(key='aten::copy_', input_shapes=[[8], [8]], count=2, self_device_time_total=10.0),
            SimpleNamespace(key='aten::view', input_shapes=[[8]], count=2, self_device_time_total=0.0),
            SimpleNamespace(key='ProfilerStep', input_shapes=[], count=1, self_device_time_total=44.0)])
    r = pe.kernels_of(prof, 2, {'_down_kernel': 'MoE'})
    assert r['components'] == {'MoE': 20.0, 'copies': 2.0} and r['kernels'] == 1
    assert r['runtime_us'] == {'cudaGraphLaunch': 150.0, 'cudaMemcpyAsync': 10.0, 'cuLaunchKernel': 4.0}
    # the operators that launched kernels, most GPU time first, per step; none without kernels, nothing but aten's
    assert [(o['op'], o['calls'], o['us']) for o in r['ops']] == [('aten::copy_', 1.0, 5.0), ('aten::mul', 2.0, 3.0)]
    assert r['ops'][1]['shapes'] == '[[8, 4], []]'


TTGIR = """#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 1], instrShape = [16, 16, 32]}>
#blocked = #ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [32, 1], warpsPerCTA = [4, 1], order = [1, 0]}>
  %a = tt.elementwise_inline_asm "mov.b32 $0, $1;" {packed_element = 4 : i32, pure = true} %s : tensor<128x32xi32, \
#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>> -> tensor<128x32xf8E4M3FN, #ttg.dot_op<{opIdx = 0, parent = #mma, \
kWidth = 4}>> loc(#loc9)
  %b = tt.elementwise_inline_asm "mov.b32 $0, $1;" {packed_element = 4 : i32, pure = true} %t : tensor<64x32xi32, \
#blocked> -> tensor<64x32xf8E4M3FN, #blocked> loc(#loc9)
  %c = tt.elementwise_inline_asm "mov.b32 $0, $1;" {packed_element = 4 : i32, pure = true} %s : tensor<128x32xi32, \
#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 4}>> -> tensor<128x32xf8E4M3FN, #ttg.dot_op<{opIdx = 0, parent = #mma, \
kWidth = 4}>> loc(#loc9)
"""


def test_asm_layouts():
    "Each inline assembly's result layout once, its aliases written out"
    assert asm_layouts(TTGIR) == [
        '#ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [32, 1], warpsPerCTA = [4, 1], order = [1, 0]}>',
        '#ttg.dot_op<{opIdx = 0, parent = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = '
        '[4, 1], instrShape = [16, 16, 32]}>, kWidth = 4}>']
    assert asm_layouts('tt.return') == []


def _bench_engine():
    import sys
    sys.path.insert(0, str(ROOT / 'tools'))
    spec = importlib.util.spec_from_file_location('bench_engine', ROOT / 'tools' / 'bench_engine.py')
    be = importlib.util.module_from_spec(spec); spec.loader.exec_module(be)
    return be


def test_pool_counts_the_weights_still_to_be_built():
    """pool_blocks: the KV pool for the requests, with the random-weight model's bytes counted as taken; a GPU they
    leave too little of says how much the weights take and names --experts"""
    from dataclasses import replace
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.kv_cache import CacheConfig, get_kv_cache_config
    be, GiB = _bench_engine(), 2 ** 30
    cfg = ModelConfig.bench()
    kc = get_kv_cache_config(cfg, CacheConfig.for_model(cfg, max_model_len=256))
    w = be.weight_bytes(cfg)
    assert 50 * GiB < w < 70 * GiB                                  # the bench checkpoint's size, 64 experts
    assert be.weight_bytes(replace(cfg, n_routed_experts=32)) < 0.7 * w
    need = be.pool_blocks(cfg, kc, 4, 140 * GiB, 140 * GiB)          # room for every request
    assert need == be.kv_pool_blocks(kc, 4, 0.9, 140 * GiB, 140 * GiB)
    # with the weights counted, a budget that holds two requests' blocks gives two requests' blocks, not four
    per = (need - 1) // 4
    free = w + int(0.1 * 100 * GiB) + 2 * per * kc.page_bytes + kc.page_bytes // 2
    assert be.pool_blocks(cfg, kc, 4, free, 100 * GiB) == 2 * per
    with pytest.raises(ValueError, match=r'GiB of weights \(64 routed experts a layer\).*--experts'):
        be.pool_blocks(cfg, kc, 4, 60 * GiB, 80 * GiB)


def test_a_model_that_does_not_fit_names_experts(monkeypatch):
    "paged_llm: a model whose weights run out of GPU memory as they are built says so and names --experts"
    from dsv41_nb.config import ModelConfig
    be = _bench_engine()
    def oom(*a, **k): raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.81 GiB")
    monkeypatch.setattr(be.PagedModel, 'init_random', oom)
    with pytest.raises(MemoryError, match=r'routed experts a layer.*pass --experts with fewer.*2\.81 GiB'):
        be.paged_llm(ModelConfig.tiny(), 0, 'cpu', kernels='torch')


def test_model_host_split_times_the_parts_and_puts_them_back(monkeypatch):
    "model_host_split: the forward's host time by part while inside, every wrapped method as it was afterwards"
    from dsv41_nb import cuda_graphs
    spec = importlib.util.spec_from_file_location('profile_engine', ROOT / 'tools' / 'profile_engine.py')
    pe = importlib.util.module_from_spec(spec); spec.loader.exec_module(pe)
    class Inner:
        def prepare(self, b): return b
    replays = []
    entry = (lambda: replays.append(1), 'staged', 'logits', None, ((), None))
    class Model:   # a graph's entry holds its replay as bound at capture, as CUDAGraphModel's do
        def __init__(self): self.model, self.graphs, self.journaled = Inner(), {4: entry}, {}
        def forward(self, b): self.graphs[4][0](); return self.model.prepare(b)
    m, before = Model(), (cuda_graphs.StagedInputs.load, cuda_graphs.StagedInputs.load_rows,
                          cuda_graphs.fill_token_ids)
    with pe.model_host_split(m) as t:
        assert m.forward(1) == 1 and m.forward(2) == 2
    assert set(t) == {'prepare', 'replay', 'forward', 'replays'} and t['forward'] >= t['prepare'] > 0
    assert replays == [1, 1] and t['replay'] > 0 and t['replays'] == 2 and m.graphs == {4: entry}
    assert (cuda_graphs.StagedInputs.load, cuda_graphs.StagedInputs.load_rows, cuda_graphs.fill_token_ids) == before
    assert 'forward' not in vars(m) and 'prepare' not in vars(m.model)
    assert pe.split_per_step({'prepare': 10, 'staged': 30, 'forward': 100, 'replays': 2}, 2) == {
        'prepare': 5, 'staged': 15, 'fill ids': 0, 'replay': 0, 'rest': 30, 'replays': 1}
    synced = []    # synchronised before each launch: the sync comes before the launch's clock
    monkeypatch.setattr(pe, 'sync', lambda d: synced.append(len(replays)))
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    with pe.model_host_split(m, sync_before_replay=True) as t: m.forward(3)
    assert synced == [2] and replays == [1, 1, 1] and t['replays'] == 1
    assert pe.host_parts({'replay': 12.4, 'replays': 1.0}) == 'replay 12 us (1.00 launches a step)'


def test_idle_steps_time_each_phase_after_a_sync(monkeypatch):
    "idle_steps: every step of the host engine timed by phase, the device synced before each, the graphs' entries kept"
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.host_steps import host_engine, HOST_PHASES
    spec = importlib.util.spec_from_file_location('profile_engine', ROOT / 'tools' / 'profile_engine.py')
    pe = importlib.util.module_from_spec(spec); spec.loader.exec_module(pe)
    llm = host_engine(ModelConfig.tiny(), 64, async_scheduling=True)
    eng, syncs = llm.llm_engine, []
    pe.decode_ready(eng, 3, 8, 20, seed=0)
    model = eng.runner.model; graphs = dict(model.graphs)
    monkeypatch.setattr(pe, 'sync', lambda device: syncs.append(device))
    host, parts = pe.idle_steps(eng, model, 'cpu', 4)
    assert syncs == ['cpu'] * 4 and model.graphs == graphs and graphs
    assert {k for k, *_ in HOST_PHASES} <= set(host) and host['model host'] > 0
    assert parts['replay'] > 0 and parts['forward'] >= parts['replay'] + parts['prepare']
    pe.drain(eng)


def test_graph_launch_times_each_graph_it_was_asked_for(tmp_path):
    "tools/graph_launch.py --quick: the sizes asked for, each with its four times, the last size captured again, JSON"
    spec = importlib.util.spec_from_file_location('graph_launch', ROOT / 'tools' / 'graph_launch.py')
    gl = importlib.util.module_from_spec(spec); spec.loader.exec_module(gl)
    out = tmp_path / 'g.json'
    res = gl.main(['--quick', '--repeats', '1', '--sizes', '4', '8', '--json', str(out)])
    assert [r['size'] for r in res['sizes']] == [4, 8]
    assert all(set(r) == {'size', 'launch_us', 'after_us', 'run_ms', 'behind_us'} for r in res['sizes'])
    assert res['recaptured_8']['launch_us'] > 0 and json.loads(out.read_text())['experts'] == res['experts']
    with pytest.raises(SystemExit): gl.main(['--quick', '--sizes', '3'])       # not a capture size
