"""Many newcomers joining a running swarm at once: do their state downloads spread over the donors, and does a dead
bootstrap peer hold anyone up?

In one Python process, every peer with its own hivemind DHT process, p2pd daemon and averager process (as in
``tests/swarm/test_newcomers.py``): a founder trains alone to epoch 1 and ``--donors - 1`` peers download its state
(from then on they serve it too). Then ``--newcomers`` peers start their DHTs, each bootstrapping from the addresses
of ``--bootstrap`` donors, the first of which (the founder) is SIGKILLed, with its DHT, p2pd and averager, once half
of the newcomers have started: the rest bootstrap from the others. Finally the newcomers ask for the swarm's state,
all within ``--within`` seconds (evenly spread), each as soon as its turn comes; a newcomer that has the state serves
it too. ``--cap none`` lifts the donors' limit of concurrent uploads (``MAX_UPLOADS_AT_ONCE``), as hivemind has none:
the same run without the spreading.

Reported: how long the newcomers' DHTs took to start (before and after the bootstrap peer died), how long each took
to get the state from its request (median, 90th percentile, max), whether every one got the founder's parameters,
and per donor the downloads it served, the most at once and those it sent on for being busy.

Differs from a real deployment: all peers share this machine's 2 cores and loopback, the newcomers' optimizers are
built before they ask (a real newcomer asks right after its own start-up), and the model is ``--params`` float32
zeros-and-ones (its size sets how long an upload holds a donor's slot).

    python benchmarks/newcomers.py                                  # 6 donors, 48 newcomers within 30 s, ~4 min
    python benchmarks/newcomers.py --newcomers 48 --cap none        # the same without the upload limit
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from typing import Dict, List, Optional

import hivemind
import torch
from _common import code_version, command_line, machine, quantiles, table, write_json

import swarm_opt
from swarm_opt._hivemind import engine as engine_module

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _optimizer(dht: hivemind.DHT, model: torch.nn.Module) -> swarm_opt.Optimizer:
    return swarm_opt.Optimizer(dht=dht, run_id="newcomers_bench", target_batch_size=16, batch_size_per_step=8,
                               params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               timeouts=swarm_opt.Timeouts(matchmaking_time=0.5, averaging_timeout=10.0,
                                                           state_download_timeout=240.0))


def _model(params: int) -> torch.nn.Module:
    return torch.nn.Linear(params // 16, 16, bias=False)


def _children(pid: int) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _sigkill_peer(dht: hivemind.DHT, opt: swarm_opt.Optimizer) -> None:
    """SIGKILL a peer's DHT process (with its p2pd) and averager process: as a crash, nothing said to anyone."""
    pids = [dht.pid, opt._averager._engine.pid]
    for pid in list(pids):
        pids += _children(pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(args: argparse.Namespace) -> dict:
    if args.cap == "none":
        engine_module.MAX_UPLOADS_AT_ONCE = 10 ** 6  # read in the averager processes, forked below
    dhts: List[hivemind.DHT] = []
    opts: List[swarm_opt.Optimizer] = []
    killed: Optional[int] = None
    try:
        founder_model = _model(args.params)
        dhts.append(hivemind.DHT(host_maddrs=LOOPBACK, start=True))
        opts.append(_optimizer(dhts[0], founder_model))
        while opts[0].local_epoch < 1:  # alone: its rounds commit by themselves
            opts[0].zero_grad()
            founder_model(torch.ones(8, founder_model.in_features)).sum().backward()
            opts[0].step()
        for _ in range(args.donors - 1):
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=LOOPBACK, start=True))
            opts.append(_optimizer(dhts[-1], _model(args.params)))
            opts[-1].load_state_from_peers(timeout=120)
        bootstrap = [addr for dht in dhts[:args.bootstrap] for addr in dht.get_visible_maddrs()]

        dht_seconds: List[float] = []
        after_kill: List[bool] = []
        for i in range(args.newcomers):
            if i == args.newcomers // 2:
                _sigkill_peer(dhts[0], opts[0])
                killed = 0
            started = time.monotonic()
            dhts.append(hivemind.DHT(initial_peers=bootstrap, host_maddrs=LOOPBACK, start=True))
            dht_seconds.append(time.monotonic() - started)
            after_kill.append(killed is not None)
        newcomer_models = [_model(args.params) for _ in range(args.newcomers)]
        for dht, model in zip(dhts[args.donors:], newcomer_models):
            opts.append(_optimizer(dht, model))

        waits: Dict[int, float] = {}
        errors: Dict[int, str] = {}
        begin = time.monotonic() + 1.0

        def join(i: int) -> None:
            time.sleep(max(0.0, begin + i * args.within / args.newcomers - time.monotonic()))
            asked = time.monotonic()
            try:
                opts[args.donors + i].load_state_from_peers()
                waits[i] = time.monotonic() - asked
            except Exception as e:  # reported in the table
                errors[i] = repr(e)

        threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(args.newcomers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(args.within + 300)
        same = sum(torch.equal(model.weight, founder_model.weight) and opts[args.donors + i].local_epoch == 1
                   for i, model in enumerate(newcomer_models))
        uploads = {rank: opt._averager.uploads for rank, opt in enumerate(opts) if rank != killed}
    finally:
        for rank, opt in enumerate(opts):
            if rank != killed:
                opt.shutdown()
        for rank, dht in enumerate(dhts):
            if rank != killed:
                dht.shutdown()
    served = {rank: u.served for rank, u in uploads.items() if u.served}
    return {
        "cap": args.cap, "donors": args.donors, "newcomers": args.newcomers, "within": args.within,
        "dht_start_seconds": {"before_kill": _stats([s for s, k in zip(dht_seconds, after_kill) if not k]),
                              "after_kill": _stats([s for s, k in zip(dht_seconds, after_kill) if k])},
        "state_seconds": _stats(list(waits.values())), "got_state": len(waits), "same_parameters": same,
        "errors": errors,
        "served_by": served, "most_at_once": max(u.most for u in uploads.values()),
        "declined": sum(u.declined for u in uploads.values()),
        "donors_that_served": len(served), "newcomers_that_served": sum(1 for rank in served if rank >= args.donors),
        "busiest_served": max(served.values(), default=0),
    }


def _stats(values: List[float]) -> Dict[str, float]:
    return quantiles(values) if values else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--donors", type=int, default=6)
    parser.add_argument("--newcomers", type=int, default=48)
    parser.add_argument("--within", type=float, default=30.0, help="seconds over which the newcomers ask for state")
    parser.add_argument("--bootstrap", type=int, default=3, help="donors whose addresses each newcomer starts from")
    parser.add_argument("--params", type=int, default=2 ** 20)
    parser.add_argument("--cap", choices=["on", "none"], default="on",
                        help="keep the donors' limit of concurrent uploads, or lift it (hivemind's behaviour)")
    args = parser.parse_args()
    if not 1 <= args.bootstrap <= args.donors:
        parser.error("--bootstrap must be between 1 and --donors")
    result = run(args)
    dht = result["dht_start_seconds"]
    state = result["state_seconds"]
    print(table(
        ["upload cap", "donors + newcomers", "DHT start s, median (max): before / after the bootstrap peer died",
         "state s from asking: median / p90 / max", "got the state (same parameters)",
         "served by (donors, of them newcomers)", "busiest served", "most at once", "sent on"],
        [[str(engine_module.MAX_UPLOADS_AT_ONCE) if args.cap == "on" else "none",
          f"{args.donors} + {args.newcomers} within {args.within:.0f} s",
          f"{dht['before_kill']['median']:.2f} ({dht['before_kill']['max']:.2f}) / "
          f"{dht['after_kill']['median']:.2f} ({dht['after_kill']['max']:.2f})",
          f"{state['median']:.2f} / {state['p90']:.2f} / {state['max']:.2f}" if state else "-",
          f"{result['got_state']} ({result['same_parameters']})",
          f"{result['donors_that_served']} ({result['newcomers_that_served']})", result["busiest_served"],
          result["most_at_once"], result["declined"]]]))
    if result["errors"]:
        print("errors:", result["errors"])
    path = write_json("newcomers", {"command": command_line(), "code": code_version(), "machine": machine(),
                                    "args": vars(args), "result": result})
    print(f"results: {path}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
