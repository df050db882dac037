#!/usr/bin/env python
"""Where Engram's table should live: lookup latency and throughput per placement, and the cost on a decode step.

    python tools/bench_engram.py [--table-gib 4] [--batches 1 64 1024] [--json out.json] [--quick]

Placements (each Engram module has its own table of --table-gib GiB, FP8 rows of 264 B):
  hbm           the table in GPU memory, gathered where the module runs
  uva           the table in pinned host memory, gathered by the same kernel over UVA where the module runs
  uva_prefetch  the same host table, gathered on a side stream as soon as the step's token ids are known, so the
                reads overlap the layers before the first Engram layer; the main stream waits only when it needs them
The step is a stand-in for a decode step at the `bench` geometry (40 layers): per layer the attention projections,
a score pass over the 640 entries a token attends to, the shared expert and the routed experts the batch touches.
Its GEMMs use bf16 weights with half the reduction width of the FP8 weights they stand for: the same bytes, and at
half the FLOP rate the same time. Lookups are timed as single launches and inside a CUDA graph (device time only);
steps inside a CUDA graph, falling back to single launches where capture fails.
--quick runs tiny sizes on whatever device there is (a CPU with TRITON_INTERPRET=1 included) to check the script."""
import argparse, contextlib, dataclasses, datetime, json, math, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, triton
from dsv41_nb.config import ModelConfig
from dsv41_nb.dispatch import median_time, copy_bandwidth, machine_name
from dsv41_nb.launches import cuda_graph
from dsv41_nb.floors import expert_touch_fraction
from dsv41_nb.engram import NgramHasher, compressed_token_map, synthetic_token_strings
from dsv41_nb.engram_table import (EngramTable, engram_lookup, engram_lookup_torch, engram_gate, engram_update,
                                   engram_row_codec)

PLACEMENTS = ('hbm', 'uva', 'uva_prefetch')
CUDA = torch.cuda.is_available()
DEV = torch.device('cuda' if CUDA else 'cpu')
NAN = float('nan')

def study_config(table_gib: float, quick: bool) -> ModelConfig:
    "`bench` (or `tiny` when quick) with Engram tables of about `table_gib` GiB each"
    base = ModelConfig.tiny() if quick else ModelConfig.bench()
    rec, cols = engram_row_codec(base).record_bytes, (base.engram_max_ngram_size - 1) * base.engram_n_heads
    # just under the size asked: pinned host blocks are rounded up to a power of two, so 4.001 GiB would pin 8
    start = max(base.engram_compressed_vocab_size, int(0.999 * table_gib * 2**30 / rec / cols))
    return dataclasses.replace(base, engram_vocab_size=start, engram_num_embeddings=())

