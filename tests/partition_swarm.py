"""A training swarm on test hosts, split and healed: the harness of the training-level partition tests
(``tests/e2e/test_partition.py``) and of ``benchmarks/partition.py``.

A bootstrap node (``swarm-opt dht``) runs on host 0 and one gradient-averaging trainer (``swarm-opt train``, task
``digits``) on each of hosts 1..N (``tests/hosts.py``). A thread reads the trainers' output every quarter second and
notes when each epoch line first appeared, so that a caller can measure the run's epoch rate over any window, find
the first epoch every trainer printed with the same test metrics (one model: the test set is the same for all, so
equal metrics mean equal parameters) and tell which trainers downloaded a state after the links came back.
"""

from __future__ import annotations

import bisect
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from swarm_opt import testing
from tests.hosts import Hosts

PORT = 31337
LOST = "Lost sight of the swarm's DHT"
FOUND = "Found the swarm's DHT again"
EPOCH = re.compile(r"^epoch (\d+): (test accuracy [\d.]+%, test loss [\d.]+)(.*)$", re.MULTILINE)
DOWNLOADED = "caught up by downloading"
LONGEST = re.compile(r"stopped by SIGINT at epoch (\d+) \(the longest step\(\) took ([\d.]+) s, at epoch (\d+)\)")


def peer_env() -> Dict[str, str]:
    """A peer's environment without the user's own ``SWARM_OPT_*`` settings."""
    return {k: v for k, v in testing.peer_env().items() if not k.startswith("SWARM_OPT_")}


class Proc:
    """A program on a test host, its output in a file; ``kill`` kills its process group (and ``Hosts.close`` every
    process in the hosts' namespaces)."""

    def __init__(self, hosts: Hosts, index: int, name: str, args: List[str], workdir: Path) -> None:
        self.name, self.out = name, workdir / f"{name}.out"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen([*hosts.prefix(index), *args], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=workdir, env=peer_env(),
                                         start_new_session=True)

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, pattern: str, timeout: float, *, count: int = 1, since: int = 0) -> re.Match:
        """The ``count``-th match of ``pattern`` in what this program printed after offset ``since``."""
        deadline = time.monotonic() + timeout
        while True:
            matches = list(re.finditer(pattern, self.text()[since:], re.MULTILINE))
            if len(matches) >= count:
                return matches[count - 1]
            tail = self.text()[-3000:]
            assert self.proc.poll() is None, f"{self.name} exited ({self.proc.returncode}):\n{tail}"
            assert time.monotonic() < deadline, f"{self.name}: no {pattern!r} in {timeout:.0f} s:\n{tail}"
            time.sleep(0.2)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@dataclass(frozen=True)
class Healed:
    """What followed the links' return: the epoch at which every trainer held one model, how many seconds after
    the links came back it was printed, the trainers that downloaded a state in between, and those that reached
    that epoch by a round (not a download)."""

    epoch: int
    seconds: float
    downloaded: Set[int]
    committed: Set[int]


