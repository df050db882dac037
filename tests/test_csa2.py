"""CSA2 roles, bindings and the reference attention layer: the role table against the public config, every binding
against `max(s <= layer)`, the window and top-k addressing against per-token loops over the block-pool slot functions,
the reference attention against a float64 softmax written out here, and the layer against plain causal attention and its
own sources.

The stacks run the compressor and indexer on their PyTorch paths (their kernels have their own tests)."""
from dataclasses import replace
import pytest
import torch
from hypothesis import given, settings, strategies as st
from fastcore import test as fct
from dsv41_nb.config import ModelConfig, layer_topology, role_counts
from dsv41_nb.dispatch import use_kernels
from dsv41_nb.record_codecs import cache_format
from dsv41_nb.block_pool import slot_mapping, compressed_state_slots
from dsv41_nb.csa2 import (CSA2_ROLES, layer_reads, layer_writes, role_table, CSA2State,
                           CSA2Step, make_step, random_block_tables, window_indices, SparseIndices,
                           topk_slots, PagedRecords, gather_keys, sparse_attention_reference)
from dsv41_nb.csa2_layer import CSA2Attention

TINY, FULL = ModelConfig.tiny(), ModelConfig.full()


# ---------------------------------------------------------------- roles and bindings
def test_full_roles_match_the_public_config():
    backbone = {r: role_counts(FULL, 'encoder')[r] + role_counts(FULL, 'decoder')[r] for r in CSA2_ROLES}
    assert backbone == {'SWA': 2, 'Full': 4, 'Reindex': 4, 'Reuse': 30}
    lines = role_table(FULL).splitlines()
    assert len(lines) == 41 and lines[21].split()[:3] == ['20', '1', 'Full']
    assert sum('Reuse' in l for l in lines) == 30


@pytest.mark.parametrize('cfg', [TINY, FULL], ids=['tiny', 'full'])
def test_every_binding_is_the_nearest_source_at_or_below(cfg):
    state = CSA2State(cfg)
    below = lambda sources, l: max(s for s in sources if s <= l)
    for info in layer_topology(cfg)[:cfg.n_layers]:
        l = info.layer
        if info.ratio == 0:
            assert info.role == 'SWA' and layer_reads(info, cfg) == {}
            continue
        assert state.source(l, 'compressed KV') == below(cfg.kv_source_layers, l)
        assert ('top-k' in layer_writes(info)) == (l in cfg.index_source_layers)
        if l not in cfg.index_source_layers: assert state.source(l, 'top-k') == below(cfg.index_source_layers, l)
        if l in cfg.index_source_layers: assert state.source(l, 'index keys') == below(cfg.kv_source_layers, l)


def test_selections_are_per_step_and_per_source():
    s, a, b = CSA2State(FULL), object(), object()
    s.publish('top-k', 20, a, 'twenty'); s.publish('top-k', 24, a, 'twenty-four')
    assert [s.read('top-k', l, a) for l in (21, 23, 25, 27)] == ['twenty', 'twenty', 'twenty-four', 'twenty-four']
    fct.test_fail(lambda: s.read('top-k', 25, b), contains='has not published one in it')
    fct.test_fail(lambda: s.publish('top-k', 3, a, None), contains='layer 3 reads')
    fct.test_fail(lambda: s.source(40, 'top-k'), contains='not a backbone layer')


# ---------------------------------------------------------------- addressing
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 9)), min_size=1, max_size=4), st.sampled_from([1, 4, 8]),
       st.integers(1, 24), st.integers(0, 2**31))
def test_window_indices_against_a_loop(requests, bs, window, seed):
    g = torch.Generator().manual_seed(seed)
    nb = (70 + bs - 1) // bs
    swa_bt = random_block_tables(len(requests), nb, len(requests) * nb + 1, g)
    step = make_step(TINY, requests, swa_bt, random_block_tables(len(requests), 5, 6 * len(requests) + 1, g), bs, 16)
    slots, lens = window_indices(step, window)
    for t, (p, r) in enumerate(zip(step.positions.tolist(), step.rows.tolist())):
        first = max(0, p - window + 1)
        want = slot_mapping(swa_bt[r], range(first, p + 1), bs).tolist()
        assert int(lens[t]) == len(want) and slots[t, :len(want)].tolist() == want
        assert (slots[t, len(want):] == -1).all()


@given(st.integers(1, 6), st.sampled_from([(16, 1), (16, 2), (128, 1), (128, 2)]), st.integers(0, 2**31))
def test_topk_slots_against_compressed_state_slots(T, geometry, seed):
    bs, r = geometry
    g = torch.Generator().manual_seed(seed)
    bt = random_block_tables(3, 4, 20, g)
    per = bs // r
    topk = torch.randint(-1, 4 * per, (T, 7), generator=g).int()
    rows = torch.randint(0, 3, (T,), generator=g).int()
    idx = SparseIndices(torch.zeros(T, 1).int(), torch.zeros(T).int(), topk, torch.full((T,), 7).int(), rows, bt, per)
    for t in range(T):
        assert topk_slots(idx)[t].tolist() == compressed_state_slots(bt[rows[t]], topk[t], bs, r).tolist()


