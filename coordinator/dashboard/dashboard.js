// The coordinator's live dashboard: polls /api/run every 2 s for the rounds closed since the last poll,
// keeps the whole history here, and redraws. Plain DOM and inline SVG; nothing is fetched but /api/run.
// Every value from the run (island ids, hostnames) goes in as text, never as HTML.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#6b7280"];
const PHASES = [  // a round's time, in the order it is spent (RoundSummary's *_s fields)
  ["wait_s", "waiting for islands", "#cbd5e1"], ["fold_s", "fold", "#4e79a7"], ["step_s", "outer step", "#f28e2b"],
  ["publish_s", "publish", "#59a14f"], ["eval_s", "eval", "#b07aa1"],
];
const UPLINK = "#2563eb", DOWNLINK = "#f28e2b";  // the bandwidth chart's two directions
const run = { rounds: [], snap: null, next: 0, failures: 0, timer: null };

const $ = (id) => document.getElementById(id);

// --- formatting ----------------------------------------------------------------------------------

function bytes(n) {
  if (n == null) return "—";
  const units = ["B", "kB", "MB", "GB", "TB", "PB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(n >= 10 ? 1 : 2)} ${units[i]}`;
}
function count(n) {
  if (n == null) return "—";
  if (n < 1000) return String(Math.round(n));
  const units = ["", "k", "M", "G", "T"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n >= 100 ? 0 : n >= 10 ? 1 : 2)}${units[i]}`;
}
function seconds(s) {
  if (s == null) return "—";
  if (s === 0) return "0";
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 1 : 0)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s`;
}
function ago(s) {
  if (s == null) return "—";
  s = Math.max(0, s);
  if (s < 60) return `${Math.round(s)}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${Math.round(s % 60)}s ago`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m ago`;
}
const fixed = (x, d = 3) => (x == null ? "—" : x.toFixed(d));

function islandColor(id) {
  const m = /(\d+)$/.exec(id);
  let k = m ? +m[1] : [...id].reduce((h, c) => (h * 31 + c.charCodeAt(0)) >>> 0, 7);
  return PALETTE[k % PALETTE.length];
}

// --- DOM helpers ---------------------------------------------------------------------------------

function svgEl(tag, attrs, parent, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function htmlEl(tag, cls, parent, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function legend(box, items) {
  box.replaceChildren();
  for (const it of items) {
    if (it.prefix) htmlEl("span", "prefix", box, it.prefix);
    const item = htmlEl("span", "item", box);
    const sw = htmlEl("span", `swatch ${it.kind || ""}`, item);
    sw.style.background = it.color;  // CSSOM, which the page's CSP allows (inline style attributes it does not)
    htmlEl("span", null, item, it.label);
    if (it.value != null) htmlEl("b", null, item, it.value);
  }
}

// --- charts --------------------------------------------------------------------------------------

// A "nice" axis over [lo, hi]: round steps (1, 2, 5 x 10^k), the domain widened to whole steps.
function niceAxis(lo, hi, n, integer) {
  if (!(hi > lo)) { const d = Math.abs(lo) * 0.05 || 1; lo -= d; hi += d; }
  const raw = (hi - lo) / Math.max(1, n), mag = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / mag;
  let step = mag * (r >= 7.5 ? 10 : r >= 3.5 ? 5 : r >= 1.5 ? 2 : 1);
  if (integer) step = Math.max(1, Math.round(step));
  lo = Math.floor(lo / step + 1e-9) * step; hi = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  for (let v = lo; v <= hi + step * 1e-6; v += step) ticks.push(+v.toPrecision(12));
  return { lo, hi, ticks };
}

// Draws axes and grid into svg; returns {x, y, W, H, m} scales for the caller's marks.
function frame(svg, xs, ys, opts) {
  svg.replaceChildren();
  const W = Math.max(320, svg.clientWidth || svg.parentNode.clientWidth || 600), H = svg.clientHeight || 260;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  // Room on the left for the widest tick label (and the axis title, where there is one).
  const widest = Math.max(...ys.ticks.map((t) => opts.yFmt(t).length));
  const m = { l: 12 + widest * 6.4 + (opts.yTitle ? 18 : 0), r: 14, t: 10, b: 36 };
  const x = (v) => m.l + ((v - xs.lo) / (xs.hi - xs.lo)) * (W - m.l - m.r);
  const y = (v) => H - m.b - ((v - ys.lo) / (ys.hi - ys.lo)) * (H - m.t - m.b);
  const axes = svgEl("g", { class: "axes" }, svg);
  for (const t of ys.ticks) {
    svgEl("line", { class: "gridline", x1: m.l, x2: W - m.r, y1: y(t), y2: y(t) }, axes);
    svgEl("text", { x: m.l - 8, y: y(t) + 4, "text-anchor": "end" }, axes, opts.yFmt(t));
  }
  const every = Math.ceil(xs.ticks.length / Math.max(2, Math.floor((W - m.l - m.r) / 70)));
  xs.ticks.forEach((t, i) => {
    if (i % every === 0) svgEl("text", { x: x(t), y: H - m.b + 16, "text-anchor": "middle" }, axes, opts.xFmt(t));
  });
  svgEl("line", { class: "baseline", x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b }, axes);
  svgEl("text", { class: "axis-title", x: W - m.r, y: H - 4, "text-anchor": "end" }, axes, opts.xTitle);
  if (opts.yTitle) {
    svgEl("text", { class: "axis-title", x: 12, y: m.t + (H - m.t - m.b) / 2, "text-anchor": "middle",
      transform: `rotate(-90 12 ${m.t + (H - m.t - m.b) / 2})` }, axes, opts.yTitle);
  }
  return { x, y, W, H, m };
}

// A line chart of series [{points: [[x, y]], cls, color, attrs, area, markers, tip}]; paths exist even when empty.
function lineChart(svg, series, opts) {
  const pts = series.flatMap((s) => s.points);
  const xv = pts.map((p) => p[0]), yv = pts.map((p) => p[1]);
  const xs = niceAxis(opts.xMin ?? Math.min(...xv, 0), Math.max(...xv, opts.xMinSpan ?? 1), 8, opts.integerX);
  const pad = yv.length ? (Math.max(...yv) - Math.min(...yv)) * 0.06 : 0;
  const ys = yv.length ? niceAxis(opts.yZero ? 0 : Math.min(...yv) - pad, Math.max(...yv) + pad, 5) : niceAxis(0, 1, 4);
  // Nothing to plot yet: a bare grid, not made-up tick values.
  const f = frame(svg, xs, ys, pts.length ? opts : { ...opts, xFmt: () => "", yFmt: () => "" });
  const marks = svgEl("g", { class: "marks" }, svg);
  for (const s of series) {
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${f.x(p[0]).toFixed(1)},${f.y(p[1]).toFixed(1)}`).join("");
    if (s.area && s.points.length > 1) {
      const last = s.points[s.points.length - 1], first = s.points[0];
      svgEl("path", { d: `${d}L${f.x(last[0]).toFixed(1)},${f.y(ys.lo)}L${f.x(first[0]).toFixed(1)},${f.y(ys.lo)}Z`,
        fill: s.color, "fill-opacity": 0.1, stroke: "none" }, marks);
    }
    svgEl("path", { class: `series ${s.cls}`, d, stroke: s.color, ...(s.attrs || {}) }, marks);
    if (s.markers && s.points.length <= 80) {
      for (const p of s.points) {
        const c = svgEl("circle", { class: s.markers, cx: f.x(p[0]), cy: f.y(p[1]), r: 3, fill: s.color }, marks);
        if (s.tip) svgEl("title", {}, c, s.tip(p));
      }
    }
  }
  if (!pts.length) svgEl("text", { class: "empty", x: f.W / 2, y: f.H / 2, "text-anchor": "middle" }, svg, opts.empty);
}

