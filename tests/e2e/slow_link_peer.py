"""A peer for ``tests/e2e/test_slow_link.py`` and ``benchmarks/slow_download.py``, run on a test host: ``donor
ADDRESS`` trains a few epochs alone, says ``ready`` with its epoch and parameters' digest and then only serves its
state; ``newcomer ADDRESS BOOTSTRAP...`` joins its run (the state download happens while the optimizer is built) and
says how long that took and what it loaded. The model is one ``--width`` x ``--width`` linear layer trained with
Adam (the state: 3x its parameters). Each line it prints is one JSON object."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import hivemind
import torch

import swarm_opt
from swarm_opt.digest import parameter_digest

#: 385k parameters: with Adam's two moments a state of ~4.6 MB, ~19 s over the test's 2-Mbit/s link
WIDTH = 620


def start(prefix: tuple, log: Path, *args: str, env: dict) -> subprocess.Popen:
    """Run this peer (``args``: its command line) under ``prefix`` (a test host's, ``Hosts.prefix``), output to
    ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([*prefix, sys.executable, __file__, *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def record(proc: subprocess.Popen, log: Path, key: str, timeout: float) -> dict:
    """The first JSON line of ``log`` that has ``key``, waited for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for line in log.read_text().splitlines():
            if line.startswith("{") and key in (found := json.loads(line)):
                return found
        if proc.poll() is not None:
            time.sleep(0.2)  # its last lines may still be on their way to the file
            if key not in log.read_text():
                raise RuntimeError(f"exited ({proc.returncode}) before saying {key!r}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {key!r} within {timeout} s:\n{log.read_text()}")
        time.sleep(0.2)


def main(role: str, address: str, initial_peers: list, width: int) -> None:
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{address}/tcp/0"], initial_peers=initial_peers, start=True)
    print(json.dumps({"maddrs": [str(m) for m in dht.get_visible_maddrs()]}), flush=True)
    torch.manual_seed(0 if role == "donor" else 1)  # the newcomer starts from other parameters than the donor's
    model = torch.nn.Linear(width, width)
    started = time.monotonic()
    opt = swarm_opt.Optimizer(dht=dht, run_id="slow_link", target_batch_size=8, params=model.parameters(),
                              optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    if role == "newcomer":
        print(json.dumps({"built_in": time.monotonic() - started, "epoch": opt.local_epoch,
                          "digest": parameter_digest(list(model.parameters())),
                          "received": opt._averager._engine.downloaded,
                          # what its tracker saw by then (a newcomer that read no record took itself for a founder)
                          "swarm_epoch": opt.progress.epoch, "peers_seen": opt.progress.num_peers}), flush=True)
        opt.shutdown()
        return
    x = torch.randn(8, width)
    while opt.local_epoch < 3:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step(batch_size=8)
    print(json.dumps({"ready": True, "epoch": opt.local_epoch, "digest": parameter_digest(list(model.parameters()))}),
          flush=True)
    time.sleep(600)  # serving its state until the test stops it


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["donor", "newcomer"])
    parser.add_argument("address", help="this host's address")
    parser.add_argument("initial_peers", nargs="*", help="the donor's multiaddresses (a newcomer's)")
    parser.add_argument("--width", type=int, default=WIDTH)
    args = parser.parse_args()
    main(args.role, args.address, args.initial_peers, args.width)
