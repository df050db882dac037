"""tools/gpu_record.py: the GPU tier's record sums pytest's JUnit XML per test file."""
import importlib.util, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('gpu_record', ROOT / 'tools' / 'gpu_record.py')
gpu_record = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpu_record)

XML = """<testsuites><testsuite>
<testcase classname="tests.test_engine" name="test_a" time="1.5"/>
<testcase classname="tests.test_engine" name="test_b" time="0.5"><failure message="x"/></testcase>
<testcase classname="tests.test_dspark.TestDSparkScheduler" name="test_c" time="2"/>
<testcase classname="tests.test_dspark" name="test_d" time="1"><skipped/></testcase>
<testcase classname="" name="tests.test_server" time="0"><skipped/></testcase>
</testsuite></testsuites>"""


def test_cases_are_summed_per_file(tmp_path):
    (tmp_path / 'j.xml').write_text(XML)
    files, failed = gpu_record.summarise(tmp_path / 'j.xml')
    assert files == {'(skipped at collection)': dict(passed=0, failed=0, skipped=1, seconds=0.0),
                     'test_dspark.py': dict(passed=1, failed=0, skipped=1, seconds=3.0),
                     'test_engine.py': dict(passed=1, failed=1, skipped=0, seconds=2.0)}
    assert failed == ['tests.test_engine::test_b']


def test_reports_of_several_phases_are_summed(tmp_path):
    (tmp_path / 'a.xml').write_text(XML)
    (tmp_path / 'b.xml').write_text('<testsuite><testcase classname="tests.test_engine" name="test_e" '
                                    'time="4"/></testsuite>')
    files, failed = gpu_record.summarise(tmp_path / 'a.xml', tmp_path / 'b.xml')
    assert files['test_engine.py'] == dict(passed=2, failed=1, skipped=0, seconds=6.0)
    assert failed == ['tests.test_engine::test_b']


def test_no_report_is_named():
    import pytest
    with pytest.raises(ValueError, match='at least one'): gpu_record.summarise()


def test_dated_by_the_first_report(tmp_path):
    (tmp_path / 'a.xml').write_text('<testsuites><testsuite timestamp="2026-12-05T14:22:29.5+00:00"/></testsuites>')
    (tmp_path / 'b.xml').write_text('<testsuites><testsuite timestamp="2026-12-05T14:31:02+00:00"/></testsuites>')
    assert gpu_record.started(tmp_path / 'b.xml', tmp_path / 'a.xml') == '2026-12-05 14:22 UTC'
    (tmp_path / 'c.xml').write_text(XML)
    assert gpu_record.started(tmp_path / 'c.xml') is None


def test_each_phase_keeps_its_time(tmp_path):
    "suite_seconds: a report's test suites' own time, summed; None for a report that has none"
    (tmp_path / 'a.xml').write_text('<testsuites><testsuite time="234.42"/><testsuite time="1.5"/></testsuites>')
    assert gpu_record.suite_seconds(tmp_path / 'a.xml') == 235.92
    (tmp_path / 'c.xml').write_text(XML)
    assert gpu_record.suite_seconds(tmp_path / 'c.xml') is None


def test_a_test_the_phase_was_stopped_in_is_named(tmp_path):
    "not_finished: collected ids no report holds, classes and parameters included, in collection order"
    (tmp_path / 'j.xml').write_text(XML)
    ids = ['tests/test_engine.py::test_a', 'tests/test_dspark.py::TestDSparkScheduler::test_c',
           'tests/test_server.py::test_dp_serve[2]', 'tests/test_engine.py::test_b', 'tests/test_engine.py::test_f']
    (tmp_path / 'ids.txt').write_text('\n'.join(ids) + '\n\n5 tests collected in 1.2s\n')
    assert gpu_record.not_finished([tmp_path / 'ids.txt'], tmp_path / 'j.xml') == [
        'tests/test_server.py::test_dp_serve[2]', 'tests/test_engine.py::test_f']
    assert gpu_record.not_finished([], tmp_path / 'j.xml') == []
