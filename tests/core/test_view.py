"""``areal-agent view``'s app on a real episode store (the browser suite is tests/view/):
filters, full-text search, pages of an episode, its tokens and its group, tokens for a
non-loopback view, the import of an older run's episodes.jsonl, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from areal_agents.engines.launch import free_port
from areal_agents.errors import ConfigError
from areal_agents.serve.session import Session
from areal_agents.serve.store import EpisodeStore
from areal_agents.trajectory import Completion, Episode
from areal_agents.view import create_app, import_run


def _completion(
    i: int, messages: list[dict], reply: dict, prompt: list[int], *, reward: float = 0.0, **kw
) -> Completion:
    out = [200 + i, 201 + i, 202 + i]
    return Completion(
        id=f"c-{i}-{len(messages)}-{kw.pop('tag', '')}",
        messages=messages,
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.1, -1.5, -0.01],
        output_versions=[3, 3, 4],
        message=reply,
        finish_reason="stop",
        created_at=time.time(),
        reward=reward,
        **kw,
    )


def _episode(sid: str, *, group: str, task: str, reward: float, end: str, env: str, word: str):
    """A two-turn tool-using episode: a calculator call, its result, then the answer."""
    system = {"role": "system", "content": "You are a careful calculator agent."}
    user = {"role": "user", "content": f"What is 6 times 7? ({word})"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call-{sid}",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
            }
        ],
    }
    first = _completion(0, [system, user], call, list(range(100, 110)), tag=sid)
    tool = {"role": "tool", "tool_call_id": f"call-{sid}", "content": "42"}
    answer = {"role": "assistant", "content": f"The answer is 42, über {word}."}
    prompt = [*first.prompt_ids, *first.output_ids, 120, 121, 122, 123]  # + the tool result
    second = _completion(1, [system, user, call, tool], answer, prompt, reward=reward, tag=sid)
    second.parent_id = first.id
    ep = Episode(sid, completions=[first, second], group_id=group, task_id=task)
    ep.ended, ep.end_reason = True, end
    ep.metadata = {"env": env, "success": reward > 0, "turns": 2}
    return ep


def _write(store: EpisodeStore, episodes: list[Episode]) -> None:
    for ep in episodes:
        session = Session(ep.session_id, "", ep, created_at=time.time())
        store.put_session(session)
        for i, c in enumerate(ep.completions):
            store.put_completion(session, c, i, ep.completions[:i])
        store.put_header(session)
        time.sleep(0.002)  # distinct created_at: a stable order
    store.flush_sync()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "myrun"
    run.mkdir()
    (run / "config.yaml").write_text("env:\n  id: areal/Calculator-v0\ntrain:\n  steps: 3\n")
    rows = [
        {
            "step": s,
            "reward_mean": 0.1 * s,
            "elapsed_s": 10.0 * s,
            "histograms": {"staleness": {"0": 3, "1": s}},
        }
        for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = EpisodeStore(run / "episodes.db")
    eps = [
        _episode(
            f"sess-{i:03d}",
            group=f"g{i // 4}",
            task=f"t{i // 4}",
            reward=1.0 if i % 2 else 0.0,
            end="terminated" if i % 3 else "truncated",
            env="areal/Calculator-v0" if i < 8 else "areal/Other-v0",
            word="zebra" if i == 5 else "plain",
        )
        for i in range(12)
    ]
    _write(store, eps)
    store.close()
    return run


def _ids(html: str) -> list[str]:
    return re.findall(r'<tr class="episode" data-session="([^"]+)"', html)


def test_the_browser_filters_and_counts(run_dir: Path) -> None:
    c = TestClient(create_app([run_dir]))
    html = c.get("/runs/myrun/episodes").text
    assert "12 episodes" in html and len(_ids(html)) == 12
    assert _ids(html)[0] == "sess-011"  # newest first
    assert len(_ids(c.get("/runs/myrun/episodes?end_reason=truncated").text)) == 4
    assert set(_ids(c.get("/runs/myrun/episodes?group=g1").text)) == {
        f"sess-{i:03d}" for i in (4, 5, 6, 7)
    }
    assert len(_ids(c.get("/runs/myrun/episodes?task=t2").text)) == 4
    assert len(_ids(c.get("/runs/myrun/episodes?env=areal/Other-v0").text)) == 4
    hi = _ids(c.get("/runs/myrun/episodes?reward_min=0.5").text)
    assert sorted(hi) == [f"sess-{i:03d}" for i in range(1, 12, 2)]
    assert _ids(c.get("/runs/myrun/episodes?reward_max=0.5&reward_min=0.5").text) == []
    rows = _ids(c.get("/runs/myrun/episodes?sort=reward").text)
    assert all(int(s[-3:]) % 2 for s in rows[:6])
    assert c.get("/api/runs/myrun/count?end_reason=terminated").json() == {"total": 8}


def test_search_finds_words_of_messages(run_dir: Path) -> None:
    c = TestClient(create_app([run_dir]))
    assert _ids(c.get("/runs/myrun/episodes?q=zebra").text) == ["sess-005"]
    assert len(_ids(c.get("/runs/myrun/episodes?q=%C3%BCber").text)) == 12  # über
    assert len(_ids(c.get("/runs/myrun/episodes?q=zebra&end_reason=truncated").text)) == 0
    for hostile in ['"zebra', "a OR", "-", "*", "NEAR(", "'; drop table sessions; --"]:
        r = c.get("/runs/myrun/episodes", params={"q": hostile})
        assert r.status_code == 200, (hostile, r.text[-500:])


def test_bad_filters_are_named_not_errors(run_dir: Path) -> None:
    c = TestClient(create_app([run_dir]))
    r = c.get("/runs/myrun/episodes?step=abc&reward_min=nan&sort=sideways&page=x")
    assert r.status_code == 200
    for name in (
        "step: expected a number",
        "reward_min: expected a finite",
        "sort: one of",
        "page:",
    ):
        assert name in r.text
    assert c.get("/runs/nope").status_code == 404
    assert c.get("/runs/myrun/episodes/sess-nope").status_code == 404
    assert c.get("/runs/myrun/groups/nope").status_code == 404
    assert c.get("/api/runs/nope/metrics").json() == {"error": "no run named 'nope'"}


def test_episode_page_shows_the_recorded_calls_rewards_and_returns(run_dir: Path) -> None:
    store = EpisodeStore(run_dir / "episodes.db")
    ep = store.load("sess-005").episode
    store.close()
    trajectory = ep.to_dict(1.0)
    c = TestClient(create_app([run_dir]))
    html = c.get("/runs/myrun/episodes/sess-005").text
    sections = {
        m[0]: dict(re.findall(r'(data-[a-z]+)="([^"]*)"', m[1]))
        for m in re.findall(
            r'<section class="completion"[^>]*data-completion="([^"]+)"([^>]*)>', html
        )
    }
    assert list(sections) == [comp["id"] for comp in trajectory["completions"]]
    for comp in trajectory["completions"]:
        shown = sections[comp["id"]]
        assert float(shown["data-reward"]) == comp["reward"]
        assert float(shown["data-return"]) == comp["return"]
        assert int(shown["data-version"]) == max(comp["output_versions"])
    args = re.findall(r'<pre class="tool-args"[^>]*>([^<]*)</pre>', html)
    assert [json.loads(a.replace("&#34;", '"')) for a in args] == [{"expression": "6*7"}]
    assert 'data-role="tool"' in html and 'data-role="system"' in html
    assert "merged into parent" in html
    assert html.count('<li class="tree-row') == 2  # one tree row per completion
    cid = trajectory["completions"][1]["id"]
    tokens = c.get(f"/runs/myrun/episodes/sess-005/tokens/{cid}?color=version").text
    assert tokens.count('class="tok out') == 3
    assert tokens.count('class="tok prompt masked"') == 4  # the tool result's new tokens
    assert 'id="legend"' in tokens
    group = c.get("/runs/myrun/groups/g1").text
    assert group.count('class="group-episode') == 4


def _long_episode(sid: str, turns: int) -> Episode:
    """``turns`` calculator calls in a row; each request sends the previous reply back in
    the client's own spelling (its own call id and a ``refusal: null``), as SDKs do."""
    system = {"role": "system", "content": "You are a careful calculator agent."}
    messages: list[dict] = [system, {"role": "user", "content": "Add the numbers up."}]
    prompt = list(range(100, 110))
    completions: list[Completion] = []
    for i in range(turns):
        reply = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call-{i}",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": f'{{"expression": "{i}+1"}}'},
                }
            ],
        }
        c = _completion(i, list(messages), reply, list(prompt), tag=sid)
        if completions:
            c.parent_id = completions[-1].id
        completions.append(c)
        resent = {
            **reply,
            "refusal": None,
            "tool_calls": [{**reply["tool_calls"][0], "id": f"x{i}"}],
        }
        messages += [resent, {"role": "tool", "tool_call_id": f"x{i}", "content": str(i + 1)}]
        prompt += [*c.output_ids, 120 + i % 50]
    ep = Episode(sid, completions=completions, group_id="long", task_id="long")
    ep.ended, ep.end_reason = True, "terminated"
    return ep


