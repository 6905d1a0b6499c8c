"""Many real peers on loopback: Moshpit groups against one group of the whole swarm, with peers killed and replaced.

Each peer is a full swarm_opt peer as in the swarm tests (``tests/swarm/peer.py``: its own OS process, hivemind DHT
process, averager process and p2pd daemon; the test harness ``tests/swarm/conftest.Swarm`` launches and reaps them).
The task is tiny (5 parameters, ``LocalUpdates``, or ``GradientAveraging`` with ``--strategy grad``: its rounds in
groups carry the parameters too) and does not train (lr 0): peers start apart (peer ``i`` holds
``i`` everywhere, newcomers download a live peer's state) and only averaging moves them, so that what is measured
is the rounds and how well they mix. ``--kill`` of the peers are SIGKILLed (whole process group) once the swarm
passed epoch ``--kill-at``, and as many newcomers join (each downloads the running swarm's state; one that starts
after the others finished founds a swarm of its own, which the table's "joined" column shows). Compared at the
same N: ``groups=None`` (one all-reduce over the whole swarm per round) against ``Groups(size=--size)``.

Reported: round success rate (per peer, the epochs it committed over the epochs it committed or failed at least
once: its log says "Round for epoch N did not reach a majority"), the group sizes of committed rounds, the median
seconds of a committed round (from the start of its all-reduce, matchmaking included, to its commit), epochs per
minute of the survivors, and the spread of the survivors' final values (max distance to their mean; the peers
started 0 to N-1 apart), beside the spread the in-process simulation ends with for the same swarm (``simulated``:
``swarm_opt.simulation.moshpit_round``, the grid code the peers run, the same kills and newcomers, each peer
missing each round with the probability the real run measured, mean and max over 20 seeds).

Differs from a real deployment: every peer runs on the same 2 cores, so a round's time is mostly CPU contention.

    python benchmarks/many_peers.py                  # 24 peers, groups of 8, 25 % killed and replaced
    python benchmarks/many_peers.py --peers 12 --size 4 --averaging groups
    python benchmarks/many_peers.py --strategy grad  # gradient averaging in groups
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from _common import REPO, code_version, command_line, machine, table, write_json
from scale_sim import holders

from swarm_opt.config import TrackerConfig
from swarm_opt.groups import Grid
from swarm_opt.simulation import moshpit_round
from tests.swarm.conftest import Swarm  # the swarm tests' launcher and reaper


def run(args: argparse.Namespace, size: Optional[int], workdir: Path) -> dict:
    swarm = Swarm(workdir)
    common = dict(task="lsq", strategy=args.strategy, groups=size, lsq_lr=0.0, init_by_rank=True, batch_size=16,
                  target_batch_size=args.peers * 16 * 5,
                  epochs=args.epochs, step_sleep=0.05, matchmaking_time=args.matchmaking_time,
                  averaging_timeout=args.averaging_timeout, expect_peers=args.peers, max_seconds=args.max_seconds,
                  linger=30.0)
    started = time.monotonic()
    try:
        for rank in range(args.peers):
            swarm.start(rank, problem=rank % 4, **common)
        killed: List[int] = []
        victims = list(range(1, 1 + int(args.kill * args.peers)))  # never the bootstrap peer (rank 0)
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline and not killed:
            # the swarm's epoch as any peer logs it (a peer that catches up logs "The swarm is at epoch N")
            epochs = [int(e) for rank in swarm.procs
                      for e in re.findall(r"epoch (\d+)(?::| averaged|;)", swarm.log(rank))]
            if epochs and max(epochs) >= args.kill_at:
                for rank in victims:
                    swarm.kill(rank)
                    killed.append(rank)
                for i, _ in enumerate(victims):  # a newcomer joins the running swarm: it waits for nobody
                    swarm.start(args.peers + i, problem=i % 4, **{**common, "expect_peers": 1})
            time.sleep(0.5)
        swarm.wait(timeout=args.max_seconds + 120)
        elapsed = time.monotonic() - started
        survivors = [r for r in swarm.procs]
        results = {r: swarm.result(r) for r in survivors}
        logs = {r: (workdir / f"peer{r}.log").read_text() for r in range(args.peers + len(killed))}
    finally:
        swarm.kill_all()
    committed = [set(re.findall(r"epoch (\d+): averaged", log)) for log in logs.values()]
    failed = [set(re.findall(r"Round for epoch (\d+) did not reach a majority", log)) for log in logs.values()]
    # a newcomer that found no swarm to join (it started after the others finished) founds one of its own: what
    # the spread then measures is two swarms, not how well one mixes
    joined = sum(bool(re.search(r"Loaded the swarm's state at epoch", logs[args.peers + i]))
                 for i in range(len(killed)))
    commits = sum(map(len, committed))
    # failed attempts (every one, retries included), and those that gave up because the round was over elsewhere
    attempts = sum(len(re.findall(r"did not reach a majority", log)) for log in logs.values())
    round_over = sum(len(re.findall(r"completed round \d+ without this peer", log)) for log in logs.values())
    failures = sum(len(f - c) for c, f in zip(committed, failed))  # epochs never committed by that peer
    rounds = [rnd for res in results.values() for rnd in res["rounds"] if not rnd["caught_up"]]
    seconds = [rnd["seconds"] for rnd in rounds]
    sizes: Dict[int, int] = {}
    for rnd in rounds:
        sizes[rnd["group_size"]] = sizes.get(rnd["group_size"], 0) + 1
    finals = torch.stack([res["w"] for res in results.values()])
    epochs = [res["epoch"] for res in results.values()]
    return {"size": size, "peers": args.peers, "killed": killed, "commits": commits, "failures": failures,
            "success_rate": commits / max(1, commits + failures), "group_sizes": dict(sorted(sizes.items())),
            "failed_attempts": attempts, "failed_as_round_over": round_over,
            "median_round_seconds": statistics.median(seconds) if seconds else None,
            "epochs_reached": epochs, "epochs_per_minute": 60 * statistics.median(epochs) / elapsed,
            "final_spread": float((finals - finals.mean(0)).norm(dim=1).max()), "seconds": elapsed,
            "newcomers_joined": joined}


def simulated_spread(args: argparse.Namespace, size: Optional[int], miss: float, seed: int) -> float:
    """The final spread of the same swarm in process: peer i holds i (5 values), ``--kill`` of them are replaced
    after round ``--kill-at`` by newcomers holding a live peer's values, each peer misses each round with
    probability ``miss``; rounds stop at ``--epochs``."""
    rng = random.Random(seed)
    peers = holders(torch.arange(args.peers, dtype=torch.float64)[:, None].repeat(1, 5))
    ids = list(range(args.peers))
    # as the real peers place themselves: by their ranks among the live peers where they see them all, else at random
    exact = args.peers <= TrackerConfig().exact_up_to
    place = (lambda i: Grid(size, i, live_peers=lambda: ids)) if exact else (lambda i: Grid(size, i))  # noqa: E731
    grids = [place(i) for i in ids]
    for r in range(args.epochs):
        for w, strategy in peers:
            w.grad = torch.zeros_like(w)
            strategy.local_step(1)
        moshpit_round([s for _, s in peers], grids, ids, r, absent={i for i in range(len(ids)) if rng.random() < miss})
        if r + 1 == args.kill_at:
            victims = range(1, 1 + int(args.kill * args.peers))  # as in the real run; newcomers take their places
            for i in victims:
                donor = peers[rng.choice([j for j in range(args.peers) if j not in victims])]
                peers[i] = holders(donor[0].detach()[None])[0]
                ids[i], grids[i] = args.peers + i, place(args.peers + i)
    finals = torch.stack([w.detach() for w, _ in peers])
    return float((finals - finals.mean(0)).norm(dim=1).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=24)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=30,
                        help="enough for the newcomers (tens of seconds to start beside the others) to join")
    parser.add_argument("--strategy", choices=["local", "grad"], default="local",
                        help="LocalUpdates, or GradientAveraging (the same mixing maths: lr 0)")
    parser.add_argument("--kill", type=float, default=0.25)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--averaging-timeout", type=float, default=20.0)
    parser.add_argument("--max-seconds", type=float, default=400.0)
    parser.add_argument("--averaging", nargs="+", choices=["one-group", "groups"], default=["one-group", "groups"],
                        help="run one group of the whole swarm, Groups(--size), or both (the default)")
    parser.add_argument("--keep", action="store_true", help="keep each run's folder of peer logs (printed)")
    args = parser.parse_args()
    runs = []
    for size in [{"one-group": None, "groups": args.size}[name] for name in args.averaging]:
        tmp = tempfile.mkdtemp(prefix="many_peers_")
        print(f"running {args.peers} peers, groups={size} in {tmp} ...", flush=True)
        try:
            runs.append(run(args, size, Path(tmp)))
        finally:
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        miss = 1 - runs[-1]["success_rate"]
        sims = [simulated_spread(args, size, miss, seed) for seed in range(20)]
        runs[-1]["simulated_spread"] = {"miss": miss, "mean": statistics.mean(sims), "max": max(sims)}
        print(runs[-1], flush=True)
    rows = [["one group" if r["size"] is None else f"Groups({r['size']})", r["peers"],
             f"{len(r['killed'])} ({r['newcomers_joined']} joined)",
             f"{r['success_rate']:.0%} ({r['commits']}/{r['commits'] + r['failures']})",
             f"{r['failed_as_round_over']} of {r['failed_attempts']}",
             ", ".join(f"{k}: {v}" for k, v in r["group_sizes"].items()),
             "-" if r["median_round_seconds"] is None else f"{r['median_round_seconds']:.2f}",
             f"{r['epochs_per_minute']:.1f}", f"{min(r['epochs_reached'])}-{max(r['epochs_reached'])}",
             f"{r['final_spread']:.1e}",
             f"{r['simulated_spread']['mean']:.1e} / {r['simulated_spread']['max']:.1e}"] for r in runs]
    print(table(["averaging", "peers", "killed+replaced (joined)", "round success",
                 "failed attempts: round over elsewhere", "committed group sizes (count)",
                 "median s/round", "epochs/min", "epochs reached", "final spread", "simulated (mean / max)"], rows))
    path = write_json("many_peers", {"command": command_line(), "code": code_version(), "machine": machine(),
                                     "args": vars(args), "runs": runs, "repo": str(REPO)})
    print(f"results: {path}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
