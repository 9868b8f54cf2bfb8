"""``areal-agent view`` in a real browser (headless Chromium driven by Selenium) on the runs
of tests/view/conftest.py: a short training run of the quickstart config, the default
model's eval and a tool-using run recorded through the proxy.

What a page shows is compared with what was recorded, read back through the store's own API
(``EpisodeStore.load(sid).episode.to_dict(gamma)``: the proxy's trajectory JSON, and
``EpisodeStore.train_tokens``) and the run's files (groups.jsonl, metrics.jsonl,
report.json), never with the view's own code. The pages' DOM: docs of areal_agents/view.
Screenshots: $AREAL_VIEW_SCREENSHOTS (``.ci/run``: out/view-screenshots), else a temp dir;
with AREAL_VIEW_README_SCREENSHOT=1 the episode's also goes to docs/images/.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import yaml

from areal_agents.serve.store import EpisodeStore

try:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    if os.environ.get("AREAL_REQUIRE_BROWSER"):
        raise
    pytest.skip("the view's browser tests need selenium (the dev extra)", allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WIDTH = 1280


# ---------------------------------------------------------------------------- what was recorded
@dataclass
class Episode:
    sid: str
    trajectory: dict[str, Any]  # the proxy's trajectory JSON (prompts="full")
    records: list[dict[str, Any]]  # train_tokens rows
    reward: float  # the sum of the completions' rewards plus the final reward

    @property
    def completions(self) -> list[dict[str, Any]]:
        return list(self.trajectory["completions"])

    def records_of(self, cid: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["completion_id"] == cid]


def _gamma(run: Path) -> float:
    config = (
        yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    )
    return float(((config or {}).get("rollout") or {}).get("gamma", 1.0))


@functools.cache
def recorded(run: Path) -> dict[str, Episode]:
    """Every stored episode of ``run``, oldest first."""
    gamma = _gamma(run)
    store = EpisodeStore(run / "episodes.db")
    try:
        out = {}
        for sid in store.session_ids():
            session = store.load(sid)
            assert session is not None, sid
            ep = session.episode
            d = ep.to_dict(gamma)
            reward = sum(c["reward"] for c in d["completions"]) + (d["final_reward"] or 0.0)
            out[sid] = Episode(sid, d, store.train_tokens(sid), reward)
        return out
    finally:
        store.close()


def ledger(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "groups.jsonl").read_text().splitlines()]


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def trained_mean(values: list[list[float]]) -> float | None:
    """The mean over the tokens that carried loss (NaN: none), or None without any."""
    flat = [v for vs in values for v in vs if not math.isnan(v)]
    return sum(flat) / len(flat) if flat else None


def messages_of(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [*c["messages"], c["message"]]


def unique_calls(ep: Episode) -> list[dict[str, Any]]:
    """The tool calls of the episode's messages and replies, each once (by call id)."""
    seen: dict[str, dict[str, Any]] = {}
    for c in ep.completions:
        for m in messages_of(c):
            for call in m.get("tool_calls") or []:
                seen.setdefault(call.get("id") or json.dumps(call, sort_keys=True), call)
    return list(seen.values())


def words(ep: Episode) -> set[str]:
    """The words of the episode's messages as the store's search tokenizes them (letters and
    digits; content, tool-call names and arguments)."""
    out: set[str] = set()
    for c in ep.completions:
        for m in messages_of(c):
            texts = [m["content"]] if isinstance(m.get("content"), str) else []
            if isinstance(m.get("content"), list):
                texts += [p.get("text") or "" for p in m["content"] if isinstance(p, dict)]
            for call in m.get("tool_calls") or []:
                texts += [call["function"]["name"], str(call["function"]["arguments"])]
            for text in texts:
                out.update(re.findall(r"[^\W_]+", text.casefold()))
    return out


def episode_with_most_calls(run: Path) -> Episode:
    return max(recorded(run).values(), key=lambda e: (len(unique_calls(e)), len(e.completions)))


# ---------------------------------------------------------------------------- page helpers
def find(driver: Any, css: str) -> list[Any]:
    return list(driver.find_elements(By.CSS_SELECTOR, css))


def one(driver: Any, css: str) -> Any:
    return driver.find_element(By.CSS_SELECTOR, css)


