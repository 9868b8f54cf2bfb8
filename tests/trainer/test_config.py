"""The training config: one loader, YAML plus dotted overrides, every problem at once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_agents.errors import ConfigError
from areal_agents.trainer.config import LoraConfig, LossConfig, TrainConfig
from areal_agents.trainer.config_io import dump_yaml, format_config, load_config, to_dict
from areal_agents.trainer.config_rollout import EnvConfig, RolloutConfig

FULL_YAML = """\
env:
  id: areal/Tau2Retail-v0
  kwargs: {user_model: scripted, max_tasks: 20}
  split: test
  seed: 7
model:
  path: /models/tiny
  dtype: float32
  device: cuda:1
  lora: {enabled: true, r: 8, alpha: 16, dropout: 0.05, target_modules: [q_proj, v_proj]}
  activation_checkpointing: true
  max_context: 4096
algorithm: dapo
sampling:
  {temperature: 0.8, top_p: 0.95, top_k: 50, max_new_tokens: 256,
   by_kind: {word: {temperature: 0.7}}}
rollout:
  agents: local
  group_size: 4
  batch_size: 2
  max_head_offpolicyness: 0
  concurrency: 8
  max_turns: 6
  episode_timeout_s: null
  gamma: 0.9
  probe_size: 2
  kv_on_update: keep
  engine_cpus: [0]
  idle_engine_cpus: [1]
context: {policy: fail, reserve_tokens: 512, keep_last_turns: 2, summary_max_tokens: 512,
          summary_trained: false}
rewards:
  judge: {mode: rubric, base_url: "http://127.0.0.1:8011/v1", model: judge, api_key_env: null,
          rubric: {correct: {description: The answer names the right entity., weight: 2.0},
                   concise: {description: At most two sentences., weight: 1.0}},
          scoring: text, include_trace: true, max_answer_chars: 1000, max_tokens: 64,
          temperature: 0.0, timeout_s: 30.0, retries: 2, concurrency: 2, self: false,
          reference: answers, calibration: judge_labels.jsonl, calibration_episodes: 64,
          min_auc: 0.6}
  judge_weight: 0.5
  env_weight: 0.8
optim:
  lr: 2e-6
  weight_decay: 0.01
  betas: [0.9, 0.95]
  grad_clip: null
  warmup_steps: 5
  schedule: cosine
  total_steps: 50
loss:
  clip_low: 0.2
  clip_high: 0.28
  ratio_level: sequence
  behaviour_correction: none
  behaviour_cap: 3
  proximal: loglinear
  kl_coef: 0.001
  kl_estimator: k2
  entropy_coef: 0.01
  agg: sum_norm
  weighting: token
  sapo_tau_pos: null
  sapo_tau_neg: null
  m2po_tau: null
critic: {path: null, lr: 1.0e-5, lam: 0.95, value_clip: 0.2, whiten: true}
advantage:
  {estimator: step_group, baseline: rloo, scale: none, eps: 1.0e-5, omega: 0.5, step_scale: none}
train:
  micro_batch_tokens: 8192
  share_prefixes: false
  minibatches: 2
  epochs: 2
  fill_passes: 1
  steps: 40
  seed: 3
  output_dir: runs/tau2
  if_exists: new
  save_every: 10
  time_limit_min: 30
  resume: true
  nproc: 1
  fsdp: false
  cpu_offload: false
  collective_timeout_s: 300.0
  cpus: [1, 2]
sft:
  enabled: true
  demos: demos.jsonl
  generate: 0
  generate_kwargs: {kind: word}
  epochs: 2
  batch_size: 4
  lr: 1.0e-5
  kind: episodes
metrics: {tensorboard: false, jsonl: true, wandb: false}
engine:
  backend: embedded
  launch: {servers: 1, python: null, module: null, args: "", port: 0, log: null, gpus: 0,
           env: {}, start_timeout_s: 900.0, max_restarts: 3}
  urls: []
  lora_updates: adapter
  weights_dir: null
