"""The README's promise about the notebooks: read in the order of its table, each one's module imports only from the
modules of the notebooks before it (at the top of the module or inside a function), and every module is in the table."""
import ast, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / 'dsv41_nb'


def readme_order() -> list[tuple[str, str]]:
    "(notebook, module) rows of the README's table of notebooks, in its order"
    text = (ROOT / 'README.md').read_text()
    return re.findall(r'^\| `([0-9a-z_]+)` \| `([0-9a-z_]+)` \|', text, re.M)


def package_imports(path: Path) -> set[str]:
    "The modules of this package that `path` imports, anywhere in it"
    found = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level: found |= {n.module.split('.')[0]} if n.module else {a.name for a in n.names}
            elif n.module == 'dsv41_nb': found |= {a.name for a in n.names}
            elif (n.module or '').startswith('dsv41_nb.'): found.add(n.module.split('.')[1])
        elif isinstance(n, ast.Import):
            found |= {a.name.split('.')[1] for a in n.names if a.name.startswith('dsv41_nb.')}
    return found


def test_every_module_is_in_the_table():
    listed = {m for _, m in readme_order()}
    modules = {p.stem for p in PKG.glob('*.py')} - {'__init__', '_modidx'}
    assert modules - listed == set(), f"modules missing from the README's table: {sorted(modules - listed)}"


def test_notebooks_are_in_file_order():
    names = [nb for nb, _ in readme_order()]
    assert names == sorted(names), 'the README lists the notebooks out of their file order'
    on_disk = sorted(p.stem for p in (ROOT / 'nbs').glob('*.ipynb') if p.stem != 'index')
    assert names == on_disk, f"table {set(names) ^ set(on_disk)} differs from nbs/"


def test_each_module_imports_only_from_earlier_ones():
    order = readme_order()
    pos = {m: i for i, (_, m) in enumerate(order)}
    late = [f"{nb} ({m}) imports {dep} ({order[pos[dep]][0]})"
            for nb, m in order for dep in package_imports(PKG / f'{m}.py')
            if dep in pos and pos[dep] > pos[m]]   # (a module may name itself: dp_front's hook)
    assert late == [], 'imports from a later notebook:\n' + '\n'.join(late)
