"""Training configuration: small frozen dataclasses, one per component.

``TrainConfig`` composes ``env``, ``model`` (with ``lora``), ``engine`` (the inference
engine: embedded, or vLLM / SGLang servers; :mod:`areal_agents.trainer.config_engine`),
``algorithm``, ``sampling``,
``rollout``, ``context`` (what the proxy does with conversations that outgrow the model's
context), ``optim``, ``loss``, ``critic`` (PPO's value model), ``advantage`` (the
estimator, when not the algorithm's own), ``train``, ``sft``,
``metrics``, ``agent`` (the user's agent in this process), ``workers`` (the worker API of
external agents) and ``scheduler``. Only ``env.id`` has no default (``model.path: null`` is the
default model, ``algorithm: grpo``). This module holds ``TrainConfig`` with its checks across
sections, the algorithm names and the sections of the model and its training; the sections
about episodes are in :mod:`areal_agents.trainer.config_rollout`, and reading and writing
YAML in :mod:`areal_agents.trainer.config_io`::

    cfg = load_config("run.yaml", ["rollout.group_size=16", "optim.betas=[0.9, 0.95]"])

``load_config`` checks every key, type and value and raises one ``ConfigError`` listing
every problem with its key and fix. It has no side effects. ``dump_yaml`` writes the
resolved config beside a run's outputs; loading that file gives an equal object.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from areal_agents.errors import ConfigError
from areal_agents.trainer.algorithms import (
    ALGORITHM_NAMES,
    CRITIC_ALGORITHMS,
    CRITIC_ESTIMATORS,
    DYNAMIC_SAMPLING_ALGORITHMS,
    GROUP_ALGORITHMS,
    AdvantageSpec,
    AlgorithmName,
    AlgorithmSpec,
    CriticConfig,
    LossSpec,
    overrides_of,
    resolve,
)
from areal_agents.trainer.config_checks import Checked, choice_problem, cores_ok
from areal_agents.trainer.config_engine import EngineConfig, engine_problems
from areal_agents.trainer.config_rollout import (
    CONTEXT_KEY_POLICIES,
    AgentConfig,
    ContextConfig,
    EnvConfig,
    EvalConfig,
    RewardsConfig,
    RolloutConfig,
    SamplingConfig,
    WorkersConfig,
)


@dataclass(frozen=True)
class LoraConfig(Checked):
    """Low-rank adapters (through peft); only the adapter is trained and synced."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight."""
    r: int = 16
    """Adapter rank."""
    alpha: float = 32.0
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Names (suffixes) of the linear modules that get adapters."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("r", self.r >= 1, ">= 1"),
            ("alpha", self.alpha > 0, "> 0"),
            ("dropout", 0 <= self.dropout < 1, "in [0, 1)"),
            ("target_modules", bool(self.target_modules) or not self.enabled, "non-empty"),
        )


