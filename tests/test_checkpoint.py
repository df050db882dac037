"""Checkpoints: the FP8/FP4 weight codecs against an independent encoder, save -> load round trips,
a public-layout checkpoint, streaming memory, and every error"""
import json, re, shutil, subprocess, sys
from dataclasses import replace
from pathlib import Path
import pytest
import torch
import torch.nn.functional as F
import fastcore.test as fct
from hypothesis import given, strategies as st
from safetensors.torch import save_file, load_file
from dsv41_nb.config import ModelConfig
from dsv41_nb.accounting import checkpoint_manifest
from dsv41_nb.checkpoint import (load_config, save_config, quantize_weight, dequantize_weight, quantize_state,
                                 dequantize_state, random_state, master_specs, stored_shape, STORAGE_DTYPES,
                                 INDEX_NAME, CONFIG_NAME, CheckpointError, _specs)
from dsv41_nb.checkpoint_files import (save_state, save_model, load_state, load_weights, load_model,
                                       module_from_state, shard_plan, shard_name, weight_map, shard_header,
                                       bytes_by_group, peak_memory_during, check_checkpoint)

TINY = ModelConfig.tiny()
PUBLIC = Path(__file__).resolve().parent.parent / 'nbs' / 'reference' / 'deepseek_v41_config.json'
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

def same(a, b):
    "Bit-identical tensors of any dtype (1-byte dtypes compared as bytes)"
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.element_size() == 1: a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b)

# ---- an independent encoder: block amax, 2^ceil(log2 .) by frexp, torch's own E4M3 cast, E2M1 by nearest grid point

def pow2_ceil(x):
    "2^ceil(log2 x) for positive fp32 x, from frexp (x = m 2^e, m in [0.5, 1))"
    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))

def fp8_oracle(w, tile):
    "(E4M3 codes (R, C), scales (R/tile, C/32) fp32): one scale per tile x 32 block"
    R, C = w.shape
    blocks = F.pad(w.float(), (0, -C % 32, 0, -R % tile)).unflatten(0, (-1, tile)).unflatten(-1, (-1, 32))
    s = pow2_ceil(blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32))
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)     # (Rb, tile, Cb, 32)
    return q.flatten(2).flatten(0, 1)[:R, :C], s

def fp4_oracle(w):
    "(4-bit codes (R, C), scales (R, C/32) fp32): nearest E2M1 point, ties to the even code, sign bit from signbit"
    g = w.float().unflatten(-1, (-1, 32))
    s = pow2_ceil(g.abs().amax(-1).clamp_min(6 * 2.0 ** -126) * torch.tensor(1 / 6, dtype=torch.float32))
    v = (g / s[..., None]).clamp(-6, 6).flatten(-2)
    d = (v.abs()[..., None] - E2M1).abs()
    i = d.argmin(-1)                                                   # the lower index on a tie
    nxt = d.gather(-1, (i + 1).clamp(max=7)[..., None])[..., 0]
    i = torch.where((i % 2 == 1) & (i < 7) & (nxt == d.gather(-1, i[..., None])[..., 0]), i + 1, i)
    return i.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3), s

def decode_fp4(packed_bytes):
    "Packed bytes (R, C/2) -> values (R, C): low nibble first, bit 3 the sign"
    b = packed_bytes.view(torch.uint8).long()
    table = torch.cat([E2M1, -E2M1])
    return torch.stack([table[b & 15], table[b >> 4]], -1).flatten(-2)

@st.composite
def weights(draw, cols_multiple=1):
    "A weight of awkward shape: rows of very different magnitudes, some exact zeros, some tiny rows"
    R = draw(st.integers(1, 80))
    C = draw(st.integers(1, 5)) * 32 if cols_multiple == 32 else draw(st.integers(1, 100))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(R, C, generator=g) * 10.0 ** torch.randint(-8, 6, (R, 1), generator=g).float()
    w[torch.rand(R, C, generator=g) < 0.05] = 0
    return w.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))

