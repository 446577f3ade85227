/* loopwatch web view. Draws the panels the server describes (/api/panels) with the data
 * it returns (/api/panel/<id>): the same definitions and SQL as the Grafana dashboards.
 * No framework, no build step; every value from the store is inserted as text. */
"use strict";

(function () {
  const COLORS = {
    green: "#73BF69", orange: "#FF9830", red: "#F2495C", blue: "#5794F2",
    yellow: "#FADE2A", text: "#d8dce3", purple: "#B877D9",
  };
  const PALETTE = ["#7EB26D", "#EAB839", "#6ED0E0", "#EF843C", "#E24D42", "#1F78C1",
    "#BA43A9", "#705DA0", "#508642", "#CCA300", "#447EBC", "#C15C17"];
  const RANGE_LABELS = { s: "second", m: "minute", h: "hour", d: "day", w: "week" };
  const REFRESH_CHOICES = [0, 10, 30, 60, 300];
  const ROW_PX = 30;
  const CHART_ROW_PX = 44;
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

  const state = {
    catalog: null, panels: {}, tiers: {}, options: {},
    route: { view: "realtime", runId: null }, range: null, refresh: 0, vars: {},
    views: {}, annotations: [], timer: null, controller: null, loading: 0,
  };

  // --- small helpers --------------------------------------------------------------------
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") el.className = value;
      else if (key === "text") el.textContent = value;
      else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
      else if (key === "style") Object.assign(el.style, value);
      else el.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }
  const color = (name) => COLORS[name] || name || COLORS.text;
  const byId = (id) => document.getElementById(id);

  function rangeSeconds(text) {
    const m = /^now-(\d+)([smhdw])$/.exec(text);
    const unit = { s: 1, m: 60, h: 3600, d: 86400, w: 604800 };
    return m ? Number(m[1]) * unit[m[2]] : 3600;
  }
  function rangeLabel(text) {
    const m = /^now-(\d+)([smhdw])$/.exec(text);
    if (!m) return text;
    const n = Number(m[1]);
    return `Last ${n} ${RANGE_LABELS[m[2]]}${n === 1 ? "" : "s"}`;
  }

  // --- number formatting by Grafana unit id ----------------------------------------------
  function fmt(value, unit, decimals) {
    if (value === null || value === undefined || value === "") return "–";
    if (unit === "dateTimeAsIso") return fmtTime(value);
    if (typeof value !== "number") return String(value);
    if (!Number.isFinite(value)) return "–";
    const fixed = (v, d) => v.toLocaleString(undefined,
      { minimumFractionDigits: d, maximumFractionDigits: d });
    const auto = (v) => {
      const a = Math.abs(v);
      return a === 0 ? 0 : a >= 100 ? 0 : a >= 1 ? 2 : a >= 0.01 ? 3 : 4;
    };
    switch (unit) {
      case "percentunit": {
        const pct = value * 100;
        const d = decimals ?? (Math.abs(pct) >= 10 || pct === 0 ? 0 : 1);
        return `${fixed(pct, Math.min(d, 2))}%`;
      }
      case "currencyUSD": return window.loopwatchMoney.usd(value, decimals ?? auto(value));
      case "ms":
        return Math.abs(value) >= 1000 ? `${fixed(value / 1000, 2)} s` : `${fixed(value, 0)} ms`;
      case "none": return String(value);
      default: {
        if (Number.isInteger(value)) return fixed(value, 0);
        const a = Math.abs(value);
        if (a >= 1e6) return `${fixed(value / 1e6, 1)}M`;
        if (a >= 1e4) return `${fixed(value / 1e3, 1)}k`;
        return fixed(value, decimals ?? (a >= 100 ? 0 : a >= 1 ? 1 : 3));
      }
    }
  }
  function fmtTime(value) {
    const d = typeof value === "number" ? new Date(value * 1000) : new Date(value);
    if (Number.isNaN(d.getTime())) return String(value);
    const pad = (n) => String(n).padStart(2, "0");
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
      `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }
  function ago(iso) {
    const seconds = (Date.now() - new Date(iso).getTime()) / 1000;
    if (!Number.isFinite(seconds)) return "";
    if (seconds < 90) return `${Math.max(0, Math.round(seconds))} s ago`;
    if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 172800) return `${Math.round(seconds / 3600)} h ago`;
    return `${Math.round(seconds / 86400)} days ago`;
  }
  function thresholdColor(steps, value) {
    let found = steps && steps.length ? steps[0].color : "text";
    for (const step of steps || []) {
      if (step.value !== null && typeof value === "number" && value >= step.value) found = step.color;
    }
    return color(found);
  }

  // --- routing and state in the URL hash ------------------------------------------------
  function parseHash() {
    const raw = location.hash.replace(/^#\/?/, "");
    const [path, query] = raw.split("?");
    const parts = (path || "realtime").split("/");
    const params = new URLSearchParams(query || "");
    let view = parts[0] || "realtime";
    let runId = null;
    let focus = null;
    if (view === "replay") { view = "run"; focus = "replay"; }  // alert links: #/replay/<run>
    if (view === "run") { runId = parts[1] ? decodeURIComponent(parts.slice(1).join("/")) : null; }
    if (!["realtime", "trends", "run", "advice"].includes(view)) view = "realtime";
    return { view, runId, params, focus };
  }
  // the Advice page has no panels of its own: it keeps the realtime tier's controls
  function tierOf(view) { return view === "run" ? "drilldown" : view === "advice" ? "realtime" : view; }
  function writeHash(view, runId) {
    const params = new URLSearchParams();
    params.set("range", state.range);
    for (const [name, value] of Object.entries(state.vars)) if (value) params.set(name, value);
    const path = view === "run" ? (runId ? `run/${encodeURIComponent(runId)}` : "run") : view;
    const next = `#/${path}?${params.toString()}`;
    if (location.hash !== next) location.hash = next;
    else render();
  }

  // --- fetching -------------------------------------------------------------------------
  async function getJSON(url, signal) {
    const response = await fetch(url, { signal, headers: { Accept: "application/json" } });
    const body = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
    if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
    return body;
  }
  function queryString(extra) {
    const params = new URLSearchParams();
    const to = Date.now();
    params.set("from", String(to - rangeSeconds(state.range) * 1000));
    params.set("to", String(to));
    for (const [name, value] of Object.entries(state.vars)) if (value) params.set(name, value);
    for (const [name, value] of Object.entries(extra || {})) params.set(name, value);
    return params.toString();
  }
  function setLoading(delta) {
    state.loading += delta;
    byId("updated").classList.toggle("loading", state.loading > 0);
    if (state.loading === 0) {
      byId("updated").textContent = `updated ${fmtTime(Date.now() / 1000).slice(11)}`;
    }
  }

  // --- page chrome ----------------------------------------------------------------------
  function buildChrome() {
    const tabs = byId("tabs");
    tabs.replaceChildren(
      h("a", { class: "tab", href: "#/realtime", "data-view": "realtime", text: "Operational health" }),
      h("a", { class: "tab", href: "#/trends", "data-view": "trends", text: "Trends" }),
      h("a", { class: "tab", href: "#/run", "data-view": "run", text: "Run drill-down" }),
      h("a", { class: "tab", href: "#/advice", "data-view": "advice", text: "Advice" }));
    byId("range").addEventListener("change", (event) => {
      state.range = event.target.value; writeHash(state.route.view, state.route.runId);
    });
    byId("refresh").addEventListener("change", (event) => {
      state.refresh = Number(event.target.value); schedule();
    });
    byId("reload").addEventListener("click", () => refreshData());
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { for (const view of Object.values(state.views)) view.resize(); }, 150);
    });
    window.addEventListener("hashchange", render);
  }

  function syncControls(tier) {
    const range = byId("range");
    const options = [...new Set([...tier.time_options, state.range])];
    range.replaceChildren(...options.map((value) =>
      h("option", { value, selected: value === state.range, text: rangeLabel(value) })));
    const refresh = byId("refresh");
    refresh.replaceChildren(...REFRESH_CHOICES.map((seconds) => h("option", {
      value: seconds, selected: seconds === state.refresh,
      text: seconds === 0 ? "Off" : seconds < 60 ? `${seconds}s` : `${seconds / 60}m`,
    })));
    for (const tab of byId("tabs").children) {
      tab.classList.toggle("active", tab.dataset.view === state.route.view);
    }
    const bar = byId("varbar");
    const filters = state.catalog.variables.filter((v) => !v.free_text && tier.variables.includes(v.name));
    bar.replaceChildren(...filters.map((variable) => {
      const select = h("select", {
        "data-var": variable.name,
        onchange: (event) => {
          state.vars[variable.name] = event.target.value;
          writeHash(state.route.view, state.route.runId);
        },
      }, h("option", { value: "", text: "All" }),
      ...(state.options[variable.name] || []).map((value) =>
        h("option", { value, selected: state.vars[variable.name] === value, text: value })));
      return h("label", {}, variable.label, select);
    }), h("span", { class: "hint", text: "Annotations: deploys, model and prompt changes" }));
  }

  function schedule() {
    clearInterval(state.timer);
    if (state.refresh > 0) {
      state.timer = setInterval(() => { if (!document.hidden) refreshData(); }, state.refresh * 1000);
    }
  }

  // --- rendering a view -----------------------------------------------------------------
  function destroyViews() {
    for (const view of Object.values(state.views)) view.destroy();
    state.views = {};
  }

  function render() {
    const { view, runId, params, focus } = parseHash();
    const changedTier = tierOf(view) !== tierOf(state.route.view) || !state.range;
    state.route = { view, runId };
    state.focus = focus;
    const tier = state.tiers[tierOf(view)];
    state.range = params.get("range") || (changedTier ? tier.time_from : state.range);
    state.vars = {};
    for (const variable of state.catalog.variables) {
      if (!variable.free_text && params.get(variable.name)) state.vars[variable.name] = params.get(variable.name);
    }
    if (changedTier) state.refresh = tier.refresh_s;
    syncControls(tier);
    schedule();
    destroyViews();
    const main = byId("main");
    main.replaceChildren();
    if (view === "run") renderDrilldown(main, tier, runId);
    else if (view === "advice") renderAdvice(main);
    else renderTier(main, tier);
    refreshData();
  }

  function renderTier(main, tier) {
    let grid = null;
    let section = null;
    for (const id of tier.panels) {
      const meta = state.panels[id];
      if (meta.section !== section) {
        section = meta.section;
        main.append(h("h2", { class: "section-title", text: section }));
        grid = h("div", { class: "grid" });
        main.append(grid);
      }
      const view = panelView(meta);
      grid.append(view.el);
      state.views[id] = view;
    }
  }

  function renderDrilldown(main, tier, runId) {
    const input = h("input", { type: "text", placeholder: "run id", value: runId || "",
      "aria-label": "run id", spellcheck: "false" });
    const open = () => { if (input.value.trim()) writeHash("run", input.value.trim()); };
    input.addEventListener("keydown", (event) => { if (event.key === "Enter") open(); });
    main.append(h("div", { class: "runbar" }, input, h("button", { type: "button", onclick: open, text: "Open run" }),
      runId ? h("a", { href: "#/run", text: "← all runs" }) : null));
    if (!runId) {
      main.append(h("h2", { class: "section-title", text: "Pick a run" }));
      const grid = h("div", { class: "grid" });
      const view = panelView(state.panels.run_list);
      grid.append(view.el);
      state.views.run_list = view;
      main.append(grid);
      return;
    }
    main.append(h("div", { class: "run-title", id: "run-title" }, h("h2", { text: runId })));
    main.append(h("dl", { class: "kv panel", id: "run-kv" }, h("div", { class: "note", text: "loading…" })));
    let grid = null;
    let section = null;
    for (const id of tier.panels) {
      const meta = state.panels[id];
      if (!meta.needs_run || id === "run_summary") continue;
      if (meta.section !== section) {
        section = meta.section;
        main.append(h("h2", { class: "section-title", text: section }));
        grid = h("div", { class: "grid" });
        main.append(grid);
      }
      const view = panelView(meta, true);
      grid.append(view.el);
      state.views[id] = view;
    }
    main.append(h("h2", { class: "section-title", id: "replay-title", text: "Replay" }),
      h("section", { class: "panel replay", id: "replay", "data-state": "loading" },
        h("div", { class: "note", text: "loading…" })),
      h("h2", { class: "section-title", text: "Trace economics of this agent" }),
      h("section", { class: "panel economics", id: "economics", "data-state": "loading" },
        h("div", { class: "note", text: "loading…" })));
  }

  async function refreshData() {
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    const signal = controller.signal;
    const { view, runId } = state.route;
    setLoading(1);
    try {
      if (view !== "run") {
        state.annotations = await loadAnnotations(signal);
      }
      const jobs = [loadAlerts(signal)];
      if (view === "run" && runId) {
        jobs.push(loadRun(runId, signal));
      } else if (view === "advice") {
        jobs.push(loadAdvice(signal));
      } else {
        for (const [id, panel] of Object.entries(state.views)) {
          if (id === "firing_alerts") continue;  // drawn from /api/alerts, the same SQL
          jobs.push(getJSON(`/api/panel/${id}?${queryString()}`, signal)
            .then((data) => panel.draw(data), (error) => { if (!signal.aborted) panel.fail(error); }));
        }
      }
      await Promise.all(jobs);
    } catch (error) {
      if (!signal.aborted) showError(error);
    } finally {
      setLoading(-1);
    }
  }

  function showError(error) {
    byId("main").prepend(h("div", { class: "note error", text: `Could not load: ${error.message}` }));
  }

  async function loadAnnotations(signal) {
    try {
      const body = await getJSON(`/api/annotations?${queryString()}`, signal);
      return body.annotations || [];
    } catch (error) {
      return [];
    }
  }

  async function loadRun(runId, signal) {
    let body;
    try {
      body = await getJSON(`/api/runs/${encodeURIComponent(runId)}?${queryString()}`, signal);
    } catch (error) {
      if (signal.aborted) return;
      byId("run-kv").replaceChildren(h("div", { class: "note error", text: error.message }));
      for (const panel of Object.values(state.views)) panel.fail(error);
      return;
    }
    const agent = drawRunSummary(body.panels.run_summary);
    for (const [id, panel] of Object.entries(state.views)) {
      if (body.panels[id]) panel.draw(body.panels[id]);
    }
    await Promise.all([
      getJSON(`/api/replay/${encodeURIComponent(runId)}`, signal).then(drawReplay,
        (error) => { if (!signal.aborted) failBox("replay", error); }),
      getJSON(`/api/economics?agent=${encodeURIComponent(agent)}&days=7`, signal).then(drawEconomics,
        (error) => { if (!signal.aborted) failBox("economics", error); }),
    ]);
    if (state.focus === "replay") {
      state.focus = null;
      byId("replay-title").scrollIntoView();
    }
  }

  // --- replay and trace economics -------------------------------------------------------
  const BODY_PREVIEW = 600;

  function failBox(id, error) {
    const box = byId(id);
    if (!box) return;
    box.dataset.state = "error";
    box.replaceChildren(h("div", { class: "note error", text: error.message }));
  }

  function bodyText(value) {
    if (value === null || value === undefined) return null;
    if (typeof value === "string") return value;
    if (Array.isArray(value) && value.length && value.every((m) => m && typeof m === "object" && !Array.isArray(m))) {
      return value.map((m) => `${m.role ?? "?"}: ${typeof m.content === "string" ? m.content : JSON.stringify(m.content ?? m)}`).join("\n");
    }
    return JSON.stringify(value, null, 2);
  }

  function bodyBlock(name, value, step) {
    const text = bodyText(value);
    const notes = [];
    if (step.truncated.includes(name)) notes.push("truncated at capture");
    if (step.missing.includes(name)) notes.push("no longer stored");
    const pre = h("pre", { class: "replay-text", "data-part": name });
    const block = h("div", { class: "replay-body" },
      h("span", { class: "part-name", text: name + (notes.length ? ` (${notes.join(", ")})` : "") }), pre);
    if (text === null) {
      pre.textContent = "— not captured";
      pre.classList.add("absent");
      return block;
    }
    const long = text.length > BODY_PREVIEW;
    pre.textContent = long ? `${text.slice(0, BODY_PREVIEW)}…` : text;
    if (long) {
      const more = h("button", { type: "button", class: "more", text: `show all ${text.length.toLocaleString()} characters`,
        onclick: () => {
          const open = pre.dataset.open === "1";
          pre.dataset.open = open ? "0" : "1";
          pre.textContent = open ? `${text.slice(0, BODY_PREVIEW)}…` : text;
          more.textContent = open ? `show all ${text.length.toLocaleString()} characters` : "show less";
        } });
      block.append(more);
    }
    return block;
  }

  function stepHead(step) {
    const bits = [`#${step.index}`, `step ${step.step}`];
    if (step.type === "llm") {
      const t = step.tokens;
      bits.push(`LLM · ${t.input.toLocaleString()} in / ${t.output.toLocaleString()} out` +
        (t.cache_read || t.cache_creation ? ` (cache read ${t.cache_read.toLocaleString()}, write ${t.cache_creation.toLocaleString()})` : ""),
      fmt(step.cost, "currencyUSD", 4));
    } else {
      bits.push(`tool ${step.tool}`);
    }
    bits.push(step.timed_out
      ? `timed out after ${fmt(step.latency_ms, "ms")}, true duration ${step.true_duration_ms === null ? "unknown" : fmt(step.true_duration_ms, "ms")}`
      : fmt(step.latency_ms, "ms"));
    return bits.join(" · ");
  }

  function drawReplay(body) {
    const box = byId("replay");
    if (!box) return;
    const cap = body.capture;
    const tone = { kept: "ok", pending: "warn", discarded: "bad" }[cap.status] || "warn";
    const head = h("div", { class: "replay-meta" },
      h("span", { class: `pill ${tone}`, "data-capture": cap.status, text: `capture ${cap.status}` }),
      h("span", { class: "alert-meta", text: `${cap.reason} · ${cap.parts} parts, ${cap.bytes.toLocaleString()} bytes` }),
      h("span", { class: "why" }, "CLI: ", h("code", { text: body.command }), " · re-drive: ",
        h("code", { text: `ReplaySession.load(reader, ${JSON.stringify(body.run_id)})` })));
    const steps = body.steps.map((step) => h("div", {
      class: `replay-step ${step.type}`, "data-index": step.index, "data-type": step.type,
    },
    h("div", { class: "replay-head", text: stepHead(step) }),
    ...(step.type === "llm"
      ? [bodyBlock("prompt", step.prompt, step), bodyBlock("response", step.response, step)]
      : [bodyBlock("args", step.args, step), bodyBlock("output", step.output, step)])));
    box.replaceChildren(head, steps.length ? h("div", { class: "replay-steps" }, steps)
      : h("div", { class: "empty", text: "No LLM or tool calls in this run." }));
    box.dataset.steps = String(body.steps.length);
    box.dataset.state = "ready";
  }

  function drawEconomics(body) {
    const box = byId("economics");
    if (!box) return;
    const cap = body.capture;
    // storage per run is often a tiny fraction of a cent: say how tiny
    const usd = (v, d) => (v > 0 && v < 1e-4 ? `$${v.toExponential(2)}` : fmt(v, "currencyUSD", d));
    const summary = h("p", { class: "econ-summary", text:
      `${body.agent}: ${body.runs} closed runs in the last 7 days · average run ${usd(body.avg_run_cost_usd, 4)}, ` +
      `${fmt(body.avg_run_seconds * 1000, "ms")} · capture keeps ${cap.kept_runs} runs, ` +
      `${Math.round(cap.stored_bytes_per_run).toLocaleString()} compressed bytes a run → ` +
      `${usd(cap.cost_per_run_usd, 8)} a run for ${body.rates.capture_retention_days} days ` +
      `(engineer ${usd(body.rates.engineer_usd_per_hour, 0)}/h, storage ${usd(body.rates.storage_usd_per_gb_month, 2)}/GiB-month)` });
    const columns = ["failure mode", "p", "runs to reproduce", "tokens", "engineer time",
      "reproduction tax", "p × tax (per run)", "capture (per run)", "verdict"];
    const rows = body.failure_modes.map((mode) => h("tr", { "data-outcome": mode.outcome },
      h("td", { text: mode.outcome }),
      h("td", { class: "num", text: fmt(mode.p, "percentunit", 1) }),
      h("td", { class: "num", text: fmt(Math.round(mode.expected_runs), "short") }),
      h("td", { class: "num", text: usd(mode.token_cost_usd, 2) }),
      h("td", { class: "num", text: usd(mode.engineer_cost_usd, 2) }),
      h("td", { class: "num", text: usd(mode.total_usd, 2) }),
      h("td", { class: "num", text: usd(mode.avoided_per_run_usd, 4) }),
      h("td", { class: "num", text: usd(cap.cost_per_run_usd, 8) }),
      h("td", { class: mode.worth_it ? "good" : "bad", text: mode.worth_it ? "capture pays" : "capture costs more" })));
    box.replaceChildren(summary, rows.length
      ? h("div", { class: "table-wrap" }, h("table", { class: "data" },
        h("thead", {}, h("tr", {}, columns.map((c, i) => h("th", { class: i > 0 && i < 8 ? "num" : null, text: c })))),
        h("tbody", {}, rows)))
      : h("div", { class: "empty", text: "No failures in this window: nothing to reproduce." }),
      h("p", { class: "why", text: `Worth it when ${body.verdict}: re-running until a failure mode recurs costs 1/p runs of tokens and of an engineer waiting.` }));
    box.dataset.modes = String(body.failure_modes.length);
    box.dataset.state = "ready";
  }

  // --- advice (detectors/advisors, docs/advisors.md) ------------------------------------
  function renderAdvice(main) {
    main.append(h("h2", { class: "section-title", text: "Advice: what to change, what it is worth" }),
      h("section", { class: "advice", id: "advice", "data-state": "loading" },
        h("div", { class: "note", text: "loading…" })));
  }

  async function loadAdvice(signal) {
    const agent = state.vars.agent || new URLSearchParams(location.hash.split("?")[1] || "").get("agent") || "";
    try {
      drawAdvice(await getJSON(`/api/advice?agent=${encodeURIComponent(agent)}`, signal));
    } catch (error) {
      if (!signal.aborted) failBox("advice", error);
    }
  }

  function drawAdvice(body) {
    const box = byId("advice");
    if (!box) return;
    state.adviceCharts = [];
    box.replaceChildren(...(body.findings.length ? body.findings.map(adviceCard)
      : [h("div", { class: "empty", text: "No finding worth raising in the window." })]));
    for (const draw of state.adviceCharts) draw();
    box.dataset.findings = String(body.findings.length);
    box.dataset.state = "ready";
  }

  function adviceCard(finding) {
    const saving = finding.saving_usd_per_day === null ? "no dollar figure"
      : `saves ${fmt(finding.saving_usd_per_day, "currencyUSD", 2)}/day`;
    const chart = h("div", { class: "advice-chart" });
    const card = h("section", { class: "panel advice-card", "data-kind": finding.kind,
      "data-agent": finding.agent, "data-subject": finding.subject },
      h("h3", { text: `${finding.kind} · ${finding.agent} / ${finding.subject}` }),
      h("p", { class: "saving", text: saving }),
      h("p", { class: "recommendation", text: finding.recommendation }),
      chart,
      h("details", {}, h("summary", { text: "evidence query" }),
        h("pre", { class: "sql", text: finding.query })));
    const ev = finding.evidence;
    if (finding.kind === "timeout") {
      state.adviceCharts.push(() => costCurve(chart, ev));
    } else if (finding.kind === "quadratic_context") {
      state.adviceCharts.push(() => prefillSlope(chart, ev.longest_run));
    } else if (finding.kind === "judge_agreement") {
      chart.append(confusionTable(ev));
    }
    return card;
  }

  function adviceChart(body, label, xs, series, xUnit, yUnit) {
    const opts = {
      width: Math.max(body.clientWidth, 280), height: 220, legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: false }, y: { range: (u, min, max) => [Math.min(0, min), max > 0 ? max * 1.1 : 1] } },
      axes: [axisStyle({ label, values: (u, splits) => splits.map((v) => fmt(v, xUnit, null)) }),
        axisStyle({ size: 64, values: (u, splits) => splits.map((v) => fmt(v, yUnit, null)) })],
      series: [{}].concat(series.map((s, i) => ({
        label: s.name, stroke: color(s.color || PALETTE[i % PALETTE.length]), width: s.line ? 2 : 0,
        points: { show: !s.line, size: 10 }, spanGaps: false,
      }))),
    };
    return new uPlot(opts, [xs].concat(series.map((s) => s.values)), body);
  }

  function costCurve(body, ev) {
    // cost(T) with today's T and the optimum marked (TMO)
    const xs = ev.cost_curve.map((p) => p[0]);
    const cost = ev.cost_curve.map((p) => p[1]);
    const mark = (t) => xs.map((x, i) => (x === t ? cost[i] : null));
    adviceChart(body, "timeout", xs, [
      { name: "expected cost per call", values: cost, line: true },
      { name: "today's timeout", values: mark(ev.timeout_ms), color: "red" },
      { name: "recommended", values: mark(ev.recommended_timeout_ms), color: "green" },
    ], "ms", "currencyUSD");
  }

  function prefillSlope(body, run) {
    // prefill tokens per step as fitted, and with digests (QUAD)
    const xs = Array.from({ length: run.calls }, (_, k) => k);
    adviceChart(body, "step", xs, [
      { name: "prefill (fitted)", values: xs.map((k) => run.intercept_tokens + run.slope_tokens_per_step * k), line: true },
      { name: "with digests", values: xs.map((k) => run.intercept_tokens + run.digest_slope_tokens_per_step * k), line: true, color: "green" },
    ], "short", "short");
  }

  function confusionTable(ev) {
    const c = ev.confusion;
    return h("table", { class: "data confusion" },
      h("thead", {}, h("tr", {}, h("th", { text: "" }), h("th", { class: "num", text: "human pass" }),
        h("th", { class: "num", text: "human fail" }))),
      h("tbody", {},
        h("tr", {}, h("th", { text: "judge pass" }), h("td", { class: "num", text: String(c.judge_pass.human_pass) }),
          h("td", { class: "num", text: String(c.judge_pass.human_fail) })),
        h("tr", {}, h("th", { text: "judge fail" }), h("td", { class: "num", text: String(c.judge_fail.human_pass) }),
          h("td", { class: "num", text: String(c.judge_fail.human_fail) }))),
      h("caption", { text: `kappa ${ev.kappa.toFixed(2)} · agreement ${fmt(ev.agreement, "percentunit", 0)} · always-pass ${fmt(ev.always_pass_agreement, "percentunit", 0)}, kappa 0` }));
  }

  function drawRunSummary(data) {
    const meta = state.panels.run_summary;
    const row = data.rows[0];
    const record = Object.fromEntries(data.columns.map((c, i) => [c, row[i]]));
    const outcome = record.status === "running" ? "running" : record.outcome;
    // replaceChildren, unlike h(), writes a null child out as the text "null"
    byId("run-title").replaceChildren(...[
      h("h2", { text: record.run_id }),
      h("span", { class: "pill", style: { color: color(meta.colors[outcome] || "text") },
        text: outcome || record.status }),
      record.loop_detected ? h("span", { class: "pill bad", text: "loop detected" }) : null,
      h("span", { class: "alert-meta", text: `${record.agent} · ${record.task_type || "no task type"}` }),
      h("a", { href: "#replay-title", class: "replay-link",
        onclick: (event) => { event.preventDefault(); byId("replay-title").scrollIntoView(); },
        text: "▶ replay" })].filter((child) => child !== null));
    const skip = new Set(["run_id", "loop_detected"]);
    byId("run-kv").replaceChildren(...data.columns.filter((c) => !skip.has(c)).map((column, i) => {
      const index = data.columns.indexOf(column);
      const value = row[index];
      const long = column === "loop_summary";
      return h("div", {}, h("dt", { text: meta.titles[meta.columns.indexOf(column)] || column }),
        h("dd", { class: long ? "long" : null, title: value === null ? "" : String(value),
          text: fmt(value, meta.column_units[column], column === "cost_usd" ? 4 : null) }));
    }));
    return record.agent;
  }

  // --- alerts and their playbooks -------------------------------------------------------
  async function loadAlerts(signal) {
    let alerts = [];
    try {
      alerts = (await getJSON(`/api/alerts?${queryString()}`, signal)).alerts;
    } catch (error) {
      if (signal.aborted) return;
      byId("status").replaceChildren(h("span", { class: "pill warn", text: "alerts unavailable" }));
      return;
    }
    const critical = alerts.filter((a) => a.severity === "critical").length;
    byId("status").replaceChildren(alerts.length === 0
      ? h("span", { class: "pill ok", text: "all clear" })
      : h("a", { href: "#/realtime", class: `pill ${critical ? "bad" : "warn"}`,
        text: `${alerts.length} firing${critical ? ` · ${critical} critical` : ""}` }));
    if (state.views.firing_alerts) state.views.firing_alerts.drawAlerts(alerts);
  }

  function alertCard(alert) {
    const book = alert.playbook_detail;
    const details = h("div", { class: "playbook", hidden: true });
    if (book) {
      details.append(
        h("h4", { text: `Playbook: ${book.title}` }),
        h("div", { class: "why", text: book.summary }),
        h("ol", {}, ...book.steps.map((step) => h("li", {},
          h("strong", { text: step.title }), " — ", h("span", { class: "why", text: step.why }),
          step.action ? h("div", { text: `Action: ${step.action}` }) : null))),
        h("h4", { text: "Mitigation" }),
        h("ul", {}, ...book.mitigation.map((item) => h("li", { text: item }))),
        h("div", { class: "why" }, "Run its queries: ",
          h("code", { text: `loopwatch playbook ${alert.playbook}${alert.agent ? ` --agent ${alert.agent}` : ""}` })));
    } else {
      details.append(h("div", { class: "why", text: alert.playbook
        ? `Playbook ${alert.playbook}: loopwatch playbook ${alert.playbook}` : "No playbook attached." }));
    }
    const toggle = h("button", { type: "button", text: "Playbook ▸",
      onclick: () => {
        details.hidden = !details.hidden;
        toggle.textContent = details.hidden ? "Playbook ▸" : "Playbook ▾";
      } });
    const meta = [alert.rule, alert.agent ? `agent ${alert.agent}` : null,
      alert.fired_at ? `fired ${ago(alert.fired_at)}` : null].filter(Boolean).join(" · ");
    return h("div", { class: `alert ${alert.severity}`, "data-rule": alert.rule },
      h("div", { class: "alert-head" },
        h("span", { class: "sev", text: alert.severity }),
        h("span", { class: "alert-summary", text: alert.summary }),
        h("span", { class: "alert-actions" },
          alert.run_id ? h("a", { href: `#/run/${encodeURIComponent(alert.run_id)}` },
            h("button", { type: "button", text: "Open run" })) : null,
          alert.run_id ? h("a", { href: `#/replay/${encodeURIComponent(alert.run_id)}`, class: "replay-link" },
            h("button", { type: "button", text: "Replay" })) : null,
          toggle)),
      h("div", { class: "alert-meta", text: meta }),
      details);
  }

  // --- one panel ------------------------------------------------------------------------
  function panelView(meta, inRun) {
    const body = h("div", { class: "panel-body" });
    const sql = h("pre", { class: "sql", hidden: true, text: meta.sql });
    const el = h("section", {
      class: "panel", "data-panel": meta.id, "data-viz": meta.viz, "data-state": "loading",
      style: { gridColumn: `span ${meta.width}` },
    },
    h("div", { class: "panel-head" }, h("h3", { text: meta.title }),
      h("button", { type: "button", class: "sql-toggle", title: "Show this panel's SQL (as Grafana runs it)",
        text: "SQL", onclick: () => { sql.hidden = !sql.hidden; } })),
    h("p", { class: "panel-desc", title: meta.description, text: meta.description }),
    sql, body);
    const fixed = (meta.viz === "table" || meta.viz === "stat") && meta.id !== "firing_alerts";
    const height = Math.max(meta.height * (fixed ? ROW_PX : CHART_ROW_PX) - 58, 70);
    if (fixed) Object.assign(body.style, { height: `${height}px`, flex: "none" });
    else body.classList.add("chart");
    let chart = null;
    let last = null;
    const view = {
      el,
      destroy() { if (chart) chart.destroy(); chart = null; },
      resize() { if (last) view.draw(last); },
      fail(error) {
        view.destroy();
        el.dataset.state = "error";
        body.replaceChildren(h("div", { class: "note error", text: error.message }));
      },
      drawAlerts(alerts) {
        el.dataset.points = String(alerts.length);
        el.dataset.state = "ready";
        body.replaceChildren(h("div", { class: "alerts" }, alerts.length === 0
          ? h("div", { class: "allclear", text: "No alerts firing." })
          : alerts.map(alertCard)));
      },
      draw(data) {
        last = data;
        view.destroy();
        const points = countPoints(meta, data);
        el.dataset.points = String(points);
        el.dataset.state = points > 0 ? "ready" : "empty";
        if (points === 0) {
          body.replaceChildren(h("div", { class: "empty", style: { height: `${height}px` },
            text: meta.needs_run ? "Nothing for this run." : "No data in this range." }));
          return;
        }
        if (meta.viz === "timeseries" || meta.viz === "bars") chart = drawTimeSeries(body, meta, data, height);
        else if (meta.viz === "barchart") chart = drawBarChart(body, meta, data, height);
        else if (meta.viz === "stat") drawStat(body, meta, data, inRun);
        else drawTable(body, meta, data);
      },
    };
    return view;
  }

  function countPoints(meta, data) {
    if (meta.viz === "timeseries" || meta.viz === "bars") {
      return data.series.reduce((n, s) => n + s.values.filter((v) => v !== null).length, 0);
    }
    return data.rows.length;
  }

  function drawStat(body, meta, data, compact) {
    const row = data.rows[0] || [];
    const stats = data.columns.map((column, i) => {
      const unit = meta.column_units[column];
      const value = row[i];
      return h("div", { class: "stat" },
        h("span", { class: "value", style: { color: thresholdColor(meta.thresholds, value) },
          text: fmt(value, unit, unit === "percentunit" || unit === "currencyUSD" ? meta.decimals : null) }),
        h("span", { class: "label", text: meta.titles[meta.columns.indexOf(column)] || column }));
    });
    body.replaceChildren(h("div", { class: `stats${compact ? " compact" : ""}` }, stats));
  }

  function drawTable(body, meta, data) {
    const units = meta.column_units;
    const numeric = data.columns.map((_, i) => data.rows.some((r) => typeof r[i] === "number"));
    const head = h("tr", {}, data.columns.map((column, i) =>
      h("th", { class: numeric[i] ? "num" : null, text: meta.titles[meta.columns.indexOf(column)] || column })));
    const rows = data.rows.map((row) => {
      let hot = false;
      const cells = row.map((value, i) => {
        const column = data.columns[i];
        const cell = h("td", { class: numeric[i] ? "num" : null });
        if (column === "run_id" && meta.links_run_id && value) {
          cell.append(h("a", { class: "mono", href: `#/run/${encodeURIComponent(value)}`, text: value }),
            " ", h("a", { class: "replay-link", href: `#/replay/${encodeURIComponent(value)}`,
              title: "replay this run", text: "▶" }));
        } else if (column === "payload") {
          cell.className = "payload";
          cell.append(h("code", { text: value, title: "click to expand" }));
          cell.addEventListener("click", () => cell.classList.toggle("open"));
        } else if (meta.color_columns.includes(column) && meta.colors[value]) {
          cell.append(h("span", { class: "cell-pill", style: { color: color(meta.colors[value]) }, text: value }));
        } else {
          const text = fmt(value, units[column], null);
          if (meta.threshold_columns.includes(column) && typeof value === "number") {
            const tint = thresholdColor(meta.thresholds, value);
            if (tint !== color("text")) { hot = true; cell.style.color = tint; cell.style.fontWeight = "700"; }
          }
          cell.textContent = text;
          if (column === "summary" || column === "loop_summary") cell.classList.add("wrap");
          if (column === "args_hash" || column === "event_id") cell.classList.add("mono");
        }
        return cell;
      });
      return h("tr", { class: hot ? "hot" : null }, cells);
    });
    body.replaceChildren(h("div", { class: "table-wrap" },
      h("table", { class: "data" }, h("thead", {}, head), h("tbody", {}, rows))));
  }

  // --- charts ---------------------------------------------------------------------------
  function axisStyle(extra) {
    return Object.assign({
      stroke: "#8b93a1", grid: { stroke: "#232833", width: 1 }, ticks: { stroke: "#232833", width: 1 },
      font: "11px system-ui, sans-serif",
    }, extra);
  }

  function overlayHook(meta, annotations) {
    return (u) => {
      const ctx = u.ctx;
      const { left, top, width, height } = u.bbox;
      ctx.save();
      ctx.lineWidth = Math.max(1, devicePixelRatio);
      if (meta.threshold_lines) {
        ctx.setLineDash([6 * devicePixelRatio, 5 * devicePixelRatio]);
        for (const step of meta.thresholds) {
          if (step.value === null) continue;
          const y = u.valToPos(step.value, "y", true);
          if (y < top || y > top + height) continue;
          ctx.strokeStyle = color(step.color);
          ctx.globalAlpha = 0.7;
          ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + width, y); ctx.stroke();
        }
      }
      ctx.globalAlpha = 0.85;
      ctx.setLineDash([3 * devicePixelRatio, 3 * devicePixelRatio]);
      ctx.strokeStyle = state.catalog.annotation.color;
      for (const marker of u.over.querySelectorAll(".ann-marker")) marker.remove();
      for (const ann of annotations) {
        const x = u.valToPos(ann.time, "x", true);
        if (x < left || x > left + width) continue;
        ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
        u.over.append(h("div", { class: "ann-marker", title: `${fmtTime(ann.time)}  ${ann.text}`,
          style: { left: `${u.valToPos(ann.time, "x")}px` } }));
      }
      ctx.restore();
    };
  }

  function lastValue(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
    return null;
  }

  function timeTicks(u, splits, axisIdx, space, incr) {
    const span = u.scales.x.max - u.scales.x.min;
    const pad = (n) => String(n).padStart(2, "0");
    return splits.map((v) => {
      const d = new Date(v * 1000);
      const day = `${MONTHS[d.getMonth()]} ${d.getDate()}`;
      const clock = `${pad(d.getHours())}:${pad(d.getMinutes())}`;
      if (span <= 86400 * 1.5) return clock;
      return incr >= 86400 ? day : `${day} ${clock}`;
    });
  }

  function fitLegend(u, body, height) {
    // The legend's height is only final once the page has laid it out: fit now, and
    // again on the next frame, so the chart plus its legend fill the panel.
    const fit = () => {
      if (!body.contains(u.root)) return;  // redrawn or navigated away meanwhile
      const legend = body.querySelector(".u-legend");
      const extra = legend ? legend.offsetHeight : 0;
      u.setSize({ width: Math.max(body.clientWidth, 200), height: Math.max(height - extra, 90) });
    };
    fit();
    requestAnimationFrame(fit);
  }

  // Points only where a value stands alone (no value either side): a line needs two,
  // so a single bucket, or one between gaps, would otherwise draw nothing.
  function isolatedPoints(u, seriesIdx) {
    const ys = u.data[seriesIdx];
    const found = [];
    for (let i = 0; i < ys.length; i++) {
      if (ys[i] !== null && ys[i] !== undefined && (i === 0 || ys[i - 1] == null) &&
          (i === ys.length - 1 || ys[i + 1] == null)) found.push(i);
    }
    return found.length ? found : null;
  }

  function drawTimeSeries(body, meta, data, height) {
    body.replaceChildren();
    const stacked = meta.viz === "bars";
    let series = data.series.map((s, i) => Object.assign({}, s, { color: s.color || PALETTE[i % PALETTE.length] }));
    let ys = series.map((s) => s.values);
    if (stacked) {
      const total = data.x.map(() => 0);
      ys = series.map((s) => s.values.map((v, j) => (total[j] += v || 0)));
      series = series.slice().reverse();
      ys = ys.slice().reverse();
    }
    const raw = series.map((s) => s.values);
    const unit = meta.unit;
    const half = (data.interval_s || 60) / 2;
    const opts = {
      width: Math.max(body.clientWidth, 200),
      height,
      cursor: { sync: { key: "loopwatch" }, points: { size: 6 }, drag: { x: false, y: false } },
      legend: { live: true },
      scales: {
        // The requested window, as Grafana does: a lone bucket has no span of its own.
        x: { time: true, range: () => (stacked ? [data.from - half, data.to + half] : [data.from, data.to]) },
        y: { range: (u, min, max) => [Math.min(0, min), max > 0 ? max * 1.1 : 1] },
      },
      axes: [
        axisStyle({ values: timeTicks, space: (u, ax, min, max) => (max - min > 129600 ? 110 : 60) }),
        axisStyle({ size: 64, values: (u, splits) => splits.map((v) => fmt(v, unit, null)) }),
      ],
      series: [{ value: (u, v) => (v === null ? "now" : fmtTime(v)) }].concat(series.map((s, i) => ({
        label: s.name,
        stroke: color(s.color),
        width: stacked ? 0 : 2,
        fill: stacked ? color(s.color) : undefined,
        dash: s.dashed ? [8, 6] : undefined,
        points: stacked ? { show: false } : { show: false, filter: isolatedPoints },
        spanGaps: false,
        paths: stacked ? uPlot.paths.bars({ size: [0.8, 48], gap: 1 }) : undefined,
        value: (u, v, si, idx) => fmt(idx === null ? lastValue(raw[i]) : raw[i][idx], unit, meta.decimals),
      }))),
      hooks: { draw: [overlayHook(meta, state.annotations)] },
    };
    const chart = new uPlot(opts, [data.x].concat(ys), body);
    fitLegend(chart, body, height);
    return chart;
  }

  function drawBarChart(body, meta, data, height) {
    body.replaceChildren();
    const labels = data.rows.map((row) => String(row[0]));
    const xs = labels.map((_, i) => i);
    const valueColumns = data.columns.slice(1);
    const opts = {
      width: Math.max(body.clientWidth, 200),
      height,
      cursor: { points: { show: false }, drag: { x: false, y: false } },
      legend: { show: valueColumns.length > 1, live: true },
      scales: {
        x: { time: false, range: () => [-0.6, labels.length - 0.4] },
        y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
      },
      axes: [
        axisStyle({ splits: () => xs, values: (u, splits) => splits.map((i) => labels[i] ?? ""), grid: { show: false } }),
        axisStyle({ size: 64, values: (u, splits) => splits.map((v) => fmt(v, meta.column_units[valueColumns[0]], null)) }),
      ],
      series: [{ value: (u, v) => (v === null ? "" : labels[v] ?? "") }].concat(valueColumns.map((column, i) => ({
        label: meta.titles[meta.columns.indexOf(column)] || column,
        stroke: color(meta.colors[column] || PALETTE[i]),
        fill: color(meta.colors[column] || PALETTE[i]),
        width: 0,
        points: { show: false },
        paths: uPlot.paths.bars({ size: [0.7, 60], gap: 2 }),
        value: (u, v) => fmt(v, meta.column_units[column], meta.decimals),
      }))),
    };
    const ys = valueColumns.map((_, i) => data.rows.map((row) => (typeof row[i + 1] === "number" ? row[i + 1] : null)));
    const chart = new uPlot(opts, [xs].concat(ys), body);
    fitLegend(chart, body, height);
    return chart;
  }

  // --- start ----------------------------------------------------------------------------
  async function start() {
    try {
      state.catalog = await getJSON("/api/panels");
    } catch (error) {
      byId("main").replaceChildren(h("div", { class: "note error", text: `Cannot reach loopwatch: ${error.message}` }));
      return;
    }
    for (const panel of state.catalog.panels) state.panels[panel.id] = panel;
    for (const tier of state.catalog.tiers) state.tiers[tier.id] = tier;
    try {
      state.options = await getJSON("/api/variables");
    } catch (error) {
      state.options = {};
    }
    buildChrome();
    render();
  }

  start();
})();