function drawLoss() {
  const snap = run.snap;
  // One point per round number: with streaming, a round's fragments each report (the last one wins).
  const evalAt = new Map(), train = new Map();
  if (snap.initial_eval_loss != null) evalAt.set(0, snap.initial_eval_loss);
  for (const r of run.rounds) {
    if (r.eval_loss != null) evalAt.set(r.round + 1, r.eval_loss);
    for (const c of r.contributions) {
      if (c.train_loss == null) continue;
      if (!train.has(c.island_id)) train.set(c.island_id, new Map());
      train.get(c.island_id).set(r.round + 1, c.train_loss);
    }
  }
  const evalPts = [...evalAt.entries()].sort((a, b) => a[0] - b[0]);
  const plotted = evalPts.filter((p) => p[0] > 0).length;  // rounds evaluated, the starting point aside
  const islands = [...train.keys()].sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
  const series = islands.map((id) => ({
    points: [...train.get(id).entries()].sort((a, b) => a[0] - b[0]), cls: "train-loss", color: islandColor(id),
    attrs: { "data-island": id, "data-points": train.get(id).size },
  }));
  series.push({ points: evalPts, cls: "eval-loss", color: "#0f172a", markers: "eval-point",
    attrs: { "data-points": plotted }, tip: (p) => `round ${p[0]}: eval loss ${p[1].toFixed(4)}` });
  lineChart($("loss-chart"), series, { integerX: true, xTitle: "round", yTitle: "loss (nats/token)",
    xFmt: (v) => String(v), yFmt: (v) => v.toFixed(2), empty: "waiting for the first round…" });
  const last = evalPts.length ? evalPts[evalPts.length - 1][1] : null;
  legend($("loss-legend"), [
    { label: "eval, global", color: "#0f172a", kind: "thick", value: last == null ? null : last.toFixed(3) },
    ...islands.map((id, i) => ({ label: id, color: islandColor(id), prefix: i ? null : "train:" })),
  ]);
}

