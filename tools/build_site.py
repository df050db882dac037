#!/usr/bin/env python
"""Build the docs site: every notebook in `nbs/` as one web page, with its committed outputs, into `_docs/`.

    python tools/build_site.py [--out _docs]        # then: python -m http.server -d _docs

Nothing is executed: a page shows the outputs saved in its notebook (the H200 numbers of `#| gpu` cells included).
The home page is `index.ipynb` (the README's source); the other notebooks follow in file-name order, which is the
reading order, each in the sidebar of every page. Directive lines (`#| export`, ...) are dropped and cells marked
`#| hide` skipped. Every exported function and class gets a `show_doc` entry (signature with its docments,
docstring), rendered by fastcore's docments as nbdev's `show_doc` does, from the exported module (imported, not run),
followed by its source. Figures the markdown links (`../images/...`) are copied to `images/`; figures in outputs are
embedded. `search.json` indexes every page's title, headings, text and exported names for the search box."""
import argparse, ast, configparser, html, importlib, inspect, json, re, shutil, sys
from pathlib import Path
import nbformat
from nbformat.v4.rwbase import rejoin_lines
from nbconvert.filters.ansi import ansi2html
from nbconvert.filters.markdown_mistune import markdown2html_mistune
from nbdev.showdoc import showdoc_nm
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / 'site_assets'
DIRECTIVE = re.compile(r'^\s*#\|\s*(.*?)\s*$')
TAGS = {'gpu': 'runs on a GPU (skipped on a CPU); its outputs are from the last GPU run',
        'slow': 'a slow cell, skipped unless asked for'}

def directives(source: str) -> dict:
    "The `#| name [args]` lines of a cell: {name: args}; `#| key: value` options too"
    out = {}
    for line in source.splitlines():
        m = DIRECTIVE.match(line)
        words = m.group(1).split() if m else []
        if not words: continue
        if words[0].endswith(':') or ':' in words[0]: words = m.group(1).replace(':', ' ', 1).split()
        out[words[0]] = ' '.join(words[1:])
    return out

def strip_directives(source: str) -> str:
    "`source` without its directive lines (and lines ending in `#| hide_line`)"
    lines = [l for l in source.splitlines() if not DIRECTIVE.match(l) and not re.search(r'#\|\s*hide_line\s*$', l)]
    return '\n'.join(lines).strip('\n')

def slugify(text: str) -> str:
    "A heading's anchor: lower case words joined by hyphens"
    text = re.sub(r'<[^>]+>', '', html.unescape(text)).lower()
    return re.sub(r'[^\w]+', '-', text).strip('-') or 'section'

def plain_text(fragment: str) -> str:
    "The visible text of an HTML fragment, whitespace collapsed"
    fragment = re.sub(r'<(script|style)\b.*?</\1>', ' ', fragment, flags=re.S)
    fragment = re.sub(r'</?(a|code|em|strong|b|i|span|mark|sub|sup|kbd)\b[^>]*>', '', fragment)   # inline: no gap
    return re.sub(r'\s+', ' ', html.unescape(re.sub(r'<[^>]+>', ' ', fragment))).strip()

_formatter = HtmlFormatter(nowrap=False)
def code_html(source: str) -> str: return highlight(source, PythonLexer(), _formatter)

# ---------------------------------------------------------------------------------------------------------- notebooks
def read_settings() -> configparser.SectionProxy:
    cfg = configparser.ConfigParser(delimiters=['='], interpolation=None)
    cfg.read(ROOT / 'settings.ini', encoding='utf-8')
    return cfg['DEFAULT']

def notebook_paths(nbs: Path) -> list:
    "index.ipynb first (the home page), then the other notebooks in file-name order"
    others = sorted(p for p in nbs.glob('*.ipynb') if p.name != 'index.ipynb' and not p.name.startswith(('_', '.')))
    home = nbs / 'index.ipynb'
    return ([home] if home.exists() else []) + others

def read_notebook(path: Path):
    "A v4 notebook, sources and outputs joined into strings (not validated: nbdev_clean keeps them well formed)"
    nb = nbformat.from_dict(json.loads(path.read_text(encoding='utf-8')))
    if nb.get('nbformat') != 4: nb = nbformat.read(path, as_version=4)
    return rejoin_lines(nb)

def page_name(path: Path) -> str: return 'index.html' if path.stem == 'index' else f'{path.stem}.html'