def attr_float(el: Any, name: str) -> float | None:
    value = el.get_attribute(name)
    return None if value is None else float(value)


def shown_call(el: Any) -> tuple[str, Any]:
    """A ``div.tool-call``'s function name and its arguments, parsed."""
    return el.get_attribute("data-name"), json.loads(
        el.find_element(By.CSS_SELECTOR, "pre.tool-args").text
    )


def shot(driver: Any, shots: Path, name: str) -> Path:
    """Save a screenshot of the window; the page fits the window's width and logged no
    errors (failed loads and script errors are SEVERE entries)."""
    path = shots / name
    assert driver.save_screenshot(str(path)), name
    assert path.stat().st_size > 10_000, f"{name} looks empty"
    width = driver.execute_script("return document.documentElement.scrollWidth")
    assert width <= WIDTH, f"{name}: the page is {width} px wide in a {WIDTH} px window"
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"{name}: errors in the browser console: {errors}"
    return path


def choose(select: Any, value: str) -> None:
    """Pick the option whose value (its text when it has no value attribute) is ``value``."""
    options = [o for o in Select(select).options if o.get_attribute("value") == value]
    assert options, f"no option {value!r}"
    options[0].click()


def url_has(driver: Any, fragment: str) -> None:
    WebDriverWait(driver, 10).until(lambda d: fragment in d.current_url)


def shown_sessions(driver: Any) -> list[str]:
    return [r.get_attribute("data-session") for r in find(driver, "tr.episode")]


def result_count(driver: Any) -> int:
    text = one(driver, "#result-count").text
    match = re.match(r"(\d+) episodes?\b", text)
    assert match, text
    return int(match.group(1))


def plotted(driver: Any, metric: str) -> list[dict[str, Any]]:
    """The traces plotly drew in the chart of ``metric`` (its graph div's ``data``)."""
    return driver.execute_script(
        """const el = document.querySelector(`div.chart[data-metric="${arguments[0]}"]`);
        const gd = el.classList.contains("js-plotly-plot")
          ? el : el.querySelector(".js-plotly-plot");
        return (gd.data || []).map((t) => ({name: t.name || "", x: Array.from(t.x || []),
                                             y: Array.from(t.y || [])}));""",
        metric,
    )


def wait_drawn(driver: Any, metric: str) -> None:
    css = f'div.chart[data-metric="{metric}"]'
    WebDriverWait(driver, 30).until(
        lambda d: find(d, f"{css}.js-plotly-plot") or find(d, f"{css} .js-plotly-plot")
    )


def fmt_variants(x: float) -> set[str]:
    return {f"{x:.3f}", f"{x:.2f}", f"{x:.4g}", f"{x:g}", repr(x)}


# ---------------------------------------------------------------------------- runs page
def test_runs_page_lists_every_run_with_its_status_and_steps(browser, view, runs, shots):
    browser.get(view + "/")
    rows = {r.get_attribute("data-run"): r for r in find(browser, "table#runs tr.run")}
    assert set(rows) == {runs.short.name, runs.eval.name, runs.tools.name}
    config = yaml.safe_load((runs.short / "config.yaml").read_text())
    quick = rows[runs.short.name]
    steps = [
        int(n) for n in re.findall(r"\d+", quick.find_element(By.CSS_SELECTOR, "td.steps").text)
    ]
    assert steps == [metrics(runs.short)[-1]["step"], config["train"]["steps"]]
    assert "finished" in quick.find_element(By.CSS_SELECTOR, "td.status").text.lower()  # final/
    shot(browser, shots, "runs.png")
    quick.find_element(By.CSS_SELECTOR, "a.run-link").click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url == f"{view}/runs/{runs.short.name}")


