"""How many samples a global epoch really averages, against ``target_batch_size``, in real loopback swarms.

Setting ``hivemind``: hivemind's own optimizer test run with 4 swarm_opt peers (batches 4-7, steps of 0.3-0.9 s,
``matchmaking_time=1.0``). Setting ``fast``: the demo's shape (4 peers, batches of 32, steps of a few ms, target
256). Peers are ``tests/swarm/peer.py`` processes; an epoch's samples are summed over the peers that committed it.

    python benchmarks/global_batch.py                       # both settings
    python benchmarks/global_batch.py --settings hivemind --target 32 --epochs 6
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Dict, List

from _common import quantiles, table, write_json

from tests.swarm.conftest import Swarm  # noqa: E402 (the repository root is on sys.path once _common is imported)

SETTINGS = {
    # rank -> (batch size, seconds of compute per step)
    "hivemind": [(4, 0.3), (5, 0.5), (6, 0.7), (7, 0.9)],
    "fast": [(32, 0.0)] * 4,
}
DEFAULT_TARGET = {"hivemind": 32, "fast": 256}
#: the first epochs of a run, before the peers know each other's speeds (shares need them), are reported apart
WARM_UP = 2


def run(setting: str, target: int, epochs: int, matchmaking_time: float) -> Dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        swarm = Swarm(Path(tmp))
        try:
            for rank, (batch, sleep) in enumerate(SETTINGS[setting]):
                swarm.start(rank, batch_size=batch, step_sleep=sleep, target_batch_size=target, inner="sgd",
                            epochs=epochs, expect_peers=len(SETTINGS[setting]), matchmaking_time=matchmaking_time,
                            max_seconds=60 + epochs * 10, linger=5.0)
            swarm.wait(timeout=120 + epochs * 15)
            results = [swarm.result(r) for r in range(len(SETTINGS[setting]))]
        finally:
            swarm.kill_all()
    per_epoch: Dict[int, int] = {}
    per_peer: Dict[int, List[int]] = {}  # epoch -> samples each peer averaged into it (0: it caught up instead)
    for rank, r in enumerate(results):
        for rep in r["reports"]:
            per_peer.setdefault(rep["epoch"], [0] * len(results))[rank] = 0 if rep["caught_up"] else rep["samples"]
            if not rep["caught_up"]:
                per_epoch[rep["epoch"]] = per_epoch.get(rep["epoch"], 0) + rep["samples"]
    ratios: List[float] = [s / target for _, s in sorted(per_epoch.items())]
    steady = [s / target for e, s in sorted(per_epoch.items()) if e > WARM_UP]
    return {"setting": setting, "target": target, "epochs": epochs, "samples_per_epoch": per_epoch,
            "samples_per_epoch_by_peer": dict(sorted(per_peer.items())),
            "ratio": quantiles(ratios) if ratios else None, "ratio_mean": sum(ratios) / len(ratios) if ratios else None,
            "ratio_mean_after_warm_up": sum(steady) / len(steady) if steady else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--target", type=int, help="target_batch_size (default: 32 hivemind, 256 fast)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--out", default="global_batch.json")
    args = parser.parse_args()
    rows = []
    for setting in args.settings:
        rows.append(run(setting, args.target or DEFAULT_TARGET[setting], args.epochs, args.matchmaking_time))
    print(table(["setting", "target", "epochs", "samples/target mean", f"mean after epoch {WARM_UP}", "median", "max"],
                [[r["setting"], r["target"], len(r["samples_per_epoch"]), f"{r['ratio_mean']:.2f}",
                  f"{r['ratio_mean_after_warm_up']:.2f}", f"{r['ratio']['median']:.2f}", f"{r['ratio']['max']:.2f}"]
                 for r in rows if r["ratio"]]))
    path = write_json(args.out, {"benchmark": "global_batch", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