def title_and_summary(nb) -> tuple:
    "The notebook's H1 and its `> summary` line, from the first markdown cell"
    for cell in nb.cells:
        if cell.cell_type != 'markdown': continue
        h1 = re.search(r'^#\s+(.+?)\s*$', cell.source, re.M)
        if not h1: continue
        summary = re.search(r'^>\s*(.+?)\s*$', cell.source[h1.end():], re.M)
        return h1.group(1), (summary.group(1) if summary else ''), cell
    return None, '', None

def default_exp(nb):
    for cell in nb.cells:
        m = re.search(r'^\s*#\|\s*default_exp\s+(\S+)', cell.source, re.M)
        if cell.cell_type == 'code' and m: return m.group(1)

def exported_names(source: str) -> tuple:
    "(documented names, other public names) defined at the top level of an exported cell"
    try: tree = ast.parse('\n'.join(l for l in source.splitlines() if not l.lstrip().startswith(('%', '!'))))
    except SyntaxError: return [], []
    documented, other = [], []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nm = showdoc_nm(node)
            if not node.name.startswith('_') or node.name.startswith('__'): documented.append(nm)
            if isinstance(node, ast.ClassDef) and not node.name.startswith('_'):
                other += [f'{node.name}.{n.name}' for n in node.body
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith('_')]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            other += [t.id for t in targets if isinstance(t, ast.Name) and not t.id.startswith('_')]
    return documented, other

# ------------------------------------------------------------------------------------------------------ show_doc
def resolve(lib: str, module, name: str):
    "The object `name` ('f' or 'Cls.meth') in `module`, else in any module of `lib`; None if not found"
    def find(mod):
        obj = mod
        for part in name.split('.'):
            # the attribute as defined (a property, not its value), unless a custom descriptor
            if inspect.isclass(obj):
                attr = inspect.getattr_static(obj, part, None)
                if isinstance(attr, (staticmethod, classmethod)): attr = attr.__func__
                elif not (attr is None or inspect.isfunction(attr) or inspect.isclass(attr)
                          or isinstance(attr, property)):
                    attr = getattr(obj, part, None)          # e.g. fastcore's @patch(cls_method=True)
                obj = attr
            else: obj = getattr(obj, part, None)
            if obj is None: return None
        return obj
    obj = find(module) if module is not None else None
    if obj is None:
        for mod in list(sys.modules.values()):
            if getattr(mod, '__name__', '').startswith(lib + '.') and (obj := find(mod)) is not None: break
    return getattr(obj, 'fn', obj) if type(obj).__name__ == 'JITFunction' else obj

def own_docstring(obj) -> str:
    "The object's own docstring (not inherited, not a dataclass's generated signature)"
    fn = getattr(obj, 'fget', None) or obj
    doc = fn.__dict__.get('__doc__') if inspect.isclass(fn) else getattr(fn, '__doc__', None)
    if not doc or (inspect.isclass(fn) and doc.startswith(fn.__name__ + '(')): return ''
    return inspect.cleandoc(doc)

def signature_text(obj, name: str, node_src: str) -> str:
    "The signature with docments as comments (fastcore's DocmentText, what `show_doc` prints)"
    from fastcore.docments import DocmentText
    try:
        sig = str(DocmentText(getattr(obj, 'fget', None) or obj, docstring=False)).rstrip()
        sig = re.sub(r'\(\s*\)', '()', sig)                       # no parameters: one line
        if inspect.isclass(obj): sig = re.sub(r'^def ', 'class ', sig)
        if isinstance(obj, property): sig = f'@property\n{sig}'
        return sig
    except Exception:   # no signature to inspect: fall back to the source's first line
        return node_src.split('\n', 1)[0].rstrip(':')

# -------------------------------------------------------------------------------------------------------- outputs
def render_output(out) -> str:
    t = out.output_type
    if t == 'stream':
        cls = 'output stream' + (' stderr' if out.get('name') == 'stderr' else '')
        return f'<pre class="{cls}">{ansi2html(out.text.rstrip())}</pre>'
    if t == 'error':
        return f'<pre class="output error">{ansi2html(chr(10).join(out.get("traceback", [])))}</pre>'
    data = out.get('data', {})
    for mime in ('image/png', 'image/jpeg', 'image/gif'):
        if mime in data:
            alt = html.escape(data.get('text/plain', 'figure').strip("<>"))
            return f'<img class="output figure" alt="{alt}" src="data:{mime};base64,{data[mime].strip()}">'
    if 'image/svg+xml' in data: return f'<div class="output figure">{data["image/svg+xml"]}</div>'
    if 'text/html' in data: return f'<div class="output html">{data["text/html"]}</div>'
    if 'text/markdown' in data:
        return f'<div class="output markdown">{markdown2html_mistune(data["text/markdown"])}</div>'
    if 'text/plain' in data: return f'<pre class="output">{ansi2html(data["text/plain"].rstrip())}</pre>'
    return ''

