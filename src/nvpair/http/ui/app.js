// nvpair's dashboard (docs/dashboard.md). Plain JavaScript, no build step, no other origin.
// Every string an engine or a peer reports is put in the page as text (textContent or a
// text node), never as HTML. URLs are relative, so the page works under a proxy's prefix.
'use strict';

const API = '../';
const TOKEN_KEY = 'nvpair-token';
const EVENTS_KEPT = 100;
const KNOWN_STATES = ['ready', 'stale', 'starting', 'loading', 'unhealthy', 'down', 'stopped',
  'failed', 'gone', 'forgotten', 'sleeping', 'waking'];

const view = {
  token: sessionStorage.getItem(TOKEN_KEY),
  engines: new Map(),   // name -> status object (GET /v1/engines, then events on top)
  rows: new Map(),      // name -> <tr>
  peers: new Map(),     // node -> peer content (events)
  events: [],           // the last EVENTS_KEPT events, newest last
  history: {},          // name -> points [age_s, latency_ms, latency_ms_max, memory_bytes]
  historyAt: 0,
  node: null, nodeMemory: null, version: null, uptime: null, uptimeAt: 0,
  confirm: null,        // {engine, action} waiting for a yes
  drawer: null,         // the engine whose drawer is open
  drawerHistory: null,  // its last hour (GET /v1/history?engine=)
  logAbort: null,
  groups: new Map(),    // name -> the group's document (the snapshot, then group events)
  lastId: null, retryMs: 2000,
};

// -- small DOM helpers: text only --------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === 'class') node.className = value;
    else if (key === 'title') node.title = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);

function text(id, value) { $(id).textContent = value; }

function ago(seconds) {
  if (seconds === null || seconds === undefined) return '–';
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

function bytes(n) {
  if (typeof n !== 'number') return '–';
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function stateClass(state) {
  return 'state state-' + (KNOWN_STATES.includes(state) ? state : 'other');
}

function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

// -- the API ---------------------------------------------------------------------------

class Unauthorized extends Error {}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (view.token) h.Authorization = `Bearer ${view.token}`;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  opts.cache = 'no-store';
  const response = await fetch(API + path, opts);
  if (response.status === 401) { askToken(); throw new Unauthorized(path); }
  return response;
}

async function getJSON(path) {
  const response = await api(path);
  if (!response.ok) throw new Error(`${path}: ${response.status}`);
  return response.json();
}

function askToken(message) {
  $('login').hidden = false;
  text('login-error', message || (view.token ? 'that token was refused' : ''));
  setLink('stopped', 'needs a token');
}

$('login').addEventListener('submit', (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $('token').value.trim());
  location.reload();
});

function setLink(kind, words) {
  const link = $('link');
  link.className = `link ${kind}`;
  link.textContent = words;
}

function notice(words, source) {  // one line above the tables; cleared by its own source
  const box = $('notice');
  source = source || 'read';
  if (!words && box.dataset.source && box.dataset.source !== source) return;
  box.dataset.source = words ? source : '';
  box.hidden = !words;
  box.textContent = words || '';
}

// -- the event stream: fetch() with the token, resumed with Last-Event-ID ----------------

async function follow() {
  let first = true;
  for (;;) {
    setLink(first ? 'connecting' : 'reconnecting', first ? 'connecting…' : 'reconnecting…');
    first = false;
    try {
      const h = {};
      if (view.lastId) h['Last-Event-ID'] = view.lastId;
      const response = await api('v1/events', { headers: h });
      if (response.status === 503) {
        const wait = Number(response.headers.get('retry-after')) || 2;
        await sleep(wait * 1000);
        continue;
      }
      if (!response.ok || !response.body) throw new Error(`events: ${response.status}`);
      setLink('live', 'live');
      await readEvents(response.body.getReader());
    } catch (err) {
      if (err instanceof Unauthorized) return;
    }
    await sleep(view.retryMs);
  }
}

