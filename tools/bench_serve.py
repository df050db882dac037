#!/usr/bin/env python
"""The server (16a_http_server) under load on one GPU: `dsv41 bench serve`'s load generator (16b_serve_cli) against the
HTTP server at each concurrency, beside the offline engine (`LLM.generate`) serving the same load in the same run; the
server's cost per token.

    python tools/bench_serve.py [--config bench] [--concurrency 1 4 16 64 128 256] [--prompt-len 128] [--max-tokens 32]
                                [--seed 0] [--json records/serve_bench.json] [--quick]

Two processes, as with `vllm serve` and `vllm bench serve`: one Python process for both would make the client and the
server take turns on one interpreter lock. The server process builds the engine of tools/bench_engine.py (the paged
model with random weights, CUDA graphs, async scheduling), measures it offline at every level with that script's
`concurrency_rows` (all of a level's prompts given to `LLM.generate` at once), then serves that same engine
(`OpenAIServer` under uvicorn, access log off). The client process waits for it, then at every level streams completions
of the same number of prompts with at most that many in flight (`run_bench`, `ignore_eos`, so every request gets
`--max-tokens` tokens). Every level is warmed up first with prompts of three tokens (new batch sizes compile kernels and
capture CUDA graphs). Prompts are random token ids of `--prompt-len`, drawn anew for every run (no prefix-cache hits
between the runs).

The server's cost per output token is its TPOT (p50) minus the offline engine's at the same level: what the event loop,
the HTTP layer, JSON and server-sent events add to every token. `--quick` runs tiny on the CPU with the PyTorch kernels
at two levels: a check of the script, not a measurement."""
import argparse, datetime, json, os, signal, subprocess, sys, tempfile, time
from pathlib import Path
import httpx, torch, triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import paged_llm, git_commit, concurrency_rows     # noqa: E402  (the engine bench_engine measures)
from dsv41_nb.config import ModelConfig                              # noqa: E402
from dsv41_nb.dispatch import machine_name                           # noqa: E402
from dsv41_nb.__main__ import random_prompts                         # noqa: E402
from dsv41_nb.server import run_sync
from dsv41_nb.http_server import OpenAIServer, UvicornServer, bind_socket
from dsv41_nb.serve_cli import run_bench

MODEL = 'dsv41-bench'


def build(args) -> tuple:
    "(LLM, device, config) of the run"
    device = 'cpu' if args.quick else 'cuda'
    if args.quick: torch.set_num_threads(1)
    cfg = ModelConfig.tiny() if args.quick else ModelConfig.bench()
    llm = paged_llm(cfg, args.seed, device, max_num_seqs=max(args.concurrency), async_scheduling=True,
                    kernels='torch' if args.quick else None, max_model_len=args.prompt_len + args.max_tokens + 64)
    return llm, device, cfg


def server_main(args):
    "The server process: build, measure offline, write `--offline-out`, then serve until SIGTERM or SIGINT"
    sock = bind_socket('127.0.0.1', 0)
    t0 = time.perf_counter()
    llm, device, cfg = build(args)
    built = time.perf_counter() - t0
    rows = concurrency_rows(llm, args.concurrency, args.prompt_len, args.max_tokens, args.seed, {}, None)
    e = llm.llm_engine
    info = dict(build_s=built, runner=type(e.runner.model).__name__, offline=rows, port=sock.getsockname()[1],
                max_num_seqs=e.scheduler.config.max_num_seqs)
    Path(args.offline_out).write_text(json.dumps(info, default=str))
    UvicornServer(OpenAIServer(llm, MODEL), 'warning', access_log=False).run([sock])


def wait_ready(proc, info_path: Path, timeout: float) -> dict:
    "The server process's offline figures, once it serves"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None: sys.exit(f"the server process ended with status {proc.returncode}")
        if info_path.exists() and info_path.stat().st_size:
            info = json.loads(info_path.read_text())
            try:
                if httpx.get(f"http://127.0.0.1:{info['port']}/health", timeout=5).status_code == 200: return info
            except httpx.HTTPError: pass
        time.sleep(1)
    sys.exit(f"the server was not ready after {timeout:.0f} s")


