"""tools/warm_up_keys.py's parts that run in a moment: where a new specialization differs from the nearest one the
build met, and the arguments it refuses (the whole run takes minutes in the interpreter; its record is in records/)."""
import os, subprocess, sys
from pathlib import Path
import pytest

TOOLS = Path(__file__).resolve().parent.parent / 'tools'


@pytest.fixture(scope='module')
def tool():
    before = os.environ.get('TRITON_INTERPRET')
    sys.path.insert(0, str(TOOLS))
    try:
        import warm_up_keys
        yield warm_up_keys
    finally:
        sys.path.remove(str(TOOLS))
        if before is None: os.environ.pop('TRITON_INTERPRET', None)
        else: os.environ['TRITON_INTERPRET'] = before


def test_nearest_difference(tool):
    seen = {('_k', (('BLOCK', '16'),), (('*float32', 'D'), ('i32', 'D'))),
            ('_k', (('BLOCK', '32'),), (('*float32', ''), ('i32', ''))),
            ('_other', (), (('i32', ''),))}
    new = ('_k', (('BLOCK', '16'),), (('*float32', 'D'), ('i32', '')))
    assert tool.nearest_difference(new, seen) == [(2, "('i32', 'D')", "('i32', '')")]
    assert tool.nearest_difference(('_never', (), ()), seen) == []


@pytest.mark.parametrize('argv, words', [(['--warm-up', 'steps', '--burst', '8', '40'], '--burst [8, 40]'),
                                         (['--warm-up', 'steps', '--burst', '0', '4'], '--burst [0, 4]'),
                                         (['--warm-up', 'all'], "invalid choice: 'all'")])
def test_bad_arguments(argv, words):
    r = subprocess.run([sys.executable, str(TOOLS / 'warm_up_keys.py'), *argv], capture_output=True, text=True)
    assert r.returncode == 2 and words in r.stderr, r.stderr
