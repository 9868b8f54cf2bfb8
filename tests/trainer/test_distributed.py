"""FSDP2 trainer ranks on gloo: 2 ranks take the step one process takes, checkpoints move
between rank counts, and a failed or orphaned rank ends in bounded time."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_agents.trainer.critic import Critic
from areal_agents.trainer.distributed import RankFailed, group_parts, run_ranks
from areal_agents.trainer.model_build import model_kwargs
from areal_agents.trainer.policy import Policy
from areal_agents.trajectory import Completion, Episode

RANKS = Path(__file__).with_name("dist_ranks.py")
_spec = importlib.util.spec_from_file_location("dist_ranks", RANKS)
assert _spec is not None and _spec.loader is not None
dist_ranks: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dist_ranks)


def test_group_parts_keeps_groups_whole_and_balances_tokens():
    groups = ["a", "a", "b", "b", "b", "c"]
    assert group_parts(groups, [10, 10, 5, 5, 5, 30], 2) == [[0, 1, 2, 3, 4], [5]]
    assert group_parts(groups, [1] * 6, 2) == [[0, 1], [2, 3, 4, 5]]
    # fewer groups than ranks: a rank gets nothing (it runs dummy micro-batches)
    assert group_parts(["a", "a"], [3, 3], 3) == [[], [0, 1], []]
    assert group_parts([], [], 2) == [[], []]


def _episodes(policy: Policy) -> list[Episode]:
    """3 groups (not divisible by 2 ranks) of 3, 3 and 2 episodes of different lengths, one
    with a second turn that extends its first; behaviour logprobs are the policy's plus
    noise, so the importance weights are not all 1."""
    g = torch.Generator().manual_seed(0)
    eps = []
    for gi, size in enumerate((3, 3, 2)):
        for k in range(size):
            ep = Episode(f"e{gi}-{k}", group_id=f"g{gi}")
            prompt = list(range(100 + 7 * gi, 112 + 9 * gi))
            out = torch.randint(200, 300, (4 + 3 * k + gi,), generator=g).tolist()
            turns = [(prompt, out)]
            if k == 1:
                turns.append(([*prompt, *out, 7, 8], [301, 302, 303 + gi]))
            for t, (p, o) in enumerate(turns):
                (lp,) = policy.logprobs([p + o], 1.0)
                noisy = lp[-len(o) :] + 0.05 * torch.randn(len(o), generator=g)
                ep.add(
                    Completion(
                        f"c{gi}{k}{t}",
                        [{"role": "user", "content": "q"}],
                        p,
                        o,
                        noisy.tolist(),
                        [0] * len(o),
                        {"role": "assistant", "content": f"a{k}"},
                        "stop",
                    )
                )
            ep.final_reward = float((k + gi) % 2)
            eps.append(ep)
    return eps


def _one_process(name: str, model: str) -> tuple[Policy, Critic | None, Any]:
    cfg = dist_ranks.case_config(name, model)
    policy_kw, critic_kw = model_kwargs(cfg, cfg.algorithm_spec(), model)
    policy = Policy(**policy_kw)
    critic = None if critic_kw is None else Critic(**critic_kw)
    return policy, critic, cfg


def _trained(policy: Policy) -> dict[str, torch.Tensor]:
    return policy.weight_update(0).state_dict or {}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= dist_ranks.WEIGHT_TOL, f"{what}: weights differ by {worst:.2e}"
    print(f"{what}: max |difference| {worst:.1e}")


def _assert_steps(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), what
        for k in w:
            assert g[k] == pytest.approx(w[k], abs=1e-5, rel=1e-5), f"{what}: {k}"


@pytest.mark.slow
def test_two_ranks_take_the_step_one_process_takes(narrow_model_dir, tmp_path):
    """For GRPO (with KL), DAPO (2 mini-batches), Dr.GRPO and PPO with a critic, LoRA and
    full fine-tuning (two of them with activation checkpointing): the loss, gradient norms
    and weights after 2 steps on 2 gloo ranks equal one unsharded process's to 1e-5, the
    weights to ``dist_ranks.WEIGHT_TOL`` (3 groups over 2 ranks; micro-batches of 40 tokens,
    so the ranks run different numbers of them), and so do the per-token records rank 0
    gathers from the ranks (``train_tokens`` rows: their number and sums of their arrays).
    The ranks' checkpoints load into one process (2 -> 1), and one process's checkpoint
    after step 1 resumes on the ranks (1 -> 2) with the same second step. A warm start on
    the ranks equals one process's. On the narrow tiny model (hidden 32): what is compared
    does not depend on the width, the time does."""
    model = str(narrow_model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (1 core each): the same float summation order
    try:
        _parity(model, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _parity(model: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    episodes = _episodes(Policy(model, dtype="float32", device="cpu"))
    want: dict[str, Any] = {}
    checkpoints: dict[str, str] = {}
    for name in dist_ranks.CASES:
        torch.manual_seed(0)
        policy, critic, cfg = _one_process(name, model)
        initial = _trained(policy)
        steps = dist_ranks.train_steps(policy, critic, episodes, cfg, range(1))
        if name in dist_ranks.RESUMED:
            ckpt = tmp_path / "one" / name
            policy.save(ckpt)
            if critic is not None:
                critic.save(ckpt / "critic")
            checkpoints[name] = str(ckpt)
            want[f"{name}+resume"] = {"steps": []}
        steps += dist_ranks.train_steps(policy, critic, episodes, cfg, range(1, 2))
        want[name] = {"steps": steps, "weights": _trained(policy)}
        moved = max(float((want[name]["weights"][k] - v).abs().max()) for k, v in initial.items())
        assert moved > 1e-3, f"{name}: 2 steps moved no weight by more than {moved:.1e}"
        if critic is not None:
            want[name]["critic"] = {k: v.detach().clone() for k, v in critic.params.items()}
        if name in dist_ranks.RESUMED:
            want[f"{name}+resume"] = {"steps": steps[1:], "weights": want[name]["weights"]}
    torch.manual_seed(0)
    policy, _, _ = _one_process(dist_ranks.SFT_CASE, model)
    sft = {"stats": dist_ranks.warm_start(policy, model), "weights": _trained(policy)}
    data = tmp_path / "data.pkl"
    data.write_bytes(
        pickle.dumps({"model": model, "episodes": episodes, "checkpoints": checkpoints})
    )
    out = tmp_path / "ranks"
    out.mkdir()
    t0 = time.perf_counter()
    run_ranks(2, [str(RANKS), "parity", str(data), str(out)])
    print(f"2 ranks: {time.perf_counter() - t0:.1f} s for {len(want)} cases")
    got = json.loads((out / "results.json").read_text())
    # the warm start: the same loss and weights on the ranks
    assert got.pop("sft") == pytest.approx(sft["stats"], abs=1e-5, rel=1e-5)
    _assert_same(torch.load(out / "sft.weights.pt"), sft["weights"], "warm start (gathered)")
    assert got.keys() == want.keys()
    for key, w in want.items():
        _assert_steps(got[key]["steps"], w["steps"], key)
        _assert_same(torch.load(out / f"{key}.weights.pt"), w["weights"], f"{key} (gathered)")
        name = key.split("+")[0]
        # 2 -> 1: the ranks' sharded checkpoint into one unsharded process
        policy, critic, _ = _one_process(name, model)
        policy.load(out / key)
        _assert_same(_trained(policy), want[name]["weights"], f"{key} (checkpoint 2 -> 1)")
        assert (out / key / "model").is_dir()  # the eval / serve copy
        if critic is not None:
            critic.load(out / key / "critic")
            params = {k: v.detach() for k, v in critic.params.items()}
            _assert_same(params, want[name]["critic"], f"{key} critic (checkpoint 2 -> 1)")
    assert (out / "grpo-lora" / "rng-rank1.pt").exists()


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failed_rank_ends_the_run_with_its_error(mode):
    t0 = time.perf_counter()
    with pytest.raises(RankFailed) as info:
        run_ranks(2, [str(RANKS), mode], monitor_interval_s=0.2)
    took = time.perf_counter() - t0
    message = str(info.value)
    assert message.startswith("trainer rank 1 "), message
    if mode == "raise":
        assert "rank one broke on purpose" in message
    else:
        assert "SIGKILL" in message
    assert took < 60, f"the run took {took:.0f} s to end"


def test_no_rank_outlives_its_launcher_killed_by_sigkill(tmp_path):
    code = (
        "import sys; from areal_agents.trainer.distributed import run_ranks; "
        f"run_ranks(2, [{str(RANKS)!r}, 'hang', {str(tmp_path)!r}])"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid-*"))) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            assert launcher.poll() is None, "the launcher ended early"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        killed = time.monotonic()
        alive = pids
        while alive and time.monotonic() - killed < 10:
            time.sleep(0.1)
            alive = [p for p in pids if _alive(p)]
        assert not alive, f"ranks {alive} outlived their launcher by 10 s"
    finally:
        launcher.kill()
        for p in tmp_path.glob("pid-*"):
            if _alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"  # a zombie is dead


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_on_two_ranks_ends_with_a_model_serve_loads(tiny_model_dir, tmp_path):
    """The README's quickstart config (LoRA) with ``--nproc 2``, on the tiny model (the
    default model's own run is test_cli's quickstart test), cut to a warm start on 16
    demonstrations and 2 steps without held-out evaluations: the warm start and the steps on
    both ranks, the weight syncs, the checkpoints' shards of both ranks, and a merged final
    model that ``areal-agent serve --model`` answers a chat completion with."""
    out = tmp_path / "quickstart"
    cli = [sys.executable, "-m", "areal_agents.cli.main"]
    train = subprocess.run(
        [
            *cli,
            "train",
            "--config",
            "examples/agents/quickstart.yaml",
            "--nproc",
            "2",
            "--quiet",
            f"train.output_dir={out}",
            f"model.path={tiny_model_dir}",
            "model.dtype=float32",
            "metrics.tensorboard=false",
            "sft.generate=16",
            "eval.episodes=0",
            "train.steps=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert train.returncode == 0, train.stderr[-4000:]
    assert f"final model: {out / 'final'}" in train.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "sft.json").exists(), "the ranks ran the warm start"
    assert all(r["weight_sync_s"] > 0 and r["loss/micro_batches"] >= 1 for r in rows)
    ckpt = out / "checkpoints" / "step-000002"
    assert (ckpt / "dcp" / ".metadata").exists() and (ckpt / "rng-rank1.pt").exists()
    assert (ckpt / "model" / "adapter_model.safetensors").exists()
    smoke = subprocess.run(
        [*cli, "serve", "--smoke", "--model", str(out / "final")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert smoke.returncode == 0, smoke.stderr[-3000:]


def test_cpu_offload_without_a_gpu_is_refused_before_any_rank_starts():
    from areal_agents.errors import ConfigError
    from areal_agents.trainer.config_io import load_config
    from areal_agents.trainer.distributed import launch

    cfg = load_config(None, ["env.id=areal/Math-v0", "train.fsdp=true", "train.cpu_offload=true"])
    with pytest.raises(ConfigError, match=r"set train\.cpu_offload=false"):
        launch(cfg)