eval: {episodes: 0, seed: 3, split: dev, env_kwargs: {max_tasks: 5}, temperature: 0.5, every: 0}
agent: {factory: "my_pkg.agents:make_agent", kwargs: {temperature: 0.5}, train: [solver]}
workers: {host: 127.0.0.1, port: 0, token: null, heartbeat_timeout_s: 30.0, on_lost: redo}
scheduler: ray
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path | None, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_full_yaml_is_read_into_every_field(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL_YAML), [])

    assert cfg.env == EnvConfig(
        id="areal/Tau2Retail-v0",
        kwargs={"user_model": "scripted", "max_tasks": 20},
        split="test",
        seed=7,
    )
    assert cfg.model.lora == LoraConfig(
        enabled=True, r=8, alpha=16.0, dropout=0.05, target_modules=("q_proj", "v_proj")
    )
    assert (cfg.model.path, cfg.model.dtype, cfg.model.device) == (
        "/models/tiny",
        "float32",
        "cuda:1",
    )
    assert cfg.model.activation_checkpointing is True and cfg.model.max_context == 4096
    assert cfg.algorithm == "dapo" and cfg.scheduler == "ray"
    assert (cfg.eval.seed, cfg.eval.split, cfg.eval.temperature) == (3, "dev", 0.5)
    assert cfg.eval.env_kwargs == {"max_tasks": 5} and cfg.eval.episodes == cfg.eval.every == 0
    assert cfg.sampling.top_k == 50 and cfg.sampling.temperature == 0.8
    assert cfg.sampling.by_kind == {"word": {"temperature": 0.7}}
    assert cfg.rollout.episode_timeout_s is None and cfg.rollout.gamma == 0.9
    assert cfg.optim.lr == 2e-6 and isinstance(cfg.optim.lr, float)  # '2e-6' is a float
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.grad_clip is None
    assert cfg.loss.behaviour_cap == 3.0 and isinstance(cfg.loss.behaviour_cap, float)
    assert (cfg.loss.proximal, cfg.loss.agg, cfg.loss.weighting) == (
        "loglinear",
        "sum_norm",
        "token",
    )
    assert cfg.train.resume is True and cfg.train.output_dir == "runs/tau2"
    assert cfg.train.if_exists == "new"
    assert cfg.train.share_prefixes is False and cfg.train.minibatches == 2
    assert cfg.train.epochs == 2
    assert cfg.train.fill_passes == 1
    assert (cfg.train.nproc, cfg.train.fsdp, cfg.train.sharded) == (1, False, False)
    assert cfg.train.collective_timeout_s == 300.0
    assert cfg.rollout.probe_size == 2
    assert (cfg.rollout.engine_cpus, cfg.train.cpus) == ((0,), (1, 2))
    assert cfg.rollout.idle_engine_cpus == (1,)
    assert cfg.rollout.kv_on_update == "keep"
    assert cfg.sft.kind == "episodes" and cfg.sft.lr == 1e-5
    assert cfg.metrics.tensorboard is False
    assert (cfg.advantage.estimator, cfg.advantage.omega) == ("step_group", 0.5)
    assert (cfg.advantage.baseline, cfg.advantage.scale, cfg.advantage.eps) == (
        "rloo",
        "none",
        1e-5,
    )
    assert (cfg.loss.ratio_level, cfg.loss.kl_estimator) == ("sequence", "k2")
    spec = cfg.algorithm_spec()  # every override on dapo's preset
    assert (spec.loss.ratio_level, spec.loss.behaviour_cap, spec.advantage.baseline) == (
        "sequence", 3.0, "rloo",
    )  # fmt: skip
    assert cfg.rewards.judge.rubric["correct"]["weight"] == 2.0
    assert (cfg.rewards.judge.calibration, cfg.rewards.judge.min_auc) == ("judge_labels.jsonl", 0.6)
    assert (cfg.rewards.judge_weight, cfg.rewards.env_weight) == (0.5, 0.8)

    # The whole file, section by section, comes back out of to_dict.
    assert to_dict(cfg) == yaml.safe_load(FULL_YAML.replace("2e-6", "2.0e-6"))


