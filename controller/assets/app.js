// weightsync dashboard: polls the controller's JSON API (/healthz, /v1/workers, /v1/syncs,
// /v1/syncs/{id}) and draws with SVG. No build step, no external resources.
"use strict";

const STAGE_COLORS = {
  source: "#a3a3a3", arm: "#94a3b8", gather_send: "#c084fc", gather_wait: "#e9d5ff",
  h2d: "#60a5fa", prepare: "#f59e0b", write: "#22c55e", barrier: "#ef4444",
  land: "#14b8a6", verify: "#8b5cf6",
  // an engine's own stages, reported by the engine after the version landed
  pause: "#f472b6", load: "#0ea5e9", resume: "#a3e635",
};
// Stages outside a lane's transfer window (its rate leaves them out).
const NOT_TRANSFER = ["source", "verify", "arm", "pause", "load", "resume"];
const SVG_NS = "http://www.w3.org/2000/svg";
let selected = null;      // sync id chosen by the user (null: follow the newest)
let lastList = [];

function el(name, attrs, text) {
  const e = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  return ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(1) + " ms";
}
function fmtBytes(b) {
  if (!b) return "0 B";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1000 && i < u.length - 1) { b /= 1000; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}
function fmtGbps(g) { return g === null || g === undefined ? "–" : g.toFixed(2); }
// A rate from bytes per nanosecond (= GB/s), in MB/s when below 1 GB/s.
function fmtRate(gbps) {
  if (!(gbps > 0)) return "";
  return gbps >= 1 ? gbps.toFixed(2) + " GB/s" : (gbps * 1000).toFixed(0) + " MB/s";
}

function renderHealth(h, w) {
  const el_ = document.getElementById("health");
  const n = w.workers.length;
  const want = w.expected.trainers + w.expected.rollouts;
  el_.innerHTML = "";
  const parts = [
    ["workers", n + " / " + want + (w.missing.length ? " (missing " + w.missing.join(", ") + ")" : "")],
    ["plan", h.planned ? "ready" : "waiting"],
    ["running", h.running_sync === null ? "none" : "sync " + h.running_sync],
  ];
  for (const [k, v] of parts) {
    const s = document.createElement("span");
    s.innerHTML = k + ": <b></b> &nbsp; ";
    s.querySelector("b").textContent = v;
    el_.appendChild(s);
  }
}

function renderList(list) {
  const body = document.querySelector("#sync-list tbody");
  body.innerHTML = "";
  for (const s of list.syncs.slice(0, 25)) {
    const tr = document.createElement("tr");
    tr.dataset.id = s.id;
    if (s.id === currentId()) tr.className = "selected";
    const cells = [s.id, s.version, s.state, fmtMs(s.stages.total_ms), fmtGbps(s.gbps)];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = c;
      if (i === 2) td.className = "state-" + s.state;
      tr.appendChild(td);
    });
    tr.addEventListener("click", () => { selected = s.id; refresh(); });
    body.appendChild(tr);
  }
}

function currentId() {
  if (selected !== null) return selected;
  return lastList.length ? lastList[0].id : null;
}

function renderHistory(list) {
  const svg = document.getElementById("history");
  svg.innerHTML = "";
  const syncs = list.syncs.slice(0, 60).reverse();
  const W = svg.clientWidth || 320, H = 140, pad = 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const max = Math.max(1, ...syncs.map(s => s.stages.total_ms || 0));
  const bw = Math.max(2, (W - pad) / Math.max(1, syncs.length) - 2);
  syncs.forEach((s, i) => {
    const h = ((s.stages.total_ms || 0) / max) * (H - pad - 6);
    const x = pad + i * (bw + 2);
    const color = s.state === "committed" ? "#22c55e" : s.state === "failed" ? "#ef4444" : "#f59e0b";
    const r = el("rect", { x, y: H - pad - h, width: bw, height: Math.max(1, h), fill: color, class: "bar" });
    r.appendChild(el("title", {}, `sync ${s.id} (v${s.version}) ${s.state}: ${fmtMs(s.stages.total_ms)}`));
    r.addEventListener("click", () => { selected = s.id; refresh(); });
    svg.appendChild(r);
  });
  svg.appendChild(el("text", { x: 2, y: 12, class: "axis" }, fmtMs(max)));
  svg.appendChild(el("text", { x: 2, y: H - 6, class: "axis" }, "oldest → newest"));
}

function renderLegend() {
  const box = document.getElementById("legend");
  if (box.childElementCount) return;
  for (const [k, c] of Object.entries(STAGE_COLORS)) {
    const s = document.createElement("span");
    s.innerHTML = `<i style="background:${c}"></i>`;
    s.appendChild(document.createTextNode(k));
    box.appendChild(s);
  }
}

