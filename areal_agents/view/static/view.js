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

  // -- runs page: status, steps and latest metrics refresh in place
  function liveRuns() {
    const tick = async () => {
      try {
        const data = await getJSON("/api/runs");
        let training = false;
        const known = new Set();
        for (const r of data.runs) {
          known.add(r.name);
          training = training || r.state === "training";
          const row = document.querySelector(`tr.run[data-run="${CSS.escape(r.name)}"]`);
          if (!row) continue;
          const st = row.querySelector("td.status .badge");
          st.textContent = r.state; st.className = "badge " + r.state;
          row.querySelector("td.steps").textContent = r.steps + (r.target_steps ? " / " + r.target_steps : "");
          for (const cell of row.querySelectorAll("td[data-key]")) cell.textContent = fmt(r.latest[cell.dataset.key]);
        }
        const shown = document.querySelectorAll("tr.run").length;
        if (known.size > shown) location.reload();  // a new run appeared
        showLive(training);
      } catch (e) { /* the server is gone or busy: try again */ }
    };
    setInterval(tick, POLL_MS);
  }

  // -- dashboard
  const COLORS = ["#2f5bd3", "#e4572e", "#17a673", "#a23bdc", "#f0a202", "#1f9fb4", "#7a5c3e", "#d6336c"];
  function seriesOf(spec, names) {
    const out = [];
    for (const s of spec) {
      if (s.endsWith("*")) {
        const prefix = s.slice(0, -1);
        for (const n of names) if (n.startsWith(prefix)) out.push(n);
      } else if (s === "histograms.staleness" || names.has(s)) out.push(s);
    }
    return out;
  }
  function tracesFor(runName, rows, spec, xkey, runIndex, overlaid) {
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
        const z = ys.map((y) => rows.map((r) => (((r.histograms || {}).staleness || {})[String(y)] || 0)));
        traces.push({ type: "heatmap", x: rows.map((r) => r[xkey]), y: ys, z, colorscale: "Blues",
          name: runName, showscale: runIndex === 0, hovertemplate: "x %{x}<br>staleness %{y}<br>%{z} episodes<extra></extra>",
          colorbar: { title: { text: "episodes" }, thickness: 10 } });
        return;
      }
      const pts = rows.filter((r) => typeof r[s] === "number");
      if (!pts.length) return;
      traces.push({ type: "scatter", mode: pts.length > 40 ? "lines" : "lines+markers",
        name: overlaid ? `${runName}: ${s}` : s, x: pts.map((r) => r[xkey]), y: pts.map((r) => r[s]),
        line: { color: COLORS[(overlaid ? runIndex * series.length + j : j) % COLORS.length], width: 2, dash: runIndex ? "dot" : "solid" },
        marker: { size: 5 } });
    });
    return traces;
  }
  function dashboard(run, overlay, live) {
    const xsel = document.getElementById("xaxis");
    const osel = document.getElementById("overlay");
    const charts = [...document.querySelectorAll("div.chart[data-metric]")];
    // few steps: one tick per step (an automatic 0.5 spacing would print "0 1 1 2 2")
    const layout = (xkey, last) => ({ margin: { l: 48, r: 12, t: 8, b: 36 }, height: 240,
      xaxis: { title: { text: xkey === "step" ? "step" : "seconds" }, zeroline: false,
        tickformat: xkey === "step" ? "d" : "", rangemode: "tozero",
        ...(xkey === "step" && last <= 12 ? { dtick: 1 } : {}) },
      yaxis: { zeroline: false, exponentformat: "e" }, legend: { orientation: "h", y: -0.25, font: { size: 11 } },
      font: { size: 11 }, paper_bgcolor: "#fff", plot_bgcolor: "#fff" });
    const draw = async () => {
      const xkey = xsel ? xsel.value : "step";
      const names = [run, ...(osel ? [...osel.selectedOptions].map((o) => o.value) : overlay)];
      const data = await Promise.all(names.map((n) => getJSON(`/api/runs/${encodeURIComponent(n)}/metrics`)));
      const last = Math.max(0, ...data.flatMap((d) => d.rows.map((r) => r.step || 0)));
      for (const el of charts) {
        const spec = JSON.parse(el.dataset.series);
        const traces = data.flatMap((d, i) => tracesFor(d.name, d.rows, spec, xkey, i, names.length > 1));
        if (!traces.length) {
          if (el.dataset.drawn) Plotly.purge(el);
          el.innerHTML = '<div class="empty">not recorded in this run</div>';
          delete el.dataset.drawn;
          continue;
        }
        if (!el.dataset.drawn) el.innerHTML = "";
        Plotly.react(el, traces, layout(xkey, last), { displaylogo: false, responsive: true,
          modeBarButtonsToRemove: ["lasso2d", "select2d"] });
        el.dataset.drawn = "1";
      }
    };
    draw();
    if (xsel) xsel.addEventListener("change", draw);
    if (osel) osel.addEventListener("change", () => {
      const chosen = [...osel.selectedOptions].map((o) => o.value);
      const u = new URL(location.href);
      if (chosen.length) u.searchParams.set("overlay", chosen.join(",")); else u.searchParams.delete("overlay");
      history.replaceState(null, "", u);
      draw();
    });
    if (live) { showLive(true); setInterval(draw, POLL_MS * 2); }
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