# ---------------------------------------------------------------------------- dashboard
@pytest.mark.parametrize("which", ["short", "tools"])
def test_dashboard_charts_the_recorded_metrics(browser, view, runs, shots, which):
    run = getattr(runs, which)
    rows = metrics(run)
    browser.get(f"{view}/runs/{run.name}")
    wait_drawn(browser, "reward_mean")
    traces = plotted(browser, "reward_mean")
    want = ([r["step"] for r in rows], [r["reward_mean"] for r in rows])
    assert any((t["x"], t["y"]) == want for t in traces), traces
    chart = one(browser, 'div.chart[data-metric="reward_mean"]')
    ticks = [t.text for t in chart.find_elements(By.CSS_SELECTOR, "g.xtick text")]
    assert ticks and len(ticks) == len(set(ticks)), ticks  # whole steps, each once
    config = one(browser, "#config").text
    assert config.split() == (run / "config.yaml").read_text().split()
    latest = one(browser, "#latest-metrics").text
    assert "reward_mean" in latest
    assert fmt_variants(rows[-1]["reward_mean"]) & set(latest.split()), latest
    if which == "short":
        for metric in ("entropy", "loss", "busy", "idle"):  # recorded by every training step
            wait_drawn(browser, metric)
        shot(browser, shots, "dashboard.png")
    one(browser, "a#episodes-link").click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/runs/{run.name}/episodes"))


# ---------------------------------------------------------------------------- episode browser
def test_episode_browser_lists_filters_and_searches(browser, view, runs, shots):
    run = runs.short
    eps = recorded(run)
    base = f"{view}/runs/{run.name}/episodes"
    browser.get(base)
    assert result_count(browser) == len(eps)
    assert sorted(shown_sessions(browser)) == sorted(eps)  # 12 episodes: one page
    for row in find(browser, "tr.episode"):
        ep = eps[row.get_attribute("data-session")]
        assert row.find_element(By.CSS_SELECTOR, "td.reward").text == f"{ep.reward:.3f}"
        assert (
            row.find_element(By.CSS_SELECTOR, "td.end-reason").text == ep.trajectory["end_reason"]
        )
        assert row.find_element(By.CSS_SELECTOR, "td.turns").text == str(len(ep.completions))
        link = row.find_element(By.CSS_SELECTOR, "a.episode-link").get_attribute("href")
        assert link.endswith(f"/runs/{run.name}/episodes/{ep.sid}")
    shot(browser, shots, "episodes.png")

    reasons = Counter(e.trajectory["end_reason"] for e in eps.values())
    assert len(reasons) >= 2, reasons  # the short run: terminated, and cancelled at the end
    for reason in reasons:
        browser.get(base)
        choose(one(browser, "form#filters select[name=end_reason]"), reason)
        one(browser, "form#filters").submit()
        url_has(browser, f"end_reason={reason}")
        want = {s for s, e in eps.items() if e.trajectory["end_reason"] == reason}
        assert set(shown_sessions(browser)) == want and result_count(browser) == len(want)
        cells = {c.text for c in find(browser, "tr.episode td.end-reason")}
        assert cells == {reason}

    # a word of some episodes' messages (a number of their task), typed into the search box
    holders: dict[str, set[str]] = {}
    for sid, ep in eps.items():
        for w in words(ep):
            holders.setdefault(w, set()).add(sid)
    word = min(
        (w for w, s in holders.items() if 1 < len(s) < len(eps)), key=lambda w: (len(holders[w]), w)
    )
    browser.get(base)
    box = one(browser, 'form#filters input[name="q"]')
    box.send_keys(word, Keys.ENTER)
    WebDriverWait(browser, 10).until(lambda d: f"q={word}" in d.current_url)
    assert set(shown_sessions(browser)) == holders[word], word
    assert result_count(browser) == len(holders[word])


def test_episode_browser_filters_by_reward_step_group_and_task(browser, view, runs):
    run = runs.tools
    eps = recorded(run)
    base = f"{view}/runs/{run.name}/episodes"
    cases: list[tuple[dict[str, str], set[str]]] = [
        ({"reward_min": "0.5"}, {s for s, e in eps.items() if e.reward >= 0.5}),
        ({"reward_max": "0"}, {s for s, e in eps.items() if e.reward <= 0}),
    ]
    for row in ledger(run):  # the step that trained them
        by_records = {s for s, e in eps.items() if any(r["step"] == row["step"] for r in e.records)}
        assert by_records == set(row["sessions"])
        cases.append(({"step": str(row["step"])}, by_records))
    for key, field in (("group", "group_id"), ("task", "task_id")):
        for value in {e.trajectory[field] for e in eps.values()}:
            cases.append(
                ({key: value}, {s for s, e in eps.items() if e.trajectory[field] == value})
            )
    quokkas = {s for s, e in eps.items() if "quokkas" in words(e) and e.reward >= 0}
    cases.append(({"q": "quokkas", "reward_min": "0"}, quokkas))
    cases.append(({"q": "naive"}, {s for s, e in eps.items() if "naïve" in words(e)}))  # folded
    for params, want in cases:
        assert 0 < len(want) < len(eps), params  # each filter keeps some, drops some
        browser.get(f"{base}?{urlencode(params)}")
        assert set(shown_sessions(browser)) == want, params
        assert result_count(browser) == len(want), params
        for name, value in params.items():  # the form shows the filter in force
            shown = one(browser, f'form#filters [name="{name}"]').get_attribute("value")
            if name in ("reward_min", "reward_max", "step"):
                assert float(shown) == float(value), (name, shown)
            else:
                assert shown == value, (name, shown)


