#!/usr/bin/env python
"""Train the small DeepSeek-V4.1 model of 11_train and ship its checkpoint, with the dense baseline beside it.

The corpus is the Python documentation (11_train); the checkpoint goes out in the public layout, with the loss curves.

    python tools/train_small.py --out checkpoints/small [--steps N | --minutes M] [--baseline] [--expert-dropout P]
                                [--corpus FILE | --corpus-tests] [--write-corpus FILE] [--json PATH] [--quick]
                                [--until-step K | --stop-after MINUTES] [--resume DIR] [--seed S] [--split-seed S]

Both models see the same batches. Without --steps, a few timed steps of each model size the run so that the training
takes about --minutes (default 4) in all; the measured tokens/s are printed first. Writes `config.json` and the
safetensors shards (`save_model`) to --out, and `training.json` beside them (also to --json if given): machine, date,
settings, the corpus, each model's history (train/validation loss per evaluation), final validation loss and perplexity,
and a few greedy continuations. --quick: a handful of steps on short windows, on the CPU, to check the script.

The corpus is this Python's (`load_corpus`); --corpus-tests adds the standard library's test packages, which some
Pythons do not ship; --corpus FILE reads one `write_corpus` stored on another machine (.json, .json.gz, .json.xz);
--write-corpus FILE stores the corpus this run would use there and exits (no GPU needed).

--seed sets the initial weights and the batch order; --split-seed which documents are held out (and the prompts
whose continuations are measured). Runs that differ in --seed alone give the run-to-run spread on one validation set.

A run may be cut into pieces, each its own process (a GPU job may end before the run does): --until-step K or
--stop-after MINUTES ends a piece early; it writes the checkpoint of a finished MoE model, each unfinished model's
`TrainState` (train_state_moe.pt, train_state_dense.pt, deleted once that model is done) and the record so far.
--resume DIR goes on from there, writing to DIR, and refuses other settings (`SettingsMismatch`). The pieces give
the weights and history one uninterrupted run would (exactly on the CPU). The record lists the pieces."""
import argparse, datetime, hashlib, json, math, sys, time
from pathlib import Path
import torch
from dsv41_nb.dispatch import machine_name
from dsv41_nb.train import (load_corpus, read_corpus, write_corpus, split_documents, byte_data, small_config,
                            trained_param_count, DenseBaseline)
from dsv41_nb.train_loop import (train, evaluate, lm_loss, make_optimizer, IndexerDistillation, fast_path,
                                 held_out_prompts, corpus_words, text_quality, TrainState)
from dsv41_nb.model import ByteTokenizer, init_random
from dsv41_nb.checkpoint_files import save_model
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import git_commit     # noqa: E402  (the checkout's commit, as every record names it)

PROMPTS = ('def ', 'The ', 'Return ')
CHECKED = ('steps', 'batch_size', 'seq_len', 'lr', 'gamma', 'expert_dropout', 'eval_every', 'eval_batches', 'seed',
           'split_seed', 'baseline', 'corpus_sha256')     # a resumed run must have these as the run it goes on from

class SettingsMismatch(ValueError):
    "A resumed run whose settings are not those of the run it would go on from"

def corpus_sha256(data) -> str:
    "SHA-256 of the training and validation token streams: the corpus as the model sees it"
    h = hashlib.sha256()
    for t in (data.train, data.val): h.update(t.numpy().tobytes())
    return h.hexdigest()

def check_resume(record: dict, settings: dict, directory):
    "Refuse (`SettingsMismatch`) to go on from the run of `record` with other `settings`"
    for k in CHECKED:
        old = record.get(k, record.get('seed')) if k == 'split_seed' else record.get(k)   # split by seed before
        if old != settings.get(k):
            raise SettingsMismatch(f"--resume {directory}: {k} = {settings.get(k)!r} here, "
                                   f"but the run there has {k} = {old!r}")

def seconds_per_step(make, data, batch_size, seq_len, device, steps=4):
    "Median seconds of one training step (forward, backward, AdamW) of a fresh model, after one warm-up step"
    model = make().to(device).float().train()
    if hasattr(model, 'quant'): model.quant = False
    opt, distill, times = make_optimizer(model, 1e-4, 0.0), IndexerDistillation(model), []
    with fast_path(model, compile=device.type == 'cuda'):      # the warm-up step compiles
        for i in range(steps + 1):
            x, y = (t.to(device) for t in data.batch(batch_size, seq_len))
            if device.type == 'cuda': torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast('cuda', torch.bfloat16, enabled=device.type == 'cuda'): loss = lm_loss(model, x, y)
            kl = distill.take()
            (loss if kl is None else loss + kl).backward(); opt.step(); opt.zero_grad(set_to_none=True)
            if device.type == 'cuda': torch.cuda.synchronize()
            if i: times.append(time.perf_counter() - t0)
    distill.remove(); del model, opt
    if device.type == 'cuda': torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]

