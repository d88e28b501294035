// kvmesh dashboard: polls the network API and renders with textContent only
// (gossiped names are untrusted: nothing from the network is parsed as HTML).
"use strict";
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const COLORS = { thunderbolt: "#c792ea", ethernet: "#6ea8fe", wifi: "#e0a458", tailscale: "#3fb68b", loopback: "#8b96a1", unknown: "#555" };
let apiKey = localStorage.getItem("kvmesh-api-key") || "";

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function fmtBytes(n) {
  if (!n) return "0 B";
  const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(n < 10 && i ? 1 : 0) + " " + u[i];
}
function fmtAge(s) { return s < 60 ? s.toFixed(1) + " s" : s < 3600 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h"; }
async function get(path) {
  const headers = apiKey ? { "X-API-Key": apiKey } : {};
  const r = await fetch(path, { headers });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}
function rows(tbody, data, cells) {
  tbody.replaceChildren(...data.map((d) => {
    const tr = el("tr");
    for (const c of cells(d)) { if (c instanceof Node) { const td = el("td"); td.append(c); tr.append(td); } else tr.append(el("td", c)); }
    return tr;
  }));
}

function renderSummary(s) {
  const items = [
    ["nodes", s.nodes], ["heads", s.heads], ["cache peers", s.caches],
    ["completed tokens", s.completed_tokens], ["KV-assisted tokens", s.kv_assisted_tokens],
    ["hit ratio", s.hit_ratio === null ? "–" : (s.hit_ratio * 100).toFixed(0) + "%"],
    ["cache used", fmtBytes(s.used_bytes) + " / " + fmtBytes(s.capacity_bytes)], ["groups", s.groups],
  ];
  $("summary").replaceChildren(...items.map(([k, v]) => {
    const c = el("div", null, "card"); c.append(el("div", v, "v"), el("div", k, "k")); return c;
  }));
  $("status").textContent = (s.private ? "private view · " : "public view · ") + "model " + s.model + " · up " + fmtAge(s.uptime_s);
}

function renderTopology(nodes) {
  const svg = $("topology"); svg.replaceChildren();
  const cx = 210, cy = 150, r = 105;
  const head = nodes.find((n) => n.status === "self") || nodes[0];
  const others = nodes.filter((n) => n !== head);
  const pos = new Map([[head, [cx, cy]]]);
  others.forEach((n, i) => { const a = (2 * Math.PI * i) / Math.max(others.length, 1) - Math.PI / 2; pos.set(n, [cx + r * Math.cos(a), cy + r * Math.sin(a)]); });
  const kinds = new Set();
  for (const n of others) {
    const kind = (n.interfaces && n.interfaces[0]) || "unknown"; kinds.add(kind);
    const [x, y] = pos.get(n); const line = document.createElementNS(SVG, "line");
    line.setAttribute("x1", cx); line.setAttribute("y1", cy); line.setAttribute("x2", x); line.setAttribute("y2", y);
    line.setAttribute("stroke", COLORS[kind] || COLORS.unknown); line.setAttribute("stroke-width", n.status === "stale" ? 1 : 2.5);
    if (n.status === "stale") line.setAttribute("stroke-dasharray", "4 3");
    svg.append(line);
  }
  for (const n of nodes) {
    const [x, y] = pos.get(n) || [cx, cy];
    const c = document.createElementNS(SVG, "circle");
    c.setAttribute("cx", x); c.setAttribute("cy", y); c.setAttribute("r", n === head ? 16 : 12); c.setAttribute("class", "node");
    c.setAttribute("fill", n.roles.includes("head") ? "#6ea8fe" : "#3fb68b");
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", x); t.setAttribute("y", y + (n === head ? 30 : 26)); t.setAttribute("text-anchor", "middle");
    t.textContent = n.alias;
    const title = document.createElementNS(SVG, "title"); title.textContent = n.alias + " (" + n.roles.join(", ") + ")";
    c.append(title); svg.append(c, t);
  }
  $("legend").replaceChildren(...[...kinds].map((k) => { const s = el("span"); const sw = el("span", null, "sw"); sw.style.background = COLORS[k] || COLORS.unknown; s.append(sw, " " + k); return s; }));
}

function renderNodes(nodes) {
  rows($("nodes").tBodies[0], nodes, (n) => {
    const used = n.capacity.budget_bytes ? n.capacity.used_bytes / n.capacity.budget_bytes : 0;
    const bar = el("span"); const b = el("span", null, "bar"); const fill = el("i"); fill.style.width = (used * 100).toFixed(1) + "%"; b.append(fill);
    bar.append(b, fmtBytes(n.capacity.used_bytes) + " / " + fmtBytes(n.capacity.budget_bytes));
    const health = n.health || "ok";  // ok | backed off | quarantined (the head's circuit breaker)
    return [n.alias, n.roles.join(", "), n.region || "–", el("span", n.status, n.status),
      el("span", health, "health-" + health.replace(/[^a-z]+/g, "-")), fmtAge(n.card_age_s),
      fmtAge(n.epoch_age_s), n.interfaces.join(", "), bar, n.capacity.entries, n.hit_ratio === null ? "–" : (n.hit_ratio * 100).toFixed(0) + "%",
      n.served ? n.served.fetches + " · " + fmtBytes(n.served.bytes) + " · " + n.served.per_s + "/s" : "–", fmtLink(n)];
  });
}
// the head's measured link to a node and its last fetch-or-compute choice there (admins only)
function fmtLink(n) {
  if (n.link_mbps === undefined) return "–";  // public view
  const parts = [n.link_mbps === null ? "unmeasured" : n.link_mbps + " Mbit/s"];
  if (n.link_rtt_ms !== null) parts.push(n.link_rtt_ms.toFixed(1) + " ms");
  if (n.last_choice) parts.push(n.last_choice);
  return n.link_mbps === null && !n.last_choice && n.link_rtt_ms === null ? "–" : parts.join(" · ");
}

function renderChart(series) {
  const cv = $("chart"), ctx = cv.getContext("2d"); const W = cv.width, H = cv.height, P = 30;
  ctx.clearRect(0, 0, W, H);
  ctx.strokeStyle = "#2a333d"; ctx.beginPath(); ctx.moveTo(P, H - P); ctx.lineTo(W - 5, H - P); ctx.moveTo(P, 5); ctx.lineTo(P, H - P); ctx.stroke();
  if (!series.length) { ctx.fillStyle = "#8b96a1"; ctx.fillText("no requests yet", W / 2 - 40, H / 2); return; }
  let acc = { kv: 0, comp: 0, gen: 0 };
  const start = { t: series[0].t - 10, kv: 0, comp: 0, gen: 0 };  // lines start at zero
  const pts = [start].concat(series.map((s) => (acc = { t: s.t, kv: acc.kv + s.kv_assisted_tokens, comp: acc.comp + s.computed_tokens, gen: acc.gen + s.completion_tokens })));
  const max = Math.max(1, ...pts.map((p) => Math.max(p.kv, p.comp, p.gen)));
  const t0 = pts[0].t, t1 = Math.max(pts[pts.length - 1].t, t0 + 1);
  const X = (t) => P + ((t - t0) / (t1 - t0)) * (W - P - 10), Y = (v) => H - P - (v / max) * (H - P - 10);
  for (const [key, color] of [["kv", "#3fb68b"], ["comp", "#e0a458"], ["gen", "#6ea8fe"]]) {
    ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
    pts.forEach((p, i) => (i ? ctx.lineTo(X(p.t), Y(p[key])) : ctx.moveTo(X(p.t), Y(p[key]))));
    ctx.stroke();
  }
  ctx.fillStyle = "#8b96a1"; ctx.fillText(String(max), 2, 14); ctx.fillText("0", 18, H - P);
}

function renderPrefill(p) {
  rows($("transfers").tBodies[0], p.recent_transfers.slice().reverse(), (t) => [t.peer, fmtBytes(t.bytes), (t.seconds * 1000).toFixed(1) + " ms", t.gbps.toFixed(2) + " GB/s"]);
  rows($("tiers").tBodies[0], p.tiers || [], (t) => [t.tier, fmtBytes(t.used_bytes) + " / " + fmtBytes(t.budget_bytes),
    t.entries, t.hits, t.admissions, t.evictions, t.tier === "disk" ? t.promotions : "–", t.tier === "disk" ? t.corrupt : "–"]);
  $("sources").textContent = "prefills by source: " + Object.entries(p.by_source).map(([k, v]) => k + " " + v).join(" · ");
  const reasons = Object.entries(p.fallback_reasons);
  rows($("fallbacks").tBodies[0], reasons.length ? reasons : [["none", 0]], ([k, v]) => [k, v]);
}

// /healthz "memory" (kvmesh.memory.report): RSS against model + --budget + --kv-budget
function renderMemory(m) {
  $("memory-panel").hidden = !m;
  if (!m) return;
  const ratio = (x) => (x === null || x === undefined ? "–" : x.toFixed(2) + "×");
  const bar = el("span"); const b = el("span", null, "bar"); const fill = el("i");
  const used = m.bound_bytes ? Math.min(1, m.rss_bytes / m.bound_bytes) : 0;
  fill.style.width = (used * 100).toFixed(1) + "%"; if (m.ratio > 1) fill.className = "over"; b.append(fill);
  bar.append(b, ratio(m.ratio));
  const heap = m.heap || {};
  const size = (v) => (v === null || v === undefined ? "–" : fmtBytes(v));
  const items = [
    ["RSS", size(m.rss_bytes)], ["of model + budgets", bar], ["model", size(m.model_bytes)],
    ["--budget (store)", size(m.budget_bytes)], ["--kv-budget", size(m.kv_budget_bytes)],
    ["RSS when ready", size(m.ready_bytes)], ["of that + budgets", ratio(m.ready_ratio)],
    ["heap in use", size(heap.in_use)], ["heap free", size(heap.free)],
    ["idle trims", m.trims], ["given back", size(m.released_bytes)],
  ];
  $("memory").replaceChildren(...items.map(([k, v]) => {
    const c = el("div", null, "card"); const vv = el("div", null, "v");
    if (v instanceof Node) vv.append(v); else vv.textContent = String(v);
    c.append(vv, el("div", k, "k")); return c;
  }));
  $("memory-note").textContent = "warm heap pad " + fmtBytes(m.warm_bytes) +
    (m.last_trim ? " · last idle trim " + fmtAge(Date.now() / 1000 - m.last_trim) + " ago" : " · not trimmed yet");
}

async function tick() {
  try {
    const [s, n, t, p, g] = await Promise.all([get("/v1/network/summary"), get("/v1/network/nodes"), get("/v1/network/tokens"), get("/v1/network/prefill"), get("/v1/network/groups")]);
    renderSummary(s); renderTopology(n.nodes); renderNodes(n.nodes); renderChart(t.series); renderPrefill(p);
    rows($("groups").tBodies[0], g.groups, (x) => [x.name, x.members.join(", ")]);
  } catch (e) { $("status").textContent = "disconnected: " + e.message; }
  try { renderMemory((await get("/healthz")).memory); } catch (e) { renderMemory(null); }
}
$("keyform").addEventListener("submit", (ev) => { ev.preventDefault(); apiKey = $("apikey").value; localStorage.setItem("kvmesh-api-key", apiKey); tick(); });
tick();
setInterval(tick, 2000);