function drawBandwidth() {
  // Each round's bytes over its duration, placed at the time it closed (seconds since the run's first round opened).
  const timed = run.rounds.filter((r) => r.closed_at != null && r.seconds > 0);
  const t0 = timed.length ? Math.min(...timed.map((r) => r.closed_at - r.seconds)) : 0;
  const up = timed.map((r) => [r.closed_at - t0, r.bytes_up / r.seconds]);
  const down = timed.map((r) => [r.closed_at - t0, r.bytes_down / r.seconds]);
  // With a symmetric codec the two curves coincide: the downlink goes second (painted over the uplink), narrower
  // and dashed, with a dot per round, so the wider solid uplink still shows at its edges and between its dashes.
  lineChart($("bandwidth-chart"), [
    { points: up, cls: "bw-up", color: UPLINK, area: true, attrs: { "data-points": up.length } },
    { points: down, cls: "bw-down", color: DOWNLINK, markers: "bw-down-point", attrs: { "data-points": down.length },
      tip: (p) => `closed at ${+p[0].toPrecision(3)}s: downlink ↓ ${bytes(p[1])}/s` },
  ], { yZero: true, xMinSpan: 1e-3, xTitle: "seconds since the first round opened", yTitle: "",
    xFmt: (v) => `${+v.toPrecision(3)}s`, yFmt: (v) => `${bytes(v)}/s`, empty: "no traffic yet" });
  const span = timed.length ? Math.max(...timed.map((r) => r.closed_at)) - t0 : 0;
  const sum = (k) => timed.reduce((a, r) => a + r[k], 0);
  legend($("bandwidth-legend"), [
    { label: "uplink ↑ (pseudo-gradients)", color: UPLINK, kind: "thick", value: span ? `${bytes(sum("bytes_up") / span)}/s` : null },
    { label: "downlink ↓ (parameters)", color: DOWNLINK, kind: "dashed", value: span ? `${bytes(sum("bytes_down") / span)}/s` : null },
  ]);
}

function drawTimeline() {
  const svg = $("timeline-chart");
  const shown = run.rounds.slice(-80);  // the latest rounds: bars stay wide enough to read
  const total = (r) => PHASES.reduce((a, [k]) => a + (r[k] || 0), 0);
  const top = Math.max(...shown.map(total), 0);
  const ys = niceAxis(0, top || 1, 4);
  const first = shown.length ? shown[0].index : 0;
  const xs = { lo: first - 0.5, hi: first + Math.max(shown.length, 10) - 0.5, ticks: shown.map((r) => r.index) };
  const f = frame(svg, xs, ys, { xFmt: (i) => String(run.rounds[i] ? run.rounds[i].round : i),
    yFmt: shown.length ? seconds : () => "",
    xTitle: run.snap.run.fragments > 1 ? "round (each fragment's)" : "round", yTitle: "" });
  const band = (f.W - f.m.l - f.m.r) / (xs.hi - xs.lo), w = Math.max(1, Math.min(28, band * 0.72));
  const bars = svgEl("g", { class: "bars" }, svg);
  for (const r of shown) {
    const g = svgEl("g", { class: "round-bar", "data-round": r.round, "data-fragment": r.fragment }, bars);
    let acc = 0;
    for (const [k, , color] of PHASES) {
      const v = r[k] || 0;
      if (v <= 0) continue;
      svgEl("rect", { class: `seg seg-${k.slice(0, -2)}`, x: f.x(r.index) - w / 2, y: f.y(acc + v), width: w,
        height: Math.max(0.5, f.y(acc) - f.y(acc + v)), fill: color }, g);
      acc += v;
    }
    svgEl("title", {}, g, `round ${r.round}${run.snap.run.fragments > 1 ? ` (fragment ${r.fragment})` : ""}: ` +
      PHASES.map(([k, name]) => `${name} ${seconds(r[k] || 0)}`).join(", "));
  }
  if (!shown.length) svgEl("text", { class: "empty", x: f.W / 2, y: f.H / 2, "text-anchor": "middle" }, svg, "no round closed yet");
  const mean = (k) => (run.rounds.length ? run.rounds.reduce((a, r) => a + (r[k] || 0), 0) / run.rounds.length : null);
  legend($("timeline-legend"), PHASES.map(([k, name, color]) => ({ label: name, color, kind: "box",
    value: mean(k) == null ? null : `${seconds(mean(k))} avg` })));
}

