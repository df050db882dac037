"Property tests for ModelConfig: random valid topologies are accepted and mapped consistently; broken ones fail with ConfigError"
import json
from dataclasses import replace
from pathlib import Path
import pytest
from hypothesis import given, strategies as st, assume
from dsv41_nb.config import (ModelConfig, ConfigError, layer_topology, role_counts, source_layer, compressed_entries_per_token,
                             engram_bucket_primes, engram_table_rows, is_prime, checkpoint_manifest, params_by_group, expert_params)

PUBLIC = Path(__file__).resolve().parent.parent / 'nbs' / 'reference' / 'deepseek_v41_config.json'
TINY = ModelConfig.tiny()

def test_full_is_the_public_config():
    d = json.loads(PUBLIC.read_text())
    assert ModelConfig.full().to_dict() == d
    assert ModelConfig.from_json(PUBLIC) == ModelConfig.full()

@st.composite
def topologies(draw):
    "A random valid layer topology on the tiny geometry"
    half = draw(st.integers(1, 6))
    n = 2 * half
    n_swa = draw(st.integers(0, n - 1))
    enc_ratio, dec_ratio = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    ratios = [0] * n_swa + [enc_ratio if l < half else dec_ratio for l in range(n_swa, n)]
    kv = set()
    for l in range(n_swa, n):                       # every run of one ratio starts with a KV source
        if l == n_swa or ratios[l] != ratios[l - 1] or draw(st.booleans()): kv.add(l)
    ix = set(kv) | {l for l in range(n_swa, n) if draw(st.booleans())}
    kv, ix = sorted(kv), sorted(ix)
    cand = draw(st.sampled_from([-1] + [l for l in ix if all(source_layer(kv, j) == source_layer(kv, l) for j in ix if j > l)]))
    n_mtp = draw(st.integers(0, 3))
    taps = tuple(range(n - min(n_mtp, n), n)) if n_mtp else ()
    return dict(n_layers=n, n_mtp_layers=n_mtp, compress_ratios=tuple(ratios) + (0,) * n_mtp, kv_source_layers=tuple(kv),
                index_source_layers=tuple(ix), candidate_source_layer=cand, dspark_target_layer_ids=taps,
                engram_layer_ids=tuple(sorted(set(draw(st.lists(st.integers(0, n - 1), max_size=2))))), engram_num_embeddings=())

@given(topologies())
def test_random_valid_topologies(t):
    c = replace(TINY, **t)
    topo = layer_topology(c)
    assert len(topo) == c.n_layers + c.n_mtp_layers
    for i in topo:
        if i.ratio == 0:
            assert i.role == 'SWA' and i.kv_source is None and i.index_source is None
            continue
        assert i.kv_source <= i.layer and c.compress_ratios[i.kv_source] == i.ratio
        assert i.kv_source <= i.index_source <= i.layer
        assert (i.role == 'Full') == (i.layer in c.kv_source_layers)
        assert (i.role == 'Reindex') == (i.layer in c.index_source_layers and i.layer not in c.kv_source_layers)
        assert i.half == ('encoder' if i.layer < c.n_layers // 2 else 'decoder')
    counts = role_counts(c)
    assert sum(counts.values()) == len(topo)
    assert counts['Full'] == len(c.kv_source_layers)
    assert abs(compressed_entries_per_token(c) - sum(1 / c.compress_ratios[s] for s in c.kv_source_layers)) < 1e-12
    assert ModelConfig.from_dict(json.loads(c.to_json())) == c

MUTATIONS = st.sampled_from(['drop_kv', 'drop_index', 'ratio', 'topk', 'heads', 'dims', 'engram', 'drafter'])

@given(topologies(), MUTATIONS, st.integers(0, 100))
def test_mutations_fail_cleanly(t, how, k):
    "A mutated config is either still valid or rejected with ConfigError, never another exception"
    c = replace(TINY, **t)
    n = c.n_layers
    if how == 'drop_kv' and c.kv_source_layers: ch = dict(kv_source_layers=c.kv_source_layers[:-1])
    elif how == 'drop_index' and c.index_source_layers: ch = dict(index_source_layers=c.index_source_layers[1:])
    elif how == 'ratio': ch = dict(compress_ratios=tuple((r + k) % 4 if i == k % n else r for i, r in enumerate(c.compress_ratios)))
    elif how == 'topk': ch = dict(index_topk=k * 8 + 1)
    elif how == 'heads': ch = dict(n_heads=k + 1)
    elif how == 'dims': ch = dict(head_dim=16 * (k + 1))
    elif how == 'engram': ch = dict(engram_num_embeddings=tuple(x - k for x in c.engram_num_embeddings))
    else: ch = dict(compress_ratios=c.compress_ratios[:-1] + (k % 3,)) if c.n_mtp_layers else {}
    try: new = replace(c, **ch)
    except ConfigError as e: assert str(e)
    else: layer_topology(new)

def test_engram_primes():
    for c in (TINY, ModelConfig.bench()):
        primes = [p for layer in engram_bucket_primes(c) for order in layer for p in order]
        assert len(primes) == len(set(primes)) == len(c.engram_layer_ids) * (c.engram_max_ngram_size - 1) * c.engram_n_heads
        assert all(is_prime(p) and p >= c.engram_vocab_size for p in primes)
        assert engram_table_rows(c) == c.engram_num_embeddings
    assert [n for n in range(200) if is_prime(n)] == [n for n in range(2, 200) if all(n % d for d in range(2, int(n ** 0.5) + 1))]

def test_manifest_counts():
    for c in (TINY, ModelConfig.bench()):
        man = checkpoint_manifest(c)
        names = [s.name for s in man]
        assert len(names) == len(set(names))
        g = params_by_group(man)
        assert g['routed_experts'] == c.n_layers * c.n_routed_experts * expert_params(c)
        assert g['dspark_experts'] == c.n_mtp_layers * c.dspark_n_routed_experts * expert_params(c)
        assert sum(1 for s in names if s.endswith('.attn.compressor.norm.weight')) == len(c.kv_source_layers)
        assert sum(1 for s in names if s.endswith('.attn.indexer.wq_b.weight')) == len(c.index_source_layers)
        assert sum(1 for s in names if s.endswith('.engram.embed.weight')) == len(c.engram_layer_ids)

def test_unknown_key():
    with pytest.raises(ConfigError, match='unknown config keys'): ModelConfig.from_dict({'dim': 64, 'bogus': 1})
