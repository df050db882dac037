#!/usr/bin/env python
"""Train the DSpark drafter of a checkpoint on its target's own greedy continuations, the target frozen.

    python tools/train_dspark.py [--checkpoint checkpoints/small] [--minutes 2] [--out PATH] [--write-checkpoint]
                                 [--json PATH] [--quick]

Prompts are windows of the training corpus (held-in documents for training, held-out ones for evaluation). The target
continues each greedily with its FP8/FP4 rounding on, as served, in fp32; one more forward gives the drafter's input
at every position. The drafter trains on every anchor past the prompt (`dsv41_nb.dspark_serving.train_drafter`), then
is evaluated on the held-out continuations: drafts accepted per block (greedy verification), each slot's acceptance
given the slots before it, the confidence head's mean prediction there, and the decode loop's tokens per step on a few
held-out prompts. Writes the drafter (`save_drafter`) to --out (default: dspark.safetensors beside the checkpoint); with
--write-checkpoint also rewrites the checkpoint itself with the trained mtp.* tensors. The record (machine, date,
settings, history, evaluation) goes to --json. --quick: a few steps on short sequences on the CPU, to check the script
(the tiny random model when the checkpoint is missing)."""
import argparse, datetime, json, sys, time
from pathlib import Path
import torch
from dsv41_nb.dispatch import machine_name
from dsv41_nb.config import ModelConfig
from dsv41_nb.model import ByteTokenizer, init_random
from dsv41_nb.checkpoint_files import load_model, save_model
from dsv41_nb.train import load_corpus, split_documents, byte_data
from dsv41_nb.dspark import Drafter, window_positions
from dsv41_nb.dspark_decode import DSparkProposer, SpecStats, speculative_generate
from dsv41_nb.dspark_serving import greedy_training_data, drafter_anchors, train_drafter, save_drafter


def windows(data, split, n, prompt_len, seed):
    "n prompts: BOS then a window of the split's stream at seeded random starts"
    stream = getattr(data, split)
    starts = torch.randint(0, len(stream) - prompt_len, (n,), generator=torch.Generator().manual_seed(seed))
    return data.windows(split, starts, prompt_len)[0]


def continuations(model, prompts, n, chunk):
    "greedy_training_data in chunks of `chunk` prompts: (sequences, drafter inputs)"
    parts = [greedy_training_data(model, p, n) for p in prompts.split(chunk)]
    return torch.cat([s for s, _ in parts]), torch.cat([h for _, h in parts])


