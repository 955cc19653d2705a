// kvtier dashboard: polls the admin API once a second and redraws. No libraries, no CDN.
"use strict";

const POLL_MS = 1000;
const COLORS = ["#4fb3ff", "#4cd08a", "#f2b544", "#c58bff", "#ff6b6b"];
const SVG_NS = "http://www.w3.org/2000/svg";

// A token given as ?token= is kept for this tab and removed from the address bar.
const query = new URLSearchParams(location.search);
if (query.has("token")) {
  sessionStorage.setItem("kvtier-token", query.get("token"));
  query.delete("token");
  const rest = query.toString();
  history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
}
const token = sessionStorage.getItem("kvtier-token");

let previous = null;      // the last /stats answer, for the activity feed
// The request id being explained: clicked, or linked as #explain=<request id>.
let selected = new URLSearchParams(location.hash.slice(1)).get("explain");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function pct(part, whole) {
  return whole > 0 ? (100 * part / whole).toFixed(1) + "%" : "-";
}

function seconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " \u00b5s";
  if (s < 1) return (s * 1e3).toFixed(1) + " ms";
  return s.toFixed(2) + " s";
}

async function getJSON(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(path + ": " + (body.error || response.status));
  return body;
}

function replaceRows(tbody, rows, emptyText, columns) {
  tbody.replaceChildren();
  if (!rows.length) {
    tbody.append(el("tr", {}, el("td", { class: "empty", colspan: String(columns) }, emptyText)));
    return;
  }
  for (const row of rows) tbody.append(row);
}

function lineChart(svg, series, opts) {
  // series: [{color, points: [[t, v], ...]}]; one shared y scale from 0. The label is HTML
  // beside the SVG: text inside a non-uniformly scaled SVG would be stretched.
  svg.replaceChildren();
  const label = document.getElementById(svg.id + "-label");
  const all = series.flatMap((s) => s.points);
  if (all.length < 2) {
    label.textContent = "collecting samples\u2026";
    return;
  }
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const vmax = Math.max(opts.min || 0, ...all.map((p) => p[1])) || 1;
  for (const s of series) {
    const line = document.createElementNS(SVG_NS, "polyline");
    const pts = s.points.map(([t, v]) =>
      ((600 * (t - t0)) / Math.max(t1 - t0, 1e-9)).toFixed(1) + "," + (115 - (105 * v) / vmax).toFixed(1));
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("stroke", s.color);
    svg.append(line);
  }
  const span = Math.round(t1 - t0);
  label.textContent = "max " + opts.format(vmax) + " \u00b7 last " + (span >= 120 ? Math.round(span / 60) + " min" : span + " s");
}

function renderTiers(stats, history) {
  const box = document.getElementById("tiers");
  box.replaceChildren();
  const names = Object.keys(stats.tiers);
  names.forEach((name, i) => {
    const t = stats.tiers[name];
    const fill = el("div", { style: "width:" + (t.capacity_bytes ? (100 * t.used_bytes / t.capacity_bytes) : 0) + "%;background:" + COLORS[i % COLORS.length] });
    box.append(el("div", {
      class: "tier", id: "tier-" + name,
      "data-used-bytes": String(t.used_bytes), "data-capacity-bytes": String(t.capacity_bytes),
      "data-entries": String(t.entries),
    },
    el("div", { class: "label" },
      el("span", { class: "name" }, name),
      el("span", { class: "usage" },
        bytes(t.used_bytes) + " of " + bytes(t.capacity_bytes) + " \u00b7 " + t.entries +
        " chunks \u00b7 " + pct(t.used_bytes, t.capacity_bytes))),
    el("div", { class: "bar" }, fill)));
  });
  const pinned = stats.pinned_bytes, cap = stats.allocator.pages_total * stats.allocator.page_bytes;
  box.append(el("div", { class: "tier", id: "pinned" },
    el("div", { class: "label" }, el("span", { class: "name" }, "pinned by requests"),
      el("span", {}, bytes(pinned) + " \u00b7 " + stats.pinned_pages + " chunks")),
    el("div", { class: "bar" }, el("div", { class: "pinned", style: "width:" + (cap ? 100 * Math.min(pinned, cap) / cap : 0) + "%" }))));
  lineChart(document.getElementById("occupancy-chart"),
    names.map((name, i) => ({ name, color: COLORS[i % COLORS.length],
      points: history.filter((p) => name in p.tier_used_bytes).map((p) => [p.time, p.tier_used_bytes[name]]) })),
    { format: bytes });
  document.getElementById("occupancy-legend").replaceChildren(...names.map((name, i) =>
    el("span", { style: "color:" + COLORS[i % COLORS.length] }, "\u25a0 " + name)));
}

