"""How many samples a global epoch really averages, against ``target_batch_size``, in real loopback swarms.

Setting ``hivemind``: hivemind's own optimizer test run with 4 swarm_opt peers (batches 4-7, steps of 0.3-0.9 s,
``matchmaking_time=1.0``). Setting ``fast``: the demo's shape (4 peers, batches of 32, steps of a few ms, target
256). Peers are ``tests/swarm/peer.py`` processes; an epoch's samples are summed over the peers that committed it.
``--shard-size 2`` runs each setting a second time with ``TrackerConfig(shard_size=2, exact_up_to=2)``: the 4 peers'
records are then sharded over 2 DHT keys and each peer reads one key every ``sampled_period`` (3 s), the path a swarm
of hundreds takes (``swarm_opt.sharding``), against the exact one in the same run.

    python benchmarks/global_batch.py                       # both settings
    python benchmarks/global_batch.py --shard-size 2        # and both again with sharded records
    python benchmarks/global_batch.py --settings hivemind --target 32 --epochs 6
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from _common import command_line, quantiles, table, write_json

from tests.swarm.conftest import Swarm  # noqa: E402 (the repository root is on sys.path once _common is imported)

SETTINGS = {
    # rank -> (batch size, seconds of compute per step)
    "hivemind": [(4, 0.3), (5, 0.5), (6, 0.7), (7, 0.9)],
    "fast": [(32, 0.0)] * 4,
}
DEFAULT_TARGET = {"hivemind": 32, "fast": 256}
#: the first epochs of a run, before the peers know each other's speeds (shares need them), are reported apart
WARM_UP = 2


def run(setting: str, target: int, epochs: int, matchmaking_time: float, shard_size: Optional[int] = None
        ) -> Dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        swarm = Swarm(Path(tmp))
        try:
            for rank, (batch, sleep) in enumerate(SETTINGS[setting]):
                swarm.start(rank, batch_size=batch, step_sleep=sleep, target_batch_size=target, inner="sgd",
                            epochs=epochs, expect_peers=len(SETTINGS[setting]), matchmaking_time=matchmaking_time,
                            max_seconds=60 + epochs * 10, linger=5.0,
                            tracker={} if shard_size is None else {"shard_size": shard_size,
                                                                   "exact_up_to": shard_size})
            swarm.wait(timeout=120 + epochs * 15)
            results = [swarm.result(r) for r in range(len(SETTINGS[setting]))]
        finally:
            swarm.kill_all()
    levels = {rep["tracker_level"] for r in results for rep in r["reports"]}
    per_epoch: Dict[int, int] = {}
    per_peer: Dict[int, List[int]] = {}  # epoch -> samples each peer averaged into it (0: it caught up instead)
    for rank, r in enumerate(results):
        for rep in r["reports"]:
            per_peer.setdefault(rep["epoch"], [0] * len(results))[rank] = 0 if rep["caught_up"] else rep["samples"]
            if not rep["caught_up"]:
                per_epoch[rep["epoch"]] = per_epoch.get(rep["epoch"], 0) + rep["samples"]
    ratios: List[float] = [s / target for _, s in sorted(per_epoch.items())]
    steady = [s / target for e, s in sorted(per_epoch.items()) if e > WARM_UP]
    return {"setting": setting, "shard_size": shard_size, "tracker_levels": sorted(levels), "target": target,
            "epochs": epochs, "samples_per_epoch": per_epoch,
            "samples_per_epoch_by_peer": dict(sorted(per_peer.items())),
            "ratio": quantiles(ratios) if ratios else None, "ratio_mean": sum(ratios) / len(ratios) if ratios else None,
            "ratio_mean_after_warm_up": sum(steady) / len(steady) if steady else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--target", type=int, help="target_batch_size (default: 32 hivemind, 256 fast)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--shard-size", type=int, help="also run each setting with TrackerConfig(shard_size=...)")
    parser.add_argument("--out", default="global_batch.json")
    args = parser.parse_args()
    rows = []
    for setting in args.settings:
        for shard_size in [None] + ([args.shard_size] if args.shard_size else []):
            rows.append(run(setting, args.target or DEFAULT_TARGET[setting], args.epochs, args.matchmaking_time,
                            shard_size))
    print(table(["setting", "tracking", "target", "epochs", "samples/target mean", f"mean after epoch {WARM_UP}",
                 "median", "max"],
                [[r["setting"], "exact" if r["shard_size"] is None else
                  f"sharded ({r['shard_size']}, levels {r['tracker_levels']})", r["target"],
                  len(r["samples_per_epoch"]), f"{r['ratio_mean']:.2f}",
                  f"{r['ratio_mean_after_warm_up']:.2f}", f"{r['ratio']['median']:.2f}", f"{r['ratio']['max']:.2f}"]
                 for r in rows if r["ratio"]]))
    path = write_json(args.out, {"benchmark": "global_batch", "rows": rows, "command": command_line()})
    print(f"wrote {path}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