@torch.no_grad()
def evaluate(drafter, hidden, seqs, anchors, chunk=4096):
    """Teacher-forced greedy acceptance on held-out anchors: per block, per slot given the earlier
    slots, the confidence there"""
    B, parts = drafter.block_size, []
    for a in anchors.split(chunk):
        r, p = a[:, 0], a[:, 1]
        pos, valid = window_positions(p, drafter.window)
        labels = seqs[r[:, None], p[:, None] + 2 + torch.arange(B, device=seqs.device)]
        logits, conf = drafter.teacher_forced(drafter.context(hidden[r[:, None], pos]), pos, valid,
                                              seqs[r, p + 1], labels)
        parts.append(torch.stack([(logits.argmax(-1) == labels).float(), torch.sigmoid(conf)]).cpu())
    hit, conf = torch.cat(parts, 1)                                                      # (A, B) each
    alive = torch.cat([torch.ones(len(hit), 1), hit.cumprod(1)[:, :-1]], 1)               # every earlier slot accepted
    return dict(accepted=float(hit.cumprod(1).sum(1).mean()), anchors=len(hit),
                # nan: never reached
                slot_hit=[float((hit[:, i] * alive[:, i]).sum() / alive[:, i].sum()) for i in range(B)],
                slot_conf=[float((conf[:, i] * alive[:, i]).sum() / alive[:, i].sum()) for i in range(B)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--checkpoint', default='checkpoints/small',
                    help='checkpoint directory (its target and mtp.* blocks)')
    ap.add_argument('--out', help='drafter weights file (default: <checkpoint>/dspark.safetensors)')
    ap.add_argument('--write-checkpoint', action='store_true',
                    help='also rewrite the checkpoint with the trained mtp.* tensors')
    ap.add_argument('--json', help='write the training record here')
    ap.add_argument('--minutes', type=float, default=2.0, help='training time')
    ap.add_argument('--steps', type=int, default=100_000, help='most optimizer steps')
    ap.add_argument('--prompts', type=int, default=512, help='training prompts')
    ap.add_argument('--val-prompts', type=int, default=64)
    ap.add_argument('--prompt-len', type=int, default=64)
    ap.add_argument('--new-tokens', type=int, default=64, help='greedy tokens generated per prompt')
    ap.add_argument('--batch-size', type=int, default=512, help='anchors per step')
    ap.add_argument('--lr', type=float, default=1e-3)
    ap.add_argument('--gamma', type=float, default=1e-3, help='router-bias balancing speed of the drafter experts')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--quick', action='store_true', help='a few steps on short sequences on the CPU: checks the script')
    ap.add_argument('--cpu', action='store_true',
                    help='train on the CPU (slow: the continuations alone take seconds a prompt; '
                         'give fewer --prompts)')
    args = ap.parse_args()
    device = torch.device('cuda' if torch.cuda.is_available() and not (args.quick or args.cpu) else 'cpu')
    if args.quick:
        torch.set_num_threads(1)
        (args.prompts, args.val_prompts, args.prompt_len, args.new_tokens, args.steps,
         args.batch_size) = 4, 2, 16, 12, 3, 32
    elif device.type == 'cpu' and not args.cpu:
        sys.exit('training the drafter needs a GPU (--cpu to train on the CPU, --quick to check the script)')
    t_start, ckpt = time.perf_counter(), Path(args.checkpoint)
    if (ckpt / 'config.json').exists(): model, source = load_model(ckpt, device=device), str(ckpt)
    elif args.quick:
        model, source = (init_random(ModelConfig.tiny(), seed=args.seed, device=device, max_seq_len=4096),
                         'tiny (random)')
    else: sys.exit(f'{ckpt}: no checkpoint (config.json) there')
    model = model.float().eval()
    model.quant = True                                               # the target as served: FP8/FP4 rounding on
    drafter, cfg = Drafter(model), model.cfg
    machine, date = machine_name(device), f'{datetime.datetime.now():%Y-%m-%d %H:%M}'
    print(f'{machine}  {date}  torch {torch.__version__}  target {source}')

    docs = load_corpus()
    train_docs, val_docs = split_documents(docs, seed=0)
    data = byte_data(train_docs, val_docs, ByteTokenizer(cfg))
    t0 = time.perf_counter()
    chunk = 128 if device.type == 'cuda' else 4 if args.quick else 16
    seqs, hidden = continuations(model, windows(data, 'train', args.prompts, args.prompt_len, args.seed).to(device),
                                 args.new_tokens, chunk)
    vseqs, vhidden = continuations(model,
                                   windows(data, 'val', args.val_prompts, args.prompt_len, args.seed + 1).to(device),
                                   args.new_tokens, chunk)
    gen_s = time.perf_counter() - t0
    anchors = drafter_anchors(len(seqs), seqs.shape[1], args.prompt_len, cfg.dspark_block_size).to(device)
    vanchors = drafter_anchors(len(vseqs), vseqs.shape[1], args.prompt_len, cfg.dspark_block_size).to(device)
    print(f'{len(seqs)} + {len(vseqs)} greedy continuations of {args.new_tokens} tokens in {gen_s:.1f} s; '
          f'{len(anchors):,} training anchors, {len(vanchors):,} held-out')

    before = evaluate(drafter, vhidden, vseqs, vanchors)
    g = torch.Generator(device).manual_seed(args.seed)
    if not args.quick:                                               # size the run: a few timed steps (they train too)
        t0 = time.perf_counter()
        train_drafter(drafter, hidden, seqs, anchors, 10, args.lr, args.batch_size, args.gamma, generator=g)
        if device.type == 'cuda': torch.cuda.synchronize()
        per_step = (time.perf_counter() - t0) / 10
        args.steps = max(10, min(args.steps, int(args.minutes * 60 / per_step)))
        print(f'{per_step * 1e3:.1f} ms per step: {args.steps:,} steps for {args.minutes:g} minutes')
    hist = train_drafter(drafter, hidden, seqs, anchors, args.steps, args.lr, args.batch_size, args.gamma,
                         seconds=None if args.quick else args.minutes * 90, log_every=max(1, args.steps // 20),
                         generator=g)
    after = evaluate(drafter, vhidden, vseqs, vanchors)
    st = SpecStats()
    vprompts = [s[:args.prompt_len].tolist() for s in vseqs[:8]]
    out = speculative_generate(model, vprompts, min(32, args.new_tokens), DSparkProposer(drafter), stats=st)
    same = sum(o == s[:len(o)].tolist() for o, s in zip(out, vseqs[:8]))
    print(f'held-out drafts accepted per block of {cfg.dspark_block_size}: '
          f'{before["accepted"]:.2f} before, {after["accepted"]:.2f} after')
    print('slot acceptance given the earlier slots:', [round(v, 3) for v in after['slot_hit']])
    print('mean confidence there:                  ', [round(v, 3) for v in after['slot_conf']])
    print(f'decode loop on {len(vprompts)} held-out prompts: {st}; {same}/{len(vprompts)} equal to '
          'the training continuations')

    out_path = Path(args.out) if args.out else (ckpt / 'dspark.safetensors' if ckpt.exists()
                                                else Path('dspark.safetensors'))
    save_drafter(drafter, out_path, dict(source=source, steps=len(hist), machine=machine, date=date))
    print(f'drafter weights -> {out_path}')
    if args.write_checkpoint:
        old = [f.stat().st_size for f in ckpt.glob('model-*.safetensors')]
        # shards as large as before (one shard: save_model's own limit); save_model removes the old ones
        save_model(model, ckpt, *([max(old)] if len(old) > 1 else []))
        print(f'checkpoint {ckpt} rewritten with the trained mtp.* tensors')
    every = max(1, len(hist) // 50)
    record = dict(machine=machine, date=date, torch=torch.__version__, python=sys.version.split()[0], target=source,
                  settings={k: v for k, v in vars(args).items() if k not in ('json', 'out')}, generation_seconds=gen_s,
                  anchors=len(anchors), steps=len(hist), history=hist[::every] + hist[-1:],
                  eval_before=before, eval=after,
                  loop=dict(tokens_per_request_step=st.emitted / max(1, st.request_steps), steps=st.steps,
                            accepted=st.accepted, drafted=st.drafted, equal_to_greedy=same, prompts=len(vprompts)),
                  weights=str(out_path), total_seconds=time.perf_counter() - t_start)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f'record -> {args.json}')


if __name__ == '__main__':
    main()
