"""The reference model: its parameters against the checkpoint manifest (tiny, and bench on the meta device), shapes,
causality and batch independence of the logits, gradients with `quant` off and on, the effect of `quant`, the tokenizer,
the selection masks against the indexer notebook's per-row references, and every entry point's bad inputs."""
import math
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from budget import examples
from fastcore import test as fct
from dsv41_nb.config import ModelConfig
from dsv41_nb.accounting import checkpoint_manifest
from dsv41_nb.indexer import topk_reference, candidate_pool_reference, sparse_topk_reference
from dsv41_nb.model import (ByteTokenizer, Transformer, init_random, manifest_mismatches, master_dtype,
                            mxfp4_qdq, weight_qdq, Linear, mhc_in)
from dsv41_nb.model_forward import select_topk, candidate_pool_mask
from dsv41_nb.model_forward_block import sort_by_expert, generate_greedy, layer_rms, streamed_layer_rms

TINY, BENCH = ModelConfig.tiny(), ModelConfig.bench()


pytestmark = pytest.mark.usefixtures('one_thread')   # conftest: tiny tensors, one thread


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return init_random(TINY, seed=3)


def ids(n, batch=1, seed=0):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- the checkpoint contract
@pytest.mark.parametrize('cfg', [TINY, BENCH], ids=['tiny', 'bench'])
def test_state_dict_is_the_manifest_without_scales(cfg):
    m = Transformer(cfg, device='meta')
    want = {s.name: s for s in checkpoint_manifest(cfg) if not s.name.endswith('.scale')}
    have = m.state_dict()
    assert set(have) == set(want)
    assert all(tuple(have[n].shape) == want[n].shape for n in want)
    assert all(have[n].dtype == (torch.float32 if want[n].dtype == 'fp32' else torch.bfloat16) for n in want)
    assert manifest_mismatches(m, cfg) == []


def test_manifest_mismatches_names_what_differs():
    m = Transformer(TINY, device='meta')
    del m.layers[3].ffn.experts[1].w2.weight
    m.layers[0].attn.attn_sink = torch.nn.Parameter(torch.empty(3, device='meta'))
    m.norm.weight = torch.nn.Parameter(torch.empty(TINY.dim, device='meta'))        # fp32, the manifest says bf16
    got = manifest_mismatches(m, TINY)
    assert 'missing layers.3.ffn.experts.1.w2.weight' in got
    assert any(g.startswith('layers.0.attn.attn_sink: shape (3,)') for g in got)
    assert any(g.startswith('norm.weight: torch.float32') for g in got)


def test_init_is_deterministic_per_name():
    a, b, c = (init_random(TINY, seed=s) for s in (1, 1, 2))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa['layers.2.attn.wq_a.weight'], sc['layers.2.attn.wq_a.weight'])
    assert not torch.equal(sa['layers.2.attn.wq_a.weight'], sa['layers.3.attn.wq_a.weight'])


# ---------------------------------------------------------------- forward
def test_forward_shapes_and_drafter_input(model):
    x = ids(37, batch=2)
    with torch.no_grad(): logits, hidden = model(x, return_hidden=True)
    assert logits.shape == (2, 37, TINY.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert hidden.shape == (2, 37, TINY.dim * len(TINY.dspark_target_layer_ids))
    taps = []                                     # the averaged copies entering each target layer, recorded by hand
    hooks = [model.layers[l].register_forward_pre_hook(lambda m, a: taps.append(a[0].mean(2)))
             for l in TINY.dspark_target_layer_ids]
    try:
        with torch.no_grad(): model(x)
    finally:
        for h in hooks: h.remove()
    assert torch.equal(hidden, torch.cat(taps, -1))


@pytest.mark.parametrize('cut', [1, 17, 40, 71, 129])
def test_logits_before_a_change_do_not_move(model, cut):
    """Changing tokens from `cut` on leaves the logits of positions < cut bit-identical (windows,
    compressor, indexer, pool, Engram)"""
    a = ids(150, seed=cut)
    b = a.clone()
    b[0, cut:] = torch.randint(0, 256, (150 - cut,), generator=torch.Generator().manual_seed(99))
    with torch.no_grad(): la, lb = model(a), model(b)
    assert torch.equal(la[0, :cut], lb[0, :cut])
    assert not torch.equal(la[0, cut:], lb[0, cut:])


def test_rows_of_a_batch_are_independent(model):
    x = ids(90, batch=3, seed=5)
    with torch.no_grad():
        together = model(x)
        alone = model(x[1:2])
    torch.testing.assert_close(together[1:2], alone, rtol=0, atol=0)


def test_image_tokens_route_and_hash_as_images(model):
    x = ids(30, seed=2)
    x[0, 10:14] = TINY.image_token_id
    with torch.no_grad(): y = model(x)
    assert torch.isfinite(y).all()
    h, pre, run = model.embed_tokens(x)
    assert run.image_mask[0].nonzero().flatten().tolist() == [10, 11, 12, 13]


# ---------------------------------------------------------------- gradients and quantisation
def grads_by_group(model):
    groups = {'embed': 'embed.', 'head': 'head.', 'norm': 'norm.', 'attention': '.attn.w', 'sink': '.attn_sink',
              'compressor': '.compressor.', 'routed experts': '.experts.', 'shared expert': '.shared_experts.',
              'router': '.gate.weight', 'mHC': '.hc_', 'engram': '.engram.'}
    got = {g: False for g in groups}
    for n, p in model.named_parameters():
        for g, key in groups.items():
            if ((n.startswith(key) if key.endswith('.') and not key.startswith('.') else key in n)
                and not n.startswith('mtp.')):
                got[g] |= p.grad is not None and bool(p.grad.abs().sum() > 0)
    return got


@pytest.mark.parametrize('quant', [False, True])
def test_gradient_reaches_every_trained_group(quant):
    m = init_random(TINY, seed=4)
    m.quant = quant
    x = ids(120, seed=4)
    F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[0, 1:]).backward()
    got = grads_by_group(m)
    assert all(got.values()), [g for g, ok in got.items() if not ok]
    assert all(p.grad is None for n, p in m.named_parameters() if '.indexer.' in n or n.startswith('mtp.'))


