"""Launch real peers as separate OS processes (each in its own session) and always clean them up."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from swarm_opt import testing

PEER_SCRIPT = Path(__file__).with_name("peer.py")
REPO = Path(__file__).resolve().parents[2]
LOG_TAIL = 40  # lines of each peer's log shown under a failed swarm test
#: what a peer says when it loads a checkpoint older than the swarm's state it held (``Optimizer.load_state_dict``)
OLDER_CHECKPOINT = r"older than the (state this peer held|swarm's state this peer downloaded as it joined)"


class Swarm:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: Dict[int, subprocess.Popen] = {}
        self.first: Optional[int] = None  # the rank whose DHT addresses are everyone's initial peers
        self._initial_peers: List[str] = []

    def start(self, rank: int, *, script: Path = PEER_SCRIPT, **config) -> subprocess.Popen:
        """Start ``script`` (default peer.py) with ``config`` as its JSON config. The first peer's DHT addresses
        (it writes them to OUT.maddrs) are everyone's initial peers: the peers started after it do not wait for it
        here but inside ``script`` (config ``initial_peers_file``), so that they start up beside it."""
        if self.first is None:
            self.first = rank
            return self._launch(rank, script, dict(initial_peers=[], **config))
        return self._launch(rank, script, dict(initial_peers_file=str(self._addresses(self.first)), **config))

    @property
    def initial_peers(self) -> List[str]:
        """The first peer's DHT addresses, for a process a test starts by hand (waits for them)."""
        if not self._initial_peers:
            assert self.first is not None, "start a peer first"
            proc = self.procs[self.first]
            try:
                self._initial_peers = testing.read_addresses(self._addresses(self.first), timeout=60,
                                                             alive=lambda: proc.poll() is None)
            except (RuntimeError, TimeoutError) as e:
                pytest.fail(f"{e}; its log:\n{self.log(self.first)}")
        return self._initial_peers

    def _addresses(self, rank: int) -> Path:
        return self.tmp / f"peer{rank}.pt.maddrs"

    def _launch(self, rank: int, script: Path, config: dict) -> subprocess.Popen:
        out = self.tmp / f"peer{rank}.pt"
        config = dict(rank=rank, out=str(out), **config)
        path = self.tmp / f"peer{rank}.json"
        path.write_text(json.dumps(config))
        proc = testing.start([str(script), str(path)], log=self.tmp / f"peer{rank}.log")
        self.procs[rank] = proc
        return proc

    def log(self, rank: int) -> str:
        return (self.tmp / f"peer{rank}.log").read_text()

    def round_events(self) -> str:
        """The peers' log lines about rounds that did not commit and about catching up, for assertion messages:
        why a round failed is what a failure of a swarm test needs first."""
        marks = ("did not reach a majority", "Loaded the swarm's state", "continuing from the local model",
                 "it lies (or is broken)")  # whom an audited round named, and left out of later groups
        return "\n".join(f"peer {rank}: {line}" for rank in self.procs
                         for line in self.log(rank).splitlines() if any(m in line for m in marks))

    def wait(self, timeout: float) -> None:
        """Wait until every peer wrote its result, then let them all leave (peers linger as donors until then)."""
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            out = self.tmp / f"peer{rank}.pt"
            while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        for rank in self.procs:
            (self.tmp / f"peer{rank}.pt.stop").touch()
        for rank, proc in self.procs.items():
            remaining = max(1.0, deadline - time.monotonic())
            try:
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                pytest.fail(f"peer {rank} did not finish in time; log:\n{self.log(rank)}")
            assert proc.returncode == 0, f"peer {rank} exited with {proc.returncode}:\n{self.log(rank)}"

    def result(self, rank: int) -> dict:
        return torch.load(self.tmp / f"peer{rank}.pt")

    def kill(self, rank: int) -> None:
        """SIGKILL a peer's whole process group (its DHT, averager and p2pd daemons die with it)."""
        testing.kill([self.procs.pop(rank)])

    def kill_all(self) -> None:
        testing.kill(self.procs.values())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """When a test of the ``swarm`` fixture fails, its report ends with the tail of every peer's log: why a round
    failed or a peer caught up is what a failure on a CI machine, whose files are gone, needs first."""
    outcome = yield
    report = outcome.get_result()
    swarm = getattr(item, "funcargs", {}).get("swarm")
    if report.when == "call" and report.failed and isinstance(swarm, Swarm):
        for log in sorted(swarm.tmp.glob("peer*.log")):
            lines = log.read_text(errors="replace").splitlines()
            report.sections.append((f"{log.name} (last {min(len(lines), LOG_TAIL)} lines)",
                                    "\n".join(lines[-LOG_TAIL:])))


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.kill_all()


@pytest.fixture(scope="module")
def dht():
    """One DHT node on loopback for the in-process peers of a test module."""
    import hivemind

    node = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    yield node
    node.shutdown()


def assert_same_params_at_each_epoch(results: list, epochs: int) -> None:
    """The peers' results (``params``: {epoch: parameters}) agree exactly wherever two hold the same epoch; each
    reached ``epochs``, with finite ``final`` parameters (the Lightning and Trainer peers)."""
    for epoch in range(max(r["epoch"] for r in results) + 1):
        held = [r["params"][epoch] for r in results if epoch in r["params"]]
        for params in held[1:]:
            for p, q in zip(params, held[0]):
                assert torch.equal(p, q), f"peers disagree at global epoch {epoch}"
    assert all(r["epoch"] >= epochs for r in results)
    assert all(torch.isfinite(p).all() for r in results for p in r["final"])


def assert_quiet(swarm: Swarm) -> None:
    """No traceback, and no warning or error from swarm_opt or hivemind, in any peer's output."""
    for rank in swarm.procs:
        for line in swarm.log(rank).splitlines():
            assert "Traceback" not in line, swarm.log(rank)
            if re.search(r" (WARNING|ERROR) (swarm_opt|hivemind)", line) or re.search(
                    r"(swarm_opt|hivemind)\S*\.py:\d+: \w*Warning", line):
                pytest.fail(f"peer {rank}: {line}")
