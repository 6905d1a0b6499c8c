"""Rounds at start-up, under load and beside a broken peer: one version per epoch, and nobody waited for in vain.

Real peers on loopback (``tests/swarm/peer.py``, the test suite's declarative peer: an MLP on synthetic data, SGD
with momentum), in four measurements:

- ``nan``: 4 peers, one of whose gradients are always NaN (it sits every round out), against a control run of 4
  honest peers, taking turns, ``--seconds`` each: epochs the honest peers reach, and their ratio (goal >= 0.8x).
- ``first``: 4 peers started together, as users start them (nobody waits to see the others): seconds from the last
  peer's first step to the first epoch committed with more than one peer (goal <= 5 s), and whether any epoch was
  committed alone meanwhile.
- ``samples``: hivemind's own optimizer test setting (4 peers, one in client mode, ``target_batch_size=32``, batch
  4, 3 epochs): samples computed by all peers / (target x epochs), first epoch included (goal <= 1.2x). As in
  hivemind's test, the peers start training together (each waits until it sees the 4); ``staggered`` also runs
  them as launched one after another, where the first one may train the whole run alone before the others come
  (its "peers that computed" column says how many computed anything).
- ``stall``: 3 peers at the default deadlines (``matchmaking_time`` 5 s, ``averaging_timeout`` 60 s); at epoch
  ``--stall-at`` one of them stops answering in the middle of a round for ``--stall`` seconds (its process frozen, its
  link down): seconds from the stall to the survivors' next committed epoch, with deadlines that adapt
  (``Timeouts(adaptive=True)``, the default) against fixed ones (``adaptive=False``), in the same run.
- ``loaded``: the 3-peer equivalence run (batches 8/12/20, target 120, 4 epochs, peers started together) beside
  ``--busy`` busy loops, ``--runs`` times: each run's relative error against one process on the union of the
  batches every peer committed (goal < 1e-4 in every run).

    python benchmarks/rounds.py                          # all four, ~6 min on 2 cores
    python benchmarks/rounds.py --only nan --seconds 30
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from _common import REPO, table, write_json

from tests.swarm.conftest import Swarm
from tests.swarm.test_grad_averaging import possible_references


def _run(peers: List[dict], timeout: float, stagger: float = 0.0) -> List[dict]:
    """Start ``peers`` (configs for tests/swarm/peer.py) together, wait for their results, return them."""
    with tempfile.TemporaryDirectory(prefix="swarm_rounds_") as tmp:
        swarm = Swarm(Path(tmp))
        try:
            for rank, config in enumerate(peers):
                swarm.start(rank, **config)
                time.sleep(stagger)
            swarm.wait(timeout=timeout)
            return [swarm.result(rank) for rank in range(len(peers))]
        finally:
            swarm.kill_all()


def measure_nan(seconds: float, reps: int) -> Dict:
    """Epochs the honest peers reach in ``seconds`` beside a NaN peer, and in a control run without it."""
    rows = []
    for rep in range(reps):
        for broken in (False, True):
            configs = [dict(batch_size=16, target_batch_size=64, inner="sgd", epochs=100_000, expect_peers=4,
                            step_sleep=0.02, max_seconds=seconds, linger=5.0,
                            attack={"nan": True} if broken and rank == 3 else None) for rank in range(4)]
            results = _run(configs, timeout=seconds + 120)
            honest = [r["epoch"] for r in results[:3]]
            rows.append(dict(rep=rep, broken=broken, epochs=statistics.median(honest)))
    control = statistics.median(r["epochs"] for r in rows if not r["broken"])
    broken = statistics.median(r["epochs"] for r in rows if r["broken"])
    return dict(rows=rows, control_epochs=control, nan_epochs=broken, ratio=broken / control if control else None)


def measure_first(reps: int) -> Dict:
    """Seconds from the last peer's first step to the first epoch committed by more than one peer."""
    rows = []
    for rep in range(reps):
        configs = [dict(batch_size=16, target_batch_size=256, inner="sgd", epochs=3, step_sleep=0.02)
                   for _ in range(4)]
        results = _run(configs, timeout=200)
        last_start = max(r["first_step"] for r in results)
        together = [rep_["time"] for r in results for rep_ in r["reports"]
                    if not rep_["caught_up"] and rep_["group_size"] > 1]
        alone = sum(1 for r in results for rep_ in r["reports"] if not rep_["caught_up"] and rep_["group_size"] == 1)
        rows.append(dict(rep=rep, first_epoch_s=min(together) - last_start if together else None,
                         epochs_committed_alone=alone))
    latencies = [r["first_epoch_s"] for r in rows if r["first_epoch_s"] is not None]
    return dict(rows=rows, median_s=statistics.median(latencies) if latencies else None)


