#!/usr/bin/env python
"""Where the fused MoE's routed down stage differs from its reference, for activations drawn from given seeds.

    python tools/moe_down_check.py [--seeds 500103725 1212549319] [--split 1] [--device cuda]

On the `bench` layer (64 experts) it draws activations as `test_moe_slots_bench_layer` does (one CUDA generator per
seed, 1, 128, 512 and 2,048 tokens in turn; the last are used), routes them, runs version 4's gate/up stage and the
down stage, and checks the down stage's routed outputs against `expert_down_torch` on the same `h` with the bound
`check_fused_moe` uses. For each seed it prints how many elements are beyond the bound; whether the down stage run
again on a copy of `h` repeats them; under each launch shape of `MOE_TUNING`, the count beyond the bound and how many
of `--reruns` launches on the same `h` differ in any bit from the first (a race in the compiled kernel: the `large`
shape at eight warps once differed in one launch of 18); where the bad or differing elements fall (row blocks,
experts, row within a block, column tiles); and, for a few of them, whether the difference is one 64-wide K chunk's
contribution left out or added twice. `--device cpu` runs a small layer in
Triton's interpreter (set TRITON_INTERPRET=1): a check that the script itself runs."""
import argparse, collections, dataclasses
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.moe import MoEWeights, route
from dsv41_nb.fused_moe import (_fused_stages, expert_down, expert_down_torch, moe_launch_shape, MOE_TUNING,
                                _abs_propagate, beyond_bf16_bound)
from dsv41_nb.moe_planes import plane_gate_up


def beyond_bound(got, want, h, W, align):
    "Elements of `got` farther from `want` than the BF16 rounding bound of the down stage's sums"
    return beyond_bf16_bound(got, want, _abs_propagate(h, W.w2, align), W.inter_dim)


def where(bad, align, W, h, got, ref):
    "Where the bad elements fall, and whether each of the first few is one K chunk off"
    rows, cols = bad.nonzero(as_tuple=True)
    sid = align.sorted_ids.long().cpu(); real = sid < align.n_assign
    pos = torch.empty(align.n_assign, dtype=torch.long); pos[sid[real]] = torch.nonzero(real).flatten()
    p, be = pos[rows], align.block_expert.long().cpu()
    for name, v in (('row blocks', p // align.block_m), ('experts', be[p // align.block_m]),
                    ('row in block', p % align.block_m), ('column tiles of 128', cols // 128)):
        print(f'  {name}: {collections.Counter(v.tolist()).most_common(8)}')
    got = got.float().cpu(); ref = ref.float().cpu()
    for r, c in list(zip(rows.tolist(), cols.tolist()))[:6]:
        e = be[pos[r] // align.block_m].item()
        terms = (h[r].float().cpu() * W.w2.dequantize(e).float().cpu()[c]).view(-1, 64).sum(1)
        d = got[r, c] - ref[r, c]
        miss, twice = (terms + d).abs().argmin().item(), (terms - d).abs().argmin().item()
        print(f'  assignment {r}, column {c}, expert {e}: {got[r, c]:.4f} vs {ref[r, c]:.4f}; '
              f'chunk {miss} left out would give {-terms[miss]:+.4f}, chunk {twice} twice {terms[twice]:+.4f}')


def repeats(launch, n: int):
    "(how many of `n` more launches differ in any bit from the first, the first of them that did or None, the first)"
    first, other, k = launch(), None, 0
    for _ in range(n):
        y = launch()
        if not torch.equal(y, first):
            k += 1
            if other is None: other = y
    return k, other, first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--seeds', type=int, nargs='+', default=[500103725, 1212549319])
    ap.add_argument('--split', type=int, default=1, help="K slices of the gate/up stage (0: its default)")
    ap.add_argument('--device', default='cuda')
    ap.add_argument('--reruns', type=int, default=None, help="launches per shape (default 300; 2 on the CPU)")
    a = ap.parse_args(argv)
    dev = a.device
    reruns = a.reruns if a.reruns is not None else 300 if dev == 'cuda' else 2
    cfg = (ModelConfig.bench() if dev == 'cuda'
           else dataclasses.replace(ModelConfig.tiny(), dim=128, moe_inter_dim=128))
    W = MoEWeights.random(cfg, 0, dev)
    for seed in a.seeds:
        g = torch.Generator(device=dev).manual_seed(seed)
        for T in ((1, 128, 512, 2048) if dev == 'cuda' else (1, 40)):
            x = (3 * torch.randn(T, cfg.dim, device=dev, generator=g)).to(torch.bfloat16)
        tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
        gate_up = plane_gate_up(W, split=a.split or None, slots=True)
        s = _fused_stages(x, tw, ti, W, cfg.swiglu_limit, gate_up=gate_up)
        h, al = s['h'], s['align']
        ref = expert_down_torch(h, W.w2, al)
        bad = beyond_bound(s['routed'], ref, h, W, al)
        shape = moe_launch_shape(al.n_assign, W.n_experts)
        print(f'seed {seed}, {T} tokens: {bad.sum().item()} of {bad.numel()} beyond the bound; '
              f'{al.num_blocks} row blocks of {al.block_m}')
        print(f'  on a copy of h: '
              f'{beyond_bound(expert_down(h.clone(), W.w2, al, shape=shape), ref, h, W, al).sum().item()} beyond')
        if bad.any(): where(bad, al, W, h, s['routed'], ref)
        for name, sh in MOE_TUNING.items():
            k, other, first = repeats(lambda: expert_down(h, W.w2, al, shape=dict(sh)), reruns)
            print(f'  launch shape {name}: {beyond_bound(first, ref, h, W, al).sum().item()} beyond; '
                  f'{k} of {reruns} launches differ from the first')
            if other is not None: where((other != first).cpu(), al, W, h, other, first)


if __name__ == '__main__': main()