def test_dump_then_reload_is_equal(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, FULL_YAML),
        [
            "env.kwargs.nested={a: [1, 2]}",
            "model.path=null",
            "optim.lr=3e-7",
            "env.split='1e-6'",  # a string that reads as a float unless quoted
            "train.output_dir='8'",
        ],
    )
    out = tmp_path / "out" / "run" / "config.yaml"
    dump_yaml(cfg, out)

    again = load_config(out, [])
    assert again == cfg
    assert (again.env.split, again.train.output_dir) == ("1e-6", "8")
    assert not list(out.parent.glob("*.tmp"))
    assert "rollout.group_size (default 8)" in out.read_text()  # changes are listed

    defaults = load_config(None, ["env.id=areal/Math-v0"])
    dump_yaml(defaults, out)
    assert load_config(out, []) == defaults


def test_defaults_need_only_the_env_id(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "env: {id: areal/Math-v0}\n"), [])

    assert cfg == TrainConfig(env=EnvConfig(id="areal/Math-v0"))
    assert cfg.model.path is None  # the default model
    assert cfg.algorithm == "grpo"
    assert cfg.rollout.group_size >= 2 and cfg.rollout.max_head_offpolicyness > 0
    # The loss is the algorithm's own unless a value is given (null = the algorithm's).
    assert set(dataclasses.asdict(cfg.loss).values()) == {None}
    assert cfg.algorithm_spec().loss.proximal == "recompute"
    assert cfg.scheduler == "local" and cfg.model.lora.enabled is False
    assert load_config(None, ["env.id=areal/Math-v0"]) == cfg
    assert load_config(write(tmp_path, "", "empty.yaml"), ["env.id=areal/Math-v0"]) == cfg


def test_partial_sections_keep_the_other_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, "env: {id: x}\nrollout: {group_size: 16}\nmodel: {lora: {r: 4}}\n")
    cfg = load_config(path, [])
    assert cfg.rollout == dataclasses.replace(RolloutConfig(), group_size=16)
    assert cfg.model.lora == LoraConfig(r=4)


def test_overrides_at_every_depth(tmp_path: Path) -> None:
    path = write(tmp_path, "env: {id: x, kwargs: {level: 1}}\nmodel: {max_context: 2048}\n")
    cfg = load_config(
        path,
        [
            "algorithm=ppo",  # top level
            "rollout.group_size=1",  # ppo needs no group
            "model.lora.enabled=true",  # three levels, bool
            "model.lora.target_modules=[q_proj, k_proj]",  # list
            "model.max_context=null",  # null replaces the file's value
            "rollout.episode_timeout_s=null",
            "optim.betas=[0.8, 0.99]",
            "optim.lr=5e-6",
            "optim.total_steps=1e3",  # an integral float is an int
            "env.kwargs.tools.python=false",  # into the free kwargs mapping
            "train.output_dir=runs/a=b",  # only the first '=' splits
            "env.split='123'",  # quoted: a string
            "loss.weighting=completion",  # an optional choice
            "loss.agg=null",
        ],
    )
    assert (cfg.loss.weighting, cfg.loss.agg) == ("completion", None)
    assert cfg.algorithm == "ppo" and cfg.rollout.group_size == 1
    assert cfg.model.lora.enabled is True
    assert cfg.model.lora.target_modules == ("q_proj", "k_proj")
    assert cfg.model.max_context is None and cfg.rollout.episode_timeout_s is None
    assert cfg.optim.betas == (0.8, 0.99) and cfg.optim.lr == 5e-6
    assert cfg.optim.total_steps == 1000 and isinstance(cfg.optim.total_steps, int)
    assert cfg.env.kwargs == {"level": 1, "tools": {"python": False}}
    assert cfg.train.output_dir == "runs/a=b" and cfg.env.split == "123"


