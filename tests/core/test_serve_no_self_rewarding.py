"""``areal-agent serve --no-self-rewarding``: a standalone server whose session keys may call
the model and read their session, but not post themselves rewards, end or delete it (a 403
naming the flag); the admin key may. Without an admin key the flag is refused before any
model loads. Through the command's own entry point (``main``), the engine replaced by the
instant FakeEngine and the server run on loopback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from areal_agents.cli import serve as serve_cli
from areal_agents.cli.main import main
from areal_agents.serve.chat import ChatTokenizer
from areal_agents.serve.proxy import Proxy
from areal_agents.serve.server import ProxyServer
from areal_agents.testing.fake_engine import FakeEngine

ADMIN = "admin-key-48"
SERVE = ["serve", "--backend", "sglang", "--engine-url", "http://127.0.0.1:9/unused"]


@pytest.fixture
def run_serve(
    monkeypatch: pytest.MonkeyPatch, qwen_chat_tokenizer: ChatTokenizer
) -> Callable[..., tuple[int, Proxy | None]]:
    """Run ``areal-agent serve ARGS`` with ``check(proxy, url)`` as its server's life."""
    monkeypatch.delenv("AREAL_ADMIN_KEY", raising=False)
    end = qwen_chat_tokenizer.token_id("<|im_end|>")
    assert end is not None

    def engine(_args: Any) -> tuple[FakeEngine, ChatTokenizer]:
        return FakeEngine(lambda ids, p: [*ids[-5:-2], end]), qwen_chat_tokenizer

    monkeypatch.setattr(serve_cli, "load_server_engine", engine)

    def run(args: list[str], check: Callable[[Proxy, str], None]) -> tuple[int, Proxy | None]:
        served: list[Proxy] = []

        def serve(proxy: Proxy, host: str, port: int) -> None:
            served.append(proxy)
            with ProxyServer.start(proxy, host=host) as srv:
                check(proxy, srv.url)

        monkeypatch.setattr(serve_cli, "serve_forever", serve)
        code = main([*SERVE, *args])
        return code, served[0] if served else None

    return run


def _session(url: str, admin: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    made = httpx.post(f"{url}/sessions", headers=admin).json()
    auth = {"Authorization": f"Bearer {made['api_key']}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 200, r.text
    return made, auth


def test_no_self_rewarding_leaves_rewards_and_ends_to_the_admin_key(run_serve):
    def check(proxy: Proxy, url: str) -> None:
        assert proxy.self_rewarding is False and proxy.admin_key == ADMIN
        admin = {"Authorization": f"Bearer {ADMIN}"}
        made, auth = _session(url, admin)
        sid = made["id"]
        manage = [
            ("POST", f"/sessions/{sid}/rewards", {"value": 1.0}),
            ("POST", f"/sessions/{sid}/rewards", {"value": 1.0, "final": True}),
            ("POST", f"/sessions/{sid}/end", {"final_reward": 1.0}),
            ("DELETE", f"/sessions/{sid}", None),
        ]
        for method, path, body in manage:  # the agent's own key: refused, nothing changes
            r = httpx.request(method, f"{url}{path}", json=body, headers=auth)
            assert r.status_code == 403, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "permission_error"
            assert "--no-self-rewarding" in error["message"], error["message"]
            assert "admin key" in error["message"], error["message"]
        # Reading stays open to the session's key.
        summary = httpx.get(f"{url}/sessions/{sid}", headers=auth).json()
        assert summary["final_reward"] is None and summary["ended"] is False
        traj = httpx.get(f"{url}/sessions/{sid}/trajectory", headers=auth).json()
        assert [c["reward"] for c in traj["completions"]] == [0.0]
        # The admin key scores and ends it.
        for method, path, body in manage[:3]:
            r = httpx.request(method, f"{url}{path}", json=body, headers=admin)
            assert r.status_code == 200, (path, r.text)
        summary = httpx.get(f"{url}/sessions/{sid}", headers=auth).json()
        assert summary["final_reward"] == 2.0 and summary["ended"] is True
        traj = httpx.get(f"{url}/sessions/{sid}/trajectory", headers=auth).json()
        assert [c["reward"] for c in traj["completions"]] == [1.0]
        r = httpx.delete(f"{url}/sessions/{sid}", headers=admin)
        assert r.status_code == 200, r.text

    code, proxy = run_serve(["--no-self-rewarding", "--admin-key", ADMIN], check)
    assert code == 0 and proxy is not None


def test_by_default_the_session_key_still_scores_itself(run_serve):
    def check(proxy: Proxy, url: str) -> None:
        assert proxy.self_rewarding is True
        made, auth = _session(url, {})
        r = httpx.post(f"{url}/sessions/{made['id']}/end", json={"final_reward": 1.0}, headers=auth)
        assert r.status_code == 200, r.text

    code, _ = run_serve([], check)
    assert code == 0


def test_no_self_rewarding_without_an_admin_key_is_refused(run_serve, capsys):
    def check(proxy: Proxy, url: str) -> None:
        raise AssertionError("the server started")

    code, proxy = run_serve(["--no-self-rewarding"], check)
    assert code == 2 and proxy is None
    err = capsys.readouterr().err
    assert "--no-self-rewarding" in err and "--admin-key" in err and "AREAL_ADMIN_KEY" in err


def test_no_self_rewarding_takes_the_admin_key_from_the_environment(run_serve, monkeypatch):
    monkeypatch.setenv("AREAL_ADMIN_KEY", ADMIN)

    def check(proxy: Proxy, url: str) -> None:
        assert proxy.self_rewarding is False and proxy.admin_key == ADMIN

    code, _ = run_serve(["--no-self-rewarding"], check)
    assert code == 0
