"""Shared pieces of the training benchmarks (``async_vs_sync.py``, ``trl_grpo.py``).

* Two benchmark environments, registered at import under the ``bench/`` namespace:

  - ``bench/SlowCalculator-v0`` (:class:`SlowCalculatorEnv`): ``areal/Calculator-v0`` whose
    every step (running the tool call, or grading the answer) takes a seeded, heavy-tailed
    time: log-normal (median ``delay_median``, log-sd ``delay_sigma``) clipped to
    ``[delay_min, delay_max]``. It stands for slow tools, sandboxes, graders and simulated
    users. The delay of a step is a function of the episode's reset seed, the turn and the
    assistant message, so a run is reproducible and the episodes of a group (same task,
    different samples) wait different times;
  - ``bench/Arithmetic-v0`` (:class:`ArithmeticEnv`): single-turn arithmetic without tools
    (the calculator task's arithmetic questions; reward 1 for a correct final number).

* :func:`resolve_bench_model`: ``default`` (SmolLM2-135M-Instruct), ``tiny`` (a seeded random
  ~3M-parameter Llama with the default model's tokenizer and chat template, built once, for
  smoke runs) or a model directory.
* :class:`TimedTrainer`: the real ``areal_agents.trainer.loop.Trainer`` (the code path of
  ``areal-agent train``), recording when rollouts start and when each step ends.

Importing this module imports torch (through the trainer): the scripts import it after
parsing their arguments, so that ``--help`` stays instant.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from areal_agents.envs.base import as_assistant_message  # noqa: E402
from areal_agents.envs.math.env import CalculatorEnv  # noqa: E402
from areal_agents.envs.registry import register  # noqa: E402
from areal_agents.tools.tool import Tool  # noqa: E402
from areal_agents.trainer.config import TrainConfig  # noqa: E402
from areal_agents.trainer.loop import StepMetrics, Trainer  # noqa: E402

SLOW_ENV_ID = "bench/SlowCalculator-v0"
ARITHMETIC_ENV_ID = "bench/Arithmetic-v0"
ARITHMETIC_SYSTEM_PROMPT = (
    "You are a careful assistant. Work out the arithmetic and reply with: The answer is <number>."
)


class SlowCalculatorEnv(CalculatorEnv):
    """Calculator-v0 whose every step takes a seeded, heavy-tailed time (see the module doc).

    Args:
        delay_min, delay_max: Clip of a step's delay in seconds [0.2, 2.0].
        delay_median: Median of the log-normal before clipping [0.5].
        delay_sigma: Standard deviation of the delay's logarithm [1.0].
        delay_seed: Changes every delay of the run [0].
        **kwargs: Passed to :class:`CalculatorEnv` (``kind``, ``few_shot``, ``split``, ...).
    """

    def __init__(
        self,
        *,
        delay_min: float = 0.2,
        delay_max: float = 2.0,
        delay_median: float = 0.5,
        delay_sigma: float = 1.0,
        delay_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if not 0 <= delay_min <= delay_max:
            raise ValueError(f"need 0 <= delay_min <= delay_max, got {delay_min}, {delay_max}")
        if delay_median <= 0 or delay_sigma < 0:
            raise ValueError(
                f"need delay_median > 0 and delay_sigma >= 0, got {delay_median}, {delay_sigma}"
            )
        super().__init__(**kwargs)
        self.delay_min, self.delay_max = float(delay_min), float(delay_max)
        self.delay_median, self.delay_sigma = float(delay_median), float(delay_sigma)
        self.delay_seed = delay_seed
        self._episode_key = ""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        self._episode_key = f"{self.delay_seed}:{seed}:{info.get('task_id')}"
        return obs, info

    def step_delay(self, action: Mapping[str, Any] | str) -> float:
        """The seconds that step ``action`` of the current turn takes."""
        try:
            text = json.dumps(as_assistant_message(action), sort_keys=True, default=str)
        except TypeError:
            text = repr(action)
        key = f"{self._episode_key}:{self.turns}:{text}".encode()
        rng = random.Random(hashlib.sha256(key).hexdigest())
        value = rng.lognormvariate(math.log(self.delay_median), self.delay_sigma)
        return min(max(value, self.delay_min), self.delay_max)

    def step(
        self, action: dict[str, Any] | str
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        delay = self.step_delay(action) if self._active else 0.0
        time.sleep(delay)
        obs, reward, terminated, truncated, info = super().step(action)
        info["env_delay_s"] = delay
        return obs, reward, terminated, truncated, info


class ArithmeticEnv(CalculatorEnv):
    """Single-turn arithmetic without tools: the question in, "The answer is N." out.

    Args:
        split: ``"train"`` or ``"test"``.
        num_tasks: Pool size [5000 train, 500 test].
        system_prompt: The system message.
    """

    def __init__(
        self,
        *,
        split: str = "train",
        num_tasks: int | None = None,
        system_prompt: str = ARITHMETIC_SYSTEM_PROMPT,
    ) -> None:
        super().__init__(
            split=split,  # type: ignore[arg-type]
            kind="arithmetic",
            num_tasks=num_tasks,
            few_shot=0,
            max_turns=1,
            max_attempts=1,
            system_prompt=system_prompt,
        )

    def _episode_tools(self) -> list[Tool]:
        return []


register(
    SLOW_ENV_ID,
    SlowCalculatorEnv,
    description="Calculator-v0 whose every step takes a seeded heavy-tailed 0.2-2 s (benchmark)",
)
register(
    ARITHMETIC_ENV_ID,
    ArithmeticEnv,
    description="Single-turn arithmetic without tools (benchmark)",
)


def arithmetic_prompts(n: int, seed_base: int) -> list[dict[str, Any]]:
    """The messages and gold answer of ``bench/Arithmetic-v0`` at seeds ``seed_base + i``: the
    tasks the trainer's group i uses when ``env.seed = seed_base``."""
    env = ArithmeticEnv()
    rows = []
    for i in range(n):
        messages, _ = env.reset(seed=seed_base + i)
        assert env.task is not None
        rows.append({"prompt": messages, "answer": env.task.answer})
    env.close()
    return rows