@given(weights(), st.sampled_from([32, 1]))
def test_fp8_matches_oracle(w, tile):
    q, s = quantize_weight(w, 'fp8', tile)
    oq, os_ = fp8_oracle(w, tile)
    same(q, oq)
    assert s.dtype == torch.float8_e8m0fnu and torch.equal(s.float(), os_)

@given(weights(cols_multiple=32))
def test_fp4_matches_oracle(w):
    q, s = quantize_weight(w, 'fp4')
    codes, os_ = fp4_oracle(w)
    assert q.dtype == torch.float4_e2m1fn_x2 and tuple(q.shape) == (w.shape[0], w.shape[1] // 2)
    assert torch.equal(q.view(torch.uint8), codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert torch.equal(s.float(), os_)

@given(weights(cols_multiple=32), st.sampled_from([('fp8', 32), ('fp8', 1), ('fp4', 32)]))
def test_dequantize_exact_and_fixed_point(w, kind_tile):
    kind, tile = kind_tile
    q, s = quantize_weight(w, kind, tile)
    v = dequantize_weight(q, s, tile)
    scale = s.float().repeat_interleave(tile if kind == 'fp8' else 1, 0)[:w.shape[0]].repeat_interleave(32, 1)
    want = (q.float() if kind == 'fp8' else decode_fp4(q)) * scale        # independent decoding
    assert torch.equal(v, want)
    assert torch.equal(v.bfloat16().float(), v)                          # exact in bf16
    assert torch.equal(dequantize_weight(*quantize_weight(v.bfloat16(), kind, tile), tile), v)   # a fixed point

def test_config_files(tmp_path):
    assert load_config(PUBLIC) == ModelConfig.full()
    for c in (TINY, ModelConfig.bench()):
        assert load_config(save_config(c, tmp_path / 'c')) == c and load_config(tmp_path / 'c') == c
    public = json.loads(PUBLIC.read_text())
    p = tmp_path / 'x.json'
    for text, msg in [(json.dumps({k: v for k, v in public.items() if k != 'dim'}), 'missing fields dim'),
                      (json.dumps(public | {'gate_temp': 1.0}), 'unknown fields gate_temp'),
                      (json.dumps(public | {'dim': 100}), 'dim = 100 is not a multiple of 32'),
                      ('{"dim": ', 'not valid JSON'), ('[1, 2]', 'expected a JSON object, got list')]:
        p.write_text(text)
        fct.test_fail(lambda: load_config(p), contains=msg)
    fct.test_fail(lambda: load_config(tmp_path / 'nothing'), contains='no config.json')

@pytest.fixture(scope='module')
def tiny_state(): return random_state(TINY, seed=3)

def test_a_save_over_a_checkpoint_leaves_only_its_own_shards(tmp_path, tiny_state):
    """Saved again with other shards (or over a single-file checkpoint, or over a broken index): the old weight files
    go once the new index is written, the directory's other files stay, and the checkpoint loads"""
    d = save_state(tiny_state, TINY, tmp_path, shard_bytes=100_000)
    (d / 'dspark.safetensors').write_bytes(b'x'); (d / 'training.json').write_text('{}')
    many = set(json.loads((d / INDEX_NAME).read_text())['weight_map'].values())
    save_state(tiny_state, TINY, d, shard_bytes=1 << 30)
    assert sorted(p.name for p in d.iterdir()) == [CONFIG_NAME, 'dspark.safetensors', shard_name(0, 1),
                                                  INDEX_NAME, 'training.json'] and len(many) > 1
    save_file({'w': torch.zeros(1)}, d / 'model.safetensors')               # an old single-file checkpoint
    save_state(tiny_state, TINY, d, shard_bytes=100_000)
    names = {p.name for p in d.iterdir()}
    assert 'model.safetensors' not in names and shard_name(0, 1) not in names and many <= names
    (d / INDEX_NAME).write_text('not json')                                  # a broken index: nothing removed
    save_state(tiny_state, TINY, d, shard_bytes=100_000)
    assert {p.name for p in d.iterdir()} == names
    raw, want = load_state(d), quantize_state(tiny_state, TINY)
    for k in want: same(raw[k], want[k])

@pytest.mark.parametrize('shard_bytes', [1, 100_000, 1 << 30])
def test_round_trip(tmp_path, tiny_state, shard_bytes):
    "save -> load_state is bit-identical to quantize_state; load_weights equals dequantize_state, for any sharding"
    d = save_state(tiny_state, TINY, tmp_path, shard_bytes=shard_bytes)
    ckpt, raw = quantize_state(tiny_state, TINY), load_state(d)
    assert list(raw) == [s.name for s in checkpoint_manifest(TINY)]
    for k in ckpt: same(raw[k], ckpt[k])
    index = json.loads((d / INDEX_NAME).read_text())
    n = len(shard_plan(TINY, shard_bytes))
    assert sorted(set(index['weight_map'].values())) == [shard_name(i, n) for i in range(n)]
    assert index['metadata']['total_size'] == sum(t.nbytes for t in ckpt.values())
    assert bytes_by_group(d) == {g: sum(s.nbytes for s in checkpoint_manifest(TINY) if s.group == g)
                                 for g in bytes_by_group(d)}
    master = dequantize_state(ckpt, TINY)
    chunk = 1 if shard_bytes == 100_000 else 8 << 20                      # 1: a slab of 32 rows at a time
    loaded = load_weights({k: torch.full_like(v, float('nan')) for k, v in tiny_state.items()}, d, chunk_bytes=chunk)
    for k in master: same(loaded[k], master[k])
    if shard_bytes == 100_000:
        again = dequantize_state(quantize_state(master, TINY), TINY)     # save -> load -> save: the same weights
        for k in master: same(again[k], master[k])

def public_checkpoint(directory, fp4_raw: bool, scale_raw: bool, seed=0):
    "Tensors with the public names and dtypes drawn directly in storage form, written by safetensors itself"
    g, out = torch.Generator().manual_seed(seed), {}
    for s in checkpoint_manifest(TINY):
        shape = stored_shape(s)
        if s.dtype == 'fp8':
            b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
            b[(b & 0x7F) == 0x7F] = 0                                       # not the NaN codes
            out[s.name] = b.view(torch.float8_e4m3fn)
        elif s.dtype == 'fp4':
            b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
            out[s.name] = b if fp4_raw else b.view(torch.float4_e2m1fn_x2)
        elif s.dtype == 'e8m0':
            b = torch.randint(110, 140, shape, generator=g, dtype=torch.int32).to(torch.uint8)
            out[s.name] = b if scale_raw else b.view(torch.float8_e8m0fnu)
        else: out[s.name] = torch.randn(shape, generator=g).to(STORAGE_DTYPES[s.dtype])
    save_config(TINY, directory)
    save_file(out, Path(directory) / 'model.safetensors')                  # one file, no index
    return out

@pytest.mark.parametrize('fp4_raw,scale_raw', [(False, False), (True, True)])
def test_public_layout_loads(tmp_path, tiny_state, fp4_raw, scale_raw):
    ck = public_checkpoint(tmp_path, fp4_raw, scale_raw)
    assert set(weight_map(tmp_path).values()) == {'model.safetensors'}
    loaded = load_weights({k: torch.zeros_like(v) for k, v in tiny_state.items()}, tmp_path)
    specs = {s.name: s for s in checkpoint_manifest(TINY)}
    for k, v in loaded.items():
        spec, sc = specs[k], specs.get(k[:-len('weight')] + 'scale')
        if sc is None or not k.endswith('.weight'): assert torch.equal(v, ck[k].to(v.dtype)); continue
        pow2 = torch.exp2(ck[sc.name].view(torch.uint8).double() - 127)
        rows = 32 if spec.dtype == 'fp8' and sc.shape[0] != spec.shape[0] else 1
        pow2 = pow2.repeat_interleave(rows, 0)[:spec.shape[0]].repeat_interleave(32, 1)
        vals = ck[k].double() if spec.dtype == 'fp8' else decode_fp4(ck[k]).double()
        assert torch.equal(v.double(), vals * pow2), k
    raw = load_state(tmp_path)
    for k in ck: same(raw[k].view(torch.uint8) if raw[k].element_size() == 1 else raw[k],
                      ck[k].view(torch.uint8) if ck[k].element_size() == 1 else ck[k])

def test_errors(tmp_path, tiny_state):
    "A broken checkpoint is refused before anything is written, with a message naming the file and the tensor"
    good = save_state(tiny_state, TINY, tmp_path / 'good', shard_bytes=200_000)
    n = len(list(good.glob('*.safetensors')))
    w, s = 'layers.4.attn.wo_b.weight', 'layers.4.attn.wo_b.scale'
    def shard_of(d, name): return d / weight_map(d)[name]
    def edit_tensors(d, name, f):
        p = shard_of(d, name); t = load_file(p); f(t); save_file(t, p)
    def edit_index(d, f):
        ix = json.loads((d / INDEX_NAME).read_text()); f(ix['weight_map']); (d / INDEX_NAME).write_text(json.dumps(ix))
    cases = [
        (lambda d: (edit_tensors(d, s, lambda t: t.pop(s)), edit_index(d, lambda m: m.pop(s))), f'missing tensors {s}'),
        (lambda d: (edit_tensors(d, w, lambda t: t.update(extra=torch.ones(2))),
                    edit_index(d, lambda m: m.update(extra=m[w]))),
         'unexpected tensors extra'),
        (lambda d: edit_tensors(d, w, lambda t: t.update({w: t[w].bfloat16()})), f'{w} is BF16, expected F8_E4M3'),
        (lambda d: edit_tensors(d, s, lambda t: t.update({s: t[s][:1]})), f'{s} has shape (1, 2), expected (2, 2)'),
        (lambda d: edit_tensors(d, 'embed.weight', lambda t: t.update({'embed.weight': t['embed.weight'].float()})),
         'embed.weight is F32, expected BF16'),
        (lambda d: save_config(replace(TINY, n_layers=10, compress_ratios=TINY.compress_ratios[:10] + (0, 0, 0),
                                       index_source_layers=(2, 4, 6, 8), dspark_target_layer_ids=(7, 8, 9)), d),
         'unexpected tensors layers.10.'),
        (lambda d: save_config(replace(TINY, vocab_size=1024, dspark_noise_token_id=1000, image_token_id=1001), d),
         'embed.weight has shape (512, 64), expected (1024, 64)'),
        (lambda d: shard_of(d, w).write_bytes(shard_of(d, w).read_bytes()[:-8]), 'not a readable safetensors file'),
        (lambda d: shard_of(d, w).write_bytes(b'garbage'), f'{weight_map(good)[w]}: not a readable safetensors file'),
        (lambda d: shard_of(d, w).unlink(), 'names shard files that do not exist'),
        (lambda d: edit_index(d, lambda m: m.update({w: shard_name(0, n) if m[w] != shard_name(0, n)
                                                        else shard_name(1, n)})),
         f'places {w} in'),
        (lambda d: (d / INDEX_NAME).write_text('{"weights": {}}'), 'not a safetensors index with a weight_map'),
        (lambda d: [p.unlink() for p in d.glob('model*')],
         'neither model.safetensors.index.json nor model.safetensors'),
        (lambda d: (d / CONFIG_NAME).unlink(), 'no config.json'),
    ]
    for i, (edit, msg) in enumerate(cases):
        d = tmp_path / f'case{i}'
        shutil.copytree(good, d); edit(d)
        dest = {k: torch.zeros_like(v) for k, v in tiny_state.items()}
        fct.test_fail(lambda: load_weights(dest, d), contains=msg)
        assert not any(v.any() for v in dest.values()), msg
    bad_inputs = [
        (lambda: save_state({**tiny_state, 'embed.weight': torch.ones(512, 63)}, TINY, tmp_path / 'x'),
         'embed.weight has shape (512, 63), expected (512, 64)'),
        (lambda: save_state({**tiny_state, 'extra.weight': torch.ones(1)}, TINY, tmp_path / 'x'),
         'unexpected tensors extra.weight'),
        (lambda: quantize_state({**tiny_state, w: torch.full((64, 64), float('inf'))}, TINY),
         f'{w} holds NaN or infinite'),
        (lambda: quantize_state([], TINY), 'expected a dict of tensors, got list'),
        (lambda: dequantize_state({}, TINY), 'missing tensors embed.weight'),
        (lambda: quantize_weight(torch.ones(2, 32, dtype=torch.int64), 'fp8'), 'expected a 2-D floating-point tensor'),
        (lambda: quantize_weight(torch.ones(2, 33), 'fp4'), 'not a multiple of the block 32'),
        (lambda: load_weights(module_from_state({'embed.weight': torch.zeros(512, 64)}), good),
         'missing tensors head.weight'),
        (lambda: load_weights({k: v for k, v in tiny_state.items()}, good, chunk_bytes=0), 'chunk_bytes = 0'),
        (lambda: save_model(torch.nn.Linear(2, 2), tmp_path / 'x'), 'has no ModelConfig `cfg`'),
        (lambda: save_model(tiny_state, tmp_path / 'x'), 'expected an nn.Module, got dict'),
        (lambda: shard_plan(TINY, 0), 'shard_bytes = 0'),
        (lambda: quantize_weight([[1.0] * 32], 'fp8'), 'expected a 2-D floating-point tensor, got list'),
        (lambda: save_state({**tiny_state, 'norm.weight': [1.0] * 64}, TINY, tmp_path / 'x'),
         'save_state: norm.weight must be a floating-point tensor, got list'),
    ]
    for f, msg in bad_inputs: fct.test_fail(f, contains=msg)

def test_random_gains_are_near_one(tiny_state):
    "RMSNorm and Engram gains start near 1, every other matrix at a fan-in scale"
    gains = [k for k in tiny_state if k.endswith('norm.weight') or k.endswith('_weight')]
    assert gains and all((tiny_state[k].float() - 1).abs().max() < 0.6 for k in gains)
    w = tiny_state['layers.4.attn.wo_b.weight'].float()
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1) < 0.1


def test_a_shard_closes_only_past_its_size():
    "A shard that the first k tensors fill exactly holds those k"
    sizes = [s.nbytes + (_specs(TINY)[1][k].nbytes if k in _specs(TINY)[1] else 0)
             for k, s in master_specs(TINY).items()]
    for k in (1, 2, 5):
        assert len(shard_plan(TINY, sum(sizes[:k]))[0]) >= k
        assert len(shard_plan(TINY, sum(sizes[:k]) - 1)[0]) == max(1, k - 1)


def test_a_save_never_removes_files_outside_its_directory(tmp_path, tiny_state):
    d, outside = tmp_path / 'ck', tmp_path / 'outside.safetensors'
    d.mkdir(); outside.write_bytes(b'keep')
    (d / INDEX_NAME).write_text(json.dumps({'weight_map': {'x': '../outside.safetensors', 'y': 3}}))
    save_state(tiny_state, TINY, d, shard_bytes=200_000)
    assert outside.read_bytes() == b'keep'


def test_check_checkpoint_with_the_config_given(tmp_path, tiny_state):
    d = save_state(tiny_state, TINY, tmp_path / 'ck', shard_bytes=200_000)
    (d / CONFIG_NAME).unlink()
    assert set(check_checkpoint(d, TINY)) == set(weight_map(d))
    fct.test_fail(lambda: check_checkpoint(d), contains='no config.json')


@pytest.mark.parametrize('name,value,named', [
    ('norm.weight', float('nan'), 'norm.weight'),                                   # BF16
    ('layers.0.hc_attn_base', float('-inf'), 'layers.0.hc_attn_base'),            # FP32
    ('layers.4.attn.wo_b.weight', 0x7F, 'layers.4.attn.wo_b.weight'),            # an E4M3 NaN code
    ('layers.4.attn.wo_b.scale', 0xFF, 'layers.4.attn.wo_b.weight'),             # the UE8M0 NaN
    ('layers.4.attn.wo_b.scale', 0xFE, 'layers.4.attn.wo_b.weight'),             # 2^127: the values overflow
    ('layers.2.ffn.experts.0.w1.scale', 0xFF, 'layers.2.ffn.experts.0.w1.weight')])   # an FP4 weight's scale
def test_non_finite_values_are_refused(tmp_path, tiny_state, name, value, named):
    "A NaN or infinity in a stored value or scale is refused on load, by name (else greedy decoding prints token 0)"
    d = save_state(tiny_state, TINY, tmp_path / 'ck', shard_bytes=200_000)
    p = d / weight_map(d)[name]; t = load_file(p)
    x = t[name].clone(); (x.view(torch.uint8) if x.element_size() == 1 else x).view(-1)[0] = value
    t[name] = x; save_file(t, p)
    fct.test_fail(lambda: load_weights({k: torch.zeros_like(v) for k, v in tiny_state.items()}, d),
                  contains=f'{named} holds NaN or infinite values', exc=CheckpointError)
    fct.test_fail(lambda: load_model(d), contains=f'{p}: {named} holds NaN')
    fct.test_fail(lambda: dequantize_state(load_state(d), TINY), contains=f'{named} holds NaN')

def test_non_finite_master_weights_are_not_saved(tmp_path, tiny_state):
    bad = {**tiny_state, 'norm.weight': torch.full_like(tiny_state['norm.weight'], float('nan'))}
    fct.test_fail(lambda: save_state(bad, TINY, tmp_path), contains='norm.weight holds NaN or infinite values')

_STREAMING_PROBE = """
import json, sys, torch
from dataclasses import replace
from dsv41_nb.config import ModelConfig
from dsv41_nb.checkpoint import random_state
from dsv41_nb.checkpoint_files import load_weights, peak_memory_during, save_state
cfg = replace(ModelConfig.tiny(), engram_num_embeddings=(1 << 18, 1 << 18))
state = random_state(cfg, seed=5)
d = save_state(state, cfg, sys.argv[1], shard_bytes=8 << 20)
warm = {k: torch.zeros_like(v) for k, v in state.items()}
load_weights(warm, d, chunk_bytes=1 << 20)   # lazy initialisation happens here, not in the measurement
del warm
target = {k: torch.zeros_like(v) for k, v in state.items()}
_, extra = peak_memory_during(lambda: load_weights(target, d, chunk_bytes=1 << 20))
torch.save({k: target[k] for k in sys.argv[2:]}, sys.argv[1] + '/loaded.pt')
print(json.dumps(dict(extra=extra, model_bytes=sum(t.nbytes for t in state.values()))))
"""

def test_streaming_memory(tmp_path):
    "Loading holds a slab, not a second copy: the peak above the filled model stays under a quarter of it"
    if not Path('/proc/self/clear_refs').exists(): pytest.skip('peak memory is read from /proc (Linux)')
    # a fresh process: the peak of a long test run's process also holds what earlier tests left to its allocator
    keys = ['layers.1.engram.embed.weight', 'layers.4.engram.embed.weight']
    out = subprocess.run([sys.executable, '-c', _STREAMING_PROBE, str(tmp_path), *keys],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r['extra'] < r['model_bytes'] / 4, r
    loaded = torch.load(tmp_path / 'loaded.pt')
    state = random_state(replace(TINY, engram_num_embeddings=(1 << 18, 1 << 18)), seed=5)
    for k in keys:
        want = dequantize_weight(*quantize_weight(state[k], 'fp8', tile=1), tile=1).bfloat16()
        assert torch.equal(loaded[k], want)

def test_model_round_trip(tmp_path):
    "A Transformer saved and loaded gives the same weights and the same logits"
    model_mod = pytest.importorskip('dsv41_nb.model')
    m = model_mod.init_random(TINY, seed=0)
    m.load_state_dict(dequantize_state(quantize_state(m.state_dict(), TINY), TINY))   # weights the checkpoint can hold
    save_model(m, tmp_path, shard_bytes=1 << 20)
    m2 = load_model(tmp_path)
    for k, v in m.state_dict().items(): same(m2.state_dict()[k], v)
    ids = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(): assert torch.equal(m(ids), m2(ids))