// --- panels --------------------------------------------------------------------------------------

function drawIslands() {
  const snap = run.snap, body = $("islands").tBodies[0];
  const rows = snap.islands.map((i) => {
    const tr = document.createElement("tr");
    tr.dataset.island = i.island_id;
    tr.dataset.status = i.status;
    const cell = (text, cls) => htmlEl("td", (cls || "") + (text === "—" ? " none" : ""), tr, text);
    const id = cell("", "id");
    htmlEl("span", "swatch", id).style.background = islandColor(i.island_id);
    id.appendChild(document.createTextNode(i.island_id));
    htmlEl("span", `badge ${i.status}`, cell(""), i.status);
    cell(i.hostname || "—", "host").title = i.hostname;
    cell(String(i.ranks), "num");
    cell(i.lease_age_s == null ? "—" : `${i.lease_age_s.toFixed(1)}s`, "num");
    cell(i.last_push == null ? "—" : ago(snap.now - i.last_push), "num");
    cell(bytes(i.bytes_up), "num");
    cell(bytes(i.bytes_down), "num");
    cell(count(i.tokens), "num");
    cell(fixed(i.train_loss), "num");
    const u = cell(i.utilization == null ? "—" : "");
    if (i.utilization != null) {
      const box = htmlEl("span", "util", u), bar = htmlEl("span", "bar", box), fill = htmlEl("div", null, bar);
      const pct = Math.max(0, Math.min(100, i.utilization * 100));
      fill.style.width = `${pct}%`;
      if (pct < 50) fill.className = "low";
      htmlEl("span", null, box, `${pct.toFixed(0)}%`);
    }
    cell(i.tokens_per_s == null ? "—" : count(i.tokens_per_s), "num");
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr");
    htmlEl("td", "none", tr, "no island has joined yet").colSpan = 12;
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  const by = (s) => snap.islands.filter((i) => i.status === s).length;
  $("islands-note").textContent = `${snap.islands.length} seen · ${by("departed")} departed · ${by("expired")} expired`;
}

function drawShards() {
  // A sharded coordinator's leader: the run above is every shard's; here each shard's part of it.
  const shards = run.snap.shards || [];
  $("shards-card").hidden = !shards.length;
  if (!shards.length) return;
  $("shards").tBodies[0].replaceChildren(...shards.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.shard = String(r.shard);
    htmlEl("td", "num", tr, String(r.shard));
    htmlEl("td", "host", tr, r.address);
    htmlEl("td", "num" + (r.round == null ? " none" : ""), tr, r.round == null ? "—" : String(r.round));
    htmlEl("td", "num", tr, bytes(r.bytes_up));
    htmlEl("td", "num", tr, bytes(r.bytes_down));
    return tr;
  }));
  $("shards-note").textContent = `${shards.length} shards · the leader's figures above are the run's`;
}

// rounds.min_islands to max_islands in words: a bare "islands 4–64" read as a count of islands, or a range of ids.
function islandsRange(r) {
  const n = r.islands_min === r.islands_max ? `${r.islands_min}` : `${r.islands_min} to ${r.islands_max}`;
  return `${n} island${r.islands_max === 1 ? "" : "s"}`;
}

function drawDetails(r) {
  const box = $("run-details");
  box.replaceChildren(`${r.fragments > 1 ? `${r.fragments} fragments (streaming) · ` : ""}H = ${r.inner_steps} inner steps · `);
  const quorum = htmlEl("span", "explained", box, `${islandsRange(r)} per round`);
  quorum.id = "run-quorum";
  quorum.title = `Each round combines the updates of ${islandsRange(r)}: it waits for at least ${r.islands_min} ` +
    `(rounds.min_islands), past its deadline if need be, and closes as soon as ${r.islands_max} have sent theirs ` +
    `(rounds.max_islands, also the most islands the run admits).`;
  box.append(` · ${run.rounds.length} round summaries`);
}

