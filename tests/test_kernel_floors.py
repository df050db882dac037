"""tools/kernel_floors.py: the kernels' records of one run read back against their goals, a record of another run
refused, and a part that fails or runs out of time named instead of read."""
import importlib.util, json, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
spec = importlib.util.spec_from_file_location('kernel_floors', ROOT / 'tools' / 'kernel_floors.py')
kf = importlib.util.module_from_spec(spec); spec.loader.exec_module(kf)

RUN = dict(machine='GPU X', commit='abc1234')


def records():
    "One run's records, as the benchmarks write them (only the fields read back)"
    return {
        'moe': dict(device='GPU X', commit='abc1234', rows=[
            dict(tokens=1, of_floor=0.2, peer_of_floor=0.05), dict(tokens=64, of_floor=0.61, peer_of_floor=0.3),
            dict(tokens=2048, of_floor=0.7, peer_of_floor=0.6), dict(tokens=8192, of_floor=0.1, peer_of_floor=0.9)]),
        'layer': dict(**RUN, mhc=[dict(tokens=1, version=2, of_floor=0.05), dict(tokens=1, version=1, of_floor=0.9),
                                  dict(tokens=8192, version=2, of_floor=0.5), dict(tokens=64, version=2, error='x')],
                      copy=[dict(kernel='mhc seam', size=1, of_floor=0.3),
                            dict(kernel='sparse decode', size=1, of_floor=0.1)],
                      compressor=[dict(batch=64, version=2, ratio=2, graph_us=10.0, launches=1),
                                  dict(batch=64, version=2, ratio=1, graph_us=12.0, launches=1),
                                  dict(batch=64, version=1, ratio=2, graph_us=90.0, launches=5)]),
        'sparse': dict(device='GPU X', commit='abc1234', rows=[
            dict(batch=1, of_floor=0.01), dict(batch=16, of_floor=0.06), dict(batch=64, of_floor=0.13),
            dict(batch=64, of_floor=0.15), dict(batch=256, of_floor=0.19)]),
        'indexer': dict(device='GPU X', commit='abc1234', full_scan=[
            dict(context=8192, of_floor=0.1), dict(context=131072, of_floor=0.45),
            dict(context=524288, of_floor=0.41)]),
    }


def write(out: Path, recs: dict):
    for part, rec in recs.items(): (out / kf.PARTS[part][2]).write_text(json.dumps(rec))


def test_goals_judged_over_the_sizes_they_apply_to():
    "Each goal's least fraction over its sizes only; the faster sparse launch at a batch; mHC's served version only"
    goals = {g['goal']: g for g in kf.judge(records())}
    moe = goals['fused MoE']
    assert moe['sizes'] == [64, 2048] and moe['least'] == 0.61 and moe['met'] is True
    assert goals['mHC seam']['sizes'] == [1, 8192] and goals['mHC seam']['met'] is False
    sd = goals['sparse decode, batch']
    assert sd['sizes'] == [64, 256] and sd['of_floor'] == [0.15, 0.19] and sd['met'] is False
    assert goals['sparse decode, small batch']['least'] == 0.01
    assert goals['indexer full scan']['least'] == 0.41 and goals['indexer full scan']['met'] is True
    cp = goals['compressor decode step, 64 requests']
    assert (cp['us'], cp['launches'], cp['met']) == (12.0, 1, True)
    cs = kf.curves(records())
    assert cs['moe peer'][-1] == (8192, 0.9) and cs['mhc copy'] == [(1, 0.3)] and cs['sparse copy'] == [(1, 0.1)]


def test_a_part_not_measured_is_none_not_false():
    recs = records(); del recs['indexer']; recs['layer']['compressor'] = []
    goals = {g['goal']: g for g in kf.judge(recs)}
    assert goals['indexer full scan']['met'] is None and goals['indexer full scan']['least'] is None
    assert goals['compressor decode step, 64 requests']['met'] is None


def test_records_of_another_run_are_refused(tmp_path):
    recs = records(); recs['sparse']['commit'] = 'fff0000'
    write(tmp_path, recs)
    with pytest.raises(ValueError, match=r'not one run: .*sparse: GPU X, commit fff0000'):
        kf.summarize(tmp_path, list(kf.PARTS))
    recs['sparse']['commit'] = 'abc1234'; recs['moe']['device'] = 'GPU Y'
    write(tmp_path, recs)
    with pytest.raises(ValueError, match='moe: GPU Y'): kf.summarize(tmp_path, list(kf.PARTS))


def test_summary_written_and_printed(tmp_path):
    write(tmp_path, records())
    s = kf.summarize(tmp_path, list(kf.PARTS))
    assert (s['machine'], s['commit'], s['failed']) == ('GPU X', 'abc1234', {})
    assert json.loads((tmp_path / 'kernel_floors.json').read_text())['goals'] == json.loads(json.dumps(s['goals']))
    text = kf.table(s)
    assert 'GPU X, commit abc1234' in text and '64: 61%, 2,048: 70%   goal 60%, met: True' in text
    assert '12.0 us in 1 launches' in text and 'moe peer' in text


def test_each_part_runs_its_benchmark_and_failures_are_named(tmp_path, monkeypatch, capsys):
    "Every part's child gets the run's commit; one that fails and one that times out are named, the rest read"
    seen = []
    def run(cmd, env, timeout, cwd, capture_output, text):
        seen.append((Path(cmd[1]).name, env['DSV41_COMMIT'], timeout))
        part = next(p for p, v in kf.PARTS.items() if v[0] == Path(cmd[1]).name)
        if part == 'indexer': raise subprocess.TimeoutExpired(cmd, timeout)
        if part != 'sparse': write(tmp_path, {part: records()[part]})
        return subprocess.CompletedProcess(cmd, 3 if part == 'sparse' else 0, 'out', 'err')
    monkeypatch.setattr(kf.subprocess, 'run', run)
    monkeypatch.setenv('DSV41_COMMIT', 'abc1234')
    kf.main([str(tmp_path), '--limit-s', '100'])
    assert [s[0] for s in seen] == ['bench_moe.py', 'bench_layer_kernels.py', 'bench_sparse_decode.py',
                                    'bench_indexer.py']
    assert {s[1] for s in seen} == {'abc1234'} and [s[2] for s in seen] == [30.0, 25.0, 25.0, 20.0]
    s = json.loads((tmp_path / 'kernel_floors.json').read_text())
    assert s['failed'] == {'sparse': 'exit status 3 (see sparse.log)',
                           'indexer': 'stopped after 20 s, its share of --limit-s'}
    goals = {g['goal']: g['met'] for g in s['goals']}
    assert goals['fused MoE'] is True and goals['sparse decode, batch'] is None
    assert 'sparse: exit status 3' in capsys.readouterr().out


@pytest.mark.parametrize('call, words', [
    (lambda: kf.command('scan', Path('.'), False), "unknown part 'scan'"),
    (lambda: kf.main(['x', '--limit-s', '0']), None),
])
def test_bad_inputs(call, words):
    if words is None:
        with pytest.raises(SystemExit): call()
    else:
        with pytest.raises(ValueError, match=words): call()


def test_commands_point_at_the_part_records(tmp_path):
    "Each part's command writes the record the summary reads; --quick reaches every benchmark"
    for part, (script, _, record, _) in kf.PARTS.items():
        cmd = kf.command(part, tmp_path, quick=True)
        assert Path(cmd[1]).name == script and cmd[-1] == '--quick' and (ROOT / 'tools' / script).exists()
        assert (str(tmp_path / record) in cmd) or (part == 'layer' and str(tmp_path) in cmd)
