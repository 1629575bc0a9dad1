// Swactor's dashboard: keeps the page live from the daemon's event stream
// (/events, server-sent events of the telemetry publisher) and sends the
// controls to the daemon. Hand-written, no dependencies.
'use strict';

const HOUR_MS = 3600 * 1000;
const LOG_MAX = 300;

const S = {
  snap: null,          // the cluster (a status snapshot), kept current by events
  snapWall: 0,         // Date.now() when snap.now was the cluster's clock
  groups: [],          // [{id, desired, ready}]
  away: {},            // node -> wall ms its agent was seen going away
  renewed: {},         // node -> {attempt, at: wall ms} of its lease's last renewal
  points: [],          // [{at_ms, ready, passes}] for the plot
  lastSeq: 0,
  convergedGen: null,  // the last generation the cluster said it converged on
  leader: '',          // who leads and who stands by, as the last status answer said; '' for a daemon alone
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : String(c ?? ''));
  return e;
}

// ----- time -----

// The cluster's clock now: its snapshot's reading plus the time since.
function clusterNow() {
  return S.snap.now + (Date.now() - S.snapWall);
}

function span(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 90) return s + ' s';
  if (s < 5400) return Math.round(s / 60) + ' min';
  return (s / 3600).toFixed(1) + ' h';
}

// A span as `swactor status` gives a lifetime: `45 s`, `12 min`,
// `2 h 10 min`, `3 d 4 h`; rounded up when `up`, else down.
function spanFine(secs, up) {
  secs = Math.max(0, Math.floor(secs));
  if (secs < 120) return secs + ' s';
  const [unit, small, word] = secs < 7200 ? [60, 0, 'min'] : secs < 172800 ? [3600, 60, 'h'] : [86400, 3600, 'd'];
  const step = small || unit;
  const t = (up ? Math.ceil(secs / step) : Math.floor(secs / step)) * step;
  const big = Math.floor(t / unit);
  const rest = t % unit;
  if (!rest || !small) return `${big} ${word}`;
  return small === 60 ? `${big} ${word} ${rest / 60} min` : `${big} ${word} ${rest / 3600} h`;
}

function clock(wallMs) {
  return new Date(wallMs).toLocaleTimeString([], { hour12: false });
}

// ----- words -----

function stateWord(n) {
  if (n.intent === 'Deleting') return n.stage === 'Failed' || n.failures > 0 ? 'failed' : 'deleting';
  if (n.agent && n.agent.Away) return 'disconnected';
  if (n.ready) return 'ready';
  switch (n.stage) {
    case 'New': case 'LeaseRequested': case 'LeaseCreated': return 'creating';
    case 'EndpointKnown': case 'BootstrapRunning': return 'booting';
    case 'Failed': return 'failed';
    case 'Destroyed': return 'restarting';
    default: return 'joining';
  }
}

// The lease of a connected agent: when this daemon last renewed it (what
// the last status answer said, aged since) and how long the node outlives
// its daemon.
function leaseWord(n) {
  const r = S.renewed[n.node];
  const renewed = r && r.attempt === n.attempt ? ' · lease renewed ' + span(Date.now() - r.at) + ' ago' : '';
  const ends = n.orphan_after_s ? ' · ends itself ' + spanFine(n.orphan_after_s, false) + ' after its daemon goes' : '';
  return renewed + ends;
}

function agentWord(n) {
  if (!n.agent || n.agent === 'NotJoined') return 'not joined';
  if (n.agent === 'Connected') return 'connected' + leaseWord(n);
  if (n.agent.Away) {
    const since = S.away[n.node];
    const left = n.agent.Away.grace_until - clusterNow();
    return 'disconnected' + (since ? ' since ' + clock(since) : '') +
      (left > 0 ? ' (grace ' + span(left) + ' more)' : ' (grace over)');
  }
  return '';
}

function retryWord(n) {
  if (n.next_retry_at == null) return '';
  const left = n.next_retry_at - clusterNow();
  return left > 0 ? 'in ' + span(left) : 'now';
}

function groupOf(node) {
  const i = node.lastIndexOf('-');
  return i < 0 ? node : node.slice(0, i);
}