function renderHitRate(stats, history) {
  document.getElementById("hit-rate").textContent = pct(stats.hit_tokens, stats.lookup_tokens);
  document.getElementById("hit-detail").textContent =
    stats.hit_tokens + " of " + stats.lookup_tokens + " looked-up tokens loaded from kvtier \u00b7 " +
    (stats.unused_tokens || 0) + " found but not needed (the engine had them) \u00b7 " + stats.lookups + " lookups";
  const points = [];
  for (let i = 1; i < history.length; i++) {
    const asked = history[i].lookup_tokens - history[i - 1].lookup_tokens;
    if (asked > 0) points.push([history[i].time, (history[i].hit_tokens - history[i - 1].hit_tokens) / asked]);
  }
  lineChart(document.getElementById("hit-chart"), [{ color: COLORS[1], points }],
    { min: 1, format: (v) => (100 * v).toFixed(0) + "%" });
}

function renderTtft(stats, history) {
  const ttft = stats.observability.ttft;
  const big = document.getElementById("ttft-saved"), detail = document.getElementById("ttft-detail");
  if (ttft.reported_requests > 0) {
    big.textContent = seconds(ttft.saved_seconds_estimate);
    detail.textContent = "estimate: hit tokens \u00d7 " + seconds(ttft.prefill_seconds_per_token) +
      " per prefilled token, from " + ttft.reported_requests + " reported TTFTs";
    lineChart(document.getElementById("ttft-chart"),
      [{ color: COLORS[2], points: history.map((p) => [p.time, p.ttft_saved_seconds]) }], { format: seconds });
  } else {
    big.textContent = stats.hit_tokens + " tokens";
    detail.textContent = "loaded from kvtier instead of prefilled (no TTFT reported yet: a connector calls engine.record_ttft)";
    lineChart(document.getElementById("ttft-chart"),
      [{ color: COLORS[2], points: history.map((p) => [p.time, p.hit_tokens]) }], { format: (v) => v + " tok" });
  }
}

function renderLeases(leases) {
  document.getElementById("lease-count").textContent = String(leases.length);
  replaceRows(document.querySelector("#leases tbody"), leases.map((l) =>
    el("tr", {}, el("td", { title: l.request_id }, l.request_id), el("td", {}, seconds(l.age_s)),
      el("td", {}, l.pinned_pages), el("td", {}, bytes(l.pinned_bytes)),
      el("td", { title: l.holds.join("\n") }, l.holds.length))), "no open requests", 5);
}

function renderPd(stats) {
  const box = document.getElementById("pd"), pd = stats.pd;
  if (!pd || pd.buffer_capacity_bytes === undefined) {
    box.replaceChildren(el("span", { class: "empty" }, pd ? "PD on (no buffer on this side)" : "PD is off"));
    return;
  }
  box.replaceChildren(
    el("div", { class: "label" }, bytes(pd.buffer_used_bytes) + " of " + bytes(pd.buffer_capacity_bytes) +
      " \u00b7 " + pct(pd.buffer_used_bytes, pd.buffer_capacity_bytes)),
    el("div", { class: "bar" }, el("div", { style: "width:" + (pd.buffer_capacity_bytes ? 100 * pd.buffer_used_bytes / pd.buffer_capacity_bytes : 0) + "%" })),
    el("div", { class: "sub" }, "sent " + bytes(pd.sent_bytes || 0) + " \u00b7 received " + bytes(pd.received_bytes || 0)));
}

function tierSum(stats, field) {
  return Object.values(stats.tiers).reduce((sum, t) => sum + (t[field] || 0), 0);
}

function renderCounters(stats) {
  const lat = stats.observability.latency;
  const rows = [
    ["lookups", stats.lookups], ["stores", stats.stores], ["chunks stored", stats.stored_chunks],
    ["chunks dropped (memory pinned)", stats.dropped_chunks], ["evictions", tierSum(stats, "evicted")],
    ["checksum failures", tierSum(stats, "corrupt")], ["load failures", stats.load_failures],
    ["requests ended", stats.requests],
  ];
  for (const op of ["lookup", "store", "retrieve"]) {
    const l = lat[op];
    rows.push([op + " p50 / p99 \u2264", l.count ? seconds(l.p50_le_s) + " / " + seconds(l.p99_le_s) : "-"]);
  }
  replaceRows(document.querySelector("#counters tbody"),
    rows.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, v))), "", 2);
}

