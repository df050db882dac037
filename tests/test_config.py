"""Property tests for ModelConfig: random valid topologies are accepted and mapped consistently;
broken ones fail with ConfigError"""
import json
import numpy as np
from dataclasses import replace, fields
from pathlib import Path
import pytest
import fastcore.test as fct
from hypothesis import given, strategies as st
from dsv41_nb.config import (ModelConfig, ConfigError, layer_topology, role_counts, source_layer, engram_bucket_primes,
                             engram_table_rows, is_prime, validate, expect_config, check_int, check_share,
                             topology_table, plot_layer_map, TOPOLOGY_COLUMNS, require)

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
    cand = draw(st.sampled_from([-1] + [l for l in ix
                                        if all(source_layer(kv, j) == source_layer(kv, l) for j in ix if j > l)]))
    n_mtp = draw(st.integers(0, 3))
    taps = tuple(range(n - min(n_mtp, n), n)) if n_mtp else ()
    return dict(n_layers=n, n_mtp_layers=n_mtp, compress_ratios=tuple(ratios) + (0,) * n_mtp,
                kv_source_layers=tuple(kv), index_source_layers=tuple(ix),
                candidate_source_layer=cand, dspark_target_layer_ids=taps,
                engram_layer_ids=tuple(sorted(set(draw(st.lists(st.integers(0, n - 1), max_size=2))))),
                engram_num_embeddings=())

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
    assert ModelConfig.from_dict(json.loads(c.to_json())) == c

MUTATIONS = st.sampled_from(['drop_kv', 'drop_index', 'ratio', 'topk', 'heads', 'dims', 'engram', 'drafter'])

@given(topologies(), MUTATIONS, st.integers(0, 100))
def test_mutations_fail_cleanly(t, how, k):
    "A mutated config is either still valid or rejected with ConfigError, never another exception"
    c = replace(TINY, **t)
    n = c.n_layers
    if how == 'drop_kv' and c.kv_source_layers: ch = dict(kv_source_layers=c.kv_source_layers[:-1])
    elif how == 'drop_index' and c.index_source_layers: ch = dict(index_source_layers=c.index_source_layers[1:])
    elif how == 'ratio':
        ch = dict(compress_ratios=tuple((r + k) % 4 if i == k % n else r for i, r in enumerate(c.compress_ratios)))
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
        assert (len(primes) == len(set(primes))
                == len(c.engram_layer_ids) * (c.engram_max_ngram_size - 1) * c.engram_n_heads)
        assert all(is_prime(p) and p >= c.engram_vocab_size for p in primes)
        assert engram_table_rows(c) == c.engram_num_embeddings
    assert ([n for n in range(200) if is_prime(n)]
            == [n for n in range(2, 200) if all(n % d for d in range(2, int(n ** 0.5) + 1))])

def test_unknown_key():
    with pytest.raises(ConfigError, match='unknown config keys'): ModelConfig.from_dict({'dim': 64, 'bogus': 1})

FULL = ModelConfig.full()