@torch.no_grad()
def samples(model, tok, device, n):
    "Greedy continuations of the prompts by the model as it will be served (its quant switch on, if it has one)"
    model.eval()
    if hasattr(model, 'quant'): model.quant = True
    out = {}
    for p in PROMPTS:
        x = torch.tensor([tok.encode(p)], device=device)
        for _ in range(n): x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], 1)   # as `generate_greedy`
        out[p] = tok.decode(x[0].tolist())
    return out

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', help='checkpoint directory (default: checkpoints/small, or the --resume directory)')
    ap.add_argument('--steps', type=int, help='optimizer steps (default: sized by --minutes)')
    ap.add_argument('--minutes', type=float, default=6.0, help='training time for both models together')
    ap.add_argument('--baseline', action='store_true', help='also train the dense baseline on the same batches')
    ap.add_argument('--json', help='also write the training record here')
    ap.add_argument('--batch-size', type=int, default=256)
    ap.add_argument('--seq-len', type=int, default=256)
    ap.add_argument('--lr', type=float, default=2e-3)
    ap.add_argument('--gamma', type=float, default=1e-2, help='router bias update speed')
    ap.add_argument('--expert-dropout', type=float, default=0.0,
                    help="p of `ExpertDropout`: each (token, expert) routing weight dropped in training")
    ap.add_argument('--eval-every', type=int, default=25)
    ap.add_argument('--eval-batches', type=int, default=4, help='validation batches per evaluation')
    ap.add_argument('--seed', type=int, default=0, help='initial weights and batch order')
    ap.add_argument('--split-seed', type=int, default=0,
                    help='which documents are held out, and the held-out prompts (another --seed, same split: '
                         'the run-to-run spread on one validation set)')
    ap.add_argument('--shard-mb', type=float, default=12,
                    help='largest checkpoint shard, MiB: the ~20 MB checkpoint as a few shards of a few MiB, '
                         'sharded as the public checkpoint is (and each file small enough to move alone)')
    ap.add_argument('--prompts', type=int, default=20, help='held-out prompts whose continuations are measured')
    ap.add_argument('--corpus', help='a corpus file written by write_corpus (default: this Python\'s corpus)')
    ap.add_argument('--corpus-tests', action='store_true', help="this Python's corpus with its test packages")
    ap.add_argument('--write-corpus', help='store the corpus this run would use in this file, then exit')
    ap.add_argument('--quick', action='store_true', help='6 steps of 2 x 64 tokens on the CPU: checks the script')
    piece = ap.add_mutually_exclusive_group()
    piece.add_argument('--until-step', type=int, metavar='K',
                       help="end this piece at step K of the run: the MoE's steps, then (--baseline) the "
                            "baseline's, its step k being steps + k")
    piece.add_argument('--stop-after', type=float, metavar='MINUTES',
                       help='end this piece before a stretch of --eval-every steps that might end after MINUTES '
                            '(keep a minute or two for the evaluations and files written after training)')
    ap.add_argument('--resume', metavar='DIR', help='go on from the piece of a run that DIR holds, writing there')
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.resume:
        if args.out and Path(args.out) != Path(args.resume):
            sys.exit('--resume DIR goes on writing to DIR: leave --out out or give the same directory')
        args.out = args.resume
        if not (Path(args.resume) / 'training.json').is_file():
            sys.exit(f'--resume {args.resume}: no training.json there')
        old = json.loads((Path(args.resume) / 'training.json').read_text())
        if old.get('finished', True): sys.exit(f'--resume {args.resume}: that run is finished')
        if args.steps is None: args.steps = old['steps']
    args.out = args.out or 'checkpoints/small'
    docs = read_corpus(args.corpus) if args.corpus else load_corpus(tests=args.corpus_tests)
    if args.write_corpus:
        path = write_corpus(docs, args.write_corpus)
        sys.exit(print(f'{len(docs):,} documents, {sum(len(d.encode()) for d in docs) / 1e6:.1f} MB -> {path} '
                       f'({path.stat().st_size / 1e6:.1f} MB)'))
    device = torch.device('cuda' if torch.cuda.is_available() and not args.quick else 'cpu')
    if args.quick: args.steps, args.batch_size, args.seq_len, args.eval_every, args.prompts = 6, 2, 64, 3, 2
    elif device.type == 'cpu':
        sys.exit('training the small model needs a GPU (use --quick to check the script on a CPU)')
    cfg = small_config()
    train_docs, val_docs = split_documents(docs, seed=args.split_seed)
    tok = ByteTokenizer(cfg)
    data = byte_data(train_docs, val_docs, tok)
    machine = machine_name(device)
    print(f'{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  '
          f'python {sys.version.split()[0]}')
    print(f'corpus: {len(docs):,} documents, {len(data.train):,} training and {len(data.val):,} validation tokens')
    sha = corpus_sha256(data)
    make_moe = lambda: init_random(cfg, args.seed)
    make_dense = lambda: DenseBaseline.matching(cfg, seed=args.seed)
    makers = {'moe': make_moe} | ({'dense': make_dense} if args.baseline else {})
    if args.steps is None:
        per_step = {k: seconds_per_step(f, data, args.batch_size, args.seq_len, device) for k, f in makers.items()}
        for k, s in per_step.items():
            print(f'{k}: {s * 1e3:.0f} ms/step, {args.batch_size * args.seq_len / s:,.0f} tokens/s')
        args.steps = max(args.eval_every,
                         int(args.minutes * 60 / sum(per_step.values())) // args.eval_every * args.eval_every)
    tokens = args.steps * args.batch_size * args.seq_len
    print(f'{args.steps} steps of {args.batch_size} x {args.seq_len} tokens = {tokens / 1e6:.1f}M tokens '
          f'({tokens / len(data.train):.1f} passes over the training text)')
    record = dict(machine=machine, date=str(datetime.date.today()), torch=torch.__version__,
                  python=sys.version.split()[0], config='small_config()', steps=args.steps, batch_size=args.batch_size,
                  seq_len=args.seq_len, lr=args.lr, gamma=args.gamma,
                  expert_dropout=args.expert_dropout, seed=args.seed, split_seed=args.split_seed,
                  eval_every=args.eval_every,
                  eval_batches=args.eval_batches, baseline=args.baseline, corpus_sha256=sha,
                  fast_path=device.type == 'cuda',
                  corpus=dict(documents=len(docs), megabytes=sum(len(d.encode()) for d in docs) / 1e6,
                              file=args.corpus, tests=args.corpus_tests,
                  train_tokens=len(data.train), val_tokens=len(data.val)), models={}, pieces=[], finished=False)
    if args.resume:
        check_resume(old, record, args.resume)
        record = old
    total = len(makers) * args.steps
    # steps each model has done: in the pieces before (a state file holds each unfinished one's), else none
    done = {k: args.steps if record['models'].get(k, {}).get('finished') else record['models'].get(k, {}).get('step', 0)
            for k in makers}
    for k in makers:
        if not args.resume: state_path(args, k).unlink(missing_ok=True)      # left by an earlier run
        elif 0 < done[k] < args.steps and not state_path(args, k).is_file():
            sys.exit(f'--resume {args.resume}: {k} stopped at step {done[k]}, but {state_path(args, k)} is missing')
    start = sum(done.values())
    if args.until_step is not None and not start < args.until_step <= total:
        sys.exit(f'--until-step {args.until_step}: this piece starts at step {start}; the run has {total}')
    until = total if args.until_step is None else args.until_step
    piece = dict(start=start, stop=start, machine=machine, date=str(datetime.date.today()), commit=git_commit(),
                 seconds=0.0)
    record['pieces'].append(piece)
    final_batches = data.eval_batches(32 if not args.quick else 2, min(args.batch_size, 32), args.seq_len)
    prompts, vocabulary = held_out_prompts(val_docs, args.prompts, 64, args.split_seed), corpus_words(train_docs)
    record['quality_settings'] = dict(prompts=args.prompts, prompt_bytes=64, new_bytes=128 if not args.quick else 8,
                                      prompt_texts=[q.decode('utf-8', 'replace') for q in prompts],
                                      sampled=dict(temperature=0.8, top_p=0.95))
    for i, (name, make) in enumerate(makers.items()):
        if done[name] == args.steps: continue                    # finished in an earlier piece
        stop = min(args.steps, until - i * args.steps)
        if stop <= done[name]: break
        model = make()
        print(f'--- {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, '
              f'steps {done[name]}..{stop} of {args.steps}')
        state = TrainState.load(state_path(args, name)) if done[name] else TrainState()
        run = lambda stop: train(model, data, args.steps, lr=args.lr, batch_size=args.batch_size,
                                 seq_len=args.seq_len, eval_every=args.eval_every, eval_batches=args.eval_batches,
                                 gamma=args.gamma, seed=args.seed, device=device,
                                 expert_dropout=args.expert_dropout, log=print, stop=stop, state=state)
        hist = train_piece(run, state, stop, args, t_start)
        piece['stop'] = i * args.steps + state.step
        if state.step < args.steps:                             # the piece ends inside this model's run
            state.save(state_path(args, name))
            record['models'][name] = dict(params=sum(p.numel() for p in model.parameters()), history=hist,
                                          finished=False, step=state.step)
            print(f'{name}: stopped at step {state.step} of {args.steps}; state in {state_path(args, name)}')
            break
        state_path(args, name).unlink(missing_ok=True)
        model.to(device)
        if hasattr(model, 'quant'): model.quant = False
        val_loss = evaluate(model, final_batches, device)
        if hasattr(model, 'quant'): model.quant = True     # as served: FP8/FP4 weights and activations
        val_served = evaluate(model, final_batches, device) if hasattr(model, 'quant') else val_loss
        quality = text_quality(model, tok, prompts, vocabulary, 128 if not args.quick else 8, args.seed)
        record['models'][name] = dict(params=sum(p.numel() for p in model.parameters()), history=hist,
                                      val_loss=val_loss, val_ppl=math.exp(val_loss), val_loss_served=val_served,
                                      seconds=hist['seconds'][-1], samples=samples(model, tok, device, 48),
                                      quality=quality, finished=True)
        print(f'{name}: validation loss {val_loss:.3f} nats/byte (perplexity {math.exp(val_loss):.2f}), '
              f'{val_served:.3f} as served; {hist["seconds"][-1]:.0f} s')
        for p, s in record['models'][name]['samples'].items(): print(f'  {p!r} -> {s!r}')
        for mode, q in quality.items():
            print(f"  {mode}: distinct word 4-grams {q['distinct_4grams']:.3f}, known words {q['known_words']:.3f}; "
                  f"e.g. {q['texts'][0]!r}")
        if name == 'moe':
            save_model(model.cpu(), args.out, int(args.shard_mb * 2**20))
            size = sum(f.stat().st_size for f in Path(args.out).iterdir())
            print(f'checkpoint: {args.out} ({size / 2**20:.1f} MiB)')
        write_record(record, piece, t_start, args)      # after each model: a run cut short keeps what it finished
    record['finished'] = all(record['models'].get(k, {}).get('finished', False) for k in makers)
    write_record(record, piece, t_start, args)
    print(f'wrote {Path(args.out) / "training.json"}; steps {piece["start"]}..{piece["stop"]} of {total} '
          f'in this piece, {piece["seconds"]:.0f} s; {record["total_seconds"]:.0f} s in all'
          + ('' if record['finished'] else f'; go on with --resume {args.out}'))

def state_path(args, name) -> Path: return Path(args.out) / f'train_state_{name}.pt'

def train_piece(run, state, stop, args, t_start):
    """Train up to step `stop` by `run(stop)`; with --stop-after, in stretches of --eval-every steps, ending early
    when the next stretch, taken as 1.5 times the longest so far, might end after the time given"""
    if args.stop_after is None: return run(stop)
    hist = state.history
    while state.step < stop:
        longest = getattr(args, 'longest_stretch', 0.0)      # of this piece, over its models
        if longest and time.perf_counter() - t_start + 1.5 * longest > args.stop_after * 60: break
        t0 = time.perf_counter()
        hist = run(min(stop, (state.step // args.eval_every + 1) * args.eval_every))
        args.longest_stretch = max(longest, time.perf_counter() - t0)
    return hist

def write_record(record, piece, t_start, args):
    "Write the training record to --out/training.json (and --json): this piece's seconds, `total_seconds` so far"
    piece['seconds'] = time.perf_counter() - t_start
    record['total_seconds'] = sum(p['seconds'] for p in record['pieces'])
    for path in [Path(args.out) / 'training.json'] + ([Path(args.json)] if args.json else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))

if __name__ == '__main__':
    main()
