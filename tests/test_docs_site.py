"""The docs site as a reader meets it: built by `tools/build_site.py`, served over HTTP, opened in headless Chromium.

    python -m pytest tests/test_docs_site.py          # the browser tests skip when Chromium is not installed
    python tests/test_docs_site.py --screenshots      # the same checks, saving screenshots to images/site/

The browser opens the home page, the formats page, the KV-cache page and the newest kernel notebook's page, and checks
that each has its notebook's title, that every <img> loaded (naturalWidth > 0), that no Python traceback shows, that
no script failed or resource 404'd, and that searching for `allocate_slots` finds the KV-cache page.
`DSV41_REQUIRE_CHROMIUM=1` (set by `.ci/run`) turns the skip into a failure."""
import base64, functools, http.server, importlib, inspect, json, os, re, shutil, subprocess, sys, tempfile
import threading, time, urllib.request
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / 'nbs'
TRACEBACK = 'Traceback (most recent call last)'
BROWSERS = ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable')

def find_chromium():
    return os.environ.get('DSV41_CHROMIUM') or next((p for b in BROWSERS if (p := shutil.which(b))), None)

def notebook(stem: str) -> dict: return json.loads((NBS / f'{stem}.ipynb').read_text())
def source(cell) -> str: return ''.join(cell['source'])

def nb_title(stem: str) -> str:
    "The notebook's H1, read straight from its JSON"
    for cell in notebook(stem)['cells']:
        if cell['cell_type'] == 'markdown' and (m := re.search(r'^#\s+(.+?)\s*$', source(cell), re.M)):
            return m.group(1)

def nb_module(stem: str):
    for cell in notebook(stem)['cells']:
        if m := re.search(r'^#\|\s*default_exp\s+(\S+)', source(cell), re.M): return m.group(1)

def notebook_stems() -> list:
    return sorted(p.stem for p in NBS.glob('*.ipynb') if p.stem != 'index' and not p.stem.startswith(('_', '.')))

def page_of_module(module: str) -> str:
    "The (last) notebook that exports `module`"
    return [s for s in notebook_stems() if nb_module(s) == module][-1]

def newest_kernel_notebook() -> str:
    "The highest-numbered notebook with a Triton kernel"
    kernels = [s for s in notebook_stems()
               if any('@triton.jit' in source(c) for c in notebook(s)['cells'] if c['cell_type'] == 'code')]
    return kernels[-1]

def build(out: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'build_site.py'), '--out', str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, f'tools/build_site.py failed:\n{r.stdout}\n{r.stderr}'
    return r

@pytest.fixture(scope='module')
def site(tmp_path_factory):
    if not os.environ.get('DSV41_REQUIRE_CHROMIUM'):
        pytest.importorskip('nbconvert', reason='the site builder needs nbconvert')
    out = tmp_path_factory.mktemp('site') / '_docs'
    build(out)
    return out

# ----------------------------------------------------------------------------------------------- without a browser
def test_every_notebook_is_a_page_in_reading_order(site):
    "Sidebar in reading order; a title on every page; no directive line and no traceback shows"
    stems = notebook_stems()
    html = (site / 'index.html').read_text()
    hrefs = re.findall(r'<li><a href="([^"]+)"', html.split('class="nb-list"')[1].split('</ol>')[0])
    assert hrefs == ['index.html'] + [f'{s}.html' for s in stems]
    for s in stems:
        page = (site / f'{s}.html').read_text()
        assert '<h1 class="title">' in page, s
        assert TRACEBACK not in page and 'class="output error"' not in page, f'{s}: an output shows a Python traceback'
        assert not re.search(r'<span class="c1">#\|', page), f'{s}: a directive line (#| ...) shows in the code'

def test_readme_and_index_images_resolve():
    "Figures linked from README.md (relative to the repo) and from index.ipynb (relative to nbs/) exist"
    readme = re.findall(r'!\[[^\]]*\]\(([^)\s]+)\)', (ROOT / 'README.md').read_text())
    index = [m for c in notebook('index')['cells'] if c['cell_type'] == 'markdown'
             for m in re.findall(r'!\[[^\]]*\]\(([^)\s]+)\)', source(c))]
    assert readme and len(readme) == len(index)
    for rel in readme: assert (ROOT / rel).is_file(), f'README.md links a missing image: {rel}'
    for rel in index: assert (NBS / rel).is_file(), f'index.ipynb links a missing image: {rel}'