async function readEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let type = 'message', data = null, id = null;
      for (const raw of block.split('\n')) {
        const line = raw.endsWith('\r') ? raw.slice(0, -1) : raw;
        if (!line || line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let rest = colon < 0 ? '' : line.slice(colon + 1);
        if (rest.startsWith(' ')) rest = rest.slice(1);
        if (field === 'event') type = rest;
        else if (field === 'data') data = data === null ? rest : `${data}\n${rest}`;
        else if (field === 'id') id = rest;
        else if (field === 'retry' && /^\d+$/.test(rest)) view.retryMs = Number(rest);
      }
      if (id !== null) view.lastId = id;
      if (data !== null) handle(type, JSON.parse(data), id);
    }
  }
}

function remember(type, doc, id) {
  view.events.push({ type, doc, id, at: new Date() });
  if (view.events.length > EVENTS_KEPT * 4) view.events.splice(0, view.events.length - EVENTS_KEPT * 4);
}

function handle(type, doc, id) {
  if (type === 'snapshot') {
    view.node = doc.node;
    const names = new Set();
    for (const e of doc.engines || []) {
      names.add(e.name);
      mergeEngine(e, true);
    }
    for (const name of [...view.engines.keys()]) if (!names.has(name)) view.engines.delete(name);
    view.peers = new Map((doc.peers || []).map((p) => [p.node, p]));
    view.groups = new Map((doc.groups || []).map((g) => [g.name, g]));
    remember(type, { engines: names.size }, id);
    renderAll();
    renderGroups([...view.groups.values()]);
    refreshEngines();
    refreshModels();
    refreshHistory();
  } else if (type === 'engine') {
    remember(type, doc, id);
    if (doc.removed) view.engines.delete(doc.name);
    else mergeEngine(doc, false);
    renderEngines(doc.name);
    if (view.drawer === doc.name) renderDrawerEvents();
    refreshEngines();
    if (doc.queued || !$('queue-section').hidden) refreshQueue();
  } else if (type === 'peer') {
    remember(type, doc, id);
    if (doc.state === 'forgotten') view.peers.delete(doc.node);
    else view.peers.set(doc.node, doc);
    renderHeader();
    refreshModels();
  } else if (type === 'models') {
    refreshModels();
  } else if (type === 'group') {  // the group's whole document (no ages): drawn as it is
    remember(type, doc, id);
    view.groups.set(doc.name, doc);
    renderGroups([...view.groups.values()]);
  } else if (type === 'memory') {
    refreshEngines();
  } else if (type === 'bye') {
    setLink('reconnecting', doc.reason === 'keys' ? 'nvpair now asks for a key; reconnecting…'
      : 'nvpair stopped; reconnecting…');
  }
}

function mergeEngine(content, fromSnapshot) {
  const old = view.engines.get(content.name);
  const merged = Object.assign({}, old || {}, content);
  if (!old || old.state !== content.state) {
    if (!old || !fromSnapshot) merged.state_age_s = old ? 0 : null;
    merged.seenAt = performance.now();
  }
  view.engines.set(content.name, merged);
}

// -- reads of the API, coalesced: at most one in flight, one more queued ------------------

function coalesced(fn, gapMs) {
  // one read in flight; asked again meanwhile, one more after it, at least gapMs later
  let running = null, again = false;
  return function run() {
    if (running) { again = true; return running; }
    running = (async () => {
      try { await fn(); } catch (err) { if (!(err instanceof Unauthorized)) notice(String(err.message || err)); }
      if (again && gapMs) await sleep(gapMs);
      running = null;
      if (again) { again = false; run(); }
    })();
    return running;
  };
}

const refreshEngines = coalesced(async () => {
  const doc = await getJSON('v1/engines');
  view.node = doc.node;
  view.nodeMemory = doc.node_memory || (doc.node && typeof doc.node === 'object' ? doc.node.memory : null) || doc.memory || null;
  if (typeof doc.node === 'object' && doc.node) view.node = doc.node.name || view.node;
  const names = new Set();
  for (const e of doc.engines) {
    names.add(e.name);
    e.seenAt = performance.now();
    view.engines.set(e.name, e);
  }
  for (const name of [...view.engines.keys()]) if (!names.has(name)) view.engines.delete(name);
  notice(null);
  renderAll();
}, 500);