def test_a_long_episode_shows_each_call_once_and_its_ends_first(tmp_path: Path) -> None:
    run = tmp_path / "long"
    run.mkdir()
    store = EpisodeStore(run / "episodes.db")
    _write(store, [_long_episode("sess-long", 60), _long_episode("sess-short", 5)])
    store.close()
    c = TestClient(create_app([run]))

    def calls(html: str) -> list[str]:
        return [
            json.loads(a.replace("&#34;", '"'))["expression"]
            for a in re.findall(r'<pre class="tool-args"[^>]*>([^<]*)</pre>', html)
        ]

    short = c.get("/runs/long/episodes/sess-short").text
    assert calls(short) == [f"{i}+1" for i in range(5)]  # the resent replies are not repeated
    assert "hidden-turns" not in short
    html = c.get("/runs/long/episodes/sess-long").text
    shown = re.findall(r'<section class="completion" id="c(\d+)"', html)
    assert [int(i) for i in shown] == [*range(20), *range(40, 60)]
    assert calls(html) == [f"{i}+1" for i in [*range(20), *range(40, 60)]]
    assert 'data-hidden="20"' in html and 'href="?turns=all#c20"' in html
    assert html.count('<li class="tree-row') == 60  # the tree has every completion
    assert 'href="?turns=all#c33"' in html and 'href="#c45"' in html
    full = c.get("/runs/long/episodes/sess-long?turns=all").text
    assert calls(full) == [f"{i}+1" for i in range(60)]
    assert "hidden-turns" not in full