@pytest.mark.parametrize('seed', [5, 6])
def test_quant_moves_the_logits_within_the_rounding_bound(seed):
    "Bound as the notebook derives it: MXFP4's relative error, sqrt(2 n_layers) independent sublayers in quadrature"
    m, x = init_random(TINY, seed=seed), ids(160, seed=seed)
    g = torch.randn(4096, 32, generator=torch.Generator().manual_seed(seed))
    fp4_err = ((mxfp4_qdq(g) - g).norm() / g.norm()).item()
    with torch.no_grad():
        m.quant = False; off = m(x)
        m.quant = True; on = m(x)
    rel = ((on - off).norm() / off.norm()).item()
    assert 0 < rel < fp4_err * math.sqrt(2 * TINY.n_layers)


def test_grid_weight_follows_the_master():
    lin = Linear(64, 32, 'fp8')
    torch.nn.init.normal_(lin.weight)
    with torch.no_grad():
        first = lin.grid_weight()
        assert torch.equal(first, weight_qdq(lin.weight, 'fp8'))
        lin.weight.mul_(2)                                     # an optimiser step changes the master in place
        assert torch.equal(lin.grid_weight(), weight_qdq(lin.weight, 'fp8'))
        assert torch.equal(lin.grid_weight(), 2 * first)       # a power-of-two scale change is exact on the grid


def test_layer_rms_stays_near_unit_and_streams_alike(model):
    x = ids(100, seed=7)
    rms = layer_rms(model, x)
    assert all(0.9 < r < 2 for r in rms), rms
    assert streamed_layer_rms(TINY, x, seed=3) == rms


def test_generate_greedy_appends_the_argmax(model):
    prompt = [ByteTokenizer.BOS, 72, 105]
    out = generate_greedy(model, prompt, 3)
    assert out[:3] == prompt and len(out) == 6
    t = generate_greedy(model, torch.tensor([prompt]), 3)
    assert t[0].tolist() == out
    with torch.no_grad():
        for i in range(3, 6): assert out[i] == model(torch.tensor([out[:i]]))[0, -1].argmax().item()
    assert generate_greedy(model, prompt, 0) == prompt


# ---------------------------------------------------------------- selection masks
def as_mask(idx, L):
    m = torch.zeros(idx.shape[0], L + 1, dtype=torch.bool)
    return m.scatter(1, torch.where(idx >= 0, idx.long(), L), True)[:, :L]


@settings(max_examples=examples(25))
@given(ratio=st.sampled_from([1, 2]), S=st.integers(1, 120), k=st.integers(1, 24), levels=st.integers(1, 5),
       blocks=st.integers(1, 8), bs=st.sampled_from([2, 4]), seed=st.integers(0, 2 ** 16))