const refreshModels = coalesced(async () => {
  const response = await api('v1/models?scope=cluster');
  if (response.status === 403) { renderModels([]); return; }  // a reader's key: no models
  if (!response.ok) throw new Error(`v1/models: ${response.status}`);
  renderModels((await response.json()).data || []);
});

function toPoints(series, step) {  // columns -> [age_s, latency_ms, latency_ms_max, memory_bytes]
  const out = [];
  for (let i = 0; i < series.latency_ms.length; i += 1) {
    out.push([Math.max(0, series.first_age_s - i * step), series.latency_ms[i],
      series.latency_ms_max[i], series.memory_bytes[i]]);
  }
  return out;
}

const refreshHistory = coalesced(async () => {  // the last 10 minutes of every engine
  const doc = await getJSON('v1/history?points=60');
  view.history = {};
  for (const [name, series] of Object.entries(doc.engines || {})) {
    view.history[name] = toPoints(series, doc.step_s);
  }
  view.version = doc.version;
  view.uptime = doc.uptime_s;
  view.uptimeAt = performance.now();
  renderHeader();
  renderEngines();
  if (view.drawer) refreshDrawerHistory();
});

const refreshDrawerHistory = coalesced(async () => {  // the drawer's engine: the last hour
  const name = view.drawer;
  if (!name) return;
  const doc = await getJSON(`v1/history?engine=${encodeURIComponent(name)}`);
  const series = (doc.engines || {})[name];
  view.drawerHistory = series ? toPoints(series, doc.step_s) : [];
  if (view.drawer === name) renderDrawer();
});

// -- rendering -------------------------------------------------------------------------

function renderAll() { renderHeader(); renderEngines(); if (view.drawer) renderDrawer(); }

function renderHeader() {
  text('node', view.node || '…');
  text('version', view.version || '…');
  text('uptime', view.uptime === null ? '…'
    : ago(view.uptime + (performance.now() - view.uptimeAt) / 1000));
  const counts = {};
  for (const p of view.peers.values()) counts[p.state] = (counts[p.state] || 0) + 1;
  const parts = ['fresh', 'one-way', 'stale', 'gone'].filter((s) => counts[s])
    .map((s) => `${counts[s]} ${s}`);
  for (const s of Object.keys(counts)) if (!parts.some((p) => p.endsWith(` ${s}`))) parts.push(`${counts[s]} ${s}`);
  text('peers', parts.length ? parts.join(', ') : 'none');
  const memory = view.nodeMemory;
  $('node-memory-box').hidden = !memory;
  if (memory) {
    const words = [];
    const headroom = memory.headroom_bytes;
    const avail = memory.mem_available ?? memory.available_bytes;
    if (typeof headroom === 'number') words.push(`headroom ${bytes(headroom)}`);
    if (typeof avail === 'number') words.push(`${bytes(avail)} available`);
    if (typeof memory.psi_some_avg10 === 'number') words.push(`pressure ${memory.psi_some_avg10}%`);
    if (memory.trend) words.push(String(memory.trend));
    if (typeof memory.exhaustion_s === 'number') words.push(`runs out in ${ago(memory.exhaustion_s)}`);
    if (memory.unified_memory) words.push('unified memory');
    if (memory.error) words.push(String(memory.error));
    $('node-memory').title = memory.why || '';
    text('node-memory', words.join(' · ') || 'watched');
  }
}

function stateAge(e) {
  if (e.state_age_s === null || e.state_age_s === undefined) return null;
  return e.state_age_s + (performance.now() - (e.seenAt || performance.now())) / 1000;
}

function liveness(e) {
  const probes = e.probes || {};
  return probes.health && probes.health.requests ? probes.health : probes.ready;
}