# ---------------------------------------------------------------- reference attention
def random_case(g, T, H, fmt_w, fmt_c, W=6, K=5):
    wc, cc = cache_format(TINY, fmt_w), cache_format(TINY, fmt_c)
    window = PagedRecords(wc.pack(torch.randn(4, 8, 64, generator=g) * 2), wc)
    compressed = PagedRecords(cc.pack(torch.randn(6, 4, 64, generator=g)), cc)
    idx = SparseIndices(torch.randint(-1, 32, (T, W), generator=g).int(),
                        torch.randint(0, W + 1, (T,), generator=g).int(),
                        torch.randint(-1, 8, (T, K), generator=g).int(),
                        torch.randint(0, K + 1, (T,), generator=g).int(),
                        torch.randint(0, 2, (T,), generator=g).int(), random_block_tables(2, 2, 6, g), 4)
    return (torch.randn(T, H, 64, generator=g) * 0.5).bfloat16(), window, compressed, idx


@given(st.integers(1, 5), st.sampled_from([1, 4]), st.sampled_from(['window_fp8', 'fp8_ds_mla']),
       st.sampled_from(['ds_fp4', 'fp8_ds_mla', 'window_fp8']), st.booleans(), st.integers(0, 2**31))
def test_reference_against_a_float64_loop(T, H, fmt_w, fmt_c, with_sink, seed):
    g = torch.Generator().manual_seed(seed)
    q, window, compressed, idx = random_case(g, T, H, fmt_w, fmt_c)
    sink = torch.randn(H, generator=g) if with_sink else None
    out, lse = sparse_attention_reference(q, window, compressed, idx, sink, 0.125)
    w_rec, c_rec = window.records(), compressed.records()
    for t in range(T):
        keys = [window.codec.unpack(w_rec[s]) for s in idx.window_slots[t, :idx.window_lens[t]].tolist() if s >= 0]
        for i in idx.topk[t, :idx.topk_lens[t]].tolist():
            if i < 0: continue
            blk = int(idx.block_table[idx.rows[t], i // 4])
            keys.append(compressed.codec.unpack(c_rec[blk * 4 + i % 4]))
        k = torch.stack(keys).double() if keys else torch.zeros(0, 64, dtype=torch.float64)
        s = q[t].double() @ k.T * 0.125                                                          # (H, n)
        den = torch.exp(s).sum(-1) + (torch.exp(sink.double()) if with_sink else 0)
        want = torch.exp(s) @ k / torch.where(den > 0, den, 1)[:, None]
        assert ((out[t].double() - want).abs() <= 2 ** -8 * want.abs() + 1e-6).all()             # one BF16 rounding
        want_lse = torch.log(den)
        assert torch.equal(lse[t].isinf(), want_lse.isinf())
        fin = ~want_lse.isinf()
        assert ((lse[t].double() - want_lse).abs()[fin] <= 1e-5 * (1 + want_lse.abs()[fin])).all()


# ---------------------------------------------------------------- the layer
def tiny_layers(cfg, seed=0):
    torch.manual_seed(seed)
    layers = [CSA2Attention(cfg, l) for l in range(cfg.n_layers)]
    for m in layers: m.attn_sink.data.normal_()
    return layers


def test_layer_is_causal_attention_when_nothing_is_left_out():
    wide = replace(TINY, window_size=64, index_topk=64)
    layers = tiny_layers(wide, 1)
    state = CSA2State(wide).allocate(layers, 64, 4, 16)
    g = torch.Generator().manual_seed(3)
    swa_bt, bt = random_block_tables(2, 16, 64, g), random_block_tables(2, 4, 64, g)
    reqs = [(0, 41), (0, 22)]
    step = make_step(wide, reqs, swa_bt, bt, 4, 16)
    xs = torch.randn(wide.n_layers, 63, wide.dim, generator=g).bfloat16()
    for m in layers:
        with use_kernels('torch'): o, _ = m.attention(xs[m.layer], step, state)
        q = m.query(xs[m.layer], step.positions)[0]
        first = 0
        for r, (start, n) in enumerate(reqs):
            k = m.window_codec.unpack(state.window[m.layer].view(-1, m.window_codec.record_bytes)
                                      [slot_mapping(swa_bt[r], range(n), 4)])
            mask = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
            if m.ratio:
                src, e = state.source(m.layer, 'compressed KV'), torch.arange(n // m.ratio)
                codec = state.main_codec
                k = torch.cat([k, codec.unpack(state.compressed[src].view(-1, codec.record_bytes)
                                               [compressed_state_slots(bt[r], e, 16, m.ratio)])])
                mask = torch.cat([mask, e[None, :] < (torch.arange(n)[:, None] + 1) // m.ratio], 1)
            s = (torch.einsum('thd,kd->thk', q[first:first + n].double(), k.double())
                 * m.scale).masked_fill(~mask[:, None], -torch.inf)
            p = torch.cat([s, m.attn_sink.double().expand(n, -1)[..., None]], -1).softmax(-1)[..., :-1]
            want = torch.einsum('thk,kd->thd', p, k.double())
            assert ((o[first:first + n].double() - want).abs()
                    <= 2 ** -8 * want.abs() + 2 ** -16 * k.abs().max()).all(), m
            first += n


def test_reuse_layers_read_exactly_their_sources_latest_topk():
    layers = tiny_layers(TINY, 2)
    state = CSA2State(TINY).allocate(layers, 64, 4, 16)
    g = torch.Generator().manual_seed(5)
    swa_bt, bt = random_block_tables(2, 24, 64, g), random_block_tables(2, 6, 64, g)
    for sched in ([(0, 60), (0, 33)], [(60, 1), (33, 1)], [(61, 1), (34, 1)]):
        step = make_step(TINY, sched, swa_bt, bt, 4, 16)
        chosen = {}
        for l in TINY.index_source_layers:
            vis = ((step.positions + 1) // TINY.compress_ratios[l]).tolist()
            chosen[l] = torch.stack([torch.cat([torch.randperm(max(v, 1), generator=g)[:min(v, 6)],
                                                torch.full((6 - min(v, 6),), -1)])
                                     for v in vis]).int()
        xs = torch.randn(TINY.n_layers, len(step.positions), TINY.dim, generator=g).bfloat16()
        with use_kernels('torch'):
            outs = [m.attention(xs[m.layer], step, state, chosen.get(m.layer)) for m in layers]
        for m in layers:
            if m.role != 'Reuse': continue
            idx, comp = m.select(xs[m.layer], None, step, state)
            src = max(s for s in TINY.index_source_layers if s <= m.layer)
            assert torch.equal(idx.topk, chosen[src])
            q = m.query(xs[m.layer], step.positions)[0]
            want = sparse_attention_reference(q, PagedRecords(state.window[m.layer], m.window_codec),
                                              comp, idx, m.attn_sink, m.scale)
            assert torch.equal(outs[m.layer][0], want[0])


def test_bad_inputs_name_the_problem():
    g = torch.Generator().manual_seed(0)
    q, window, compressed, idx = random_case(g, 3, 4, 'window_fp8', 'ds_fp4')
    layers = tiny_layers(TINY)
    state = CSA2State(TINY).allocate(layers[:4], 16, 4, 16)
    step = make_step(TINY, [(0, 5)], random_block_tables(1, 4, 16, g), random_block_tables(1, 2, 16, g), 4, 16)
    cases = [
        (lambda: CSA2Attention(TINY, -1), 'not a backbone layer'),
        (lambda: CSA2Attention(TINY, 2, main_kv_format='bogus'), 'unknown cache format'),
        (lambda: sparse_attention_reference(q, window, compressed, idx, None, 0), 'scale: expected a positive number'),
        (lambda: sparse_attention_reference(q, window, compressed, replace(idx, rows=idx.rows + 5), None, 0.1),
         'rows: holds'),
        (lambda: sparse_attention_reference(q, window, compressed, replace(idx, topk_lens=idx.topk_lens[:1]),
                                            None, 0.1), 'topk_lens: expected'),
        (lambda: sparse_attention_reference(q, PagedRecords(window.cache[..., :-1].contiguous(), window.codec),
                                            compressed, idx, None, 0.1), 'window: expected a contiguous uint8 cache'),
        (lambda: window_indices(step, 0), 'window = 0'),
        (lambda: window_indices(step, 4, torch.zeros(len(step.positions) + 1, dtype=torch.long)),
         'window_indices: floor: expected'),
        (lambda: window_indices(step, 4, torch.zeros(len(step.positions))), 'window_indices: floor: expected'),
        (lambda: make_step(TINY, [(0, -1)], step.swa_block_table, step.block_table, 4, 16), 'tokens = -1'),
        (lambda: layers[2].attention(torch.randn(4, TINY.dim).bfloat16(), step, state), 'x: expected (5, dim)'),
        (lambda: layers[2].select(torch.randn(5, TINY.dim).bfloat16(), None, step, state, topk=torch.zeros(4, 2)),
         'topk: expected (5, k) int32'),
        (lambda: layers[3].select(None, None, step, state), 'needs the top-k of layer 2 from this step'),
        (lambda: random_block_tables(4, 4, 10), 'do not fit in 9 usable blocks'),
    ]
    for f, msg in cases: fct.test_fail(f, contains=msg)