function eventText(ev) {
  if (typeof ev === 'string') return ev === 'Paused' ? 'reconciling paused' : ev;
  const [kind, v] = Object.entries(ev)[0];
  switch (kind) {
    case 'ShapeAccepted': return `generation ${v.generation} accepted (${v.nodes} node(s))`;
    case 'Node': return `${v.node} a${v.attempt}: ${stateWord(v)} (${v.stage})` + (v.last_error && !v.ready ? ` — ${v.last_error}` : '');
    case 'Removed': return `${v.node} removed`;
    case 'Dispatched': return `${v.node}: ${v.effect}`;
    case 'Finished': return `${v.node}: ${v.outcome}` + (v.folded ? '' : ' (stale, discarded)');
    case 'Pass': return `pass ${v.number}: ${v.transitions} transition(s), ${v.dispatched} dispatched`;
    case 'Converged': return `converged on generation ${v.generation} with ${v.nodes} node(s)`;
    case 'Warning': return `warning: ${v.message}`;
    case 'Adopted': return `adopted ${v.adopted.length} node(s), ${v.orphans.length} orphan(s)`;
    case 'Swept': return `sweep found ${v.orphans.length} orphan(s)`;
    case 'Hold': return `group ${v.group}: ` + (v.reason || (v.kind === 'Rollout' ? 'rollout goes on' : 'remediation resumed'));
    case 'Collected': return `orphan ${v.key.node} a${v.key.attempt} ` + (v.error ? `not collected: ${v.error}` : 'collected');
    case 'AgentJoined': return `${v.key.node} a${v.key.attempt}: agent joined`;
    case 'AgentDisconnected': return `${v.key.node} a${v.key.attempt}: agent disconnected`;
    case 'TeardownStarted': return `teardown started (generation ${v.generation})`;
    case 'Resumed': return v.by_teardown ? 'resumed by the teardown' : 'reconciling resumed';
    default: return kind;
  }
}

// ----- rendering -----

// Converged: the cluster said so for this generation, and every desired
// node is (again) ready with nothing else left over.
function converged() {
  const s = S.snap;
  if (s.converged) S.convergedGen = s.generation;
  const ready = s.nodes.filter((n) => n.ready).length;
  return S.convergedGen === s.generation && ready === s.desired_nodes &&
    s.nodes.length === ready && !s.orphans;
}

// When the run tears itself down (its shape's max_lifetime_s or
// idle_teardown_s), counted down from the snapshot's reading; '' if never.
function lifetimeText(s) {
  const l = s.lifetime;
  if (!l) return '';
  const field = (which) => (which === 'MaxLifetime' ? 'max_lifetime_s' : 'idle_teardown_s');
  const v = l.verdict;
  if (v === 'Unbounded') {
    return `no idle teardown while a job runs (idle_teardown_s: ${spanFine(l.lifetime.idle_teardown_s, false)})`;
  }
  if (v.Reached) return `tearing down: ${field(v.Reached)} reached`;
  const since = Math.max(0, Date.now() - S.snapWall);
  const left = Math.max(0, v.Within.left_ms - since);
  const idle = v.Within.which === 'IdleTeardown' && l.idle_ms != null
    ? `: idle ${spanFine((l.idle_ms + since) / 1000, false)}` : '';
  return `tears down in ${spanFine(Math.ceil(left / 1000), true)} (${field(v.Within.which)}${idle})`;
}

function headline() {
  const s = S.snap;
  const h = $('headline');
  const nodes = s.nodes.filter((n) => n.intent !== 'Deleting');
  const ready = nodes.filter((n) => n.ready).length;
  let text;
  let cls;
  if (s.shutting_down) {
    text = 'tearing down: ' + s.nodes.length + ' node(s) left';
    cls = 'busy';
  } else if (converged()) {
    text = `converged: ${ready} of ${s.desired_nodes} node(s) ready`;
    cls = 'ok';
  } else {
    const why = [];
    const waiting = s.nodes.filter((n) => !n.ready);
    if (s.paused) why.push('reconciling is paused (Resume to go on)');
    if (ready < s.desired_nodes) why.push(`${ready} of ${s.desired_nodes} node(s) ready`);
    const failing = waiting.filter((n) => n.last_error);
    if (failing.length) why.push(`${failing[0].node}: ${failing[0].last_error}` + (failing.length > 1 ? ` (and ${failing.length - 1} more failing)` : ''));
    for (const hold of s.holds || []) why.push(`group ${hold.group}: ${hold.reason}`);
    if (s.orphans) why.push(`${s.orphans} leftover resource(s) being collected`);
    if (!s.adopted) why.push('adopting what an earlier daemon left');
    if (!why.length) why.push('the cluster has not confirmed it yet');
    text = 'not converged: ' + why.join('; ');
    cls = 'busy';
  }
  if (s.paused && cls === 'ok') text += ' (paused)';
  const micros = (s.rentals || []).reduce((sum, r) => sum + r.usd_per_hour_micros, 0);
  if (micros > 0) text += ` · rented machines $${(micros / 1e6).toFixed(2)}/h`;
  if (s.spend && (s.spend.spent_micros > 0 || s.budget)) {
    text += ` · spent $${(s.spend.spent_micros / 1e6).toFixed(2)}`;
    if (s.budget) text += ` of a $${(s.budget.usd_micros / 1e6).toFixed(2)} budget`;
  }
  const lifetime = lifetimeText(s);
  if (lifetime) text += ` · ${lifetime}`;
  const foreign = (s.foreign || []).length;
  if (foreign) text += ` · ${foreign} resource(s) of this run belong to another deployment (see status)`;
  h.textContent = text;
  h.className = cls;
  const leader = $('leader');
  if (leader.textContent !== S.leader) leader.textContent = S.leader;
  leader.hidden = !S.leader;
  $('generation').textContent = s.generation;
}