@dataclass(frozen=True)
class ModelConfig(Checked):
    """The policy model: served for rollouts and trained."""

    path: str | None = None
    """Local directory or hub id; None = the offline default model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype. auto: the engine serves in bfloat16 where the device computes it
    natively (CUDA with bf16, CPUs with AVX512-BF16 / AMX / Arm BF16), else float32; the
    trainer holds the weights in bfloat16 only then and with LoRA (the frozen base), else
    float32. An explicit bfloat16 on a CPU without it runs far slower (a warning says so)."""
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None = cuda when available, else cpu."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters; off by default (full fine-tuning)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    max_context: int | None = None
    """Longest prompt + output in tokens: the engine stops there and the proxy refuses a
    prompt this long (400 ``context_length_exceeded``); None = the model's own limit."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        device_ok = bool(re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", self.device or "cpu"))
        return (
            ("device", device_ok, "'cpu', 'cuda', 'cuda:N' (or null = auto)"),
            ("max_context", self.max_context is None or self.max_context >= 1, ">= 1 or null"),
        )


@dataclass(frozen=True)
class OptimConfig(Checked):
    """The optimizer (AdamW) and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates, each in [0, 1)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; None = no clipping."""
    warmup_steps: int = 0
    """Training steps of linear warmup: step k of them runs at lr * k / warmup_steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warmup: constant, or decayed (linearly or along a half cosine) to
    0 at total_steps; counted in training steps, every mini-batch of a step at the same rate
    (formulas in ``areal_agents.trainer.schedule``). Logged as ``optim/lr``."""
    total_steps: int | None = None
    """Length of the schedule in training steps; None = train.steps."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        clip, total = self.grad_clip, self.total_steps
        return (
            ("lr", self.lr > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("betas", all(0 <= b < 1 for b in self.betas), "each in [0, 1)"),
            ("grad_clip", clip is None or clip > 0, "> 0 or null (no clipping)"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("total_steps", total is None or total >= 1, ">= 1 or null (= train.steps)"),
        )


if TYPE_CHECKING:  # made at run time from LossSpec / AdvantageSpec; typed loosely here
    LossConfig = Any
    AdvantageConfig = Any

LossConfig = overrides_of(  # type: ignore[misc]
    LossSpec,
    "LossConfig",
    """The policy loss (``areal_agents.trainer.loss.policy_loss``): each key overrides the
    algorithm's own value (null = the algorithm's; see ``areal_agents.trainer.algorithms``).""",
    __name__,
)
"""The ``loss`` section: ``LossSpec``'s fields as overrides (``overrides_of``)."""

AdvantageConfig = overrides_of(  # type: ignore[misc]
    AdvantageSpec,
    "AdvantageConfig",
    """The advantage estimator and its settings, when not the algorithm's own (null = the
    algorithm's: ``gae`` for ppo, ``group`` with its baseline and scale for the others).""",
    __name__,
)
"""The ``advantage`` section: ``AdvantageSpec``'s fields as overrides (``overrides_of``)."""


@dataclass(frozen=True)
class RunConfig(Checked):
    """The training loop: length, batching, seeds, outputs and checkpoints."""

    micro_batch_tokens: int = 16384
    """Token budget of one packed micro-batch; a step accumulates gradients over several."""
    share_prefixes: bool = True
    """Compute the prefixes that sequences share (a group's prompt) once per micro-batch,
    as a prefix tree with an attention mask; exact. Off: every sequence packed whole."""
    minibatches: int = 1
    """Optimizer steps per training step: the batch is split into this many mini-batches
    of whole episodes (whole groups when it divides their number), each one update with
    its loss averaged over its own samples, as PPO's mini-batches (``split_batch``). The
    weights reach the engine once per step, so policy versions still count steps. With
    ``loss.proximal=recompute`` every mini-batch is clipped against the policy before the
    step; with ``loglinear`` the later ones interpolate towards the already updated policy."""
    epochs: int = 1
    """Passes over each step's batch: every pass runs its ``minibatches`` updates again on
    the same episodes (PPO's epochs), so a step takes ``epochs * minibatches`` optimizer
    steps and still one policy version. More training per generated episode: with the engine
    and the trainer on cores of their own, it fills the trainer's wait for the next batch.
    The clip keeps the later passes near the proximal policy (exactly the policy before the
    step with ``loss.proximal=recompute``; ``loglinear`` interpolates towards the updated one)."""
    fill_passes: int = 0
    """Further passes over the last batch, made only while the next one is not complete: the
    trainer's wait for the engine filled with more training per generated episode. After a
    step's weights reach the engine, the trainer runs the step's policy updates again (a
    critic trains once per batch), one update at a time, until the next batch is in or
    ``fill_passes`` more passes are done, so it never holds the rollouts back by more than one
    update. The updates belong to the next
    policy version (the engine gets them with the next step's weights); the clip keeps them
    near the batch's proximal policy as with ``epochs``. Each step's metrics count them
    (``fill_updates``, ``fill_s``). For a trainer with cores (or a device) of its own: with
    the engine on the same CPU cores they take turns with its decoding. 0 = off."""
    steps: int = 200
    """Training steps (policy versions) to run."""
    seed: int = 0
    """Seed of everything random in the run."""
    output_dir: str = "runs/default"
    """Where checkpoints, metrics and the resolved config are written."""
    if_exists: Literal["refuse", "new"] = "refuse"
    """When ``output_dir`` already holds a run and this is no resume: refuse (name
    ``--resume`` and a new directory), or new: write to the first of ``output_dir-2``,
    ``-3``, ... that holds none (a run = checkpoints or a run.json)."""
    save_every: int = 50
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    time_limit_min: float | None = None
    """Wall-clock budget in minutes (warm start included, summed over resumes): the run stops
    after the last step expected to end within it (the next step, as long as the longest
    of the last four, would overrun it), then writes a checkpoint and the final model; None = no
    limit, run ``steps`` steps."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir."""
    nproc: int = 1
    """Trainer ranks: data-parallel FSDP2 ranks on ``torch.distributed`` (started by its
    elastic agent on this machine, or as Ray actors with ``scheduler: ray``). Each step's
    groups are split across them, and they compute the step that one process would."""
    fsdp: bool | None = None
    """Shard the policy (and critic) with FSDP2; None = when ``nproc > 1``. True with one
    rank lets a single device use ``cpu_offload``."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in CPU memory between uses
    (FSDP2's ``CPUOffloadPolicy``): less device memory, more host transfers."""
    collective_timeout_s: float = 600.0
    """How long a trainer rank waits in one collective before it gives up (a peer died or
    hangs); the run then ends with an error naming the rank."""
    cpus: tuple[int, ...] | None = None
    """CPU cores this process (the trainer, and with ``scheduler: local`` the engine and the
    episodes too) runs on, with that many torch threads (Linux ``sched_setaffinity``);
    None = every core. With ``scheduler: ray`` and ``rollout.engine_cpus`` on other cores,
    training and inference each get cores of their own, as on separate GPUs. Core numbers,
    or positions among the cores the command may use (``os.sched_getaffinity``, sorted),
    read when the config is loaded: ``allowed[1]`` (the second), ``allowed[2:4]`` (a
    Python slice), ``allowed`` (all of them). A position past the last core is an error
    that names the shared layout (``scheduler=local rollout.engine_cpus=null
    rollout.idle_engine_cpus=null train.cpus=null``)."""

    @property
    def sharded(self) -> bool:
        """Whether the trainer runs FSDP2 ranks (``fsdp``, default: ``nproc > 1``)."""
        return self.nproc > 1 if self.fsdp is None else self.fsdp

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        return (
            ("nproc", self.nproc >= 1, ">= 1"),
            (
                "fsdp",
                self.fsdp is not False or self.nproc == 1,
                "true or null with nproc > 1 (several ranks shard the model)",
            ),
            (
                "cpu_offload",
                not self.cpu_offload or self.sharded,
                "false unless the trainer is sharded (set train.fsdp=true)",
            ),
            ("collective_timeout_s", self.collective_timeout_s > 0, "> 0"),
            ("cpus", cores_ok(self.cpus), "a non-empty list of distinct core numbers >= 0"),
            ("micro_batch_tokens", self.micro_batch_tokens >= 1, ">= 1"),
            ("minibatches", self.minibatches >= 1, ">= 1 (1 = one update per step)"),
            ("epochs", self.epochs >= 1, ">= 1 (1 = one pass over each batch)"),
            ("fill_passes", self.fill_passes >= 0, ">= 0 (0 = off)"),
            ("steps", self.steps >= 1, ">= 1"),
            ("save_every", self.save_every >= 0, ">= 0 (0 = only at the end)"),
            (
                "time_limit_min",
                self.time_limit_min is None or self.time_limit_min > 0,
                "> 0 or null (no limit)",
            ),
            ("output_dir", bool(self.output_dir), "a directory"),
        )


@dataclass(frozen=True)
class SFTConfig(Checked):
    """Optional supervised warm start on demonstrations before RL."""

    enabled: bool = False
    """Run the warm start first."""
    demos: str | None = None
    """Path of the demonstrations (JSONL); required when enabled unless ``generate`` > 0."""
    generate: int = 0
    """Instead of reading ``demos``, write this many with the env's ``demos()`` (as
    ``areal-agent demos`` does) to ``sft_demos.jsonl`` in the run directory; 0 = off."""
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the env's ``demos()``, e.g. ``{kind: arithmetic}``."""
    epochs: int = 1
    """Passes over the demonstrations."""
    batch_size: int = 8
    """Demonstrations per optimizer step (``ceil(demos / batch_size)`` steps an epoch):
    fewer, longer demonstrations want a smaller batch for enough steps."""
    lr: float = 1e-5
    """Learning rate of the warm start, > 0."""
    kind: Literal["messages", "episodes"] = "messages"
    """Demo format: OpenAI chat messages (rendered by the chat template with the env's
    tools), or recorded episodes (an ``episodes.jsonl`` of ``areal-agent eval --out``),
    trained on their recorded samples: only the tokens the model sampled, skipping episodes
    that failed or ended in an error."""

    def _rules(self) -> Sequence[tuple[str, bool, str]]:
        episodes = self.kind == "episodes"
        return (
            (
                "demos",
                bool(self.demos) or self.generate > 0 or not self.enabled,
                "a JSONL path when sft is enabled (or set sft.generate to write demos)",
            ),
            (
                "kind",
                not (episodes and self.generate),
                "'messages' with sft.generate (it writes chat messages); or give recorded "
                "episodes as sft.demos and remove sft.generate",
            ),
            ("generate", self.generate >= 0, ">= 0 (0 = read sft.demos)"),
            ("epochs", self.epochs >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
        )


@dataclass(frozen=True)
class MetricsConfig(Checked):
    """Where training metrics go (always under train.output_dir)."""

    tensorboard: bool = True
    """Write TensorBoard event files."""
    jsonl: bool = True
    """Write one JSON line of metrics per step."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""


@dataclass(frozen=True)
class TrainConfig(Checked):
    """A whole training run. Only ``env.id`` has no default."""

    env: EnvConfig
    """The environment to train on."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The inference engine that generates the episodes: embedded, or vLLM / SGLang servers."""
    algorithm: AlgorithmName = "grpo"
    """The RL algorithm, which sets the advantage estimator and the loss (each defined,
    with its formula and paper, in ``areal_agents.trainer.algorithms``). The ``loss`` and
    ``advantage`` keys left null take its values."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling during rollouts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Episode collection and staleness."""
    context: ContextConfig = field(default_factory=ContextConfig)
    """What the proxy does with conversations that outgrow ``model.max_context``."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model and GAE (PPO only; the discount is ``rollout.gamma``, per turn)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """The advantage estimator, when not the algorithm's own (step-level groups, turn GAE)."""
    train: RunConfig = field(default_factory=RunConfig)
    """The training loop and its outputs."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Optional supervised warm start."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation before, during and after training."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Rewards beyond the env's: an LLM judge of the final answers."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The user's agent in this process; none = the model drives the env."""
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    """The worker API of external agents and self-rewarded services (``rollout.agents``)."""
    scheduler: Literal["local", "ray"] = "local"
    """Run every component in this process (local) or spread them over Ray."""

    def algorithm_spec(self) -> AlgorithmSpec:
        """The algorithm with this config's ``loss``, ``advantage`` and ``critic`` sections
        (``areal_agents.trainer.algorithms.resolve``): what the trainer receives."""
        return resolve(self.algorithm, self.loss, self.advantage, self.critic)

    @property
    def ray_rollout(self) -> bool:
        """Whether the episodes run on Ray rollout workers (``scheduler: ray`` with the
        embedded engine; with servers, Ray holds only the servers)."""
        return self.scheduler == "ray" and not self.engine.server

    def _self_rewarded_problems(self) -> list[str]:
        """``rollout.agents: self_rewarded`` has no env and no task handout: the keys that
        only those use would do nothing."""
        out = []
        if self.env.id is not None:
            out.append(
                "env.id: a self-rewarded run takes its episodes and rewards from the sessions "
                "a service opens; remove the env section, or use rollout.agents=external to "
                "have the env hand out tasks and score them"
            )
        if self.rollout.probe_size:
            out.append("rollout.probe_size: a self-rewarded run has no probe; set it to 0")
        if self.sft.enabled and self.sft.generate:
            out.append(
                "sft.generate: needs an env's demos(); give sft.demos (JSONL) in a "
                "self-rewarded run"
            )
        base = WorkersConfig()
        for name in ("heartbeat_timeout_s", "on_lost"):
            if getattr(self.workers, name) != getattr(base, name):
                out.append(
                    f"workers.{name}: applies to tasks handed out to external workers, and a "
                    "self-rewarded run hands out none (rollout.episode_timeout_s bounds a "
                    "group); remove it"
                )
        return out

    def _advantage_problems(self) -> list[str]:
        """``advantage.*`` against the algorithm: a critic estimator needs a critic, a group
        one none, and the step-group keys only do something with ``step_group``."""
        out, adv, alg = [], self.advantage, self.algorithm
        critic = alg in CRITIC_ALGORITHMS
        est = adv.estimator or ("gae" if critic else "group")
        if est in CRITIC_ESTIMATORS and not critic:
            out.append(
                f"advantage.estimator: {est!r} takes its advantages from a critic, but "
                f"algorithm {alg!r} trains none; set algorithm="
                f"{'|'.join(sorted(CRITIC_ALGORITHMS))}, or advantage.estimator=group|step_group"
            )
        elif est not in CRITIC_ESTIMATORS and critic:
            out.append(
                f"advantage.estimator: {est!r} normalizes within groups, but algorithm "
                f"{alg!r} takes its advantages from a critic; set advantage.estimator="
                "gae|turn_gae, or a group algorithm (e.g. algorithm=grpo)"
            )
        if est == "step_group" and alg not in GROUP_ALGORITHMS and self.rollout.group_size < 2:
            out.append(
                "rollout.group_size: advantage.estimator=step_group compares the turns of a "
                f"group's episodes, so it needs group_size >= 2, got {self.rollout.group_size}"
            )
        for name in ("omega", "step_scale"):
            if est != "step_group" and getattr(adv, name) is not None:
                out.append(
                    f"advantage.{name}: only advantage.estimator=step_group uses it, but the "
                    f"estimator is {est!r}; set advantage.estimator=step_group or remove "
                    f"advantage.{name}"
                )
        return out

    def _loss_problems(self) -> list[str]:
        """The ``loss.*`` and ``advantage.*`` overrides on the algorithm's preset (each value
        checked by ``LossSpec`` / ``AdvantageSpec``), and the off-policy correction that an
        asynchronous run needs."""
        try:
            spec = self.algorithm_spec()
        except ConfigError as exc:
            return exc.problems or [str(exc)]
        eta = self.rollout.max_head_offpolicyness
        if eta > 0 and spec.loss.behaviour_correction == "none":
            return [
                f"loss.behaviour_correction: 'none' is refused when training asynchronously "
                f"(rollout.max_head_offpolicyness={eta}): stale tokens need an off-policy "
                f"correction; set loss.behaviour_correction=clip (or mask), or "
                f"rollout.max_head_offpolicyness=0 for synchronous training"
            ]
        return []

    def _problems(self) -> list[str]:
        """Checks that span sections (each section checks itself), with full keys."""
        out, group = [], self.rollout.group_size
        if self.algorithm not in ALGORITHM_NAMES:
            out.append(choice_problem("algorithm", self.algorithm, ALGORITHM_NAMES))
        elif self.algorithm in GROUP_ALGORITHMS and group < 2:
            out.append(
                f"rollout.group_size: {self.algorithm} normalizes advantages within a group, "
                f"so it needs group_size >= 2, got {group}"
            )
        if self.rollout.probe_size and self.algorithm not in DYNAMIC_SAMPLING_ALGORITHMS:
            out.append(
                f"rollout.probe_size: only algorithms that drop uniform groups use a probe "
                f"({'|'.join(sorted(DYNAMIC_SAMPLING_ALGORITHMS))}), got algorithm="
                f"{self.algorithm}; set rollout.probe_size=0 or choose one of them"
            )
        if self.algorithm not in CRITIC_ALGORITHMS and self.critic != CriticConfig():
            out.append(
                f"critic: set, but algorithm {self.algorithm!r} trains no critic; remove the "
                f"critic section or choose algorithm={'|'.join(sorted(CRITIC_ALGORITHMS))}"
            )
        if self.algorithm in ALGORITHM_NAMES:
            fit = self._advantage_problems()  # an estimator that does not fit is said once
            out += fit + [p for p in self._loss_problems() if not (fit and "estimator" in p)]
        agents = self.rollout.agents
        self_rewarded = agents == "self_rewarded"
        if agents == "local" and self.workers != WorkersConfig():
            out.append(
                "workers: set, but rollout.agents is 'local'; set rollout.agents=external "
                "to serve the worker API, or remove the workers section"
            )
        if self.env.id is None and not self_rewarded:
            out.append("env.id: required, but missing")
        if self_rewarded:
            out.extend(self._self_rewarded_problems())
        if self.agent.train and agents == "local" and self.agent.factory is None:
            out.append(
                "agent.train: picks among the agents of agent-driven episodes, but the model "
                "drives the env here; set agent.factory (or rollout.agents=external), or "
                "remove agent.train"
            )
        if agents != "local" and self.agent.factory is not None:
            out.append(
                "agent.factory: external agents bring their own code (areal-agent worker "
                "--agent ...); remove agent.factory or set rollout.agents=local"
            )
        if agents != "local" and self.ray_rollout:
            out.append(
                f"rollout.agents: {agents} workers connect to this process's worker API; "
                "use scheduler=local with them (the workers themselves may run anywhere)"
            )
        elsewhere = agents in ("external", "self_rewarded") or self.ray_rollout
        if self.eval.episodes and elsewhere:
            out.append(
                "eval.episodes: the held-out evaluation runs episodes in this process (the "
                "model or agent.factory driving the env); with external workers, "
                "self-rewarded sessions or scheduler=ray, evaluate the checkpoints with "
                "areal-agent eval instead, and set eval.episodes=0"
            )
        if self.train.cpus is not None and self.train.nproc > 1:
            out.append(
                "train.cpus: pins this one trainer process, not the ranks that "
                f"train.nproc={self.train.nproc} starts; remove train.cpus or set train.nproc=1"
            )
        out.extend(engine_problems(self))
        judge = self.rewards.judge
        if judge.mode != "none" and judge.base_url is None and self.ray_rollout:
            out.append(
                "rewards.judge.base_url: with scheduler=ray the proxy is not in this "
                "process; give the judge's OpenAI-compatible URL (e.g. a served model)"
            )
        episodes = judge.calibration is None and judge.calibration_episodes > 0
        if judge.mode != "none" and episodes and (elsewhere or self.env.id is None):
            out.append(
                "rewards.judge.calibration: the judge's calibration episodes run in this "
                "process (the model or agent.factory driving the env); with external "
                "workers, self-rewarded sessions or scheduler=ray, give a labelled JSONL "
                "file (rewards.judge.calibration=path; rows {prompt or messages, answer, "
                "label})"
            )
        total = self.optim.total_steps or self.train.steps
        if self.optim.warmup_steps > total:
            out.append(
                f"optim.warmup_steps: must be <= the schedule's {total} steps, "
                f"got {self.optim.warmup_steps}"
            )
        ctx, new = self.model.max_context, self.sampling.max_new_tokens
        if ctx is not None and new > ctx:
            out.append(f"sampling.max_new_tokens: {new} exceeds model.max_context={ctx}")
        if ctx is not None and self.train.micro_batch_tokens < ctx:
            out.append(
                f"train.micro_batch_tokens: must be >= model.max_context={ctx} (one "
                f"full-length sequence fits a micro-batch), got {self.train.micro_batch_tokens}"
            )
        out.extend(self._context_problems())
        return out

    def _context_problems(self) -> list[str]:
        """``context.*`` against its policy, the model's context and the scheduler."""
        out: list[str] = []
        c, ctx, base = self.context, self.model.max_context, ContextConfig()
        for name, policies in CONTEXT_KEY_POLICIES.items():
            if c.policy not in policies and getattr(c, name) != getattr(base, name):
                out.append(
                    f"context.{name}: set, but context.policy={c.policy} does not use it; set "
                    f"context.policy={'|'.join(policies)} or remove context.{name}"
                )
        if c.policy == "fail":
            return out
        if self.ray_rollout:
            out.append(
                f"context.policy: {c.policy} is applied by the trainer's own proxy, and with "
                "scheduler=ray the rollout workers' proxies apply none; use scheduler=local "
                "or context.policy=fail"
            )
        limits = ["reserve_tokens"] + (["summary_max_tokens"] if c.policy == "summarize" else [])
        for name in limits:
            if ctx is not None and getattr(c, name) >= ctx:
                out.append(
                    f"context.{name}: must be below model.max_context={ctx}, got "
                    f"{getattr(c, name)}; lower it or raise model.max_context"
                )
        return out
