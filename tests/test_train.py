"""The training pieces: the corpus and its split, byte windows, the router-bias balancing rule, the dense baseline,
and `train` itself (it learns, it is deterministic, it leaves the model's dtypes and switches as they were)."""
import json, math, os, subprocess, sys
from pathlib import Path
import pytest
import torch
import torch.nn as nn
import fastcore.test as fct
from hypothesis import given, settings, strategies as st
from budget import examples
from dsv41_nb.moe import route
from dsv41_nb.train import (SKIP_MODULES, corpus_documents, load_corpus, split_documents, ByteData, small_config,
                            module_documents, byte_data, trained_param_count, DenseBaseline, dense_param_count,
                            lr_at, balance_router_bias, max_violation, ExpertLoad, ExpertDropout, source_files)
from dsv41_nb.train_loop import (lm_loss, compiled, evaluate, train, fast_path, held_out_prompts, sample_next,
                                 continue_prompts, distinct_4grams, known_words, ends_in_loop, corpus_words)
from dsv41_nb.train_records import interval_rates

def _gen(seed): return torch.Generator().manual_seed(seed)

@pytest.fixture(scope='module')
def docs(tmp_path_factory):
    return load_corpus(tmp_path_factory.mktemp('cache'))

def _stream_data(n_train=4000, n_val=1000, seed=0):
    "Token streams of random English-like bytes: independent of the corpus, fast"
    g = _gen(seed)
    words = [bytes(torch.randint(97, 123, (int(n),), generator=g).tolist())
             for n in torch.randint(1, 7, (40,), generator=g)]
    pick = lambda n: torch.tensor(list(b' '.join(words[i] for i in torch.randint(0, 40, (n,), generator=g).tolist())),
                                  dtype=torch.int16)
    return ByteData(pick(n_train // 4), pick(n_val // 4), 256)

def test_corpus_is_deterministic(docs, tmp_path):
    "Built twice it is the same list; the cache reads back identical; no skipped module and no document twice"
    assert corpus_documents() == docs == load_corpus(tmp_path) == load_corpus(tmp_path)   # built, built, cached
    assert len(list(tmp_path.iterdir())) == 1
    assert len(set(docs)) == len(docs) and sum(len(d.encode()) for d in docs) > 1_000_000
    assert not any(d.startswith(f'"""{m}\n') or d.startswith(f'"""{m}.') for d in docs for m in SKIP_MODULES)

def test_split_is_disjoint_and_stable(docs):
    "Disjoint, covering; a document's side depends on its text and the seed only (not on order or on other documents)"
    train_docs, val_docs = split_documents(docs)
    assert set(train_docs).isdisjoint(val_docs) and len(train_docs) + len(val_docs) == len(docs)
    assert 0.03 < len(val_docs) / len(docs) < 0.07                 # 5% expected; binomial sd ~0.3% at 5,000 documents
    sub_train, sub_val = split_documents(docs[1::3][::-1])
    assert set(sub_val) == set(val_docs) & set(docs[1::3]) and set(sub_train) <= set(train_docs)
    assert set(split_documents(docs, seed=7)[1]) != set(val_docs)

@settings(max_examples=examples(30))
@given(st.integers(2, 40), st.integers(1, 5), st.integers(0, 2**31))
def test_windows_shift_targets(seq_len, batch, seed):
    "Inputs are BOS then the targets shifted right; targets are a contiguous slice of the stream"
    data = ByteData(torch.randint(0, 256, (200,), generator=_gen(seed), dtype=torch.int16),
                    torch.zeros(50, dtype=torch.int16), 256)
    x, y = data.batch(batch, seq_len, _gen(seed))
    assert x.shape == y.shape == (batch, seq_len) and (x[:, 0] == 256).all() and (x[:, 1:] == y[:, :-1]).all()
    for row in y.tolist():
        s = data.train.tolist()
        assert any(s[i:i + seq_len] == row for i in range(len(s) - seq_len + 1))

@settings(max_examples=examples(60))
@given(st.integers(2, 64), st.integers(0, 2**31), st.floats(1e-4, 0.1))
def test_bias_rule_moves_against_load(E, seed, gamma):
    "Each expert's bias moves by exactly γ against the sign of (its load - the mean load), 0 at the mean"
    counts = torch.randint(0, 50, (E,), generator=_gen(seed))
    bias = torch.randn(E, generator=_gen(seed + 1))
    new = balance_router_bias(bias.clone(), counts, gamma)
    for b0, b1, c in zip(bias.tolist(), new.tolist(), counts.tolist()):
        mean = sum(counts.tolist()) / E
        want = b0 - gamma if c > mean else b0 + gamma if c < mean else b0
        assert abs(b1 - want) < 1e-6

def test_bias_update_balances_a_skewed_router():
    "Four experts favoured by the inputs' mean direction: the rule brings the max violation down by more than 3x"
    g, E, D = _gen(3), 16, 32
    w = torch.randn(E, D, generator=g) / D ** 0.5
    w[:4] += 0.8
    bias, vio = torch.zeros(E), []
    for _ in range(300):
        _, ids = route(torch.randn(512, D, generator=g) + 0.3, w, bias, 2, 1.5)
        counts = torch.bincount(ids.flatten(), minlength=E)
        vio.append(max_violation(counts)); balance_router_bias(bias, counts, 0.01)
    assert vio[0] > 1.5 and sum(vio[-50:]) / 50 < vio[0] / 3

def test_baseline_param_count():
    "The closed form counts what the module holds; `matching` lands within 1% of the small model's backbone"
    m = DenseBaseline(300, 64, 3, 4, 96)
    assert sum(p.numel() for p in m.parameters()) == dense_param_count(300, 64, 3, 96)
    b = DenseBaseline.matching(small_config())
    assert abs(sum(p.numel() for p in b.parameters()) / trained_param_count(small_config()) - 1) < 0.01

def test_overfit_tiny_stream():
    """48 random bytes, windows of 32: the model memorises them. The only byte it cannot know is the first of a window
    (17 starts are equally likely), so the loss floor is ln(17) / 32 = 0.09 nats; uniform guessing is ln 512 = 6.24"""
    s = torch.randint(0, 256, (48,), generator=_gen(0), dtype=torch.int16)
    m = DenseBaseline(512, 64, 2, 2, 128)
    hist = train(m, ByteData(s, s, 256), steps=40, lr=1e-2, batch_size=8, seq_len=32, eval_every=40, eval_batches=1,
                 device='cpu')
    assert math.log(17) / 32 - 0.01 < hist['val_loss'][-1] < 0.3

def test_train_is_deterministic_and_restores_the_model():
    "Same seed, same history (CPU); parameters come back in their original dtypes, the quant switch as it was"
    data, runs = _stream_data(), []
    for _ in range(2):
        m = DenseBaseline(512, 32, 1, 2, 64).to(torch.bfloat16)
        m.quant = True
        runs.append(train(m, data, steps=4, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, device='cpu'))
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and m.quant is True
    assert runs[0] == {**runs[1], 'seconds': runs[0]['seconds']}
    assert len(runs[0]['val_loss']) == 2

class _BlowsUp(nn.Module):
    "A model whose loss turns to NaN at its third forward"
    def __init__(self):
        super().__init__()
        self.m, self.calls = DenseBaseline(512, 32, 1, 2, 64), 0
    def forward(self, ids):
        self.calls += 1
        out = self.m(ids)
        return out * float('nan') if self.calls == 3 else out

def test_train_names_the_step_whose_loss_is_not_finite():
    "Losses are read back at each evaluation only, yet a non-finite one is reported with its own (0-based) step"
    with pytest.raises(FloatingPointError, match='the loss is nan at step 2$'):
        train(_BlowsUp(), _stream_data(), steps=6, batch_size=2, seq_len=16, eval_every=5, eval_batches=1,
              device='cpu')

class _Routed(nn.Module):
    "A tiny LM with one MoE router at `layers.0.ffn.gate`, to check that `train` balances it"
    def __init__(self, E=8, D=32):
        super().__init__()
        self.embed, self.head = nn.Embedding(512, D), nn.Linear(D, 512)
        self.layers = nn.ModuleList([nn.Module()]); self.layers[0].ffn = nn.Module()
        gate = self.layers[0].ffn.gate = nn.Module()
        gate.weight = nn.Parameter(torch.randn(E, D) / D ** 0.5); gate.bias = nn.Parameter(torch.zeros(E))
        gate.forward = lambda x: route(x, gate.weight, gate.bias, 2, 1.5)
        self.experts = nn.Parameter(torch.randn(E, D, D) / D)
    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)
        w, idx = self.layers[0].ffn.gate(h)
        y = h + (w[..., None] * torch.einsum('tkd,tkde->tke', h[:, None].expand(-1, 2, -1), self.experts[idx])).sum(1)
        return self.head(y).view(*ids.shape, -1)

def test_validation_text_does_not_move_the_router_biases():
    """The bias rule learns from training tokens alone: the same run evaluated on other validation text (every step)
    ends with the same biases and weights"""
    a, b = _stream_data(seed=0), _stream_data(seed=0)
    b = ByteData(a.train, torch.flip(b.val, (0,)) if len(b.val) else b.val, 256)
    assert not torch.equal(a.val, b.val)
    ends, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)      # several threads sum some gradients in an order that varies
    try:
        for data in (a, b):
            torch.manual_seed(0); m = _Routed()
            train(m, data, steps=4, batch_size=2, seq_len=16, eval_every=1, eval_batches=1, gamma=0.01, device='cpu')
            ends.append({n: p.detach().clone() for n, p in m.named_parameters()})
    finally: torch.set_num_threads(threads)
    assert all(torch.equal(ends[0][n], ends[1][n]) for n in ends[0])