def test_episode_browser_moves_with_j_and_k_and_opens_with_enter(browser, view, runs):
    run = runs.short
    browser.get(f"{view}/runs/{run.name}/episodes")
    order = shown_sessions(browser)
    assert len(order) >= 4

    def press(*keys: str) -> int:
        for key in keys:
            ActionChains(browser).send_keys(key).perform()
        selected = find(browser, "tr.episode.selected")
        assert len(selected) == 1
        return order.index(selected[0].get_attribute("data-session"))

    first = press("j")
    assert first in (0, 1)
    assert press("j") == first + 1
    assert press("j", "j") == first + 3
    assert press("k") == first + 2
    ActionChains(browser).send_keys(Keys.ENTER).perform()
    target = order[first + 2]
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/episodes/{target}"))
    assert [s.get_attribute("data-completion") for s in find(browser, "section.completion")] == [
        c["id"] for c in recorded(run)[target].completions
    ]


# ---------------------------------------------------------------------------- an episode
def check_episode_page(browser: Any, view: str, run: Path, ep: Episode) -> None:
    browser.get(f"{view}/runs/{run.name}/episodes/{ep.sid}")
    sections = find(browser, "section.completion")
    assert [s.get_attribute("data-completion") for s in sections] == [
        c["id"] for c in ep.completions
    ]
    for section, c in zip(sections, ep.completions, strict=True):
        assert attr_float(section, "data-reward") == c["reward"]
        assert attr_float(section, "data-return") == pytest.approx(
            c["return"], rel=1e-12, abs=1e-12
        )
        want = trained_mean([r["advantages"] for r in ep.records_of(c["id"])])
        if want is None:
            assert section.get_attribute("data-advantage") is None, c["id"]
        else:
            assert attr_float(section, "data-advantage") == pytest.approx(
                want, rel=1e-12, abs=1e-12
            )
        version = attr_float(section, "data-version")
        assert version is not None
        assert min(c["output_versions"]) <= version <= max(c["output_versions"])
        if len(set(c["output_versions"])) == 1:
            assert version == c["output_versions"][0]
        link = section.find_element(By.CSS_SELECTOR, "a.tokens-link").get_attribute("href")
        assert link.endswith(f"/runs/{run.name}/episodes/{ep.sid}/tokens/{c['id']}")
        in_section = [
            shown_call(e) for e in section.find_elements(By.CSS_SELECTOR, "div.tool-call")
        ]
        for call in c["message"].get("tool_calls") or []:  # the reply's calls, as sampled
            f = call["function"]
            assert (f["name"], json.loads(f["arguments"])) in in_section, (c["id"], in_section)

    def key(name: str, args: Any) -> str:
        return json.dumps([name, args], sort_keys=True)

    shown = [key(*shown_call(e)) for e in find(browser, "div.tool-call")]
    calls = unique_calls(ep)
    # every recorded call is shown once, and nothing else (a reply that the next request
    # sends back is not shown again there)
    assert sorted(shown) == sorted(
        key(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls
    )

    by_role: dict[str, list[str]] = {}
    for m in find(browser, "div.msg[data-role]"):
        by_role.setdefault(m.get_attribute("data-role"), []).append(m.text)
    for c in ep.completions:
        for m in messages_of(c):
            if isinstance(m.get("content"), str) and m["content"].strip():
                snippet = m["content"].strip()[:200].split("\n")[0]
                assert any(snippet in text for text in by_role.get(m["role"], [])), (m, by_role)
    tree = [
        li.get_attribute("data-completion") for li in find(browser, "#tree li[data-completion]")
    ]
    assert sorted(tree) == sorted(c["id"] for c in ep.completions)
    if ep.trajectory["group_id"]:
        href = one(browser, "a#group-link").get_attribute("href")
        assert href.endswith(f"/runs/{run.name}/groups/{quote(ep.trajectory['group_id'])}")


def test_episode_view_shows_the_recorded_calls_rewards_returns_and_advantages(
    browser, view, runs, shots
):
    eps = recorded(runs.tools)
    assert any(len(unique_calls(e)) >= 3 for e in eps.values())  # parallel and repeated calls
    assert any(not e.records for e in eps.values()) and any(e.records for e in eps.values())
    for ep in eps.values():
        check_episode_page(browser, view, runs.tools, ep)
    quick = recorded(runs.short)
    trained = [e for e in quick.values() if e.records]
    assert trained, "the short run trained no episode"
    check_episode_page(browser, view, runs.short, trained[0])
    assert find(browser, 'div.msg[data-role="system"]') and find(
        browser, 'div.msg[data-role="user"]'
    )

    best = episode_with_most_calls(runs.tools)
    browser.get(f"{view}/runs/{runs.tools.name}/episodes/{best.sid}")
    assert find(browser, 'div.msg[data-role="tool"]')
    path = shot(browser, shots, "episode.png")
    if os.environ.get("AREAL_VIEW_README_SCREENSHOT") == "1":
        (ROOT / "docs" / "images").mkdir(parents=True, exist_ok=True)
        shutil.copy(path, ROOT / "docs" / "images" / "view-episode.png")


# ---------------------------------------------------------------------------- its tokens
def check_tokens(browser: Any, ep: Episode, c: dict[str, Any], mode: str) -> list[Any]:
    """The output tokens on the page of ``c`` in colour mode ``mode`` are the recorded ones,
    one coloured span each, with the recorded logprob, version and trainer record."""
    tokens = find(browser, "span.tok.out")
    assert len(tokens) == len(c["output_ids"]), mode
    assert [int(t.get_attribute("data-id")) for t in tokens] == c["output_ids"]
    assert [float(t.get_attribute("data-logprob")) for t in tokens] == pytest.approx(
        c["output_logprobs"]
    )
    assert [int(t.get_attribute("data-version")) for t in tokens] == c["output_versions"]
    records = ep.records_of(c["id"])
    weights = records[-1]["behaviour_weights"] if records else [math.nan] * len(tokens)
    clipped = records[-1]["clipped"] if records else [False] * len(tokens)
    for t, w, clip in zip(tokens, weights, clipped, strict=True):
        shown = t.get_attribute("data-weight")
        if math.isnan(w):
            assert shown in ("", None, "nan", "NaN")
        else:
            assert float(shown) == pytest.approx(w)
        assert (t.get_attribute("data-clipped") in ("1", "true", "True")) == clip
        assert t.get_attribute("title")
    colours = [t.value_of_css_property("background-color") for t in tokens]
    assert all(col not in ("rgba(0, 0, 0, 0)", "transparent") for col in colours), mode
    assert one(browser, "#legend").is_displayed()
    return colours


def test_token_view_colours_every_sampled_token(browser, view, runs, shots):
    run = runs.tools
    best = episode_with_most_calls(run)
    after_tools = [c for c in best.completions if any(m["role"] == "tool" for m in c["messages"])]
    c = after_tools[0]  # its prompt ends with the tools' results
    results = [m["content"] for m in c["messages"] if m["role"] == "tool"]
    page = f"{view}/runs/{run.name}/episodes/{best.sid}/tokens/{c['id']}"
    per_mode = {}
    for mode in ("logprob", "weight", "version"):
        browser.get(f"{page}?color={mode}")
        assert (
            Select(one(browser, "select#color")).first_selected_option.get_attribute("value")
            == mode
        )
        per_mode[mode] = check_tokens(browser, best, c, mode)
        masked = "".join(
            t.get_attribute("textContent") for t in find(browser, "span.tok.prompt.masked")
        )
        for text in results:
            assert text in masked, (text, masked[-300:])
        assert find(browser, "span.tok.prompt")
        if mode == "logprob":
            assert len(set(c["output_logprobs"])) > 1
            assert len(set(per_mode[mode])) > 1  # different logprobs, different colours
            shot(browser, shots, "tokens.png")
    assert per_mode["logprob"] != per_mode["weight"]

    browser.get(page)
    choose(one(browser, "select#color"), "version")
    WebDriverWait(browser, 10).until(lambda d: "color=version" in d.current_url)
    check_tokens(browser, best, c, "version")

    untrained = next(e for e in recorded(run).values() if not e.records)
    last = untrained.completions[-1]
    browser.get(f"{view}/runs/{run.name}/episodes/{untrained.sid}/tokens/{last['id']}?color=weight")
    check_tokens(browser, untrained, last, "weight")

    quick = next(e for e in recorded(runs.short).values() if e.records)
    qc = quick.completions[0]
    browser.get(
        f"{view}/runs/{runs.short.name}/episodes/{quick.sid}/tokens/{qc['id']}?color=weight"
    )
    check_tokens(browser, quick, qc, "weight")


# ---------------------------------------------------------------------------- its group
@pytest.mark.parametrize("which", ["tools", "short"])
def test_group_view_puts_the_group_side_by_side(browser, view, runs, shots, which):
    run = getattr(runs, which)
    eps = recorded(run)
    row = next(r for r in ledger(run) if len(r["sessions"]) > 1)
    ep = eps[row["sessions"][0]]
    gid = ep.trajectory["group_id"]
    browser.get(f"{view}/runs/{run.name}/episodes/{ep.sid}")
    one(browser, "a#group-link").click()
    WebDriverWait(browser, 10).until(lambda d: f"/runs/{run.name}/groups/" in d.current_url)
    cards = {e.get_attribute("data-session"): e for e in find(browser, "div.group-episode")}
    assert set(cards) == {s for s, e in eps.items() if e.trajectory["group_id"] == gid}
    assert set(cards) == set(row["sessions"])
    for sid, reward in zip(row["sessions"], row["rewards"], strict=True):
        assert attr_float(cards[sid], "data-reward") == pytest.approx(reward)
        assert attr_float(cards[sid], "data-reward") == pytest.approx(eps[sid].reward)
        want = trained_mean([r["advantages"] for r in eps[sid].records])
        shown = attr_float(cards[sid], "data-advantage")
        assert shown is None if want is None else shown == pytest.approx(want), sid
    if which == "tools":
        assert len(set(row["rewards"])) > 1
        shot(browser, shots, "group.png")


# ---------------------------------------------------------------------------- an eval
def test_eval_page_shows_the_report_and_its_episodes(browser, view, runs, shots):
    run = runs.eval
    report = json.loads((run / "report.json").read_text())
    browser.get(f"{view}/runs/{run.name}")
    text = one(browser, "table#report").text
    for label in (f"pass@{report['k']}", f"pass^{report['k']}"):
        assert label in text
    for key in ("success_rate", "pass_at_k", "pass_hat_k"):
        x = report[key]
        assert {f"{100 * x:.1f}%", f"{100 * x:.0f}%", f"{x:.3f}"} & set(text.split()), (key, text)
    page = browser.find_element(By.TAG_NAME, "body").text
    for reason, n in report["end_reasons"].items():
        assert re.search(rf"\b{re.escape(reason)}\b\s*:?\s*{n}\b", page), (reason, n)
    shot(browser, shots, "eval.png")
    one(browser, "a#episodes-link").click()
    WebDriverWait(browser, 10).until(lambda d: d.current_url.endswith(f"/runs/{run.name}/episodes"))
    eps = recorded(run)
    assert len(eps) == report["episodes"] == result_count(browser)
    assert sorted(shown_sessions(browser)) == sorted(eps)
    for row in find(browser, "tr.episode"):
        reward = eps[row.get_attribute("data-session")].reward
        assert row.find_element(By.CSS_SELECTOR, "td.reward").text == f"{reward:.3f}"


def test_compare_lines_up_the_tasks_of_two_evals(browser, view, runs):
    run = runs.eval
    tasks = {e.trajectory["task_id"] for e in recorded(run).values()}
    browser.get(f"{view}/compare?{urlencode({'a': run.name, 'b': run.name})}")
    assert {r.get_attribute("data-task") for r in find(browser, "tr.task[data-task]")} == tasks
    browser.get(f"{view}/compare?{urlencode({'a': run.name, 'b': runs.tools.name})}")
    assert not find(browser, "tr.task")  # no task in common