function renderActivity(stats) {
  if (previous) {
    const lines = [];
    for (const [name, t] of Object.entries(stats.tiers)) {
      const old = previous.tiers[name];
      if (old && old.entries !== t.entries) lines.push(name + " " + old.entries + " \u2192 " + t.entries + " chunks");
      if (old && old.evicted !== t.evicted) lines.push(name + " evicted " + (t.evicted - old.evicted));
      if (old && old.corrupt !== t.corrupt) lines.push(name + " checksum failures +" + (t.corrupt - old.corrupt));
    }
    if (stats.lookups !== previous.lookups) lines.push("lookups +" + (stats.lookups - previous.lookups));
    if (stats.open_requests !== previous.open_requests) lines.push("open leases " + previous.open_requests + " \u2192 " + stats.open_requests);
    const list = document.getElementById("activity"), stamp = new Date().toLocaleTimeString();
    for (const line of lines) list.prepend(el("li", {}, stamp + "  " + line));
    while (list.children.length > 50) list.lastChild.remove();
  }
  previous = stats;
}

function renderRequests(requests) {
  replaceRows(document.querySelector("#requests tbody"), requests.map((r) =>
    el("tr", { onclick: () => { selected = r.request_id; history.replaceState(null, "", "#explain=" + encodeURIComponent(selected)); explain(); } },
      el("td", { title: r.request_id }, r.request_id), el("td", {}, r.prompt_tokens),
      el("td", {}, r.found_tokens), el("td", {}, r.loaded_tokens),
      el("td", { title: "found, never loaded: set when the request ends" }, r.unused_tokens ?? "\u2013"))), "no lookups yet", 5);
}

async function explain() {
  const box = document.getElementById("explain");
  if (!selected) return;
  try {
    const record = await getJSON("/explain?request_id=" + encodeURIComponent(selected));
    const runs = [];
    for (const c of record.chunks) {
      const what = c.found ? "found in " + c.tier : c.reason;
      const last = runs[runs.length - 1];
      if (last && last.what === what && last.detail === (c.detail || "")) { last.to = c.index; last.end = c.end; }
      else runs.push({ from: c.index, to: c.index, start: c.start, end: c.end, what, detail: c.detail || "", found: c.found });
    }
    const table = el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "chunks"), el("th", {}, "tokens"),
      el("th", {}, "outcome"), el("th", {}, "why"))));
    const body = el("tbody", {});
    for (const r of runs) {
      body.append(el("tr", {}, el("td", {}, r.from === r.to ? r.from : r.from + "\u2013" + r.to),
        el("td", {}, r.start + "\u2013" + r.end), el("td", { class: r.found ? "found" : "miss" }, r.what),
        el("td", { title: r.detail }, r.detail)));
    }
    table.append(body);
    box.replaceChildren(el("h2", {}, "explain " + record.request_id), table);
  } catch (err) {
    box.replaceChildren(el("span", { class: "miss" }, String(err.message || err)));
  }
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const [stats, history, leases, requests] = await Promise.all([
      getJSON("/stats"), getJSON("/history"), getJSON("/leases"), getJSON("/requests?limit=15")]);
    const points = history.points;
    document.getElementById("engine-info").textContent = stats.engine.model_name + " \u00b7 " +
      stats.engine.layout + " \u00b7 chunk " + stats.engine.chunk_size + " tokens \u00b7 fingerprint " + stats.engine.fingerprint;
    renderTiers(stats, points);
    renderHitRate(stats, points);
    renderTtft(stats, points);
    renderLeases(leases.leases);
    renderPd(stats);
    renderCounters(stats);
    renderActivity(stats);
    renderRequests(requests.requests);
    if (selected && !document.getElementById("explain").childElementCount) explain();
    status.textContent = "live \u00b7 updated " + new Date().toLocaleTimeString();
    status.className = "status live";
    document.body.setAttribute("data-polls", String(Number(document.body.getAttribute("data-polls") || 0) + 1));
  } catch (err) {
    status.textContent = "disconnected: " + (err.message || err);
    status.className = "status down";
  }
  setTimeout(poll, POLL_MS);
}

poll();