function probesPerHour(e) {
  if (!e.probes || !view.uptime) return null;
  let total = 0;
  for (const p of Object.values(e.probes)) total += p.requests || 0;
  const hours = (view.uptime + (performance.now() - view.uptimeAt) / 1000) / 3600;
  return hours > 0 ? Math.round(total / hours) : null;
}

function renderEngines(only) {
  const row = only === undefined ? null : view.rows.get(only);
  if (row && view.engines.has(only)) { fillRow(row, view.engines.get(only)); return; }
  const tbody = document.querySelector('#engines tbody');
  const names = [...view.engines.keys()];
  for (const [name, row] of view.rows) {
    if (!view.engines.has(name)) { row.remove(); view.rows.delete(name); }
  }
  for (const name of names) {
    let row = view.rows.get(name);
    if (!row) {
      row = el('tr', { class: 'engine' });
      row.dataset.engine = name;
      view.rows.set(name, row);
    }
    fillRow(row, view.engines.get(name));
    tbody.append(row);  // keeps the order of the engines; never a second row for a name
  }
  $('no-engines').hidden = names.length > 0;
}

function fillRow(row, e) {
  const age = stateAge(e);
  const state = el('span', { class: stateClass(e.state) }, e.state,
    age === null ? null : el('span', { class: 'age' }, ` · ${ago(age)}`));
  state.dataset.state = e.state;
  const live = liveness(e);
  const identity = e.identity ? [e.identity.model, e.identity.version].filter(Boolean).join(' @ ') : '';
  const memory = e.memory;
  const memCell = el('td', { class: 'memory' });
  if (memory && typeof memory.rss_anon_bytes === 'number') {  // (no process: no trend shown)
    memCell.title = [memory.why, memory.error].filter(Boolean).join('; ');
    memCell.append(bytes(memory.rss_anon_bytes + (memory.swap_bytes || 0)));
    if (memory.trend) {
      memCell.append(' ', el('span', { class: `trend-${String(memory.trend).replace(/[^a-z]/g, '')}` }, String(memory.trend)));
    }
    if (typeof memory.slope_bytes_per_h === 'number' && memory.slope_bytes_per_h) memCell.append(` ${memory.slope_bytes_per_h > 0 ? '+' : ''}${bytes(memory.slope_bytes_per_h)}/h`);
    if (typeof memory.exhaustion_s === 'number') memCell.append(el('div', { class: 'quiet' }, `runs out in ${ago(memory.exhaustion_s)}`));
  } else memCell.append('–');
  const cells = [
    el('td', {}, el('button', { class: 'name', type: 'button', title: 'details', onclick: () => openDrawer(e.name) }, e.name)),
    el('td', {}, e.kind || ''),
    el('td', { class: 'state-cell' }, state),
    el('td', { class: 'models' }, (e.models || []).join(', ') || '–', e.models_stale ? el('span', { class: 'quiet' }, ' (stale list)') : null),
    el('td', {}, identity || '–'),
    el('td', { class: 'num' }, probesPerHour(e) ?? '–'),
    el('td', { class: 'num' }, live && live.latency_ms !== null && live.latency_ms !== undefined ? `${live.latency_ms} ms` : '–'),
    el('td', {}, spark(view.history[e.name], 110, 26)),
    el('td', { class: 'num' }, e.restarts ?? 0),
    memCell,
    el('td', { class: 'err', title: e.error || '' }, e.error ? e.error.slice(0, 160) : ''),
    el('td', { class: 'actions' }, ...actions(e)),
  ];
  row.replaceChildren(...cells);
}

