#!/usr/bin/env python
"""Measure how a checkpoint writes: greedy and sampled continuations of held-out prompts (11_train_loop's text_quality).

    python tools/text_quality.py [--checkpoint checkpoints/small] [--prompts 20] [--json PATH]

The prompts are 64-byte cuts of the validation documents of today's corpus (`held_out_prompts`, seed 0), each continued
by 128 bytes, greedily and sampled at temperature 0.8, top-p 0.95, with the checkpoint's FP8/FP4 rounding on, as
served. Prints the share of distinct word 4-grams, the share of known words, and a few continuations; the record
(machine, date, checkpoint, its training date, the measures and every text) goes to --json."""
import argparse, datetime, json, sys, time
from pathlib import Path
import torch
from dsv41_nb.dispatch import machine_name
from dsv41_nb.model import ByteTokenizer
from dsv41_nb.checkpoint_files import load_model
from dsv41_nb.train import load_corpus, split_documents
from dsv41_nb.train_loop import held_out_prompts, corpus_words, text_quality


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--checkpoint', default='checkpoints/small', help='checkpoint directory')
    ap.add_argument('--prompts', type=int, default=20, help='held-out prompts')
    ap.add_argument('--new-bytes', type=int, default=128, help='bytes written after each prompt')
    ap.add_argument('--json', help='write the record here')
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    if not (ckpt / 'config.json').exists(): sys.exit(f'{ckpt}: no checkpoint (config.json) there')
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    t0 = time.perf_counter()
    model = load_model(ckpt, device=device)
    tok = ByteTokenizer(model.cfg)
    train_docs, val_docs = split_documents(load_corpus())
    prompts = held_out_prompts(val_docs, args.prompts, 64, 0)
    quality = text_quality(model, tok, prompts, corpus_words(train_docs), args.new_bytes, 0)
    trained = json.loads((ckpt / 'training.json').read_text()) if (ckpt / 'training.json').exists() else {}
    print(f'{machine_name(device)}  {datetime.datetime.now():%Y-%m-%d %H:%M}  {ckpt} '
          f'(trained {trained.get("date", "?")}), {time.perf_counter() - t0:.0f} s')
    for mode, q in quality.items():
        print(f"{mode:8s} distinct word 4-grams {q['distinct_4grams']:.3f}, known words {q['known_words']:.3f}")
        for p, t in list(zip(prompts, q['texts']))[:2]: print(f'   {p.decode()!r} -> {t!r}')
    if args.json:
        record = dict(machine=machine_name(device), date=str(datetime.date.today()), torch=torch.__version__,
                      checkpoint=str(ckpt), trained=trained.get('date'),
                      params=sum(p.numel() for p in model.parameters()),
                      prompts=[p.decode() for p in prompts], new_bytes=args.new_bytes, quality=quality)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1))
        print(f'record -> {args.json}')


if __name__ == '__main__':
    main()