# (call, exception type, words the message must contain): every public function of dsv41_nb.config, given bad input
BAD_INPUTS = [
    (lambda: ModelConfig(vocab_size='abc'), ConfigError, "vocab_size = 'abc' is a str; expected an int"),
    (lambda: ModelConfig(n_heads=True), ConfigError, 'n_heads = True is a bool'),
    (lambda: ModelConfig(route_scale='1.5'), ConfigError, "route_scale = '1.5' is a str; expected a number"),
    (lambda: ModelConfig(norm_eps=float('inf')), ConfigError, 'norm_eps = inf; expected a finite number'),
    (lambda: ModelConfig(score_func=1), ConfigError, 'score_func = 1 is a int; expected a str'),
    (lambda: ModelConfig(kv_source_layers=(2.0, 8, 14, 20)), ConfigError, 'holds 2.0, a float; expected ints'),
    (lambda: ModelConfig(compress_ratios=None), ConfigError, 'compress_ratios = None is a NoneType; expected a tuple'),
    (lambda: ModelConfig(window_size=-128), ConfigError, 'window_size = -128; it must be positive'),
    (lambda: ModelConfig(dim=0), ConfigError, 'dim = 0; it must be positive'),
    (lambda: ModelConfig(hc_eps=0.0), ConfigError, 'hc_eps = 0.0; it must be positive'),
    (lambda: ModelConfig(n_mtp_layers=-1), ConfigError, 'n_mtp_layers = -1; it must not be negative'),
    (lambda: ModelConfig(candidate_source_layer=-7), ConfigError, 'candidate_source_layer = -7'),
    (lambda: ModelConfig(engram_vocab_size=-5, engram_num_embeddings=()), ConfigError,
     'engram_vocab_size = -5; it must be positive'),
    (lambda: ModelConfig(vision_max_wh_ratio=-1.0), ConfigError, 'vision_max_wh_ratio = -1.0'),
    (lambda: replace(TINY, vision_max_wh_ratio=0.0), ConfigError, 'vision_max_wh_ratio = 0.0; expected None or > 0'),
    (lambda: replace(TINY, rope_head_dim=15), ConfigError, 'rope_head_dim = 15; expected an even number'),
    (lambda: replace(TINY, rope_head_dim=64), ConfigError, 'rope_head_dim = 64; expected an even number'),
    (lambda: replace(TINY, n_activated_experts=9), ConfigError, 'n_activated_experts = 9 > n_routed_experts = 8'),
    (lambda: replace(TINY, engram_pad_id=512), ConfigError, 'engram_pad_id = 512 is outside the vocabulary 0..511'),
    (lambda: replace(TINY, kv_source_layers=(2, 4, 6, 12)), ConfigError, 'contains 12, outside the backbone layers'),
    (lambda: replace(TINY, kv_source_layers=(0, 2, 4, 6)), ConfigError, 'layer 0, whose compress_ratio is 0'),
    (lambda: replace(TINY, index_topk=65), ConfigError, 'index_topk = 65 exceeds the candidate pool'),
    (lambda: ModelConfig.from_dict(['dim', 64]), ConfigError, 'expected a dict of config.json keys, got list'),
    (lambda: ModelConfig.from_dict({'dim': 64, 'bogus': 1}), ConfigError, 'unknown config keys'),
    (lambda: source_layer((2, 8), 'x'), TypeError, "source_layer: layer must be an int, got 'x'"),
    (lambda: source_layer(None, 3), TypeError, 'source_layer: sources must be a tuple or list'),
    (lambda: source_layer((2, '8'), 3), TypeError, 'source_layer: sources must be a tuple or list'),
    (lambda: is_prime('7'), TypeError, "is_prime: n must be an int, got '7'"),
    (lambda: is_prime(7.0), TypeError, 'is_prime: n must be an int, got 7.0'),
    (lambda: check_int('f', 'n', -1, 0), ValueError, 'f: n = -1; expected at least 0'),
    (lambda: check_share('f', 'u', 1.5), ValueError, 'f: u = 1.5; expected a share in (0, 1]'),
    (lambda: check_share('f', 'u', False), ValueError, 'f: u = False; expected a share'),
    (lambda: check_share('f', 'u', '0.5'), ValueError, "f: u = '0.5'; expected a share"),
    (lambda: check_share('f', 'u', 0), ValueError, 'f: u = 0; expected a share in (0, 1]'),
    (lambda: require(False, 'm', 'x'), TypeError, "require: exc must be an exception class, got 'x'"),
    (lambda: require(False, 'm', int), TypeError, "require: exc must be an exception class, got <class 'int'>"),
    (lambda: validate('full'), TypeError, 'validate: expected a ModelConfig, got str'),
    (lambda: expect_config({}, 'g'), TypeError, 'g: expected a ModelConfig, got dict'),
    (lambda: engram_bucket_primes(None), TypeError, 'engram_bucket_primes: expected a ModelConfig'),
    (lambda: engram_table_rows(FULL.to_dict()), TypeError, 'engram_bucket_primes: expected a ModelConfig, got dict'),
    (lambda: layer_topology('full'), TypeError, 'layer_topology: expected a ModelConfig, got str'),
    (lambda: role_counts(FULL, 'middle'), ValueError, "role_counts: half = 'middle'"),
    (lambda: role_counts(3), TypeError, 'layer_topology: expected a ModelConfig, got int'),
    (lambda: topology_table(None), TypeError, 'layer_topology: expected a ModelConfig, got NoneType'),
    (lambda: plot_layer_map('tiny'), TypeError, 'layer_topology: expected a ModelConfig, got str'),
]

@pytest.mark.parametrize('call, exc, words', BAD_INPUTS, ids=[w[:40] for _, _, w in BAD_INPUTS])
def test_bad_inputs(call, exc, words):
    fct.test_fail(call, contains=words, exc=exc)


def test_edges_are_accepted():
    "Each limit a rule sets is itself allowed"
    for kw in (dict(rope_head_dim=32), dict(n_activated_experts=8), dict(engram_pad_id=0), dict(engram_pad_id=511),
               dict(index_topk=16 * 4), dict(vision_max_wh_ratio=1e-3)):
        assert all(getattr(replace(TINY, **kw), k) == v for k, v in kw.items())
    assert replace(TINY, engram_num_embeddings=(6127, 6337)).engram_num_embeddings == (6127, 6337)   # given, kept
    assert [check_share('f', 'u', v) for v in (1, 0.5, np.float32(0.25))] == [1, 0.5, 0.25]
    assert require(True, 'never raised', 'not an exception class') is None

WRONG = {'int': 'x', 'float': 'x', 'str': 3, 'tuple': 'x', 'float | None': 'x', 'str | None': 3}

@pytest.mark.parametrize('name', [f.name for f in fields(ModelConfig)])
def test_every_field_rejects_a_wrong_type(name):
    "A JSON value of the wrong type is named in a ConfigError, never a comparison or attribute error later"
    kind = {f.name: f.type for f in fields(ModelConfig)}[name]
    with pytest.raises(ConfigError, match=f'^{name} = '): replace(FULL, **{name: WRONG[kind]})

def test_topology_columns_match_the_table():
    for c in (TINY, FULL): assert topology_table(c).splitlines()[0].split() == list(TOPOLOGY_COLUMNS)
