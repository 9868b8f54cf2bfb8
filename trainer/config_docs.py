"""``docs/config.md``, written from the training config's declarations.

``TrainConfig`` and its sections are frozen dataclasses whose fields carry attribute
docstrings (a string right after the field). This module reads them (with :mod:`ast`) and
writes one Markdown reference: a table of the top-level keys, then one heading per section
(a nested section under its parent's), introduced by the section's class docstring, with a
row per key: its full dotted name, type, default (as YAML writes it) and meaning. CI runs
``--check``, which fails when the committed file differs from what this module writes::

    python -m areal_agents.trainer.config_docs            # (re)write docs/config.md
    python -m areal_agents.trainer.config_docs --check    # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import re
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from areal_agents.trainer.config import TrainConfig

COMMAND = "python -m areal_agents.trainer.config_docs"
"""The command that regenerates ``docs/config.md``."""

TITLE = "Training config reference"


def default_out() -> Path:
    """``docs/config.md`` of the checkout this package lives in (else of the working dir)."""
    here = Path(__file__).resolve().parents
    root = next((p for p in here if (p / "pyproject.toml").is_file()), Path.cwd())
    return root / "docs" / "config.md"


@dataclass(frozen=True)
class Row:
    """One key of a config: a leaf, or a section (``section`` is then its class)."""

    key: str
    kind: str
    default: str
    meaning: str
    section: type | None = None


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of dataclass ``cls`` (and its dataclass bases), by field. A
    section of overrides made by ``areal_agents.trainer.algorithms.overrides_of`` has no source
    of its own: its fields' docstrings are those of the class it was made from."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(base):
            continue
        if (made_from := base.__dict__.get("__overrides_of__")) is not None:
            out.update(field_docs(made_from))
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
        for node, after in itertools.pairwise(body):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            doc = after.value if isinstance(after, ast.Expr) else None
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str):
                out[node.target.id] = inspect.cleandoc(doc.value)
    return out


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`x` / :class:`~x`


def paragraphs(doc: str | None) -> list[str]:
    """A docstring's paragraphs, each on one line, its RST literals as Markdown code."""
    text = _ROLE.sub(r"``\1``", doc or "").replace("``", "`")
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def type_name(tp: Any) -> str:
    """An annotation as a config user reads it: ``float | null``, ``"a" | "b"``, ``list[int]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple and args[1:] == (Ellipsis,):
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin is dict:
        return f"mapping[{type_name(args[0])}, {type_name(args[1])}]"
    if origin is list:
        return f"list[{type_name(args[0])}]"
    return str(getattr(tp, "__name__", tp))


_YAML_WORDS = {"null", "~", "true", "false", "yes", "no", "on", "off", "y", "n"}


def yaml_value(value: Any) -> str:
    """``value`` in YAML's flow style: ``null``, ``true``, ``1e-06``, ``[a, b]``, ``{}``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return value if _plain(value) else json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(k)}: {yaml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no YAML form for {value!r}")


def _plain(text: str) -> bool:
    """Whether YAML reads ``text`` unquoted as this same string."""
    if not re.fullmatch(r"[A-Za-z0-9_][\w./-]*", text) or text.lower() in _YAML_WORDS:
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def rows(cls: type, prefix: str = "") -> list[Row]:
    """A row per field of dataclass ``cls`` (sections included, not entered), in order."""
    docs, hints, out = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        meaning = " ".join(paragraphs(docs.get(f.name)))
        if _is_section(tp):
            meaning = meaning or (paragraphs(tp.__doc__) or [""])[0]
            out.append(Row(key, "section", "", meaning, tp))
            continue
        if f.default is not dataclasses.MISSING:
            default = yaml_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = yaml_value(f.default_factory())
        else:
            default = "required"
        out.append(Row(key, type_name(tp), default, meaning))
    return out


def all_rows(cls: type, prefix: str = "") -> list[Row]:
    """Every key of ``cls``, each section followed by its own keys, in declaration order."""
    out = []
    for row in rows(cls, prefix):
        out += [row, *(all_rows(row.section, row.key + ".") if row.section else [])]
    return out


def leaf_rows(cls: type) -> list[Row]:
    """Every leaf key of ``cls`` (the keys that hold values), in declaration order."""
    return [r for r in all_rows(cls) if r.section is None]


def _anchor(key: str) -> str:
    """The anchor a Markdown renderer gives the heading ``key``."""
    return re.sub(r"[^\w\- ]", "", key.lower()).replace(" ", "-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(section_rows: Sequence[Row]) -> list[str]:
    """A Markdown table: key, type, default, meaning; a section's key links to its heading."""
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in section_rows:
        key = f"[`{r.key}`](#{_anchor(r.key)})" if r.section else f"`{r.key}`"
        default = f"`{_cell(r.default)}`" if r.default else ""
        out.append(f"| {key} | `{_cell(r.kind)}` | {default} | {_cell(r.meaning)} |")
    return out


def _sections(cls: type, prefix: str, depth: int) -> list[str]:
    """The headings of the sections of ``cls``, each with its intro, table and subsections."""
    out: list[str] = []
    for row in rows(cls, prefix):
        if row.section is None:
            continue
        out += ["", f"{'#' * min(depth, 6)} {row.key}", ""]
        for text in paragraphs(row.section.__doc__):
            out += [text, ""]
        out += table(rows(row.section, row.key + "."))
        out += _sections(row.section, row.key + ".", depth + 1)
    return out


def render(root: type = TrainConfig, title: str = TITLE) -> str:
    """The whole reference of config ``root`` as Markdown (deterministic)."""
    modules = sorted(
        {r.section.__module__ for r in all_rows(root) if r.section} | {root.__module__}
    )
    sources = ", ".join(f"`{m}`" for m in modules)
    out = [
        f"# {title}",
        "",
        f"_Generated from the declarations in {sources} by `{COMMAND}`; do not edit by hand._",
        "",
    ]
    for text in paragraphs(root.__doc__):
        out += [text, ""]
    out += [
        "Each key is written by its full dotted name: in a YAML file it nests by section "
        "(`a.b: c` is `a: {b: c}`), on the command line it is an override `a.b=c`. "
        "`null` is YAML's None.",
        "",
        "## Top-level keys",
        "",
        *table(rows(root)),
        *_sections(root, "", 2),
    ]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the reference (default: the checkout's ``docs/config.md``), or ``--check`` it."""
    parser = argparse.ArgumentParser(
        prog=COMMAND, description="Write docs/config.md from the training config."
    )
    parser.add_argument("--out", type=Path, default=None, help="default: docs/config.md")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = parser.parse_args(argv)
    out: Path = args.out or default_out()
    command = COMMAND + ("" if args.out is None else f" --out {out}")
    text = render()
    if not args.check:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out} ({len(leaf_rows(TrainConfig))} keys)")
        return 0
    old = out.read_text(encoding="utf-8") if out.is_file() else ""
    if old == text:
        return 0
    diff = difflib.unified_diff(
        old.splitlines(), text.splitlines(), str(out), "generated", n=0, lineterm=""
    )
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    print(f"{out} is stale: regenerate it with `{command}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
