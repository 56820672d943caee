// rlcore watch: follows runs through /api/run/I (incremental: each poll asks only for what this
// page lacks) and draws them with uPlot. No reload: charts and tables are updated in place.
"use strict";

const POLL_MS = 2000;
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const PANELS = [
  {id: "reward", title: "reward (train)", keys: ["reward_mean"]},
  {id: "eval", title: "held-out eval: reward and pass@k", keys: ["eval/reward_mean"], prefix: "eval/pass@"},
  {id: "loss", title: "loss", keys: ["loss"]},
  {id: "kl", title: "KL: engine mismatch vs staleness", keys: ["engine_mismatch_kl", "staleness_kl", "mismatch_kl"]},
  {id: "entropy", title: "entropy", keys: ["entropy"]},
  {id: "clip", title: "clip fraction", keys: ["clip_frac"]},
  {id: "throughput", title: "throughput (tokens/s)", keys: ["tokens_per_s", "gen_tokens_per_s"]},
  {id: "busy", title: "busy fraction of the step", keys: ["trainer_busy_frac", "rollout_busy_frac"]},
  {id: "sync", title: "weight sync (s)", keys: ["sync_time_s"]},
  {id: "canary", title: "canary gap vs calibrated bound",
   keys: ["canary_mean_gap", "canary_mean_limit", "canary_max_gap", "canary_max_limit"]},
  {id: "acct", title: "sample accounting (cumulative)",
   keys: ["samples_generated", "samples_trained", "samples_dropped_stale", "samples_failed", "samples_in_flight"]},
  {id: "staleness", title: "staleness (max policy versions behind)", keys: ["max_staleness"]},
];
const LATEST = ["step", "policy_version", "reward_mean", "eval/reward_mean", "loss", "entropy", "engine_mismatch_kl",
  "staleness_kl", "clip_frac", "tokens_per_s", "trainer_busy_frac", "rollout_busy_frac", "sync_time_s",
  "max_staleness", "step_time_s"];
const ACCOUNTING = ["samples_generated", "samples_trained", "samples_dropped_stale", "samples_failed",
  "samples_in_flight", "samples_filtered"];

const runs = [];     // {index, name, epoch, rows, train, evals, samples, events, alarms, ended, polls}
const charts = {};   // panel id -> {plot, div, labels}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(v) {
  if (typeof v !== "number") return v === undefined || v === null ? "" : String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : v.toFixed(a >= 100 ? 0 : 3);
}
function colour(i) { return COLOURS[i % COLOURS.length]; }

async function poll(run) {
  const q = `epoch=${run.epoch}&rows=${run.rows.length}&samples=${run.samples.length}&events=${run.events.length}`;
  const resp = await fetch(`/api/run/${run.index}?${q}`, {cache: "no-store"});
  const p = await resp.json();
  const reset = p.epoch !== run.epoch;
  if (reset) {  // the run's files were cut back (resumed): start over
    Object.assign(run, {epoch: p.epoch, rows: [], train: [], evals: [], samples: [], events: []});
  }
  for (const row of p.rows) {
    run.rows.push(row);
    (("reward_mean" in row) ? run.train : ("eval/reward_mean" in row ? run.evals : [])).push(row);
  }
  run.samples.push(...p.samples);
  run.events.push(...p.events);
  run.alarms = p.alarms;
  run.ended = p.ended;
  run.polls += 1;
  return {rows: reset || p.rows.length > 0, samples: reset || p.samples.length > 0, events: reset || p.events.length > 0};
}

function series(run, key) {
  const src = key.startsWith("eval/") ? run.evals : run.train;
  return [src.map(r => r.step), src.map(r => (typeof r[key] === "number" ? r[key] : null))];
}

function panelKeys(panel) {
  const keys = [...panel.keys];
  if (panel.prefix) {
    for (const run of runs) for (const r of run.evals) for (const k of Object.keys(r)) {
      if (k.startsWith(panel.prefix) && k.split("/").length === 2 && !keys.includes(k)) keys.push(k);
    }
  }
  return keys;
}

