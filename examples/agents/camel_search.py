"""A CAMEL-AI ChatAgent on areal/Search-v0, against a running proxy (``areal-agent serve``).

Per question: open a proxy session (``POST /sessions``), build the env here and give the
agent the env's ``search`` and ``open`` tools; the env scores the agent's answer, the score
is posted as the session's final reward, and the recorded trajectory is printed.
CAMEL and torch cannot share a venv: serve from the main one, run this from CAMEL's:
    .venv/bin/areal-agent serve --port 8000
    VENV/bin/python examples/agents/camel_search.py --base-url http://127.0.0.1:8000
"""

import argparse
import os

import httpx
from camel.agents import ChatAgent

from areal_agents import envs
from areal_agents.integrations.camel import as_function_tools, session_model


def run_episode(http: httpx.Client, seed: int, args: argparse.Namespace) -> bool:
    env = envs.make("areal/Search-v0", split="test")
    messages, info = env.reset(seed=seed)  # [system prompt, question]
    made = http.post("/sessions", json={"task_id": info["task_id"]}).raise_for_status().json()
    model = session_model(
        made["base_url"],
        made["api_key"],
        model_config_dict={"temperature": 0.7, "max_tokens": args.max_tokens},
    )
    agent = ChatAgent(
        messages[0]["content"],
        model=model,
        tools=as_function_tools(env.tools()),
        max_iteration=args.max_iterations,
    )
    try:
        response = agent.step(messages[-1]["content"])
        answer, error = (response.msgs[0].content if response.msgs else ""), None
    except Exception as exc:  # a failed model call is data: score what there is, go on
        answer, error = "", repr(exc)
    reward, score = env.score([*messages, {"role": "assistant", "content": answer}])
    auth = {"Authorization": f"Bearer {made['api_key']}"}
    end = {"final_reward": reward, "reason": "agent_error" if error else "terminated"}
    http.post(f"/sessions/{made['id']}/end", json=end, headers=auth).raise_for_status()
    traj = http.get(f"/sessions/{made['id']}/trajectory", headers=auth).raise_for_status().json()
    print(
        f"task={info['task_id']} reward={reward:.2f} success={score['success']} "
        f"predicted={(score.get('predicted') or '')[:60]!r} answers={score.get('answers')} "
        f"error={error}"
    )
    for c in traj["completions"]:
        calls = [t["function"]["name"] for t in c["message"].get("tool_calls") or []]
        said = f"tool calls {calls}" if calls else " ".join((c["message"]["content"] or "").split())
        print(
            f"  completion: {len(c['prompt_ids'])} prompt + {len(c['output_ids'])} output "
            f"tokens, return {c['return']:.2f}: {said[:90]}"
        )
    print(f"  recorded: {traj['metrics']}")
    return bool(score["success"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True, help="the proxy, e.g. http://127.0.0.1:8000")
    parser.add_argument("--admin-key", default=os.environ.get("AREAL_ADMIN_KEY"))
    parser.add_argument("--episodes", type=int, default=2, help="questions of the test split")
    parser.add_argument("--max-iterations", type=int, default=3, help="model calls per question")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per model call")
    args = parser.parse_args()
    root = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    with httpx.Client(base_url=root, headers=headers, timeout=600) as http:
        wins = sum(run_episode(http, seed, args) for seed in range(args.episodes))
    print(f"episodes={args.episodes} success={wins}/{args.episodes}")


if __name__ == "__main__":
    main()
