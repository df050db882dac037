"""tools/bench_moe.py's peer: the MoE layer in PyTorch on BF16 weights (`torch._grouped_mm`), on the tiny layer."""
import dataclasses, importlib.util, sys
from pathlib import Path
import pytest, torch
from dsv41_nb.config import ModelConfig
from dsv41_nb.moe import MoEWeights, route, moe_experts_reference, fp8_qdq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))       # the tool imports its neighbour bench_engine
spec = importlib.util.spec_from_file_location('bench_moe', ROOT / 'tools' / 'bench_moe.py')
bm = importlib.util.module_from_spec(spec); spec.loader.exec_module(bm)


def _layer(T, seed=0):
    cfg = ModelConfig.tiny()
    W = MoEWeights.random(cfg, seed, 'cpu')
    x = torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    return cfg, W, x, route(x, W.gate, W.bias, cfg.n_activated_experts, cfg.route_scale)


@pytest.mark.parametrize('T', [1, 8, 40])
def test_the_peer_is_the_layer(T):
    "On the reference's FP8-rounded input and routing, within the rounding of its hidden activations"
    cfg, W, x, (tw, ti) = _layer(T)
    want = moe_experts_reference(x, tw, ti, W, cfg.swiglu_limit)
    xq = fp8_qdq(x).to(torch.bfloat16)
    assert bm.rel_err(bm.grouped_peer(cfg, W)(xq, (tw, ti)), want) < 0.04
    # routed itself it routes as `route` does: the same on an input it routes the same way
    assert torch.equal(bm.grouped_peer(cfg, W)(x), bm.grouped_peer(cfg, W)(x, (tw, ti)))


def test_the_peer_would_be_caught():
    "A peer that drops the shared expert, or swaps two experts' weights, is far outside the check's bound"
    cfg, W, x, (tw, ti) = _layer(40)
    want = moe_experts_reference(x, tw, ti, W, cfg.swiglu_limit)
    xq = fp8_qdq(x).to(torch.bfloat16)
    no_shared = dataclasses.replace(W, shared_w2=dataclasses.replace(
        W.shared_w2, codes=torch.zeros_like(W.shared_w2.codes)))
    assert bm.rel_err(bm.grouped_peer(cfg, no_shared)(xq, (tw, ti)), want) > 0.2
    swapped = dataclasses.replace(W, w2=dataclasses.replace(W.w2, codes=W.w2.codes.roll(1, 0)))
    assert bm.rel_err(bm.grouped_peer(cfg, swapped)(xq, (tw, ti)), want) > 0.2


@pytest.mark.slow
def test_peer_ab_checks_and_records(capsys):
    "Both layers checked against the reference loop, timed, and set against the served layer's floor"
    cfg = ModelConfig.tiny()
    rec = bm.peer_ab(cfg, [1, 6], 'cpu')
    assert [r['tokens'] for r in rec['rows']] == [1, 6] and rec['copy_TBps'] > 0
    for r in rec['rows']:
        assert r['err_peer'] < 0.05 and r['err_served'] < 0.05
        assert r['speedup'] == pytest.approx(r['peer_ms'] / r['served_ms'])
        assert r['of_floor'] == pytest.approx(r['floor_ms'] / r['served_ms'])
    assert capsys.readouterr().out.count('grouped_mm BF16') == 2