function drawHeader() {
  const snap = run.snap, r = snap.run;
  document.title = `diloco · ${r.name} · round ${snap.round}/${r.total_rounds}`;
  $("run-name").textContent = r.name;
  drawDetails(r);
  $("round").textContent = String(snap.round);
  $("total-rounds").textContent = ` / ${r.total_rounds}`;
  $("progress-bar").style.width = `${Math.min(100, (100 * snap.round) / Math.max(1, r.total_rounds))}%`;
  const evals = run.rounds.filter((x) => x.eval_loss != null);
  const last = evals.length ? evals[evals.length - 1].eval_loss : null;
  $("eval-loss").textContent = last == null ? fixed(snap.initial_eval_loss) : last.toFixed(3);
  $("eval-hint").textContent = snap.initial_eval_loss == null ? "evaluation is off"
    : last == null ? "at the start" : `${(last - snap.initial_eval_loss).toFixed(3)} since the start (${snap.initial_eval_loss.toFixed(3)})`;
  const tf = snap.traffic_factor;
  $("traffic-factor").textContent = tf == null ? "—" : tf === 0 ? "no baseline" : `${tf >= 10 ? tf.toFixed(0) : tf.toFixed(1)}× less`;
  $("traffic-hint").textContent = tf === 0 ? "one island: DDP would send nothing" : "than data-parallel (DDP)";
  const up = run.rounds.reduce((a, x) => a + x.bytes_up, 0), down = run.rounds.reduce((a, x) => a + x.bytes_down, 0);
  $("bytes-total").textContent = bytes(snap.bytes_total);
  $("bytes-hint").textContent = `↑ ${bytes(up)} · ↓ ${bytes(down)}`;
  const live = snap.islands.filter((i) => i.status === "live" || i.status === "probation").length;
  $("islands-live").textContent = String(live);
  $("islands-hint").textContent = `${snap.islands.length} joined over the run`;
  // One name when both directions share the codec: the card has room for one.
  $("codec").textContent = r.codec === r.downlink_codec ? `${r.codec} ↑↓` : `${r.codec} ↑ · ${r.downlink_codec} ↓`;
}

function drawFooter() {
  const snap = run.snap, box = $("events");
  const names = { leases_expired: "leases expired", dropped_nonfinite: "non-finite dropped", checksum_resyncs: "resyncs",
    late_pushes: "late pushes", restarts: "coordinator restarts", rounds_lost: "rounds lost", island_restarts: "island restarts",
    revoked: "revoked", idle_removed: "idle removed" };
  const chips = Object.entries(names).map(([k, label]) => [label, snap.events[k] || 0]);
  const refused = Object.values(snap.events.refusals || {}).reduce((a, n) => a + n, 0);
  chips.push(["calls refused", refused]);
  box.replaceChildren(...chips.map(([label, n]) => {
    const c = htmlEl("span", `chip${n ? " hot" : ""}`, null, `${label}: ${n}`);
    if (label === "calls refused" && refused) c.title = JSON.stringify(snap.events.refusals);
    return c;
  }));
  $("checksum").textContent = snap.checksum ? `checksum ${snap.checksum.slice(0, 16)}` : "";
  $("updated").textContent = `updated ${new Date(snap.now * 1000).toLocaleTimeString()}`;
}

function setStatus(state, text) {
  $("status").dataset.state = state;
  $("status-text").textContent = text;
}

function render() {
  if (!run.snap) return;
  drawHeader();
  drawLoss();
  drawBandwidth();
  drawIslands();
  drawShards();
  drawTimeline();
  drawFooter();
}

// --- polling -------------------------------------------------------------------------------------

async function poll() {
  run.timer = null;
  let delay = POLL_MS;
  try {
    const response = await fetch(`/api/run?since=${run.next}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snap = await response.json();
    if (snap.next_since < run.rounds.length || (snap.rounds.length && snap.rounds[0].index !== run.rounds.length)) {
      // The coordinator's history changed under us (a restore): start over from the first round.
      run.rounds = []; run.next = 0;
      schedule(0);
      return;
    }
    run.rounds.push(...snap.rounds);
    run.next = snap.next_since;
    run.snap = snap;
    run.failures = 0;
    render();
    if (snap.finished) { setStatus("finished", "finished"); return; }  // nothing will change: stop polling
    setStatus("live", "live");
  } catch (err) {
    run.failures += 1;
    delay = Math.min(POLL_MS * 2 ** run.failures, 30000);
    setStatus("reconnecting", `reconnecting (${err.message || err})`);
  }
  schedule(delay);
}

function schedule(ms) {
  if (run.timer == null) run.timer = setTimeout(poll, ms);
}

let resizeTimer = null;
window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(render, 150); });
document.addEventListener("DOMContentLoaded", () => schedule(0));
