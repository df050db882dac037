"""Why the engine's greedy tokens and the naive loop's part: free-running agreement against step-by-step agreement.

    python tools/greedy_agreement.py [--device cuda] [--requests 32] [--prompt-len 128] [--max-tokens 32] [--json PATH]

Serves the trained small checkpoint's greedy continuations of random byte prompts (the load test's input) in several
ways: the naive loop (`generate_greedy`, the dense reference recomputing every sequence), and the engine with CUDA
graphs (waiting for each step, and not) or eagerly, with bounded replay on (the default) and off. For each it reports

- *free-running* agreement with the naive loop: the share of output positions holding the same token (once two greedy
  continuations part, every later position differs, so one near tie early costs the rest of the sequence);
- *step-by-step* agreement: the share of steps where the token is the dense reference's argmax given that
  continuation's own prefix (the reference run once over each whole sequence, on the CPU in fp32 accumulation), and
  the reference's margin (top logit minus the chosen token's) at the steps that differ.

On a CPU it runs with the PyTorch kernels and no graphs (a smoke run)."""
import argparse, json, time, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsv41_nb.checkpoint_files import load_model
from dsv41_nb.model_forward_block import generate_greedy
from dsv41_nb.engine import LLM
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.__main__ import random_prompts

CKPT = Path(__file__).resolve().parents[1] / 'checkpoints' / 'small'


@torch.no_grad()
def stepwise(ref, prompts, outs):
    """(agreeing steps, steps, margins at the steps that differ, gaps top1-top2 there) of
    continuations `outs` under `ref`"""
    x = torch.tensor([p + o for p, o in zip(prompts, outs)])
    P, T = len(prompts[0]), len(outs[0])
    logits = torch.cat([ref(x[i:i + 8]) for i in range(0, len(x), 8)])[:, P - 1:P - 1 + T].double()
    chosen = torch.tensor(outs)
    top2 = logits.topk(2, -1).values
    agree = logits.argmax(-1) == chosen
    margin = (logits.max(-1).values - logits.gather(-1, chosen[..., None])[..., 0])[~agree]
    return int(agree.sum()), agree.numel(), margin.tolist(), (top2[..., 0] - top2[..., 1])[~agree].tolist()


def free_running(a, b):
    "Share of positions with equal tokens; first position where each pair parts (len if never)"
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    first = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
    return same, first


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--requests', type=int, default=32)
    ap.add_argument('--prompt-len', type=int, default=128)
    ap.add_argument('--max-tokens', type=int, default=32)
    ap.add_argument('--json', default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    ref = load_model(CKPT, device='cpu')                                    # the reference, on the CPU
    model = load_model(CKPT, device=dev)
    prompts = random_prompts(a.requests, a.prompt_len, seed=0)
    t0 = time.perf_counter()
    naive = generate_greedy(model, torch.tensor(prompts, device=dev), a.max_tokens)[:, a.prompt_len:].tolist()
    runs = {'naive loop': naive}
    gpu = dev.type == 'cuda'
    ways = ([('graphs, async', dict(async_scheduling=True)), ('graphs, sync', {}), ('eager', dict(cuda_graphs=False))]
            if gpu else [('eager', dict(kernels='torch'))])
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    for replay in (True, False):
        for name, kw in ways:
            llm = LLM(model, max_num_seqs=a.requests, max_model_len=a.prompt_len + a.max_tokens + 64,
                      bounded_replay=replay, **kw)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            runs[f"engine {name}, replay {'on' if replay else 'off'}"] = [o.outputs[0].token_ids for o in outs]
            del llm
    rows = []
    for name, outs in runs.items():
        same, first = free_running(outs, naive)
        ok, n, margins, gaps = stepwise(ref, prompts, outs)
        rows.append(dict(run=name, free_running_same=same, parted_at_median=sorted(first)[len(first) // 2],
                         never_parted=sum(f == a.max_tokens for f in first), stepwise_agree=ok, steps=n,
                         margins=sorted(margins), gaps=sorted(gaps)))
    print(f"{a.requests} random prompts of {a.prompt_len} bytes, {a.max_tokens} greedy tokens, "
          f"trained small checkpoint, {torch.cuda.get_device_name() if gpu else 'CPU'}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - t0:.0f} s")
    print(f"{'run':34} {'same as naive':>13} {'parts at':>9} {'whole':>6} {'argmax steps':>14} "
          f"{'largest margin off':>19}")
    for r in rows:
        print(f"{r['run']:34} {r['free_running_same']:>13.1%} {r['parted_at_median']:>9d} {r['never_parted']:>6d} "
              f"{r['stepwise_agree']:>7d} / {r['steps']:<4d} {max(r['margins'], default=0):>19.4f}")
    if a.json:
        json.dump(dict(date=time.strftime('%Y-%m-%d %H:%M'), device=torch.cuda.get_device_name() if gpu else 'cpu',
                       args=vars(a), rows=rows), open(a.json, 'w'), indent=1)


if __name__ == '__main__': main()