def client_rows(url: str, args) -> list:
    "`dsv41 bench serve` at every level, after the same warm-up as offline"
    rows = []
    for c in args.concurrency:
        warm = random_prompts(c, args.prompt_len, seed=args.seed + 3 * 10**6 + c)
        run_sync(run_bench(url, warm, 3, MODEL, max_concurrency=c, ignore_eos=True))
        prompts = random_prompts(c, args.prompt_len, seed=args.seed + 2 * 10**6 + c)
        s = run_sync(run_bench(url, prompts, args.max_tokens, MODEL, max_concurrency=c, ignore_eos=True))
        if s['failed']: sys.exit(f"{s['failed']} requests failed at concurrency {c}: {s['errors']}")
        rows.append(dict(concurrency=c, **s))
        print(f"server  {c:5d}: {s['output_throughput']:9.1f} tok/s, TPOT p50 {1e3 * s['tpot_s']['p50']:7.2f} ms",
              flush=True)
    return rows


def compare(offline: list, served: list) -> list:
    "A row per level: both throughputs and TPOTs, the server's share and its cost per token"
    out = []
    for o, s in zip(offline, served):                        # offline rows came through JSON: keys are strings
        ot, st = o['tpot_s']['50'], s['tpot_s']['p50']
        out.append(dict(concurrency=o['concurrency'], engine_tok_s=o['output_tokens_per_s'],
                        server_tok_s=s['output_throughput'],
                        server_share=s['output_throughput'] / o['output_tokens_per_s'],
                        engine_tpot_s=ot, server_tpot_s=st, overhead_per_token_s=st - ot,
                        engine_ttft_s=o['ttft_s']['50'], server_ttft_s=s['ttft_s']['p50']))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--concurrency', type=int, nargs='+', default=[1, 4, 16, 64, 128, 256])
    ap.add_argument('--prompt-len', type=int, default=128)
    ap.add_argument('--max-tokens', type=int, default=32)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--json', help='write the results to this file')
    ap.add_argument('--quick', action='store_true', help='tiny on the CPU at two levels: checks the script')
    ap.add_argument('--role', default='client', choices=('client', 'server'), help=argparse.SUPPRESS)
    ap.add_argument('--offline-out', help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick: args.concurrency, args.prompt_len, args.max_tokens = [1, 4], 16, 4
    elif not torch.cuda.is_available():
        sys.exit('this benchmark needs a GPU (use --quick to check the script on a CPU)')
    if args.role == 'server': return server_main(args)
    machine = machine_name('cpu' if args.quick else 'cuda')
    date = f'{datetime.datetime.now():%Y-%m-%d %H:%M}'
    print(f"{machine}  {date}  torch {torch.__version__}  triton {triton.__version__}  "
          f"{'tiny' if args.quick else 'bench'}; prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} out", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        info_path = Path(tmp) / 'offline.json'
        cmd = [sys.executable, __file__, '--role', 'server', '--offline-out', str(info_path), '--seed', str(args.seed),
               '--prompt-len', str(args.prompt_len), '--max-tokens', str(args.max_tokens),
               '--concurrency', *map(str, args.concurrency)] + (['--quick'] if args.quick else [])
        proc = subprocess.Popen(cmd)
        try:
            info = wait_ready(proc, info_path, timeout=1800)
            served = client_rows(f"http://127.0.0.1:{info['port']}", args)
        finally:
            proc.send_signal(signal.SIGTERM)
            try: proc.wait(timeout=120)
            except subprocess.TimeoutExpired: proc.kill()
    rows = compare(info['offline'], served)
    print(f"{'conc':>5} {'engine tok/s':>13} {'server tok/s':>13} {'share':>6} {'TPOT eng':>9} {'TPOT srv':>9} "
          f"{'cost/token':>10}   (ms)")
    for r in rows:
        print(f"{r['concurrency']:5d} {r['engine_tok_s']:13.1f} {r['server_tok_s']:13.1f} "
              f"{r['server_share']:6.2f} {1e3 * r['engine_tpot_s']:9.2f} "
              f"{1e3 * r['server_tpot_s']:9.2f} {1e3 * r['overhead_per_token_s']:10.2f}")
    res = dict(machine=machine, date=date, torch=torch.__version__, triton=triton.__version__,
               config='tiny' if args.quick else 'bench', commit=os.environ.get('DSV41_COMMIT') or git_commit(),
               args={k: v for k, v in vars(args).items() if k not in ('role', 'offline_out')},
               build_s=info['build_s'], runner=info['runner'], rows=rows, offline=info['offline'], server=served)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print('wrote', args.json)


if __name__ == '__main__':
    main()