function drawCharts() {
  for (const panel of PANELS) {
    const tables = [], labels = [];
    for (const run of runs) {
      for (const key of panelKeys(panel)) {
        const [xs, ys] = series(run, key);
        if (!ys.some(v => v !== null)) continue;
        tables.push([xs, ys]);
        labels.push({run: run.index, label: runs.length > 1 ? `${run.name}: ${key}` : key});
      }
    }
    if (!tables.length) continue;
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const sig = labels.map(l => l.label).join("|");
    let c = charts[panel.id];
    if (c && c.sig !== sig) { c.plot.destroy(); c.div.remove(); c = undefined; }
    if (!c) {
      const div = el("div", {class: "panel", id: `panel-${panel.id}`});
      div.appendChild(el("h3", {}, panel.title));
      // in PANELS order, whichever curve gets data first (eval rows come later than train rows)
      const later = PANELS.slice(PANELS.indexOf(panel) + 1).map(p => charts[p.id]).find(x => x);
      document.getElementById("charts").insertBefore(div, later ? later.div : null);
      const perRun = {};
      const opts = {
        width: 420, height: 200, scales: {x: {time: false}},
        series: [{label: "step"}, ...labels.map(l => {
          const n = perRun[l.run] = (perRun[l.run] || 0) + 1;
          return {label: l.label, stroke: colour(l.run * 3 + n - 1), width: 1.5, spanGaps: true,
                  dash: n > 1 && runs.length > 1 ? [6, 3] : undefined,
                  points: {show: panel.id === "eval"}};
        })],
        axes: [{label: "step"}, {size: 60}],
      };
      c = charts[panel.id] = {plot: new uPlot(opts, data, div), div, sig};
    } else {
      c.plot.setData(data);
    }
    c.div.dataset.points = String(data[0].length);
  }
}

function drawRuns() {
  const ul = document.getElementById("runs");
  ul.replaceChildren(...runs.map(run => {
    const last = run.train.length ? run.train[run.train.length - 1].step : "-";
    const li = el("li", {"data-run": run.index, "data-rows": run.rows.length, "data-last-step": last,
                         "data-ended": run.ended ? "1" : "0", "data-polls": run.polls,
                         class: run.ended ? "ended" : "live"});
    const dot = el("span", {class: "dot"}); dot.style.background = colour(run.index * 3);
    li.append(dot, el("b", {}, run.name), ` step ${last} `, el("span", {class: "state"}, run.ended ? "ended" : "live"));
    li.title = run.path;
    return li;
  }));
}

function drawLatest() {
  const table = document.getElementById("latest");
  const head = el("tr"); head.appendChild(el("th", {}, "run"));
  for (const k of LATEST) head.appendChild(el("th", {}, k));
  const rows = [head];
  for (const run of runs) {
    const last = Object.assign({}, run.train[run.train.length - 1] || {});
    const ev = run.evals[run.evals.length - 1];
    if (ev) last["eval/reward_mean"] = ev["eval/reward_mean"];
    const tr = el("tr", {"data-run": run.index}); tr.appendChild(el("th", {}, run.name));
    for (const k of LATEST) {
      const td = el("td", {"data-key": k}, fmt(last[k]));
      if (typeof last[k] === "number") td.dataset.value = String(last[k]);
      tr.appendChild(td);
    }
    rows.push(tr);
  }
  table.replaceChildren(...rows);
}

function drawAccounting() {
  const table = document.getElementById("accounting");
  const head = el("tr"); head.appendChild(el("th", {}, "run"));
  for (const k of ["step", ...ACCOUNTING, "identity"]) head.appendChild(el("th", {}, k.replace("samples_", "")));
  const rows = [head];
  const reasons = {};
  for (const run of runs) {
    const last = run.train[run.train.length - 1] || {};
    const tr = el("tr", {"data-run": run.index}); tr.appendChild(el("th", {}, run.name));
    for (const k of ["step", ...ACCOUNTING]) {
      const td = el("td", {"data-key": k}, fmt(last[k]));
      if (typeof last[k] === "number") td.dataset.value = String(last[k]);
      tr.appendChild(td);
    }
    const parts = ACCOUNTING.slice(1).map(k => last[k] || 0).reduce((a, b) => a + b, 0);
    const ok = last.samples_generated === undefined || parts === last.samples_generated;
    tr.appendChild(el("td", {"data-key": "identity", class: ok ? "" : "bad"}, ok ? "holds" : `off by ${last.samples_generated - parts}`));
    rows.push(tr);
    for (const r of run.train) for (const [reason, n] of Object.entries(r.failed_by_reason || {})) {
      const key = `${run.index}\u0000${reason}`;
      reasons[key] = (reasons[key] || 0) + n;
    }
  }
  table.replaceChildren(...rows);
  const ft = document.getElementById("failures");
  const frows = [el("tr")]; frows[0].append(el("th", {}, "run"), el("th", {}, "reason"), el("th", {}, "samples"));
  for (const [key, n] of Object.entries(reasons).sort((a, b) => b[1] - a[1])) {
    const [ri, reason] = key.split("\u0000");
    const tr = el("tr", {"data-run": ri, "data-reason": reason});
    tr.append(el("td", {}, runs[ri].name), el("td", {}, reason), el("td", {"data-key": "count"}, String(n)));
    frows.push(tr);
  }
  if (frows.length === 1) frows.push(el("tr", {}, "no failed sample"));
  ft.replaceChildren(...frows);
}

