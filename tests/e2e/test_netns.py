"""A swarm across separate hosts: network namespaces on a bridge, links limited to 50 Mbit/s with ``tc tbf``.

A bootstrap node and three peers, each on its own host (one peer in client mode: it accepts no connections), train
several global epochs together with the ``swarm-opt`` CLI; a peer killed on one host does not stall the others.
Traffic goes only between these namespaces. Skipped, with the reason, where namespaces cannot be created (not root,
no iproute2); in CI here it runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.e2e.conftest import cli_env, dump_stacks
from tests.hosts import OWNERS, Hosts, namespaces_unavailable, remove_orphans


@pytest.fixture
def hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    made = Hosts(4)
    try:
        yield made
    finally:
        made.close()


class Host:
    def __init__(self, hosts: Hosts, index: int, name: str, args: List[str], workdir: Path, env: Dict[str, str]):
        self.out = workdir / f"{name}.out"
        self.err = workdir / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(["ip", "netns", "exec", hosts.names[index], sys.executable, "-m",
                                          "swarm_opt", *args], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         cwd=workdir, env=env, start_new_session=True)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def epoch(self) -> int:
        """The last epoch this peer printed (0 before its first)."""
        return max([int(e) for e in re.findall(r"^epoch (\d+): ", self.out.read_text(), re.MULTILINE)] + [0])

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.out.read_text(), re.MULTILINE)
            if match:
                return match
            assert self.proc.poll() is None, f"exited early:\n{self.text()}"
            if time.monotonic() >= deadline:
                dump_stacks(self.proc)  # ``ip netns exec`` runs Python in its own place: its pid is the peer's
                pytest.fail(f"timed out waiting for {pattern!r}:\n{self.text()}")
            time.sleep(0.2)


@pytest.mark.swarm
@pytest.mark.timeout(360)
def test_a_swarm_across_hosts_survives_a_killed_peer_which_rejoins_with_its_identity(hosts, tmp_path):
    env = cli_env()
    node = Host(hosts, 0, "dht", ["dht", "--host-maddrs", f"/ip4/{hosts.address(0)}/tcp/31337"], tmp_path, env)
    bootstrap = node.wait_for(r"^/ip4/\S+/p2p/\S+$", 60).group(0)
    assert hosts.address(0) in bootstrap
    epochs = 100_000  # until Ctrl-C: rounds take a fraction of a second, a restart several seconds

    def start(i: int, name: str, min_peers: int = 3) -> Host:
        args = ["train", "--run-id", "netns", "--initial-peers", bootstrap, "--task", "digits",
                "--target-batch-size", "512", "--batch-size", "32", "--epochs", str(epochs),
                "--min-peers", str(min_peers), "--matchmaking-time", "2", "--averaging-timeout", "20",
                "--identity-path", f"peer{i}.id", "--checkpoint-dir", f"ckpt{i}", "--checkpoint-every", "1"]
        if i == 3:
            args.append("--client-mode")  # behind NAT: dials out only
        else:
            args += ["--host-maddrs", f"/ip4/{hosts.address(i)}/tcp/0"]
        return Host(hosts, i, name, args, tmp_path, env)

    peers = {i: start(i, f"peer{i}") for i in (1, 2, 3)}
    for i in (1, 3):
        # the client averaged across hosts (in some epoch: a peer that missed one round catches up by downloading)
        peers[i].wait_for(r"^epoch \d+: .*averaged with 3 of 3 peer\(s\)", 180)
    identity = re.search(r"as peer (\S+)", peers[2].err.read_text()).group(1)
    deadline = time.monotonic() + 60  # the victim has a checkpoint to resume from
    while not list((tmp_path / "ckpt2").glob("epoch-*.pt")):
        assert time.monotonic() < deadline and peers[2].proc.poll() is None, peers[2].text()
        time.sleep(0.2)
    os.killpg(peers[2].proc.pid, signal.SIGKILL)  # a host's peer dies mid-run
    killed_at = peers[1].epoch()
    peers[1].wait_for(rf"^epoch {killed_at + 2}: ", 60)  # the others went on without it

    again = start(2, "peer2_again", min_peers=1)  # restarted on its host, same identity and checkpoint directory
    again.wait_for(r"^epoch \d+: .*averaged with 3 of 3 peer\(s\)", 120)  # back in the swarm
    for host in (peers[1], peers[3], again):
        host.proc.send_signal(signal.SIGINT)  # Ctrl-C: each leaves with a checkpoint
    for host in (peers[1], peers[3], again):
        assert host.proc.wait(60) == 0, host.text()
        text = host.text()
        assert "stopped by SIGINT" in text and "Traceback" not in text, text
    assert f"as peer {identity}" in again.text()
    assert "resumed from" in again.text()
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(30) == 0, node.text()


@pytest.mark.timeout(60)
def test_hosts_left_by_a_killed_test_run_are_removed_by_the_next_one(tmp_path):
    """A test run killed mid-test (SIGKILL: no ``finally``) leaves its namespaces behind; the next ``Hosts`` removes
    them (their maker is dead) and leaves those of a live maker alone."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    repo = Path(__file__).resolve().parents[2]
    maker = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom tests.hosts import Hosts\n"
                              "h = Hosts(2)\nprint(h.tag, flush=True)\ntime.sleep(600)"],
                             cwd=repo, stdout=subprocess.PIPE, text=True)
    try:
        tag = maker.stdout.readline().strip()
        assert tag, "the maker made no hosts"
        mine = Hosts(1)  # the maker is alive: its hosts stay
        try:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"so{tag}sw" in listed and f"so{tag}h1" in listed
            maker.kill()
            maker.wait(10)
            second = Hosts(1)  # the maker died without closing them: they go
            second.close()
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"so{tag}" not in listed and not os.path.exists(f"{OWNERS}/so{tag}sw")
            assert mine.switch in listed  # a live maker's hosts are left alone
        finally:
            mine.close()
    finally:
        maker.kill()
        maker.wait(10)
        remove_orphans()  # the maker's, where the test failed before removing them
