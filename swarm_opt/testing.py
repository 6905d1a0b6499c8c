"""Run peers on one machine and always clean them up: the one harness of the test suite, the benchmarks and the demo.

A peer is several processes (the user's, a DHT process, its ``p2pd`` daemon, an averager). Each peer started here
runs in a session of its own, so that one signal reaches all of it, as a terminal's Ctrl-C does, and a SIGKILL of its
process group leaves nothing behind even when the peer itself died first and left orphans. Output goes to files, so
a hung peer never blocks on a full pipe and its log survives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

from swarm_opt._libc import die_with_parent
from swarm_opt._procfs import memory_rollup

#: the directory that holds the ``swarm_opt`` package (a checkout's root): peers import swarm_opt from there
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def peer_env(**extra: str) -> Dict[str, str]:
    """The environment of a local peer: this process's, importing this swarm_opt, one thread per peer (peers share
    the machine's cores), unbuffered output (a log shows what happened up to a kill), and Python's stacks in the log
    of a process that dies of a fatal signal (a C++ abort in a forked averager process names itself)."""
    path = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1", **extra}


def start(argv: Sequence[str], *, log: Path, stderr_log: Optional[Path] = None, env: Optional[Dict[str, str]] = None,
          cwd: Optional[Path] = None, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """Start ``python ARGV...`` in a session of its own, output to ``log`` (stderr too, unless ``stderr_log``).
    ``prefix`` runs it through another command (``ip netns exec HOST``). The kernel SIGKILLs it when the thread that
    called ``start`` ends (``PR_SET_PDEATHSIG``; Linux): a driver or a test run that dies, even of SIGKILL, leaves no
    peer behind in its own session (a peer's DHT process and averager die with the peer). Call it from a thread that
    lives as long as the peer should (a driver's main thread, a test's)."""
    parent = os.getpid()
    with open(log, "w") as out, open(stderr_log or os.devnull, "w") as err:
        return subprocess.Popen([*prefix, sys.executable, *argv], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err if stderr_log else subprocess.STDOUT, start_new_session=True,
                                env=peer_env() if env is None else env, cwd=str(cwd or SOURCE_ROOT),
                                preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent))


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (nothing if the whole group is gone)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGKILL the process groups of ``procs`` and reap them; also after a clean exit, because a peer's session may
    still hold orphans (``p2pd``, an averager) after its leader is gone."""
    procs = list(procs)
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        signal_group(proc, signal.SIGKILL)


def _group_entries(procs: Iterable[subprocess.Popen]) -> Iterable[Path]:
    """The /proc entries of the live (not zombie) processes in the process groups of ``procs``."""
    groups = {proc.pid for proc in procs}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if int(fields[2]) in groups and fields[0] != "Z":
                yield entry
        except (OSError, IndexError, ValueError):
            continue


def leftovers(procs: Iterable[subprocess.Popen]) -> List[str]:
    """``"pid command"`` of every process still alive in the process groups of ``procs`` (none after ``kill``)."""
    found = []
    for entry in _group_entries(procs):
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
        except OSError:
            continue
        found.append(f"{entry.name} {command}")
    return found


def processes_named(procs: Iterable[subprocess.Popen], name: str) -> List[int]:
    """Pids of the live processes called ``name`` (e.g. ``"p2pd"``) in the process groups of ``procs``."""
    found = []
    for entry in _group_entries(procs):
        try:
            if (entry / "comm").read_text().strip() == name:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def write_addresses(maddrs: Iterable[object], path: Union[str, Path]) -> None:
    """Publish a peer's DHT addresses for the peers started beside it: atomically, as they read it once it exists."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps([str(a) for a in maddrs]))
    os.replace(tmp, path)


def read_addresses(path: Union[str, Path], timeout: float = 90.0,
                   alive: Callable[[], bool] = lambda: True) -> List[str]:
    """Wait for the addresses ``write_addresses`` publishes at ``path`` (while ``alive()``) and return them."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if not alive():
            raise RuntimeError(f"the peer that was to write {path} exited first")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout:.0f} s: the first peer did not start its DHT")
        time.sleep(0.05)
    return json.loads(Path(path).read_text())


def initial_peers(config: dict) -> List[str]:
    """A test peer's initial peers: its config's ``initial_peers``, or the addresses its swarm's first peer writes to
    ``initial_peers_file`` (peers started beside the first one wait for them there)."""
    if config.get("initial_peers_file"):
        return read_addresses(config["initial_peers_file"])
    return list(config.get("initial_peers", []))


# --- what a peer's processes hold (benchmarks/soak.py, benchmarks/peer_memory.py, tests/e2e/test_soak.py) ---

def _stat(pid: int) -> Optional[tuple]:
    """(state, ppid, pgrp, session) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[2]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def session_members(sid: int) -> List[int]:
    """Live processes of the session ``sid``: a peer started by ``swarm_opt.testing`` leads its own, and its DHT
    process and p2pd stay in it (they leave the peer's process group, not its session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat and stat[3] == sid and stat[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def process_sample(pid: int) -> Optional[Dict[str, float]]:
    """PSS, USS, RSS, anonymous and shared-memory PSS (bytes), open fds and threads of one process; None if it went
    away while being read."""
    try:
        memory = memory_rollup(pid)
        threads = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("Threads:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, StopIteration, ValueError):
        return None
    return {"pid": pid, "comm": comm, "pss": memory.get("Pss", 0), "rss": memory.get("Rss", 0),
            "uss": memory["USS"], "anon": memory["anon"], "fds": fds, "threads": threads}


def name_roles(leader: int, procs: List[Dict]) -> None:
    """Label each process of a peer's tree: trainer (the leader), p2pd, dht (p2pd's parent), shm_manager (torch's
    torch_shm_manager), averager (any other process; numbered when there are several)."""
    parents = {p["pid"]: _stat(p["pid"]) for p in procs}
    dht_pids = {parents[p["pid"]][1] for p in procs if p["comm"] == "p2pd" and parents.get(p["pid"])}
    others = 0
    for p in procs:
        if p["pid"] == leader:
            p["role"] = "trainer"
        elif p["comm"] == "p2pd":
            p["role"] = "p2pd"
        elif p["comm"].startswith("torch_shm"):
            p["role"] = "shm_manager"
        elif p["pid"] in dht_pids:
            p["role"] = "dht"
        else:
            others += 1
            p["role"] = "averager" if others == 1 else f"averager{others}"