# ----------------------------------------------------------------------------------------------------- the builder
class Site:
    def __init__(self, out: Path):
        self.out, self.settings = out, read_settings()
        self.lib = self.settings.get('lib_name', 'dsv41_nb')
        self.nbs = ROOT / self.settings.get('nbs_path', 'nbs')
        self.pages, self.links, self.search, self.images, self.problems = [], {}, [], set(), []

    # pass 1: read every notebook, find its title, module and exported names
    def read(self):
        for path in notebook_paths(self.nbs):
            nb = read_notebook(path)
            title, summary, title_cell = title_and_summary(nb)
            mod_name = default_exp(nb)
            page = dict(path=path, nb=nb, href=page_name(path), stem=path.stem, title=title or path.stem,
                        summary=summary, title_cell=title_cell, module_name=mod_name, module=None, names=set())
            if mod_name and path.stem != 'index':
                full = self.lib if mod_name == '__init__' else f'{self.lib}.{mod_name}'
                try: page['module'] = importlib.import_module(full)
                except Exception as e: self.problems.append(f'{path.name}: cannot import {full} ({e!r})')
                self.links.setdefault(full, page['href'])
            self.links.setdefault(path.stem, page['href'])
            self.pages.append(page)
        # exported names -> their entries, for links in prose
        short = {}
        for page in self.pages:
            for cell in page['nb'].cells:
                d = directives(cell.source) if cell.cell_type == 'code' else {}
                if not ('export' in d or 'exports' in d) or 'hide' in d: continue
                documented, other = exported_names(cell.source)
                page['names'].update(documented + other)
                for nm in documented + other:
                    self.links.setdefault(nm, f"{page['href']}#{nm}")
                    short.setdefault(nm.rsplit('.', 1)[-1], set()).add(nm)
        for s, full in short.items():            # `allocate_slots` links to KVCacheManager.allocate_slots if unique
            if len(full) == 1 and s not in self.links: self.links[s] = self.links[next(iter(full))]
        for page in self.pages:                  # a module's short name (`formats`) links to its page
            if page['module'] is not None and page['module_name'] != '__init__':
                self.links.setdefault(page['module_name'], page['href'])

    def linkify(self, fragment: str, here: str) -> str:
        "Link inline `code` naming a notebook, module or exported name to its page"
        def repl(m):
            if m.group(1): return m.group(1)
            name = html.unescape(m.group(2)).removesuffix('()')
            target = self.links.get(name)
            if not target: return m.group(0)
            if target.startswith(here + '#'): target = target[len(here):]
            return f'<a class="api-link" href="{target}">{m.group(0)}</a>'
        return re.sub(r'(<a\b.*?</a>|<pre\b.*?</pre>|<h\d\b.*?</h\d>)|<code>([\w.]+(?:\(\))?)</code>',
                      repl, fragment, flags=re.S)

    def local_images(self, fragment: str, page: dict) -> str:
        "Point relative image paths (written from nbs/) at copies in the site"
        def repl(m):
            src = m.group(2)
            if re.match(r'^(data:|https?:|/|#)', src): return m.group(0)
            file = (page['path'].parent / src).resolve()
            try: rel = file.relative_to(ROOT).as_posix()
            except ValueError: rel = None
            if rel is None or not file.is_file():
                self.problems.append(f"{page['path'].name}: image {src} not found")
                return m.group(0)
            self.images.add(rel)
            return f'{m.group(1)}{html.escape(rel)}{m.group(3)}'
        return re.sub(r'(<img\b[^>]*?\bsrc=")([^"]+)(")', repl, fragment)

    def markdown(self, source: str, page: dict, ids: set, toc: list) -> str:
        "A markdown cell as HTML: anchors on headings (collected for the table of contents), local images, links"
        frag = markdown2html_mistune(source)
        def heading(m):
            level, inner = int(m.group(1)), re.sub(r'<a class="anchor-link".*?</a>', '', m.group(3))
            slug = base = slugify(inner)
            n = 1
            while slug in ids or slug in page['names']: n += 1; slug = f'{base}-{n}'   # exported names keep their ids
            ids.add(slug)
            toc.append((level, slug, plain_text(inner)))
            return (f'<h{level} id="{slug}">{inner}<a class="anchor-link" href="#{slug}" '
                    f'aria-label="link to this section">#</a></h{level}>')
        frag = re.sub(r'<h([1-6]) id="([^"]*)">(.*?)</h\1>', heading, frag, flags=re.S)
        return self.linkify(self.local_images(frag, page), page['href'])

    def doc_entry(self, page, name: str, node_src: str, ids: set) -> tuple:
        "The show_doc entry of exported `name`: (html, search record)"
        obj = resolve(self.lib, page['module'], name)
        if obj is None:
            self.problems.append(f"{page['path'].name}: exported name {name} not found in {page['module_name']}")
            return '', None
        kind = ('class' if inspect.isclass(obj) else 'property' if isinstance(obj, property)
                else 'classmethod' if inspect.ismethod(obj) and inspect.isclass(obj.__self__)
                else 'method' if '.' in name else 'function')
        sig, doc = signature_text(obj, name, node_src), own_docstring(obj)
        ids.add(name)
        doc_html = self.linkify(markdown2html_mistune(doc), page['href']) if doc else ''
        entry = (f'<section class="doc-entry" id="{html.escape(name)}"><h4 class="doc-name">'
                 f'<a href="#{html.escape(name)}"><code>{html.escape(name)}</code></a><span '
                 f'class="doc-kind">{kind}</span></h4><div class="doc-sig">{code_html(sig)}</div>'
                 f'{f"<div class=doc-string>{doc_html}</div>" if doc_html else ""}</section>')
        return entry, dict(k='api', t=page['title'], u=f"{page['href']}#{name}", h=name,
                           x=doc.split('\n\n')[0].replace('`', ''), n=[name])

    def code_cell(self, cell, page, ids) -> tuple:
        "(html, documented names, other names) of a code cell"
        d = directives(cell.source)
        if 'hide' in d or d.get('include') == 'false': return '', [], []
        src = strip_directives(cell.source)
        show_src = d.get('echo') != 'false' and src.strip()
        outs = [] if d.get('output') == 'false' else [render_output(o) for o in cell.get('outputs', [])]
        outs = [o for o in outs if o]
        if not show_src and not outs: return '', [], []
        exported = 'export' in d or 'exports' in d
        documented, other = exported_names(src) if exported and page['module'] is not None else ([], [])
        parts, names = [], []
        for nm in documented:
            if nm in ids: continue               # defined again further down: one entry, at the first definition
            entry, rec = self.doc_entry(page, nm, src, ids)
            if entry: parts.append(entry); names.append(nm); self.search.append(rec)
        anchors = ''
        for n in other:                          # constants and class-body methods: an anchor for links and search
            if n not in ids: ids.add(n); anchors += f'<span id="{html.escape(n)}"></span>'
        tags = ''.join(f'<span class="cell-tag" title="{TAGS[t]}">{t}</span>' for t in TAGS if t in d)
        tags = f'<div class="cell-tags">{tags}</div>' if tags else ''
        if show_src:
            code = code_html(src)
            if exported or 'exporti' in d:
                code = f'<details class="exported-source" open><summary>Exported source</summary>{code}</details>'
            parts.append(f'<div class="cell-source">{tags}{code}</div>')
        if outs: parts.append(f'<div class="cell-outputs">{"".join(outs)}</div>')
        kind = 'export-cell' if exported else 'code-cell'
        return f'<div class="cell {kind}">{anchors}{"".join(parts)}</div>', names, other

    # pass 2: render each page
    def render_page(self, i: int, page: dict) -> str:
        ids, toc, body, sections = {'top', 'site-search'}, [], [], []
        section = dict(k='section', t=page['title'], u=page['href'], h=page['title'], x=[], n=[])
        sections.append(section)
        for cell in page['nb'].cells:
            if cell.cell_type == 'markdown':
                src = cell.source
                if cell is page['title_cell']:   # the H1 and summary become the page header
                    src = re.sub(r'^#\s+.+$', '', src, count=1, flags=re.M)
                    src = re.sub(r'^\s*>\s*.+$', '', src, count=1, flags=re.M) if page['summary'] else src
                if not src.strip(): continue
                frag = self.markdown(src, page, ids, toc)
                # a new search section at each heading in this cell
                pieces = re.split(r'(<h[1-3] id="[^"]+">.*?</h[1-3]>)', frag, flags=re.S)
                for piece in pieces:
                    m = re.match(r'<h[1-3] id="([^"]+)">(.*?)</h[1-3]>', piece, flags=re.S)
                    if m:
                        section = dict(k='section', t=page['title'], u=f"{page['href']}#{m.group(1)}",
                                       h=plain_text(re.sub(r'<a class="anchor-link".*?</a>', '', m.group(2))),
                                       x=[], n=[])
                        sections.append(section)
                    else: section['x'].append(plain_text(piece))
                body.append(f'<div class="cell markdown-cell">{frag}</div>')
            elif cell.cell_type == 'code':
                frag, names, other = self.code_cell(cell, page, ids)
                if frag: body.append(frag)
                section['n'] += names + other
        for s in sections:
            s['x'] = ' '.join(t for t in s['x'] if t)
            if s['x'] or s['n'] or s is sections[0]: self.search.append(s)
        return self.page_html(i, page, '\n'.join(body), toc)

    def sidebar(self, here: str) -> str:
        items = []
        for p in self.pages:
            cur = ' class="current" aria-current="page"' if p['href'] == here else ''
            label = (f'<span class="nb-stem">{p["stem"]}</span>' if p['stem'] != 'index' else '') + \
                    f'<span class="nb-title">{html.escape(p["title"]) if p["stem"] != "index" else "Home"}</span>'
            items.append(f'<li><a href="{p["href"]}"{cur}>{label}</a></li>')
        return '<ol class="nb-list">' + ''.join(items) + '</ol>'

    def page_html(self, i: int, page: dict, body: str, toc: list) -> str:
        toc_html = ''.join(f'<li class="toc-l{lvl}"><a href="#{slug}">{html.escape(text)}</a></li>'
                           for lvl, slug, text in toc if lvl in (2, 3))
        prev = self.pages[i - 1] if i > 0 else None
        nxt = self.pages[i + 1] if i + 1 < len(self.pages) else None
        pager = ''.join(f'<a class="pager-{cls}" href="{p["href"]}"><span>{word}</span>{html.escape(p["title"])}</a>'
                        for cls, word, p in (('prev', 'Previous', prev), ('next', 'Next', nxt)) if p)
        summary = self.linkify(markdown2html_mistune(page['summary']), page['href']) if page['summary'] else ''
        module = ((f'<p class="page-module">module <code>{self.lib}.{page["module_name"]}</code> · notebook '
                   f'<code>nbs/{page["path"].name}</code></p>')
                  if page['module_name'] and page['stem'] != 'index' else '')
        site_title = self.pages[0]['title'] if self.pages else self.lib
        doc_title = site_title if page['stem'] == 'index' else f'{page["title"]} – {site_title}'
        template = (ASSETS / 'page.html').read_text()
        fill = {'doc_title': html.escape(doc_title), 'site_title': html.escape(site_title),
                'sidebar': self.sidebar(page['href']), 'title': html.escape(page['title']),
                'summary': summary, 'module': module, 'body': body,
                'toc': f'<nav class="toc"><h2>On this page</h2><ul>{toc_html}</ul></nav>' if toc_html else '',
                'pager': pager, 'description': html.escape(page['summary'][:200])}
        return re.sub(r'\{\{(\w+)\}\}', lambda m: fill[m.group(1)], template)

    def build(self) -> list:
        if self.out.exists():                    # replace an earlier build, never a folder that is something else
            if any(self.out.iterdir()) and not (self.out / 'search.json').exists():
                raise SystemExit(f'{self.out} exists and is not a site built by this script; choose another --out')
            shutil.rmtree(self.out)
        (self.out / 'assets').mkdir(parents=True)
        self.read()
        for i, page in enumerate(self.pages):
            (self.out / page['href']).write_text(self.render_page(i, page), encoding='utf-8')
        for rel in sorted(self.images):
            (self.out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, self.out / rel)
        for f in ('site.css', 'site.js', 'favicon.svg'): shutil.copy2(ASSETS / f, self.out / 'assets' / f)
        (self.out / 'assets' / 'pygments.css').write_text(_formatter.get_style_defs('.highlight'))
        (self.out / 'search.json').write_text(json.dumps(self.search, ensure_ascii=False, separators=(',', ':')),
                                              encoding='utf-8')
        (self.out / '.nojekyll').write_text('')
        return self.problems

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--out', default=None, help='output folder (default: doc_path of settings.ini, _docs)')
    args = ap.parse_args()
    out = Path(args.out) if args.out else ROOT / read_settings().get('doc_path', '_docs')
    site = Site(out.resolve())
    problems = site.build()
    n_api = sum(r['k'] == 'api' for r in site.search)
    print(f'{len(site.pages)} pages, {n_api} API entries, {len(site.images)} images -> {out}')
    for p in problems: print('ERROR:', p, file=sys.stderr)
    sys.exit(1 if problems else 0)
