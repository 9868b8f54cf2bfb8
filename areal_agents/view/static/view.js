// areal-agent view: live updates, charts (plotly), keyboard navigation, token hover.
"use strict";
const areal = (() => {
  const POLL_MS = 3000;
  const fmt = (v) => {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (Number.isInteger(v)) return String(v);
    const a = Math.abs(v);
    return (a !== 0 && (a >= 1e5 || a < 1e-3)) ? v.toPrecision(3) : v.toFixed(3);
  };
  const getJSON = async (url) => {
    const r = await fetch(url, { headers: { Accept: "application/json" } });
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  };
  const showLive = (on) => { const el = document.getElementById("live"); if (el) el.hidden = !on; };

  // -- runs page: status, steps and latest metrics refresh in place while a run trains;
  // with nothing training, only a watched runs/ directory is looked at now and then (for
  // runs started later); otherwise the page does not poll at all
  const WATCH_MS = 30000;
  function liveRuns(live, watching) {
    if (!live && !watching) return;
    const tick = async () => {
      let training = false;
      try {
        const data = await getJSON("/api/runs");
        const known = new Set();
        for (const r of data.runs) {
          known.add(r.name);
          training = training || r.state === "training";
          const row = document.querySelector(`tr.run[data-run="${CSS.escape(r.name)}"]`);
          if (!row) continue;
          const st = row.querySelector("td.status .badge");
          st.textContent = r.state; st.className = "badge " + r.state;
          const why = row.querySelector("td.status .reason");
          if (why) why.textContent = r.reason || (r.phase ? "running: " + r.phase.replace(/_/g, " ") : "");
          row.querySelector("td.steps").textContent = r.steps + (r.target_steps ? " / " + r.target_steps : "");
          for (const cell of row.querySelectorAll("td[data-key]")) cell.textContent = fmt(r.latest[cell.dataset.key]);
        }
        const shown = document.querySelectorAll("tr.run").length;
        if (known.size > shown) { location.reload(); return; }  // a new run appeared
      } catch (e) { training = live; /* the server is gone or busy: try again */ }
      showLive(training);
      const next = training ? POLL_MS : (watching ? WATCH_MS : 0);
      if (next) setTimeout(tick, next);
    };
    setTimeout(tick, live ? POLL_MS : WATCH_MS);
  }

  // -- dashboard
  const COLORS = ["#2f5bd3", "#e4572e", "#17a673", "#a23bdc", "#f0a202", "#1f9fb4", "#7a5c3e", "#d6336c"];
  // the staleness heatmap: zero tokens is empty (white), more tokens darker blue
  const COUNT_SCALE = [[0, "#ffffff"], [0.02, "#deebf7"], [0.35, "#9ecae1"], [0.7, "#4292c6"], [1, "#08306b"]];
  function seriesOf(spec, names) {
    const out = [];
    for (const s of spec) {
      if (s.endsWith("*")) {
        const prefix = s.slice(0, -1);
        for (const n of [...names].sort()) if (n.startsWith(prefix)) out.push(n);
      } else if (s === "histograms.staleness" || names.has(s)) out.push(s);
    }
    return out;
  }
  // Series of very different scale (say 1e-3 and 1) on one axis draw the small ones flat:
  // split the series at the largest gap between their scales (over 10x) and put the group
  // of the first series on the left axis, the other on a right one.
  function rightAxis(series, datasets) {
    const scale = new Map();
    for (const s of series) {
      let m = 0;
      for (const rows of datasets) for (const r of rows) if (typeof r[s] === "number" && Number.isFinite(r[s])) m = Math.max(m, Math.abs(r[s]));
      if (m > 0) scale.set(s, Math.log10(m));
    }
    const sorted = [...scale.entries()].sort((a, b) => a[1] - b[1]);
    let gap = 1, at = -1;  // at least one decade apart
    for (let i = 1; i < sorted.length; i++) {
      if (sorted[i][1] - sorted[i - 1][1] > gap) { gap = sorted[i][1] - sorted[i - 1][1]; at = i; }
    }
    if (at < 0) return new Set();
    const low = new Set(sorted.slice(0, at).map((e) => e[0]));
    const high = new Set(sorted.slice(at).map((e) => e[0]));
    const first = series.find((s) => scale.has(s));
    return low.has(first) ? high : low;
  }
  function tracesFor(runName, rows, spec, xkey, runIndex, overlaid, right, unit) {
    const names = new Set();
    for (const r of rows) for (const k in r) if (typeof r[k] === "number") names.add(k);
    const traces = [];
    const series = seriesOf(spec, names);
    series.forEach((s, j) => {
      if (s === "histograms.staleness") {
        const values = new Set();
        for (const r of rows) for (const v in ((r.histograms || {}).staleness || {})) values.add(Number(v));
        if (!values.size) return;
        const ys = [...values].sort((a, b) => a - b);
        const z = ys.map((y) => rows.map((r) => (((r.histograms || {}).staleness || {})[String(y)] || null)));
        const what = unit || "tokens";
        traces.push({ type: "heatmap", x: rows.map((r) => r[xkey]), y: ys, z, zmin: 0, zauto: false,
          zmax: Math.max(1, ...z.flat().filter((v) => v !== null)), colorscale: COUNT_SCALE, hoverongaps: false,
          name: overlaid ? `${runName}: ${what} by lag` : `${what} by lag`, showscale: runIndex === 0, showlegend: false,
          hovertemplate: `${xkey === "step" ? "step" : "s"} %{x}<br>%{y} versions behind<br>%{z} ${what}<extra></extra>`,
          colorbar: { title: { text: what, side: "right" }, thickness: 10, tickformat: "~s" } });
        return;
      }
      const pts = rows.filter((r) => typeof r[s] === "number");
      if (!pts.length) return;
      const onRight = right.has(s);
      const label = s + (onRight ? " (right axis)" : "");
      traces.push({ type: "scatter", mode: pts.length > 40 ? "lines" : "lines+markers",
        name: overlaid ? `${runName}: ${label}` : label, x: pts.map((r) => r[xkey]), y: pts.map((r) => r[s]),
        yaxis: onRight ? "y2" : "y",
        line: { color: COLORS[(overlaid ? runIndex * series.length + j : j) % COLORS.length], width: 2, dash: runIndex ? "dot" : "solid" },
        marker: { size: 5 } });
    });
    return traces;
  }
  const STAGE_SPEC = ["success_rate", "mean_reward", "mean_turns"];
  function dashboard(run, overlay, live) {
    const xsel = document.getElementById("xaxis");
    const osel = document.getElementById("overlay");
    const charts = [...document.querySelectorAll("div.chart[data-metric]")];
    // the legend sits above the plot, clear of the x axis and its title; a single series
    // still names itself there; few steps: one tick per step (an automatic 0.5 spacing
    // would print "0 1 1 2 2")
    const layout = (el, xkey, last, traces, right) => {
      const width = el.clientWidth || 400;
      const named = traces.filter((t) => t.showlegend !== false);
      const chars = named.reduce((n, t) => n + String(t.name).length + 5, 0);
      const rows = named.length ? Math.max(1, Math.ceil((chars * 6.5) / Math.max(200, width - 40))) : 0;
      const height = 260 + Math.max(0, rows - 1) * 18;
      const heat = traces.some((t) => t.type === "heatmap");
      const stages = el.dataset.metric === "held_out";
      const lags = heat ? traces.flatMap((t) => t.y) : [];
      const span = lags.length ? Math.max(...lags) - Math.min(...lags) : 0;
      // the top margin holds the legend's rows, and above them the mode bar's
      const out = { margin: { l: 52, r: right.size || heat ? 56 : 16, t: 30 + rows * 18, b: 40 }, height, autosize: true,
        xaxis: stages ? { type: "category", automargin: true }
          : { title: { text: xkey === "step" ? "step" : "seconds", standoff: 6 }, zeroline: false, automargin: true,
            tickformat: xkey === "step" ? "d" : "", rangemode: "tozero",
            ...(xkey === "step" && last <= 12 ? { dtick: 1 } : {}) },
        yaxis: heat ? { title: { text: "versions behind" }, tickformat: "d", dtick: Math.max(1, Math.ceil(span / 8)), zeroline: false, automargin: true }
          : { zeroline: false, exponentformat: "e", automargin: true },
        showlegend: named.length > 0,
        legend: { orientation: "h", x: 0, xanchor: "left", y: 1, yanchor: "bottom", font: { size: 11 } },
        font: { size: 11 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" };
      if (right.size) out.yaxis2 = { overlaying: "y", side: "right", showgrid: false, zeroline: false, exponentformat: "e", automargin: true };
      return out;
    };
    const draw = async () => {
      const xkey = xsel ? xsel.value : "step";
      const names = [run, ...(osel ? [...osel.selectedOptions].map((o) => o.value) : overlay)];
      const data = await Promise.all(names.map((n) => getJSON(`/api/runs/${encodeURIComponent(n)}/metrics`)));
      const last = Math.max(0, ...data.flatMap((d) => d.rows.map((r) => r.step || 0)));
      for (const el of charts) {
        const stages = el.dataset.metric === "held_out";
        const spec = stages ? STAGE_SPEC : JSON.parse(el.dataset.series);
        const sets = data.map((d) => (stages ? d.held_out || [] : d.rows));
        const right = rightAxis(spec, sets);
        const traces = data.flatMap((d, i) => tracesFor(d.name, sets[i], spec, stages ? "name" : xkey, i,
          names.length > 1, right, el.dataset.unit));
        if (!traces.length) {
          if (el.dataset.drawn) Plotly.purge(el);
          el.innerHTML = '<div class="empty">not recorded in this run</div>';
          delete el.dataset.drawn;
          continue;
        }
        if (!el.dataset.drawn) el.innerHTML = "";
        const lay = layout(el, xkey, last, traces, right);
        el.style.height = lay.height + "px";
        Plotly.react(el, traces, lay, { displaylogo: false, responsive: true,
          modeBarButtonsToRemove: ["lasso2d", "select2d"] });
        el.dataset.drawn = "1";
      }
      return data[0].state;
    };
    // a run that trains is polled for new steps until it stops; any other is drawn once
    const poll = async () => {
      let state = "training";
      try { state = await draw(); } catch (e) { /* the server is busy: try again */ }
      showLive(state === "training");
      if (state === "training") setTimeout(poll, POLL_MS * 2);
    };
    if (live) poll(); else draw();
    if (xsel) xsel.addEventListener("change", draw);
    if (osel) osel.addEventListener("change", () => {
      const chosen = [...osel.selectedOptions].map((o) => o.value);
      const u = new URL(location.href);
      if (chosen.length) u.searchParams.set("overlay", chosen.join(",")); else u.searchParams.delete("overlay");
      history.replaceState(null, "", u);
      draw();
    });
  }

  // -- episode browser: j/k/Enter, "/" to search
  function episodeKeys() {
    const rows = () => [...document.querySelectorAll("tr.episode")];
    let i = -1;
    const select = (k) => {
      const rs = rows();
      if (!rs.length) return;
      i = Math.max(0, Math.min(rs.length - 1, k));
      rs.forEach((r) => r.classList.remove("selected"));
      rs[i].classList.add("selected");
      rs[i].setAttribute("aria-selected", "true");
      rs[i].focus({ preventScroll: true });
      rs[i].scrollIntoView({ block: "nearest" });
    };
    document.addEventListener("keydown", (e) => {
      const t = e.target;
      if (t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA")) return;
      if (e.key === "j" || e.key === "ArrowDown") { select(i + 1); e.preventDefault(); }
      else if (e.key === "k" || e.key === "ArrowUp") { select(i - 1); e.preventDefault(); }
      else if (e.key === "Enter" && i >= 0) {
        const a = rows()[i].querySelector("a.episode-link");
        if (a) location.href = a.href;
      } else if (e.key === "/") {
        const q = document.querySelector('#filters input[name="q"]');
        if (q) { q.focus(); e.preventDefault(); }
      }
    });
    for (const r of rows()) r.addEventListener("click", (e) => { if (e.target.tagName !== "A") select(rows().indexOf(r)); });
  }
  function watchCount() {
    const table = document.getElementById("episodes");
    if (!table) return;
    const shown = Number(table.dataset.total);
    const note = document.getElementById("new-episodes");
    setInterval(async () => {
      try {
        const d = await getJSON(table.dataset.countUrl);
        if (d.total > shown) {
          note.hidden = false;
          note.innerHTML = `<a href="">${d.total - shown} new episode${d.total - shown === 1 ? "" : "s"}: reload</a>`;
          showLive(true);
        }
      } catch (e) { /* try again */ }
    }, POLL_MS * 2);
  }

  // -- token view: the hovered or focused token's details under the tokens
  function tokenHover() {
    const info = document.getElementById("hover-info");
    const show = (e) => {
      const t = e.target.closest(".tok");
      if (t && info) info.textContent = t.title;
    };
    document.addEventListener("mouseover", show);
    document.addEventListener("focusin", show);
  }

  return { liveRuns, dashboard, episodeKeys, watchCount, tokenHover };
})();
