"""The docs name only what exists: README.md, docs/*.md and examples/agents/README.md.

- Every ``areal-agent`` command they show (in a code block or an inline code span) is a
  command of the CLI (``areal_agents.cli.main``), and every ``--flag`` written after it is
  an option of that command's parser.
- Every training config key they name exists in ``TrainConfig``: the dotted overrides after
  ``areal-agent train`` (``rollout.group_size=8``, ``scheduler=ray``) and the keys written
  alone in an inline code span (`` `rewards.judge.min_auc` ``, `` `train.nproc=2` ``). Keys
  under a free-form mapping (``env.kwargs.*``, ``sampling.by_kind.*``, ...) may be anything;
  keys inside YAML blocks are not checked.
- Every relative link (``[text](path)``, ``[text](path#heading)``, ``[text](#heading)``)
  points to a file that exists, and an anchor into a Markdown file to one of its headings
  (its anchor as renderers write it). The links of CHANGELOG.md are checked too.
- README.md stays short (it leads; the rest is in docs/).

Parsing only: nothing is run, and neither torch nor a model is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
import types
import typing
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path

import pytest

from areal_agents.cli.main import _COMMANDS, _build_parser
from areal_agents.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200


def doc_files() -> list[Path]:
    """The pages whose commands, config keys and links are checked."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "examples" / "agents" / "README.md",
    ]


def link_files() -> list[Path]:
    """The pages whose links are checked: the above and the changelog."""
    return [*doc_files(), ROOT / "CHANGELOG.md"]


# ------------------------------------------------------------------------- markdown


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its info string, first line number and text."""

    info: str
    line: int
    text: str


def split_markdown(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced code blocks, and the lines outside them (with their line numbers)."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    fence: str | None = None
    info, start = "", 0
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, info, start, body = m.group(2), m.group(3).strip(), number + 1, []
        elif fence is not None and m and m.group(2).startswith(fence) and not m.group(3).strip():
            blocks.append(Block(info, start, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append((number, line))
    return blocks, prose


INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def inline_spans(prose: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """The inline code spans of the prose (a span may run over a line break), by line."""
    text = "\n".join(line for _, line in prose)
    numbers = [n for n, _ in prose]
    for m in INLINE_CODE.finditer(text):
        line = numbers[text.count("\n", 0, m.start())]
        yield line, " ".join(m.group(2).split())


def without_code(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The prose lines with their inline code spans blanked (links inside code are text)."""
    text = "\n".join(line for _, line in prose)
    text = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return list(zip([n for n, _ in prose], text.split("\n"), strict=True))


# ------------------------------------------------------------------------- the CLI


@cache
def cli_options() -> dict[str | None, frozenset[str]]:
    """Each command's option strings; ``None``: the top-level parser's."""
    parser = _build_parser()
    options: dict[str | None, frozenset[str]] = {None: frozenset(parser._option_string_actions)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                options[name] = frozenset(sub._option_string_actions)
    return options


SHELL_STOP = {"&&", "||", "|", ";", ">", ">>", "<", "&", "(", ")"}


def command_words(text: str) -> list[str]:
    """The words after ``areal-agent`` up to the end of the shell command."""
    text = text.split("`", 1)[0]
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unbalanced quote: a span cut short
        words = text.split("#", 1)[0].split()
    out = []
    for word in words:
        if word in SHELL_STOP or re.fullmatch(r"[();<>|&]+", word):
            break
        out.append(word)
    return out


INVOCATION = re.compile(r"(?<![\w-])areal-agent(?![\w-])")
COMMAND_START = re.compile(r"(^|&&|\|\||;|\||\(|\$\()\s*(\$\s+)?([A-Za-z_]\w*=\S*\s+)*\S*/?$")
"""What may stand before ``areal-agent`` when it starts a shell command: the start of the
line or of a command after ``&&`` / ``;`` / ``|`` / ``$(``, a prompt ``$``, environment
assignments (``PYTHONPATH=dir``), a directory (``.venv/bin/``). Elsewhere (a diagram, a
sentence in a code block) the word is not an invocation."""


def commands_in(line: str) -> Iterator[list[str]]:
    """The words after each ``areal-agent`` that starts a command in ``line``."""
    for m in INVOCATION.finditer(line):
        before = line[: m.start()]
        if COMMAND_START.search(before) and (not before or before[-1] in " /$(;|&"):
            yield command_words(line[m.end() :])


def invocations(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line, words after areal-agent)`` of every invocation in a code block or span."""
    blocks, prose = split_markdown(path.read_text())
    for block in blocks:
        logical, first = "", block.line
        for number, line in enumerate(block.text.split("\n"), block.line):
            if not logical:
                first = number
            if line.endswith("\\"):  # continued on the next line
                logical += line[:-1] + " "
                continue
            logical += line
            for words in commands_in(logical):
                yield first, words
            logical = ""
    for number, span in inline_spans(prose):
        for words in commands_in(span):
            yield number, words


# ------------------------------------------------------------------------- the config


def _section_type(hint: object) -> type | None:
    """The dataclass a field's type holds (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint):
        return typing.cast(type, hint)
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return typing.cast(type, arg)
    return None


def _is_mapping(hint: object) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_mapping(a) for a in typing.get_args(hint))
    return origin in (dict, Mapping) or hint is dict


