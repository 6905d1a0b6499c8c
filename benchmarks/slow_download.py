"""A newcomer downloading a large state over a slow link: how long it takes beside what the link allows, and that it
is not given up (the download's deadline moves on while the state arrives: ``swarm_opt.deadlines.DownloadDeadline``).

Two test hosts (network namespaces of this machine, ``tests/hosts.py``) whose links ``tc tbf`` limits to ``--rate``;
the link is probed first (one TCP stream between the hosts). For each ``--widths`` a donor on host 0 trains a
``width x width`` linear layer with Adam alone to epoch 3 (state: parameters and two moments), then a newcomer on
host 1 joins its run: its optimizer downloads the state while it is built, with a patience of 15 s
(``state_sync.NEWCOMER_PATIENCE``) that the larger states outlast many times. Peers are
``tests/e2e/slow_link_peer.py``, the multi-host test's.

Reported per state: bytes received, the newcomer's build time (start-up and the download), the time the measured
link needs for those bytes, their ratio, and whether the newcomer holds the donor's parameters at the donor's epoch.

    python benchmarks/slow_download.py                                  # 50 Mbit/s; 6, 50 and 400 MB; ~4 min
    python benchmarks/slow_download.py --rate 100mbit --widths 5800
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from _common import kill_all, link_hosts, require_test_hosts, table, write_json

from swarm_opt import state_sync, testing


def run_one(hosts: Any, width: int, workdir: Path) -> Dict[str, Any]:
    from tests.e2e.slow_link_peer import record, start

    env = testing.peer_env()
    donor_log, newcomer_log = workdir / f"donor-{width}.log", workdir / f"newcomer-{width}.log"
    procs = [start(hosts.prefix(0), donor_log, "donor", hosts.address(0), "--width", str(width), env=env)]
    try:
        maddrs = record(procs[0], donor_log, "maddrs", 60)["maddrs"]
        ready = record(procs[0], donor_log, "ready", 300)
        procs.append(start(hosts.prefix(1), newcomer_log, "newcomer", hosts.address(1), *maddrs, "--width",
                           str(width), env=env))
        joined = record(procs[1], newcomer_log, "built_in", 1800)
    finally:
        kill_all(procs)
    return dict(width=width, params=width * width + width, received=joined["received"],
                built_in=joined["built_in"], epoch=joined["epoch"], donor_epoch=ready["epoch"],
                same_state=joined["epoch"] == ready["epoch"] and joined["digest"] == ready["digest"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="50mbit", help="each host's link (tc tbf), e.g. 50mbit, 100mbit")
    parser.add_argument("--widths", type=int, nargs="+", default=[680, 2048, 5800],
                        help="the linear layer's widths: 680 -> 5.6 MB of state, 2048 -> 50 MB, 5800 -> 404 MB")
    parser.add_argument("--out", default="slow_download.json", help="the JSON's name under benchmarks/results/")
    args = parser.parse_args()
    require_test_hosts()
    hosts = link_hosts(2, args.rate)
    runs: List[Dict[str, Any]] = []
    started = time.time()
    try:
        link = hosts.measure_link()
        print(f"2 hosts, links limited to {args.rate}: one TCP stream measured at {link:.1f} Mbit/s", flush=True)
        with tempfile.TemporaryDirectory() as workdir:
            for width in args.widths:
                run = run_one(hosts, width, Path(workdir))
                run["link_seconds"] = run["received"] * 8 / (link * 1e6)
                runs.append(run)
                print(f"  {run['received'] / 1e6:.1f} MB: built in {run['built_in']:.1f} s", flush=True)
    finally:
        hosts.close()
    rows = [[f"{r['params'] / 1e6:.2f}M", f"{r['received'] / 1e6:.1f}", f"{r['built_in']:.1f}",
             f"{r['link_seconds']:.1f}", f"{r['built_in'] / r['link_seconds']:.2f}x",
             f"{r['built_in'] / state_sync.NEWCOMER_PATIENCE:.1f}x", "yes" if r["same_state"] else "NO"]
            for r in runs]
    print(f"\nA newcomer's download over {args.rate} links ({link:.0f} Mbit/s measured), Adam state (3x the "
          f"parameters)")
    print(table(["parameters", "MB received", "newcomer built in (s)", "the link needs (s)", "built / link",
                 "built / patience (15 s)", "the donor's state"], rows))
    path = write_json(args.out, dict(rate=args.rate, link_mbit_s=link, runs=runs, seconds=time.time() - started))
    print(f"wrote {path}\nreproduce: python benchmarks/slow_download.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
