"""A swarm across separate hosts: network namespaces on a bridge, links limited to 50 Mbit/s with ``tc tbf``.

A bootstrap node and three peers, each on its own host (one peer in client mode: it accepts no connections), train
several global epochs together with the ``swarm-opt`` CLI; a peer killed on one host does not stall the others.
Traffic goes only between these namespaces. Skipped, with the reason, where namespaces cannot be created (not root,
no iproute2); in CI here it runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

import pytest

from tests.e2e.conftest import cli_env

SUBNET = "10.213.{}.{}"


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """``n`` hosts (namespaces) plugged into one bridge that lives in a switch namespace of its own."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch, self.names = f"so{tag}sw", [f"so{tag}h{i}" for i in range(n)]
        self.third_octet = int(tag[:2], 16)
        _sh("ip", "netns", "add", self.switch)
        self._in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._in(self.switch, "ip", "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _sh("ip", "netns", "add", name)
            _sh("ip", "link", "add", f"v{tag}{i}", "netns", self.switch, "type", "veth", "peer", "name", "eth0",
                "netns", name)
            self._in(self.switch, "ip", "link", "set", f"v{tag}{i}", "master", "br0", "up")
            self._in(name, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            self._in(name, "ip", "link", "set", "eth0", "up")
            self._in(name, "ip", "link", "set", "lo", "up")
            self._in(name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit", "burst", "32kbit",
                     "latency", "400ms")

    def address(self, i: int) -> str:
        return SUBNET.format(self.third_octet, i + 1)

    @staticmethod
    def _in(namespace: str, *args: str) -> None:
        _sh("ip", "netns", "exec", namespace, *args)

    def close(self) -> None:
        for name in self.names + [self.switch]:
            pids = _sh("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _sh("ip", "netns", "del", name, check=False)


def _namespaces_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    probe = f"so{uuid.uuid4().hex[:6]}probe"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    return "" if made.returncode == 0 else f"cannot create network namespaces: {made.stderr.strip()}"


@pytest.fixture
def hosts():
    reason = _namespaces_unavailable()
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
            assert time.monotonic() < deadline, f"timed out waiting for {pattern!r}:\n{self.text()}"
            time.sleep(0.2)


@pytest.mark.swarm
@pytest.mark.timeout(360)
def test_a_swarm_across_hosts_survives_a_killed_peer_which_rejoins_with_its_identity(hosts, tmp_path):
    env = cli_env()
    node = Host(hosts, 0, "dht", ["dht", "--host-maddrs", f"/ip4/{hosts.address(0)}/tcp/31337"], tmp_path, env)
    bootstrap = node.wait_for(r"^/ip4/\S+/p2p/\S+$", 60).group(0)
    assert hosts.address(0) in bootstrap
    epochs = 16

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
    assert killed_at < epochs - 4, "the swarm finished too early for the kill to happen mid-run"
    peers[1].wait_for(rf"^epoch {killed_at + 2}: ", 60)  # the others went on without it

    again = start(2, "peer2_again", min_peers=1)  # restarted on its host, same identity and checkpoint directory
    again.wait_for(r"^epoch \d+: .*averaged with 3 of 3 peer\(s\)", 120)  # back in the swarm
    for host in (peers[1], peers[3], again):
        assert host.proc.wait(180) == 0, host.text()
        text = host.text()
        assert re.search(rf"^epoch {epochs}: test accuracy", text, re.MULTILINE), text
        assert "Traceback" not in text, text
    assert f"as peer {identity}" in again.text()
    assert "resumed from" in again.text()
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(30) == 0, node.text()
