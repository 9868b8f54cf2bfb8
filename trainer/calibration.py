"""Judge calibration (``rewards.judge``): a judged reward is checked before it trains.

Before the first training step (after the engine holds the weights: with ``self: true`` the
policy is the judge), the run's judge scores labelled answers:

* with ``rewards.judge.calibration: path``, the rows of that JSONL file
  (:func:`areal_agents.trainer.judge.load_labelled`);
* else ``calibration_episodes`` episodes the run's engine plays on the training env (the
  run's sampling; groups ``eval-judge-calibration-<seed>`` in the episode store, never
  trained), each labelled by the env's own checker: its ``success``.

At least ``MIN_CALIBRATION`` = 64 labelled answers with ``MIN_PER_LABEL`` = 16 of each label
are needed; fewer is a ``ConfigError`` that says how to get more. With P right (label
true) and N wrong answers and s the judge's score in [0, 1]:

* the AUC, in its Mann-Whitney form: how often the judge scores a right answer above a
  wrong one, ties counting half::

      AUC = P(s+ > s-) + 0.5 P(s+ = s-)
          = sum_{i right} sum_{j wrong} ([s_i > s_j] + 0.5 [s_i = s_j]) / (P N)

  computed from midranks (every score ranked ascending, tied scores sharing the mean of
  their ranks; R+ the sum of the right answers' ranks): AUC = (R+ - P (P + 1) / 2) / (P N);
* the balanced accuracy of the judge's verdict (pass: s >= ``PASS_SCORE`` = 0.5)::

      balanced accuracy = (TPR + TNR) / 2,  TPR = |{i right: s_i >= 0.5}| / P,
                                            TNR = |{j wrong: s_j < 0.5}| / N

Answers the judge could not score are left out (and counted). Both figures are printed,
written with every answer's score to ``RUN_DIR/judge_calibration.json`` and logged with
every step's metrics as ``judge/calib_auc`` and ``judge/calib_balanced_accuracy``. An AUC
below ``rewards.judge.min_auc`` (0.7 by default) stops the run before its first step with a
``ConfigError``; ``min_auc: 0`` runs anyway. A run started again in the same directory with
the same judge, model, env and sampling (a resume, or a rerun with another ``min_auc``)
reuses the stored calibration instead of measuring again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from areal_agents.errors import ConfigError
from areal_agents.rollout.evaluate import evaluate
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.config_io import to_dict
from areal_agents.trainer.config_rollout import MIN_CALIBRATION, MIN_PER_LABEL
from areal_agents.trainer.judge import PASS_SCORE, Answer, Judge, JudgeError

FILE = "judge_calibration.json"
GROUP_PREFIX = "eval-judge-calibration"
"""The proxy's group names of the calibration episodes: ``eval-judge-calibration-<seed>``."""
LABELLED_FILE_HINT = (
    'rewards.judge.calibration=path.jsonl, rows {"prompt" or "messages", "answer", "label"}'
)


# ---------------------------------------------------------------------------- the measures
def auc(scores: list[float], labels: list[bool]) -> float:
    """``P(s+ > s-) + 0.5 P(s+ = s-)`` over every (right, wrong) pair (the module's formula),
    from midranks. Raises ``ValueError`` when either label is missing."""
    pos = sum(labels)
    neg = len(labels) - pos
    if not pos or not neg:
        raise ValueError(f"the AUC needs both labels, got {pos} right and {neg} wrong")
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        mid = (i + j) / 2 + 1  # ranks i+1 .. j+1 share their mean
        for k in range(i, j + 1):
            ranks[order[k]] = mid
        i = j + 1
    r_pos = sum(r for r, y in zip(ranks, labels, strict=True) if y)
    return (r_pos - pos * (pos + 1) / 2) / (pos * neg)


