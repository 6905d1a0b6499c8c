"""What one training peer holds, process by process: swarm_opt's against hivemind.Optimizer's, same model, same run.

For each system, ``--peers`` (2) peers train an MLP 784-2800-2800-10 (10.07M fp32 parameters, 40.3 MB) with
SGD(momentum=0.9) on random data in one swarm on loopback (``target_batch_size=256``, 32 samples per step), each peer
in its own session. Once every peer passed ``--warm-epochs`` global epochs (rounds averaged, state exchanged at
start), each peer's whole session is read ``--samples`` times, 3 s apart, while it trains: per process (trainer,
DHT, p2pd, averager(s), torch's shm manager) PSS (``/proc/PID/smaps_rollup``: shared pages split between the
processes that map them, so the sum over a peer counts each page once), its anonymous and shared-memory part
(``Pss_Anon + Pss_Shmem``: what the peer adds, without the share of library files, which depends on how many other
processes on the machine map them), USS and RSS; the medians are reported. The
two systems run one after the other in the same invocation, so the machine and the libraries are the same.

    python benchmarks/peer_memory.py
    python benchmarks/peer_memory.py --peers 3 --warm-epochs 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

from _common import join_loopback_swarm, kill_all, launch, leftovers, table, tail, write_json

from swarm_opt.testing import name_roles, process_sample, session_members

MB = 1e6
SYSTEMS = ("swarm_opt", "hivemind")


def worker(args: argparse.Namespace) -> None:
    import hivemind
    import torch

    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    dht = join_loopback_swarm(workdir, args.rank)
    torch.manual_seed(0)  # identical initial weights on every peer
    model = torch.nn.Sequential(torch.nn.Linear(784, 2800), torch.nn.ReLU(), torch.nn.Linear(2800, 2800),
                                torch.nn.ReLU(), torch.nn.Linear(2800, 10))
    common = dict(dht=dht, run_id=f"mem_{args.system}", target_batch_size=256, batch_size_per_step=32,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), params=model.parameters(),
                  matchmaking_time=2.0, averaging_timeout=60.0)
    if args.system == "swarm_opt":
        import swarm_opt

        opt = swarm_opt.Optimizer(strategy=swarm_opt.GradientAveraging(), **common)
    else:
        opt = hivemind.Optimizer(verbose=False, **common)
    g = torch.Generator().manual_seed(args.rank)
    x, y = torch.rand(512, 784, generator=g), torch.randint(0, 10, (512,), generator=g)
    epoch_file = workdir / f"epoch{args.rank}"
    while True:
        idx = torch.randint(0, len(x), (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        epoch_file.write_text(str(opt.local_epoch))


def run_system(args: argparse.Namespace, system: str) -> Dict:
    workdir = Path(f"/tmp/swarm_peer_memory_{system}_{os.getpid()}")
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.iterdir():
        old.unlink()
    logs = [workdir / f"peer{r}.log" for r in range(args.peers)]
    procs = []
    try:
        for rank in range(args.peers):
            procs.append(launch([__file__, "--worker", "--system", system, "--rank", str(rank), "--workdir",
                                 str(workdir)], logs[rank]))
        deadline = time.monotonic() + args.timeout

        def epochs() -> List[int]:
            found = []
            for r in range(args.peers):
                try:
                    found.append(int((workdir / f"epoch{r}").read_text() or 0))
                except (OSError, ValueError):
                    found.append(0)
            return found

        while min(epochs()) < args.warm_epochs:
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"{system} peer exited ({proc.returncode}):\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{system}: epochs {epochs()} < {args.warm_epochs} after {args.timeout:.0f} s:\n"
                                   f"{tail(logs[0])}")
            time.sleep(1.0)
        samples: List[List[Dict]] = [[] for _ in procs]
        for _ in range(args.samples):
            for rank, proc in enumerate(procs):
                tree = [p for p in map(process_sample, session_members(proc.pid)) if p]
                name_roles(proc.pid, tree)
                samples[rank].append(tree)
            time.sleep(3.0)
        reached = epochs()
    finally:
        kill_all(procs)
        deadline = time.monotonic() + 5  # a process killed a moment ago may still be on its way out
        while leftovers(procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = leftovers(procs)
        if left:
            print(f"WARNING: processes left behind: {left}", file=sys.stderr)
    peers = []
    for rank, trees in enumerate(samples):
        roles = sorted({p["role"] for tree in trees for p in tree})
        per_role = {role: {key: statistics.median(sum(p[key] for p in tree if p["role"] == role) for tree in trees)
                           / MB for key in ("pss", "anon", "uss", "rss")} for role in roles}
        totals = {key: statistics.median(sum(p[key] for p in tree) for tree in trees) / MB
                  for key in ("pss", "anon", "uss", "rss")}
        peers.append({"rank": rank, "roles": per_role, "total": totals,
                      "processes": statistics.median(len(tree) for tree in trees)})
    return {"system": system, "epochs": reached, "peers": peers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--workdir")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--warm-epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = [run_system(args, system) for system in SYSTEMS]
    roles = ["trainer", "dht", "p2pd", "averager", "averager2", "shm_manager"]
    rows = []
    for result in results:
        for p in result["peers"]:
            rows.append([result["system"], p["rank"],
                         *[f"{p['roles'][r]['pss']:.0f} ({p['roles'][r]['anon']:.0f})" if r in p["roles"] else "-"
                           for r in roles],
                         f"{p['total']['pss']:.0f}", f"{p['total']['anon']:.0f}", f"{p['total']['uss']:.0f}",
                         f"{p['total']['rss']:.0f}", f"{p['processes']:.0f}"])
    print(table(["system", "peer", *[f"{r} PSS (anon+shm)" for r in roles], "PSS MB", "anon+shm PSS MB", "USS MB",
                 "RSS MB", "processes"], rows))
    ratios = {}
    for key in ("pss", "anon"):
        mean = {r["system"]: statistics.mean(p["total"][key] for p in r["peers"]) for r in results}
        ratios[key] = mean["swarm_opt"] / mean["hivemind"]
        print(f"{'PSS' if key == 'pss' else 'anon+shm PSS'} per peer (mean of {args.peers}): swarm_opt "
              f"{mean['swarm_opt']:.0f} MB, hivemind {mean['hivemind']:.0f} MB: {ratios[key]:.2f}x")
    path = write_json("peer_memory.json", {"results": results, "pss_ratio": ratios["pss"],
                                           "anon_shm_pss_ratio": ratios["anon"]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