function drawTimeline() {
  const items = [];
  for (const run of runs) for (const e of run.events) items.push({run, e});
  const startOf = run => (run.events.find(e => e.kind === "start") || {}).time;
  // start-up before step 1; step events at their step; the run's end (or interrupt) last
  const rank = ({e}) => (e.step !== undefined && e.step !== null ? e.step + 0.5
    : (e.kind === "end" || e.kind === "interrupt" ? Infinity : -1));
  items.sort((a, b) => (rank(a) === rank(b) ? 0 : rank(a) - rank(b)) || (a.e.time || 0) - (b.e.time || 0));
  document.getElementById("timeline").replaceChildren(...items.map(({run, e}) => {
    const t0 = startOf(run);
    const when = e.step !== undefined && e.step !== null ? `step ${e.step}`
      : (e.time && t0 ? `+${(e.time - t0).toFixed(1)}s` : "");
    const secs = typeof e.seconds === "number" ? ` (${e.seconds.toFixed(1)}s)` : "";
    const li = el("li", {"data-kind": e.kind, "data-run": run.index, "data-step": e.step ?? ""},
                  `${runs.length > 1 ? run.name + " " : ""}${when} [${e.kind}] ${e.text}${secs}`);
    return li;
  }));
}

function versionColour(v, lo, hi) {
  if (v < 0) return "#eee";  // environment tokens (not the policy's)
  const t = hi > lo ? (v - lo) / (hi - lo) : 1;
  return `hsl(${210 - 170 * t}, 70%, 82%)`;  // oldest blue .. newest orange
}
function logprobColour(lp) {
  const t = Math.min(1, -lp / 5);  // 0 nats: white, <= -5 nats: red
  return `hsl(0, 80%, ${100 - 30 * t}%)`;
}
const GAP_SCALE = [0, 0.01, 0.1, 0.3, 1];  // nats: the legend's steps
function gapColour(gap) {
  if (gap === null || gap === undefined) return "#eee";  // no trainer logprob (an environment token)
  const t = Math.min(1, Math.sqrt(gap));  // 0: white, 0.01: faint, 0.1: light, >= 1 nat: deep purple
  return `hsl(280, 70%, ${100 - 45 * t}%)`;
}
function tokenGap(s, i) {
  const t = s.trainer_logprobs ? s.trainer_logprobs[i] : null;
  return t === null || t === undefined ? null : Math.abs(t - s.token_logprobs[i]);
}
// The reasons of the failed samples of the run (the filter's options after "all" and "scored").
function syncReasons(run) {
  const sel = document.getElementById("f-reason");
  const reasons = [...new Set(run.samples.map(s => s.failed_reason).filter(r => r))].sort();
  if (sel.options.length === reasons.length + 2) return;
  const keep = sel.value;
  sel.replaceChildren(el("option", {value: ""}, "all samples"), el("option", {value: "scored"}, "scored only"),
                      ...reasons.map(r => el("option", {value: r}, `failed: ${r}`)));
  sel.value = keep;
}
function reasonOk(s, reason) {
  return reason === "" || (reason === "scored" ? !s.failed_reason : s.failed_reason === reason);
}
function rewardOk(s, rmin, rmax) {  // a failed sample has no reward: only the open range keeps it
  return s.reward === null ? rmin === -Infinity && rmax === Infinity : s.reward >= rmin && s.reward <= rmax;
}