def test_later_override_wins() -> None:
    cfg = load_config(None, ["env.id=x", "rollout.group_size=4", "rollout.group_size=6"])
    assert cfg.rollout.group_size == 6


def test_unknown_keys_are_rejected_with_the_nearest_key(tmp_path: Path) -> None:
    path = write(tmp_path, "env: {id: x}\nrollout: {group_sise: 4}\nmodle: {}\n")
    problems = problems_of(path, ["model.lora.rnak=8", "lr=1e-5", "zzz=1"])

    assert "unknown key 'rollout.group_sise'; did you mean 'rollout.group_size'?" in problems
    assert "unknown key 'modle'; did you mean 'model'?" in problems
    assert (
        "unknown key 'model.lora.rnak'; valid keys here: "
        "enabled, r, alpha, dropout, target_modules" in problems
    )
    assert "unknown key 'lr'; did you mean 'optim.lr' or 'critic.lr' or 'sft.lr'?" in problems
    (zzz,) = [p for p in problems if "'zzz'" in p]
    assert "valid keys here: env, model, engine, algorithm" in zzz


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "env: {id: x}\noptim: {lr: 0}\nrollout: {gamma: 1.5}\n")
    with pytest.raises(ConfigError) as info:
        load_config(
            path,
            [
                "rollout.group_sise=4",
                "rollout.batch_size=abc",
                "loss.agg=avg",
                "sampling.top_p=0",
                "train.steps=0",
            ],
        )
    problems = info.value.problems
    assert len(problems) == 7, problems
    for key in ("optim.lr", "rollout.gamma", "rollout.group_sise", "rollout.batch_size"):
        assert any(key in p for p in problems), key
    assert "optim.lr: must be > 0, got 0.0" in problems
    assert "rollout.gamma: must be in [0, 1], got 1.5" in problems
    assert all(p in str(info.value) for p in problems)  # the message lists them too


def test_sampling_by_kind_values_are_checked(tmp_path: Path) -> None:
    problems = problems_of(
        None,
        [
            "env.id=x",
            "sampling.by_kind={word: {temperature: 0, top_k: 2.5}, math: {temprature: 1.0}, x: 3}",
        ],
    )
    assert sorted(problems) == [
        "sampling.by_kind.math.temprature: must be one of temperature, top_p, top_k "
        "(unknown key), got 1.0",
        "sampling.by_kind.word.temperature: must be > 0 for training, got 0",
        "sampling.by_kind.word.top_k: must be an integer >= 0 (0 disables), got 2.5",
        "sampling.by_kind.x: expected a mapping such as {temperature: 1.0}",
    ]
    ok = load_config(None, ["env.id=x", "sampling.by_kind={word: {temperature: 0.7, top_k: 5}}"])
    assert ok.sampling.by_kind == {"word": {"temperature": 0.7, "top_k": 5}}


def test_type_errors_name_the_key_and_both_types(tmp_path: Path) -> None:
    problems = problems_of(
        None,
        [
            "env.id=x",
            "rollout.group_size=abc",
            "rollout.concurrency=true",  # a bool is not an int
            "rollout.max_turns=2.5",
            "model.activation_checkpointing=maybe",
            "optim.lr=fast",
            "optim.betas=[0.9]",
            "model.lora.target_modules=q_proj",
            "env.split=5",
            "env.kwargs=[1]",
            "sampling=7",
        ],
    )
    assert problems == [
        "env.kwargs: expected a mapping with string keys, got [1]",
        "env.split: expected str, got 5",
        "model.lora.target_modules: expected a list of str, got 'q_proj'",
        "model.activation_checkpointing: expected bool, got 'maybe'",
        "sampling: expected a mapping of keys, got 7",
        "rollout.group_size: expected int, got 'abc'",
        "rollout.concurrency: expected int, got True",
        "rollout.max_turns: expected int, got 2.5",
        "optim.lr: expected float, got 'fast'",
        "optim.betas: expected a list of float (length 2), got [0.9]",
    ]