class TrainingSwarm:
    """``size`` trainers (hosts 1..size) and a bootstrap node (host 0); see the module docstring."""

    def __init__(self, hosts: Hosts, size: int, workdir: Path, *, averaging_timeout: float = 20.0,
                 target_batch_size: int = 512) -> None:
        self.hosts, self.size, self.averaging_timeout, self.matchmaking_time = hosts, size, averaging_timeout, 2.0
        self.node = Proc(hosts, 0, "dht", [sys.executable, "-m", "swarm_opt", "dht", "--host-maddrs",
                                           f"/ip4/{hosts.address(0)}/tcp/{PORT}"], workdir)
        bootstrap = self.node.wait_for(r"^(/ip4/10\.\S+/p2p/\S+)$", 60).group(1)
        self.trainers = {i: Proc(hosts, i, f"trainer{i}", [
            sys.executable, "-m", "swarm_opt", "train", "--run-id", "partition", "--initial-peers", bootstrap,
            "--host-maddrs", f"/ip4/{hosts.address(i)}/tcp/{PORT}", "--task", "digits", "--target-batch-size",
            str(target_batch_size), "--batch-size", "32", "--min-peers", str(size), "--matchmaking-time",
            str(self.matchmaking_time),
            "--averaging-timeout", str(averaging_timeout), "--data-seed", str(i), "-v"], workdir)
            for i in range(1, size + 1)}
        self._lock = threading.Lock()
        self._seen: Dict[int, Dict[int, float]] = {i: {} for i in self.trainers}  # epoch -> when first printed
        self._read_up_to = {i: 0 for i in self.trainers}  # what each trainer printed up to its last whole line, read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="epoch-lines", daemon=True)
        self._thread.start()

    # --- reading the trainers' output --------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            self._read()

    def _read(self) -> None:
        """Note when each epoch line that a trainer printed since the last read first appeared."""
        with self._lock:
            for i, trainer in self.trainers.items():
                now = time.monotonic()
                with open(trainer.out, "rb") as out:
                    out.seek(self._read_up_to[i])
                    new = out.read()
                new = new[:new.rfind(b"\n") + 1]
                self._read_up_to[i] += len(new)
                for epoch, _, _ in EPOCH.findall(new.decode(errors="replace")):
                    self._seen[i].setdefault(int(epoch), now)

    def offsets(self) -> Dict[int, int]:
        """How much each trainer printed so far: ``epochs_since`` reads what follows."""
        return {i: len(t.text()) for i, t in self.trainers.items()}

    def epochs_since(self, i: int, offset: int, end: Optional[int] = None) -> List[Tuple[int, str, str]]:
        """(epoch, test metrics, the rest of the line) of each epoch line trainer ``i`` printed after ``offset`` (up
        to ``end``)."""
        text = self.trainers[i].text()[offset:end]
        return [(int(e), metrics, rest) for e, metrics, rest in EPOCH.findall(text)]

    def epoch(self, i: int) -> int:
        """The newest epoch trainer ``i`` printed (0 before any), up to now (not the watcher's last read: a caller
        that just saw a line in the output finds its epoch here)."""
        self._read()
        with self._lock:
            return max(self._seen[i], default=0)

    def epoch_at(self, i: int, when: float) -> int:
        """The newest epoch trainer ``i`` had printed at monotonic time ``when``, by the watcher's notes; epochs
        skipped by a download count as reached when the download's line came."""
        with self._lock:
            reached = sorted((t, e) for e, t in self._seen[i].items())
        index = bisect.bisect_right([t for t, _ in reached], when)
        return max((e for _, e in reached[:index]), default=0)

    def known_since(self) -> float:
        """When the trainers had all seen one another, at the latest (monotonic): the first epoch line any of them
        printed (``--min-peers`` holds the first epoch until every trainer is there). A cut peer remembers the
        others for as long as it had seen them, up to ``TrackerConfig.forget_after`` (``swarm_opt.progress``)."""
        self._read()
        with self._lock:
            return min(min(seen.values()) for seen in self._seen.values() if seen)

    def rate(self, trainers: Iterable[int], start: float, end: float) -> float:
        """Epochs per second over [start, end] (monotonic times): the median over ``trainers`` of the epochs each
        advanced in that window, divided by its length."""
        advanced = sorted(self.epoch_at(i, end) - self.epoch_at(i, start) for i in trainers)
        return advanced[len(advanced) // 2] / (end - start)

    def one_model(self, offsets: Dict[int, int]) -> Optional[int]:
        """The first epoch that every trainer printed since ``offsets`` with the same test metrics, or None."""
        seen = {i: {e: metrics for e, metrics, _ in self.epochs_since(i, offsets[i])} for i in self.trainers}
        common = set.intersection(*(set(s) for s in seen.values()))
        return next((e for e in sorted(common) if len({s[e] for s in seen.values()}) == 1), None)

    def describe(self, offsets: Dict[int, int]) -> str:
        """Each trainer's last epochs since ``offsets`` and its last lines that are not about an epoch (what it
        said about the swarm: lost sight of it, ignored a peer, downloaded, failed a round)."""
        def said(i: int) -> List[str]:
            lines = self.trainers[i].text()[offsets[i]:].splitlines()
            return [line[:200] for line in lines
                    if not EPOCH.match(line) and "INFO swarm_opt.optimizer: epoch" not in line][-6:]

        return "; ".join(f"trainer {i}: {[(e, m, r.strip(', ')[:40]) for e, m, r in self.epochs_since(i, o)][-3:]}, "
                         f"said {said(i)}" for i, o in offsets.items())

    # --- the run's course -------------------------------------------------------------------------------------------
    def wait_together(self, timeout: float = 240, since: Optional[Dict[int, int]] = None) -> None:
        """Until every trainer averaged a round with all the others (after ``since``: offsets)."""
        deadline = time.monotonic() + timeout
        for i, trainer in self.trainers.items():
            trainer.wait_for(rf"^epoch \d+: .*averaged with {self.size} of {self.size} peer",
                             max(0.0, deadline - time.monotonic()), since=since[i] if since else 0)

    def cut(self, sides: Sequence[Set[int]]) -> None:
        """Cut each set of trainers in ``sides`` off on a side of its own (trainers on one side see each other)."""
        for side in sides:
            self.hosts.cut(side)

    def heal(self, timeout: float = 60.0) -> Healed:
        """Bring every link back; wait until the trainers hold one model (at most ``timeout`` seconds)."""
        offsets = self.offsets()
        self.hosts.heal()
        healed = time.monotonic()
        epoch = self.wait_one_model(offsets, timeout, "of healing")
        downloaded = {i for i in self.trainers
                      if any(DOWNLOADED in rest for e, _, rest in self.epochs_since(i, offsets[i]) if e <= epoch)}
        committed = {i for i in self.trainers
                     if any(e == epoch and "averaged with" in rest for e, _, rest in self.epochs_since(i, offsets[i]))}
        return Healed(epoch, time.monotonic() - healed, downloaded, committed)

    def wait_one_model(self, offsets: Dict[int, int], timeout: float, what: str = "") -> int:
        """The first epoch every trainer printed since ``offsets`` with the same metrics, within ``timeout``."""
        started = time.monotonic()
        while (epoch := self.one_model(offsets)) is None:
            assert time.monotonic() - started < timeout, \
                f"no one model within {timeout:.0f} s {what}: {self.describe(offsets)}"
            time.sleep(0.25)
        return epoch

    def stop(self, timeout: float = 60.0) -> Dict[int, Tuple[float, int]]:
        """Stop every trainer with Ctrl-C (they leave cleanly); each one's longest step() (seconds, at epoch)."""
        self._stop.set()
        for trainer in self.trainers.values():
            trainer.proc.send_signal(signal.SIGINT)
        longest = {}
        for i, trainer in self.trainers.items():
            trainer.proc.wait(timeout)
            match = LONGEST.search(trainer.text())
            assert match is not None and "Traceback" not in trainer.text(), trainer.text()[-3000:]
            longest[i] = (float(match.group(2)), int(match.group(3)))
        return longest

    def close(self) -> None:
        self._stop.set()
        for proc in [*self.trainers.values(), self.node]:
            proc.kill()
