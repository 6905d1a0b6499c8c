"""A swarm's DHT split by a network partition finds itself again: test hosts (network namespaces on a bridge) whose
links are cut and healed (``Hosts.cut`` / ``Hosts.heal``), as a real network fails.

Each DHT peer (``tests/e2e/dht_peer.py``) publishes its own key every second and reads everyone's, as a training
peer's tracker does, and prints which peers' fresh values it read. A peer cut off from the others sees only itself;
after the links come back every peer must read every other within 60 s. Plain hivemind never gets there: its nodes
drop each other from their routing tables while the link is down and nobody dials again (``docs/hivemind.md``,
"Partitions"); ``test_plain_hivemind_stays_split_after_the_link_is_back`` keeps that on record. Skipped, with the
reason, where namespaces cannot be created.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Set

import pytest

from tests.e2e.conftest import REPO, cli_env
from tests.hosts import Hosts, namespaces_unavailable

PEER_SCRIPT = REPO / "tests" / "e2e" / "dht_peer.py"
PORT = 31337
LOST = "Lost sight of the swarm's DHT"
FOUND = "Found the swarm's DHT again"


@pytest.fixture
def make_hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    made: List[Hosts] = []

    def make(n: int) -> Hosts:
        made.append(Hosts(n))
        return made[-1]

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()


class Proc:
    """A program on a test host, its output in files; its process group is killed by ``kill`` (and every process
    in the hosts' namespaces by ``Hosts.close``)."""

    def __init__(self, hosts: Hosts, index: int, name: str, args: List[str], workdir: Path) -> None:
        self.name, self.out = name, workdir / f"{name}.out"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen([*hosts.prefix(index), *args], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=workdir, env=cli_env(),
                                         start_new_session=True)

    def text(self) -> str:
        return self.out.read_text()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.text(), re.MULTILINE)
            if match:
                return match
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


class DhtPeer(Proc):
    def __init__(self, hosts: Hosts, index: int, peers: int, workdir: Path, initial_peers: Iterable[str] = (),
                 watch: bool = True, name: Optional[str] = None) -> None:
        args = [sys.executable, str(PEER_SCRIPT), str(index), str(peers), f"/ip4/{hosts.address(index)}/tcp/{PORT}"]
        if initial_peers:
            args += ["--initial-peers", *initial_peers]
        if not watch:
            args.append("--no-watch")
        super().__init__(hosts, index, name or f"peer{index}", args, workdir)

    @property
    def address(self) -> str:
        return self.wait_for(r"^address (/ip4/10\.\S+)$", 60).group(1)

    def seen(self) -> Set[int]:
        """The peers whose fresh values this peer read at its last look."""
        lines = re.findall(r"^seen t=\S+ table=\d+ peers=([\d,]*)$", self.text(), re.MULTILINE)
        return {int(i) for i in lines[-1].split(",") if i} if lines else set()

    def looks(self) -> int:
        return len(re.findall(r"^seen ", self.text(), re.MULTILINE))


