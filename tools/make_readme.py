#!/usr/bin/env python
"""Write README.md from nbs/index.ipynb (what `nbdev_readme` does, without needing Quarto).

Markdown cells are copied, code cells become ```python blocks followed by their text output, `#|` directive
lines are dropped, cells marked `#| hide` are skipped, and image links `../images/` become `images/`."""
import re
from pathlib import Path
import nbformat

def to_markdown(nb) -> str:
    parts = []
    for cell in nb.cells:
        src = cell.source
        if re.search(r'^#\|\s*hide', src, re.M): continue
        src = '\n'.join(l for l in src.splitlines() if not l.startswith('#|')).strip()
        if cell.cell_type == 'markdown':
            parts.append(src.replace('](../images/', '](images/'))
        elif cell.cell_type == 'code' and src:
            parts.append(f'```python\n{src}\n```')
            text = ''.join(o.get('text', '') if o.output_type == 'stream' else o.get('data', {}).get('text/plain', '')
                           for o in cell.get('outputs', []) if o.output_type in ('stream', 'execute_result'))
            if text.strip(): parts.append('```\n' + text.rstrip() + '\n```')
    return '\n\n'.join(parts) + '\n'

if __name__ == '__main__':
    root = Path(__file__).resolve().parent.parent
    nb = nbformat.read(root / 'nbs' / 'index.ipynb', as_version=4)
    (root / 'README.md').write_text(to_markdown(nb))
    print('README.md written')