def balanced_accuracy(scores: list[float], labels: list[bool]) -> float:
    """``(TPR + TNR) / 2`` of the verdict ``score >= PASS_SCORE`` against ``labels``.
    Raises ``ValueError`` when either label is missing."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        raise ValueError(f"balanced accuracy needs both labels, got {len(pos)} and {len(neg)}")
    tpr = sum(s >= PASS_SCORE for s in pos) / len(pos)
    tnr = sum(s < PASS_SCORE for s in neg) / len(neg)
    return (tpr + tnr) / 2


# ---------------------------------------------------------------------------- the result
@dataclass
class Calibration:
    """One calibration of the run's judge."""

    source: str
    """Where the labelled answers came from: the file, or ``N episodes``."""
    labeller: str
    """Who labelled them: ``the env's success`` or ``the file's labels``."""
    answers: int
    """Answers the judge scored (those it could not are ``judge_errors``)."""
    right: int
    wrong: int
    judge_errors: int
    auc: float
    balanced_accuracy: float
    min_auc: float
    judge_model: str
    score_mean_right: float
    score_mean_wrong: float
    fingerprint: str = ""
    pass_score: float = PASS_SCORE
    rows: list[dict[str, Any]] = field(default_factory=list)
    """Per answer: ``{"label", "score", "answer"}`` (the answer's start), or ``"error"``."""

    @property
    def passed(self) -> bool:
        return self.auc >= self.min_auc

    def metrics(self) -> dict[str, float]:
        return {
            "judge/calib_auc": self.auc,
            "judge/calib_balanced_accuracy": self.balanced_accuracy,
        }

    def line(self) -> str:
        return (
            f"judge calibration: AUC {self.auc:.3f}, balanced accuracy "
            f"{self.balanced_accuracy:.3f} on {self.answers} answers ({self.right} right, "
            f"{self.wrong} wrong by {self.labeller}; {self.source}; {self.judge_errors} judge "
            f"errors); mean score {self.score_mean_right:.3f} right / "
            f"{self.score_mean_wrong:.3f} wrong; min_auc {self.min_auc:g}: "
            + ("passed" if self.passed else "FAILED")
        )


# ---------------------------------------------------------------------------- the run's
async def calibrate_judge(
    cfg: TrainConfig, source: Any, out: Path, *, quiet: bool = False
) -> Calibration | None:
    """Calibrate ``source.judge`` before the first step (see the module docstring): measure
    (or reuse the stored calibration of the same setup), print, store, set the judge's
    ``judge/calib_*`` metrics; raise ``ConfigError`` when the AUC is below
    ``rewards.judge.min_auc`` or there are too few labelled answers. None: no calibration
    (``calibration_episodes: 0`` with ``min_auc: 0``, or too few labels with ``min_auc:
    0``)."""
    judge: Judge = source.judge
    j = cfg.rewards.judge
    if j.calibration is None and j.calibration_episodes == 0:
        _say(quiet, "judge calibration: none (rewards.judge.calibration_episodes=0, min_auc=0)")
        return None
    path = out / FILE
    fingerprint = _fingerprint(cfg, judge)
    cal = _stored(path, fingerprint, j.min_auc)
    if cal is not None:
        _say(quiet, f"{cal.line()} (stored in {path})")
    else:
        if judge.labelled is not None:
            assert j.calibration is not None
            groups = _file_groups(judge.labelled, j.mode, cfg.rollout.group_size)
            where, labeller = f"file {j.calibration}", "the file's labels"
        else:
            groups = await _episode_groups(cfg, source, quiet=quiet)
            where, labeller = f"{j.calibration_episodes} episodes", "the env's success"
        labels = [y for g in groups for _, y in g]
        problem = _too_few(labels, sum(labels), where, labeller, cfg)
        if problem is None:
            cal = await measure(judge, groups, where, labeller, j.min_auc)
            cal.fingerprint = fingerprint
            path.write_text(json.dumps(_jsonable(cal), indent=1) + "\n")
            problem = _too_few_judged(cal, cfg)
        if problem is not None:
            if j.min_auc > 0:
                raise ConfigError(problem)
            _say(quiet, f"judge calibration: not measured (min_auc=0): {problem}")
            return None
        assert cal is not None
        _say(quiet, cal.line())
    judge.calibration = cal.metrics()
    if not cal.passed:
        fixes = [
            "Use a stronger judge ("
            + ("rewards.judge.self=false " if j.self else "")
            + "rewards.judge.base_url=URL of a larger model)"
        ]
        if j.reference is None:
            fixes.append("show it the reference answer (rewards.judge.reference=<info key>)")
        fixes.append("change the rubric")
        raise ConfigError(
            f"rewards.judge: the judge's calibration AUC is {cal.auc:.3f} (balanced accuracy "
            f"{cal.balanced_accuracy:.3f}) on {cal.answers} answers ({cal.right} right, "
            f"{cal.wrong} wrong by {cal.labeller}), below rewards.judge.min_auc="
            f"{cal.min_auc:g}: its scores do not tell right answers from wrong ones well "
            f"enough to train on. {'; '.join(fixes)}; or set "
            f"rewards.judge.min_auc=0 to train anyway. Every score is in {path}"
        )
    return cal