@cache
def config_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Every key of ``TrainConfig`` (sections and leaves, dotted), and the keys whose
    values are free-form mappings (anything may follow them)."""
    keys: set[str] = set()
    free: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            keys.add(key)
            section = _section_type(hints[f.name])
            if section is not None:
                walk(section, key + ".")
            elif _is_mapping(hints[f.name]):
                free.add(key)

    walk(TrainConfig, "")
    return frozenset(keys), frozenset(free)


def sections() -> frozenset[str]:
    """The top-level keys that are sections (``rollout``, ``rewards``, ...)."""
    keys, _ = config_keys()
    return frozenset(k.split(".", 1)[0] for k in keys if "." in k)


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a config key (None when it is)."""
    keys, free = config_keys()
    if key in keys or any(key.startswith(f + ".") for f in free):
        return None
    parts = key.split(".")
    known = ".".join(parts[:-1])
    while known and known not in keys:
        known = known.rpartition(".")[0]
    if not known:
        return f"no config section {parts[0]!r}"
    below = sorted(
        k for k in keys if k.startswith(known + ".") and k.count(".") == known.count(".") + 1
    )
    return f"{known!r} has no key {key[len(known) + 1 :]!r} (its keys: {', '.join(below)})"


FILE_SUFFIXES = {
    "json", "jsonl", "log", "py", "yaml", "yml", "db", "md", "txt", "png", "pt", "safetensors",
    "toml", "sh", "csv",
}  # fmt: skip
DOTTED = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$")
OVERRIDE = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)=")


ENV_OBJECT = re.compile(
    r"^env\.(step|reset|score|spec|unwrapped|close|render|tools|np_random|action_space|"
    r"observation_space)\b"
)
"""``env.step``, ``env.spec.id``...: a gymnasium env object's attributes, not ``env.*`` keys."""
NOT_OUR_KEYS = {
    "rollout.max_concurrent_rollouts": "AReaL's key, in docs/scaling.md's table of its settings",
}


def span_key(span: str) -> str | None:
    """The config key an inline code span names on its own, if any: `` `a.b` ``,
    `` `a.b=1` ``, `` `a.b: 1` ``, `` 'a.b={...}' ``, `` `a.b = x` ``."""
    word = span.strip().strip("'\"").split(" ", 1)[0]
    word = re.split(r"[=:]", word, maxsplit=1)[0]
    if not DOTTED.match(word) or word.rsplit(".", 1)[1] in FILE_SUFFIXES:
        return None
    if word.split(".", 1)[0] not in sections() or ENV_OBJECT.match(word):
        return None
    return None if word in NOT_OUR_KEYS else word


