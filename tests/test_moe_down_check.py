"""tools/moe_down_check.py on a small layer in the interpreter: the bound it applies and what it reports."""
import dataclasses, importlib.util, re
from pathlib import Path
import torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.moe import MoEWeights, route
from dsv41_nb.fused_moe import _fused_stages, expert_down_torch
from dsv41_nb.moe_planes import plane_gate_up

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('moe_down_check', ROOT / 'tools' / 'moe_down_check.py')
md = importlib.util.module_from_spec(spec); spec.loader.exec_module(md)


def test_a_chunk_left_out_is_found_and_named(capsys):
    cfg = dataclasses.replace(ModelConfig.tiny(), dim=128, moe_inter_dim=128)
    W = MoEWeights.random(cfg, 0, 'cpu')
    x = (3 * torch.randn(40, cfg.dim, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    tw, ti = route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)
    s = _fused_stages(x, tw, ti, W, cfg.swiglu_limit, gate_up=plane_gate_up(W, split=1, slots=True))
    h, al = s['h'], s['align']
    ref = expert_down_torch(h, W.w2, al)
    assert not md.beyond_bound(s['routed'], ref, h, W, al).any()
    e = al.block_expert.long()[(al.sorted_ids == 5).nonzero()[0, 0] // al.block_m].item()   # assignment 5's expert
    terms = (h[5].float() * W.w2.dequantize(e).float()[9]).view(-1, 64).sum(1)
    j = terms.abs().argmax().item()
    got = ref.clone(); got[5, 9] = (ref[5, 9].float() - terms[j]).to(torch.bfloat16)  # chunk j left out
    bad = md.beyond_bound(got, ref, h, W, al)
    assert bad.nonzero().tolist() == [[5, 9]]
    md.where(bad, al, W, h, got, ref)
    out = capsys.readouterr().out
    assert f'experts: [({e}, 1)]' in out
    assert re.search(rf'assignment 5, column 9, expert {e}: .* chunk {j} left out', out)


def test_the_script_runs_on_a_small_layer(capsys):
    md.main(['--device', 'cpu', '--seeds', '1'])
    out = capsys.readouterr().out
    assert 'seed 1, 40 tokens: 0 of 10240 beyond the bound' in out
    assert out.count('launch shape') == 4 and out.count('0 beyond; 0 of 2 launches differ from the first') == 4


def test_repeats_counts_the_launches_that_differ_from_the_first():
    a, b = torch.zeros(3), torch.tensor([0.0, 0.0, 1e-30])
    outs = iter([a, a, b, a, b.clone()])
    k, other, first = md.repeats(lambda: next(outs), 4)
    assert (k, first is a, other is b) == (2, True, True)
    assert md.repeats(lambda: a.clone(), 5)[:2] == (0, None)
