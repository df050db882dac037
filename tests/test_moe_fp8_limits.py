"""tools/moe_fp8_limits.py: what holds version 5 of the gate/up stage behind version 4
(Nsight Compute reports, capped registers)."""
import importlib.util, sys
from pathlib import Path
import pytest
import fastcore.test as fct

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
spec = importlib.util.spec_from_file_location('moe_fp8_limits', ROOT / 'tools' / 'moe_fp8_limits.py')
lim = importlib.util.module_from_spec(spec); spec.loader.exec_module(lim)


def report(name, duration, regs, stall):
    return f"""  {name} (3096, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    ---------------------------------------------------------------- ----------- ------------
    Metric Name                                                      Metric Unit Metric Value
    ---------------------------------------------------------------- ----------- ------------
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio        inst     {stall}
    Section: GPU Speed Of Light Throughput
    Duration                         us       {duration}
    Registers Per Thread             register/thread             {regs}
    OPT   Est. Speedup: 37.64%
"""


def test_last_report_reads_the_last_of_repeated_launches():
    text = ('==PROF== Profiling "_gate_up_fp8_kernel"\n[1048] python3.12@127.0.0.1\n'
            + report('_gate_up_fp8_kernel', '1,680', 184, 1.65) + report('_gate_up_fp8_kernel', 690, 168, 1.5))
    r = lim.last_report(text)
    fct.test_eq((r['kernel'], r['Duration'], r['Registers Per Thread']), ('_gate_up_fp8_kernel', 690.0, 168.0))
    fct.test_eq(r['smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio'], 1.5)
    fct.test_eq(lim.last_report(report('_down_kernel', '1,234.5', 128, 1))['Duration'], 1234.5)


def test_last_report_names_a_file_with_no_report():
    fct.test_fail(lambda: lim.last_report('==PROF== Connected to process 1\n  nothing here\n'),
                  contains='no kernel report')


def test_capped_launch_passes_the_cap_and_keeps_what_compiled():
    seen = []
    class Compiled: n_regs, n_spills = 128, 16
    class Kernel:
        def __getitem__(self, grid):
            def launch(*a, **k): seen.append((grid, a, k)); return Compiled()
            return launch
    k = lim.Capped(Kernel(), 128)
    k[(4, 1)](1, 2, BM=32)
    want = {} if lim.triton_interpreting() else {'maxnreg': 128}
    fct.test_eq(seen, [((4, 1), (1, 2), dict(BM=32, **want))])
    fct.test_eq(k.seen, dict(registers=128, spills=16))
    seen.clear(); lim.Capped(Kernel(), None)[(1,)]()
    fct.test_eq(seen, [((1,), (), {})])


def test_programs_a_multiprocessor_holds_by_registers():
    "Registers are allocated 8 a thread at a time from 65,536; at most 64 warps a multiprocessor"
    fct.test_eq([lim.programs_by_registers(r, w) for r, w in ((128, 4), (129, 4), (184, 4), (104, 8), (66, 8))],
                [4, 3, 2, 2, 3])
    fct.test_eq(lim.programs_by_registers(16, 4), 16)          # the warp slots, not the registers
