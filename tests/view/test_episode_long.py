"""The episode view on long episodes, through the app's HTML (no browser): ``long_run`` of
tests/view/conftest.py holds chains of 1,000 and 240 turns and a 60-turn episode whose side
branches nest ten deep, all trained (weights and advantages in ``train_tokens``).

A 1,000-turn episode opens, paged (its first and last completions, a link to the rest) and
whole (``?turns=all``); its completion tree is one flat list of rows whatever the depth,
branches indented up to a cap; each output token's tooltip is one attribute holding its
text, logprob, p, version, importance weight and advantage. What the pages show is compared
with what the store holds (``EpisodeStore.load`` and ``train_tokens``)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any

import pytest
from fastapi.testclient import TestClient

from areal_agents.serve.store import EpisodeStore
from areal_agents.view import create_app

INDENT_CAP = 4  # the tree's deepest indent (areal_agents.view.queries.TREE_INDENT_CAP)
VOID = {"meta", "link", "br", "hr", "img", "input", "wbr", "col", "area", "base", "source"}


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Element | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Element] = []
        self.text: list[str] = []

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def ancestors(self) -> Iterator[Element]:
        e = self.parent
        while e is not None:
            yield e
            e = e.parent

    def walk(self) -> Iterator[Element]:
        """This element and the ones inside it, in document order."""
        todo = [self]
        while todo:
            e = todo.pop()
            yield e
            todo.extend(reversed(e.children))

    def find(self, tag: str, cls: str | None = None) -> list[Element]:
        """The elements inside this one with tag ``tag`` (and class ``cls``)."""
        inside = [e for c in self.children for e in c.walk()]
        return [e for e in inside if e.tag == tag and (cls is None or cls in e.classes)]

    def by_id(self, ident: str) -> Element:
        found = [e for e in self.walk() if e.attrs.get("id") == ident]
        assert len(found) == 1, ident
        return found[0]

    def all_text(self) -> str:
        return "".join(t for e in self.walk() for t in e.text)


class Page(HTMLParser):
    """The page as a tree of elements; attribute values come unescaped, as a browser reads
    them (an attribute that a stray quote ended early loses its tail here too)."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {}, None)
        self.at = self.root
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        e = Element(tag, {k: v or "" for k, v in attrs}, self.at)
        self.at.children.append(e)
        if tag not in VOID:
            self.at = e

    def handle_endtag(self, tag: str) -> None:
        e: Element | None = self.at
        while e is not None and e.tag != tag:
            e = e.parent
        if e is not None and e.parent is not None:
            self.at = e.parent

    def handle_data(self, data: str) -> None:
        self.at.text.append(data)


