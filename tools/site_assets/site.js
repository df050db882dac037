// The docs site's search: search.json (one record per section and per exported name) searched in the browser.
// window.siteSearch(query) resolves to the ranked results [{u, h, t, k, x}], best first.
(() => {
  const indexUrl = new URL('../search.json', document.currentScript.src);
  let index = null;
  const load = () => (index ??= fetch(indexUrl).then(r => {
    if (!r.ok) throw new Error(`search index: HTTP ${r.status}`);
    return r.json();
  }));
  const lower = s => (s || '').toLowerCase();

  // A term must match somewhere; names count most, then headings, titles, text.
  function scoreTerm(rec, term) {
    let s = 0;
    for (const n of rec.n) {
      const ln = lower(n), last = ln.slice(ln.lastIndexOf('.') + 1);
      if (ln === term || last === term) { s = Math.max(s, 100); } else if (ln.includes(term)) { s = Math.max(s, 40); }
    }
    const h = lower(rec.h);
    if (h === term) s += 30; else if (h.includes(term)) s += 20;
    if (lower(rec.t).includes(term)) s += 6;
    if (lower(rec.x).includes(term)) s += 3;
    return s;
  }

  async function siteSearch(query, limit = 12) {
    const terms = lower(query).split(/\s+/).filter(Boolean);
    if (!terms.length) return [];
    const recs = await load(), hits = [];
    for (const rec of recs) {
      let total = 0;
      for (const term of terms) {
        const s = scoreTerm(rec, term);
        if (!s) { total = 0; break; }
        total += s;
      }
      if (total) hits.push([total + (rec.k === 'api' ? 5 : 0), rec]);
    }
    hits.sort((a, b) => b[0] - a[0]);
    const seen = new Set(), out = [];
    for (const [, rec] of hits) {
      if (seen.has(rec.u)) continue;
      seen.add(rec.u);
      out.push(rec);
      if (out.length >= limit) break;
    }
    return out;
  }
  window.siteSearch = siteSearch;

  const esc = s => String(s).replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
  const escRe = s => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  function mark(text, terms) {
    let out = esc(text);
    for (const t of terms) out = out.replace(new RegExp(`(${escRe(esc(t))})`, 'ig'), '<mark>$1</mark>');
    return out;
  }
  function snippet(text, terms) {
    if (!text) return '';
    const lt = lower(text);
    const at = Math.max(0, Math.min(...terms.map(t => { const i = lt.indexOf(t); return i < 0 ? Infinity : i; })));
    const start = Number.isFinite(at) ? Math.max(0, at - 60) : 0;
    return (start ? '… ' : '') + text.slice(start, start + 170) + (text.length > start + 170 ? ' …' : '');
  }

  function setup() {
    const input = document.getElementById('site-search'), list = document.getElementById('search-results');
    if (!input || !list) return;
    let active = -1, timer = null;
    const items = () => [...list.querySelectorAll('li[data-u]')];
    const close = () => { list.hidden = true; active = -1; };
    const highlight = i => {
      const li = items();
      if (!li.length) return;
      active = (i + li.length) % li.length;
      li.forEach((el, j) => el.classList.toggle('active', j === active));
      li[active].scrollIntoView({block: 'nearest'});
    };
    async function run() {
      const q = input.value.trim();
      if (!q) { close(); list.innerHTML = ''; return; }
      const terms = lower(q).split(/\s+/).filter(Boolean);
      let results;
      try { results = await siteSearch(q); } catch (e) { list.innerHTML = `<li class="r-none">${esc(e.message)}</li>`; list.hidden = false; return; }
      if (q !== input.value.trim()) return;   // a newer query is on its way
      list.innerHTML = results.length ? results.map(r =>
        `<li data-u="${esc(r.u)}" class="r-${r.k}"><a href="${esc(r.u)}"><span class="r-h">${mark(r.h, terms)}</span>` +
        (r.h !== r.t ? `<span class="r-t">${esc(r.t)}</span>` : '') +
        `<span class="r-x">${mark(snippet(r.x, terms), terms)}</span></a></li>`).join('')
        : '<li class="r-none">No matches</li>';
      list.hidden = false;
      active = -1;
    }
    input.addEventListener('input', () => { clearTimeout(timer); timer = setTimeout(run, 60); });
    input.addEventListener('focus', () => { load().catch(() => {}); if (input.value.trim()) run(); });
    input.addEventListener('keydown', e => {
      if (e.key === 'ArrowDown') { e.preventDefault(); highlight(active + 1); }
      else if (e.key === 'ArrowUp') { e.preventDefault(); highlight(active - 1); }
      else if (e.key === 'Escape') { close(); input.blur(); }
      else if (e.key === 'Enter') {
        const li = items()[Math.max(active, 0)];
        if (li) { close(); window.location.href = li.dataset.u; }
      }
    });
    list.addEventListener('click', e => { if (e.target.closest('a')) close(); });
    document.addEventListener('click', e => { if (!e.target.closest('.search')) close(); });
    document.addEventListener('keydown', e => {
      if (e.key === '/' && document.activeElement !== input && !e.ctrlKey && !e.metaKey) { e.preventDefault(); input.focus(); }
    });
    const q = new URLSearchParams(window.location.search).get('q');   // index.html?q=allocate_slots opens with results
    if (q) { input.value = q; run(); }

    const toggle = document.querySelector('.nav-toggle');
    if (toggle) toggle.addEventListener('click', () => document.body.classList.toggle('nav-open'));
    const sidebar = document.querySelector('.sidebar'), current = document.querySelector('.nb-list a.current');
    if (sidebar && current && current.offsetTop > sidebar.clientHeight - 40) sidebar.scrollTop = current.offsetTop - sidebar.clientHeight / 2;
  }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', setup); else setup();
})();