def test_choices_list_the_options() -> None:
    problems = problems_of(
        None,
        [
            "env.id=x",
            "loss.behaviour_correction=clamp",
            "scheduler=slurm",
            "algorithm=grop",
            "model.dtype=fp16",
        ],
    )
    assert (
        "loss.behaviour_correction: expected one of 'clip', 'mask', 'none', got 'clamp'; "
        "did you mean 'clip'?" in problems
    )
    assert "scheduler: expected one of 'local', 'ray', got 'slurm'" in problems
    assert (
        "model.dtype: expected one of 'auto', 'float32', 'bfloat16', 'float16', got 'fp16'"
        in problems[0]
    )
    (algorithm,) = [p for p in problems if p.startswith("algorithm:")]
    assert "'grpo', 'dr_grpo'" in algorithm and "did you mean 'grpo'?" in algorithm


def test_async_without_a_correction_is_refused() -> None:
    problems = problems_of(
        None,
        ["env.id=x", "rollout.max_head_offpolicyness=4", "loss.behaviour_correction=none"],
    )
    assert len(problems) == 1
    assert problems[0].startswith("loss.behaviour_correction:")
    assert "set loss.behaviour_correction=clip (or mask)" in problems[0]

    sync = load_config(
        None, ["env.id=x", "rollout.max_head_offpolicyness=0", "loss.behaviour_correction=none"]
    )
    assert sync.loss.behaviour_correction == "none"


def test_cross_section_checks() -> None:
    problems = problems_of(
        None,
        [
            "env.id=x",
            "rollout.group_size=1",  # grpo normalizes within a group
            "optim.warmup_steps=500",
            "train.steps=100",
            "model.max_context=1024",
            "sampling.max_new_tokens=2048",
            "train.micro_batch_tokens=512",
            "sft.enabled=true",
        ],
    )
    joined = "\n".join(problems)
    assert "rollout.group_size: grpo normalizes advantages within a group" in joined
    assert "optim.warmup_steps: must be <= the schedule's 100 steps, got 500" in problems
    assert "sampling.max_new_tokens: 2048 exceeds model.max_context=1024" in problems
    assert "train.micro_batch_tokens: must be >= model.max_context=1024" in joined
    assert (
        "sft.demos: must be a JSONL path when sft is enabled (or set sft.generate to write "
        "demos), got None"
    ) in problems


def test_missing_env_id_and_bad_input() -> None:
    assert problems_of(None, []) == ["env.id: required, but missing"]
    assert problems_of(None, ["rollout.group_size", "=3", "a..b=1"]) == [
        "override 'rollout.group_size': expected key=value, e.g. rollout.group_size=8",
        "override '=3': expected key=value, e.g. rollout.group_size=8",
        "override 'a..b=1': expected key=value, e.g. rollout.group_size=8",
    ]
    (bad,) = problems_of(None, ["env.id=[x"])
    assert bad.startswith("override 'env.id=[x': cannot parse")


def test_file_problems(tmp_path: Path) -> None:
    (missing,) = problems_of(tmp_path / "nope.yaml", [])
    assert missing.startswith("cannot read config file") and "nope.yaml" in missing
    (syntax,) = problems_of(write(tmp_path, "env: {id: x\n"), [])
    assert "cannot read config file" in syntax
    (dup,) = problems_of(write(tmp_path, "env: {id: x}\nrollout: {}\nrollout: {}\n"), [])
    assert "duplicate key 'rollout'" in dup
    (top,) = problems_of(write(tmp_path, "- env\n"), [])
    assert "expected a mapping of keys, got ['env']" in top


