"""The episode, token and group pages of long episodes in a real browser (headless Chromium
through Selenium, tests/view/conftest.py), on a phone's width (390 px) and a laptop's
(1,280 px): ``long_run`` holds chains of 1,000 and 240 turns and a 60-turn episode whose
side branches nest ten deep, with long unbroken strings in its messages and tool calls.

Nothing may be wider than the page: the document does not scroll sideways and every
element ends inside the window, except inside a box that scrolls sideways by design. The
completion tree stays readable: its rows keep their width and its card never scrolls
sideways. A token's tooltip holds its logprob."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

try:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    if os.environ.get("AREAL_REQUIRE_BROWSER"):
        raise
    pytest.skip("the view's browser tests need selenium (the dev extra)", allow_module_level=True)

WIDTHS = (390, 1280)
HEIGHT = 800

# Elements that end outside the window (right edge past its width + 1, the vertical
# scrollbar not counted, or left edge before -1), not counting those inside a box that clips
# or scrolls its overflow sideways (whose own box is checked like any other).
OVERFLOW_JS = """
const W = document.documentElement.clientWidth, out = [];
const clips = (e) => ["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(e).overflowX);
const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "")
  + (typeof e.className === "string" && e.className.trim() ? "." + e.className.trim() : "");
const todo = [...document.body.children];
while (todo.length) {
  const e = todo.pop();
  const r = e.getBoundingClientRect();
  if ((r.width || r.height) && (r.right > W + 1 || r.left < -1)) {
    out.push(`${name(e)} [${Math.round(r.left)}, ${Math.round(r.right)}]`);
  }
  if (!clips(e)) todo.push(...e.children);  // what a clipping box holds: not checked
}
const scroll = document.documentElement.scrollWidth;
return {inner: window.innerWidth, client: W, scroll: scroll, out: out.slice(0, 12), n: out.length};
"""

# The completion the URL's #fragment names, scrolled to: what the window shows at the middle
# of its head and of its visible part (both must be the completion's own, not a sticky box
# drawn over it).
VISIBLE_JS = """
const t = document.querySelector(location.hash), head = t.querySelector(".completion-head");
const r = t.getBoundingClientRect(), h = head.getBoundingClientRect();
const x = r.left + r.width / 2;
const mid = (Math.max(r.top, 0) + Math.min(r.bottom, window.innerHeight)) / 2;
const at = (y) => { const e = document.elementFromPoint(x, y); return !!e && t.contains(e); };
return {head: at(h.top + h.height / 2), middle: at(mid), top: r.top};
"""

# The completion tree: its card's sideways scroll, and its rows' narrowest width.
TREE_JS = """
const card = document.querySelector(".tree-card");
const rows = [...document.querySelectorAll("#tree li[data-completion]")];
const widths = rows.map((r) => r.getBoundingClientRect().width).filter((w) => w > 0);
return {rows: rows.length, shown: widths.length, narrowest: Math.min(...widths),
        scroll: card.scrollWidth, client: card.clientWidth,
        nested: rows.filter((r) => r.parentElement.closest("li")).length};
"""


@pytest.fixture
def at_width(browser: Any) -> Iterator[Any]:
    """Set the window's layout width (a desktop browser's, not a zoomed-out phone's)."""

    def use(width: int) -> None:
        browser.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )

    yield use
    browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def load(browser: Any, url: str) -> None:
    """Open ``url`` and wait for the whole document: on a long page chromedriver's ``get``
    can return while it is still loading."""
    browser.get(url)
    WebDriverWait(browser, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def fits(browser: Any, width: int, what: str) -> None:
    got = browser.execute_script(OVERFLOW_JS)
    assert got["inner"] == width, (what, got)
    assert got["scroll"] <= got["client"], (what, width, got)
    assert got["n"] == 0, (what, width, got)


def check_tree(browser: Any, width: int, turns: int, what: str) -> None:
    tree = browser.execute_script(TREE_JS)
    assert tree["rows"] == tree["shown"] == turns, (what, tree)
    assert tree["nested"] == 0, (what, tree)
    assert tree["scroll"] <= tree["client"] + 1, (what, width, tree)  # no sideways scroll
    assert tree["narrowest"] >= (200 if width < 1000 else 180), (what, width, tree)


@pytest.mark.parametrize("width", WIDTHS)
def test_long_and_branchy_episodes_fit_the_window(browser, long_view, long_run, at_width, width):
    at_width(width)
    run = long_run.path.name
    pages = [("long-1000", "#c990", 1000), ("branchy", "#c45", 60)]
    if width < 1000:  # the whole 1,000 turns, on the narrow window
        pages.insert(1, ("long-1000", "?turns=all#c500", 1000))
    for name, query, turns in pages:
        load(browser, f"{long_view}/runs/{run}/episodes/{long_run.sids[name]}{query}")
        what = f"{name}{query}"
        shown = browser.find_elements(By.CSS_SELECTOR, "section.completion")
        assert len(shown) == (turns if "turns=all" in query else 40), what  # over 50: paged
        fits(browser, width, what)
        check_tree(browser, width, turns, what)
        seen = browser.execute_script(VISIBLE_JS)
        assert seen["head"] and seen["middle"], (what, width, seen)
    levels = browser.execute_script(  # the branchy episode's rows
        "return [...document.querySelectorAll('#tree li[data-level]')].map((r) => "
        "[Number(r.dataset.level), r.getBoundingClientRect().left]);"
    )
    deepest = max(level for level, _ in levels)
    assert deepest == 10  # the branchy episode's ten nested branches
    left = {level: x for level, x in levels}
    assert left[deepest] == left[4] > left[1] > left[0]  # indented, up to the cap


@pytest.mark.parametrize("width", WIDTHS)
def test_token_and_group_pages_fit_and_tooltips_hold_the_logprob(
    browser, long_view, long_run, at_width, width
):
    at_width(width)
    run = long_run.path.name
    sid = long_run.sids["branchy"]
    load(browser, f"{long_view}/runs/{run}/episodes/{sid}")
    link = browser.find_elements(By.CSS_SELECTOR, "section.completion a.tokens-link")[3]
    load(browser, link.get_attribute("href"))
    fits(browser, width, "tokens")
    tokens = browser.execute_script(
        "return [...document.querySelectorAll('span.tok.out')]"
        ".map((t) => [t.title, Number(t.dataset.logprob), t.textContent]);"
    )
    assert tokens
    for title, lp, _ in tokens:
        shown = re.search(r" · logprob (\S+) · p (\S+) · version (\S+) · weight (\S+) · ", title)
        assert shown is not None, title
        assert float(shown.group(1)) == pytest.approx(lp, abs=5e-5), title
        assert float(shown.group(2)) == pytest.approx(math.exp(lp), abs=5e-4), title
        assert re.search(r" · advantage -?\d", title), title
    texts = "".join(text for _, _, text in tokens)
    assert '"' in texts and "<" in texts  # quotes and markup did not cut a tooltip short
    k = next(k for k, (_, _, text) in enumerate(tokens) if '"' in text)
    target = browser.find_elements(By.CSS_SELECTOR, "span.tok.out")[k]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", target)
    ActionChains(browser).move_to_element(target).perform()
    info = browser.find_element(By.ID, "hover-info").text
    assert info == tokens[k][0] and " · logprob " in info

    load(browser, f"{long_view}/runs/{run}/groups/g-long")
    cards = browser.find_elements(By.CSS_SELECTOR, "div.group-episode")
    assert len(cards) == len(long_run.sids)
    fits(browser, width, "group")