# ------------------------------------------------------------------------------ models
def resolve_bench_model(name: str) -> str:
    """``default`` -> the default model; ``tiny`` -> :func:`tiny_model_dir`; else a path."""
    from areal_agents.model import resolve_model

    if name == "tiny":
        return str(tiny_model_dir())
    return resolve_model(None if name == "default" else name)


def tiny_model_dir() -> Path:
    """A seeded random ~3M-parameter Llama with the default model's tokenizer, built once
    under the areal-agents cache (for smoke runs: it trains and generates, but learns
    nothing useful in a few steps)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_agents.model import cache_dir, resolve_model

    target = cache_dir() / "models" / "bench-tiny-llama"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    source = Path(resolve_model(None, quiet=True))
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation")):
            shutil.copy(f, tmp / f.name)
    base = json.loads((source / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp)  # float32, torch's default
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


# ------------------------------------------------------------------------------ trainer
class TimedTrainer(Trainer):
    """``areal_agents.trainer.loop.Trainer`` recording the start of rollouts and the end of each
    step.

    ``t_start`` is taken when the engine, policy and runner are built (rollouts start right
    after); ``step_ends[k]`` when step k's optimizer step returns (before its weights reach
    the engine). CPU time of the whole process (all threads) is taken at the same points.
    """

    def __init__(self, cfg: TrainConfig, *, quiet: bool = False) -> None:
        super().__init__(cfg, quiet=quiet)
        self.t_start = 0.0
        self.cpu_start = 0.0
        self.step_ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.step_stats: list[dict[str, Any]] = []
        self.episodes_per_step: list[int] = []
        self.cores_start: dict[int, float] = {}
        self.cores_end: dict[int, float] = {}

    def _build(self) -> None:
        super()._build()
        self.t_start, self.cpu_start = time.perf_counter(), time.process_time()
        self.cores_start = core_busy_s()

    async def _train_step(self, *args: Any, **kwargs: Any) -> StepMetrics:
        got = args[0] if args else kwargs["got"]
        step = await super()._train_step(*args, **kwargs)
        self.step_ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.cores_end = core_busy_s()
        self.episodes_per_step.append(sum(len(eps) for _, eps in got))
        return step

    async def _publish(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        scalars = await super()._publish(*args, **kwargs)
        self.step_stats.append(scalars)  # the step's metrics as logged (weight sync, time/*)
        return scalars

    def engine_stats(self) -> dict[str, int]:
        """The engine's counters (requests, prefills, decode steps, output tokens)."""
        return dict(getattr(self.engine, "_stats", {}))


def core_busy_s() -> dict[int, float]:
    """Seconds each CPU core of the machine has been busy since boot (``/proc/stat``: all
    time but idle and iowait), every process counted: an engine in a process of its own
    too. Spinning OpenMP threads count as busy, so the benchmarks run with
    ``OMP_WAIT_POLICY=passive``. Empty where ``/proc/stat`` does not exist."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(x) for x in fields[:8]]
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4]) / tick
    return out


def core_busy_between(start: Mapping[int, float], end: Mapping[int, float]) -> dict[int, float]:
    """Busy seconds of each core between two :func:`core_busy_s` readings."""
    return {c: end[c] - start[c] for c in start if c in end}


def ray_worker_setup() -> None:
    """Ray's ``worker_process_setup_hook`` for runs whose episodes run on Ray workers:
    importing this module registers the ``bench/`` envs there."""


def set_threads(threads: int | None) -> int:
    """Use ``threads`` torch threads (None: torch's default); returns the number in use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def load_average() -> str:
    """The 1-minute load average, for the README's "load" column."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"
