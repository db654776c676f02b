// meshplan's page: a form over the JSON API (live) or one embedded result (static, --html). Charts are inline SVG.
"use strict";
(function () {
  const BOOT = JSON.parse(document.getElementById("meshplan-data").textContent);
  const SHARED = ["model", "hardware", "chips"];
  const TRAIN = ["seq_len", "global_batch", "dtype", "framework", "dp", "fsdp", "tp", "pp", "vpp", "cp", "ep",
    "microbatch", "recompute", "zero"];
  const SERVE = ["input_len", "output_len", "batch", "quant", "kv_quant", "tp", "pp", "ep"]; // form names s_<field>
  const COLORS = ["#2563eb", "#16a34a", "#f59e0b", "#9333ea", "#64748b", "#dc2626", "#0891b2", "#db2777", "#854d0e"];
  const form = document.getElementById("form");
  const $ = (id) => document.getElementById(id);
  let tab = "train", upload = null, train = null, selected = 0, seq = 0, timer = null;

  // ---------- formatting ----------
  function fmtTime(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    if (s < 1e-3) return (s * 1e6).toFixed(1) + " µs";
    if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
    return s.toFixed(s < 10 ? 2 : 1) + " s";
  }
  const GIB = 1024 ** 3;
  const fmtGiB = (b) => (b / GIB).toFixed(1) + " GiB";
  const pct = (x) => (100 * x).toFixed(1) + "%";
  function describe(c) {
    const parts = [];
    for (const k of ["dp", "fsdp", "tp", "pp", "vpp", "cp", "ep"]) if (c[k] > 1) parts.push(k + "=" + c[k]);
    parts.push("mb=" + c.microbatch, "recompute=" + c.recompute);
    if (c.zero) parts.push("zero=" + c.zero);
    if (c.offload) parts.push("offload=" + c.offload);
    return parts.join(" ");
  }

  // ---------- SVG ----------
  const NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, parent, text) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function svg(container, w, h) {
    container.textContent = "";
    return el("svg", {width: w, height: h, viewBox: `0 0 ${w} ${h}`, role: "img"}, container);
  }
  // One horizontal stacked bar with a legend: parts [{label, value}] in one unit.
  // `limit` {label, value}: a dashed capacity line, the scale stretched to hold it (training: the chip's usable HBM,
  // as the --plot memory PNG draws it; serving: the memory budget serve --json gives).
  function stackBar(container, parts, fmt, total, limit) {
    parts = parts.filter((p) => p.value > 0);
    const W = 420, H = 40 + 16 * (parts.length + (limit ? 1 : 0)), s = svg(container, W, H);
    const used = parts.reduce((a, p) => a + p.value, 0);
    const sum = Math.max(total || used, limit ? limit.value : 0) || 1;
    if (limit) {
      const lx = 10 + (W - 20) * limit.value / sum;
      el("line", {x1: lx, y1: 2, x2: lx, y2: 34, stroke: "#111", "stroke-dasharray": "4 3", class: "limit"}, s);
      el("text", {x: 10, y: 45 + 16 * parts.length}, s, `- - ${limit.label} ${fmt(limit.value)}`);
    }
    let x = 10;
    parts.forEach((p, i) => {
      const w = (W - 20) * p.value / sum;
      el("rect", {x, y: 8, width: Math.max(w, 0.5), height: 20, fill: COLORS[i % COLORS.length], "data-label": p.label},
        s).appendChild(el("title", {}, null, `${p.label}: ${fmt(p.value)}`));
      x += w;
      el("rect", {x: 10, y: 36 + 16 * i, width: 10, height: 10, fill: COLORS[i % COLORS.length]}, s);
      el("text", {x: 26, y: 45 + 16 * i}, s, `${p.label}  ${fmt(p.value)}  (${(100 * p.value / (used || 1)).toFixed(0)}%)`);
    });
    return s;
  }
  // A line chart: series [{name, points: [{x, y, label, tag, highlight}]}]; log2 x / log10 y when asked.
  function lineChart(container, series, o) {
    const W = o.width || 420, H = 268, L = 64, R = 30, T = 20, B = 40, s = svg(container, W, H);
    const all = series.flatMap((se) => se.points).filter((p) => isFinite(p.x) && isFinite(p.y) && (!o.logx || p.x > 0) && (!o.logy || p.y > 0));
    if (!all.length) { el("text", {x: L, y: H / 2}, s, "no data"); return s; }
    const fx = o.logx ? Math.log2 : (v) => v, fy = o.logy ? Math.log10 : (v) => v;
    let x0 = Math.min(...all.map((p) => fx(p.x))), x1 = Math.max(...all.map((p) => fx(p.x)));
    let y0 = o.y0 !== undefined && !o.logy ? o.y0 : Math.min(...all.map((p) => fy(p.y))), y1 = Math.max(...all.map((p) => fy(p.y)));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1); }
    const X = (v) => L + (W - L - R) * (fx(v) - x0) / (x1 - x0), Y = (v) => H - B - (H - T - B) * (fy(v) - y0) / (y1 - y0);
    el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}, s);
    el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}, s);
    for (let i = 0; i <= 4; i++) {
      const f = y0 + (y1 - y0) * i / 4, v = o.logy ? 10 ** f : f;
      el("text", {x: L - 4, y: Y(v) + 4, "text-anchor": "end"}, s, o.yfmt(v));
      el("line", {x1: L, y1: Y(v), x2: W - R, y2: Y(v), stroke: "#eee"}, s);
    }
    let last = -1e9;
    for (const v of [...new Set(all.map((p) => p.x))].sort((a, b) => a - b)) {
      if (X(v) - last < 34) continue;
      last = X(v);
      el("text", {x: X(v), y: H - B + 14, "text-anchor": "middle"}, s, o.xfmt(v));
    }
    el("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle"}, s, o.xlabel);
    el("text", {x: 12, y: (T + H - B) / 2, transform: `rotate(-90 12 ${(T + H - B) / 2})`, "text-anchor": "middle"}, s, o.ylabel);
    series.forEach((se, k) => {
      const pts = se.points.filter((p) => all.includes(p));
      el("polyline", {points: pts.map((p) => `${X(p.x)},${Y(p.y)}`).join(" "), fill: "none",
        stroke: COLORS[k % COLORS.length], "stroke-width": 2}, s);
      let lastTag = -1e9;
      pts.forEach((p) => {
        const c = el("circle", {cx: X(p.x), cy: Y(p.y), r: p.highlight ? 6 : 3.5, fill: p.highlight ? "#dc2626" : COLORS[k % COLORS.length]}, s);
        c.appendChild(el("title", {}, null, p.label || `${o.xfmt(p.x)}: ${o.yfmt(p.y)}`));
        if (p.tag !== undefined && (X(p.x) - lastTag >= 22 || p.highlight)) {
          lastTag = X(p.x);
          el("text", {x: X(p.x) + 5, y: Y(p.y) - 6}, s, p.tag);
        }
      });
    });
    return s;
  }
  // Pipeline timeline: bars [{stage, start_s, duration_s, kind, micro_batch}] per stage, plus exposed comm.
  function timeline(container, bars, pp, commPerMb, vpp = 1) {
    const W = Math.max(640, container.clientWidth - 20 || 900), rowH = 22, L = 70, T = 6;
    const rows = pp + (commPerMb > 0 ? 1 : 0), H = T + rows * rowH + 26, s = svg(container, W, H);
    const end = Math.max(...bars.map((b) => b.start_s + b.duration_s), commPerMb, 1e-12);
    const X = (t) => L + (W - L - 10) * t / end, off = commPerMb > 0 ? 1 : 0;
    if (off) {
      el("text", {x: 4, y: T + 15}, s, "exp. comm");
      el("rect", {x: L, y: T + 3, width: X(commPerMb) - L, height: rowH - 6, fill: "#dc2626"}, s)
        .appendChild(el("title", {}, null, `exposed communication per micro-batch ${fmtTime(commPerMb)}`));
    }
    for (let st = 0; st < pp; st++) el("text", {x: 4, y: T + (st + off) * rowH + 15}, s, `stage ${st}`);
    for (const b of bars) {
      const r = el("rect", {x: X(b.start_s), y: T + (b.stage + off) * rowH + 2, width: Math.max(X(b.start_s + b.duration_s) - X(b.start_s) - 0.5, 0.5),
        height: rowH - 4, fill: b.kind === "F" ? "#2563eb" : "#16a34a", class: "slot"}, s);
      const chunk = b.chunk !== undefined && vpp > 1 ? `, model chunk ${b.chunk}` : "";
      r.appendChild(el("title", {}, null, `${b.kind === "F" ? "forward" : "backward"} micro-batch ${b.micro_batch}${chunk}, stage ${b.stage}: ${fmtTime(b.duration_s)}`));
    }
    el("text", {x: L, y: H - 6}, s, "0");
    el("text", {x: W - 10, y: H - 6, "text-anchor": "end"}, s, fmtTime(end) + "  (blue forward, green backward)");
    return s;
  }

  // ---------- form and URL ----------
  function fill(select, names, keepFirst) {
    const first = keepFirst ? select.options[0] : null;
    select.textContent = "";
    if (first) select.appendChild(first);
    for (const n of names) { const o = document.createElement("option"); o.value = o.textContent = n; select.appendChild(o); }
  }
  function fieldNames() { return SHARED.concat(tab === "train" ? TRAIN : SERVE.map((f) => "s_" + f)); }
  function formState() {
    const st = {tab};
    for (const n of SHARED.concat(TRAIN, SERVE.map((f) => "s_" + f))) {
      const v = form.elements[n] ? form.elements[n].value.trim() : "";
      if (v !== "") st[n] = v;
    }
    if (upload) { st.model_json = upload.text; st.model_name = upload.name; delete st.model; }
    return st;
  }
  function apiParams(st) {
    const p = {};
    for (const n of SHARED) if (st[n] !== undefined) p[n] = st[n];
    if (st.model_json !== undefined) { p.model_json = st.model_json; p.model_name = st.model_name; }
    if (tab === "train") { for (const n of TRAIN) if (st[n] !== undefined) p[n] = st[n]; }
    else for (const f of SERVE) if (st["s_" + f] !== undefined) p[f] = st["s_" + f];
    return p;
  }
  function toQuery(st) { return new URLSearchParams(st).toString(); }
  function fromQuery() {
    const q = new URLSearchParams(location.search), st = {};
    for (const [k, v] of q) st[k] = v;
    return st;
  }
  function setForm(st) {
    for (const n of SHARED.concat(TRAIN, SERVE.map((f) => "s_" + f))) {
      if (st[n] === undefined || !form.elements[n]) continue;
      const e = form.elements[n];
      if (e.tagName === "SELECT" && ![...e.options].some((o) => o.value === st[n])) {
        const o = document.createElement("option"); o.value = o.textContent = st[n]; e.appendChild(o);
      }
      e.value = st[n];
    }
    if (st.model_json !== undefined) setUpload(st.model_json, st.model_name || "uploaded.json");
  }
  function setUpload(text, name) {
    upload = {text, name};
    const sel = form.elements.model;
    let o = sel.querySelector("option[data-upload]");
    if (!o) { o = document.createElement("option"); o.setAttribute("data-upload", "1"); sel.insertBefore(o, sel.firstChild); }
    o.value = "__upload__"; o.textContent = "uploaded: " + name; sel.value = "__upload__";
  }
  function setTab(t) {
    tab = t;
    document.body.dataset.tab = t;
    for (const b of document.querySelectorAll("nav .tab")) b.classList.toggle("active", b.dataset.tab === t);
  }
  function clearErrors() {
    for (const e of document.querySelectorAll(".err")) e.textContent = "";
    for (const e of form.querySelectorAll(".bad")) e.classList.remove("bad");
  }
  // results shown under an error belong to the last inputs that planned: dimmed and labelled until the next plan
  function markStale(stale) {
    for (const id of ["train-out", "serve-out"]) $(id).classList.toggle("stale", stale);
  }
  function showError(msg, field) {
    const name = field && (tab === "serve" && !SHARED.includes(field) ? "s_" + field : field);
    const spot = name && document.querySelector(`.err[data-for="${name}"]`);
    const target = spot && spot.parentElement.offsetParent !== null ? spot : $("form-error");  // its fieldset is shown
    target.textContent = "error: " + msg;
    if (spot && form.elements[name]) form.elements[name].classList.add("bad");
  }

  async function call(path, params) {
    const r = await fetch(path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(params)});
    const body = await r.json();
    if (!r.ok) { const e = new Error(body.error || r.statusText); e.field = body.field; throw e; }
    return body;
  }

  // ---------- training ----------
  function renderTrain(view) {
    train = view;
    const r = view.train, i = view.inputs || {};
    const name = i.model || (i.model_name || "uploaded").replace(/\.json$/i, "");
    $("train-title").textContent = `${name} on ${i.chips || ""} × ${i.hardware || ""}: ${r.searched} layouts searched in ${r.search_time_s.toFixed(2)} s`;
    const tb = document.querySelector("#plans tbody");
    tb.textContent = "";
    r.plans.forEach((p, k) => {
      const tr = document.createElement("tr");
      const cells = [k + 1, describe(p.config), fmtTime(p.step_time_s), pct(p.mfu), pct(p.hfu), p.tokens_per_s_per_chip.toFixed(0),
        fmtTime(p.time_s.compute), fmtTime(p.time_s.exposed_comm), fmtTime(p.time_s.bubble), fmtGiB(p.memory_bytes_per_chip.total), p.fits ? "yes" : "no"];
      for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
      tr.addEventListener("click", () => selectPlan(k));
      tb.appendChild(tr);
    });
    selectPlan(Math.min(selected, r.plans.length - 1));
    if (view.scaling) renderScaling(view.scaling);
  }
  async function selectPlan(k) {
    selected = k;
    const p = train.train.plans[k];
    document.querySelectorAll("#plans tbody tr").forEach((tr, j) => tr.classList.toggle("selected", j === k));
    document.querySelectorAll(".sel").forEach((e) => { e.textContent = `#${k + 1}`; });
    $("bottleneck").textContent = `Bottleneck (plan #${k + 1}): ${p.bottleneck}. ${p.explanation}. Mesh: ${p.mesh}.`;
    const m = p.memory_bytes_per_chip;
    const hbm = (BOOT.presets.hbm_usable_bytes || {})[(train.inputs || {}).hardware];
    stackBar($("chart-memory"), ["params", "grads", "optimizer", "activations", "other"].map((n) => ({label: n, value: m[n]})), fmtGiB,
      undefined, hbm ? {label: "HBM", value: hbm} : undefined);
    const tbd = p.time_breakdown_s || p.time_s, parts = [{label: "compute", value: tbd.compute}];
    for (const key in tbd) if (key.startsWith("exposed_comm/")) parts.push({label: "exposed " + key.slice(13), value: tbd[key]});
    if (parts.length === 1) parts.push({label: "exposed comm", value: p.time_s.exposed_comm});
    parts.push({label: "bubble", value: p.time_s.bubble}, {label: "other", value: p.time_s.other});
    stackBar($("chart-time"), parts, fmtTime);
    let sched = train.schedules ? train.schedules[k] : null;
    if (!sched) {
      try {
        sched = await call("/api/schedule", {pp: p.config.pp, vpp: p.config.vpp, micro_batches: Math.max(1, Math.round(p.micro_batches || 1)), compute_s: p.time_s.compute});
      } catch (e) { $("chart-timeline").textContent = "error: " + e.message; return; }
    }
    if (selected === k) {
      timeline($("chart-timeline"), sched.bars, p.config.pp, p.time_s.exposed_comm / Math.max(p.micro_batches || 1, 1), p.config.vpp);
      const shown = sched.shown_micro_batches, total = sched.micro_batches;
      $("timeline-shown").textContent = shown !== undefined && total !== undefined ?
        (shown < total ? `${shown} of ${total} micro-batches shown` : `all ${total} micro-batches`) +
        (p.config.vpp > 1 ? `, ${p.config.vpp} model chunks each` : "") : "";
    }
  }
  function renderScaling(points) {
    const chips = Number((train && train.inputs && train.inputs.chips) || 0);
    lineChart($("chart-mfu"), [{name: "MFU", points: points.map((q) => ({x: q.chips, y: q.mfu, highlight: q.chips === chips, label: `${q.chips} chips: MFU ${pct(q.mfu)}`}))}],
      {logx: true, y0: 0, xlabel: "chips", ylabel: "MFU", xfmt: (v) => String(v), yfmt: (v) => (100 * v).toFixed(0) + "%"});
  }

  // ---------- serving ----------
  function renderServe(view) {
    const o = view.serve, c = o.config, cost = o.cost_per_million_tokens;
    $("serve-title").textContent = `${o.model} on ${o.chips} × ${o.hardware}: tp=${c.tp} pp=${c.pp} ep=${c.ep} × ${c.replicas} replicas, ${c.weight_dtype} weights, ${c.kv_dtype} KV (${o.mode})`;
    const cards = [["TTFT", fmtTime(o.ttft_s), "ttft"], ["TPOT", fmtTime(o.tpot_s), "tpot"], ["end-to-end latency", fmtTime(o.e2e_latency_s), "e2e"],
      ["output tokens/s", Math.round(o.throughput_tokens_per_s).toLocaleString("en-US"), "throughput"],
      ["batch per replica (max)", `${o.batch} (${o.max_batch_per_replica})` +
        (o.running_batch !== undefined && o.running_batch < o.batch ? `, ${o.running_batch} decode at once (step budget)` : ""), "batch"],
      ["$ / M output tokens", "$" + cost.output.toFixed(3), "cost-output"], ["$ / M input tokens", "$" + cost.input.toFixed(4), "cost-input"],
      ["$ / M tokens blended", "$" + cost.blended.toFixed(3), "cost-blended"],
      ["memory per chip", `${fmtGiB(o.memory_bytes_per_chip.total)} of ${fmtGiB(o.memory_bytes_per_chip.budget)}`, "memory"],
      ["decode step bound by", o.decode_step.bound, "bound"]];
    if (o.expert_gemms) {  // a MoE: the format the engine's MoE kernel runs the experts in, and its measured rate
      const g = o.expert_gemms;
      cards.push(["MoE expert GEMMs" + (g.engine_fraction !== null ? ` (engine kernel: ${g.engine_fraction.toFixed(2)} of peak)` : " (chip's grouped ceiling)"),
        g.format, "experts"]);
    }
    const box = $("serve-cards");
    box.textContent = "";
    for (const [k, v, id] of cards) {
      const d = document.createElement("div"); d.className = "card"; d.id = "card-" + id;
      const a = document.createElement("div"); a.className = "v"; a.textContent = v;
      const b = document.createElement("div"); b.className = "k"; b.textContent = k;
      d.append(a, b); box.appendChild(d);
    }
    const fr = o.frontier || [];
    lineChart($("chart-frontier"), [{name: "frontier", points: fr.map((p) => ({x: p.throughput_tokens_per_s, y: p.tpot_s * 1e3, tag: p.batch,
      highlight: p.batch === o.batch, label: `batch ${p.batch}: ${Math.round(p.throughput_tokens_per_s)} tok/s, TPOT ${fmtTime(p.tpot_s)}, TTFT ${fmtTime(p.ttft_s)}`}))}],
    {width: 760, y0: 0, logx: true, xlabel: "output tokens/s (deployment)", ylabel: "TPOT (ms)", xfmt: (v) => v >= 1e3 ? (v / 1e3).toFixed(0) + "k" : v.toFixed(0), yfmt: (v) => v.toFixed(1)});
    lineChart($("chart-cost"), [{name: "cost", points: fr.map((p) => ({x: p.batch, y: p.cost_per_million_tokens.output, highlight: p.batch === o.batch}))}],
      {logx: true, logy: true, xlabel: "batch per replica", ylabel: "$ / M output tokens", xfmt: (v) => String(v), yfmt: (v) => "$" + v.toFixed(2)});
    const m = o.memory_bytes_per_chip;
    stackBar($("chart-serve-memory"), ["weights", "kv_cache", "activations", "reserved"].map((n) => ({label: n, value: m[n]})), fmtGiB, undefined,
      {label: "budget", value: m.budget});
    const tb = document.querySelector("#layouts tbody");
    tb.textContent = "";
    for (const l of o.layouts || []) {
      const tr = document.createElement("tr");
      for (const v of [`tp=${l.config.tp} pp=${l.config.pp} ep=${l.config.ep} ×${l.config.replicas}`, l.batch, fmtTime(l.ttft_s), fmtTime(l.tpot_s), Math.round(l.throughput_tokens_per_s)]) {
        const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
      }
      tb.appendChild(tr);
    }
  }

  // ---------- running ----------
  async function run() {
    const st = formState(), my = ++seq;
    history.replaceState(null, "", "?" + toQuery(st));
    $("permalink").href = "?" + toQuery(st);
    clearErrors();
    $("status").textContent = "planning…";
    const params = apiParams(st);
    try {
      if (tab === "train") {
        const r = await call("/api/train", params);
        if (my !== seq) return;
        renderTrain({kind: "train", train: r, inputs: params});
        markStale(false);
        $("status").textContent = "";
        $("chart-mfu").textContent = "computing…";
        const sc = await call("/api/scaling", params);
        if (my === seq) renderScaling(sc.points);
      } else {
        const r = await call("/api/serve", params);
        if (my !== seq) return;
        renderServe({kind: "serve", serve: r, inputs: params});
        markStale(false);
        $("status").textContent = "";
      }
    } catch (e) {
      if (my !== seq) return;
      $("status").textContent = "";
      showError(e.message, e.field);
      markStale(true);
    }
  }
  function schedule() { clearTimeout(timer); timer = setTimeout(run, 350); }

  // ---------- start ----------
  fill(form.elements.model, BOOT.presets.models);
  fill(form.elements.hardware, BOOT.presets.hardware);
  fill(form.elements.framework, BOOT.presets.frameworks, true);
  fill(form.elements.recompute, BOOT.presets.recompute, true);
  form.elements.model.value = "llama3-70b";
  form.elements.hardware.value = "h100-sxm";
  if (BOOT.mode === "static") {
    const v = BOOT.view, inp = {};
    document.body.classList.add("static");
    $("static-note").hidden = false;
    for (const k in v.inputs) inp[v.kind === "serve" && !SHARED.includes(k) ? "s_" + k : k] = String(v.inputs[k]);
    setForm(inp);
    for (const e of form.elements) e.disabled = true;
    $("permalink").hidden = true;
    setTab(v.kind);
    if (v.kind === "train") renderTrain(v); else renderServe(v);
    return;
  }
  document.querySelectorAll("nav .tab").forEach((b) => b.addEventListener("click", () => { setTab(b.dataset.tab); run(); }));
  form.addEventListener("submit", (e) => { e.preventDefault(); clearTimeout(timer); run(); });
  form.addEventListener("change", (e) => {
    if (e.target.id === "f-upload") return;
    if (e.target.name === "model" && e.target.value !== "__upload__") {
      upload = null;
      const o = form.elements.model.querySelector("option[data-upload]");
      if (o) o.remove();
    }
    schedule();
  });
  form.addEventListener("input", (e) => { if (e.target.tagName === "INPUT" && e.target.type !== "file") schedule(); });
  $("f-upload").addEventListener("change", async (e) => {
    const f = e.target.files[0];
    if (!f) return;
    setUpload(await f.text(), f.name);
    run();
  });
  const st = fromQuery();
  setTab(st.tab === "serve" ? "serve" : "train");
  setForm(st);
  run();
})();