function renderGroups() {
  const body = $('groups').tBodies[0];
  const ready = {};
  for (const n of S.snap.nodes) if (n.ready) ready[groupOf(n.node)] = (ready[groupOf(n.node)] || 0) + 1;
  for (const g of S.groups) {
    let row = body.querySelector(`tr[data-group="${CSS.escape(g.id)}"]`);
    if (!row) {
      const input = el('input', { type: 'number', min: '0', id: 'count-' + g.id, value: g.desired });
      row = el('tr', { 'data-group': g.id },
        el('td', {}, g.id),
        el('td', { class: 'num' }, el('span', { class: 'ready' }), ' / ', el('span', { class: 'desired' })),
        el('td', {}, input, ' ', el('button', { 'data-scale': g.id }, 'Scale')));
      body.append(row);
    }
    row.querySelector('.ready').textContent = ready[g.id] || 0;
    row.querySelector('.desired').textContent = g.desired;
  }
  for (const row of [...body.rows]) {
    if (!S.groups.some((g) => g.id === row.dataset.group)) row.remove();
  }
}

// Rows are updated in place (not rebuilt), so a click is never lost to a redraw.
function renderNodes() {
  const body = $('nodes').tBodies[0];
  const keep = new Set();
  let prev = null;
  for (const n of S.snap.nodes) {
    const id = 'node-' + n.node;
    keep.add(id);
    let row = document.getElementById(id);
    if (!row || row.cells.length !== 10) {
      const fresh = el('tr', { id },
        el('td', {}, el('a', { href: '#', 'data-node': n.node }, n.node)),
        ...Array.from({ length: 8 }, (_, i) => el('td', i === 4 ? { class: 'num' } : i === 5 ? { class: 'err' } : {})),
        el('td', {}, el('button', { 'data-replace': n.node }, 'Replace')));
      if (row) row.replaceWith(fresh);
      row = fresh;
    }
    row.dataset.ready = String(n.ready);
    row.dataset.attempt = String(n.attempt);
    row.dataset.stage = n.stage;
    const texts = [
      stateWord(n),
      n.stage + (n.pending ? ` (${n.pending}…)` : ''),
      'a' + n.attempt,
      n.resource || n.lease || '',
      String(n.failures),
      n.ready ? '' : (n.last_error || ''),
      retryWord(n),
      agentWord(n),
    ];
    texts.forEach((t, i) => {
      const cell = row.cells[i + 1];
      if (cell.textContent !== t) cell.textContent = t;
    });
    const after = prev ? prev.nextElementSibling : body.firstElementChild;
    if (after !== row) {
      if (prev) prev.after(row); else body.prepend(row);
    }
    prev = row;
  }
  for (const row of [...body.rows]) if (!keep.has(row.id)) row.remove();
}

