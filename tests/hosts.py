"""Test hosts on one machine: network namespaces on a bridge, with bandwidth-limited links (``tc tbf``).

Used by the multi-host tests (``tests/e2e/test_netns.py``, ``tests/e2e/test_partition.py``) and the utilization
benchmark. Needs root and iproute2; traffic stays between these namespaces.

A partition (``Hosts.cut``) moves hosts' switch ports onto a bridge of their own, as a cable cut beyond a site's
switch does: each host keeps its link up and its address, its packets to the other side are dropped silently (no
"network unreachable" that would tell a program at once), and hosts cut together still reach each other.
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
from typing import Dict, Iterable, Union

SUBNET = "10.213.{}.{}"
OWNERS = "/run/swarm_opt-test-hosts"  # a file per switch namespace there names the process that made it (not in
# /etc/netns/<name>, whose files ``ip netns exec`` mounts over /etc)


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """``n`` hosts (namespaces) plugged into one bridge that lives in a switch namespace of its own; each host's
    outgoing link is limited to ``rate`` (``tc tbf``). ``close()`` kills what runs in them and removes them."""

    def __init__(self, n: int, rate: str = "50mbit", burst: str = "32kbit") -> None:
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        self._side: Dict[int, str] = {}  # host -> the island bridge it was cut onto (absent: on br0 with the rest)
        self._islands = 0
        self.switch, self.names = f"so{tag}sw", [f"so{tag}h{i}" for i in range(n)]
        self.third_octet = int(tag[:2], 16)
        remove_orphans()
        os.makedirs(OWNERS, exist_ok=True)
        with open(f"{OWNERS}/{self.switch}", "w") as f:  # before the namespace: see ``remove_orphans``
            f.write(str(os.getpid()))
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
            self._in(name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
                     "latency", "400ms")
        # names for the hosts' addresses (also as IPv4-mapped IPv6, as a dual-stack listener sees them), as a LAN's
        # DNS gives them: no DNS server is reachable from a namespace, and torch's c10d warns at each connection
        # whose address it cannot name (``ip netns exec`` mounts this file over /etc/hosts)
        names = "".join(f"{self.address(i)} {name}\n::ffff:{self.address(i)} {name}\n"
                        for i, name in enumerate(self.names))
        for name in self.names:
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n::1 localhost\n" + names)

    def address(self, i: int) -> str:
        return SUBNET.format(self.third_octet, i + 1)

    def prefix(self, i: int) -> tuple:
        """The command prefix that runs a program on host ``i``."""
        return ("ip", "netns", "exec", self.names[i])

    def measure_link(self, seconds: float = 3.0, port: int = 5999) -> float:
        """Mbit/s of one TCP stream from host 1 to host 0 (the rate the tbf shaping really gives)."""
        code = ("import socket,sys,time\ns=socket.socket();s.bind((sys.argv[1],int(sys.argv[2])));s.listen(1)\n"
                "c,_=s.accept();n=0;t=time.time()\n"
                "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
                "print(n*8/(time.time()-t)/1e6)")
        server = subprocess.Popen([*self.prefix(0), sys.executable, "-c", code, self.address(0), str(port)],
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        sender = ("import socket,sys,time\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])));b=b'x'*(1<<16);"
                  f"e=time.time()+{seconds}\nwhile time.time()<e: c.sendall(b)\nc.close()")
        subprocess.run([*self.prefix(1), sys.executable, "-c", sender, self.address(0), str(port)], check=True,
                       timeout=60)
        out, _ = server.communicate(timeout=30)
        return float(out.strip())

    def cut(self, hosts: Union[int, Iterable[int]]) -> None:
        """Cut ``hosts`` (one index, or several that stay together on their side) off from every other host: their
        switch ports move onto a bridge of their own. A host already cut elsewhere moves to this new side."""
        group = sorted({hosts} if isinstance(hosts, int) else set(hosts))
        if not group or not all(0 <= i < len(self.names) for i in group):
            raise ValueError(f"host indices in 0..{len(self.names) - 1} expected, got {group}")
        self._islands += 1
        island = f"br{self._islands}"
        self._in(self.switch, "ip", "link", "add", island, "type", "bridge")
        self._in(self.switch, "ip", "link", "set", island, "up")
        for i in group:
            self._in(self.switch, "ip", "link", "set", self._port(i), "master", island)
            self._side[i] = island
        self._drop_empty_islands()

    def heal(self, hosts: Union[int, Iterable[int], None] = None) -> None:
        """Plug ``hosts`` (default: every cut host) back into the common bridge; healing a host that is not cut
        does nothing."""
        group = set(self._side) if hosts is None else ({hosts} if isinstance(hosts, int) else set(hosts))
        for i in sorted(group & set(self._side)):
            self._in(self.switch, "ip", "link", "set", self._port(i), "master", "br0")
            del self._side[i]
        self._drop_empty_islands()

    def is_cut(self, i: int) -> bool:
        return i in self._side

    def _port(self, i: int) -> str:
        return f"v{self.tag}{i}"

    def _drop_empty_islands(self) -> None:
        for k in range(1, self._islands + 1):
            island = f"br{k}"
            if island not in self._side.values():
                _sh("ip", "netns", "exec", self.switch, "ip", "link", "del", island, check=False)

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
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        try:
            os.unlink(f"{OWNERS}/{self.switch}")
        except FileNotFoundError:
            pass


def remove_orphans() -> None:
    """Remove the test hosts of processes that died without closing them (a test run killed): each switch namespace
    names its creator's pid in ``OWNERS/<switch>``, written before the namespace exists, so that a host set
    another process is still making is never taken for an orphan."""
    listed = _sh("ip", "netns", "list", check=False).stdout
    for tag in set(re.findall(r"^so(\w{6})sw\b", listed, re.MULTILINE)):
        try:
            with open(f"{OWNERS}/so{tag}sw") as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue  # made before owners were named, or by hand: not ours to judge
        try:
            os.kill(owner, 0)
            continue  # its creator is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        orphan = Hosts.__new__(Hosts)
        orphan.switch = f"so{tag}sw"
        orphan.names = sorted(set(re.findall(rf"^(so{tag}h\d+)\b", listed, re.MULTILINE)))
        orphan.close()


def burst_for(rate: str) -> str:
    """A tbf bucket for ``rate`` ("100mbit", "1gbit"): 256 kbit, or 2.5 ms of the rate if more (a bucket too small
    for the kernel's timer tick caps a fast link below its rate)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"a link rate like '100mbit' or '1gbit' is expected, got {rate!r}")
    bits = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return f"{max(256, int(bits / 400 / 1e3))}kbit"


def namespaces_unavailable() -> str:
    """Why test hosts cannot be made here ('' if they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    probe = f"so{uuid.uuid4().hex[:6]}probe"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    return "" if made.returncode == 0 else f"cannot create network namespaces: {made.stderr.strip()}"