async def measure(
    judge: Judge,
    groups: list[list[tuple[Answer, bool]]],
    source: str = "",
    labeller: str = "the labels",
    min_auc: float = 0.0,
) -> Calibration:
    """Score every labelled answer (a group at a time: ``ranking`` compares a group's) and
    compute the AUC and the balanced accuracy of the scores the judge could give. Raises
    ``ValueError`` when those lack either label."""
    outcomes = await asyncio.gather(
        *[judge.score(f"calibration-{i}", [a for a, _ in g]) for i, g in enumerate(groups)]
    )
    scores: list[float] = []
    labels: list[bool] = []
    rows: list[dict[str, Any]] = []
    errors = 0
    for g, got in zip(groups, outcomes, strict=True):
        for (answer, label), outcome in zip(g, got, strict=True):
            row: dict[str, Any] = {"label": label, "answer": answer.text[:200]}
            if isinstance(outcome, JudgeError):
                errors += 1
                row["error"] = str(outcome)
            else:
                scores.append(outcome[0])
                labels.append(label)
                row["score"] = outcome[0]
            rows.append(row)
    right = [s for s, y in zip(scores, labels, strict=True) if y]
    wrong = [s for s, y in zip(scores, labels, strict=True) if not y]
    both = bool(right and wrong)
    return Calibration(
        source=source,
        labeller=labeller,
        answers=len(scores),
        right=len(right),
        wrong=len(wrong),
        judge_errors=errors,
        auc=auc(scores, labels) if both else math.nan,
        balanced_accuracy=balanced_accuracy(scores, labels) if both else math.nan,
        min_auc=min_auc,
        judge_model=str(judge.backend.model),
        score_mean_right=sum(right) / len(right) if right else math.nan,
        score_mean_wrong=sum(wrong) / len(wrong) if wrong else math.nan,
        rows=rows,
    )


# ---------------------------------------------------------------------------- the answers
def _file_groups(
    labelled: list[tuple[Answer, bool]], mode: str, group_size: int
) -> list[list[tuple[Answer, bool]]]:
    """The file's rows as judge calls: one each (``rubric``), or the rows of one task
    together, ``group_size`` at a time (``ranking`` compares answers to the same task)."""
    if mode != "ranking":
        return [[row] for row in labelled]
    by_task: dict[str, list[tuple[Answer, bool]]] = {}
    for row in labelled:
        by_task.setdefault(row[0].task, []).append(row)
    return [
        rows[k : k + group_size]
        for rows in by_task.values()
        for k in range(0, len(rows), group_size)
    ]


async def _episode_groups(
    cfg: TrainConfig, source: Any, *, quiet: bool
) -> list[list[tuple[Answer, bool]]]:
    """``calibration_episodes`` episodes on the training env with the run's engine and
    sampling (``rollout.group_size`` per task with ``ranking``, else one), each labelled by
    its ``success``; episodes that failed, or whose env reports no success, are left out."""
    j = cfg.rewards.judge
    judge: Judge = source.judge
    k = cfg.rollout.group_size if j.mode == "ranking" else 1
    episodes = math.ceil(j.calibration_episodes / k) * k
    await source.prepare()  # an in-process agent needs the proxy served over HTTP
    bar = tqdm(total=episodes, desc="judge calibration", unit="ep", disable=quiet, file=sys.stderr)
    try:
        _, results = await evaluate(
            source.runner,
            source.make_env,
            env_id=str(cfg.env.id),
            episodes=episodes,
            k=k,
            seed=source.settings.seed_base,
            agent=source.local_agent,
            progress=lambda _: bar.update(),
            group_prefix=GROUP_PREFIX,
        )
    finally:
        bar.close()
    groups = []
    for group in results:
        usable = [r for r in group if r.ok and r.episode.completions and r.success is not None]
        try:
            rows = [(judge.answer_of(r), bool(r.success)) for r in usable]
        except JudgeError as exc:  # rewards.judge.reference names no key of the env's info
            raise ConfigError(str(exc)) from None
        if rows:
            groups.append(rows)
    return groups