def test_loading_touches_no_globals(tmp_path: Path) -> None:
    path = write(tmp_path, "env: {id: x, kwargs: {a: 1}}\nrollout: {group_size: 4}\n")
    before = path.read_text()
    overrides = ["rollout.group_size=16", "env.kwargs.b=2"]

    first = load_config(path, overrides)
    second = load_config(path, ["sampling.temperature=0.5"])
    third = load_config(path, [])

    assert first.rollout.group_size == 16 and first.env.kwargs == {"a": 1, "b": 2}
    assert second.rollout.group_size == 4 and second.sampling.temperature == 0.5
    assert second.env.kwargs == {"a": 1}
    assert third.sampling.temperature == 1.0 and third.env.kwargs == {"a": 1}
    assert first.env.kwargs is not third.env.kwargs
    assert overrides == ["rollout.group_size=16", "env.kwargs.b=2"]
    assert path.read_text() == before
    assert TrainConfig(env=EnvConfig(id="x")).rollout.group_size == 8  # defaults untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.rollout.group_size = 2  # type: ignore[misc]


def test_dataclasses_check_themselves_when_built() -> None:
    with pytest.raises(ConfigError) as info:
        RolloutConfig(gamma=2.0, group_size=0)
    assert info.value.problems == [
        "group_size: must be >= 1, got 0",
        "gamma: must be in [0, 1], got 2.0",
    ]
    with pytest.raises(ConfigError) as info:
        TrainConfig(env=EnvConfig(id="x"), loss=LossConfig(behaviour_correction="none"))
    assert "set loss.behaviour_correction=clip (or mask)" in str(info.value)


def test_format_config_shows_the_changes() -> None:
    text = format_config(load_config(None, ["env.id=x", "rollout.group_size=4"]))
    assert "rollout:\n  group_size: 4\n" in text
    assert text.endswith("# changed from the defaults: rollout.group_size (default 8)")
    assert format_config(load_config(None, ["env.id=x"])).endswith("defaults: nothing")


def test_config_loading_does_not_import_torch() -> None:
    code = (
        "import sys; from areal_agents.trainer.config_io import load_config; "
        "load_config(None, ['env.id=x']); print('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize(
    ("algorithm", "allowed"),
    [("grpo", False), ("rloo", False), ("reinforce_pp_baseline", False), ("ppo", True)],
)
def test_group_size_one_only_without_a_group_baseline(algorithm: str, allowed: bool) -> None:
    overrides = ["env.id=x", f"algorithm={algorithm}", "rollout.group_size=1"]
    if allowed:
        assert load_config(None, overrides).rollout.group_size == 1
    else:
        (problem,) = problems_of(None, overrides)
        assert problem.startswith(f"rollout.group_size: {algorithm} normalizes")


def test_critic_section_checks_values_and_defaults_equal_the_ppo_spec() -> None:
    from areal_agents.trainer.algorithms import ALGORITHMS, CRITIC_ALGORITHMS, get_algorithm
    from areal_agents.trainer.config import CriticConfig

    assert {n for n, s in ALGORITHMS.items() if s.needs_critic} == CRITIC_ALGORITHMS == {"ppo"}
    assert get_algorithm("ppo").critic == CriticConfig()  # the section is what the critic gets
    cfg = load_config(None, ["env.id=x", "algorithm=ppo", "critic.lr=3e-5", "critic.path=/m"])
    assert cfg.critic == CriticConfig(path="/m", lr=3e-5)
    problems = problems_of(
        None, ["env.id=x", "algorithm=ppo", "critic.lr=0", "critic.lam=1.5", "critic.value_clp=1"]
    )
    assert "critic.lr: must be > 0, got 0.0" in problems
    assert "critic.lam: must be in [0, 1], got 1.5" in problems
    assert "unknown key 'critic.value_clp'; did you mean 'critic.value_clip'?" in problems


def test_critic_settings_without_a_critic_algorithm_name_the_fix() -> None:
    (problem,) = problems_of(None, ["env.id=x", "algorithm=grpo", "critic.lam=0.9"])
    assert problem == (
        "critic: set, but algorithm 'grpo' trains no critic; remove the critic section "
        "or choose algorithm=ppo"
    )
    # a resolved config (every section written out with its defaults) still loads
    assert load_config(None, ["env.id=x", "critic.lam=0.95"]).algorithm == "grpo"