def wait_until(condition: Callable[[], bool], timeout: float, what: Callable[[], str]) -> float:
    """Seconds until ``condition()`` held; fails with ``what()`` after ``timeout``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"not within {timeout:.0f} s: {what()}"
        time.sleep(0.5)
    return time.monotonic() - start


def fresh_looks(peers: Dict[int, DhtPeer], looks: int = 2) -> None:
    """Wait until every peer has looked ``looks`` more times (so that ``seen`` describes the present)."""
    start = {i: p.looks() for i, p in peers.items()}
    wait_until(lambda: all(p.looks() >= start[i] + looks for i, p in peers.items()), 60, lambda: "peers stalled")


def everyone_sees_everyone(peers: Dict[int, DhtPeer]) -> bool:
    return all(p.seen() == set(peers) for p in peers.values())


def describe(peers: Dict[int, DhtPeer]) -> str:
    return "; ".join(f"peer {i} sees {sorted(p.seen())}" for i, p in peers.items()) + "\n" + "\n".join(
        f"--- {p.name}\n{p.text()[-1500:]}" for p in peers.values())


def start_swarm(hosts: Hosts, n: int, tmp_path: Path, watch: bool = True) -> Dict[int, DhtPeer]:
    """``n`` DHT peers, one per host; peer 0 first, the others join through it."""
    first = DhtPeer(hosts, 0, n, tmp_path, watch=watch)
    peers = {0: first}
    for i in range(1, n):
        peers[i] = DhtPeer(hosts, i, n, tmp_path, initial_peers=[first.address], watch=watch)
    wait_until(lambda: everyone_sees_everyone(peers), 60, lambda: describe(peers))
    return peers


def cut_and_heal(hosts: Hosts, peers: Dict[int, DhtPeer], cut: Set[int], seconds: float) -> None:
    """Cut ``cut`` off together for ``seconds``; checks that the cut side saw only itself meanwhile."""
    hosts.cut(cut)
    deadline = time.monotonic() + seconds
    wait_until(lambda: all(peers[i].seen() <= cut for i in cut), min(seconds, 30), lambda: describe(peers))
    time.sleep(max(0.0, deadline - time.monotonic()))
    assert all(peers[i].seen() <= cut for i in cut), describe(peers)  # still apart when the links come back
    hosts.heal()


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_dht_node_cut_off_for_30_s_finds_the_others_again(make_hosts, tmp_path):
    hosts = make_hosts(4)
    peers = start_swarm(hosts, 4, tmp_path)
    cut_and_heal(hosts, peers, {3}, 30)
    took = wait_until(lambda: everyone_sees_everyone(peers), 60, lambda: describe(peers))
    fresh_looks(peers)
    assert everyone_sees_everyone(peers), describe(peers)
    print(f"every peer read every other {took:.0f} s after the link came back")
    assert LOST in peers[3].text(), peers[3].text()
    peers[3].wait_for(FOUND, 15)
    for i in (0, 1, 2):  # three of four still saw each other: nothing to say
        assert LOST not in peers[i].text(), peers[i].text()


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(420)
def test_two_of_six_cut_off_together_for_3_minutes_find_the_others_again(make_hosts, tmp_path):
    hosts = make_hosts(6)
    peers = start_swarm(hosts, 6, tmp_path)
    cut_and_heal(hosts, peers, {2, 5}, 180)
    wait_until(lambda: everyone_sees_everyone(peers), 60, lambda: describe(peers))
    for i in (2, 5):  # each still saw its partner, 1 of 5: lost all the same
        assert LOST in peers[i].text(), peers[i].text()
        peers[i].wait_for(FOUND, 15)  # said at the watcher's next look


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(240)
def test_plain_hivemind_stays_split_after_the_link_is_back(make_hosts, tmp_path):
    """hivemind 1.1.12 without our watcher: if this fails, hivemind learnt to heal by itself (docs/hivemind.md)."""
    hosts = make_hosts(4)
    peers = start_swarm(hosts, 4, tmp_path, watch=False)
    cut_and_heal(hosts, peers, {3}, 30)
    time.sleep(60)
    assert peers[3].seen() == {3} and all(3 not in peers[i].seen() for i in (0, 1, 2)), describe(peers)


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_peers_find_each_other_through_a_restarted_bootstrap_node(make_hosts, tmp_path):
    """The bootstrap node (``swarm-opt dht`` with a fixed identity and port) dies and comes back with an empty
    routing table; the peers that joined through it dial it again, so a newcomer that knows only the bootstrap node
    finds them all, and they find the newcomer."""
    hosts = make_hosts(5)
    dht_args = [sys.executable, "-m", "swarm_opt", "dht", "--host-maddrs", f"/ip4/{hosts.address(0)}/tcp/{PORT}",
                "--identity-path", str(tmp_path / "bootstrap.id")]
    node = Proc(hosts, 0, "bootstrap", dht_args, tmp_path)
    bootstrap = node.wait_for(r"^(/ip4/10\.\S+/p2p/\S+)$", 60).group(1)
    peers = {i: DhtPeer(hosts, i, 5, tmp_path, initial_peers=[bootstrap]) for i in (1, 2, 3)}
    wait_until(lambda: all(p.seen() == {1, 2, 3} for p in peers.values()), 60, lambda: describe(peers))

    node.kill()
    fresh_looks(peers, looks=5)  # their reads go on without it
    again = Proc(hosts, 0, "bootstrap_again", dht_args, tmp_path)
    assert again.wait_for(r"^(/ip4/10\.\S+/p2p/\S+)$", 60).group(1) == bootstrap  # same identity and port
    peers[4] = DhtPeer(hosts, 4, 5, tmp_path, initial_peers=[bootstrap])
    took = wait_until(lambda: all(p.seen() == {1, 2, 3, 4} for p in peers.values()), 60, lambda: describe(peers))
    print(f"the newcomer and the others read each other {took:.0f} s after it started")
    again.proc.send_signal(signal.SIGINT)
    assert again.proc.wait(30) == 0, again.text()
    assert "Traceback" not in again.text(), again.text()


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_a_newcomer_whose_initial_peers_are_unreachable_says_so_and_retries(make_hosts, tmp_path):
    hosts = make_hosts(3)
    dht_args = [sys.executable, "-m", "swarm_opt", "dht", "--host-maddrs", f"/ip4/{hosts.address(0)}/tcp/{PORT}"]
    node = Proc(hosts, 0, "bootstrap", dht_args, tmp_path)
    bootstrap = node.wait_for(r"^(/ip4/10\.\S+/p2p/\S+)$", 60).group(1)
    hosts.cut(0)

    # it gives up after --join-timeout, in one line naming the address and why
    started = time.monotonic()
    newcomer = subprocess.run([*hosts.prefix(1), sys.executable, "-m", "swarm_opt", "dht", "--host-maddrs",
                               f"/ip4/{hosts.address(1)}/tcp/{PORT}", "--initial-peers", bootstrap,
                               "--join-timeout", "20"], capture_output=True, text=True, timeout=90, cwd=tmp_path,
                              env=cli_env(), start_new_session=True)
    took = time.monotonic() - started
    assert newcomer.returncode == 2, newcomer.stderr
    assert took < 60, f"gave up after {took:.0f} s:\n{newcomer.stderr}"  # a try and a probe take ~3 s each
    retries = re.findall(r"none of the initial peers answered: (\S+) \(([^)]+)\); trying again in", newcomer.stderr)
    assert retries and retries[0][0] == bootstrap, newcomer.stderr
    error = [line for line in newcomer.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and bootstrap in error[0] and "tried for 20 s" in error[0], newcomer.stderr
    assert "Traceback" not in newcomer.stderr, newcomer.stderr

    # it joins once the link comes back within --join-timeout
    waiting = Proc(hosts, 2, "newcomer", [sys.executable, "-m", "swarm_opt", "dht", "--host-maddrs",
                                          f"/ip4/{hosts.address(2)}/tcp/{PORT}", "--initial-peers", bootstrap,
                                          "--join-timeout", "120"], tmp_path)
    waiting.wait_for(r"none of the initial peers answered", 60)
    hosts.heal(0)
    waiting.wait_for(r"swarm-opt dht: running", 60)
    assert waiting.text().count("none of the initial peers answered") <= 6, waiting.text()  # backoff, not a flood


# --- a training swarm: what issue 48 saw -----------------------------------------------------------------------------


def epochs_after(text: str, offset: int) -> Dict[int, str]:
    """epoch -> its test metrics, for the epoch lines a trainer printed after ``offset`` characters of its output."""
    return {int(e): metrics for e, metrics in
            re.findall(r"^epoch (\d+): (test accuracy [\d.]+%, test loss [\d.]+)", text[offset:], re.MULTILINE)}


def one_model(trainers: Dict[int, Proc], offsets: Dict[int, int]) -> Optional[int]:
    """An epoch that every trainer printed since ``offsets`` with the same test metrics (so the same parameters: the
    test set is the same for all), or None."""
    seen = {i: epochs_after(t.text(), offsets[i]) for i, t in trainers.items()}
    common = set.intersection(*(set(s) for s in seen.values()))
    return next((e for e in sorted(common) if len({s[e] for s in seen.values()}) == 1), None)


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(600)
@pytest.mark.parametrize("size,cut,seconds", [(5, {2}, 30), (6, {2, 5}, 30), (5, {2}, 180), (6, {2, 5}, 180)],
                         ids=["1of5-30s", "2of6-30s", "1of5-3min", "2of6-3min"])
def test_a_training_swarm_split_by_a_partition_holds_one_model_within_60_s_of_healing(make_hosts, tmp_path, size,
                                                                                      cut, seconds):
    """Gradient-averaging trainers (``swarm-opt train``), one per host, and a bootstrap node on a host of its own;
    ``cut`` trainers lose their links for ``seconds``. Within 60 s of the links coming back, every trainer prints an
    epoch with the same test metrics as every other (one model), and the cut ones said they lost sight of the swarm
    and found it again."""
    hosts = make_hosts(size + 1)  # host 0: the bootstrap node; trainer i on host i
    node = Proc(hosts, 0, "dht", [sys.executable, "-m", "swarm_opt", "dht", "--host-maddrs",
                                  f"/ip4/{hosts.address(0)}/tcp/{PORT}"], tmp_path)
    bootstrap = node.wait_for(r"^(/ip4/10\.\S+/p2p/\S+)$", 60).group(1)
    trainers = {i: Proc(hosts, i, f"trainer{i}", [
        sys.executable, "-m", "swarm_opt", "train", "--run-id", "partition", "--initial-peers", bootstrap,
        "--host-maddrs", f"/ip4/{hosts.address(i)}/tcp/{PORT}", "--task", "digits", "--target-batch-size", "512",
        "--batch-size", "32", "--min-peers", str(size), "--matchmaking-time", "2", "--averaging-timeout", "20",
        "--data-seed", str(i)], tmp_path) for i in range(1, size + 1)}
    for trainer in trainers.values():  # together before the cut
        trainer.wait_for(rf"^epoch \d+: .*averaged with {size} of {size} peer", 240)

    hosts.cut(cut)
    time.sleep(seconds)
    offsets = {i: len(t.text()) for i, t in trainers.items()}
    hosts.heal()
    took = wait_until(lambda: one_model(trainers, offsets) is not None, 60,
                      lambda: "; ".join(f"trainer {i}: {sorted(epochs_after(t.text(), offsets[i]).items())[-3:]}"
                                        for i, t in trainers.items()))
    print(f"one model at epoch {one_model(trainers, offsets)}, {took:.0f} s after the links came back")
    for i in cut:
        assert LOST in trainers[i].text(), trainers[i].text()[-3000:]
        trainers[i].wait_for(FOUND, 15)
