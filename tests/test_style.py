"""The notebooks' code reads like its models (fastai's miniai, nbdev's own notebooks): no code line over 120
characters, and fewer than 5% of code lines over 100. The scripts in tools/ and the tests keep the same 120 limit."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'


def code_lines() -> list[tuple[str, str]]:
    "(notebook, line) for every line of every code cell"
    return [(p.stem, line) for p in sorted(NBS.glob('*.ipynb'))
            for c in json.loads(p.read_text())['cells'] if c['cell_type'] == 'code'
            for line in ''.join(c['source']).split('\n')]


def test_no_code_line_over_120():
    long = [f"{nb}: {line[:60]}..." for nb, line in code_lines() if len(line) > 120]
    assert long == [], f"{len(long)} code lines over 120 characters:\n" + '\n'.join(long[:20])


def test_few_code_lines_over_100():
    lines = code_lines()
    over = sum(len(line) > 100 for _, line in lines)
    assert over / len(lines) < 0.05, f"{over} of {len(lines)} code lines ({over / len(lines):.1%}) are over 100"


def test_no_tool_or_test_line_over_120():
    "The scripts and the tests: no line over 120 characters (a failure lists each as file:line from the root)"
    files = sorted([*ROOT.glob('tools/*.py'), *ROOT.glob('tests/*.py')])
    long = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text(encoding='utf-8').split('\n'), 1) if len(line) > 120]
    assert files and long == [], f"{len(long)} lines over 120 characters:\n" + '\n'.join(long)
