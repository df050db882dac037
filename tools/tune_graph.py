#!/usr/bin/env python
"""Launch shapes of the small-batch kernels chosen where they run: inside the batch-1 decode step's CUDA graph.

    python tools/tune_graph.py [--json images/13_graph_tuning.json] [--quick]

A kernel timed back to back keeps its instructions in the SM's instruction cache; in a decode step it runs once per
layer between a hundred other kernels and fetches them again. So this script builds the `bench` engine of
`tools/bench_engine.py` (the paged path with random weights, CUDA graphs), starts one request, and for each candidate
launch shape of sparse decode (the `DECODE_TUNING` row that one token uses, 06_sparse_decode), the mHC seam
(`MHC_TUNING`'s small-batch keys, 07a_mhc_kernel), the MoE GEMVs (`GEMV_TUNING`, 08e_moe_gemv) and the FP8 GEMV
(`FP8_GEMV_TUNING` at one token, 09a_fp8_linear) captures the batch-1 graph again and times its replay (`median_time`).
Each row also records the compiled sparse decode kernel's size, registers and spills. A sparse-decode candidate is first
checked against the reference at one token (64 heads, both main-KV formats, `check_decode`) and only timed if it passes:
a shape can compile into a wrong kernel. The defaults are timed first and last (the drift between the two is the noise).
`--quick` runs tiny on the CPU (emulated graphs): a check of the script, not a measurement."""
import argparse, datetime, json, sys
from pathlib import Path
import torch, triton
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import paged_llm
from dsv41_nb.config import ModelConfig
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.__main__ import random_prompts
from dsv41_nb.dispatch import median_time, machine_name
from dsv41_nb import sparse_decode as sd, mhc_kernel, moe_gemv, fp8_linear

CANDIDATES = {   # kind -> (the launch table it overrides, in place; the overrides tried)
    'sparse': (sd.DECODE_TUNING[8], [dict(splits=24), dict(splits=32), dict(block_n=16), dict(block_n=64),
                                      dict(num_warps=4), dict(num_warps=16), dict(block_h=32), dict(num_stages=1)]),
    'seam': (mhc_kernel.MHC_TUNING,
             [dict(small_block_d=64), dict(small_warps=2), dict(small_finish_sb=16), dict(small_finish_sb=64),
              dict(split=64), dict(split=32)]),
    'moe_gate_up': (moe_gemv.GEMV_TUNING['gate_up'],
                    [dict(block_k=1024), dict(block_k=1024, block_n=32), dict(block_k=1024, programs=64),
                     dict(block_k=1024, num_warps=8), dict(block_k=1024, block_n=32, num_warps=8),
                     dict(block_n=32), dict(block_k=512)]),
    'moe_down': (moe_gemv.GEMV_TUNING['down'],
                 [dict(block_n=16), dict(block_n=64), dict(num_warps=8), dict(programs=64)]),
    'fp8_gemv': (fp8_linear.FP8_GEMV_TUNING[1],
                 [dict(block_n=32), dict(block_k=2048), dict(num_warps=8), dict(programs=8),
                  dict(programs=2)]),
}


def sparse_wrong(cfg: ModelConfig, device) -> str | None:
    "Why sparse decode at one token, with the table as it stands, is outside the reference's bound (None: it is within)"
    for main_format in ('ds_fp4', 'fp8_ds_mla'):
        args = sd.decode_inputs(cfg, 1, 2048, cfg.index_topk, 'window_fp8', main_format, device=device, seed=5)
        try: sd.check_decode(args)
        except (AssertionError, ValueError) as e: return f'{main_format}: {e}'     # out of bound, or a shape it refuses
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--json', help='write the rows to this file')
    ap.add_argument('--kinds', nargs='+', default=list(CANDIDATES), choices=list(CANDIDATES),
                    help='which tables to try')
    ap.add_argument('--quick', action='store_true')
    args = ap.parse_args()
    device = 'cpu' if args.quick or not torch.cuda.is_available() else 'cuda'
    if device == 'cpu' and not args.quick:
        sys.exit('this measurement needs a GPU (use --quick to check the script on a CPU)')
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    check_cfg = ModelConfig.tiny() if args.quick else ModelConfig.full()      # the reference check at the full width
    llm = paged_llm(cfg, 0, device, max_num_seqs=8, max_model_len=224, **(dict(kernels='torch') if args.quick else {}))
    eng = llm.llm_engine
    gm, kernels, old = eng.runner.model, {}, []
    if args.quick:                                            # no GPU: the same wrapper, emulated
        from dsv41_nb.cuda_graphs import CUDAGraphModel
        gm = eng.runner.model = CUDAGraphModel(gm, eng.kv_cache_config, 224, emulate=True)
    launch = sd._sparse_decode_triton
    def recorded(*a, **k):                                    # the compiled kernel of the latest launch
        r = launch(*a, **k)
        if r[2] is not None: kernels['sparse'] = r[2]
        return r
    sd._sparse_decode_triton = recorded
    eng.add_request('tuned', random_prompts(1, 128, seed=1)[0],
                    SamplingParams(temperature=0, max_tokens=10 ** 4, ignore_eos=True))
    for _ in range(6): eng.step()                             # the prefill, then decode steps with the batch-1 graph

    def measure(kind, override):
        old.append(gm.graphs.pop(1, None)); gm.pool = None; kernels.clear()   # a new graph in a pool of its own
        for _ in range(3): eng.step()
        t = median_time(gm.graphs[1][0], warmup=30, rep=200) if 1 in gm.graphs else float('nan')
        k = kernels.get('sparse')
        res = dict(kind=kind, override=override, replay_ms=1e3 * t)
        if k is not None and hasattr(k, 'n_regs'):
            res.update(cubin_kb=len(k.asm['cubin']) / 1024, registers=k.n_regs, spills=k.n_spills)
        print(f"{kind:8s} {str(override):45s} {res['replay_ms']:8.3f} ms" +
              (f"  sparse decode: cubin {res['cubin_kb']:.0f} KB, {res['registers']} registers, {res['spills']} spills"
               if 'cubin_kb' in res else ''), flush=True)
        return res

    defaults = {k: dict(CANDIDATES[k][0]) for k in args.kinds}
    rows = [measure('default', {})]
    for kind in args.kinds:
        table, overrides = CANDIDATES[kind]
        for v in overrides:
            table.update(v)
            try:
                wrong = sparse_wrong(check_cfg, device) if kind == 'sparse' else None
                if wrong:
                    print(f"{kind:8s} {str(v):45s} not timed: {wrong}", flush=True)
                    rows.append(dict(kind=kind, override=v, replay_ms=float('nan'), wrong=wrong))
                else: rows.append(measure(kind, v))
            except Exception as e:
                # the engine may be left mid-step
                print(f"{kind} {v}: {type(e).__name__}: {str(e)[:200]}", flush=True); break
            finally: table.clear(); table.update(defaults[kind])
    rows.append(measure('default', {}))
    out = dict(machine=machine_name(device), date=f'{datetime.datetime.now():%Y-%m-%d %H:%M}', torch=torch.__version__,
               triton=triton.__version__, config='tiny' if args.quick else 'bench', defaults=defaults, rows=rows)
    if args.json: Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == '__main__': main()