def test_selection_masks_match_the_indexer_references(ratio, S, k, levels, blocks, bs, seed):
    "Scores with many ties (few levels); the pool holds at least k entries, as the config requires"
    blocks = max(blocks, -(-k // bs) + 1)
    vis = (torch.arange(S) + 1) // ratio
    L = max(S // ratio, 1)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, levels, (S, L), generator=g).float().masked_fill(torch.arange(L) >= vis[:, None], -torch.inf)
    assert torch.equal(select_topk(raw, vis, k), as_mask(topk_reference(raw, vis, k), L))
    pool = candidate_pool_mask(raw, vis, blocks, bs)
    ref = candidate_pool_reference(raw, vis, blocks, bs)
    assert torch.equal(pool, as_mask(ref, -(-L // bs)).repeat_interleave(bs, 1)[:, :L])
    assert torch.equal(select_topk(raw, vis, k, pool), as_mask(sparse_topk_reference(raw, vis, ref, k, bs), L))


# ---------------------------------------------------------------- tokenizer
@given(st.text(max_size=40))
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer(TINY)
    ids_ = tok.encode(text)
    assert ids_[0] == tok.BOS and all(0 <= i < 256 for i in ids_[1:])
    assert tok.decode(ids_) == text and tok.decode(tok.encode(text, bos=False)) == text


def test_engram_map_fits_and_merges_case():
    for cfg in (TINY, BENCH):
        tok = ByteTokenizer(cfg)
        m = tok.engram_map()
        assert m.shape == (cfg.vocab_size,) and int(m.max()) < cfg.engram_compressed_vocab_size
        assert m[ord('Q')] == m[ord('q')] and m[ord('Q')] != m[ord('R')]
        assert len(set(m[[tok.BOS, tok.EOS, tok.PAD, cfg.image_token_id, cfg.dspark_noise_token_id]].tolist())) == 5



def _mhc_args(**kw):
    "Arguments of mhc_in for 4 tokens of the tiny config (block 0's parameters' shapes), some replaced"
    n, d = TINY.hc_mult, TINY.dim
    a = dict(x=torch.zeros(4, n, d), pre=torch.zeros(4, n), fn=torch.zeros((2 + n) * n, n * d),
             scale=torch.ones(3), base=torch.zeros((2 + n) * n), norm_weight=torch.ones(d), n=n,
             iters=TINY.hc_sinkhorn_iters, hc_eps=TINY.hc_eps, norm_eps=TINY.norm_eps) | kw
    return tuple(a.values())

# ---------------------------------------------------------------- bad inputs
def test_bad_inputs(model):
    from dataclasses import replace
    tok, short = ByteTokenizer(TINY), Transformer(TINY, max_seq_len=20, device='meta')
    emap = tok.engram_map()
    BAD = [
        (lambda: model(torch.zeros(1, 4)), 'expected an int64 tensor'),
        (lambda: sort_by_expert(torch.zeros(4, 2), 8),
         'ids must be an int64 (tokens, k) tensor'),
        (lambda: model(torch.zeros(1, 4, dtype=torch.int32)), 'got torch.int32'),
        (lambda: model([[1, 2]]), 'got list'),
        (lambda: model(torch.zeros(2, 3, 4, dtype=torch.int64)), 'got shape (2, 3, 4)'),
        (lambda: model(torch.zeros(0, 4, dtype=torch.int64)), 'non-empty'),
        (lambda: model(torch.tensor([[5, TINY.vocab_size]])), f'id {TINY.vocab_size} is outside the vocabulary'),
        (lambda: short(torch.zeros(1, 21, dtype=torch.int64)), '21 tokens exceed max_seq_len = 20'),
        (lambda: model(torch.zeros(1, 3, dtype=torch.int64, device='meta')), 'the model on cpu'),
        (lambda: Transformer(None), 'expected a ModelConfig'),
        (lambda: Transformer(TINY, max_seq_len=0), 'max_seq_len = 0'),
        (lambda: Transformer(TINY, engram_map=emap.int()), 'expected an int64 tensor of shape (512,)'),
        (lambda: Transformer(TINY, engram_map=torch.full((512,), 400)), 'out of range'),
        (lambda: init_random(TINY, seed=1.5), 'seed must be an int'),
        (lambda: generate_greedy(model, [1], 2.0), 'n must be an int'),
        (lambda: generate_greedy(model, [1, 999], 1), 'id 999 is outside'),
        (lambda: ByteTokenizer(replace(TINY, image_token_id=100)), 'above PAD = 258'),
        (lambda: ByteTokenizer(TINY).encode(None), 'expected a str'),
        (lambda: ByteTokenizer(TINY).decode([1, -1]), 'id -1 is not a token id'),
        (lambda: ByteTokenizer(TINY).decode([1.0]), 'id 1.0 is not a token id'),
        (lambda: master_dtype('int4'), "'int4' is not a checkpoint dtype"),
        (lambda: Linear(8, 8, 'e5m2'), "fmt 'e5m2'"),
        (lambda: mhc_in(torch.zeros(4, TINY.dim), *_mhc_args()[1:]), 'x: expected streams (T, n, dim)'),
        (lambda: mhc_in(*_mhc_args(pre=torch.zeros(4, 3))), 'pre: expected shape (4, 4)'),
        (lambda: mhc_in(*_mhc_args(norm_weight=torch.ones(3))), f'norm_weight: expected shape ({TINY.dim},)'),
    ]
    for f, msg in BAD: fct.test_fail(f, contains=msg)


def test_engram_map_too_big_for_the_config():
    from dataclasses import replace
    small = replace(TINY, engram_compressed_vocab_size=100)
    fct.test_fail(lambda: ByteTokenizer(small).engram_map(), contains='do not fit engram_compressed_vocab_size = 100')