function renderPlot() {
  const svg = $('plot');
  const now = Date.now();
  const pts = S.points.filter((p) => p.at_ms > now - HOUR_MS);
  // The line runs on to now at the current count.
  pts.push({ at_ms: now, ready: S.snap.nodes.filter((n) => n.ready).length, passes: S.snap.stats.passes });
  const W = 600, H = 160, pad = 4;
  // The time axis spans what there is to show: 5 minutes at least, an hour at most.
  const spanMs = Math.min(HOUR_MS, Math.max(5 * 60000, now - pts[0].at_ms));
  const x = (t) => pad + (W - 2 * pad) * (1 - (now - t) / spanMs);
  const readyMax = Math.max(1, S.snap.desired_nodes, ...pts.map((p) => p.ready));
  const rates = [];
  // Rates over at least 5 s, so two close points do not make a spike.
  let from = pts[0];
  for (const p of pts.slice(1)) {
    const dt = (p.at_ms - from.at_ms) / 60000;
    if (dt >= 5 / 60) {
      rates.push({ at_ms: p.at_ms, rate: Math.max(0, p.passes - from.passes) / dt });
      from = p;
    }
  }
  const rateMax = Math.max(1, ...rates.map((r) => r.rate));
  const line = (list, val, max) => list.map((p) => `${x(p.at_ms).toFixed(1)},${(H - pad - (H - 2 * pad) * val(p) / max).toFixed(1)}`).join(' ');
  const ns = 'http://www.w3.org/2000/svg';
  const poly = (points, color) => {
    const p = document.createElementNS(ns, 'polyline');
    p.setAttribute('points', points);
    p.setAttribute('fill', 'none');
    p.setAttribute('stroke', color);
    p.setAttribute('stroke-width', '2');
    p.setAttribute('vector-effect', 'non-scaling-stroke');
    return p;
  };
  svg.replaceChildren(poly(line(pts, (p) => p.ready, readyMax), '#17803d'), poly(line(rates, (r) => r.rate, rateMax), '#2563eb'));
  $('plot-range').textContent = `the last ${span(spanMs)}; top of the plot: ${readyMax} node(s), ${Math.round(rateMax)} passes/min`;
}

function render() {
  headline();
  renderGroups();
  renderNodes();
  renderPlot();
}

function log(atMs, text) {
  const box = $('log');
  box.append(el('div', {}, clock(atMs) + '  ' + text));
  while (box.childNodes.length > LOG_MAX) box.firstChild.remove();
  box.scrollTop = box.scrollHeight;
}

function say(text, bad) {
  const m = $('message');
  m.textContent = text;
  m.className = bad ? 'bad' : '';
}

// ----- data -----

function sample() {
  const ready = S.snap.nodes.filter((n) => n.ready).length;
  S.points.push({ at_ms: Date.now(), ready, passes: S.snap.stats.passes });
  while (S.points.length && S.points[0].at_ms < Date.now() - HOUR_MS) S.points.shift();
}

function takeOverview(o) {
  S.snap = o.status;
  S.snapWall = Date.now();
  S.groups = o.groups;
  // Only daemons that share their run (`swactor up --etcd`) say who leads.
  S.leader = o.leader || '';
  // Only a status answer says when leases were renewed; node events do not.
  for (const n of S.snap.nodes) {
    if (n.lease_renewed_ms_ago != null) S.renewed[n.node] = { attempt: n.attempt, at: Date.now() - n.lease_renewed_ms_ago };
  }
}

// Jobs: queued ones with why they wait, then what ran; refreshed every 2 s.
async function refreshJobs() {
  try {
    const r = await fetch('/api/jobs', { credentials: 'same-origin' });
    if (!r.ok) return;
    const j = await r.json();
    const body = document.querySelector('#jobs tbody');
    const count = document.getElementById('jobs-count');
    count.textContent = j.total === 0 ? '' : `${j.queued} queued · ${j.total} in all`;
    if (j.jobs.length === 0) {
      body.innerHTML = '<tr><td colspan="5" class="note">no jobs yet (<code>swactor run --all -- hostname</code> starts one)</td></tr>';
      return;
    }
    body.replaceChildren(...j.jobs.map((job) => {
      const tr = document.createElement('tr');
      tr.dataset.job = job.id;
      tr.dataset.state = job.state;
      const where = job.gang
        ? `gang of ${job.gang.nodes}` + (job.gang.restarts ? ` · restart ${job.gang.restarts} of ${job.gang.retry}` : '') + (job.nodes.length ? `: ${job.nodes.join(', ')}` : '')
        : job.nodes.join(', ');
      const progress = job.waiting != null ? job.waiting
        : job.runs === 0 ? (job.ended || '')
        : `${job.succeeded}/${job.runs} succeeded`;
      for (const text of [job.id, job.state + (job.priority ? ` (priority ${job.priority})` : ''), where, progress, job.command]) {
        const td = document.createElement('td');
        td.textContent = text;
        tr.appendChild(td);
      }
      return tr;
    }));
  } catch (e) { /* the event stream reports the connection */ }
}
refreshJobs();
setInterval(refreshJobs, 2000);

