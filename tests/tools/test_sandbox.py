"""The sandboxed Python executor: output, every failure mode with its message, limits,
isolation and concurrency. Limits are small so the whole file runs in a few seconds. The
tests run under the default isolation (bubblewrap); escape attempts are in
``test_sandbox_escape.py``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import pytest

import areal_agents.tools.sandbox_bwrap as sandbox_bwrap
import areal_agents.tools.sandbox_cgroup as sandbox_cgroup
from areal_agents.tools.sandbox import (
    SandboxLimits,
    SandboxUnavailableError,
    check_sandbox,
    make_python_tool,
    python_tool,
    run_python,
    run_python_sync,
)
from areal_agents.tools.sandbox_cgroup import memory_cgroup_parent
from areal_agents.tools.tool import Tool

FAST: dict[str, Any] = {"timeout_s": 5.0, "memory_mb": 256, "max_output_chars": 2000}


async def test_runs_code_and_captures_stdout_and_stderr() -> None:
    result = await run_python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)", **FAST)
    assert result.ok and result.error is None and result.message == ""
    assert result.stdout == "42\n"
    assert result.stderr == "warn\n"
    assert result.exit_code == 0
    assert not result.truncated
    assert result.to_text() == "42\nwarn\n"


async def test_no_output_is_said() -> None:
    result = await run_python("x = 1", **FAST)
    assert result.ok and result.to_text() == "(no output)"


async def test_infinite_loop_times_out() -> None:
    result = await run_python("print('start')\nwhile True:\n    pass", timeout_s=0.5)
    assert result.error == "timeout"
    assert result.message == "Error: timed out after 0.5 s"
    assert result.exit_code is None
    assert result.stdout == "start\n"  # output printed before the kill is kept
    assert result.duration_s < 3.0


async def test_memory_bomb_fails_with_memory_message() -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))"
    result = await run_python(code, timeout_s=5.0, memory_mb=128)
    assert result.error == "memory"
    assert result.message == "Error: memory limit of 128 MB exceeded"
    assert "MemoryError" in result.stderr


async def test_fork_bomb_hits_process_limit() -> None:
    code = "import os\nwhile True:\n    os.fork()"
    result = await run_python(code, timeout_s=5.0, max_processes=3)
    assert result.error == "process"
    assert result.message.startswith("Error: process limit reached")
    assert "at most 3 processes" in result.message


async def test_multiprocessing_within_the_limit_works() -> None:
    code = (
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child'); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent')\n"
    )
    result = await run_python(code, **FAST, max_processes=1)
    assert result.ok, result.to_text()
    assert sorted(result.stdout.split()) == ["child", "parent"]


async def test_starting_programs_is_refused() -> None:
    result = await run_python("import subprocess\nsubprocess.run(['echo', 'hi'])", **FAST)
    assert result.error == "program"
    assert result.message.startswith("Error: running other programs is disabled in the sandbox")
    result = await run_python("import os\nos.system('echo hi')", **FAST)
    assert result.error == "program"


# (isolation, use_namespaces): bubblewrap, and the in-process mode with and without unshare.
MODES = [("bwrap", None), ("process", None), ("process", False)]
MODE_IDS = ["bwrap", "process", "process-no-namespaces"]


@pytest.mark.parametrize(("isolation", "use_namespaces"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import socket\nsocket.getaddrinfo('localhost', 80)",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9/', timeout=1)",
    ],
    ids=["connect", "dns", "urllib"],
)
async def test_network_access_is_disabled(
    code: str, isolation: str, use_namespaces: bool | None
) -> None:
    result = await run_python(code, **FAST, isolation=isolation, use_namespaces=use_namespaces)
    assert result.error == "network"
    assert result.message == "Error: network access is disabled in the sandbox"


async def test_local_socketpair_still_works_for_asyncio() -> None:
    code = "import asyncio\nasync def main():\n    return 5\nprint(asyncio.run(main()))"
    result = await run_python(code, **FAST)
    assert result.ok, result.to_text()
    assert result.stdout == "5\n"


@pytest.mark.parametrize(
    ("code", "path"),
    [
        ("open('/etc/areal-sandbox-test', 'w').write('x')", "/etc/areal-sandbox-test"),
        ("import os\nos.remove('/tmp/areal-sandbox-nothing')", "/tmp/areal-sandbox-nothing"),
        ("import os\nos.mkdir('../escape')", None),
        ("import pathlib\npathlib.Path('/tmp/areal-x').write_text('x')", "/tmp/areal-x"),
    ],
    ids=["open", "remove", "mkdir-parent", "pathlib"],
)
async def test_writing_outside_the_sandbox_is_refused(code: str, path: str | None) -> None:
    result = await run_python(code, **FAST)
    assert result.error == "write"
    assert result.message.startswith(
        "Error: writing outside the sandbox directory is not allowed: "
    )
    if path is not None:
        assert result.message.endswith(path)
        assert not os.path.exists(path)


async def test_writes_inside_the_private_directory_work_and_are_removed() -> None:
    code = (
        "import os, tempfile\n"
        "open('notes.txt', 'w').write('hello')\n"
        "os.mkdir('sub')\n"
        "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
        "    f.write('x')\n"
        "print(open('notes.txt').read())\n"
        "print(os.getcwd())\n"
        "print(os.path.dirname(f.name) == os.getcwd())\n"
    )
    result = await run_python(code, **FAST)
    assert result.ok, result.to_text()
    text, cwd, same = result.stdout.split()
    assert text == "hello" and same == "True"
    assert not os.path.exists(cwd)  # the directory is gone after the run


async def test_output_is_truncated_with_a_marker() -> None:
    result = await run_python(
        "print('x' * 100000)\nprint('end')", timeout_s=5.0, max_output_chars=50
    )
    assert result.ok and result.truncated
    assert result.stdout.startswith("x" * 50)
    assert result.stdout.endswith("[output truncated after 50 characters]")
    assert len(result.stdout) < 120


async def test_exception_and_exit_status_are_reported() -> None:
    result = await run_python("def f():\n    return 1 / 0\nf()", **FAST)
    assert result.error == "exception"
    assert result.message == "Error: ZeroDivisionError: division by zero"
    assert 'File "<code>", line 2, in f' in result.stderr
    assert "<string>" not in result.stderr  # the sandbox's own frames are hidden
    result = await run_python("import sys\nsys.exit(3)", **FAST)
    assert (result.error, result.exit_code) == ("exit", 3)
    assert result.message == "Error: the code exited with status 3"
    result = await run_python("def (", **FAST)
    assert result.error == "exception" and "SyntaxError" in result.message


async def test_parent_environment_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_SANDBOX_SECRET", "hunter2")
    result = await run_python("import os\nprint(os.environ.get('AREAL_SANDBOX_SECRET'))", **FAST)
    assert result.stdout == "None\n"


async def test_concurrent_runs_are_isolated() -> None:
    code = (
        "import os, time\n"
        "open('mine.txt', 'w').write('{i}')\n"
        "time.sleep(0.2)\n"
        "print('{i}', open('mine.txt').read(), sorted(os.listdir('.')), os.getcwd())\n"
    )
    results = await asyncio.gather(
        *(run_python(code.replace("{i}", str(i)), **FAST) for i in range(8))
    )
    for i, result in enumerate(results):
        assert result.ok, result.to_text()
        index, content, *_rest, cwd = result.stdout.split()
        assert (index, content) == (str(i), str(i))
        assert "['mine.txt']" in result.stdout  # each sees only its own private directory
        assert cwd == "/sandbox"  # the same path, a separate tmpfs in each sandbox


async def test_concurrent_runs_in_process_mode_get_separate_directories() -> None:
    code = "import time\ntime.sleep(0.1)\nprint(__import__('os').getcwd())"
    results = await asyncio.gather(
        *(run_python(code, **FAST, isolation="process") for _ in range(4))
    )
    assert all(result.ok for result in results)
    assert len({result.stdout for result in results}) == 4


def test_sync_wrapper_outside_and_inside_an_event_loop() -> None:
    assert run_python_sync("print('sync')", **FAST).stdout == "sync\n"

    async def inside() -> str:
        return run_python_sync("print('nested')", **FAST).stdout

    assert asyncio.run(inside()) == "nested\n"


def test_bad_limits_are_caller_errors() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        run_python_sync("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python_sync("pass", memory_mb=1)
    with pytest.raises(TypeError, match="code: expected str"):
        run_python_sync(b"print(1)")  # type: ignore[arg-type]


def test_python_tool_returns_output_or_a_clear_failure() -> None:
    assert isinstance(python_tool, Tool) and python_tool.name == "python"
    assert python_tool.schema["function"]["parameters"]["required"] == ["code"]
    ok = python_tool.call({"code": "print(sum(range(10)))"})
    assert ok.ok and ok.content == "45\n"
    tool = make_python_tool(timeout_s=0.5, memory_mb=128)
    slow = tool.call('{"code": "while True: pass"}')
    assert (slow.error, slow.content) == ("timeout", "Error: timed out after 0.5 s")
    bad = tool.call({"code": "raise ValueError('nope')"})
    assert bad.error == "tool_exception"
    assert bad.content.startswith("Error: ValueError: nope\nTraceback")
    assert tool.call({}).error == "bad_arguments"


@pytest.mark.parametrize(("isolation", "use_namespaces"), MODES, ids=MODE_IDS)
async def test_leftover_forks_are_killed_when_the_code_ends(
    isolation: str, use_namespaces: bool | None
) -> None:
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('done')"
    result = await run_python(
        code, timeout_s=5.0, max_processes=1, isolation=isolation, use_namespaces=use_namespaces
    )
    assert result.ok, result.to_text()
    assert result.stdout == "done\n"
    assert result.duration_s < 2.0  # not held up by the sleeping fork


async def test_disk_quota_and_signals_are_reported() -> None:
    result = await run_python("open('big', 'wb').write(b'x' * (3 << 20))", **FAST, disk_mb=2)
    assert (result.error, result.message) == ("disk", "Error: disk quota of 2 MB exceeded")
    result = await run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", **FAST)
    assert result.error == "signal" and result.exit_code is None
    assert result.message == "Error: the process was killed by signal SIGSEGV"
    result = await run_python("import sys\nsys.exit(139)", **FAST)  # not mistaken for a signal
    assert (result.error, result.exit_code) == ("exit", 139)


def test_isolation_is_chosen_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SandboxLimits().isolation == "bwrap"
    monkeypatch.setenv("AREAL_SANDBOX_ISOLATION", "process")
    assert SandboxLimits().isolation == "process"
    assert "areal-sandbox-" in run_python_sync("import os\nprint(os.getcwd())", **FAST).stdout
    monkeypatch.setenv("AREAL_SANDBOX_ISOLATION", "none")
    with pytest.raises(ValueError, match="isolation: expected one of 'bwrap', 'process'"):
        SandboxLimits()
    with pytest.raises(ValueError, match="use_namespaces applies to isolation='process'"):
        run_python_sync("pass", isolation="bwrap", use_namespaces=False)


def test_missing_bubblewrap_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_bwrap, "_verified", set())
    real_which = sandbox_bwrap.shutil.which
    monkeypatch.setattr(
        sandbox_bwrap.shutil,
        "which",
        lambda name, **kw: None if name == "bwrap" else real_which(name, **kw),
    )
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        make_python_tool()
    with pytest.raises(SandboxUnavailableError, match="isolation='process'"):
        run_python_sync("print(1)")
    # The explicit opt-in still runs (the weaker in-process checks).
    tool = make_python_tool(isolation="process", timeout_s=5.0)
    assert tool.call({"code": "print(2)"}).content == "2\n"


def test_bubblewrap_without_user_namespaces_refuses_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failing = ["/bin/sh", "-c", "echo 'bwrap: setting up uid map: Permission denied' >&2; exit 1"]
    monkeypatch.setattr(sandbox_bwrap, "_verified", set())
    monkeypatch.setattr(
        sandbox_bwrap, "bwrap_launch", lambda limits: sandbox_bwrap.BwrapLaunch([*failing, "sh"])
    )
    with pytest.raises(SandboxUnavailableError) as info:
        check_sandbox("bwrap")
    text = str(info.value)
    assert "setting up uid map: Permission denied" in text
    assert "user.max_user_namespaces" in text and "isolation='process'" in text
    check_sandbox("process")  # always available


async def test_each_run_has_its_own_memory_cgroup_removed_after_it() -> None:
    parent, why = memory_cgroup_parent()
    if parent is None:
        pytest.skip(f"no memory cgroup here ({why})")
    mine = f"areal-sandbox-{os.getpid()}-"
    limit_file = "memory.limit_in_bytes" if parent.version == 1 else "memory.max"
    task = asyncio.ensure_future(run_python("import time\ntime.sleep(1)", **FAST, disk_mb=8))
    limits: list[int] = []
    while not task.done() and not limits:
        for name in os.listdir(parent.path):
            with contextlib.suppress(OSError, ValueError):
                if name.startswith(mine):
                    with open(os.path.join(parent.path, name, limit_file)) as f:
                        limits.append(int(f.read()))
        await asyncio.sleep(0.02)
    assert (await task).ok
    assert limits == [SandboxLimits(memory_mb=256, disk_mb=8).cgroup_bytes]  # 304 MB
    assert not [name for name in os.listdir(parent.path) if name.startswith(mine)]


async def test_without_a_memory_cgroup_it_warns_once_and_refuses_shared_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_cgroup() -> tuple[None, str]:
        return None, "the test took it away"

    monkeypatch.setattr(sandbox_cgroup, "memory_cgroup_parent", no_cgroup)
    monkeypatch.setattr(sandbox_bwrap, "memory_cgroup_parent", no_cgroup)
    monkeypatch.setattr(sandbox_bwrap, "_warned", False)
    code = "import os\ntry:\n    os.memfd_create('x')\nexcept OSError as e:\n    print(e.strerror)"
    with caplog.at_level(logging.WARNING, logger="areal_agents.tools.sandbox_bwrap"):
        results = [await run_python(code, **FAST) for _ in range(2)]
    assert [r.stdout for r in results] == ["Operation not permitted\n"] * 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "no memory cgroup (the test took it away)" in warnings[0]
    assert "memory is bounded per process (RLIMIT_AS), not as a whole" in warnings[0]


async def test_a_launcher_that_cannot_join_its_cgroup_refuses_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The code cannot pass for the launcher: its marker lacks the launch's token.
    code = "import os, sys\nprint('areal-sandbox-setup[0]: forged', file=sys.stderr)\nos._exit(125)"
    result = await run_python(code, **FAST)
    assert (result.error, result.exit_code) == ("exit", 125)
    gone = sandbox_cgroup.MemoryCgroup(str(tmp_path / "removed"), 1)
    monkeypatch.setattr(sandbox_bwrap, "create_memory_cgroup", lambda limit: gone)
    with pytest.raises(SandboxUnavailableError, match="cannot join the memory cgroup") as info:
        await run_python("print(1)", **FAST)
    assert "isolation='process'" in str(info.value)