# ------------------------------------------------------------------------- links


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def slug(heading: str) -> str:
    """The anchor of a heading, as Markdown renderers write it: its text without markup,
    lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The heading anchors of a Markdown file (headings in code blocks are not headings)."""
    _, prose = split_markdown(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def link_problems(path: Path) -> Iterator[str]:
    _, prose = split_markdown(path.read_text())
    rel = path.relative_to(ROOT)
    lines = without_code(prose)
    text = "\n".join(line for _, line in lines)  # a link's text may run over a line break
    for m in LINK.finditer(text):
        number = lines[text.count("\n", 0, m.start())][0]
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            yield f"{rel}:{number}: link to {target!r}: no such file {file_part!r}"
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            yield (
                f"{rel}:{number}: link to {target!r}: {os.path.relpath(dest, ROOT)} has "
                f"no heading with the anchor #{anchor}"
            )


# ------------------------------------------------------------------------- the tests


def command_problems(path: Path) -> Iterator[str]:
    rel = path.relative_to(ROOT)
    options = cli_options()
    for number, words in invocations(path):
        where = f"{rel}:{number}: `areal-agent {' '.join(words)}`"
        if not words:
            continue
        first = words[0]
        if first.startswith("-"):
            if first.split("=", 1)[0] not in options[None]:
                yield f"{where}: areal-agent has no option {first!r}"
            continue
        if first not in _COMMANDS:
            if first.isupper() or not re.match(r"^[a-z][a-z-]*$", first):
                continue  # a placeholder (`areal-agent COMMAND`) or not a command at all
            yield f"{where}: no command {first!r} (commands: {', '.join(sorted(_COMMANDS))})"
            continue
        for raw in words[1:]:
            optional = raw.startswith("[")
            word = raw.strip("[]")
            if word in ("", "...", "…") or word.startswith("..."):
                continue
            if word.startswith("-") and len(word) > 1 and not re.match(r"^-\d", word):
                flag = word.split("=", 1)[0]
                if flag not in options[first]:
                    known = ", ".join(sorted(o for o in options[first] if o.startswith("--")))
                    yield f"{where}: `{first}` has no option {flag!r} (its options: {known})"
                continue
            m = OVERRIDE.match(word)
            if first == "train" and m:
                key = m.group(1)
                if optional and key.split(".", 1)[0] not in sections() | config_keys()[0]:
                    continue  # a placeholder such as [a.b=c ...]
                problem = key_problem(key)
                if problem:
                    yield f"{where}: override {word!r}: {problem}"


def inline_key_problems(path: Path) -> Iterator[str]:
    rel = path.relative_to(ROOT)
    _, prose = split_markdown(path.read_text())
    for number, span in inline_spans(prose):
        if INVOCATION.search(span):
            continue  # a command: checked with its overrides
        key = span_key(span)
        if key is not None and (problem := key_problem(key)):
            yield f"{rel}:{number}: `{span}` names config key {key!r}: {problem}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_areal_agent_command_and_flag_shown_exists(path: Path) -> None:
    problems = list(command_problems(path))
    assert not problems, "commands or flags that the CLI does not have:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_key_named_exists(path: Path) -> None:
    problems = list(inline_key_problems(path))
    assert not problems, "config keys that TrainConfig does not have:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", link_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(path: Path) -> None:
    problems = list(link_problems(path))
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    )


# ------------------------------------------------------------------------- the checker


def test_the_checker_finds_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page with one mistake of each kind is flagged once for each, and the right forms
    pass: the checker is not vacuous."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading (x.py)\n")
    page.write_text(
        "# Page\n\n"
        "```bash\n"
        "areal-agent train --config a.yaml rollout.group_size=8 env.kwargs.anything=1 \\\n"
        "    rollout.group_sise=8 scheduler=ray   # a comment: --not-a-flag\n"
        "areal-agent serve --modle m && echo --fine\n"
        "areal-agent trian\n"
        "areal-agent --version\n"
        "```\n\n"
        "Inline: `areal-agent logs RUN -f`, `areal-agent train --resume RUN [a.b=c ...]`,\n"
        "`rewards.judge.min_auc`, `rewards.judge.min_acu=0`, `sampling.by_kind={x: {}}`,\n"
        "`train.log`, `eval.json`, `env.kwargs.user_base_url`, `critic.*`.\n\n"
        "[ok](other.md#a-code-heading-xpy), [ok](#page), [gone](missing.md), "
        "[two\nlines](gone2.md) "
        "[bad anchor](other.md#nope), [local](http://127.0.0.1:8765/), `[not](a-link.md)`\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    commands = list(command_problems(page))
    keys = list(inline_key_problems(page))
    links = list(link_problems(page))
    assert len(commands) == 3, commands
    assert "'rollout' has no key 'group_sise'" in commands[0]
    assert "`serve` has no option '--modle'" in commands[1]
    assert "no command 'trian'" in commands[2]
    assert len(keys) == 1 and "'rewards.judge' has no key 'min_acu'" in keys[0], keys
    assert len(links) == 3, links
    assert "no such file 'missing.md'" in links[0]
    assert "page.md:15: link to 'gone2.md'" in links[1]
    assert "has no heading with the anchor #nope" in links[2]
