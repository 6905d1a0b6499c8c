"""Run ``swarm-opt`` commands as a user does: separate processes, each in its own session (a Ctrl-C is sent to the
whole process group, as a terminal does), output read from files, every process group killed at the end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from swarm_opt import testing

REPO = Path(__file__).resolve().parents[2]
TAG_VARIABLE = "SWARMOPT_CLI_TEST_TAG"


def dump_stacks(proc: subprocess.Popen) -> None:
    """Where every thread of a peer's process is: SIGABRT makes Python's faulthandler (on in a peer's environment,
    ``testing.peer_env``) write their stacks to its stderr before it dies."""
    try:
        os.kill(proc.pid, signal.SIGABRT)
        proc.wait(5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def cli_env(**extra: str) -> Dict[str, str]:
    """A local peer's environment without the user's own ``SWARM_OPT_*`` settings."""
    return {k: v for k, v in testing.peer_env(**extra).items() if not k.startswith("SWARM_OPT_") or k in extra}


def run_cli(*args: str, timeout: float = 90, cwd: Optional[Path] = None, **env: str) -> subprocess.CompletedProcess:
    """Run a command to completion (for commands that exit by themselves: bad input, --once)."""
    return subprocess.run([sys.executable, "-m", "swarm_opt", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=cli_env(**env), start_new_session=True)


class CliProcess:
    def __init__(self, name: str, args: List[str], workdir: Path, env: Dict[str, str],
                 module: str = "swarm_opt") -> None:
        self.name, self.args = name, args
        self.out, self.err = workdir / f"{name}.out", workdir / f"{name}.err"
        self.proc = testing.start(["-m", module, *args], log=self.out, stderr_log=self.err, env=env, cwd=workdir)

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, pattern: str, timeout: float, stream: str = "stdout") -> re.Match:
        """Wait until the output matches ``pattern``; fail with the process's output if it exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, getattr(self, stream), re.MULTILINE)
            if match:
                return match
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the last lines may still be on their way to the file
                match = re.search(pattern, getattr(self, stream), re.MULTILINE)
                if match:
                    return match
                pytest.fail(f"{self.name} exited ({self.proc.returncode}) before printing {pattern!r}:\n"
                            f"{self.describe()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} did not print {pattern!r} within {timeout:.0f} s:\n{self.describe()}")
            time.sleep(0.2)

    def interrupt(self) -> None:
        """Ctrl-C in a terminal: SIGINT to the whole process group (hivemind's processes and p2pd included)."""
        testing.signal_group(self.proc, signal.SIGINT)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            dump_stacks(self.proc)
            pytest.fail(f"{self.name} did not exit within {timeout:.0f} s:\n{self.describe()}")

    def describe(self) -> str:
        return f"--- {self.name} stdout ---\n{self.stdout[-3000:]}\n--- {self.name} stderr ---\n{self.stderr[-6000:]}"

    def kill(self) -> None:
        testing.kill([self.proc])


def processes_tagged(tag: str, variable: str = TAG_VARIABLE) -> Dict[int, str]:
    """pid -> command of every live process whose environment carries the tag (children inherit it, p2pd too)."""
    found = {}
    needle = f"{variable}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


class Cli:
    """Starts ``swarm-opt`` processes in ``workdir``; ``kill_all`` removes them and anything they started."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.tag = uuid.uuid4().hex
        self.processes: List[CliProcess] = []

    def start(self, name: str, *args: str, module: str = "swarm_opt") -> CliProcess:
        """``python -m MODULE ARGS...`` (``swarm-opt``, or a stand-in such as ``tests.e2e.previous_release``)."""
        process = CliProcess(name, list(args), self.workdir, cli_env(**{TAG_VARIABLE: self.tag}), module)
        self.processes.append(process)
        return process

    def run(self, *args: str, timeout: float = 90, **env: str) -> subprocess.CompletedProcess:
        return run_cli(*args, timeout=timeout, cwd=self.workdir, **{TAG_VARIABLE: self.tag}, **env)

    def dht(self, *extra: str) -> tuple:
        """A bootstrap node on loopback; returns (process, its first multiaddr)."""
        node = self.start(f"dht{len(self.processes)}", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *extra)
        maddr = node.wait_for(r"^(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)$", timeout=60).group(1)
        return node, maddr

    def leftovers(self, wait: float = 0.0) -> Dict[int, str]:
        """Processes started by this test that are still alive (waiting up to ``wait`` seconds for them to go)."""
        deadline = time.monotonic() + wait
        while True:
            found = processes_tagged(self.tag)
            if not found or time.monotonic() >= deadline:
                return found
            time.sleep(0.2)

    def kill_all(self) -> None:
        for process in self.processes:
            process.kill()
        for pid in self.leftovers():  # a process that left its group (none should) is still ours by its tag
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def cli(tmp_path: Path):
    c = Cli(tmp_path)
    try:
        yield c
    finally:
        c.kill_all()