def test_train_updates_router_bias_not_by_gradient():
    "The router bias changes by the rule (multiples of γ), is not in the optimizer, and the hooks are removed after"
    m, data = _Routed(), _stream_data()
    train(m, data, steps=5, batch_size=2, seq_len=16, eval_every=5, eval_batches=1, gamma=0.01, device='cpu')
    b = m.layers[0].ffn.gate.bias.detach()
    assert b.abs().max() > 0 and torch.allclose(b / 0.01, (b / 0.01).round(), atol=1e-4)
    assert not m.layers[0].ffn.gate._forward_hooks

def test_expert_dropout_in_training_only():
    """In training a share p of the (token, expert) weights is zeroed, the rest scaled by 1/(1-p);
    eval and removal restore"""
    m, h = _Routed(E=16), torch.randn(8192, 32, generator=_gen(3))
    gate = m.layers[0].ffn.gate
    w0, ids0 = gate(h)
    drop = ExpertDropout(m, 0.3)
    m.train(); w1, ids1 = gate(h)
    kept = w1 != 0
    assert torch.equal(ids1, ids0) and abs(kept.float().mean().item() - 0.7) < 0.02
    torch.testing.assert_close(w1[kept], w0[kept] / 0.7)
    m.eval(); assert torch.equal(gate(h)[0], w0)
    m.train(); drop.remove(); assert torch.equal(gate(h)[0], w0) and not gate._forward_hooks