function drawSamples() {
  const runSel = document.getElementById("f-run");
  if (runSel.options.length !== runs.length) {
    runSel.replaceChildren(...runs.map(r => el("option", {value: r.index}, r.name)));
  }
  const run = runs[Number(runSel.value || 0)];
  if (!run) return;
  const stepSel = document.getElementById("f-step");
  const steps = [...new Set(run.samples.map(s => s.step))];
  if (stepSel.options.length !== steps.length + 1) {
    const keep = stepSel.value;
    stepSel.replaceChildren(el("option", {value: ""}, "all"), ...steps.map(s => el("option", {value: s}, String(s))));
    stepSel.value = keep;
  }
  const val = id => document.getElementById(id).value;
  const rmin = val("f-rmin") === "" ? -Infinity : Number(val("f-rmin"));
  const rmax = val("f-rmax") === "" ? Infinity : Number(val("f-rmax"));
  syncReasons(run);
  const text = val("f-text").toLowerCase(), step = val("f-step"), by = val("f-colour"), reason = val("f-reason");
  const shown = run.samples.filter(s => rewardOk(s, rmin, rmax) && (step === "" || String(s.step) === step)
    && reasonOk(s, reason) && (!text || (s.prompt + s.completion).toLowerCase().includes(text)));
  const vs = shown.flatMap(s => (s.token_versions || []).filter(v => v >= 0));
  const lo = vs.length ? Math.min(...vs) : 0, hi = vs.length ? Math.max(...vs) : 0;
  const legend = document.getElementById("legend");
  const swatch = (text, background) => Object.assign(el("span", {}, text), {style: `background:${background}`});
  legend.replaceChildren(...(by === "version"
    ? [lo, hi].filter((v, i, a) => a.indexOf(v) === i).map(v => swatch(`version ${v}`, versionColour(v, lo, hi)))
    : by === "gap"
      ? [el("b", {}, "|trainer \u2212 engine| logprob: "), ...GAP_SCALE.map(g => swatch(`${g} nats`, gapColour(g))),
         swatch("no trainer logprob", gapColour(null))]
      : [0, -1, -3, -5].map(lp => swatch(`${lp} nats`, logprobColour(lp)))));
  const list = shown.slice(-200).reverse().map(s => {
    const div = el("div", {class: s.failed_reason ? "sample failed" : "sample", "data-step": s.step,
                           "data-reward": String(s.reward), "data-reason": s.failed_reason || ""});
    div.appendChild(el("div", {class: "meta"}, s.failed_reason ? `step ${s.step} | failed: ${s.failed_reason}`
      : `step ${s.step} | reward ${fmt(s.reward)} | version ${s.version ?? "-"}`));
    if (s.error) div.appendChild(el("div", {class: "error"}, s.error));
    div.appendChild(el("div", {class: "prompt"}, s.prompt));
    const comp = el("div", {class: "completion"});
    if (s.tokens) {
      s.tokens.forEach((t, i) => {
        const v = s.token_versions[i], lp = s.token_logprobs[i], gap = tokenGap(s, i);
        const trainer = gap === null ? "" : `, trainer logprob ${s.trainer_logprobs[i]}, gap ${gap.toFixed(4)} nats`;
        const span = el("span", {class: "tok", "data-version": v, "data-logprob": lp, "data-gap": gap ?? "",
                                 title: `version ${v}, engine logprob ${lp}${trainer}`}, t);
        span.style.background = by === "version" ? versionColour(v, lo, hi) : by === "gap" ? gapColour(gap) : logprobColour(lp);
        comp.appendChild(span);
      });
    } else {
      comp.textContent = s.completion;
    }
    div.appendChild(comp);
    return div;
  });
  document.getElementById("sample-list").replaceChildren(...list);
  document.getElementById("samples").dataset.shown = String(list.length);
  document.getElementById("samples").dataset.total = String(run.samples.length);
}

function drawAlarms() {
  const items = [];
  for (const run of runs) for (const a of run.alarms || []) {
    items.push(el("li", {"data-alarm": a.id, "data-run": run.index}, `${runs.length > 1 ? run.name + ": " : ""}step ${a.step}: ${a.text}`));
  }
  document.getElementById("alarms").replaceChildren(...(items.length ? items : [el("li", {class: "ok"}, "no alarm")]));
}

// Only what changed is drawn again: a page left open on a long run costs its browser little.
function draw(changed) {
  drawRuns();
  if (changed.rows) { drawAlarms(); drawLatest(); drawCharts(); drawAccounting(); }
  if (changed.events) drawTimeline();
  if (changed.samples) drawSamples();
  document.body.dataset.polls = String(runs.reduce((a, r) => a + r.polls, 0));
}

async function loop() {
  const changed = {rows: false, samples: false, events: false};
  for (const run of runs) {
    try {
      const c = await poll(run);
      for (const k of Object.keys(changed)) changed[k] = changed[k] || c[k];
      delete document.body.dataset.error;
    } catch (err) { document.body.dataset.error = String(err); }
  }
  draw(changed);
  setTimeout(loop, POLL_MS);
}

async function start() {
  let list;
  try {
    list = await (await fetch("/api/runs", {cache: "no-store"})).json();
  } catch (err) {  // the server is not up yet (a page opened as the run starts): try again
    document.body.dataset.error = String(err);
    setTimeout(start, POLL_MS);
    return;
  }
  delete document.body.dataset.error;
  for (const r of list) runs.push({...r, epoch: 0, rows: [], train: [], evals: [], samples: [], events: [], alarms: [],
                                   ended: false, polls: 0});
  for (const id of ["f-run", "f-step", "f-rmin", "f-rmax", "f-text", "f-reason", "f-colour"]) {
    document.getElementById(id).addEventListener("input", drawSamples);
  }
  loop();
}
start();