let refreshing = null;
function refreshSoon() {
  if (refreshing) return;
  refreshing = setTimeout(async () => {
    refreshing = null;
    try {
      const r = await fetch('/api/status', { credentials: 'same-origin' });
      if (r.ok) { takeOverview(await r.json()); render(); }
    } catch (e) { /* the event stream reports the connection */ }
  }, 300);
}

function upsert(n) {
  const nodes = S.snap.nodes;
  const i = nodes.findIndex((m) => m.node === n.node);
  if (i >= 0) nodes[i] = n; else { nodes.push(n); nodes.sort((a, b) => a.node.localeCompare(b.node, undefined, { numeric: true })); }
  if (!n.ready) S.snap.converged = false;
  if (!(n.agent && n.agent.Away)) delete S.away[n.node];
}

function onEvent(d) {
  S.lastSeq = d.seq;
  const ev = d.event;
  log(d.at_ms, eventText(ev));
  if (ev === 'Paused') { S.snap.paused = true; return; }
  const [kind, v] = Object.entries(ev)[0];
  switch (kind) {
    case 'Node': upsert(v); break;
    case 'Removed': S.snap.nodes = S.snap.nodes.filter((n) => n.node !== v.node); break;
    case 'ShapeAccepted': S.snap.generation = v.generation; S.snap.desired_nodes = v.nodes; S.snap.converged = false; refreshSoon(); break;
    case 'Converged': S.snap.converged = true; S.convergedGen = v.generation; S.snap.observed_generation = v.generation; refreshSoon(); break;
    case 'Pass': S.snap.stats.passes = v.number; break;
    case 'Resumed': S.snap.paused = false; break;
    case 'Hold': refreshSoon(); break;
    case 'AgentDisconnected': S.away[v.key.node] = d.at_ms; break;
    case 'TeardownStarted': S.snap.shutting_down = 'Teardown'; S.snap.generation = v.generation; break;
    default: break;
  }
}

let dirty = false;
function changed() {
  if (dirty) return;
  dirty = true;
  requestAnimationFrame(() => { dirty = false; render(); });
}

function connect() {
  const es = new EventSource('/events');
  es.addEventListener('open', () => { $('conn').textContent = 'live'; });
  es.addEventListener('error', () => { $('conn').textContent = 'reconnecting…'; });
  es.addEventListener('snapshot', (e) => {
    const d = JSON.parse(e.data);
    // The publisher's snapshot, then every event after it.
    // What only a status answer holds (prices, spend, foreign resources,
    // who leads) is kept until the next one.
    const kept = S.snap || {};
    S.snap = d.state;
    S.snap.rentals = kept.rentals || [];
    S.snap.spend = kept.spend;
    S.snap.foreign = kept.foreign || [];
    S.snap.ha = kept.ha;
    S.snapWall = Date.now();
    S.lastSeq = d.seq;
    refreshSoon();
    changed();
  });
  es.addEventListener('event', (e) => { onEvent(JSON.parse(e.data)); changed(); });
  es.addEventListener('lagged', (e) => {
    log(Date.now(), `missed ${JSON.parse(e.data).missed} event(s); reloading the state`);
    refreshSoon();
  });
}

// ----- controls -----

async function post(path, body) {
  const r = await fetch(path, {
    method: 'POST',
    credentials: 'same-origin',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(body || {}),
  });
  let answer = {};
  try { answer = await r.json(); } catch (e) { /* no body */ }
  if (!r.ok) {
    const e = new Error(answer.error || `${r.status} ${r.statusText}`);
    e.confirm = answer.confirm;
    throw e;
  }
  return answer;
}

async function act(what, path, body, done) {
  say(what + '…');
  try {
    const answer = await post(path, body);
    say(done(answer));
  } catch (e) {
    say(e.message, true);
  }
}

// Asks in the page's own dialog; resolves to true when confirmed.
function ask(question) {
  const d = $('confirm-dialog');
  $('confirm-text').textContent = question;
  d.returnValue = '';
  d.showModal();
  return new Promise((resolve) => {
    d.addEventListener('close', () => resolve(d.returnValue === 'confirm'), { once: true });
  });
}