function actions(e) {
  if (!e.managed) return [];  // adopted: nvpair never starts or stops it
  if (view.confirm && view.confirm.engine === e.name) {
    const action = view.confirm.action;
    return [el('span', {}, `${action} ${e.name}? `),
      el('button', { type: 'button', class: 'danger confirm', onclick: () => act(e.name, action) }, `yes, ${action}`),
      el('button', { type: 'button', class: 'cancel', onclick: () => { view.confirm = null; renderEngines(); } }, 'no')];
  }
  return ['start', 'stop', 'restart'].map((action) => el('button', {
    type: 'button', class: `act act-${action}`,
    onclick: () => { view.confirm = { engine: e.name, action }; renderEngines(); },
  }, action));
}

async function act(name, action) {
  view.confirm = null;
  renderEngines();
  try {
    const response = await api(`v1/engines/${encodeURIComponent(name)}/${action}`, { method: 'POST' });
    if (!response.ok) {
      let why = `${action} ${name}: ${response.status}`;
      try { why = `${action} ${name}: ${(await response.json()).error.message}`; } catch (err) { /* not JSON */ }
      notice(why, 'action');
    } else notice(null, 'action');
  } catch (err) {
    if (!(err instanceof Unauthorized)) notice(`${action} ${name}: ${err.message || err}`, 'action');
  }
}

// -- charts (SVG drawn here) -------------------------------------------------------------

const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  return node;
}

function line(points, x, y, cls) {
  const coords = points.filter((p) => p[1] !== null && p[1] !== undefined)
    .map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
  if (!coords.length) return null;
  if (coords.length === 1) coords.push(coords[0].replace(/^[\d.]+/, (v) => String(Number(v) + 2)));
  return svg('polyline', { points: coords.join(' '), class: cls });
}

function spanOf(points) {  // the chart's width in seconds: the data's, from 5 min to an hour
  const oldest = Math.max(0, ...(points || []).map((p) => p[0]));
  return Math.min(3600, Math.max(300, Math.ceil(oldest / 300) * 300));
}

function spark(points, width, height) {
  const box = svg('svg', { class: 'spark', width, height, viewBox: `0 0 ${width} ${height}` });
  if (!points || !points.length) return box;
  const span = spanOf(points);
  const lat = points.map((p) => [p[0], p[1]]);
  const top = Math.max(1, ...lat.filter((p) => p[1] !== null).map((p) => p[1]));
  const x = (age) => width - (Math.min(age, span) / span) * width;
  const y = (v) => height - 2 - (v / top) * (height - 4);
  const path = line(lat, x, y, 'lat');
  if (path) box.append(path);
  box.append(svg('title', {}));
  box.lastChild.textContent = `probe latency, last ${span / 60} min (up to ${top} ms)`;
  return box;
}

function chart(points, width, height) {
  const box = svg('svg', { class: 'chart', width, height, viewBox: `0 0 ${width} ${height}` });
  const pad = 30, span = spanOf(points);
  const x = (age) => width - 4 - (Math.min(age, span) / span) * (width - pad - 4);
  box.append(svg('line', { x1: pad, y1: height - 14, x2: width - 4, y2: height - 14, class: 'axis' }));
  const label = (tx, ty, words, anchor) => {
    const t = svg('text', { x: tx, y: ty, 'text-anchor': anchor || 'start' });
    t.textContent = words;
    box.append(t);
  };
  label(pad, height - 2, `-${span / 60} min`);
  label(width - 4, height - 2, 'now', 'end');
  if (!points || !points.length) { label(width / 2, height / 2, 'no probe results yet', 'middle'); return box; }
  const lat = points.map((p) => [p[0], p[2] ?? p[1]]).filter((p) => p[1] !== null);
  const top = Math.max(1, ...lat.map((p) => p[1]));
  const y = (v) => height - 16 - (v / top) * (height - 30);
  const path = line(lat, x, y, 'lat');
  if (path) box.append(path);
  label(2, 12, `${top} ms`);
  const mem = points.filter((p) => typeof p[3] === 'number').map((p) => [p[0], p[3]]);
  if (mem.length) {
    const low = Math.min(...mem.map((p) => p[1])), high = Math.max(...mem.map((p) => p[1]));
    const range = Math.max(1, high - low);
    const ym = (v) => height - 16 - ((v - low) / range) * (height - 30);
    const mpath = line(mem, x, ym, 'mem');
    if (mpath) box.append(mpath);
    label(width - 4, 12, `memory ${bytes(low)}–${bytes(high)}`, 'end');
  }
  label(pad + 40, 12, 'probe latency (max per 10 s)');
  return box;
}