def measure_samples(reps: int) -> Dict:
    """Samples computed / (target x epochs) in hivemind's optimizer test setting, peers starting together (as in
    hivemind's test) and as launched one after another."""
    rows = []
    target, epochs = 32, 3
    for rep in range(reps):
        for together in (True, False):
            configs = [dict(batch_size=4, target_batch_size=target, inner="sgd", epochs=epochs, step_sleep=0.02,
                            client_mode=rank == 3, expect_peers=4 if together else 1) for rank in range(4)]
            results = _run(configs, timeout=200)
            computed = sum(r["samples_computed"] for r in results)
            rows.append(dict(rep=rep, together=together, computed=computed, ratio=computed / (target * epochs),
                             computing_peers=sum(r["samples_computed"] > 0 for r in results)))
    median = {mode: statistics.median(r["ratio"] for r in rows if r["together"] == mode) for mode in (True, False)}
    return dict(rows=rows, median_ratio=median[True], staggered_median_ratio=median[False])


def measure_stall(reps: int, stall_at: int, stall: float) -> Dict:
    """Seconds the survivors lose to a member that stalls once mid-round, with adaptive and with fixed deadlines."""
    rows = []
    for rep in range(reps):
        for adaptive in (True, False):
            with tempfile.TemporaryDirectory(prefix="swarm_rounds_") as tmp:
                swarm = Swarm(Path(tmp))
                try:
                    for rank in range(3):
                        fault = dict(slow_replies=stall, slow_from_epoch=stall_at, slow_once=True) if rank == 2 else {}
                        swarm.start(rank, batch_size=16, target_batch_size=96, inner="sgd", epochs=stall_at + 4,
                                    step_sleep=0.02, matchmaking_time=5.0, averaging_timeout=60.0, expect_peers=3,
                                    adaptive_deadlines=adaptive, max_seconds=stall + 200, linger=stall + 10, **fault)
                    deadline = time.monotonic() + stall + 300
                    while time.monotonic() < deadline and not all(
                            (Path(tmp) / f"peer{rank}.pt").exists() for rank in range(2)):
                        time.sleep(0.2)
                    stalled = Path(tmp) / "peer2.pt.slowed"
                    results = [swarm.result(rank) for rank in range(2)]
                finally:
                    swarm.kill_all()
                began = stalled.stat().st_mtime if stalled.exists() else None
                # the survivors' longest wait between two epochs from the stall on (the stalled round, and any
                # retry that waited for the stalled member)
                gaps = []
                for r in results:
                    times = sorted(rep_["time"] for rep_ in r["reports"])
                    gaps += [b - max(a, began) for a, b in zip(times, times[1:]) if began is not None and b > began]
                deadlines = [rep_["deadlines"][1] for r in results for rep_ in r["reports"]
                             if began is not None and rep_["time"] < began]
                rows.append(dict(rep=rep, adaptive=adaptive, lost_s=max(gaps) if gaps else None,
                                 deadline_at_stall=deadlines[-1] if deadlines else None,
                                 epochs=[r["epoch"] for r in results]))
    lost = {mode: statistics.median(r["lost_s"] for r in rows if r["adaptive"] == mode and r["lost_s"] is not None)
            for mode in (True, False)}
    return dict(rows=rows, adaptive_s=lost[True], fixed_s=lost[False],
                ratio=lost[True] / lost[False] if lost[False] else None)