def test_every_loss_key_reaches_the_loss_spec():
    """The ``loss`` section is made from ``LossSpec`` (``overrides_of``): each key is a
    LossSpec field of the same name, which ``resolve`` sets; no key is validated and then
    ignored, and a null key leaves the algorithm's own value."""
    import dataclasses

    from areal_agents.trainer.algorithms import LossSpec, get_algorithm
    from areal_agents.trainer.config import LossConfig

    names = [f.name for f in dataclasses.fields(LossConfig)]
    assert names == [f.name for f in dataclasses.fields(LossSpec)]
    overrides = [
        "loss.clip_high=0.28",
        "loss.agg=sum",
        "loss.kl_coef=0.1",
        "loss.proximal=loglinear",
    ]
    cfg = load_config(None, ["env.id=x", "algorithm=dapo", *overrides])
    spec = cfg.algorithm_spec().loss
    assert (spec.clip_high, spec.agg, spec.kl_coef, spec.proximal) == (
        0.28,
        "sum",
        0.1,
        "loglinear",
    )
    dapo = get_algorithm("dapo").loss
    assert (spec.clip_low, spec.weighting) == (dapo.clip_low, dapo.weighting) == (0.2, "token")


def test_trainer_ranks_are_checked_before_the_run():
    assert load_config(None, ["env.id=areal/Math-v0", "train.nproc=2"]).train.sharded
    one = load_config(None, ["env.id=areal/Math-v0", "train.fsdp=true"])
    assert one.train.sharded and one.train.nproc == 1
    problems = problems_of(None, ["env.id=areal/Math-v0", "train.nproc=2", "train.fsdp=false"])
    assert any(p.startswith("train.fsdp: must be true or null with nproc > 1") for p in problems)
    problems = problems_of(None, ["env.id=areal/Math-v0", "train.cpu_offload=true"])
    assert any("set train.fsdp=true" in p for p in problems)
    problems = problems_of(None, ["env.id=areal/Math-v0", "train.nproc=0"])
    assert any(p.startswith("train.nproc: must be >= 1") for p in problems)
    warm = ["env.id=areal/Math-v0", "train.nproc=2", "sft.enabled=true", "sft.demos=d.jsonl"]
    assert load_config(None, warm).sft.enabled  # the ranks run the warm start too
    assert load_config(None, ["env.id=areal/Math-v0", "train.nproc=2", "scheduler=ray"])


def test_core_pinning_keys_are_checked_before_the_run():
    cfg = load_config(
        None, ["env.id=areal/Math-v0", "scheduler=ray", "rollout.engine_cpus=[0]", "train.cpus=[1]"]
    )
    assert (cfg.rollout.engine_cpus, cfg.train.cpus) == ((0,), (1,))
    problems = problems_of(None, ["env.id=areal/Math-v0", "rollout.engine_cpus=[0]"])
    assert any(
        p.startswith("rollout.engine_cpus: pins the engine's own process") and "scheduler=ray" in p
        for p in problems
    )
    for bad in ("[]", "[1, 1]", "[-1]"):
        problems = problems_of(None, ["env.id=areal/Math-v0", f"train.cpus={bad}"])
        assert any(p.startswith("train.cpus: must be a non-empty list") for p in problems), bad
        problems = problems_of(
            None, ["env.id=areal/Math-v0", "scheduler=ray", f"rollout.idle_engine_cpus={bad}"]
        )
        assert any(p.startswith("rollout.idle_engine_cpus: must be a non-empty") for p in problems)
    problems = problems_of(None, ["env.id=areal/Math-v0", "rollout.idle_engine_cpus=[1]"])
    assert any(
        p.startswith("rollout.idle_engine_cpus: starts a second engine process")
        and "set scheduler=ray" in p
        for p in problems
    )
    problems = problems_of(None, ["env.id=areal/Math-v0", "train.cpus=[a]"])
    assert any(p.startswith("train.cpus: expected a list of int") for p in problems)