def test_train_with_expert_dropout_changes_the_run_and_unhooks():
    "The same seed with and without expert dropout: different histories, the router's hooks gone after both"
    data, hists = _stream_data(), []
    for p in (0.0, 0.5):
        torch.manual_seed(0); m = _Routed()
        hists.append(train(m, data, steps=4, batch_size=2, seq_len=16, eval_every=4, eval_batches=1, device='cpu',
                           expert_dropout=p))
        assert not m.layers[0].ffn.gate._forward_hooks
    assert hists[0]['train_loss'] != hists[1]['train_loss']

def test_bad_inputs():
    data, m = _stream_data(), DenseBaseline(512, 32, 1, 2, 64)
    cases = [
        (lambda: split_documents(['a', 'b'], 1.5), 'val_fraction = 1.5'),
        (lambda: split_documents('text'), 'docs must be a list of str'),
        (lambda: data.windows('test', torch.tensor([0]), 8), "split = 'test'"),
        (lambda: data.batch(0, 8), 'batch_size'),
        (lambda: data.batch(2, 10**6), 'longer than the train stream'),
        (lambda: balance_router_bias(torch.zeros(4), torch.zeros(5)), "counts must have the bias's shape (4,)"),
        (lambda: balance_router_bias(torch.zeros(4), torch.zeros(4), -1.0), 'gamma = -1.0'),
        (lambda: DenseBaseline(512, 30, 1, 4, 64), 'dim = 30 must split into 4 heads'),
        (lambda: DenseBaseline(512, 64, 0, 2, 64), 'n_layers'),
        (lambda: DenseBaseline.matching(small_config(), 1000), 'cannot hold 12 layers'),
        (lambda: m(torch.zeros(2, 4)), 'input_ids must be int64'),
        (lambda: train(m, data, steps=0), 'steps'),
        (lambda: train(m, data, steps=2, lr=-1.0), 'lr = -1.0'),
        (lambda: train(m, data, steps=2, seq_len=10**6), 'does not fit the streams'),
        (lambda: train('model', data, steps=2), 'model must be an nn.Module'),
        (lambda: train(m, [1, 2, 3], steps=2), 'data must be a ByteData'),
        (lambda: lr_at(0, 10, 1e-3, -1), 'warmup'),
        (lambda: max_violation([1, 2]), 'counts must be a non-empty 1-D tensor'),
        (lambda: evaluate(m, []), 'batches must be a non-empty list'),
        (lambda: ExpertLoad('model'), 'expected an nn.Module'),
        (lambda: ExpertDropout('model', 0.1), 'ExpertDropout: expected an nn.Module'),
        (lambda: ExpertDropout(m, 1.0), 'p = 1.0'),
        (lambda: ExpertDropout(m, -0.1), 'p = -0.1'),
        (lambda: ExpertDropout(m, True), 'p = True'),
        (lambda: train(m, data, steps=2, expert_dropout=1.5), 'p = 1.5'),
        (lambda: module_documents('no_such_module_xyz'), "no importable module 'no_such_module_xyz'"),
        (lambda: byte_data(['a'], ['b'], object()), 'tokenizer must have encode, BOS and EOS'),
        (lambda: byte_data([], ['b'], None), 'train_docs must be a non-empty list of str'),
        (lambda: lm_loss(m, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)),
         'must match inputs'),
        (lambda: train(m, data, steps=2, fast='yes'), "fast = 'yes'"),
        (lambda: fast_path('model').__enter__(), 'expected an nn.Module'),
        (lambda: compiled('hc_post'), 'compiled: expected a function, got str'),
        (lambda: interval_rates([1, 2]), 'interval_rates: expected a train history'),
        (lambda: interval_rates(dict(tokens=[0, 5], seconds=[0.0])), '2 token counts but 1 times'),
        (lambda: source_files('/no/such/folder'), 'no directory /no/such/folder'),
        (lambda: held_out_prompts(['some text'] * 3, n=0), 'n'),
        (lambda: held_out_prompts(['short'] * 3, n=2, length=64), 'no document is longer than 128 bytes'),
        (lambda: continue_prompts(m, None, [b'ab', b'abc'], 2), 'the prompts must all have one length'),
    ]
    for f, msg in cases: fct.test_fail(f, contains=msg)