// -- the drawer: one engine's chart, probes, log and events ------------------------------

function openDrawer(name) {
  if (view.logAbort) view.logAbort.abort();
  view.drawer = name;
  view.drawerHistory = null;
  $('drawer').hidden = false;
  refreshDrawerHistory();
  text('drawer-log', '');
  renderDrawer();
  const e = view.engines.get(name);
  if (e && e.managed) followLog(name);
  else text('drawer-log', 'adopted engine: nvpair did not start it and keeps no log of it');
}

$('drawer-close').addEventListener('click', () => {
  if (view.logAbort) view.logAbort.abort();
  view.logAbort = null;
  view.drawer = null;
  $('drawer').hidden = true;
});

function renderDrawer() {
  const e = view.engines.get(view.drawer);
  text('drawer-title', view.drawer + (e ? ` (${e.kind || ''}, ${e.state})` : ' (gone)'));
  $('drawer-chart').replaceChildren(chart(view.drawerHistory || view.history[view.drawer], 600, 160));
  const tbody = document.querySelector('#drawer-probes tbody');
  const rows = [];
  for (const [name, p] of Object.entries((e && e.probes) || {})) {
    rows.push(el('tr', {},
      el('td', {}, name), el('td', {}, p.path || ''),
      el('td', { class: 'when' }, p.ok === null || p.ok === undefined ? '–' : `${p.ok ? 'ok' : 'failed'} ${p.http_status ?? ''} · ${ago(p.age_s)} ago`),
      el('td', { class: 'num' }, p.latency_ms ?? '–'), el('td', { class: 'num' }, p.latency_ms_mean ?? '–'),
      el('td', { class: 'num' }, p.latency_ms_max ?? '–'), el('td', { class: 'num' }, p.requests ?? 0),
      el('td', { class: 'num' }, p.failures ?? 0), el('td', { class: 'err' }, p.error || '')));
  }
  tbody.replaceChildren(...rows);
  renderDrawerEvents();
}

function renderDrawerEvents() {
  const mine = view.events.filter((ev) => ev.type === 'engine' && ev.doc.name === view.drawer)
    .slice(-EVENTS_KEPT);
  if (!mine.length) {
    $('drawer-events').replaceChildren(el('li', { class: 'quiet' }, 'no change since this page opened'));
    return;
  }
  $('drawer-events').replaceChildren(...mine.reverse().map((ev) => el('li', {},
    `${ev.at.toLocaleTimeString()} ${ev.doc.removed ? 'removed' : ev.doc.state}`,
    ev.doc.error ? el('span', { class: 'error' }, ` ${ev.doc.error}`) : null)));
}

async function followLog(name) {
  const abort = new AbortController();
  view.logAbort = abort;
  const pre = $('drawer-log');
  let next = null;
  while (!abort.signal.aborted) {
    try {
      const query = next === null ? 'tail=200' : `after=${next}&wait_s=25`;
      const response = await api(`v1/engines/${encodeURIComponent(name)}/logs?${query}`,
        { signal: abort.signal });
      if (!response.ok) { pre.textContent = `no log: ${response.status}`; return; }
      const doc = await response.json();
      if (abort.signal.aborted) return;
      if (doc.missed) pre.append(`[${doc.missed} lines missed]\n`);
      if (doc.lines.length) {
        const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        pre.append(doc.lines.join('\n') + '\n');
        while (pre.textContent.length > 200000) pre.firstChild.remove();
        if (stick) pre.scrollTop = pre.scrollHeight;
      }
      next = doc.next;
    } catch (err) {
      if (abort.signal.aborted || err instanceof Unauthorized) return;
      await sleep(2000);
    }
  }
}

