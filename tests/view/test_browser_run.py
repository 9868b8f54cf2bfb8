"""The run side of ``areal-agent view`` in a real browser (headless Chromium through
Selenium, as tests/view/test_browser.py drives it): the dashboard of a run with held-out
stages, its episode list and the compare page, on a 390 px phone screen and a 1,280 px one.

The runs are ``write_staged_run``'s (tests/view/conftest.py, ``run_pages``): one that
finished all its steps and one stopped by its time limit, both 35 minutes ago. What a page
shows is compared with the files the runs hold (eval.json, metrics.jsonl, run.json).
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import pytest

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    if os.environ.get("AREAL_REQUIRE_BROWSER"):
        raise
    pytest.skip("the view's browser tests need selenium (the dev extra)", allow_module_level=True)

pytestmark = pytest.mark.slow

WIDTHS = (390, 1280)
HEIGHT = 844

# Before any script of the page: every timer it sets (kind, delay) and every URL it fetches.
RECORDER = """
(() => {
  const log = { timers: [], fetches: [] };
  window.__recorded = log;
  const timeout = window.setTimeout, interval = window.setInterval, fetch = window.fetch;
  window.setTimeout = function (f, ms, ...rest) {
    log.timers.push(["timeout", Number(ms) || 0]); return timeout.call(this, f, ms, ...rest); };
  window.setInterval = function (f, ms, ...rest) {
    log.timers.push(["interval", Number(ms) || 0]); return interval.call(this, f, ms, ...rest); };
  window.fetch = function (url, ...rest) {
    log.fetches.push(String(url)); return fetch.call(this, url, ...rest); };
})();
"""

# Everything wider than the window that is not inside a container that scrolls sideways
# (a table in its card), and the page's own width.
OVERFLOW = """
const W = window.innerWidth;
const scrolls = (el) => {
  for (let p = el.parentElement; p && p !== document.body; p = p.parentElement) {
    const x = getComputedStyle(p).overflowX;
    if (x === "auto" || x === "scroll") return true;
  }
  return false;
};
const name = (el) => {
  const cls = typeof el.className === "string" ? el.className.trim().split(/\\s+/) : [];
  return el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + cls.map((c) => "." + c).join("");
};
const wide = [];
for (const el of document.querySelectorAll("body *")) {
  const r = el.getBoundingClientRect();
  if (!r.width && !r.height) continue;
  if (r.right > W + 1 && !scrolls(el)) wide.push(`${name(el)} right=${Math.round(r.right)}`);
}
return { inner: W, scroll: document.documentElement.scrollWidth, wide: wide.slice(0, 12) };
"""


@pytest.fixture
def screen(browser: Any) -> Any:
    """The session's browser with the recorder installed; each test sets its width with
    :func:`width`; afterwards the window is as test_browser.py expects it (1,280 px)."""
    ident = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORDER})
    try:
        yield browser
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        browser.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": ident["identifier"]}
        )


def width(driver: Any, px: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": px, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
    )


def find(driver: Any, css: str) -> list[Any]:
    return list(driver.find_elements(By.CSS_SELECTOR, css))


def one(driver: Any, css: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, css)


def fits(driver: Any, px: int, page: str) -> None:
    """Nothing on the page is wider than the screen (tables scroll inside their cards)."""
    got = driver.execute_script(OVERFLOW)
    assert got["inner"] == px, got
    assert got["scroll"] <= px, f"{page} at {px} px: the page is {got['scroll']} px wide: {got}"
    assert not got["wide"], f"{page} at {px} px: wider than the screen: {got['wide']}"


def no_errors(driver: Any, page: str) -> None:
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{page}: errors in the browser console: {errors}"


def drawn(driver: Any, metric: str) -> None:
    css = f'div.chart[data-metric="{metric}"]'
    WebDriverWait(driver, 30).until(
        lambda d: find(d, f"{css}.js-plotly-plot") or find(d, f"{css} .js-plotly-plot")
    )


CHART = """
const el = document.querySelector(`div.chart[data-metric="${arguments[0]}"]`);
const gd = el.classList.contains("js-plotly-plot") ? el : el.querySelector(".js-plotly-plot");
const box = (css) => {
  const n = gd.querySelector(css);
  if (!n) return null;
  const r = n.getBoundingClientRect();
  return { top: r.top, bottom: r.bottom, left: r.left, right: r.right };
};
const texts = (css) => Array.from(gd.querySelectorAll(css)).map((t) => t.textContent);
return {
  traces: gd.data.map((t) => ({ type: t.type, name: t.name || "", x: Array.from(t.x || []),
    y: Array.from(t.y || []), yaxis: t.yaxis || "y", zmin: t.zmin, colorscale: t.colorscale,
    hover: t.hovertemplate || "", colorbar: t.colorbar ? (t.colorbar.title || {}).text : null })),
  legend: box("g.legend"),
  plot: box("rect.nsewdrag"),
  xtitle: box("g.g-xtitle"),
  legendText: texts("g.legend text.legendtext"),
  yticks: texts("g.ytick text"),
  showlegend: gd.layout.showlegend,
};
"""


def chart(driver: Any, metric: str) -> dict[str, Any]:
    drawn(driver, metric)
    return driver.execute_script(CHART, metric)


def overlaps(a: dict[str, float], b: dict[str, float]) -> bool:
    return not (
        a["bottom"] <= b["top"] + 0.5
        or b["bottom"] <= a["top"] + 0.5
        or a["right"] <= b["left"] + 0.5
        or b["right"] <= a["left"] + 0.5
    )


# ---------------------------------------------------------------------------- the dashboard
@pytest.mark.parametrize("px", WIDTHS)
def test_run_page_shows_the_held_out_stages_and_fits_the_screen(screen, run_pages, shots, px):
    run = run_pages.timed_out
    stages = json.loads((run / "eval.json").read_text())
    width(screen, px)
    screen.get(f"{run_pages.url}/runs/{run.name}")
    for metric in ("reward_mean", "loss", "staleness"):
        drawn(screen, metric)
    time.sleep(0.3)  # responsive charts settle to the card's width
    fits(screen, px, f"/runs/{run.name}")
    assert one(screen, "h1 .badge").text == "finished"
    assert one(screen, "#run-reason").text == "stopped by the time limit after 29 of 1000 steps"
    rows = find(screen, "table#held-out tr.stage")
    assert [r.get_attribute("data-stage") for r in rows] == [s["label"] for s in stages]
    for r, s in zip(rows, stages, strict=True):
        cell = r.find_element(By.CSS_SELECTOR, 'td[data-key="success_rate"]')
        assert cell.text == f"{100 * s['success_rate']:.1f}%"
    held = chart(screen, "held_out")
    names = ["base", "warm start", "step 20", "final"]
    success = next(t for t in held["traces"] if t["name"].startswith("success_rate"))
    assert success["x"] == names and success["y"] == [s["success_rate"] for s in stages]
    for metric in ("grad_norm", "tokens_per_s"):
        drawn(screen, metric)
    fits(screen, px, f"/runs/{run.name}")
    screen.save_screenshot(str(shots / f"run-{px}.png"))
    no_errors(screen, f"/runs/{run.name}")


def test_charts_keep_legends_clear_and_scales_apart(screen, run_pages):
    run = run_pages.timed_out
    width(screen, 1280)
    screen.get(f"{run_pages.url}/runs/{run.name}")
    for metric in ("reward_mean", "loss", "grad_norm", "tokens_per_s", "entropy", "held_out"):
        c = chart(screen, metric)
        named = [t for t in c["traces"] if t["type"] != "heatmap"]
        assert c["showlegend"] and c["legend"], (metric, c)  # one series still says its name
        assert sorted(c["legendText"]) == sorted(t["name"] for t in named), (metric, c)
        assert c["legend"]["bottom"] <= c["plot"]["top"] + 1, (metric, c)  # above the plot
        if c["xtitle"]:
            assert not overlaps(c["legend"], c["xtitle"]), (metric, c)
    loss, grad = chart(screen, "loss"), chart(screen, "grad_norm")
    assert [t["name"] for t in loss["traces"]] == ["loss"]  # not flattened under grad_norm
    assert [t["name"] for t in grad["traces"]] == ["grad_norm"]
    rate = chart(screen, "tokens_per_s")  # ~4,000 next to ~300: a second axis for the small
    axes = {t["name"].split(" ")[0]: t["yaxis"] for t in rate["traces"]}
    assert axes == {"gen_tokens_per_s": "y", "train_tokens_per_s": "y2"}, rate["traces"]


def test_staleness_counts_tokens_from_an_empty_zero(screen, run_pages):
    run = run_pages.timed_out
    rows = [
        json.loads(line)
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if "held_out" not in json.loads(line)
    ]
    width(screen, 1280)
    screen.get(f"{run_pages.url}/runs/{run.name}")
    caption = one(screen, 'figure:has(div.chart[data-metric="staleness"]) figcaption').text
    assert "tokens" in caption and "episodes" not in caption
    c = chart(screen, "staleness")
    (heat,) = c["traces"]
    assert heat["type"] == "heatmap" and heat["zmin"] == 0
    assert heat["colorscale"][0][0] == 0 and heat["colorscale"][0][1].lower() in ("#fff", "#ffffff")
    assert heat["colorbar"] == "tokens" and "tokens" in heat["hover"]
    assert "episode" not in heat["hover"]
    assert heat["x"] == [r["step"] for r in rows]
    lags = sorted({int(k) for r in rows for k in r["histograms"]["staleness"]})
    assert heat["y"] == lags
    assert c["yticks"] and all(re.fullmatch(r"\d+", t) for t in c["yticks"]), c["yticks"]


# ---------------------------------------------------------------------------- status, polling
def test_a_finished_run_whose_store_the_view_opened_stays_finished_and_does_not_poll(
    screen, run_pages
):
    run = run_pages.finished
    width(screen, 1280)
    screen.get(f"{run_pages.url}/runs/{run.name}/episodes")  # the view opens the store
    assert find(screen, "tr.episode")
    wal = run / "episodes.db-wal"
    assert wal.exists() and time.time() - wal.stat().st_mtime < 120  # just touched
    screen.get(f"{run_pages.url}/runs/{run.name}")
    assert one(screen, "h1 .badge").text == "finished"  # not "training"
    assert one(screen, "#run-reason").text == "finished: all steps done"
    drawn(screen, "reward_mean")
    time.sleep(1.0)
    log = screen.execute_script("return window.__recorded")
    polls = [t for t in log["timers"] if t[1] >= 1000]
    assert not polls, f"a finished run's dashboard set timers: {log['timers']}"
    assert len([u for u in log["fetches"] if "/api/" in u]) == 1, log["fetches"]  # drawn once
    assert not one(screen, "#live").is_displayed()
    screen.get(f"{run_pages.url}/runs/{run.name}/episodes")
    log = screen.execute_script("return window.__recorded")
    assert not [t for t in log["timers"] if t[1] >= 1000], log["timers"]
    screen.get(f"{run_pages.url}/")
    badges = {
        r.get_attribute("data-run"): r.find_element(By.CSS_SELECTOR, "td.status").text
        for r in find(screen, "tr.run")
    }
    assert badges[run.name].startswith("finished"), badges
    assert "stopped by the time limit after 29 of 1000 steps" in badges[run_pages.timed_out.name]


# ---------------------------------------------------------------------------- episodes, compare
@pytest.mark.parametrize("px", WIDTHS)
def test_episode_list_filters_by_stage_and_fits_the_screen(screen, run_pages, px):
    run = run_pages.timed_out
    width(screen, px)
    screen.get(f"{run_pages.url}/runs/{run.name}/episodes")
    fits(screen, px, "episodes")
    stage = Select(one(screen, 'select[name="stage"]'))
    values = [o.get_attribute("value") for o in stage.options]
    assert values == ["", "training", "base", "warm_start", "step-20", "final"]
    stage.select_by_value("final")
    one(screen, "#filters button[type=submit]").click()
    WebDriverWait(screen, 10).until(lambda d: "stage=final" in d.current_url)
    shown = [r.get_attribute("data-session") for r in find(screen, "tr.episode")]
    assert shown and all(s.startswith("eval-final-") for s in shown), shown
    Select(one(screen, 'select[name="stage"]')).select_by_value("training")
    one(screen, "#filters button[type=submit]").click()
    WebDriverWait(screen, 10).until(lambda d: "stage=training" in d.current_url)
    shown = [r.get_attribute("data-session") for r in find(screen, "tr.episode")]
    assert len(shown) == 8 and all(s.startswith("train-") for s in shown), shown
    fits(screen, px, "episodes?stage=training")
    no_errors(screen, "episodes")


@pytest.mark.parametrize("px", WIDTHS)
def test_compare_puts_a_runs_stages_side_by_side_and_fits_the_screen(screen, run_pages, px):
    run = run_pages.timed_out
    stages = {s["label"]: s for s in json.loads((run / "eval.json").read_text())}
    width(screen, px)
    screen.get(f"{run_pages.url}/compare?a={run.name}&b={run_pages.finished.name}")
    assert len(find(screen, "#compare tr.task")) == 2 + 4  # two training tasks, four held-out
    fits(screen, px, "compare A with B")
    screen.get(f"{run_pages.url}/compare?run={run.name}&stages=base,final")
    heads = [h.get_attribute("data-stage") for h in find(screen, "#compare-stages th[data-stage]")]
    assert heads == ["base", "final"]
    cells = find(screen, '#compare-stages tr[data-key="success_rate"] td[data-stage]')
    assert [c.text for c in cells] == [
        f"{100 * stages[x]['success_rate']:.1f}%" for x in ("base", "final")
    ]
    assert len(find(screen, "#compare-stage-tasks tr.task")) == 4
    fits(screen, px, "compare")
    box = find(screen, '#compare-stages-form input[value="step-20"]')[0]  # the form adds one
    box.click()
    one(screen, "#compare-stages-form button").click()
    WebDriverWait(screen, 10).until(lambda d: "step-20" in d.current_url)
    heads = [h.get_attribute("data-stage") for h in find(screen, "#compare-stages th[data-stage]")]
    assert heads == ["base", "step-20", "final"]
    fits(screen, px, "compare (three stages)")
    no_errors(screen, "compare")
    screen.get(f"{run_pages.url}/no/such/page")  # a page, not JSON
    assert one(screen, "section.error h1").text == "Not found"
    assert "/no/such/page" in one(screen, "section.error").text
    fits(screen, px, "404")
    screen.get_log("browser")  # the 404 itself is logged