def measure_loaded(runs: int, busy: int) -> Dict:
    """The 3-peer equivalence beside ``busy`` busy loops: each run's relative error against one process."""
    rows = []
    for run in range(runs):
        loops = [subprocess.Popen(["bash", "-c", "while :; do :; done"]) for _ in range(busy)]
        try:
            configs = [dict(batch_size=bs, target_batch_size=120, inner="sgd", epochs=4, step_sleep=0.03)
                       for bs in (8, 12, 20)]
            results = _run(configs, timeout=300)
        finally:
            for loop in loops:
                loop.kill()
        params = results[0]["params"]
        norm = sum(float(p.norm()) for p in params)
        errors = [sum(float((a - b).norm()) for a, b in zip(params, ref)) / norm
                  for ref in possible_references(results, "sgd", 4)]
        spread = max(float((a - b).abs().max()) for r in results[1:] for a, b in zip(r["params"], params))
        alone = sum(1 for r in results for rep_ in r["reports"] if not rep_["caught_up"] and rep_["group_size"] == 1)
        rows.append(dict(run=run, relative_error=min(errors), peers_spread=spread, epochs_committed_alone=alone))
    return dict(rows=rows, worst_relative_error=max(r["relative_error"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=["nan", "first", "samples", "stall", "loaded"],
                        choices=["nan", "first", "samples", "stall", "loaded"])
    parser.add_argument("--seconds", type=float, default=30.0, help="nan: seconds per run")
    parser.add_argument("--reps", type=int, default=2, help="nan, first, samples: repetitions")
    parser.add_argument("--runs", type=int, default=5, help="loaded: runs")
    parser.add_argument("--stall-at", type=int, default=8, help="stall: the epoch at which a member stalls")
    parser.add_argument("--stall", type=float, default=90.0, help="stall: seconds it stalls")
    parser.add_argument("--busy", type=int, default=3, help="loaded: busy loops beside the peers")
    args = parser.parse_args()
    out: Dict[str, Dict] = {}
    if "nan" in args.only:
        out["nan"] = measure_nan(args.seconds, args.reps)
    if "first" in args.only:
        out["first"] = measure_first(args.reps)
    if "samples" in args.only:
        out["samples"] = measure_samples(args.reps)
    if "stall" in args.only:
        out["stall"] = measure_stall(args.reps, args.stall_at, args.stall)
    if "loaded" in args.only:
        out["loaded"] = measure_loaded(args.runs, args.busy)
    rows = []
    if "nan" in out:
        rows.append(["honest epochs beside a NaN peer / control", f"{out['nan']['ratio']:.2f}x",
                     f"{out['nan']['nan_epochs']:.0f} vs {out['nan']['control_epochs']:.0f} in {args.seconds:.0f} s",
                     ">= 0.8x"])
    if "first" in out:
        median = out["first"]["median_s"]
        alone = sum(r["epochs_committed_alone"] for r in out["first"]["rows"])
        rows.append(["first epoch after the last peer's first step", "n/a" if median is None else f"{median:.1f} s",
                     f"{alone} epochs committed alone", "<= 5 s"])
    if "samples" in out:
        for together in (True, False):
            runs = [r for r in out["samples"]["rows"] if r["together"] == together]
            rows.append([f"samples computed / target x epochs (hivemind's test, "
                         f"{'started together' if together else 'staggered'})",
                         f"{statistics.median(r['ratio'] for r in runs):.2f}x",
                         ", ".join(f"{r['ratio']:.2f} ({r['computing_peers']} computing)" for r in runs),
                         "<= 1.2x" if together else ""])
    if "stall" in out:
        stall = out["stall"]
        rows.append(["survivors' seconds lost to a member stalled mid-round, adaptive / fixed deadlines",
                     "n/a" if stall["ratio"] is None else f"{stall['ratio']:.2f}x",
                     f"{stall['adaptive_s']:.1f} s vs {stall['fixed_s']:.1f} s", "< 1x"])
    if "loaded" in out:
        rows.append(["relative error vs one process, under load", f"{out['loaded']['worst_relative_error']:.1e}",
                     ", ".join(f"{r['relative_error']:.1e}" for r in out["loaded"]["rows"]), "< 1e-4 every run"])
    print(table(["measure", "value", "detail", "goal"], rows))
    path = write_json("rounds.json", out)
    print(f"written {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
