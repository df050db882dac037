"""The notebooks' code reads like its models (fastai's miniai, nbdev's own notebooks): no code line over 120
characters, and fewer than 5% of code lines over 100."""
import json
from pathlib import Path

NBS = Path(__file__).resolve().parents[1] / 'nbs'


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