def test_every_exported_function_and_class_has_an_entry(site):
    "Each public function/class a module exports (its __all__, defined there) has a show_doc entry on its page"
    for stem in notebook_stems():
        mod_name = nb_module(stem)
        if not mod_name or mod_name.startswith('_'): continue
        mod = importlib.import_module(f'dsv41_nb.{mod_name}')
        page = (site / f'{stem}.html').read_text()
        for name in getattr(mod, '__all__', []):
            obj = getattr(mod, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == mod.__name__:
                assert f'<section class="doc-entry" id="{name}">' in page, f'{stem}: no entry for {name}'

def test_search_index_finds_allocate_slots(site):
    recs = json.loads((site / 'search.json').read_text())
    kv = page_of_module('kv_manager')
    hits = [r for r in recs if any(n.split('.')[-1] == 'allocate_slots' for n in r['n'])]
    assert any(r['u'].startswith(f'{kv}.html#') and r['k'] == 'api' for r in hits), hits
    assert {r['u'].split('#')[0] for r in recs} == {'index.html', *(f'{s}.html' for s in notebook_stems())}

# ---------------------------------------------------------------------------------------------------- the browser
class Chromium:
    "Headless Chromium driven over the DevTools protocol (one tab)"
    def __init__(self, exe: str, width: int = 1280, height: int = 860):
        import websocket   # websocket-client, installed with jupyterlab
        self.profile = tempfile.mkdtemp(prefix='chromium-')
        self.proc = subprocess.Popen([exe, '--headless', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
                                      '--no-first-run', '--no-default-browser-check',
                                      '--hide-scrollbars', '--mute-audio', '--remote-debugging-port=0',
                                      '--remote-allow-origins=*', f'--user-data-dir={self.profile}',
                                      f'--window-size={width},{height}', 'about:blank'],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, t0 = Path(self.profile) / 'DevToolsActivePort', time.time()
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.time() - t0 > 60:
                self.close(); raise RuntimeError(f'{exe} did not start (exit code {self.proc.returncode})')
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f'http://127.0.0.1:{port}/json/list', timeout=10))
        ws = next(t['webSocketDebuggerUrl'] for t in targets if t.get('type') == 'page')
        self.ws = websocket.create_connection(ws, timeout=60, suppress_origin=True)
        self.next_id, self.events = 0, []
        for domain in ('Page', 'Runtime', 'Log'): self.send(f'{domain}.enable')
        self.send('Emulation.setDeviceMetricsOverride', width=width, height=height, deviceScaleFactor=1, mobile=False)

    def send(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps(dict(id=self.next_id, method=method, params=params)))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get('id') == self.next_id:
                if 'error' in msg: raise RuntimeError(f'{method}: {msg["error"]}')
                return msg.get('result', {})
            if 'method' in msg: self.events.append(msg)

    def wait_for(self, event: str, timeout: float = 60):
        t0 = time.time()
        while time.time() - t0 < timeout:
            for i, e in enumerate(self.events):
                if e['method'] == event: return self.events.pop(i)
            msg = json.loads(self.ws.recv())
            if 'method' in msg: self.events.append(msg)
        raise TimeoutError(event)

    def open(self, url: str):
        "Load `url`; returns the script exceptions and console/network errors seen while loading"
        self.events.clear()
        self.send('Page.navigate', url=url)
        self.wait_for('Page.loadEventFired')
        self.evaluate('new Promise(r => setTimeout(r, 150))')   # deferred handlers settle
        errors = [e['params']['exceptionDetails'].get('exception', {}).get('description')
                  or e['params']['exceptionDetails'].get('text')
                  for e in self.events if e['method'] == 'Runtime.exceptionThrown']
        errors += [f"{e['params']['entry'].get('url', '')}: {e['params']['entry']['text']}"
                   for e in self.events if e['method'] == 'Log.entryAdded' and e['params']['entry']['level'] == 'error']
        return errors

    def evaluate(self, expression: str):
        r = self.send('Runtime.evaluate', expression=expression, awaitPromise=True, returnByValue=True)
        if 'exceptionDetails' in r: raise RuntimeError(f'{expression[:60]}...: {r["exceptionDetails"]}')
        return r['result'].get('value')

    def screenshot(self, path: Path, scroll_to: str | None = None):
        "Save the viewport as a PNG (256 colours when Pillow is there: a third of the size, text unchanged)"
        if scroll_to: self.evaluate(f"document.querySelector({json.dumps(scroll_to)}).scrollIntoView()")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.send('Page.captureScreenshot', format='png')['data']))
        try: from PIL import Image
        except ImportError: return
        with Image.open(path) as im:
            small = im.convert('RGB').quantize(256, method=Image.Quantize.MEDIANCUT,
                                               dither=Image.Dither.NONE)
        small.save(path, optimize=True)

    def close(self):
        try: self.ws.close()
        except Exception: pass
        self.proc.terminate()
        try: self.proc.wait(10)
        except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args): pass