def test_runs_page_and_dashboard(run_dir: Path, tmp_path: Path) -> None:
    c = TestClient(create_app([run_dir.parent]))
    html = c.get("/").text
    assert 'data-run="myrun"' in html and "2 / 3" in html
    dash = c.get("/runs/myrun").text
    assert 'data-metric="reward_mean"' in dash and 'data-metric="staleness"' in dash
    assert "areal/Calculator-v0" in dash  # the config
    rows = c.get("/api/runs/myrun/metrics").json()["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    with (run_dir / "metrics.jsonl").open("a") as f:  # the run goes on: the next read has it
        f.write(json.dumps({"step": 3, "reward_mean": 0.5}) + "\n")
    assert [r["step"] for r in c.get("/api/runs/myrun/metrics").json()["rows"]] == [1, 2, 3]
    (tmp_path / "later").mkdir()  # a run started after the view: it appears
    (tmp_path / "later" / "metrics.jsonl").write_text("")
    assert 'data-run="later"' in c.get("/").text


def test_a_token_guards_every_page(run_dir: Path) -> None:
    c = TestClient(create_app([run_dir], token="s3cret"))
    assert c.get("/").status_code == 401
    assert c.get("/api/runs").status_code == 401
    assert c.get("/?token=wrong").status_code == 401
    assert c.get("/?token=s3cret").status_code == 200
    assert c.get("/runs/myrun").status_code == 200  # the cookie carries it
    fresh = TestClient(create_app([run_dir], token="s3cret"))
    assert fresh.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_import_builds_a_store_from_episodes_jsonl(run_dir: Path, tmp_path: Path) -> None:
    store = EpisodeStore(run_dir / "episodes.db")
    old = tmp_path / "old-eval"
    old.mkdir()
    with (old / "episodes.jsonl").open("w") as f:
        for sid in store.session_ids()[:6]:
            row = store.load(sid).episode.to_dict(1.0)
            row["result"] = {"success": True, "turns": 2, "end_reason": "terminated"}
            f.write(json.dumps(row) + "\n")
        f.write("not json\n")
    store.close()
    page = TestClient(create_app([old])).get("/runs/old-eval/episodes")
    assert page.status_code == 404 and "--import" in page.text
    assert import_run(old) == {"imported": 6, "skipped": 0, "bad_lines": 1}
    assert import_run(old) == {"imported": 0, "skipped": 6, "bad_lines": 1}
    c = TestClient(create_app([old]))
    assert len(_ids(c.get("/runs/old-eval/episodes").text)) == 6
    assert _ids(c.get("/runs/old-eval/episodes?q=zebra").text) == ["sess-005"]
    with pytest.raises(ConfigError, match=r"no episodes\.jsonl"):
        import_run(tmp_path)


def test_the_cli_serves_and_refuses_an_open_host_without_a_token(run_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "areal_agents.cli.main", "view", str(run_dir), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--host", "0.0.0.0", "--no-browser"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("view: http://127.0.0.1:") and "?token=" in line, line
        url = line.split(" ", 1)[1].strip()
        for _ in range(100):
            try:
                r = httpx.get(url.split("?")[0])
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert r.status_code == 401
        assert httpx.get(url).status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)
    out = subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", "view", str(run_dir / "nothing")],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "no such run directory" in out.stderr


def test_a_store_url_on_each_backend(store_url: str) -> None:
    """The same filters and search on a store named by URL (SQLite file or PostgreSQL)."""
    store = EpisodeStore(store_url)
    _write(
        store,
        [
            _episode(
                f"sess-{i}",
                group="g",
                task=f"t{i}",
                reward=float(i),
                end="terminated",
                env="areal/Calculator-v0" if i else "areal/Other-v0",
                word="zebra" if i == 2 else "plain",
            )
            for i in range(4)
        ],
    )
    store.close()
    app = create_app([store_url])
    name = app.state.runs.runs()[0].name
    c = TestClient(app)
    assert len(_ids(c.get(f"/runs/{name}/episodes").text)) == 4
    assert _ids(c.get(f"/runs/{name}/episodes?q=zebra").text) == ["sess-2"]
    assert _ids(c.get(f"/runs/{name}/episodes?env=areal/Other-v0").text) == ["sess-0"]
    assert _ids(c.get(f"/runs/{name}/episodes?reward_min=2.5").text) == ["sess-3"]
    assert _ids(c.get(f"/runs/{name}/episodes?sort=-reward").text)[0] == "sess-0"
    page = c.get(f"/runs/{name}/episodes/sess-3")
    assert page.status_code == 200 and "calculator" in page.text
    assert c.get(f"/runs/{name}/groups/g").text.count('class="group-episode') == 4