def _too_few(
    labels: list[bool], right: int, where: str, labeller: str, cfg: TrainConfig
) -> str | None:
    """Why these labels cannot calibrate (with what to do), or None when they can."""
    wrong = len(labels) - right
    if len(labels) >= MIN_CALIBRATION and min(right, wrong) >= MIN_PER_LABEL:
        return None
    j = cfg.rewards.judge
    if j.calibration is not None:
        more = "add rows of the missing label to the file"
    elif min(right, wrong) == 0:
        which = "succeeded" if wrong == 0 else "failed"
        more = (
            f"no episode {which}, so more calibration episodes will hardly help: give a "
            f"labelled file ({LABELLED_FILE_HINT})"
        )
    else:
        need = max(MIN_CALIBRATION, math.ceil(len(labels) * MIN_PER_LABEL / min(right, wrong)))
        need = math.ceil(need / MIN_CALIBRATION) * MIN_CALIBRATION
        more = (
            f"run more calibration episodes (rewards.judge.calibration_episodes={need}) or "
            f"give a labelled file ({LABELLED_FILE_HINT})"
        )
    return (
        f"rewards.judge: too few labelled answers to calibrate the judge: it needs "
        f"{MIN_CALIBRATION} with {MIN_PER_LABEL} of each label, and {where} gave "
        f"{len(labels)} ({right} right, {wrong} wrong by {labeller}); {more}; or set "
        "rewards.judge.min_auc=0 to train without the check"
    )


def _too_few_judged(cal: Calibration, cfg: TrainConfig) -> str | None:
    """Why the answers the judge could score are too few (its errors), or None."""
    if cal.answers >= MIN_CALIBRATION and min(cal.right, cal.wrong) >= MIN_PER_LABEL:
        return None
    errors = [r["error"] for r in cal.rows if "error" in r]
    last = f"; the last: {errors[-1]}" if errors else ""
    return (
        f"rewards.judge: the judge could not score {cal.judge_errors} of the calibration's "
        f"answers{last}; {cal.answers} remain ({cal.right} right, {cal.wrong} wrong), fewer "
        f"than {MIN_CALIBRATION} with {MIN_PER_LABEL} of each label. Check rewards.judge "
        "(base_url, model, max_tokens, timeout_s, scoring) or use a stronger judge model; "
        "or set rewards.judge.min_auc=0 to train without the check"
    )


# ---------------------------------------------------------------------------- storing
def _fingerprint(cfg: TrainConfig, judge: Judge) -> str:
    """What a calibration depends on: the judge (but ``min_auc``) and its model, the
    policy's model, env, sampling, rollout, agent and warm start."""
    d = to_dict(cfg)
    d["rewards"]["judge"].pop("min_auc", None)
    parts = {k: d[k] for k in ("env", "model", "sampling", "rollout", "agent", "sft", "rewards")}
    parts["judge_model"] = str(judge.backend.model)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _stored(path: Path, fingerprint: str, min_auc: float) -> Calibration | None:
    """The calibration stored in ``path`` when it was measured for the same setup (its
    ``min_auc`` replaced by today's), else None."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.pop("fingerprint", None) != fingerprint:
            return None
        data.pop("passed", None)
        data["min_auc"] = min_auc
        nan = {k: math.nan for k, v in data.items() if v is None}
        cal = Calibration(**{**data, **nan}, fingerprint=fingerprint)
    except (ValueError, TypeError, AttributeError):
        return None
    if cal.answers < MIN_CALIBRATION or min(cal.right, cal.wrong) < MIN_PER_LABEL:
        return None
    return cal


def _jsonable(cal: Calibration) -> dict[str, Any]:
    """The calibration as JSON: NaN as null, with ``passed``."""
    data = {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(cal).items()
    }
    return {**data, "passed": cal.passed}


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(line, file=sys.stderr)
