#!/usr/bin/env python
"""Where an engine step with DSpark drafts spends its time: the small checkpoint and its drafter, c requests decoding
greedily with a fixed number of drafts (or none), profiled by cProfile on the host.

    python tools/profile_dspark_step.py [--concurrency 8] [--policy fixed|off] [--out PATH]

The engine (CUDA graphs for its decode-only steps on a GPU) runs the whole decode three times on the same prompts:
the first compiles and captures, the second is timed, the third is timed under cProfile. Prints the two times, the
CUDA-graph wrapper's counts (steps replayed, steps run eagerly) and the scheduler's draft counts, then the profile
sorted by cumulative and by own time; --out writes the same text with a header naming machine, date and commit."""
import argparse, cProfile, contextlib, datetime, io, os, pstats, sys, time
from pathlib import Path
import torch
from dsv41_nb.dispatch import machine_name
from dsv41_nb.checkpoint_files import load_model
import dsv41_nb.drafter_graphs  # noqa: F401  (an engine serves the drafter: fused kernels, CUDA graphs)
from dsv41_nb.dspark import Drafter
from dsv41_nb.dspark_serving import load_drafter
from dsv41_nb.engine import LLM
from dsv41_nb.scheduler import SamplingParams
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit     # noqa: E402  (the checkout's commit, as every record names it)
from bench_dspark import held_out_windows, proposer     # noqa: E402  (the DSpark benchmark's prompts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--checkpoint', default='checkpoints/small')
    ap.add_argument('--concurrency', type=int, default=8)
    ap.add_argument('--policy', default='fixed', choices=['fixed', 'off'])
    ap.add_argument('--new-tokens', type=int, default=32)
    ap.add_argument('--out', help='also write the report here')
    args = ap.parse_args()
    if args.concurrency < 1: ap.error(f'--concurrency {args.concurrency}; expected at least 1')
    dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
    ckpt = Path(args.checkpoint)
    m = load_model(ckpt, device=dev).eval(); m.quant = True
    d = Drafter(m); load_drafter(d, ckpt / 'dspark.safetensors')
    c, n = args.concurrency, args.new_tokens
    prompts = held_out_windows(m.cfg, c, 64)
    llm = LLM(m, proposer=proposer(d, 'off' if args.policy == 'off' else 'fixed 5', None),
              max_model_len=64 + n + 8, max_num_seqs=c, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(f'{machine_name(dev)}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, '
              f'torch {torch.__version__}, commit {git_commit()}')
        for name in ('warm-up run', 'second run'):
            t0 = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); sync()
            print(f'c={c} {args.policy}: {name} {time.perf_counter() - t0:.2f} s')
        pr = cProfile.Profile(); pr.enable(); t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False); sync(); dt = time.perf_counter() - t0
        pr.disable()
        print('graph stats', getattr(llm.llm_engine.runner.model, 'stats', None),
              'scheduler', dict(llm.llm_engine.scheduler.stats))
        print(f'c={c} {args.policy}: profiled run {dt:.2f} s')
        for key, k in (('cumulative', 45), ('tottime', 25)):
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(k); print(s.getvalue())
    print(out.getvalue())
    if args.out: Path(args.out).write_text(out.getvalue())


if __name__ == '__main__':
    main()
