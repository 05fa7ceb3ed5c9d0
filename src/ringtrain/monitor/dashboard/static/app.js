/* ringtrain dashboard: polls the JSON API about once a second and draws with uPlot.
 * Plain JavaScript, no build step. Every text that comes from a run directory is inserted with
 * textContent (never as HTML). */
(function () {
  "use strict";

  const POLL_MS = 1000;
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31"];
  const RED = "#d62728";
  const PARTS = [ // a timing window's mean seconds per step; they add up to step_s_mean
    ["data_s", "data", "#4e79a7"],
    ["compute_s", "compute", "#59a14f"],
    ["comm_exposed_s", "comm exposed", "#f28e2b"],
    ["optimizer_s", "optimizer", "#b07aa1"],
    ["other_s", "other", "#a0a0a0"],
  ];
  const TERMINAL = new Set(["FINISHED", "ERRORED", "ABORTED", "STOPPED", "PREEMPTED"]);
  const RESUMABLE = "resumable: its state was saved at the stop step; run it again with the same name (or ringtrain run --resume) to continue";

  // ------------------------------------------------------------------ helpers

  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k === "style") node.style.cssText = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else node[k] = v;
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function fmtNum(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(3);
    return String(Number(v.toPrecision(4)));
  }

  function fmtDuration(s) {
    if (!isNum(s)) return "-";
    s = Math.max(0, s);
    if (s < 59.95) return s.toFixed(1) + "s";
    let t = Math.round(s);
    const m = Math.floor(t / 60), sec = t % 60;
    if (m < 60) return `${m}m ${String(sec).padStart(2, "0")}s`;
    const h = Math.floor(m / 60), min = m % 60;
    if (h < 24) return `${h}h ${String(min).padStart(2, "0")}m`;
    return `${Math.floor(h / 24)}d ${String(h % 24).padStart(2, "0")}h`;
  }

  function fmtElapsed(s) { // axis ticks: compact
    if (!isNum(s)) return "";
    const sign = s < 0 ? "-" : "";
    s = Math.abs(s);
    if (s < 60) return sign + (Number.isInteger(s) ? s : s.toFixed(1)) + "s";
    const m = Math.floor(s / 60), sec = Math.round(s % 60);
    if (m < 60) return `${sign}${m}m${sec ? String(sec).padStart(2, "0") + "s" : ""}`;
    const h = Math.floor(m / 60);
    return `${sign}${h}h${String(m % 60).padStart(2, "0")}m`;
  }

  function fmtBytes(n) {
    if (!isNum(n)) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = n, i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return i === 0 ? `${Math.round(v)} B` : `${v.toFixed(1)} ${units[i]}`;
  }

  function fmtMs(seconds) {
    if (!isNum(seconds)) return "-";
    const ms = seconds * 1000;
    return (ms < 10 ? ms.toFixed(2) : ms < 100 ? ms.toFixed(1) : ms.toFixed(0)) + " ms";
  }

  function fmtClock(t) {
    if (!isNum(t)) return "-";
    const d = new Date(t * 1000);
    const p = (x) => String(x).padStart(2, "0");
    return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ` +
      `${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
  }

  function fmtMetrics(m, max) {
    const keys = Object.keys(m || {});
    if (keys.includes("epoch")) keys.splice(keys.indexOf("epoch"), 1), keys.unshift("epoch");
    const shown = max ? keys.slice(0, max) : keys;
    let text = shown.map((k) => `${k}=${fmtNum(m[k])}`).join(" ");
    if (shown.length < keys.length) text += ` (+${keys.length - shown.length} more)`;
    return text;
  }

  function badge(status) {
    if (status === "PREEMPTED") {
      return el("span", { class: `badge ${status}`, text: "PREEMPTED (resumable)", title: RESUMABLE });
    }
    return el("span", { class: `badge ${status}`, text: status });
  }

  function replaceRows(tbody, rows) {
    tbody.replaceChildren(...rows);
  }

  // ------------------------------------------------------------------ API

  const params = new URLSearchParams(location.search);
  const TOKEN = params.get("token");
  if (TOKEN) { // the cookie the server just set carries it from now on; keep it out of history
    params.delete("token");
    const q = params.toString();
    history.replaceState(null, "", location.pathname + (q ? "?" + q : "") + location.hash);
  }

  class HttpError extends Error {
    constructor(status, text) { super(text); this.status = status; }
  }

  async function api(path) {
    const headers = TOKEN ? { "X-Ringtrain-Token": TOKEN } : {};
    const r = await fetch(path, { credentials: "same-origin", cache: "no-store", headers });
    if (!r.ok) throw new HttpError(r.status, (await r.text()).slice(0, 500));
    return r.json();
  }

  // ------------------------------------------------------------------ charts

  const charts = new Map(); // id -> {u, key, box}

  function chartWidth(box) {
    return Math.max(240, Math.floor(box.clientWidth || box.parentElement.clientWidth || 400));
  }

  /** Creates or updates chart `id` in `box`: recreated when `key` (its series) changes. */
  function plot(id, box, key, makeOpts, data) {
    let c = charts.get(id);
    if (c && (c.key !== key || c.box !== box || !box.isConnected)) {
      c.u.destroy();
      charts.delete(id);
      c = null;
    }
    if (!c) {
      box.replaceChildren();
      const opts = makeOpts();
      opts.width = chartWidth(box);
      opts.height = opts.height || 210;
      c = { u: new uPlot(opts, data, box), key, box };
      charts.set(id, c);
    } else {
      c.u.setData(data);
    }
    box.setAttribute("data-points", String(data[0].length));
    return c.u;
  }

  function destroyCharts() {
    for (const c of charts.values()) c.u.destroy();
    charts.clear();
  }

  window.addEventListener("resize", () => {
    for (const c of charts.values()) {
      if (c.box.isConnected) c.u.setSize({ width: chartWidth(c.box), height: c.u.height });
    }
  });

  // Tick steps for "time since start": round seconds, minutes and hours.
  const ELAPSED_STEPS = [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800,
    3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];
  const xAxis = (label) => ({
    label, labelSize: 18, size: 34, incrs: ELAPSED_STEPS, space: 60,
    values: (u, splits) => splits.map(fmtElapsed),
    grid: { stroke: "#eef0f3" },
  });
  const yAxis = (label, fmt, size) => ({
    label, labelSize: 18, size: size || 56,
    values: (u, splits) => splits.map(fmt || fmtNum),
    grid: { stroke: "#eef0f3" },
  });

  function timeOpts(yLabel, series, yFmt, ySize) {
    return {
      scales: { x: { time: false } },
      axes: [xAxis("time since start"), yAxis(yLabel, yFmt, ySize)],
      series: [{ label: "time", value: (u, v) => (v === null ? "-" : fmtElapsed(v)) }, ...series],
      cursor: { drag: { x: true, y: false } },
    };
  }

  // ------------------------------------------------------------------ runs table

  const list = { data: null, sort: null };

  function runColumns(d) {
    const cols = [
      { id: "name", label: "Name", get: (r) => r.name },
      { id: "status", label: "Status", get: (r) => r.status },
      { id: "start_time", label: "Started", get: (r) => r.start_time, num: false },
      { id: "duration_s", label: "Duration", get: (r) => r.duration_s, num: true },
      { id: "world_size", label: "Workers", get: (r) => r.world_size, num: true },
      { id: "rounds", label: "Rounds", get: (r) => r.rounds, num: true },
      { id: "num_checkpoints", label: "Ckpts", get: (r) => r.num_checkpoints, num: true },
    ];
    if (d.hparams.length) { // a sweep's trials: hyperparameters and final metrics as columns
      for (const k of d.hparams) {
        cols.push({ id: "h:" + k, label: k, get: (r) => (r.config || {})[k], num: true, hparam: true });
      }
      for (const k of d.metrics) {
        cols.push({ id: "m:" + k, label: k, get: (r) => (r.metrics || {})[k], num: true });
      }
    } else {
      cols.push({ id: "metrics", label: "Last metrics", get: (r) => fmtMetrics(r.metrics, 8) });
    }
    return cols;
  }

  function compare(a, b) {
    const na = a === null || a === undefined || a === "", nb = b === null || b === undefined || b === "";
    if (na || nb) return na && nb ? 0 : na ? 1 : -1; // missing values last either way
    if (typeof a === "number" && typeof b === "number") return a - b;
    return String(a).localeCompare(String(b), undefined, { numeric: true });
  }

  function renderRuns(d) {
    list.data = d;
    $("root-path").textContent = d.path;
    const cols = runColumns(d);
    const thead = $("runs-table").tHead;
    const headRow = el("tr");
    for (const c of cols) {
      const th = el("th", { text: c.label, class: (c.num ? "num " : "") + (c.hparam ? "hparam" : ""),
        title: c.hparam ? "hyperparameter (train_loop_config)" : "sort by " + c.label });
      th.dataset.col = c.id;
      if (list.sort && list.sort.id === c.id) th.dataset.dir = list.sort.dir;
      th.addEventListener("click", () => {
        const dir = list.sort && list.sort.id === c.id && list.sort.dir === "asc" ? "desc" : "asc";
        list.sort = { id: c.id, dir };
        renderRuns(list.data);
      });
      headRow.append(th);
    }
    thead.replaceChildren(headRow);

    let rows = d.runs.slice();
    if (list.sort) {
      const col = cols.find((c) => c.id === list.sort.id);
      if (col) {
        const sign = list.sort.dir === "asc" ? 1 : -1;
        rows.sort((a, b) => {
          const va = col.get(a), vb = col.get(b);
          const missing = va === null || va === undefined || vb === null || vb === undefined;
          return missing ? compare(va, vb) : sign * compare(va, vb);
        });
      }
    }
    const trs = rows.map((r) => {
      const tr = el("tr", { "data-run": r.name, "data-status": r.status });
      if (r.stragglers && r.stragglers.length) tr.classList.add("has-straggler");
      for (const c of cols) {
        const v = c.get(r);
        let td;
        if (c.id === "name") {
          td = el("td", {}, el("a", { href: "#run=" + encodeURIComponent(r.name), text: r.name }));
        } else if (c.id === "status") {
          td = el("td", { class: "status", title: r.error || "" }, badge(r.status));
          if (r.stragglers && r.stragglers.length) {
            td.append(" ", el("span", { class: "badge straggler",
              text: "straggler: rank " + r.stragglers.join(", ") }));
          }
        } else if (c.id === "start_time") {
          td = el("td", { text: fmtClock(v) });
        } else if (c.id === "duration_s") {
          td = el("td", { class: "num", text: fmtDuration(v) });
        } else if (c.id === "metrics") {
          td = el("td", { class: "mono", text: v });
        } else {
          td = el("td", { class: c.num && typeof v === "number" ? "num" : "", text: fmtNum(v) });
        }
        tr.append(td);
      }
      return tr;
    });
    replaceRows($("runs-table").tBodies[0], trs);
    $("runs-count").textContent = `${d.runs.length} in ${d.path}`;
    $("runs-hint").hidden = d.runs.length < 2;
    $("trials-note").hidden = d.hparams.length === 0;
    const empty = $("runs-empty");
    empty.hidden = d.runs.length > 0;
    empty.textContent = d.exists ? `No runs in ${d.path} yet.` : `${d.path} does not exist (yet).`;
    window.rtDash.runs = d.runs.length;
    const sweeps = d.sweeps || [];
    $("sweeps-list").hidden = sweeps.length === 0;
    replaceRows($("sweeps-list"), sweeps.map((s) => el("li", {
      text: `sweep ${s.name} (${s.status}): ${s.counts} — its trials: ringtrain dashboard ${s.path}`,
    })));
  }

  // ------------------------------------------------------------------ one run

  let run = null;

  function newRun(name) {
    return { name, gen: null, metrics: [], timing: [], timeline: [], data: null, version: 0,
      drawn: -1, rankChoice: null, lastTimeline: -1, failuresKey: "", checkpointsKey: "",
      resizesKey: "" };
  }

  function resetRunView() {
    destroyCharts();
    $("metric-charts").replaceChildren();
    for (const id of ["workers-table", "timeline-table", "checkpoints-table", "resizes-table"]) {
      $(id).tBodies[0].replaceChildren();
    }
    $("timeline-strip").replaceChildren();
    $("failures").replaceChildren();
    $("breakdown-rank").replaceChildren();
    $("run-error").hidden = true;
    $("straggler-banner").hidden = true;
    $("elastic-panel").hidden = true;
  }

  async function pollRun(name) {
    if (!run || run.name !== name) { run = newRun(name); resetRunView(); }
    const state = run;
    const q = new URLSearchParams({ gen: state.gen || "", metrics: state.metrics.length,
      timing: state.timing.length, timeline: state.timeline.length });
    const d = await api(`api/runs/${encodeURIComponent(name)}?${q}`);
    if (run !== state) return false; // the page moved on meanwhile
    if (d.generation !== state.gen) {
      state.gen = d.generation;
      state.metrics = []; state.timing = []; state.timeline = [];
    }
    let grew = false;
    for (const k of ["metrics", "timing", "timeline"]) {
      const part = d[k];
      if (part.items.length || part.start < state[k].length) {
        state[k] = state[k].slice(0, part.start).concat(part.items);
        grew = true;
      }
    }
    if (grew) state.version++;
    state.data = d;
    renderRun(state);
    return d.more;
  }

  function startTime(state) {
    const s = state.data.summary;
    if (isNum(s.start_time)) return s.start_time;
    const first = state.timeline[0] || state.metrics[0] || state.timing[0];
    return first && isNum(first.time) ? first.time : 0;
  }

  function renderRun(state) {
    const d = state.data;
    const s = d.summary;
    $("root-path").textContent = d.path;
    $("run-name").textContent = d.name;
    $("run-status").className = "badge " + s.status;
    $("run-status").textContent = s.status === "PREEMPTED" ? "PREEMPTED (resumable)" : s.status;
    $("run-status").title = s.status === "PREEMPTED" ? RESUMABLE : "";
    const facts = [
      ["Started", fmtClock(s.start_time)],
      ["Duration", fmtDuration(s.duration_s)],
      ["Workers", workersText(d)],
      ["Rounds", s.rounds ?? "-"],
      ["Attempt", d.attempt],
      ["Checkpoints", s.num_checkpoints],
      ...(d.diloco ? [["Outer steps", d.diloco.outer_steps ?? "-"]] : []),
      ["Path", d.path],
    ];
    $("run-facts").replaceChildren(...facts.map(([k, v]) =>
      el("div", { "data-fact": k.toLowerCase() }, el("dt", { text: k }), el("dd", { text: String(v) }))));
    $("run-error").hidden = !s.error;
    $("run-error").textContent = s.error || "";
    const cfg = [];
    for (const [k, v] of Object.entries(d.train_loop_config || {})) {
      cfg.push(el("span", { class: "pill", text: `${k}=${typeof v === "object" ? JSON.stringify(v) : fmtNum(v)}` }));
    }
    $("run-config").replaceChildren(...cfg);

    renderStragglers(d);
    if (state.drawn !== state.version || state.flaggedKey !== flaggedKey(d)) {
      state.drawn = state.version;
      state.flaggedKey = flaggedKey(d);
      renderMetrics(state);
      renderTiming(state);
    }
    renderWorkers(state);
    renderDiloco(d);
    renderElastic(state);
    renderTimeline(state);
    renderCheckpoints(state);
    renderFailures(state);

    Object.assign(window.rtDash, {
      run: d.name,
      status: s.status,
      metricRounds: state.rounds || 0,
      timingWindows: state.timing.length,
      timelineEvents: state.timeline.length,
      stragglers: d.stragglers.map((x) => x.rank),
      worldSize: s.world_size ?? null,
      resizes: d.resizes.length,
      leftRanks: d.left_ranks.map((x) => x.rank),
      outerSteps: d.diloco ? d.diloco.outer_steps : null,
    });
  }

  const flaggedKey = (d) => d.stragglers.map((x) => x.rank).join(",");

  function renderStragglers(d) {
    const banner = $("straggler-banner");
    banner.hidden = d.stragglers.length === 0;
    $("straggler-list").replaceChildren(...d.stragglers.map((x) => {
      const ratio = isNum(x.ratio) ? `${x.ratio.toFixed(2)}× the median of the others` : "";
      const parts = [`rank ${x.rank}`, x.reason ? `slow in ${x.reason}` : "",
        isNum(x.busy_s) ? `busy ${fmtMs(x.busy_s)} per step` : "",
        ratio + (isNum(x.median_s) ? ` (${fmtMs(x.median_s)})` : "")].filter(Boolean);
      const li = el("li", { "data-rank": String(x.rank), text: parts.join(", ") });
      if (x.message) li.title = x.message;
      return li;
    }));
  }

  // Metrics per round (rank 0): one small chart per numeric metric.
  function renderMetrics(state) {
    const byRound = new Map();
    let attempt = -1;
    for (const it of state.metrics) {
      if (it.attempt > attempt) { // a restarted attempt re-reports from its checkpoint on
        attempt = it.attempt;
        for (const r of [...byRound.keys()]) if (r >= it.round) byRound.delete(r);
      }
      byRound.set(it.round, it.metrics);
    }
    const rounds = [...byRound.keys()].sort((a, b) => a - b);
    state.rounds = rounds.length;
    const keys = [];
    const seen = new Set();
    for (const r of rounds) {
      for (const [k, v] of Object.entries(byRound.get(r))) {
        if (!seen.has(k) && isNum(v)) { seen.add(k); keys.push(k); }
      }
    }
    $("metric-rounds").textContent = `${rounds.length} round${rounds.length === 1 ? "" : "s"}`;
    $("metric-empty").hidden = rounds.length > 0;
    const grid = $("metric-charts");
    keys.forEach((k, i) => {
      let box = grid.querySelector(`[data-metric="${CSS.escape(k)}"]`);
      if (!box) {
        box = el("div", { class: "chart-box", "data-metric": k },
          el("div", { class: "chart-title", text: k }), el("div", { class: "chart" }));
        grid.append(box);
      }
      const x = rounds;
      const y = rounds.map((r) => (isNum(byRound.get(r)[k]) ? byRound.get(r)[k] : null));
      const color = PALETTE[i % PALETTE.length];
      plot("metric:" + k, box.lastChild, "m:" + k, () => ({
        height: 190,
        scales: { x: { time: false } },
        axes: [
          { label: "round", labelSize: 18, size: 34, grid: { stroke: "#eef0f3" },
            values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? String(v) : "")) },
          yAxis(k, fmtNum, 60),
        ],
        series: [{ label: "round" },
          { label: k, stroke: color, width: 1.6, spanGaps: true, value: (u, v) => fmtNum(v),
            points: { show: rounds.length <= 60, size: 4 } }],
        legend: { show: true },
      }), [x, y]);
    });
  }

  // Timing windows: per-rank series on a shared time axis (null where a rank has no point).
  function timingModel(state) {
    const t0 = startTime(state);
    const rows = state.timing.filter((w) => isNum(w.time)).slice().sort((a, b) => a.time - b.time);
    const ranks = [...new Set(rows.map((w) => w.rank))].sort((a, b) => a - b);
    const times = [];
    const index = new Map();
    for (const w of rows) {
      if (!index.has(w.time)) { index.set(w.time, times.length); times.push(w.time); }
    }
    const x = times.map((t) => t - t0);
    const slot = new Map(ranks.map((r, i) => [r, i]));
    const col = (field, scale) => { // one array per rank, in one pass over the windows
      const arrays = ranks.map(() => new Array(times.length).fill(null));
      for (const w of rows) {
        if (isNum(w[field])) arrays[slot.get(w.rank)][index.get(w.time)] = w[field] * (scale || 1);
      }
      return arrays;
    };
    return { t0, rows, ranks, times, index, x, col };
  }

  function rankSeries(ranks, flagged, fmt, left) {
    return ranks.map((r, i) => {
      const bad = flagged.has(r);
      const gone = left && left.has(r);
      return { label: `rank ${r}${bad ? " (straggler)" : gone ? " (left)" : ""}`,
        stroke: bad ? RED : PALETTE[i % PALETTE.length], dash: gone ? [5, 4] : undefined,
        width: bad ? 3 : 1.4, spanGaps: true, value: (u, v) => (v === null ? "-" : fmt(v)),
        points: { show: false } };
    });
  }

  function renderTiming(state) {
    const d = state.data;
    const m = timingModel(state);
    const flagged = new Set(d.stragglers.map((x) => x.rank));
    const left = new Set(d.left_ranks.map((x) => x.rank));
    const key = m.ranks.join(",") + "|" + [...flagged].join(",") + "|" + [...left].join(",");
    $("timing-count").textContent = `${state.timing.length} timing window${state.timing.length === 1 ? "" : "s"}`;
    $("timing-charts").hidden = m.rows.length === 0;
    $("workers-empty").hidden = m.rows.length > 0;
    if (!m.rows.length) return;
    const msFmt = (v) => fmtNum(v) + " ms";

    plot("step", $("chart-step"), key, () => timeOpts("ms per step",
      rankSeries(m.ranks, flagged, msFmt, left), fmtNum), [m.x, ...m.col("step_s", 1000)]);

    // Throughput: each rank, and the total (the sum of every rank's latest window; a rank
    // that left the group in a resize no longer counts).
    const per = m.col("samples_per_s");
    const total = new Array(m.times.length).fill(null);
    const latest = new Map();
    const changes = d.world_sizes.filter((c) => c.event === "resize" && isNum(c.time));
    let attempt = null, next = 0;
    for (const w of m.rows) {
      if (w.attempt !== attempt) { latest.clear(); attempt = w.attempt; }
      for (; next < changes.length && changes[next].time <= w.time; next++) {
        for (const r of [...latest.keys()]) if (r >= changes[next].world_size) latest.delete(r);
      }
      if (isNum(w.samples_per_s)) latest.set(w.rank, w.samples_per_s);
      let sum = 0;
      for (const v of latest.values()) sum += v;
      total[m.index.get(w.time)] = sum;
    }
    const rateFmt = (v) => fmtNum(v) + "/s";
    plot("throughput", $("chart-throughput"), key, () => timeOpts("samples/s", [
      { label: "total", stroke: "#1d2330", width: 2.2, spanGaps: true,
        value: (u, v) => (v === null ? "-" : rateFmt(v)), points: { show: false } },
      ...rankSeries(m.ranks, flagged, rateFmt, left),
    ], fmtNum), [m.x, total, ...per]);

    plot("rss", $("chart-rss"), key, () => timeOpts("RSS", rankSeries(m.ranks, flagged, fmtBytes, left),
      fmtBytes, 74), [m.x, ...m.col("rss_bytes")]);

    const gpu = m.col("gpu_allocated_bytes");
    const hasGpu = gpu.some((a) => a.some((v) => v !== null));
    $("gpu-panel").hidden = !hasGpu;
    if (hasGpu) {
      plot("gpu", $("chart-gpu"), key, () => timeOpts("GPU allocated",
        rankSeries(m.ranks, flagged, fmtBytes, left), fmtBytes, 74), [m.x, ...gpu]);
    }
    renderBreakdown(state, m, flagged);
  }

  function renderBreakdown(state, m, flagged) {
    const select = $("breakdown-rank");
    const options = m.ranks.map(String);
    if ([...select.options].map((o) => o.value).join() !== options.join()) {
      select.replaceChildren(...m.ranks.map((r) => el("option", { value: String(r), text: `rank ${r}` })));
    }
    let rank = state.rankChoice;
    if (rank === null || !m.ranks.includes(rank)) {
      rank = flagged.size ? [...flagged][0] : m.ranks[0];
    }
    select.value = String(rank);
    const rows = m.rows.filter((w) => w.rank === rank);
    const x = rows.map((w) => w.time - m.t0);
    const raw = PARTS.map(([k]) => rows.map((w) => (isNum(w[k]) ? w[k] * 1000 : 0)));
    const stacked = [];
    let acc = new Array(rows.length).fill(0);
    for (const part of raw) { acc = acc.map((a, i) => a + part[i]); stacked.push(acc); }
    const series = PARTS.map(([, label, color], i) => ({
      label, stroke: color, width: 1, points: { show: false },
      fill: i === 0 ? color + "cc" : undefined,
      value: (u, v, si, idx) => (idx === null || idx === undefined ? "-" : fmtNum(raw[i][idx]) + " ms"),
    }));
    const bands = PARTS.slice(1).map(([, , color], i) => ({ series: [i + 2, i + 1], fill: color + "cc" }));
    plot("breakdown", $("chart-breakdown"), "b:" + rank + (flagged.has(rank) ? "!" : ""), () => {
      const o = timeOpts("ms per step", series, fmtNum);
      o.bands = bands;
      return o;
    }, [x, ...stacked]);
  }

  function renderWorkers(state) {
    const d = state.data;
    const flagged = new Map(d.stragglers.map((x) => [x.rank, x]));
    const latest = new Map();
    for (const w of state.timing) {
      const cur = latest.get(w.rank);
      if (!cur || !isNum(cur.time) || (isNum(w.time) && w.time >= cur.time)) latest.set(w.rank, w);
    }
    const left = new Map(d.left_ranks.map((x) => [x.rank, x.time]));
    const t0 = startTime(state);
    const ranks = new Set([...latest.keys(), ...Object.keys(d.rank_metrics).map(Number), ...flagged.keys(),
      ...left.keys()]);
    const ws = d.summary.world_size;
    if (isNum(ws) && ws <= 256) for (let r = 0; r < ws; r++) ranks.add(r);
    const rows = [...ranks].sort((a, b) => a - b).map((r) => {
      const w = latest.get(r) || {};
      const bad = left.has(r) ? null : flagged.get(r);
      const total = isNum(w.step_s_mean) && w.step_s_mean > 0 ? w.step_s_mean
        : PARTS.reduce((a, [k]) => a + (isNum(w[k]) ? w[k] : 0), 0);
      const bar = el("div", { class: "bar", title: "share of the mean step" });
      if (total > 0) {
        for (const [k, label, color] of PARTS) {
          if (isNum(w[k]) && w[k] > 0) {
            bar.append(el("span", { style: `width:${(100 * w[k] / total).toFixed(2)}%;background:${color}`,
              title: `${label}: ${fmtMs(w[k])}` }));
          }
        }
      }
      const last = d.rank_metrics[String(r)];
      const tr = el("tr", { "data-rank": String(r) },
        el("td", { class: "num", text: String(r) }),
        el("td", { class: "num", text: fmtNum(w.step) }),
        el("td", { class: "num", text: fmtMs(w.step_s) }),
        el("td", {}, bar),
        ...PARTS.map(([k]) => el("td", { class: "num", text: fmtMs(w[k]) })),
        el("td", { class: "num", text: isNum(w.samples_per_s) ? fmtNum(w.samples_per_s) : "-" }),
        el("td", { class: "num", text: fmtBytes(w.rss_bytes) }),
        el("td", { class: "num", text: fmtBytes(w.gpu_allocated_bytes) }),
        el("td", { class: "num", text: last ? String(last.round) : "-" }),
        el("td", {}, bad ? el("span", { class: "badge straggler", text: "straggler",
          title: bad.message || bad.reason || "" }) : left.has(r) ? el("span", { class: "badge left",
          text: "left the group", title: isNum(left.get(r))
            ? `not in the group since +${fmtDuration(left.get(r) - t0)} (an elastic resize); its last window is shown`
            : "not in the group since an elastic resize" }) : null),
      );
      if (bad) tr.classList.add("straggler");
      if (left.has(r)) tr.classList.add("left");
      return tr;
    });
    replaceRows($("workers-table").tBodies[0], rows);
    const legend = $("breakdown-legend");
    if (!legend.childElementCount) {
      legend.replaceChildren(...PARTS.map(([, label, color]) =>
        el("span", {}, el("span", { class: "swatch", style: `background:${color}` }), label)));
    }
  }

  function describe(e) {
    switch (e.type) {
      case "run_start": return `attempt ${e.attempt ?? "?"} started with ${e.world_size ?? "?"} workers`;
      case "resume": return `attempt ${e.attempt ?? "?"} resumes from ${e.checkpoint || "the start"}`;
      case "failure": return `rank ${e.rank ?? "?"} ${e.kind || "failed"}: ${e.message || ""}`;
      case "decision": return `${e.decision || "?"}: ${e.reason || ""}`;
      case "checkpoint": return `${e.path || "checkpoint"} (round ${e.round ?? "?"}) ${fmtMetrics(e.metrics, 6)}`;
      case "checkpoint_deleted": return `${e.path || ""} ${e.reason ? "(" + e.reason + ")" : ""}`;
      case "checkpoint_failed": return `round ${e.round ?? "?"}: ${[].concat(e.errors || []).join("; ")}`;
      case "checkpoint_invalid": return e.reason || "";
      case "straggler": return `rank ${e.rank} flagged` + (e.reason ? ` (${e.reason})` : "") +
        (isNum(e.ratio) ? `, ${e.ratio.toFixed(2)}× the median` : "") + (e.message ? ` — ${e.message}` : "");
      case "straggler_cleared": return `rank ${e.rank} is no longer a straggler`;
      case "resize": return `${e.old_world_size ?? "?"} → ${e.new_world_size ?? "?"} workers` +
        spareNote(e.spare_ranks) + (e.cause ? `: ${e.cause}` : "") +
        (isNum(e.resume_s) ? `; training resumed ${e.resume_s.toFixed(2)} s after the failure` : "") +
        (isNum(e.steps_rolled_back)
          ? `, ${e.steps_rolled_back} step${e.steps_rolled_back === 1 ? "" : "s"} rolled back` : "");
      case "resize_fallback": return `restart from the disk checkpoint: ${e.reason || ""}`;
      case "spare": return e.action === "promoted" ? `hot spare ${e.spare} took rank ${e.rank}`
        : e.action === "lost" ? `hot spare lost: ${e.reason || ""}`
        : e.action === "ready" ? `hot spare ${e.spare} ready` + (isNum(e.ready_s) ? ` after ${e.ready_s.toFixed(2)} s` : "")
        : `hot spare ${e.spare} started` + (e.pid != null ? ` (pid ${e.pid})` : "");
      case "preemption": return `notice from ${e.source || "?"}: ${e.reason || ""}` +
        (isNum(e.grace_s) ? ` (${e.grace_s} s to save)` : "");
      case "preemption_saved": return `every worker saved at step ${e.step ?? "?"}` +
        (e.round != null ? ` (round ${e.round})` : "") +
        (isNum(e.saved_s) ? ` ${e.saved_s.toFixed(2)} s after the notice` : "");
      case "preemption_incomplete": return `${e.reason || "not saved"}; resumes from ${e.checkpoint || "the start"}`;
      case "replica_mismatch": return `silent data corruption at step ${e.step ?? "?"} (${e.check || "replica"} check): ` +
        `${e.named ? "" : "suspects "}` + [].concat(e.ranks || []).map((r, i) =>
          `rank ${r} on ${[].concat(e.hosts || [])[i] || "?"}`).join(", ") + ` — ${e.action || ""}`;
      case "run_end": return `${e.status || "ended"} after ${fmtDuration(e.duration_s)}`;
      default: return "";
    }
  }

  function renderTimeline(state) {
    const d = state.data;
    const t0 = startTime(state);
    const s = d.summary;
    let tEnd = t0;
    for (const e of state.timeline) if (isNum(e.time)) tEnd = Math.max(tEnd, e.time);
    if (isNum(s.duration_s)) tEnd = Math.max(tEnd, t0 + s.duration_s);
    const strip = $("timeline-strip");
    const span = Math.max(1e-6, tEnd - t0);
    const marks = [el("span", { class: "edge", text: "0s" }), el("span", { class: "edge right", text: fmtDuration(tEnd - t0) })];
    for (const e of state.timeline) {
      if (!isNum(e.time) || e.type === "checkpoint_deleted") continue;
      const pct = Math.min(100, Math.max(0, (100 * (e.time - t0)) / span));
      const tall = ["run_start", "run_end", "failure", "decision", "resize", "resize_fallback", "replica_mismatch"].includes(e.type);
      marks.push(el("span", { class: `mark ev-${e.type}${tall ? " tall" : ""}`, style: `left:${pct.toFixed(3)}%`,
        title: `+${fmtDuration(e.time - t0)} ${e.type}: ${describe(e)}` }));
    }
    strip.replaceChildren(...marks);
    if (state.lastTimeline === state.timeline.length) return;
    state.lastTimeline = state.timeline.length;
    const rows = state.timeline.slice(-500).reverse().map((e) => el("tr", { "data-type": e.type },
      el("td", { text: fmtClock(e.time) }),
      el("td", { class: "num", text: isNum(e.time) ? fmtDuration(e.time - t0) : "-" }),
      el("td", {}, el("span", { class: `ev ev-${e.type}`, text: e.type.replace(/_/g, " ") })),
      el("td", { class: "wrap", text: describe(e) })));
    replaceRows($("timeline-table").tBodies[0], rows);
  }

  function workersText(d) {
    const ws = d.summary.world_size;
    const e = d.elastic;
    return (ws ?? "-") + (e ? ` (elastic ${e.min_workers}–${e.max_workers})` : "");
  }

  /** When the run ended, or now for a running one (the right edge of time axes). */
  function endTime(state, t0) {
    const s = state.data.summary;
    let tEnd = t0;
    for (const e of state.timeline) if (isNum(e.time)) tEnd = Math.max(tEnd, e.time);
    if (isNum(s.duration_s)) tEnd = Math.max(tEnd, t0 + s.duration_s);
    return tEnd;
  }

  // DiLoCo runs: each rank's outer loop (bytes sent per inner step, time in outer syncs).
  function renderDiloco(d) {
    const panel = $("diloco-panel");
    panel.hidden = !d.diloco;
    if (!d.diloco) return;
    const n = d.diloco.outer_steps;
    $("diloco-outer-steps").textContent = isNum(n) ? `${n} outer step${n === 1 ? "" : "s"}` : "";
    const rows = Object.entries(d.diloco.ranks).map(([r, f]) =>
      el("tr", { "data-rank": r },
        el("td", { class: "num", text: r }),
        el("td", { class: "num", text: fmtNum(f.outer_steps) }),
        el("td", { class: "num", text: fmtBytes(f.bytes_per_step) }),
        el("td", { class: "num", text: fmtDuration(f.sync_s) }),
        el("td", { class: "num", text: fmtMs(f.sync_s_per_step) }),
        el("td", { class: "num", text: isNum(f.sync_frac) ? (100 * f.sync_frac).toFixed(1) + "%" : "-" }),
        el("td", { class: "num", text: fmtNum(f.exchanges) }),
      ));
    replaceRows($("diloco-table").tBodies[0], rows);
  }

  // Elastic runs: the world size over time (a step chart) and the resizes.
  function renderElastic(state) {
    const d = state.data;
    const e = d.elastic;
    const sizes = d.world_sizes.filter((c) => isNum(c.world_size));
    const changed = new Set(sizes.map((c) => c.world_size)).size > 1;
    const panel = $("elastic-panel");
    panel.hidden = !e && !d.resizes.length && !changed;
    if (panel.hidden) return;
    const n = d.resizes.filter((r) => r.kind === "resize").length;
    const fb = d.resizes.length - n;
    $("resize-count").textContent = `${n} resize${n === 1 ? "" : "s"}` +
      (fb ? `, ${fb} fallback${fb === 1 ? "" : "s"}` : "");
    $("elastic-range").textContent = (e ? `elastic, ${e.min_workers}–${e.max_workers} workers; ` : "") +
      `now ${d.summary.world_size ?? "-"}`;

    const t0 = startTime(state);
    const x = [], y = [];
    for (const c of sizes) {
      const at = isNum(c.time) ? Math.max(0, c.time - t0) : 0;
      if (x.length && at <= x[x.length - 1]) { y[y.length - 1] = c.world_size; continue; }
      if (y.length && y[y.length - 1] === c.world_size) continue; // a restart at the same size
      x.push(at); y.push(c.world_size);
    }
    const end = endTime(state, t0) - t0;
    if (y.length && end > x[x.length - 1]) { x.push(end); y.push(y[y.length - 1]); }
    const box = $("chart-world");
    box.dataset.worldSizes = sizes.map((c) => c.world_size).join(",");
    if (x.length) {
      const flat = (v) => x.map(() => v);
      const series = [{ label: "workers", stroke: "#1d2330", width: 2, fill: "#1f77b418",
        paths: uPlot.paths.stepped({ align: 1 }), value: (u, v) => (v === null ? "-" : String(v)),
        points: { show: true, size: 5 } }];
      const data = [x, y];
      if (e) {
        for (const [label, v, color] of [["min", e.min_workers, "#b7791f"], ["max", e.max_workers, "#2e8540"]]) {
          series.push({ label, stroke: color, dash: [4, 4], width: 1, points: { show: false },
            value: () => String(v) });
          data.push(flat(v));
        }
      }
      plot("world", box, "w:" + (e ? `${e.min_workers}-${e.max_workers}` : ""), () => {
        const o = timeOpts("workers", series, (v) => (Number.isInteger(v) ? String(v) : ""), 44);
        o.height = 150;
        o.scales.y = { range: (u, min, max) => [0, Math.max(max, 1) + 0.5] };
        o.axes[1].incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000];
        o.axes[1].space = 16;
        return o;
      }, data);
    }

    const key = String(d.resizes.length) + "|" + t0;
    $("resizes-wrap").hidden = d.resizes.length === 0;
    $("resizes-empty").hidden = d.resizes.length > 0;
    if (key === state.resizesKey) return;
    state.resizesKey = key;
    replaceRows($("resizes-table").tBodies[0], d.resizes.map((r) => {
      const fallback = r.kind === "fallback";
      return el("tr", { "data-kind": r.kind, class: fallback ? "fallback" : "" },
        el("td", { text: fmtClock(r.time) }),
        el("td", { class: "num", text: isNum(r.time) ? fmtDuration(r.time - t0) : "-" }),
        el("td", { class: "change", text: fallback ? "restart from disk checkpoint"
          : `${r.old_world_size ?? "?"} → ${r.new_world_size ?? "?"}` + spareNote(r.spare_ranks) }),
        el("td", { class: "wrap", text: r.cause || "" }),
        el("td", { class: "num", text: isNum(r.resume_s) ? r.resume_s.toFixed(2) + " s" : "-" }),
        el("td", { class: "num", text: fmtNum(r.steps_rolled_back) }),
        el("td", { class: "num", text: fmtNum(r.snapshot_step) }));
    }));
  }

  // A resize in which hot spares took ranks (ScalingConfig.spares): " (spare took rank 1)".
  function spareNote(ranks) {
    if (!Array.isArray(ranks) || !ranks.length) return "";
    return ` (spare${ranks.length === 1 ? "" : "s"} took rank${ranks.length === 1 ? "" : "s"} ${ranks.join(", ")})`;
  }

  function renderCheckpoints(state) {
    const cps = state.data.checkpoints;
    const key = JSON.stringify(cps.map((c) => [c.name, c.latest, c.best]));
    $("checkpoint-count").textContent = cps.length ? String(cps.length) : "";
    $("checkpoints-empty").hidden = cps.length > 0;
    $("checkpoints-wrap").hidden = cps.length === 0;
    if (key === state.checkpointsKey) return;
    state.checkpointsKey = key;
    replaceRows($("checkpoints-table").tBodies[0], cps.map((c) => el("tr", { "data-checkpoint": c.name },
      el("td", { class: "mono", text: c.name }),
      el("td", { class: "num", text: String(c.round) }),
      el("td", { class: "num", text: fmtBytes(c.size_bytes) }),
      el("td", { text: fmtClock(c.created) }),
      el("td", { class: "mono wrap", text: fmtMetrics(c.metrics) }),
      el("td", { text: [c.latest ? "latest" : "", c.best ? "best" : ""].filter(Boolean).join(", ") }))));
  }

  function renderFailures(state) {
    const fs = state.data.failures;
    $("failures-panel").hidden = fs.length === 0;
    // Root causes are counted; follow-on failures (a peer's lost connection) are counted apart.
    const roots = fs.filter((f) => !f.follow_on).length;
    const follow = fs.length - roots;
    $("failure-count").textContent = fs.length ? String(roots) + (follow ? ` (+${follow} follow-on)` : "") : "";
    const key = String(fs.length);
    if (key === state.failuresKey) return;
    state.failuresKey = key;
    const t0 = startTime(state);
    const rows = fs.map((f) => {
      const tr = el("tr", {},
        el("td", { text: fmtClock(f.time) }),
        el("td", { class: "num", text: isNum(f.time) ? fmtDuration(f.time - t0) : "-" }),
        el("td", { class: "num", text: f.rank === null ? "-" : String(f.rank) }),
        el("td", { text: f.follow_on ? `${f.kind} (follow-on)` : f.kind }),
        el("td", { class: "wrap" }, f.message,
          f.traceback ? el("details", { class: "tb" }, el("summary", { text: "traceback" }),
            el("pre", { text: f.traceback })) : null));
      return tr;
    });
    const table = el("table", { class: "data" },
      el("thead", {}, el("tr", {}, ...["Time", "+", "Rank", "Kind", "Message"].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...rows));
    $("failures").replaceChildren(el("div", { class: "table-wrap" }, table));
  }

  // ------------------------------------------------------------------ routing and polling

  window.rtDash = { polls: 0, view: null, runs: 0, run: null, status: null, metricRounds: 0,
    timingWindows: 0, timelineEvents: 0, stragglers: [], outerSteps: null };

  function routeName() {
    const m = /^#run=(.+)$/.exec(location.hash);
    if (m) return decodeURIComponent(m[1]);
    return list.data && list.data.single && location.hash !== "#all" ? list.data.single : null;
  }

  function show(view) {
    $("runs-view").hidden = view !== "runs";
    $("run-view").hidden = view !== "run";
    window.rtDash.view = view;
  }

  function setLive(state, text) {
    const live = $("live");
    live.dataset.state = state;
    live.textContent = text;
  }

  let timer = null;
  let busy = false;
  let again = false;

  async function tick() {
    clearTimeout(timer);
    if (busy) { again = true; return; }
    busy = true;
    again = false;
    let delay = POLL_MS;
    try {
      if (!list.data) renderRuns(await api("api/runs"));
      const name = routeName();
      if (name) {
        show("run");
        if (await pollRun(name)) delay = 0;
        const st = run && run.data ? run.data.summary.status : null;
        if (TERMINAL.has(st)) delay = Math.max(delay, 1000);
      } else {
        show("runs");
        if (run) { run = null; resetRunView(); }
        renderRuns(await api("api/runs"));
      }
      $("error-banner").hidden = true;
      window.rtDash.polls++;
      setLive("live", "updated " + new Date().toLocaleTimeString());
    } catch (err) {
      const banner = $("error-banner");
      banner.hidden = false;
      if (err instanceof HttpError && err.status === 401) {
        banner.textContent = "This dashboard needs its token: open the URL that `ringtrain dashboard` printed (…/?token=…).";
      } else if (err instanceof HttpError && err.status === 404) {
        let text = err.message;
        try { text = JSON.parse(err.message).error || text; } catch (e) { /* plain text */ }
        banner.textContent = text;
      } else {
        banner.textContent = "Cannot reach the dashboard server (" + (err.message || err) + "); retrying…";
      }
      setLive("error", "disconnected");
    } finally {
      busy = false;
      timer = setTimeout(tick, again ? 0 : delay);
    }
  }

  window.addEventListener("hashchange", () => { window.scrollTo(0, 0); tick(); });
  $("back-link").addEventListener("click", (ev) => {
    ev.preventDefault();
    location.hash = "#all";
  });
  $("breakdown-rank").addEventListener("change", (ev) => {
    if (!run) return;
    run.rankChoice = Number(ev.target.value);
    run.drawn = -1;
    renderRun(run);
  });
  tick();
})();