// Scales a group; a change `apply` would ask about is asked about here too.
async function scale(g, count) {
  const done = (a) => a.message + (a.paused ? ' (paused: acted on after Resume)' : '');
  say(`scaling ${g} to ${count}…`);
  try {
    say(done(await post('/api/scale', { group: g, count })));
  } catch (e) {
    if (!e.confirm) { say(e.message, true); return; }
    if (!(await ask(e.confirm + '. Go ahead?'))) { say('nothing was changed'); return; }
    act(`scaling ${g} to ${count}`, '/api/scale', { group: g, count, yes: true }, done);
  }
}

async function showNode(node) {
  const box = $('detail');
  box.style.display = 'block';
  box.replaceChildren(el('p', {}, 'loading ' + node + '…'));
  try {
    const r = await fetch('/api/node/' + encodeURIComponent(node), { credentials: 'same-origin' });
    const d = await r.json();
    if (!r.ok) throw new Error(d.error);
    const n = d.node;
    const rows = n.attempts.map((a) => el('tr', {},
      el('td', {}, 'a' + a.attempt), el('td', {}, a.stage),
      el('td', {}, a.ready_at != null ? 'ready' : ''),
      el('td', {}, a.ended_at != null ? 'ended' : 'current'),
      el('td', { class: 'err' }, a.failed_reason || a.last_error || '')));
    const table = el('table', {}, el('thead', {}, el('tr', {},
      el('th', {}, 'attempt'), el('th', {}, 'stage'), el('th', {}, 'ready'), el('th', {}, ''), el('th', {}, 'why it failed'))),
    el('tbody', {}, ...rows));
    const log = d.log
      ? [el('p', {}, `last lines of attempt a${d.log.attempt}'s log` + (d.log.live ? '' : ' (kept after it ended)')), el('pre', {}, d.log.lines.join('\n'))]
      : [el('p', {}, 'no local log (only process nodes keep theirs here)')];
    box.replaceChildren(
      el('h2', {}, `${n.node}` + (n.desired ? '' : ' (no longer desired)')),
      el('p', {}, 'lease: ' + (n.lease || 'none') + (n.failed_reason ? ' · failed: ' + n.failed_reason : '')),
      table, ...log,
      el('button', { id: 'detail-close' }, 'Close'));
  } catch (e) {
    box.replaceChildren(el('p', { class: 'err' }, e.message));
  }
}

document.addEventListener('click', (e) => {
  const t = e.target;
  if (!(t instanceof HTMLElement)) return;
  if (t.dataset.scale) {
    const g = t.dataset.scale;
    scale(g, Number($('count-' + g).value));
  } else if (t.dataset.replace) {
    const n = t.dataset.replace;
    act(`replacing ${n}`, '/api/replace', { node: n },
      (a) => `${n}: attempt a${a.Replaced.attempt} is failed and will be replaced`);
  } else if (t.dataset.node) {
    e.preventDefault();
    showNode(t.dataset.node);
  } else if (t.id === 'detail-close') {
    $('detail').style.display = 'none';
  } else if (t.id === 'pause') {
    act('pausing', '/api/pause', {}, (a) => a.Paused.changed ? 'paused: nothing new is dispatched until Resume' : 'already paused');
  } else if (t.id === 'resume') {
    act('resuming', '/api/resume', {}, (a) => a.Paused.changed ? 'resumed' : 'not paused: nothing to resume');
  } else if (t.id === 'teardown') {
    $('teardown-dialog').showModal();
  }
});

$('teardown-dialog').addEventListener('close', () => {
  if ($('teardown-dialog').returnValue === 'confirm') {
    act('tearing down', '/api/teardown', { confirm: true }, (a) => a.message);
  }
});

async function start() {
  takeOverview(JSON.parse($('initial').textContent));
  try {
    const r = await fetch('/api/history', { credentials: 'same-origin' });
    if (r.ok) S.points = (await r.json()).points;
  } catch (e) { /* the plot starts empty */ }
  sample();
  render();
  connect();
  setInterval(() => { renderNodes(); headline(); }, 1000);
  setInterval(() => { sample(); renderPlot(); }, 10000);
  // A lifetime's deadline moves with jobs and applies, and leases are
  // renewed, which no event tells: read the status again now and then.
  setInterval(() => refreshSoon(), 5000);
}

start();