@pytest.fixture(scope="module")
def client(long_run: Any) -> Iterator[TestClient]:
    with TestClient(create_app([long_run.path]), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def stored(long_run: Any) -> dict[str, Any]:
    """Each episode of ``long_run`` by name: ``(episode, {completion id: train_tokens row})``."""
    store = EpisodeStore(long_run.path / "episodes.db")
    try:
        out = {}
        for name, sid in long_run.sids.items():
            session = store.load(sid)
            assert session is not None
            rows = {r["completion_id"]: r for r in store.train_tokens(sid)}
            out[name] = (session.episode, rows)
        return out
    finally:
        store.close()


def get(client: TestClient, url: str) -> Element:
    got = client.get(url)
    assert got.status_code == 200, (url, got.status_code, got.text[-1500:])
    return Page(got.text).root


def tree_rows(page: Element) -> list[Element]:
    tree = page.by_id("tree")
    return [e for e in tree.walk() if e.tag == "li" and "data-completion" in e.attrs]


@pytest.mark.parametrize("name", ["long-1000", "long-240"])
def test_a_long_episode_opens_paged_and_whole(client, long_run, stored, name):
    ep, _ = stored[name]
    n = len(ep.completions)
    ids = [c.id for c in ep.completions]
    base = f"/runs/{long_run.path.name}/episodes/{long_run.sids[name]}"

    page = get(client, base)  # its first 20 and last 20 completions, the rest behind a link
    shown = [s.attrs["data-completion"] for s in page.find("section", "completion")]
    assert shown == ids[:20] + ids[-20:]
    hidden = page.by_id("hidden-turns")
    assert int(hidden.attrs["data-hidden"]) == n - 40
    assert [a.attrs["href"] for a in hidden.find("a")] == ["?turns=all#c20"]
    assert sorted(r.attrs["data-completion"] for r in tree_rows(page)) == sorted(ids)

    page = get(client, base + "?turns=all")
    shown = [s.attrs["data-completion"] for s in page.find("section", "completion")]
    assert shown == ids
    rows = tree_rows(page)
    assert [r.attrs["data-completion"] for r in rows] == ids  # a chain: in turn order
    assert all(r.attrs["data-indent"] == "0" and r.attrs["data-level"] == "0" for r in rows)
    assert [int(r.attrs["data-depth"]) for r in rows] == list(range(n))
    last = page.by_id(f"c{n - 1}")
    assert f"Step {n - 1}: " in last.all_text()


def test_the_tree_of_a_branchy_episode_is_flat_and_capped(client, long_run, stored):
    ep, _ = stored["branchy"]
    cs = ep.completions
    index = {c.id: i for i, c in enumerate(cs)}
    parent = {c.id: c.parent_id for c in cs}
    page = get(client, f"/runs/{long_run.path.name}/episodes/{long_run.sids['branchy']}")
    rows = tree_rows(page)
    order = [r.attrs["data-completion"] for r in rows]
    assert sorted(order) == sorted(index)
    tree = page.by_id("tree")
    for r in rows:  # one row each, no row inside another, no list inside a row
        assert not any(a.tag == "li" for a in r.ancestors())
        assert not r.find("ul") and not r.find("ol")
        assert int(r.attrs["data-indent"]) <= INDENT_CAP
    assert not tree.find("ul") and not tree.find("ol")  # the tree is one list

    # tree order: a parent before its children; depth: the ancestors; a row that does not
    # continue the row above names the completion its branch leaves
    depth: dict[str, int] = {}
    for k, r in enumerate(rows):
        cid = r.attrs["data-completion"]
        p = parent[cid]
        assert p is None or order.index(p) < k
        depth[cid] = 0 if p is None else depth[p] + 1
        assert int(r.attrs["data-depth"]) == depth[cid]
        level = int(r.attrs["data-level"])
        assert int(r.attrs["data-indent"]) == min(level, INDENT_CAP)
        if k and p is not None and order[k - 1] != p:
            assert f"↳ #{index[p]}" in r.all_text(), cid
        marks = [e.all_text() for e in r.find("span", "lvl")]
        assert marks == ([str(level)] if level else []), cid  # the level, past the cap too
    levels = [int(r.attrs["data-level"]) for r in rows]
    assert max(levels) == 10 > INDENT_CAP  # ten nested branches: shown, indented no deeper
    # the main chain stays at level 0, each side branch one level deeper than the last
    assert [levels[order.index(c.id)] for c in cs[:30]] == [0] * 30
    assert [levels[order.index(cs[30 + 3 * k].id)] for k in range(10)] == list(range(1, 11))


def _title_parts(title: str) -> dict[str, str]:
    """``"id N · "text" · logprob X · p Y · ..."`` -> {"id": N, "text": ..., "logprob": X, ...}"""
    head, quoted, *rest = title.split(" · ")
    out = {"id": head.removeprefix("id "), "text": quoted}
    for part in rest:
        key, _, value = part.partition(" ")
        out[key] = value
    return out


def test_token_tooltips_hold_logprob_p_version_weight_and_advantage(client, long_run, stored):
    ep, rows = stored["branchy"]
    sid = long_run.sids["branchy"]
    tried = 0
    for c in ep.completions[:8]:
        page = get(client, f"/runs/{long_run.path.name}/episodes/{sid}/tokens/{c.id}")
        spans = [s for s in page.find("span", "tok") if "out" in s.classes]
        assert len(spans) == len(c.output_ids)
        row = rows[c.id]
        for k, s in enumerate(spans):
            title = s.attrs["title"]
            parts = _title_parts(title)
            assert int(parts["id"]) == c.output_ids[k]
            assert json.loads(parts["text"]) == s.all_text()  # the whole text, quotes and all
            lp = c.output_logprobs[k]
            assert float(parts["logprob"]) == pytest.approx(lp, abs=5e-5), title
            assert float(parts["p"]) == pytest.approx(math.exp(lp), abs=5e-4), title
            assert int(parts["version"]) == c.output_versions[k], title
            assert float(parts["weight"]) == pytest.approx(row["behaviour_weights"][k], abs=5e-4), (
                title
            )
            assert float(parts["advantage"]) == pytest.approx(row["advantages"][k], abs=5e-4), title
            assert float(s.attrs["data-logprob"]) == pytest.approx(lp)
        texts = "".join(s.all_text() for s in spans)
        tried += '"' in texts and "<" in texts and "&" in texts
        for s in page.find("span", "prompt"):  # prompt tokens: one attribute too
            assert re.fullmatch(r"prompt token \d+ \".*\" \(.*no loss\)", s.attrs["title"], re.S)
    assert tried  # tokens holding quotes and markup characters were among them


def test_tree_rows_of_odd_parent_links():
    """Every completion is one row, once: a parent that is not in the episode makes a root,
    parent links that loop (no root to reach them from) are listed flat at the end."""
    from areal_agents.trajectory import Completion
    from areal_agents.view.queries import tree_rows

    def c(cid: str, parent: str | None) -> Completion:
        return Completion(cid, [], [], [], [], [], {}, "stop", parent_id=parent)

    cs = [c("a", None), c("b", "a"), c("x", "y"), c("y", "x"), c("c", "a"), c("d", "gone")]
    rows = tree_rows(cs)
    assert [r["id"] for r in rows] == ["a", "b", "c", "d", "x", "y"]
    assert [r["level"] for r in rows] == [0, 0, 1, 0, 0, 0]
    assert [r["branch"] for r in rows] == [False, False, True, True, True, True]
    assert [r["parent"] for r in rows] == [None, 0, 0, None, None, None]
    assert rows[0]["forks"] == 2