def serve(folder: Path):
    "The site over HTTP on a free local port, as `python -m http.server -d _docs` serves it"
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), functools.partial(QuietHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f'http://127.0.0.1:{server.server_address[1]}'

PAGE_CHECK = """(async () => {
  const imgs = [...document.images];
  await Promise.all(imgs.map(im => im.complete ? null : new Promise(r => { im.addEventListener('load', r); \
im.addEventListener('error', r); })));
  return {title: document.title, h1: (document.querySelector('h1.title') || {}).textContent,
          images: imgs.map(im => [im.getAttribute('src').slice(0, 60), im.naturalWidth]),
          traceback: document.body.innerText.includes('Traceback (most recent call last)'),
          error_outputs: document.querySelectorAll('pre.output.error').length,
          sidebar: [...document.querySelectorAll('.nb-list a')].length,
          current: (document.querySelector('.nb-list a.current') || {}).getAttribute?.('href')};
})()"""

def pages_to_check() -> dict:
    "{name: notebook stem} of the pages the browser opens"
    return {'home': 'index', 'formats': page_of_module('formats'), 'kv_cache': page_of_module('kv_cache'),
            'kernel': newest_kernel_notebook()}

def check_site(site: Path, shots: Path | None = None) -> list:
    "Open the pages in Chromium and check them; returns a line per page. Screenshots to `shots` if given."
    exe = find_chromium()
    server, base = serve(site)
    browser = Chromium(exe)
    report = []
    try:
        for name, stem in pages_to_check().items():
            href = 'index.html' if stem == 'index' else f'{stem}.html'
            errors = browser.open(f'{base}/{href}')
            r = browser.evaluate(PAGE_CHECK)
            title = nb_title(stem)
            assert r['h1'] == title, f'{href}: heading {r["h1"]!r}, notebook title {title!r}'
            assert title in r['title'], f'{href}: <title> {r["title"]!r} lacks {title!r}'
            assert not errors, f'{href}: errors while loading: {errors}'
            broken = [src for src, w in r['images'] if not w > 0]
            assert not broken, f'{href}: images that did not load: {broken}'
            assert not r['traceback'] and not r['error_outputs'], f'{href}: shows a Python traceback'
            assert (r['sidebar'] == len(notebook_stems()) + 1
                    and r['current'] == href), f'{href}: sidebar {r["sidebar"]}, {r["current"]}'
            if stem == 'index': assert r['images'], 'the home page shows no figure'
            report.append(f'{href}: "{title}", {len(r["images"])} images loaded')
            if shots:
                browser.screenshot(shots / f'{name}.png')
                if r['images'] and stem != 'index':
                    browser.screenshot(shots / f'{name}_figure.png', scroll_to='.cell-outputs img')
        # the search: the function the box calls, then the box itself (index.html?q=... opens with results)
        kv = page_of_module('kv_manager')
        browser.open(f'{base}/index.html')
        hits = browser.evaluate("siteSearch('allocate_slots').then(rs => rs.map(r => r.u))")
        assert any(u.startswith(f'{kv}.html') for u in hits[:3]), f'search for allocate_slots: {hits[:5]}'
        errors = browser.open(f'{base}/index.html?q=allocate_slots')
        shown = browser.evaluate("""new Promise(r => setTimeout(() => r([..."""
                                 """document.querySelectorAll('#search-results li[data-u]')]
                                    .map(li => li.dataset.u)), 300))""")
        assert not errors and any(u.startswith(f'{kv}.html') for u in shown[:3]), f'search box: {shown[:5]} {errors}'
        report.append(f'search "allocate_slots": {hits[0]} first of {len(hits)}')
        if shots:
            browser.screenshot(shots / 'search.png')
            browser.open(f'{base}/{kv}.html#KVCacheManager.allocate_slots')
            browser.screenshot(shots / 'kv_cache_api.png')
    finally:
        browser.close()
        server.shutdown()
    return report

@pytest.mark.skipif(not find_chromium() and not os.environ.get('DSV41_REQUIRE_CHROMIUM'),
                    reason='Chromium is not installed (Debian: apt-get install chromium); .ci/run installs it')
def test_pages_in_chromium(site):
    assert find_chromium(), 'DSV41_REQUIRE_CHROMIUM is set but no Chromium was found'
    for line in check_site(site): print(line)

if __name__ == '__main__':
    import argparse
    ap = argparse.ArgumentParser(description='Build the docs site and check it in headless Chromium')
    ap.add_argument('--screenshots', nargs='?', const=str(ROOT / 'images' / 'site'), default=None, metavar='DIR',
                    help='save screenshots of the checked pages (default folder: images/site/)')
    args = ap.parse_args()
    if not find_chromium(): sys.exit('Chromium is not installed (Debian: apt-get install chromium)')
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / '_docs'
        print(build(out).stdout.strip())
        for line in check_site(out, Path(args.screenshots) if args.screenshots else None): print(line)
    if args.screenshots: print('screenshots in', args.screenshots)