// -- models and groups -------------------------------------------------------------------

function renderModels(items) {
  const tbody = document.querySelector('#models tbody');
  tbody.replaceChildren(...items.map((m) => {
    const nv = m.nvpair || {};
    const state = nv.state || '';
    const age = nv.checked_age_s ?? nv.age_s;
    return el('tr', { class: 'model' },
      el('td', {}, m.id),
      el('td', {}, nv.node || ''),
      el('td', {}, (nv.engines || (nv.engine ? [nv.engine] : [])).join(', ')),
      el('td', {}, el('span', { class: stateClass(state) }, state + (nv.stale && state !== 'stale' ? ' (stale)' : ''))),
      el('td', {}, age === null || age === undefined ? '–' : `${ago(age)} ago`));
  }));
}

// GET /v1/queue, read while anything waits (an engine event says so), once a second at most
const refreshQueue = coalesced(async () => {
  const response = await api('v1/queue');
  if (!response.ok) return;  // (a key that may not read: no section)
  const engines = Object.entries((await response.json()).engines || {})
    .filter(([, q]) => q.depth > 0);
  $('queue-section').hidden = !engines.length;
  document.querySelector('#queue tbody').replaceChildren(...engines.map(([name, q]) => el('tr', {},
    el('td', {}, name),
    el('td', {}, String(q.depth)),
    el('td', {}, q.oldest_wait_s === null ? '–' : ago(q.oldest_wait_s)),
    el('td', {}, Object.entries(q.keys).map(([k, v]) => `${k}: ${v.depth}`).join(', ')),
    el('td', {}, q.waiting.slice(0, 5).map((w) => w.key ?? '(no key)').join(', ')),
    el('td', { class: 'quiet' }, q.blocked || ''))));
  if (engines.length) setTimeout(refreshQueue, 1000);  // (ages move while they wait)
}, 1000);

function renderGroups(doc) {
  const groups = Array.isArray(doc) ? doc : (doc.groups || Object.values(doc).filter((g) => g && typeof g === 'object'));
  $('groups-section').hidden = !groups.length;
  $('groups').replaceChildren(...groups.map((g) => {
    const ranks = Array.isArray(g.ranks) ? g.ranks : Object.values(g.ranks || {});
    const history = Array.isArray(g.history) ? g.history.slice(0, 10) : [];  // newest first
    return el('div', { class: 'group' },
      el('h3', {}, `${g.name ?? ''} `, el('span', { class: stateClass(g.state) }, g.state ?? '?'),
        g.epoch === undefined || g.epoch === null ? null : ` epoch ${g.epoch}`,
        typeof g.ranks_ready === 'number' && ranks.length > 1
          ? ` · ${g.ranks_ready}/${ranks.length - 1} ranks ready` : null),
      el('div', { class: 'groups-grid' }, ...ranks.map((r, i) => el('div', { class: 'rank', 'data-rank': r.rank ?? i },
        `rank ${r.rank ?? i}`, r.node ? ` · ${r.node}` : null, ' ',
        el('span', { class: stateClass(r.state) }, r.state ?? '?')))),
      g.error ? el('p', { class: 'error' }, g.error) : null,
      history.length ? el('ol', { class: 'quiet' }, ...history.map((h) => el('li', {},
        typeof h === 'string' ? h : `epoch ${h.epoch ?? '?'}${h.reason ? `: ${h.reason}` : ''}`))) : null);
  }));
}

// -- start -----------------------------------------------------------------------------

function tick() {  // ages move: only their text, so a button is never replaced under a click
  renderHeader();
  for (const [name, row] of view.rows) {
    const span = row.querySelector('.age');
    const age = stateAge(view.engines.get(name) || {});
    if (span && age !== null) span.textContent = ` · ${ago(age)}`;
  }
}

setInterval(tick, 1000);
setInterval(() => {  // counters and charts (groups and everything else come as events)
  refreshHistory();
  refreshEngines();
}, 10000);
follow();