function renderDetail(s) {
  document.getElementById("detail-title").textContent =
    `Sync ${s.id} — version ${s.version} — ${s.state}`;
  document.getElementById("trace-link").href = `/v1/syncs/${s.id}/trace`;
  const sum = document.getElementById("detail-summary");
  sum.innerHTML = "";
  const facts = [
    ["total", fmtMs(s.stages.total_ms)], ["prepare", fmtMs(s.stages.prepare_ms)],
    ["write", fmtMs(s.stages.write_ms)], ["landed", fmtMs(s.stages.land_ms)],
    ["verify", fmtMs(s.stages.verify_ms)], ["bytes", fmtBytes(s.bytes)],
    ["GB/s", fmtGbps(s.gbps)], ["verified", s.verified === null ? "–" : String(s.verified)],
  ];
  if (s.delta_policy != null) facts.push(["delta policy", s.delta_policy]);
  if (s.delta) {
    facts.push(["delta wire / full", `${(s.delta.wire_fraction * 100).toFixed(1)}% ` +
      `(${(s.delta.changed_fraction * 100).toFixed(2)}% changed)`]);
  }
  if (s.waiting_for_drain_of != null) facts.push(["queued behind", `drain of sync ${s.waiting_for_drain_of}`]);
  if (s.drain_wait_ms != null) facts.push(["drain wait", fmtMs(s.drain_wait_ms)]);
  if (s.waiting_on.length) facts.push(["waiting on", s.waiting_on.join(", ")]);
  for (const [k, v] of facts) {
    const d = document.createElement("div");
    d.innerHTML = `<span>${k}</span>`;
    d.appendChild(document.createTextNode(v));
    sum.appendChild(d);
  }
  const fail = document.getElementById("failure");
  if (s.failure) {
    fail.hidden = false;
    fail.textContent = `Failed: ${s.failure.worker}` +
      (s.failure.tensor ? ` (tensor ${s.failure.tensor})` : "") + `: ${s.failure.cause}`;
  } else {
    fail.hidden = true;
  }
  drawTimeline(s);
}

function drawTimeline(s) {
  const svg = document.getElementById("timeline");
  svg.innerHTML = "";
  const lanes = s.lanes || [];
  const labelW = 190, laneH = 26, top = 24, W = Math.max(600, svg.clientWidth || 900);
  const H = top + lanes.length * laneH + 10;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  let end = 1;
  for (const l of lanes) for (const sp of l.spans) end = Math.max(end, sp.end_ns);
  if (s.stages.total_ms) end = Math.max(end, s.stages.total_ms * 1e6);
  const x = ns => labelW + (ns / end) * (W - labelW - 10);
  // axis
  for (let i = 0; i <= 5; i++) {
    const t = (end * i) / 5;
    svg.appendChild(el("line", { x1: x(t), x2: x(t), y1: top - 4, y2: H - 6, stroke: "#eee" }));
    svg.appendChild(el("text", { x: x(t) - 10, y: 14, class: "axis" }, fmtMs(t / 1e6)));
  }
  lanes.forEach((l, i) => {
    const y = top + i * laneH;
    const g = el("g", { class: "lane" + (l.critical ? " critical" : ""), "data-worker": l.worker });
    const xfer = l.spans.filter(p => !NOT_TRANSFER.includes(p.stage));
    const busy = xfer.length && l.part_done_ns ? l.part_done_ns - Math.min(...xfer.map(p => p.start_ns)) : 0;
    const rate = busy > 0 && l.bytes ? fmtRate(l.bytes / busy) : "";
    g.appendChild(el("text", { x: 4, y: y + 16, class: "lane-label" + (l.critical ? " critical" : "") },
      (l.critical ? "★ " : "") + l.worker + "  " + fmtBytes(l.bytes) + " " + rate));
    g.appendChild(el("rect", { x: labelW, y: y + 3, width: W - labelW - 10, height: laneH - 6,
      fill: l.critical ? "#fff1f2" : "#f8fafc" }));
    for (const sp of l.spans) {
      const w = Math.max(1, x(sp.end_ns) - x(sp.start_ns));
      const r = el("rect", { x: x(sp.start_ns), y: y + 5, width: w, height: laneH - 10,
        fill: STAGE_COLORS[sp.stage] || "#999", class: "span span-" + sp.stage });
      const dur = (sp.end_ns - sp.start_ns) / 1e6;
      const gb = sp.end_ns > sp.start_ns && sp.bytes ? fmtRate(sp.bytes / (sp.end_ns - sp.start_ns)) : "";
      r.appendChild(el("title", {}, `${l.worker} ${sp.stage} task ${sp.task}: ${fmtMs(dur)}, ${fmtBytes(sp.bytes)} ${gb}`));
      g.appendChild(r);
    }
    if (l.part_done_ns) {
      g.appendChild(el("line", { x1: x(l.part_done_ns), x2: x(l.part_done_ns), y1: y + 2, y2: y + laneH - 2,
        stroke: l.critical ? "#b91c1c" : "#334155", "stroke-width": l.critical ? 3 : 1 }));
    }
    svg.appendChild(g);
  });
  if (!lanes.length) {
    svg.appendChild(el("text", { x: 10, y: 40, class: "axis" }, "no spans reported yet"));
  }
}

let timer = null;
async function refresh() {
  clearTimeout(timer);
  let busy = false;
  try {
    const [h, w, list] = await Promise.all([
      getJSON("/healthz"), getJSON("/v1/workers"), getJSON("/v1/syncs"),
    ]);
    lastList = list.syncs;
    busy = list.running !== null;
    renderHealth(h, w);
    renderList(list);
    renderHistory(list);
    renderLegend();
    const id = currentId();
    if (id !== null) renderDetail(await getJSON(`/v1/syncs/${id}`));
  } catch (e) {
    document.getElementById("health").textContent = "controller unreachable: " + e.message;
  }
  // Poll fast while a sync runs, slowly otherwise.
  timer = setTimeout(refresh, busy ? 500 : 3000);
}

refresh();
