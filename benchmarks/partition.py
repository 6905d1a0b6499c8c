"""Partitions: how long a training swarm split by the network takes to hold one model again once the links come
back, and how much work the cut side throws away, for splits of 10 s, 1 min and 5 min.

Each run is a fresh swarm of gradient-averaging trainers (``swarm-opt train``, task ``digits``, global batch 512,
batch 32, ``--averaging-timeout 20``), one per test host (a network namespace of this machine, ``tests/hosts.py``),
and a bootstrap node on a host of its own, as ``tests/e2e/test_partition.py`` builds them
(``tests/partition_swarm.py``). Once every trainer averaged a round with all the others, the run's epoch rate is
measured over ``--window`` seconds; then the scenario's trainers lose their links for the split's length:

* ``1of5``: one trainer of five, alone;
* ``2of6``: two trainers of six, together on one side;
* ``2of6-apart``: two trainers of six, each alone.

A cut trainer commits no epoch while it sees fewer than a majority of the peers it saw within
``TrackerConfig.forget_after`` (60 s); after that it trains on alone (or with its side), and that work is thrown
away when the links come back. Reported per run: seconds from the links' return to the first epoch every trainer
prints with the same test metrics (one model), the epochs the cut trainers committed on their own while cut (thrown
away: the most of any cut trainer) and the local samples they dropped when they took the majority's state, which
trainers downloaded, the epoch rate over ``--window`` seconds after one model against the rate before the cut, and
the longest ``step()`` of any trainer over the whole run.

    python benchmarks/partition.py                                  # 1of5 at 10 s, 1 min, 5 min: ~15 min
    python benchmarks/partition.py --scenarios 1of5 2of6 --splits 10 60 300
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Set

from _common import require_test_hosts, table, write_json

SCENARIOS: Dict[str, tuple] = {"1of5": (5, [{2}]), "2of6": (6, [{2, 5}]), "2of6-apart": (6, [{2}, {5}])}
DROPPED = re.compile(r"\((\d+) local samples dropped\)")


def run_one(scenario: str, split: float, window: float, workdir: Path) -> Dict[str, Any]:
    from tests.hosts import Hosts
    from tests.partition_swarm import TrainingSwarm

    size, sides = SCENARIOS[scenario]
    cut: Set[int] = set().union(*sides)
    hosts = Hosts(size + 1)
    swarm = None
    try:
        swarm = TrainingSwarm(hosts, size, workdir)
        swarm.wait_together()
        start = time.monotonic()
        time.sleep(window)
        before = swarm.rate(swarm.trainers, start, time.monotonic())
        at_cut = {i: swarm.epoch(i) for i in swarm.trainers}
        cut_offsets = swarm.offsets()
        swarm.cut(sides)
        time.sleep(split)
        heal_offsets = swarm.offsets()
        alone = {i: sum("averaged with" in rest for _, _, rest in
                        swarm.epochs_since(i, cut_offsets[i], heal_offsets[i])) for i in cut}
        at_heal = {i: swarm.epoch(i) for i in swarm.trainers}
        healed = swarm.heal(timeout=120)
        one = time.monotonic()
        time.sleep(window)
        after = swarm.rate(swarm.trainers, one, time.monotonic())
        dropped = {i: sum(int(n) for n in DROPPED.findall(swarm.trainers[i].text()[heal_offsets[i]:]))
                   for i in cut}
        longest = swarm.stop()
    finally:
        if swarm is not None:
            swarm.close()
        hosts.close()
    return dict(scenario=scenario, split_s=split, heal_to_one_model_s=round(healed.seconds, 1),
                one_model_epoch=healed.epoch, epochs_at_cut=at_cut, epochs_at_heal=at_heal,
                epochs_thrown_away=max(alone.values()), epochs_alone=alone, samples_dropped=dropped,
                downloaded=sorted(healed.downloaded), reached_by_round=sorted(healed.committed),
                rate_before=round(before, 3), rate_after=round(after, 3),
                rate_ratio=round(after / before, 2) if before > 0 else None,
                longest_step_s=max(s for s, _ in longest.values()), longest_steps=longest)


def row(run: Dict[str, Any]) -> List[Any]:
    majority_held = bool(set(run["reached_by_round"]) - set().union(*SCENARIOS[run["scenario"]][1]))
    return [run["scenario"], f"{run['split_s']:.0f}", f"{run['heal_to_one_model_s']:.0f}", run["one_model_epoch"],
            run["epochs_thrown_away"], max(run["samples_dropped"].values(), default=0),
            "majority" if majority_held else "MINORITY", f"{run['rate_before']:.2f}", f"{run['rate_after']:.2f}",
            f"{run['rate_ratio']:.2f}" if run["rate_ratio"] is not None else "-", f"{run['longest_step_s']:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["1of5"], choices=sorted(SCENARIOS))
    parser.add_argument("--splits", nargs="+", type=float, default=[10, 60, 300], help="seconds the links stay down")
    parser.add_argument("--window", type=float, default=30.0, help="seconds over which the epoch rate is measured")
    parser.add_argument("--out", default="partition.json", help="the JSON's name under benchmarks/results/")
    args = parser.parse_args()

    require_test_hosts()
    runs: List[Dict[str, Any]] = []
    started = time.time()
    for scenario in args.scenarios:
        for split in args.splits:
            t0 = time.time()
            with tempfile.TemporaryDirectory(prefix="partition-") as workdir:
                run = run_one(scenario, split, args.window, Path(workdir))
            runs.append(run)
            print(f"  {scenario}, {split:.0f} s split: one model {run['heal_to_one_model_s']:.0f} s after healing, "
                  f"{run['epochs_thrown_away']} epoch(s) thrown away ({time.time() - t0:.0f} s)", flush=True)
    headers = ["scenario", "split s", "healing -> one model s", "at epoch", "epochs thrown away (cut trainer)",
               "local samples dropped", "one model is the", "epochs/s before", "epochs/s after", "after / before",
               "longest step() s"]
    print(f"\nPartitions: trainers cut off and healed (digits, global batch 512, averaging_timeout 20 s, epoch rates "
          f"over {args.window:.0f} s windows)")
    print(table(headers, [row(run) for run in runs]))
    path = write_json(args.out, dict(window_s=args.window, runs=runs, seconds=time.time() - started))
    print(f"wrote {path}\nreproduce: python benchmarks/partition.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