def random_table(rows: int, cfg: ModelConfig, seed: int = 0, chunk: int = 1 << 20) -> EngramTable:
    "A table in host memory (pinned on a GPU machine) of random finite FP8 rows, scales 2^-10..2^0, made on the device"
    rec, hd = engram_row_codec(cfg).record_bytes, cfg.engram_head_dim
    out = torch.empty(rows, rec, dtype=torch.uint8, pin_memory=CUDA)
    g = torch.Generator(device=DEV).manual_seed(seed)
    for r0 in range(0, rows, chunk):
        n = min(chunk, rows - r0)
        codes = torch.randint(0, 0x7F, (n, hd), generator=g, device=DEV, dtype=torch.int32)   # no NaN code
        codes |= torch.randint(0, 2, (n, hd), generator=g, device=DEV, dtype=torch.int32) << 7  # sign
        scales = torch.randint(117, 128, (n, hd // 32), generator=g, device=DEV, dtype=torch.int32)
        out[r0:r0 + n].copy_(torch.cat([codes, scales], -1).to(torch.uint8))
    return EngramTable(out, hd)

def graph_time(fn, reps: int = 20, rep_ms: int = 100):
    "Seconds per call of `fn` replayed `reps` times back to back in one CUDA graph (None where capture fails)"
    if not CUDA: return None
    try:
        # warmed up (compiled) off the capture
        return median_time(cuda_graph(fn, warmup=1, calls=reps), rep=rep_ms) / reps
    except Exception as e:                                  # report the run without this number rather than stop
        print(f'  (CUDA graph capture failed: {type(e).__name__}: {e})')
        return None

def h2d_bandwidth(nbytes: int = 1 << 28):
    "Pinned host -> GPU copy bandwidth, bytes/s (None without a GPU)"
    if not CUDA: return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    return nbytes / median_time(lambda: dst.copy_(src, non_blocking=True))

class StandInStep:
    "The weight and cache traffic and the FLOPs of a decode step at `cfg`'s geometry, with or without Engram"
    def __init__(self, cfg: ModelConfig, max_batch: int, layer_sets: int = 4):
        self.cfg, D, I, E = cfg, cfg.dim, cfg.moe_inter_dim, cfg.n_routed_experts
        H, hd, G, R, Q = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
        w = lambda *s: torch.randn(*s, device=DEV, dtype=torch.bfloat16) * s[-1] ** -0.5
        self.sets = [dict(wq_a=w(Q, D // 2), wq_b=w(H * hd, Q // 2), wkv=w(hd, D // 2), wo_a=w(G * R, H * hd // G // 2),
                          wo_b=w(D, G * R // 2), sh13=w(2 * I, D // 2), sh2=w(D, I // 2),
                          e13=w(E, D // 2, 2 * I), e2=w(E, I // 2, D))
                     for _ in range(layer_sets)]                      # distinct weights, each set far larger than L2
        self.kv = w(max_batch, hd, cfg.window_size + cfg.index_topk)   # the entries one token attends to
        self.xe = w(E, math.ceil(max_batch * cfg.n_activated_experts / E) + 1, D // 2)
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.wkv = [w(D * (cfg.hc_mult + 1), cols * cfg.engram_head_dim // 2) for _ in cfg.engram_layer_ids]
        self.qk = torch.ones(cfg.hc_mult, D, device=DEV)
        self.x, self.h = w(max_batch, D), w(max_batch, cfg.hc_mult, D)
        self.side = torch.cuda.Stream() if CUDA else None

    def layer(self, l: int, x: torch.Tensor) -> torch.Tensor:
        c, s, B = self.cfg, self.sets[l % len(self.sets)], x.shape[0]
        D, E, k, I = c.dim, c.n_routed_experts, c.n_activated_experts, c.moe_inter_dim
        q = (x[:, :D // 2] @ s['wq_a'].T)[:, :c.q_lora_rank // 2] @ s['wq_b'].T       # (B, heads * head_dim)
        x[:, :D // 2] @ s['wkv'].T                                                    # the window latent
        torch.bmm(q.view(B, c.n_heads, c.head_dim), self.kv[:B])                       # scores over 640 entries
        o = (q[:, :s['wo_a'].shape[1]] @ s['wo_a'].T)[:, :s['wo_b'].shape[1]] @ s['wo_b'].T   # (B, dim)
        touched = min(E, max(k, round(E * float(expert_touch_fraction(B, k, E)))))    # experts the batch visits
        per = math.ceil(B * k / touched)                                               # tokens per touched expert
        he = torch.bmm(self.xe[:touched, :per], s['e13'][:touched])                    # (touched, per, 2I)
        torch.bmm(he[..., :I // 2], s['e2'][:touched])
        return (o[:, :D // 2] @ s['sh13'].T)[:, :I // 2] @ s['sh2'].T                 # shared expert -> (B, dim)

    def engram(self, i: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        c, D = self.cfg, self.cfg.dim
        kv = rows.flatten(-2)[:, :self.wkv[i].shape[1]] @ self.wkv[i].T                # FP8-sized wkv: (B, D * 5)
        key, value = kv.split([c.hc_mult * D, D], -1)
        gate = engram_gate(h, key.float().unflatten(-1, (c.hc_mult, D)), self.qk, self.qk, c.norm_eps)
        return engram_update(h, gate, value)

    def prefetch(self, B, tables, hasher, tokens, history):
        "Hash and gather every module's rows on the side stream; returns the rows and the event that marks them ready"
        main = torch.cuda.current_stream() if CUDA else None
        if CUDA: self.side.wait_stream(main)
        with torch.cuda.stream(self.side) if CUDA else contextlib.nullcontext():
            ids = hasher(tokens[:B], history=history[:B], check=False)[:, 0]          # (B, layers, cols)
            staged = [engram_lookup(t, ids[:, i], check=False) for i, t in enumerate(tables)]
            ready = torch.cuda.Event() if CUDA else None
            if CUDA: ready.record(self.side)
        if CUDA and not torch.cuda.is_current_stream_capturing():
            for s in staged: s.record_stream(main)                 # used on the main stream: keep until it is done
        return staged, ready

    def __call__(self, B: int, placement=None, tables=None, hasher=None, tokens=None, history=None):
        c, x, h = self.cfg, self.x[:B], self.h[:B]
        staged = ready = ids = None
        if placement == 'uva_prefetch': staged, ready = self.prefetch(B, tables, hasher, tokens, history)
        elif placement is not None: ids = hasher(tokens[:B], history=history[:B], check=False)[:, 0]
        for l in range(c.n_layers):
            if placement is not None and l in c.engram_layer_ids:
                i = c.engram_layer_ids.index(l)
                if staged is None: rows = engram_lookup(tables[i], ids[:, i], check=False)
                else:
                    if CUDA and i == 0: torch.cuda.current_stream().wait_event(ready)
                    rows = staged[i]
                h = self.engram(i, h, rows)
            x = self.layer(l, x)
        return x, h

def time_lookups(tables, ids, batches, cfg, graphs: bool) -> list:
    "One module's lookup per placement and batch: single-launch and graph times, rates, the floor of the limiting link"
    rec, cols, hd = engram_row_codec(cfg).record_bytes, ids.shape[-1], cfg.engram_head_dim
    bw = dict(hbm=copy_bandwidth() if CUDA else None, uva=h2d_bandwidth())   # HBM: bytes read + written per second
    rows = []
    for placement in ('hbm', 'uva'):
        for B in batches:
            t_ids = ids[:B].contiguous()
            fn = lambda: engram_lookup(tables[placement], t_ids, check=False)
            t, t_graph = median_time(fn), graph_time(fn) if graphs else None
            read = B * cols * rec                                  # records read; the bf16 rows written stay in HBM
            link = read + B * cols * hd * 2 if placement == 'hbm' else read       # bytes over the limiting link
            best = t_graph or t
            rows.append(dict(placement=placement, batch=B, us=t * 1e6, graph_us=t_graph and t_graph * 1e6,
                             rows_per_s=B * cols / best, GBps=read / best / 1e9,
                             floor_us=bw[placement] and link / bw[placement] * 1e6))
    for B in batches:                                                         # the PyTorch reference, GPU table
        t_ids = ids[:B].contiguous()
        t = median_time(lambda: engram_lookup_torch(tables['hbm'], t_ids))
        rows.append(dict(placement='hbm (torch reference)', batch=B, us=t * 1e6, graph_us=None, rows_per_s=None,
                         GBps=None, floor_us=None))
    hbm = {r['batch']: r for r in rows if r['placement'] == 'hbm'}
    # like for like: graph to graph, else launch to launch
    for r in rows:
        h = hbm[r['batch']]
        r['vs_hbm'] = r['graph_us'] / h['graph_us'] if r['graph_us'] and h['graph_us'] else r['us'] / h['us']
    return rows

def time_steps(cfg, batches, tables, hasher, tokens, history, graphs: bool) -> list:
    "The stand-in step without Engram and with each placement, per batch, in milliseconds"
    step, out = StandInStep(cfg, max(batches)), []
    for B in batches:
        row = dict(batch=B)
        for placement in (None,) + PLACEMENTS:
            fn = lambda: step(B, placement, tables.get(placement), hasher, tokens, history)
            t = graph_time(fn, reps=1, rep_ms=500) if graphs else None
            row['mode'] = 'graph' if t is not None else 'launches'
            row[placement or 'none'] = (t if t is not None else median_time(fn, warmup=50, rep=300)) * 1e3
        out.append(row)
    return out

def report(head, lookups, hash_us, steps, geometry):
    print(head)
    print('\nlookup of one module (row ids -> bf16 rows), microseconds; rates from the graph time where there is one')
    print(f"{'placement':22s} {'batch':>6s} {'launch us':>10s} {'graph us':>9s} {'Mrows/s':>8s} {'GB/s read':>9s} "
          f"{'floor us':>9s} {'vs hbm':>7s}")
    for r in lookups:
        print(f"{r['placement']:22s} {r['batch']:6d} {r['us']:10.1f} {r['graph_us'] or NAN:9.1f} "
              f"{(r['rows_per_s'] or NAN) / 1e6:8.1f} {r['GBps'] or NAN:9.2f} "
              f"{r['floor_us'] or NAN:9.1f} {r['vs_hbm']:6.1f}x")
    print('hashing (both modules): ' + ', '.join(f'batch {B}: {t:.1f} us' for B, t in hash_us.items()))
    print(f"\nstand-in decode step at the {geometry} geometry, milliseconds (overhead against no Engram)")
    print(f"{'batch':>6s} {'no engram':>10s} " + ' '.join(f'{p:>20s}' for p in PLACEMENTS) + '  timing')
    for r in steps:
        cells = ' '.join(f"{r[p]:9.3f} ({(r[p] / r['none'] - 1) * 100:+6.1f}%)" for p in PLACEMENTS)
        print(f"{r['batch']:6d} {r['none']:10.3f} {cells}  {r['mode']}")

def run(table_gib: float = 4.0, batches=(1, 64, 1024), quick: bool = False, graphs: bool = True) -> dict:
    "Build the tables and the stand-in step, time everything, print the tables; returns the results"
    if quick: table_gib, batches = 2**-10, tuple(b for b in batches if b <= 4) or (1, 4)
    graphs = graphs and CUDA
    cfg = study_config(table_gib, quick)
    rec, cols = engram_row_codec(cfg).record_bytes, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    machine = machine_name('cuda' if CUDA else 'cpu')
    gib = cfg.engram_num_embeddings[0] * rec / 2**30
    head = (f"{machine}  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  "
            f"triton {triton.__version__}\n{len(cfg.engram_layer_ids)} Engram tables of "
            f"{cfg.engram_num_embeddings[0]:,} rows x {rec} B = {gib:.2f} GiB each; "
            f"{cols} rows per token per module")
    texts = synthetic_token_strings(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    hasher = NgramHasher(cfg, *compressed_token_map(texts)).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (max(batches), 1), generator=g, device=DEV)
    history = torch.randint(0, cfg.vocab_size, (max(batches), cfg.engram_max_ngram_size - 1), generator=g, device=DEV)
    host = [random_table(n, cfg, seed=i) for i, n in enumerate(cfg.engram_num_embeddings)]
    gpu = [t.placed('gpu') for t in host] if CUDA else host
    tables = dict(hbm=gpu, uva=host, uva_prefetch=host)
    ids = hasher(tokens, history=history)[:, 0]                                    # (batch, layers, cols)
    for t_gpu, t_host in zip(gpu, host):                                          # both placements read the same rows
        assert torch.equal(engram_lookup(t_gpu, ids[:64, 0]), engram_lookup(t_host, ids[:64, 0]))
    lookups = time_lookups(dict(hbm=gpu[0], uva=host[0]), ids[:, 0], batches, cfg, graphs)
    hash_us = {B: median_time(lambda: hasher(tokens[:B], history=history[:B], check=False)) * 1e6 for B in batches}
    steps = time_steps(cfg, batches, tables, hasher, tokens, history, graphs)
    report(head, lookups, hash_us, steps, 'tiny' if quick else 'bench')
    return dict(machine=machine, date=str(datetime.date.today()), torch=torch.__version__, triton=triton.__version__,
                header=head, table_rows=list(cfg.engram_num_embeddings), record_bytes=rec, rows_per_token=cols,
                batches=list(batches), lookups=lookups, hash_us=hash_us, steps=steps)

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--table-gib', type=float, default=4.0, help='size of each Engram table (two modules)')
    ap.add_argument('--batches', type=int, nargs='+', default=[1, 64, 1024])
    ap.add_argument('--json', help='write the results here')
    ap.add_argument('--quick', action='store_true', help='tiny sizes, any device: checks that the script runs')
    ap.add_argument('--no-graphs', action='store_true', help='time single launches only')
    a = ap.parse_args()
    if not CUDA and not a.quick: sys.exit('this benchmark needs a GPU (or --quick, with TRITON_INTERPRET=1 on a CPU)')
    res = run(a.table_gib, tuple(a.batches), a.quick, not a.no_graphs)
    if a.json: Path(a.json).write_text(json.dumps(res, indent=1))
