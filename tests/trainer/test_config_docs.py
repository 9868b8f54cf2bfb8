"""docs/config.md is what the generator writes from the config's declarations, and complete."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from areal_agents.trainer.algorithms import ALGORITHMS
from areal_agents.trainer.config import TrainConfig
from areal_agents.trainer.config_docs import (
    COMMAND,
    default_out,
    leaf_rows,
    main,
    render,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_doc_is_what_the_generator_writes() -> None:
    assert default_out() == DOC
    assert DOC.read_text(encoding="utf-8") == render(), (
        f"docs/config.md is stale: regenerate it with `{COMMAND}`"
    )


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of dataclass ``cls``, walked here independently of the generator."""
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _leaf_keys(tp, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_every_leaf_key_is_documented_with_a_meaning() -> None:
    text = DOC.read_text(encoding="utf-8")
    keys = _leaf_keys(TrainConfig)
    assert len(keys) > 100 and "rollout.group_size" in keys
    for key in keys:
        assert f"| `{key}` |" in text, f"{key} is missing from docs/config.md"
    assert [r.key for r in leaf_rows(TrainConfig)] == keys
    undocumented = [r.key for r in leaf_rows(TrainConfig) if not r.meaning]
    assert not undocumented, f"give these fields an attribute docstring: {undocumented}"


def test_the_algorithm_key_names_every_algorithm() -> None:
    """The ``algorithm`` key's type is the registry's names (``AlgorithmName``), so the
    generated row lists every algorithm."""
    (row,) = [r for r in leaf_rows(TrainConfig) if r.key == "algorithm"]
    assert all(f'"{name}"' in row.kind for name in ALGORITHMS)


@dataclass(frozen=True)
class _Inner:
    """A nested section: ``its`` intro."""

    cap: float | None = None
    """Cap of the weight; None = the :mod:`algo`'s own.

    Second paragraph, with a | pipe."""


@dataclass(frozen=True)
class _Tiny:
    """A tiny config."""

    mode: Literal["clip", "mask", "none"] = "clip"
    """How to correct."""
    cores: tuple[int, ...] | None = None
    """Pinned cores."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's betas."""
    lr: float = 1e-6
    """Learning rate."""
    names: tuple[str, ...] = ("q_proj", "1e3", "")
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per kind."""
    inner: _Inner = field(default_factory=_Inner)
    """The inner section."""
    name: str = "runs/default"
    """Where."""


def test_a_tiny_config_renders_its_types_defaults_and_meanings() -> None:
    text = render(_Tiny, title="Tiny")
    assert text.startswith(f"# Tiny\n\n_Generated from the declarations in `{__name__}` by ")
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert (
        rows["| `mode`"] == '| `mode` | `"clip" \\| "mask" \\| "none"` | `clip` | How to correct. |'
    )
    assert rows["| `cores`"] == "| `cores` | `list[int] \\| null` | `null` | Pinned cores. |"
    assert rows["| `betas`"] == "| `betas` | `[float, float]` | `[0.9, 0.999]` | Adam's betas. |"
    assert rows["| `lr`"] == "| `lr` | `float` | `1e-06` | Learning rate. |"
    assert rows["| `names`"] == '| `names` | `list[str]` | `[q_proj, "1e3", ""]` |  |'
    assert rows["| `by_kind`"] == (
        "| `by_kind` | `mapping[str, mapping[str, any]]` | `{}` | Per kind. |"
    )
    assert rows["| `name`"] == "| `name` | `str` | `runs/default` | Where. |"
    assert rows["| [`inner`](#inner)"] == (
        "| [`inner`](#inner) | `section` |  | The inner section. |"
    )
    assert "\n## inner\n\nA nested section: `its` intro.\n\n| key | type |" in text
    assert rows["| `inner.cap`"] == (
        "| `inner.cap` | `float \\| null` | `null` | Cap of the weight; None = the `algo`'s own. "
        "Second paragraph, with a \\| pipe. |"
    )
    assert render(_Tiny, title="Tiny") == text  # deterministic


def test_check_fails_on_a_stale_file_and_names_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "config.md"
    assert main(["--check", "--out", str(out)]) == 1  # missing
    assert f"regenerate it with `{COMMAND} --out {out}`" in capsys.readouterr().err
    assert main(["--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text(encoding="utf-8").replace("`grpo`", "`ppo`"), encoding="utf-8")
    assert main(["--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert '-| `algorithm` | `"grpo"' in err and "| `ppo` | The RL algorithm" in err
    assert COMMAND in err
