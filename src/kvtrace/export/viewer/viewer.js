// kvtrace viewer: draws the data that export/viewer/data.py embedded in #kvtrace-data. No network, no
// libraries. Every string from the trace (request ids, model names, reasons) reaches the page through
// textContent or canvas fillText; nothing from the trace is ever parsed as HTML.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);

  // ---- data -------------------------------------------------------------------------------------
  const raw = JSON.parse($("kvtrace-data").textContent);

  // A column is a plain array or {"d": [first, deltas...]} for sorted integer columns.
  function dec(c) {
    if (c && !Array.isArray(c) && Array.isArray(c.d)) {
      const out = new Array(c.d.length);
      let acc = 0;
      for (let i = 0; i < c.d.length; i++) { acc += c.d[i]; out[i] = acc; }
      return out;
    }
    return c || [];
  }
  function decodeAll(obj) {
    const out = {};
    for (const k of Object.keys(obj || {})) {
      const v = obj[k];
      out[k] = (Array.isArray(v) || (v && Array.isArray(v.d))) ? dec(v) : v;
    }
    return out;
  }

  const meta = raw.meta;
  const S = decodeAll(raw.steps);
  const N = S.ts.length;
  S.se = new Float64Array(N);  // schedule() returned, µs
  S.te = new Float64Array(N);  // step finished (or schedule end when it never did), µs
  for (let i = 0; i < N; i++) {
    S.se[i] = S.ts[i] + (S.sched[i] || 0);
    S.te[i] = S.se[i] + (S.exec[i] == null ? 0 : S.exec[i]);
  }
  const R = decodeAll(raw.requests);
  const NR = R.id.length;
  const G = decodeAll(raw.segments);
  const segStart = new Int32Array(NR + 1);  // segments of request r: segStart[r] .. segStart[r+1]
  for (let i = 0; i < G.req.length; i++) segStart[G.req[i] + 1]++;
  for (let r = 0; r < NR; r++) segStart[r + 1] += segStart[r];
  const D = raw.details;
  const DR = decodeAll(D.requests);
  const DB = decodeAll(D.blocks);
  const PRE = decodeAll(raw.preemptions);
  const PIN = decodeAll(raw.pins);
  const K = raw.kernels ? decodeAll(raw.kernels) : null;
  const H = decodeAll(raw.heat);
  const ST = decodeAll(raw.states);

  function rangesBy(col, n) {  // rows sorted by col -> Int32Array of start offsets per value
    const start = new Int32Array(n + 1);
    for (let i = 0; i < col.length; i++) start[col[i] + 1]++;
    for (let i = 0; i < n; i++) start[i + 1] += start[i];
    return start;
  }
  const drStart = rangesBy(DR.step, N);
  const dbStart = rangesBy(DB.step, N);

  let tMin = Infinity, tMax = -Infinity;
  for (let i = 0; i < N; i++) { tMin = Math.min(tMin, S.ts[i]); tMax = Math.max(tMax, S.te[i]); }
  for (let r = 0; r < NR; r++) {
    if (R.arr[r] != null) tMin = Math.min(tMin, R.arr[r]);
    if (R.fin[r] != null) tMax = Math.max(tMax, R.fin[r]);
  }
  if (!isFinite(tMin)) { tMin = 0; tMax = 1; }
  if (tMax <= tMin) tMax = tMin + 1;

  // ---- state ------------------------------------------------------------------------------------
  const pad = (tMax - tMin) * 0.01;
  const state = {
    tab: "steps", v0: tMin - pad, v1: tMax + pad, step: -1, req: -1,
    matches: [], matchPos: -1, layer: -1, heatMode: "access",
  };
  const colors = {
    prefill: "#e8833a", decode: "#3b7dd8", queued: "#b8bec8", preempted: "#d9363e", pin: "#8e44ad",
    kv: "#2e9d57", read: "#1f6fd1", write: "#e0452b", sel: "rgba(255, 196, 0, .35)",
    // Admission stops: each its own colour, none shared with the segments' or pins' (preempted keeps
    // the preemption red).
    stop: { "tok-budget": "#e6c200", "kv-insuf": "#a0522d", "max-seqs": "#2c6e8f", blocked: "#888",
      lora: "#666", preempted: "#d9363e", "prefill-throttle": "#1aa3a3", "prefill-cadence": "#5fbfbf",
      skipped: "#aaa" },
    events: ["#e0452b", "#2e9d57", "#9aa3ae", "#1aa3a3", "#222"],  // alloc touch free cache evict
    states: [null, "#3b7dd8", "#5cb85c", "#8e44ad"],  // free in-use cached held
  };
  const segColors = [colors.queued, colors.prefill, colors.decode, colors.preempted];

  // ---- formatting -------------------------------------------------------------------------------
  function fmtT(us) {  // a time since the session start
    return (us / 1e6).toFixed(us < 1e7 ? 4 : 3) + " s";
  }
  function fmtD(us) {  // a duration
    if (us == null || !isFinite(us)) return "–";
    const a = Math.abs(us);
    if (a >= 1e6) return (us / 1e6).toFixed(3) + " s";
    if (a >= 1e3) return (us / 1e3).toFixed(a >= 1e5 ? 0 : 1) + " ms";
    return us.toFixed(0) + " µs";
  }
  const fmtN = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  const pct = (a, b) => (b > 0 ? Math.round((100 * a) / b) + "%" : "–");
  function idRanges(ids) {  // [1,2,3,7] -> "1-3, 7"
    const out = [];
    for (let i = 0; i < ids.length; i++) {
      let j = i;
      while (j + 1 < ids.length && ids[j + 1] === ids[j] + 1) j++;
      out.push(j > i ? ids[i] + "-" + ids[j] : String(ids[i]));
      i = j;
    }
    return out.join(", ");
  }

  // ---- DOM helpers (text only) ------------------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = String(text);
    return e;
  }
  function badge(text, cls) { return el("span", "badge" + (cls ? " " + cls : ""), text); }
  function clear(e) { while (e.firstChild) e.removeChild(e.firstChild); return e; }
  function swatch(color, label) {
    const s = el("span");
    const sw = el("span", "sw");
    sw.style.background = color;
    s.appendChild(sw);
    s.appendChild(document.createTextNode(label));
    return s;
  }

  // ---- canvas helpers ---------------------------------------------------------------------------
  function fit(canvas, cssHeight) {  // size the backing store to the CSS box; returns a 2D context in CSS px
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, canvas.clientWidth);
    const h = Math.max(1, cssHeight || canvas.clientHeight);
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  }
  function xOf(t, x0, w) { return x0 + ((t - state.v0) / (state.v1 - state.v0)) * w; }
  function tOf(x, x0, w) { return state.v0 + ((x - x0) / w) * (state.v1 - state.v0); }
  function lowerBound(arr, v) {  // first i with arr[i] >= v (arr sorted)
    let lo = 0, hi = arr.length;
    while (lo < hi) { const m = (lo + hi) >> 1; if (arr[m] < v) lo = m + 1; else hi = m; }
    return lo;
  }
  function visibleSteps() {  // [first, last) steps that may overlap the view
    const first = Math.max(0, lowerBound(S.ts, state.v0) - 1);
    const last = Math.min(N, lowerBound(S.ts, state.v1) + 1);
    return [first, last];
  }
  function stepAt(t) {  // the step whose [start, end] holds t, else the nearest one
    if (!N) return -1;
    const i = Math.min(N - 1, Math.max(0, lowerBound(S.ts, t) - 1));  // last step starting before t
    if (t > S.te[i] && i + 1 < N && S.ts[i + 1] - t < t - S.te[i]) return i + 1;
    return i;
  }
  function axis(ctx, x0, w, y, h) {  // time ticks along the bottom
    const span = state.v1 - state.v0;
    const raw = span / Math.max(1, w / 110);
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || 10 * p;
    ctx.fillStyle = "#6b7280"; ctx.strokeStyle = "#dde1e7"; ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "top";
    const decimals = Math.min(6, Math.max(0, Math.ceil(-Math.log10(step / 1e6) - 1e-9)));
    for (let t = Math.ceil(state.v0 / step) * step; t <= state.v1; t += step) {
      const x = xOf(t, x0, w);
      ctx.beginPath(); ctx.moveTo(x + 0.5, y - h); ctx.lineTo(x + 0.5, y); ctx.stroke();
      ctx.fillText((t / 1e6).toFixed(decimals) + " s", x + 2, y + 2);
    }
  }

  // ---- header -----------------------------------------------------------------------------------
  function header() {
    document.title = "kvtrace " + meta.session;
    $("session").textContent = meta.session;
    $("model").textContent = [meta.model, meta.vllm_version ? "vLLM " + meta.vllm_version : null]
      .filter(Boolean).join(" · ");
    const c = meta.counts;
    const sum = $("summary");
    const parts = [
      [N, "steps", "step-count"], [NR, "requests", "request-count"], [c.preemptions, "preemptions"],
      [c.block_events, "block events"], [c.kv_access, "KV access records"],
    ];
    parts.forEach(([n, label, id], i) => {
      if (i) sum.appendChild(document.createTextNode(" · "));
      const s = el("span", null, fmtN(n));
      if (id) s.id = id;
      sum.appendChild(s);
      sum.appendChild(document.createTextNode(" " + label));
    });
    // Blocks as the step rows count them (kv:U/T: usable blocks, vLLM's null block left out), and both
    // time origins: this page's (session start) and kvtrace query's t_s (the first engine step).
    const blocks = meta.usable_blocks != null ? fmtN(meta.usable_blocks) + " usable blocks"
      : fmtN(meta.pool_blocks) + " blocks";
    sum.appendChild(document.createTextNode(" · status " + meta.status + " · block size " +
      fmtN(meta.block_size) + " tokens · " + blocks + " · times: s since session start"));
    if (meta.first_step_s != null) {
      const o = el("span", null, " (first step " + meta.first_step_s.toFixed(3) + " s = query t_s 0)");
      o.id = "origin";
      o.title = "kvtrace query's t_s columns count from the first engine step; this page from session start";
      sum.appendChild(o);
    }
    const ul = $("notices");
    for (const n of raw.notices) ul.appendChild(el("li", n.kind, n.text));
  }
  function notice(kind, text) { $("notices").appendChild(el("li", kind, text)); }

  // ---- step badges (the seed viewer's format) ---------------------------------------------------
  function stepBadges(i) {
    const out = [];
    const stop = S.stop_names[S.stop[i]] || "none";
    if (S.np[i] > 0) {
      const cached = S.prompt[i] > 0 ? pct(S.cached[i], S.prompt[i]) : "–";
      out.push(badge(`[prefill:${S.np[i]}b(${S.pt[i]}t), ${S.prompt[i]}t total, ${cached} cached, fwd:${S.fwd[i]}t]`, "prefill"));
    } else {
      out.push(badge(`[decode:${S.nd[i]}b, fwd:${S.fwd[i]}t]`, "decode"));
    }
    if (S.np[i] > 0 && S.nd[i] > 0) out.push(badge(`dec:${S.nd[i]}`, "decode"));
    out.push(badge(`tok:${S.fwd[i]}/${S.budget[i]}`));
    out.push(badge(stop, "stop-" + stop));
    if (S.ln[i] > 0) {
      const ext = S.le[i] || 0;
      const hit = S.lh[i] + ext;
      let text = `hit:${hit}/${S.lq[i]}(${pct(hit, S.lq[i])})`;
      if (S.external) text += ` L:${S.lh[i]} E:${ext}`;
      out.push(badge(text, "hit"));
    }
    if (S.preempts[i] > 0) out.push(badge(`preempt×${S.preempts[i]}`, "preempt"));
    if (S.pins[i] > 0) out.push(badge(`pin×${S.pins[i]}`, "pin"));
    out.push(badge(`kv:${S.kv[i]}/${S.kvt[i]}`));
    out.push(badge(`run:${S.run[i]} wait:${S.wait[i]}`));
    return out;
  }
  function stepLabel(i) { return (meta.ranks.length > 1 ? "r" + S.rank[i] + " " : "") + S.step[i]; }

  // ---- Steps view: timeline canvas --------------------------------------------------------------
  const stepsCanvas = $("steps-canvas");
  const TL = { x0: 46, right: 8, barTop: 10, barH: 92, stripH: 6, kvTop: 116, kvH: 40, axisY: 160 };
  function drawSteps() {
    const { ctx, w } = fit(stepsCanvas);
    const pw = w - TL.x0 - TL.right;
    ctx.save();
    ctx.beginPath(); ctx.rect(TL.x0, 0, pw, TL.axisY); ctx.clip();
    const [a, b] = visibleSteps();
    let maxTok = 1;
    for (let i = a; i < b; i++) maxTok = Math.max(maxTok, S.budget[i] || 0, S.fwd[i] || 0);
    if (state.step >= 0) {
      const x0 = xOf(S.ts[state.step], TL.x0, pw), x1 = xOf(S.te[state.step], TL.x0, pw);
      ctx.fillStyle = colors.sel;
      ctx.fillRect(x0 - 1, 0, Math.max(3, x1 - x0 + 2), TL.axisY);
    }
    for (let i = a; i < b; i++) {
      const x0 = xOf(S.ts[i], TL.x0, pw);
      const bw = Math.max(1, xOf(S.te[i], TL.x0, pw) - x0);
      const hp = (TL.barH * (S.pt[i] || 0)) / maxTok, hd = (TL.barH * (S.dt[i] || 0)) / maxTok;
      const base = TL.barTop + TL.barH;
      ctx.fillStyle = colors.decode; ctx.fillRect(x0, base - hd, bw, hd);
      ctx.fillStyle = colors.prefill; ctx.fillRect(x0, base - hd - hp, bw, hp);
      const stop = S.stop_names[S.stop[i]];
      if (stop && stop !== "none") {
        ctx.fillStyle = colors.stop[stop] || "#888";
        ctx.fillRect(x0, base + 2, bw, TL.stripH);
      }
    }
    // KV usage (fraction of usable blocks) as a filled line
    ctx.fillStyle = "rgba(46, 157, 87, .18)"; ctx.strokeStyle = colors.kv; ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    for (let i = a; i < b; i++) {
      const f = S.kvt[i] > 0 ? S.kv[i] / S.kvt[i] : 0;
      const x = xOf(S.se[i], TL.x0, pw), y = TL.kvTop + TL.kvH * (1 - f);
      if (!started) { ctx.moveTo(x, y); started = true; } else ctx.lineTo(x, y);
    }
    ctx.stroke();
    // preemptions (red triangles) and pins (purple diamonds)
    for (let i = 0; i < PRE.ts.length; i++) {
      const x = xOf(PRE.ts[i], TL.x0, pw);
      ctx.fillStyle = colors.preempted;
      ctx.beginPath(); ctx.moveTo(x - 5, 0); ctx.lineTo(x + 5, 0); ctx.lineTo(x, 8); ctx.fill();
    }
    for (let i = 0; i < PIN.ts.length; i++) {
      const x = xOf(PIN.ts[i], TL.x0, pw), y = TL.kvTop - 4;
      ctx.fillStyle = colors.pin;
      ctx.beginPath(); ctx.moveTo(x, y - 4); ctx.lineTo(x + 4, y); ctx.lineTo(x, y + 4); ctx.lineTo(x - 4, y); ctx.fill();
    }
    ctx.restore();
    ctx.fillStyle = "#6b7280"; ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "middle";
    ctx.fillText("tokens", 2, TL.barTop + 8);
    ctx.fillText(String(maxTok), 2, TL.barTop + 22);
    ctx.fillText("KV use", 2, TL.kvTop + 6);
    ctx.fillText("100%", 2, TL.kvTop + 18);
    axis(ctx, TL.x0, pw, TL.axisY, TL.axisY);
  }
  function stepsLegend() {
    const l = $("steps-legend");
    l.appendChild(swatch(colors.prefill, "prefill tokens"));
    l.appendChild(swatch(colors.decode, "decode tokens"));
    l.appendChild(swatch(colors.kv, "KV blocks in use"));
    // A step stopped by a preemption and the preemption's marker are one thing: one entry, one red.
    for (const [k, c] of Object.entries(colors.stop)) if (k !== "lora" && k !== "preempted") l.appendChild(swatch(c, "stop: " + k));
    l.appendChild(swatch(colors.preempted, "stop: preempted · preemption ▼"));
    l.appendChild(swatch(colors.pin, "pin ◆"));
    l.appendChild(el("span", null, "wheel: zoom · drag: pan · click: step details"));
  }

  // ---- Steps view: virtual list -----------------------------------------------------------------
  const ROW = 24;
  const list = $("steps-list");
  const spacer = list.querySelector(".spacer");
  spacer.style.height = N * ROW + "px";
  function drawList() {
    const first = Math.max(0, Math.floor(list.scrollTop / ROW) - 2);
    const last = Math.min(N, first + Math.ceil(list.clientHeight / ROW) + 5);
    clear(spacer);
    for (let i = first; i < last; i++) {
      const row = el("div", "row" + (i === state.step ? " selected" : ""));
      row.style.top = i * ROW + "px";
      row.dataset.idx = String(i);
      row.appendChild(el("span", "c-step", stepLabel(i)));
      row.appendChild(el("span", "c-time", fmtT(S.ts[i])));
      row.appendChild(el("span", "c-dur", fmtD(S.te[i] - S.ts[i])));
      const b = el("span", "c-badges");
      for (const x of stepBadges(i)) b.appendChild(x);
      row.appendChild(b);
      spacer.appendChild(row);
    }
  }
  list.addEventListener("scroll", () => requestAnimationFrame(drawList));
  spacer.addEventListener("click", (e) => {
    const row = e.target.closest(".row");
    if (row) selectStep(Number(row.dataset.idx), { reveal: true });
  });

  // ---- Requests view ----------------------------------------------------------------------------
  const LANE = 16, LABEL_W = 230;
  const lanes = [];  // {req} or {group: label}
  {
    let job;
    for (let r = 0; r < NR; r++) {
      if (R.grouped && R.job[r] !== job) { job = R.job[r]; lanes.push({ group: job == null ? "no job" : "job " + job }); }
      lanes.push({ req: r });
    }
  }
  const laneOf = new Int32Array(NR);
  lanes.forEach((l, i) => { if (l.req != null) laneOf[l.req] = i; });
  const reqScroll = $("req-scroll"), reqCanvas = $("req-canvas");
  reqScroll.querySelector(".spacer").style.height = lanes.length * LANE + 20 + "px";
  const matchSet = new Set();
  function label(ctx, text, maxW) {
    if (ctx.measureText(text).width <= maxW) return text;
    let lo = 0, hi = text.length;
    while (lo < hi) { const m = (lo + hi + 1) >> 1; if (ctx.measureText(text.slice(0, m) + "…").width <= maxW) lo = m; else hi = m - 1; }
    return text.slice(0, lo) + "…";
  }
  function drawRequests() {
    const hgt = reqScroll.clientHeight;
    reqCanvas.style.height = hgt + "px";
    reqCanvas.style.marginBottom = -hgt + "px";
    const { ctx, w, h } = fit(reqCanvas, hgt);
    const x0 = LABEL_W, pw = w - LABEL_W - 8;
    const top = reqScroll.scrollTop;
    const first = Math.max(0, Math.floor(top / LANE)), last = Math.min(lanes.length, first + Math.ceil(h / LANE) + 1);
    ctx.font = "11px ui-monospace, monospace"; ctx.textBaseline = "middle";
    for (let li = first; li < last; li++) {
      const y = li * LANE - top, l = lanes[li];
      if (l.group != null) {
        ctx.fillStyle = "#eef0f3"; ctx.fillRect(0, y, w, LANE);
        ctx.fillStyle = "#1d2330"; ctx.font = "bold 11px system-ui, sans-serif";
        ctx.fillText(label(ctx, l.group, LABEL_W - 8), 4, y + LANE / 2);
        ctx.font = "11px ui-monospace, monospace";
        continue;
      }
      const r = l.req;
      if (r === state.req) { ctx.fillStyle = "#fff3c4"; ctx.fillRect(0, y, w, LANE); }
      else if (matchSet.has(r)) { ctx.fillStyle = "#fff9db"; ctx.fillRect(0, y, w, LANE); }
      else if (li % 2) { ctx.fillStyle = "#fafbfc"; ctx.fillRect(0, y, w, LANE); }
      ctx.fillStyle = "#1d2330";
      ctx.fillText(label(ctx, R.id[r], LABEL_W - 12), 6, y + LANE / 2);
      ctx.save(); ctx.beginPath(); ctx.rect(x0, y, pw, LANE); ctx.clip();
      for (let s = segStart[r]; s < segStart[r + 1]; s++) {
        const t0 = G.t0[s], t1 = t0 + (G.dur[s] || 0);
        if (t1 < state.v0 || t0 > state.v1) continue;
        const a = xOf(t0, x0, pw), b = xOf(t1, x0, pw);
        ctx.fillStyle = segColors[G.kind[s]] || "#999";
        const inset = G.kind[s] === 0 ? 5 : 2;
        ctx.fillRect(a, y + inset, Math.max(1, b - a), LANE - 2 * inset);
      }
      ctx.fillStyle = "#1d2330";
      if (R.first[r] != null) { const x = xOf(R.first[r], x0, pw); ctx.fillRect(x, y + 2, 1.5, LANE - 4); }
      if (R.fin[r] != null) { const x = xOf(R.fin[r], x0, pw); ctx.fillRect(x - 1, y + 1, 3, LANE - 2); }
      ctx.restore();
    }
    if (state.step >= 0) {
      const a = xOf(S.ts[state.step], x0, pw), b = xOf(S.te[state.step], x0, pw);
      ctx.fillStyle = colors.sel; ctx.fillRect(a, 0, Math.max(2, b - a), h);
    }
    ctx.strokeStyle = "#dde1e7"; ctx.beginPath(); ctx.moveTo(x0 - 0.5, 0); ctx.lineTo(x0 - 0.5, h); ctx.stroke();
    ctx.fillStyle = "rgba(255, 255, 255, .92)"; ctx.fillRect(x0, h - 18, pw, 18);
    axis(ctx, x0, pw, h - 16, 4);
  }
  function reqLegend() {
    const l = $("req-legend");
    ["queued", "prefill chunk", "decode", "preempted (until resumed)"].forEach((n, i) => l.appendChild(swatch(segColors[i], n)));
    l.appendChild(el("span", null, "thin tick: first token · thick tick: finished"));
    l.appendChild(el("span", null, R.grouped ? "lanes grouped by job, then turn" : "lanes in arrival order"));
    l.appendChild(el("span", null, "ctrl/alt + wheel: zoom · drag: pan · wheel: scroll"));
  }
  function reqAt(clientY) {
    const rect = reqCanvas.getBoundingClientRect();
    const li = Math.floor((clientY - rect.top + reqScroll.scrollTop) / LANE);
    const l = lanes[li];
    return l && l.req != null ? l.req : -1;
  }
  reqScroll.addEventListener("scroll", () => requestAnimationFrame(drawRequests));

  // ---- KV blocks view ---------------------------------------------------------------------------
  const heatCanvas = $("heat-canvas"), usageCanvas = $("usage-canvas");
  const HM = { x0: 56, right: 8, top: 4, bottom: 22 };
  const nCells = H.bin.length;
  const cellT0 = new Float64Array(nCells), cellT1 = new Float64Array(nCells);
  const maxPerOp = {};
  {
    const k = H.step_bin;
    for (let c = 0; c < nCells; c++) {
      const s0 = Math.min(N - 1, H.bin[c] * k), s1 = Math.min(N - 1, H.bin[c] * k + k - 1);
      cellT0[c] = k === 1 ? S.se[s0] : S.ts[s0];  // one step: its execute part; several: start to end
      cellT1[c] = Math.max(S.te[s1], cellT0[c] + 1);
      maxPerOp[H.op[c]] = Math.max(maxPerOp[H.op[c]] || 1, H.n[c]);
    }
  }
  // Rows are the blocks the session used, in id order (H.blocks: each one's block id), binned by
  // H.block_bin beyond the view's row cap; ST.blk and H.blk are rows, not block ids.
  const usedBlocks = H.blocks || [];
  const stStart = rangesBy(ST.blk, usedBlocks.length + 1);
  const isAccess = H.source === "kv_access";
  const heatRows = Math.max(1, H.rows);
  state.b0 = 0; state.b1 = heatRows;  // the rows shown (block-axis zoom), in view rows
  function blockLabel(row) {  // "block 17" or "blocks 16-31" for a row of the view
    const a = row * H.block_bin, b = Math.min(usedBlocks.length, (row + 1) * H.block_bin) - 1;
    if (a >= usedBlocks.length) return null;
    return b > a ? `blocks ${usedBlocks[a]}-${usedBlocks[b]} (${b - a + 1} used)` : `block ${usedBlocks[a]}`;
  }
  function zoomBlocks(factor, at) {  // at: the view row to keep in place
    const span = state.b1 - state.b0;
    const next = Math.min(heatRows, Math.max(Math.min(8, heatRows), span * factor));
    const f = (at - state.b0) / span;
    let b0 = at - f * next;
    b0 = Math.max(0, Math.min(heatRows - next, b0));
    state.b0 = b0; state.b1 = b0 + next;
    requestAnimationFrame(redraw);
  }
  function heatColor(op) {
    if (isAccess) return op === 1 ? colors.write : colors.read;
    return colors.events[op] || "#999";
  }
  function rgb(hex) { const v = parseInt(hex.slice(1), 16); return [(v >> 16) & 255, (v >> 8) & 255, v & 255]; }
  const HEAT_BG = [244, 245, 247];
  // The heatmap is rasterised by hand into one ImageData: per pixel, the strongest cell of each op (or
  // the block's state), then composited. Cost is bounded by pixels touched, not by canvas calls, so
  // hundreds of thousands of cells still redraw in a few tens of ms.
  function drawHeat() {
    const { ctx, w, h } = fit(heatCanvas);
    const pw = w - HM.x0 - HM.right, ph = h - HM.top - HM.bottom;
    const rowSpan = state.b1 - state.b0, rowH = ph / rowSpan;
    const dpr = window.devicePixelRatio || 1;
    const X0 = Math.round(HM.x0 * dpr), Y0 = Math.round(HM.top * dpr);
    const W = Math.max(1, Math.round(pw * dpr)), HH = Math.max(1, Math.round(ph * dpr));
    const img = ctx.createImageData(W, HH);
    const px = img.data;
    const span = state.v1 - state.v0;
    const colOf = (t) => ((t - state.v0) / span) * W;
    if (state.heatMode === "state") {
      const st = new Uint8Array(W * HH);  // 0 free, else state; held > in use > cached where blocks share a row
      const rank = [0, 2, 1, 3];
      const rowPx = HH / (rowSpan * H.block_bin), first = state.b0 * H.block_bin;
      for (let i = 0; i < ST.blk.length; i++) {
        const t0 = ST.t0[i], t1 = ST.dur[i] == null ? tMax : t0 + ST.dur[i];
        if (t1 < state.v0 || t0 > state.v1) continue;
        const a = Math.max(0, Math.floor(colOf(t0))), b = Math.min(W, Math.max(a + 1, Math.ceil(colOf(t1))));
        const yf = (ST.blk[i] - first) * rowPx;
        if (yf >= HH || yf + rowPx <= 0) continue;
        const y0 = Math.max(0, Math.floor(yf)), y1 = Math.min(HH, Math.max(y0 + 1, Math.floor(yf + rowPx)));
        const v = ST.state[i];
        for (let y = y0; y < y1; y++) {
          const row = y * W;
          for (let x = a; x < b; x++) if (rank[v] > rank[st[row + x]]) st[row + x] = v;
        }
      }
      const pal = colors.states.map((c) => (c ? rgb(c) : HEAT_BG));
      for (let i = 0, j = 0; i < st.length; i++, j += 4) {
        const c = pal[st[i]];
        px[j] = c[0]; px[j + 1] = c[1]; px[j + 2] = c[2]; px[j + 3] = 255;
      }
    } else {
      const L = H.layers.length;
      const sub = H.step_bin === 1 && state.layer < 0 && L > 1;  // one sub-column per layer, in layer order
      const order = isAccess ? [0, 1] : [2, 3, 0, 1, 4];
      const acc = order.map(() => new Float32Array(W * HH));  // per op: strongest cell over each pixel
      const slot = {};
      order.forEach((op, k) => { slot[op] = k; });
      const logMax = {};
      for (const op of order) logMax[op] = Math.log1p(maxPerOp[op] || 1);
      const rowPx = HH / rowSpan;
      for (let c = 0; c < nCells; c++) {
        if (state.layer >= 0 && H.layer[c] !== state.layer) continue;
        let t0 = cellT0[c], t1 = cellT1[c];
        if (t1 < state.v0 || t0 > state.v1) continue;
        if (sub) { const d = (t1 - t0) / L; t0 += d * H.layer[c]; t1 = t0 + d; }
        const a = Math.max(0, Math.floor(colOf(t0))), b = Math.min(W, Math.max(a + 1, Math.ceil(colOf(t1))));
        if (a >= W || b <= 0) continue;
        const yf = (H.blk[c] - state.b0) * rowPx;
        if (yf >= HH || yf + rowPx <= 0) continue;
        const y0 = Math.max(0, Math.floor(yf)), y1 = Math.min(HH, Math.max(y0 + 1, Math.floor(yf + rowPx)));
        const v = 0.3 + (0.7 * Math.log1p(H.n[c])) / logMax[H.op[c]];
        const arr = acc[slot[H.op[c]]];
        if (!arr) continue;
        for (let y = y0; y < y1; y++) {
          const row = y * W;
          for (let x = a; x < b; x++) if (v > arr[row + x]) arr[row + x] = v;
        }
      }
      const pal = order.map((op) => rgb(heatColor(op)));
      for (let i = 0, j = 0; i < W * HH; i++, j += 4) {
        let r = HEAT_BG[0], g = HEAT_BG[1], bl = HEAT_BG[2];
        for (let k = 0; k < order.length; k++) {
          const al = acc[k][i];
          if (al > 0) { const c = pal[k]; r += (c[0] - r) * al; g += (c[1] - g) * al; bl += (c[2] - bl) * al; }
        }
        px[j] = r; px[j + 1] = g; px[j + 2] = bl; px[j + 3] = 255;
      }
    }
    ctx.putImageData(img, X0, Y0);  // device pixels: ignores the dpr transform
    ctx.save(); ctx.beginPath(); ctx.rect(HM.x0, HM.top, pw, ph); ctx.clip();
    if (state.step >= 0) {
      const a = xOf(S.ts[state.step], HM.x0, pw), b = xOf(S.te[state.step], HM.x0, pw);
      ctx.strokeStyle = "#c99700"; ctx.lineWidth = 1.5; ctx.strokeRect(a, HM.top, Math.max(2, b - a), ph);
    }
    ctx.restore();
    ctx.fillStyle = "#6b7280"; ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "middle";
    const every = Math.max(1, Math.ceil(16 / rowH));
    const nice = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000].find((n) => n >= every) || every;
    for (let r = Math.ceil(state.b0 / nice) * nice; r < state.b1; r += nice) {
      const id = usedBlocks[r * H.block_bin];
      if (id != null) ctx.fillText(String(id), 4, HM.top + (r - state.b0 + 0.5) * rowH);
    }
    axis(ctx, HM.x0, pw, h - HM.bottom, ph);
    ctx.fillStyle = "#6b7280"; ctx.textBaseline = "top";
    ctx.fillText("block", 4, h - HM.bottom + 4);
  }
  function drawUsage() {
    const { ctx, w, h } = fit(usageCanvas);
    const x0 = HM.x0, pw = w - HM.x0 - HM.right, top = 6, ph = h - top - 20;
    ctx.fillStyle = "#f4f5f7"; ctx.fillRect(x0, top, pw, ph);
    const [a, b] = visibleSteps();
    ctx.save(); ctx.beginPath(); ctx.rect(x0, top, pw, ph); ctx.clip();
    ctx.beginPath();
    let firstX = null, lastX = null;
    for (let i = a; i < b; i++) {
      const f = S.kvt[i] > 0 ? S.kv[i] / S.kvt[i] : 0;
      const x = xOf(S.se[i], x0, pw), y = top + ph * (1 - f);
      if (firstX == null) { ctx.moveTo(x, top + ph); firstX = x; }
      ctx.lineTo(x, y); lastX = x;
    }
    if (lastX != null) { ctx.lineTo(lastX, top + ph); ctx.closePath(); }
    ctx.fillStyle = "rgba(46, 157, 87, .35)"; ctx.fill();
    ctx.fillStyle = colors.preempted;
    for (let i = 0; i < PRE.ts.length; i++) ctx.fillRect(xOf(PRE.ts[i], x0, pw) - 1, top, 2, ph);
    ctx.restore();
    ctx.fillStyle = "#6b7280"; ctx.font = "11px system-ui, sans-serif"; ctx.textBaseline = "middle";
    ctx.fillText("100%", 4, top + 6); ctx.fillText("0%", 4, top + ph - 4);
    axis(ctx, x0, pw, h - 20, ph);
  }
  function heatLegend() {
    const l = clear($("heat-legend"));
    if (state.heatMode === "state") {
      ["in use", "cached (free, hash kept)", "held (pinned)"].forEach((n, i) => l.appendChild(swatch(colors.states[i + 1], n)));
      l.appendChild(swatch("#f4f5f7", "free"));
    } else if (isAccess) {
      l.appendChild(swatch(colors.read, "read"));
      l.appendChild(swatch(colors.write, "write"));
      l.appendChild(el("span", null, H.step_bin === 1 && H.layers.length > 1 && state.layer < 0
        ? "each step's execute time split into one column per layer" : "darker: more records"));
    } else {
      H.op_names.forEach((n, i) => l.appendChild(swatch(colors.events[i], n === "touch" ? "touch (prefix hit)" : n)));
    }
  }
  function heatCellAt(x, y) {  // {step, block, text} under a point of the heat canvas
    const w = heatCanvas.clientWidth, h = heatCanvas.clientHeight;
    const pw = w - HM.x0 - HM.right, ph = h - HM.top - HM.bottom;
    if (x < HM.x0 || y < HM.top || y > HM.top + ph) return null;
    const t = tOf(x, HM.x0, pw), row = Math.floor(state.b0 + ((y - HM.top) / ph) * (state.b1 - state.b0));
    const blocks = blockLabel(row);
    if (blocks == null) return null;
    const step = stepAt(t);
    let text = `${blocks} · ${fmtT(t)}` + (step >= 0 ? ` · step ${stepLabel(step)}` : "");
    if (state.heatMode === "state" && H.block_bin === 1) {
      let s = 0;
      for (let i = stStart[row]; i < stStart[row + 1]; i++) {
        if (ST.t0[i] <= t && (ST.dur[i] == null || ST.t0[i] + ST.dur[i] > t)) s = ST.state[i];
      }
      text += ` · ${ST.state_names[s]}`;
    } else if (step >= 0) {
      const bin = Math.floor(step / H.step_bin), counts = {};
      for (let c = 0; c < nCells; c++) {
        if (H.bin[c] === bin && H.blk[c] === row && (state.layer < 0 || H.layer[c] === state.layer)) {
          counts[H.op_names[H.op[c]]] = (counts[H.op_names[H.op[c]]] || 0) + H.n[c];
        }
      }
      const parts = Object.entries(counts).map(([k, v]) => `${k} ${v}`);
      if (parts.length) text += " · " + parts.join(", ") + (isAccess ? " records" : "");
    }
    return { step, text };
  }

  // ---- details panel ----------------------------------------------------------------------------
  const details = $("details");
  function reqButton(r) {
    const b = el("button", "link rid", R.id[r]);
    b.type = "button";
    b.title = R.id[r];
    b.addEventListener("click", () => selectRequest(r, { reveal: true, tab: "requests" }));
    return b;
  }
  function stepButton(i) {
    const b = el("button", "link", stepLabel(i));
    b.type = "button";
    b.addEventListener("click", () => selectStep(i, { reveal: true, tab: "steps" }));
    return b;
  }
  function table(headers, rows, numeric) {
    const t = el("table"), tr = el("tr");
    headers.forEach((hd, i) => tr.appendChild(el("th", numeric && numeric[i] ? "num" : null, hd)));
    t.appendChild(tr);
    for (const row of rows) {
      const r = el("tr");
      row.forEach((v, i) => {
        const td = el("td", numeric && numeric[i] ? "num" : null);
        if (v instanceof Node) td.appendChild(v); else td.textContent = v == null ? "–" : String(v);
        r.appendChild(td);
      });
      t.appendChild(r);
    }
    return t;
  }
  function dl(pairs) {
    const d = el("dl");
    for (const [k, v] of pairs) { d.appendChild(el("dt", null, k)); const dd = el("dd"); if (v instanceof Node) dd.appendChild(v); else dd.textContent = v == null ? "–" : String(v); d.appendChild(dd); }
    return d;
  }
  function showStep(i) {
    clear(details);
    details.dataset.kind = "step";
    details.dataset.step = String(S.step[i]);
    details.appendChild(el("h2", null, "Step " + stepLabel(i)));
    const b = el("div");
    for (const x of stepBadges(i)) b.appendChild(x);
    details.appendChild(b);
    details.appendChild(dl([
      ["start", fmtT(S.ts[i])], ["schedule()", fmtD(S.se[i] - S.ts[i])],
      ["execute + update", S.exec[i] == null ? "not finished" : fmtD(S.exec[i])],
      ["tokens", `${S.fwd[i]} (prefill ${S.pt[i]}, decode ${S.dt[i]}) of budget ${S.budget[i]}`],
      ["requests", `${S.np[i]} prefill, ${S.nd[i]} decode; ${S.new[i]} new, ${S.res[i]} resumed, ${S.fin[i]} finished`],
      ["queues", `${S.run[i]} running (max ${S.seqs[i]}), ${S.wait[i]} waiting`],
      ["KV blocks", `${S.kv[i]} / ${S.kvt[i]} in use (${pct(S.kv[i], S.kvt[i])})`],
      ["admission stop", S.stop_names[S.stop[i]]],
      ["prefix lookups", S.ln[i] ? `${S.ln[i]}: ${S.lh[i]} local + ${S.le[i] || 0} external of ${S.lq[i]} tokens` : "none"],
    ]));
    const kept = i % D.every === 0;
    details.appendChild(el("h3", null, `Requests (${drStart[i + 1] - drStart[i]})`));
    if (!kept) details.appendChild(el("p", "hint", `Details of this step were not embedded (1 step in ${D.every} kept).`));
    const rows = [];
    for (let j = drStart[i]; j < drStart[i + 1]; j++) {
      rows.push([reqButton(DR.req[j]), DR.phase_names[DR.phase[j]] + (DR.chunk[j] >= 0 && DR.phase[j] === 0 ? " #" + DR.chunk[j] : ""),
        DR.kind_names[DR.kind[j]], DR.tokens[j], DR.before[j], DR.blocks[j]]);
    }
    if (rows.length) details.appendChild(table(["request", "phase", "kind", "tokens", "before", "new blk"], rows, [0, 0, 0, 1, 1, 1]));
    details.appendChild(el("h3", null, "Blocks"));
    const brows = [];
    for (let j = dbStart[i]; j < dbStart[i + 1]; j++) {
      const name = DB.event_names[DB.event[j]];
      brows.push([name === "touch" ? "hit (touch)" : name === "alloc" ? "allocated" : name === "free" ? "freed" : name,
        DB.req[j] >= 0 ? reqButton(DB.req[j]) : "–", DB.n[j], DB.ids ? el("span", "ids", idRanges(DB.ids[j] || [])) : "(ids not embedded)"]);
    }
    if (brows.length) details.appendChild(table(["event", "request", "blocks", "block ids"], brows, [0, 0, 1, 0]));
    else if (kept) details.appendChild(el("p", "hint", "No block events in this step."));
    const pre = [], pins = [];
    for (let j = 0; j < PRE.step.length; j++) if (PRE.step[j] === i) pre.push([PRE.req[j] != null ? reqButton(PRE.req[j]) : "–", PRE.lost[j], PRE.blocks[j], PRE.out[j]]);
    for (let j = 0; j < PIN.step.length; j++) if (PIN.step[j] === i) pins.push([PIN.event[j], PIN.req[j] != null ? reqButton(PIN.req[j]) : el("span", "rid", PIN.rid[j]), PIN.blocks[j], PIN.ttl_ns[j] != null ? fmtD(PIN.ttl_ns[j] / 1000) : "–", PIN.reason[j]]);
    if (pre.length) { details.appendChild(el("h3", null, "Preemptions")); details.appendChild(table(["request", "tokens lost", "blocks freed", "output tokens"], pre, [0, 1, 1, 1])); }
    if (pins.length) { details.appendChild(el("h3", null, "Pins")); details.appendChild(table(["event", "request", "blocks", "ttl", "reason"], pins, [0, 0, 1, 1, 0])); }
    if (K) {
      const j = K.step.indexOf(i);
      details.appendChild(el("h3", null, "Kernels (Nsight)"));
      if (j < 0) details.appendChild(el("p", "hint", "No kernels recorded for this step."));
      else details.appendChild(dl([["kernels", fmtN(K.kernels[j])], ["GPU time", fmtD(K.gpu_ns[j] / 1000)], ["top", (K.top[j] || []).join(", ")]]));
    }
  }
  function showRequest(r) {
    clear(details);
    details.dataset.kind = "request";
    details.appendChild(el("h2", "rid", R.id[r]));
    const ttft = R.first[r] != null && R.arr[r] != null ? R.first[r] - R.arr[r] : null;
    details.appendChild(dl([
      ["job / turn", R.job[r] == null ? "–" : `${R.job[r]} / ${R.turn[r] == null ? "–" : R.turn[r]}`],
      ["arrival", R.arr[r] == null ? "–" : fmtT(R.arr[r])],
      ["queued", R.sched[r] != null && R.arr[r] != null ? fmtD(R.sched[r] - R.arr[r]) : "–"],
      ["first token", ttft == null ? "–" : fmtD(ttft) + " after arrival"],
      ["finished", R.fin[r] == null ? "not finished" : `${fmtT(R.fin[r])} (${R.reason[r] || "?"})`],
      ["prompt", R.prompt[r] == null ? "–" : `${fmtN(R.prompt[r])} tokens, ${fmtN(R.cached[r])} cached (${pct(R.cached[r], R.prompt[r])})`],
      ["output", fmtN(R.out[r]) + " tokens"],
      ["preemptions", fmtN(R.npre[r])],
    ]));
    const rows = [];
    for (let j = 0; j < DR.req.length && rows.length < 400; j++) {
      if (DR.req[j] === r) rows.push([stepButton(DR.step[j]), DR.phase_names[DR.phase[j]], DR.kind_names[DR.kind[j]], DR.tokens[j]]);
    }
    details.appendChild(el("h3", null, "Scheduled in steps" + (D.every > 1 ? ` (1 step in ${D.every} embedded)` : "")));
    if (rows.length) details.appendChild(table(["step", "phase", "kind", "tokens"], rows, [0, 0, 0, 1]));
    const segs = [];
    for (let s = segStart[r]; s < segStart[r + 1]; s++) segs.push([G.kind_names[G.kind[s]], fmtT(G.t0[s]), fmtD(G.dur[s])]);
    details.appendChild(el("h3", null, "Lane"));
    details.appendChild(table(["phase", "start", "duration"], segs, [0, 1, 1]));
  }

  // ---- selection, zoom, pan ---------------------------------------------------------------------
  function reveal(t0, t1) {  // pan (and zoom out if needed) so that [t0, t1] is in view
    const span = state.v1 - state.v0;
    if (t1 - t0 > span * 0.9) { const m = (t1 - t0) * 0.1; state.v0 = t0 - m; state.v1 = t1 + m; return; }
    if (t0 < state.v0 || t1 > state.v1) { const c = (t0 + t1) / 2; state.v0 = c - span / 2; state.v1 = c + span / 2; }
  }
  function selectStep(i, opts) {
    if (i < 0 || i >= N) return;
    state.step = i;
    if (opts && opts.tab) setTab(opts.tab);
    if (opts && opts.reveal) {
      reveal(S.ts[i], S.te[i]);
      const top = i * ROW;
      if (top < list.scrollTop || top > list.scrollTop + list.clientHeight - ROW) list.scrollTop = Math.max(0, top - list.clientHeight / 3);
    }
    showStep(i);
    redraw();
  }
  function selectRequest(r, opts) {
    if (r < 0 || r >= NR) return;
    state.req = r;
    if (opts && opts.tab) setTab(opts.tab);
    if (opts && opts.reveal) {
      const top = laneOf[r] * LANE;
      if (top < reqScroll.scrollTop || top > reqScroll.scrollTop + reqScroll.clientHeight - LANE) reqScroll.scrollTop = Math.max(0, top - reqScroll.clientHeight / 3);
      if (segStart[r + 1] > segStart[r]) {
        const s0 = segStart[r], s1 = segStart[r + 1] - 1;
        reveal(G.t0[s0], G.t0[s1] + (G.dur[s1] || 0));
      }
    }
    showRequest(r);
    redraw();
  }
  function zoom(factor, center) {
    const c = center == null ? (state.v0 + state.v1) / 2 : center;
    const full = (tMax - tMin) * 1.1;
    let span = Math.min(full, Math.max(10, (state.v1 - state.v0) * factor));
    const f = (c - state.v0) / (state.v1 - state.v0);
    state.v0 = c - f * span; state.v1 = state.v0 + span;
    redraw();
  }
  function pan(dt) { state.v0 += dt; state.v1 += dt; redraw(); }
  function resetView() { state.v0 = tMin - pad; state.v1 = tMax + pad; redraw(); }

  function attachTimeNav(canvas, x0, right, onClick, wheelNeedsModifier) {
    let drag = null;
    canvas.addEventListener("wheel", (e) => {
      if (wheelNeedsModifier && !(e.ctrlKey || e.altKey || e.metaKey || e.shiftKey)) return;
      e.preventDefault();
      const rect = canvas.getBoundingClientRect(), pw = rect.width - x0 - right;
      if (e.shiftKey && !e.ctrlKey) { pan(((e.deltaY || e.deltaX) / pw) * (state.v1 - state.v0)); return; }
      zoom(Math.exp(e.deltaY * 0.002), tOf(e.clientX - rect.left, x0, pw));
    }, { passive: false });
    canvas.addEventListener("mousedown", (e) => { drag = { x: e.clientX, v0: state.v0, v1: state.v1, moved: false }; });
    window.addEventListener("mousemove", (e) => {
      if (!drag) return;
      const pw = canvas.getBoundingClientRect().width - x0 - right;
      const dx = e.clientX - drag.x;
      if (Math.abs(dx) > 3) drag.moved = true;
      if (!drag.moved) return;
      const dt = (-dx / pw) * (drag.v1 - drag.v0);
      state.v0 = drag.v0 + dt; state.v1 = drag.v1 + dt;
      requestAnimationFrame(redraw);
    });
    window.addEventListener("mouseup", (e) => {
      if (!drag) return;
      const moved = drag.moved;
      drag = null;
      if (!moved && e.target === canvas) {
        const rect = canvas.getBoundingClientRect();
        onClick(e.clientX - rect.left, e.clientY - rect.top, rect);
      }
    });
  }
  attachTimeNav(stepsCanvas, TL.x0, TL.right, (x, y, rect) => {
    if (x < TL.x0) return;
    selectStep(stepAt(tOf(x, TL.x0, rect.width - TL.x0 - TL.right)), { reveal: false });
    const top = state.step * ROW;
    list.scrollTop = Math.max(0, top - list.clientHeight / 3);
  });
  attachTimeNav(reqCanvas, LABEL_W, 8, (x, y) => {
    const r = reqAt(y + reqCanvas.getBoundingClientRect().top);
    if (r >= 0) selectRequest(r, {});
  }, true);
  // Block axis: Alt + wheel zooms it at the pointer (before attachTimeNav's wheel, which zooms time).
  heatCanvas.addEventListener("wheel", (e) => {
    if (!e.altKey) return;
    e.preventDefault(); e.stopImmediatePropagation();
    const rect = heatCanvas.getBoundingClientRect(), ph = rect.height - HM.top - HM.bottom;
    const at = state.b0 + ((e.clientY - rect.top - HM.top) / ph) * (state.b1 - state.b0);
    zoomBlocks(Math.exp(e.deltaY * 0.002), Math.max(0, Math.min(heatRows, at)));
  }, { passive: false });
  $("blocks-zoom-in").addEventListener("click", () => zoomBlocks(0.5, (state.b0 + state.b1) / 2));
  $("blocks-zoom-out").addEventListener("click", () => zoomBlocks(2, (state.b0 + state.b1) / 2));
  $("blocks-zoom-reset").addEventListener("click", () => { state.b0 = 0; state.b1 = heatRows; redraw(); });
  attachTimeNav(heatCanvas, HM.x0, HM.right, (x, y) => {
    const c = heatCellAt(x, y);
    if (c && c.step >= 0) selectStep(c.step, {});
  });
  attachTimeNav(usageCanvas, HM.x0, HM.right, (x, y, rect) => {
    selectStep(stepAt(tOf(x, HM.x0, rect.width - HM.x0 - HM.right)), {});
  });

  // tooltips
  const tip = $("tooltip");
  function showTip(e, text) {
    if (!text) { tip.hidden = true; return; }
    tip.textContent = text; tip.hidden = false;
    tip.style.left = Math.min(window.innerWidth - 300, e.clientX + 12) + "px";
    tip.style.top = e.clientY + 14 + "px";
  }
  heatCanvas.addEventListener("mousemove", (e) => {
    const rect = heatCanvas.getBoundingClientRect();
    const c = heatCellAt(e.clientX - rect.left, e.clientY - rect.top);
    showTip(e, c && c.text);
  });
  stepsCanvas.addEventListener("mousemove", (e) => {
    const rect = stepsCanvas.getBoundingClientRect(), x = e.clientX - rect.left;
    if (x < TL.x0) { showTip(e, null); return; }
    const i = stepAt(tOf(x, TL.x0, rect.width - TL.x0 - TL.right));
    showTip(e, i < 0 ? null : `step ${stepLabel(i)} · ${fmtT(S.ts[i])} · ${fmtD(S.te[i] - S.ts[i])}\n` +
      stepBadges(i).map((b) => b.textContent).join(" "));
  });
  reqCanvas.addEventListener("mousemove", (e) => {
    const rect = reqCanvas.getBoundingClientRect(), r = reqAt(e.clientY);
    if (r < 0) { showTip(e, null); return; }
    const t = tOf(e.clientX - rect.left, LABEL_W, rect.width - LABEL_W - 8);
    let seg = "";
    for (let s = segStart[r]; s < segStart[r + 1]; s++) {
      if (G.t0[s] <= t && t <= G.t0[s] + (G.dur[s] || 0)) seg = ` · ${G.kind_names[G.kind[s]]} ${fmtD(G.dur[s])}`;
    }
    showTip(e, R.id[r] + seg);
  });
  for (const c of [heatCanvas, stepsCanvas, reqCanvas]) c.addEventListener("mouseleave", () => { tip.hidden = true; });

  // ---- toolbar ----------------------------------------------------------------------------------
  function setTab(tab) {
    state.tab = tab;
    for (const b of document.querySelectorAll(".tab")) b.setAttribute("aria-selected", String(b.dataset.tab === tab));
    $("view-steps").hidden = tab !== "steps";
    $("view-requests").hidden = tab !== "requests";
    $("view-blocks").hidden = tab !== "blocks";
    redraw();
  }
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => setTab(b.dataset.tab));
  $("zoom-in").addEventListener("click", () => zoom(0.5));
  $("zoom-out").addEventListener("click", () => zoom(2));
  $("zoom-reset").addEventListener("click", resetView);

  const layerSel = $("layer");
  {
    const all = el("option", null, isAccess ? "all layers" : "(no per-layer records)");
    all.value = "-1";
    layerSel.appendChild(all);
    if (isAccess) H.layers.forEach((lay, i) => { const o = el("option", null, "layer " + lay); o.value = String(i); layerSel.appendChild(o); });
    layerSel.disabled = !isAccess;
    layerSel.addEventListener("change", () => { state.layer = Number(layerSel.value); heatLegend(); redraw(); });
  }
  if (!isAccess) $("heat-mode-access").textContent = "block events";
  for (const radio of document.querySelectorAll('input[name="heat-mode"]')) {
    radio.addEventListener("change", () => { if (radio.checked) { state.heatMode = radio.value; heatLegend(); redraw(); } });
  }

  const search = $("search"), searchCount = $("search-count");
  const lowerIds = R.id.map((s) => String(s).toLowerCase());
  function runSearch() {
    const q = search.value.trim().toLowerCase();
    matchSet.clear();
    state.matches = [];
    state.matchPos = -1;
    if (q) for (let r = 0; r < NR; r++) if (lowerIds[r].includes(q)) { state.matches.push(r); matchSet.add(r); }
    searchCount.textContent = q ? `${state.matches.length} match${state.matches.length === 1 ? "" : "es"}` : "";
    redraw();
  }
  function nextMatch() {
    if (!state.matches.length) return;
    state.matchPos = (state.matchPos + 1) % state.matches.length;
    searchCount.textContent = `${state.matchPos + 1} / ${state.matches.length}`;
    selectRequest(state.matches[state.matchPos], { reveal: true, tab: "requests" });
  }
  let searchTimer = 0;
  search.addEventListener("input", () => { clearTimeout(searchTimer); searchTimer = setTimeout(runSearch, 120); });
  search.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { clearTimeout(searchTimer); if (!state.matches.length || search.dataset.q !== search.value) { runSearch(); search.dataset.q = search.value; } nextMatch(); }
  });

  document.addEventListener("keydown", (e) => {
    if (e.target instanceof HTMLInputElement || e.target instanceof HTMLSelectElement) return;
    const span = state.v1 - state.v0;
    if (e.key === "+" || e.key === "=") zoom(0.5);
    else if (e.key === "-") zoom(2);
    else if (e.key === "0") resetView();
    else if (e.key === "ArrowLeft") pan(-span * 0.2);
    else if (e.key === "ArrowRight") pan(span * 0.2);
    else if (e.key === "/") { e.preventDefault(); search.focus(); }
    else if ((e.key === "ArrowDown" || e.key === "j") && state.step >= 0) { e.preventDefault(); selectStep(Math.min(N - 1, state.step + 1), { reveal: true }); }
    else if ((e.key === "ArrowUp" || e.key === "k") && state.step >= 0) { e.preventDefault(); selectStep(Math.max(0, state.step - 1), { reveal: true }); }
  });

  // ---- drawing ----------------------------------------------------------------------------------
  let frame = 0;
  function redraw() {
    $("range").textContent = `${fmtT(state.v0)} – ${fmtT(state.v1)} (${fmtD(state.v1 - state.v0)})`;
    if (state.tab === "steps") { drawSteps(); drawList(); }
    else if (state.tab === "requests") drawRequests();
    else { drawHeat(); drawUsage(); }
    frame++;
  }
  window.addEventListener("resize", () => requestAnimationFrame(redraw));

  try {
    header();
    stepsLegend();
    reqLegend();
    heatLegend();
    if (!N) notice("warn", "This session has no engine steps (was the scheduler probe off?).");
    redraw();
  } catch (err) {
    notice("error", "Viewer error: " + (err && err.message));
    throw err;
  }
  // For tests and benchmarks: how long the first view took, and a few read-only handles.
  window.kvtraceViewer = {
    renderedMs: performance.now(), steps: N, requests: NR, state,
    frames: () => frame, selectStep: (i) => selectStep(i, { reveal: true }),
    stepIndex: (step) => S.step.indexOf(step),
    blockRows: () => ({ rows: heatRows, b0: state.b0, b1: state.b1, blocks: usedBlocks.length }),
    stepX: (i) => {  // CSS x of a step's middle on the steps canvas, for clicking it
      const pw = stepsCanvas.clientWidth - TL.x0 - TL.right;
      return xOf((S.ts[i] + S.te[i]) / 2, TL.x0, pw);
    },
  };
  document.body.dataset.ready = "1";
})();