def _tiny_model_and_run(seed=0, S=40):
    """A tiny Transformer (10_model), and the attention input and DenseRun of its first index-source
    layer, captured by a hook"""
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.model import init_random
    from dsv41_nb.train_loop import indexer_layers
    m = init_random(ModelConfig.tiny(), seed)
    m.quant = False
    attn = next(iter(indexer_layers(m).values()))
    seen = {}
    h = attn.register_forward_hook(lambda mod, args, out: seen.update(args=args))
    with torch.no_grad(): m(torch.randint(0, 256, (2, S), generator=_gen(seed)))
    h.remove()
    return m, attn, seen['args']

def test_attention_mass_matches_a_loop():
    "Per query and head, softmax over window + visible compressed entries + sink, in float64 loops; summed, normalised"
    from dsv41_nb.train_loop import attention_mass
    m, attn, (x, run) = _tiny_model_and_run()
    got = attention_mass(attn, x, run)                                               # (B, S, L)
    q, _ = attn.query(x, run)
    win, comp = attn.window_kv(x, run).double(), run.compressed[attn.info.kv_source].double()
    B, S, H, _ = q.shape
    for b, s in [(0, 0), (1, 7), (0, S - 1), (1, S // 2)]:
        vis = int(run.visible(attn.ratio)[s])
        mass = torch.zeros(comp.shape[1], dtype=torch.float64)
        for h in range(H):
            qs = q[b, s, h].double()
            wl = [qs @ win[b, j] * attn.scale for j in range(max(0, s - attn.window + 1), s + 1)]
            cl = [qs @ comp[b, t] * attn.scale for t in range(vis)]
            z = torch.stack(wl + cl + [attn.attn_sink[h].double()]).exp()
            mass[:vis] += z[len(wl):len(wl) + vis] / z.sum()
        want = mass / mass.sum() if vis else mass
        torch.testing.assert_close(got[b, s].double(), want, rtol=1e-4, atol=1e-6)   # fp32 softmax vs float64

def test_indexer_distillation_trains_only_the_indexer():
    "The KL's gradient reaches indexer weights and nothing else; a few Adam steps on it lower it"
    from dsv41_nb.train_loop import IndexerDistillation, lm_loss
    m, _, _ = _tiny_model_and_run()
    d, x = IndexerDistillation(m), torch.randint(0, 256, (2, 40), generator=_gen(1))
    idx = [p for n, p in m.named_parameters() if '.indexer.' in n]
    for p in idx: p.data = p.data.float()
    opt, kls = torch.optim.Adam(idx, lr=1e-2), []
    for _ in range(6):
        m(x); kl = d.take(); kls.append(kl.item())
        m.zero_grad(set_to_none=True); kl.backward()
        assert all((p.grad is not None) == ('.indexer.' in n) for n, p in m.named_parameters())
        opt.step()
    d.remove()
    assert kls[-1] < kls[0] and not d.handles


def test_text_measures():
    "distinct word 4-grams, known words and loops on texts whose answers are known by hand"
    assert distinct_4grams(b'a string is a string is a string is a string') == 3 / 8
    assert distinct_4grams(b'Return the list of the keys.') == 1.0 and distinct_4grams(b'') == 1.0
    assert known_words(b'Return teh list', {b'Return', b'list'}) == 2 / 3
    assert corpus_words(['Return the list', 'x = 1']) == {b'Return', b'the', b'list'}
    assert ends_in_loop(b'def f():' + b' ' * 64) and ends_in_loop(b'x' + b'the string is a string ' * 4)
    assert not ends_in_loop(b'Return the list of the keys, in the order they were added to the mapping.')
    assert not ends_in_loop(b' ' * 63)   # too short to tell

def test_sample_next():
    "temperature 0 is the argmax; a tiny top-p keeps only the most likely id; sampling follows the softmax"
    g = _gen(0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    assert sample_next(logits, 0.0, 1.0).tolist() == [1, 0]
    assert sample_next(logits, 1.0, 1e-6, g).tolist() == [1, 0]
    draws = torch.stack([sample_next(logits[:1], 1.0, 1.0, g) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)

def test_held_out_prompts_start_lines():
    docs = ['line one\nline two is longer\n' * 20, 'x' * 300 + '\nend']
    ps = held_out_prompts(docs, n=6, length=16, seed=3)
    assert len(ps) == 6 and all(len(p) == 16 for p in ps)
    assert all(any(d.encode().startswith(p) or (b'\n' + p) in d.encode() for d in docs) for p in ps)
    assert held_out_prompts(docs, n=6, length=16, seed=3) == ps

def test_fast_path_matches_the_reference_and_restores():
    "The grouped experts give the reference's loss and gradients on a tiny model; the switch is undone after"
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.model import init_random, MoE, Block, mhc_in
    from dsv41_nb.mhc import hc_post
    m = init_random(ModelConfig.tiny(), 0).float(); m.quant = False
    x = torch.randint(0, 256, (2, 40), generator=_gen(1)); y = torch.randint(0, 256, (2, 40), generator=_gen(2))
    def run():
        m.zero_grad(); loss = lm_loss(m, x, y); loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    ref_loss, ref = run()
    with fast_path(m, compile=False):
        assert all(mod.grouped for mod in m.modules() if isinstance(mod, MoE))
        loss, got = run()
    assert abs(loss - ref_loss) < 1e-5
    for n, g in got.items():
        if n in ref: torch.testing.assert_close(g, ref[n], rtol=1e-4, atol=1e-6)
        else: assert g.eq(0).all(), n        # an expert no token chose
    assert not any(mod.grouped for mod in m.modules() if isinstance(mod, MoE))
    assert all(b.hc_in is mhc_in and b.hc_out is hc_post for b in m.modules() if isinstance(b, Block))

def test_interval_rates():
    "Tokens over seconds between consecutive evaluations; one evaluation gives none"
    assert interval_rates(dict(tokens=[100, 300, 600], seconds=[1.0, 2.0, 4.0])) == [200.0, 150.0]
    assert interval_rates(dict(tokens=[100], seconds=[1.0])) == []

@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get('DSV41_SLOW')),
                    reason='compiling takes some forty seconds on a CPU: on a GPU or with DSV41_SLOW=1')
def test_fast_path_compiles_mhc_to_the_same_values_and_gradients():
    """Inside fast_path a block's mHC sides are compiled copies of mhc_in and hc_post: on a block's inputs they give the
    eager functions' outputs and gradients (to fp32 rounding), on the GPU when there is one"""
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.model import init_random, mhc_in
    from dsv41_nb.mhc import hc_post
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    m = init_random(ModelConfig.tiny(), 0).float().to(dev); blk, c = m.layers[2], m.cfg
    g = _gen(3)
    x = torch.randn(64, c.hc_mult, c.dim, generator=g).to(dev).requires_grad_()
    pre = torch.softmax(torch.randn(64, c.hc_mult, generator=g), -1).to(dev).requires_grad_()
    f = torch.randn(64, c.dim, generator=g).to(dev).requires_grad_()
    args = (blk.hc_attn_fn, blk.hc_attn_scale, blk.hc_attn_base, blk.attn_norm.weight, c.hc_mult,
            c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)
    def run(enter, out):
        y, nxt, post, comb = enter(x, pre, *args)
        z = out(f, x, post, comb)
        loss = (y * y.detach().sign()).sum() + nxt.sum() + (z * z.detach().sign()).sum()
        grads = torch.autograd.grad(loss, [x, pre, f, blk.hc_attn_fn, blk.attn_norm.weight])
        return [y, nxt, post, comb, z, *grads]
    ref = run(mhc_in, hc_post)
    with fast_path(m, compile=True):
        assert blk.hc_in is not mhc_in and blk.hc_out is not hc_post
        got = run(blk.hc_in, blk.hc_out)
    for a, b in zip(got, ref):      # sums in another order: fp32 rounding of the tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))

def _tiny_pieces(stops, tmp_path, **kw):
    """Six steps of the tiny DeepSeek model with expert dropout, in pieces ending at `stops`; each piece after the first
    in a fresh model of another seed, its state read back from a file"""
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.model import init_random
    from dsv41_nb.train_loop import TrainState
    data, st = _stream_data(), TrainState()
    kw = dict(steps=6, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, expert_dropout=0.2, device='cpu') | kw
    for k, stop in enumerate(stops):
        m = init_random(ModelConfig.tiny(), k)
        hist = train(m, data, stop=stop, state=st, **kw)
        st.save(tmp_path / 'state.pt'); st = TrainState.load(tmp_path / 'state.pt')
    return m, hist, st

def test_train_in_pieces_equals_one_run(tmp_path):
    """Pieces 0-3 (ends between evaluations), 3-4 (ends at one: the validation forwards' expert counts carry over),
    4-6 give the weights and history of one run 0-6, exactly on the CPU"""
    whole, hist, _ = _tiny_pieces([6], tmp_path)
    part, hist_parts, st = _tiny_pieces([3, 4, 6], tmp_path)
    assert {**hist_parts, 'seconds': None} == {**hist, 'seconds': None} and len(hist['val_loss']) == 3
    assert st.step == 6 and all(torch.equal(v, whole.state_dict()[k]) for k, v in part.state_dict().items())

def test_resume_refuses_other_settings(tmp_path):
    "A piece that goes on with another schedule, batch, seed or model is refused, naming what differs"
    from dsv41_nb.train_loop import TrainState
    _, _, st = _tiny_pieces([2], tmp_path)
    data, m = _stream_data(), DenseBaseline(512, 32, 1, 2, 64)
    kw = dict(steps=6, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, expert_dropout=0.2, device='cpu')
    for change, msg in [(dict(lr=1e-3), 'lr = 0.001'), (dict(steps=8), 'steps = 8'), (dict(seed=1), 'seed = 1'),
                        (dict(seq_len=32), 'seq_len = 32'), (dict(batch_size=4), 'batch_size = 4'),
                        ({}, "the state's weights do not fit the model")]:
        fct.test_fail(lambda: train(m, data, state=TrainState.load(tmp_path / 'state.pt'), **(kw | change)),
                      contains=msg)

def test_piece_bad_inputs(tmp_path):
    from dsv41_nb.train_loop import TrainState
    data, m = _stream_data(), DenseBaseline(512, 32, 1, 2, 64)
    kw = dict(steps=4, batch_size=2, seq_len=16, eval_every=2, eval_batches=1, device='cpu')
    torch.save({'weights': {}}, tmp_path / 'other.pt')
    cases = [
        (lambda: train(m, data, start=-1, **kw), 'start = -1'),
        (lambda: train(m, data, start=2, **kw), 'start = 2 needs the TrainState'),
        (lambda: train(m, data, start=2, state=TrainState(), **kw), 'the state stands at step 0'),
        (lambda: train(m, data, stop=5, state=TrainState(), **kw), 'stop = 5 is beyond steps = 4'),
        (lambda: train(m, data, stop=0, state=TrainState(), **kw), 'stop = 0'),
        (lambda: train(m, data, stop=2, **kw), 'needs a TrainState to keep'),
        (lambda: train(m, data, state={'step': 2}, **kw), 'state must be a TrainState, got dict'),
        (lambda: TrainState.load(tmp_path / 'other.pt'), 'holds no TrainState'),
        (lambda: TrainState.load(tmp_path / 'none.pt'), 'no file at'),
    ]
    for f, msg in cases: fct.test_fail(f, contains=msg)

def _train_small(monkeypatch):
    "tools/train_small.py as a module, its model the tiny config (the script's steps on the small one take minutes)"
    import importlib.util
    from dsv41_nb.config import ModelConfig
    spec = importlib.util.spec_from_file_location('train_small', Path(__file__).parents[1] / 'tools/train_small.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, 'small_config', ModelConfig.tiny)
    return mod

@pytest.mark.slow
def test_train_small_quick_in_pieces(monkeypatch, tmp_path):
    """--quick --baseline in three pieces (inside the MoE's run, inside the baseline's, the rest) ends where one run
    does; the record lists the pieces, the state files are gone; a resume with another setting is refused"""
    from dsv41_nb.train import write_corpus
    ts = _train_small(monkeypatch)
    g = _gen(0)
    words = ['def', 'return', 'the', 'list', 'of', 'keys', 'value', 'class', 'import', 'self']
    docs = [' '.join(words[i] for i in torch.randint(0, 10, (60,), generator=g).tolist()) for _ in range(60)]
    corpus = write_corpus(docs, tmp_path / 'corpus.json')
    args = ['--quick', '--baseline', '--corpus', str(corpus)]
    ts.main(args + ['--out', str(tmp_path / 'one')])
    ts.main(args + ['--out', str(tmp_path / 'two'), '--until-step', '4'])
    with pytest.raises(ts.SettingsMismatch, match='lr = 0.001 here'):
        ts.main(args + ['--resume', str(tmp_path / 'two'), '--lr', '1e-3'])
    ts.main(args + ['--resume', str(tmp_path / 'two'), '--until-step', '8'])
    ts.main(args + ['--resume', str(tmp_path / 'two')])
    one, two = (json.loads((tmp_path / d / 'training.json').read_text()) for d in ('one', 'two'))
    for k in ('moe', 'dense'):
        assert two['models'][k]['val_loss'] == one['models'][k]['val_loss']
        assert {**two['models'][k]['history'], 'seconds': 0} == {**one['models'][k]['history'], 'seconds': 0}
    assert [(p['start'], p['stop']) for p in two['pieces']] == [(0, 4), (4, 8), (8, 12)] and two['finished']
    assert not list((tmp_path / 'two').glob('*.pt'))

def test_train_small_split_seed(monkeypatch):
    """--split-seed names the held-out documents; a record from before it split by its --seed, and a resume of it
    with another split is refused"""
    ts = _train_small(monkeypatch)
    ts.check_resume({'seed': 0}, {'seed': 0, 'split_seed': 0}, 'old')         # split by seed 0: the same
    with pytest.raises(ts.SettingsMismatch, match='split_seed = 1 here'):
        ts.check_resume({'seed': 0}, {'seed': 0, 'split_seed': 1}, 'old')
    with pytest.raises(ts.SettingsMismatch, match='seed = 1 here'):
        ts.check_resume({'seed': 0, 'split_seed': 0}, {'seed': 1, 'split_seed': 0}, 'new')

def test_source_files_with_tests_needs_a_test_package(tmp_path):
    (tmp_path / 'json').mkdir(); (tmp_path / 'json' / 'a.py').write_text('x = 1\n')
    (tmp_path / 'test').mkdir(); (tmp_path / 'test' / 'test_a.py').write_text('y = 2\n')
    names = lambda fs: [f.relative_to(tmp_path).as_posix() for f in fs]
    assert names(source_files(tmp_path)) == ['json/a.py']
    assert names(source_files(tmp_path, tests=True)) == ['json/a.py', 'test/test_a.py']
    (tmp_path / 'test' / 'test_a.py').unlink(); (tmp_path / 'test').rmdir()
    # a Python without its test packages: refused, not a smaller corpus
    fct.test_fail(lambda: source_files(tmp_path, tests=True), contains='holds no test package')

def test_train_dspark_quick_keeps_the_checkpoint_shards(monkeypatch, tmp_path):
    """tools/train_dspark.py --write-checkpoint rewrites the checkpoint in shards of the size it had: the same
    files, every one in the index, and the model loads"""
    import importlib.util
    from dsv41_nb.config import ModelConfig
    from dsv41_nb.model import init_random
    from dsv41_nb.checkpoint_files import save_model, load_model
    ck = tmp_path / 'ck'
    save_model(init_random(ModelConfig.tiny(), seed=0, max_seq_len=4096), ck, 1 << 20)
    before = sorted(f.name for f in ck.glob('model-*.safetensors'))
    assert len(before) > 1
    spec = importlib.util.spec_from_file_location('train_dspark', Path(__file__).parents[1] / 'tools/train_dspark.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, 'argv', ['train_dspark.py', '--quick', '--checkpoint', str(ck), '--write-checkpoint'])
    mod.main()
    after = sorted(f.name for f in ck.glob('model-*.safetensors'))
    index = json.loads((ck / 'model.safetensors.index.json').read_text())
    assert after == before and set(index['weight_map'].values()) == set(after)
    assert (ck / 'dspark.safetensors').is_file()
    load_model(ck)
