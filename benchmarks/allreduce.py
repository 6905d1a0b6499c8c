"""All-reduce throughput: ``swarm_opt.averaging.TensorAverager`` against ``torch.distributed`` gloo, same run.

For every peer count the script starts that many worker processes (this script with ``--worker``, each in its own
session so that its p2pd daemon and averager process can be killed as a group). The workers join one hivemind DHT
and one gloo process group; the gloo group also serves as the barrier that lines the peers up before each timed call.
For each tensor size they time, in this order:

* gloo: ``dist.all_reduce(t); t.div_(world)`` (the average, in place);
* swarm_opt: matchmaking is started ahead (``TensorAverager.schedule``) and timed separately until the group is
  formed; then ``TensorAverager.all_reduce([t], weight=1)`` is timed (copy into hivemind's buffer, butterfly
  all-reduce through p2pd, copy back).

A call's time is the slowest peer's. Throughput is the tensor's size divided by that time (MB = 10^6 bytes). The
averaged values are checked against the exact mean once per size.

    python benchmarks/allreduce.py                               # 1M, 10M, 50M float32 among 2 and 4 peers
    python benchmarks/allreduce.py --sizes 1e6 1e7 --peers 2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import List

import torch
from _common import (  # also puts the repo on sys.path for swarm_opt
    RESULTS_DIR,
    command_line,
    kill_all,
    launch,
    leftovers,
    quantiles,
    table,
    wait_all,
    write_json,
)

BYTES_PER_PARAM = 4


# --- worker ---------------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import logging

    import hivemind
    import torch.distributed as dist
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    import swarm_opt
    from swarm_opt.averaging import TensorAverager

    logging.basicConfig(level=logging.WARNING, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    rank, world = args.rank, args.world
    maddrs_file = Path(args.tmp) / "maddrs.json"
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        tmp_file = maddrs_file.with_suffix(".tmp")
        tmp_file.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(tmp_file, maddrs_file)
    else:
        deadline = time.monotonic() + 60
        while not maddrs_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 did not publish its DHT address within 60 s")
            time.sleep(0.05)
        dht = hivemind.DHT(initial_peers=json.loads(maddrs_file.read_text()), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           start=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_true(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    timeouts = swarm_opt.Timeouts(matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)
    results = []
    try:
        for size in args.sizes:
            base = torch.randn(size, generator=torch.Generator().manual_seed(0))
            original = base + rank  # peers differ by a constant: the exact mean is base + (world - 1) / 2
            expected_shift = (world - 1) / 2
            tensor = original.clone()
            entry = {"size": size, "mb": size * BYTES_PER_PARAM / 1e6, "world": world}

            gloo_times = []
            for i in range(args.warmup + args.reps):
                tensor.copy_(original)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                tensor.div_(world)
                elapsed = slowest(time.perf_counter() - start)
                if i == 0:
                    entry["gloo_max_error"] = float((tensor - base - expected_shift).abs().max())
                if i >= args.warmup:
                    gloo_times.append(elapsed)
            entry["gloo_s"] = quantiles(gloo_times)

            averager = TensorAverager(dht, prefix=f"bench_allreduce_w{world}_n{size}", templates=[tensor],
                                      timeouts=timeouts)
            mm_times, ar_times, group_sizes, failures = [], [], [], 0
            try:
                dist.barrier()  # every averager process is up before the first matchmaking
                for i in range(args.warmup + args.reps):
                    tensor.copy_(original)
                    dist.barrier()
                    start = time.perf_counter()
                    averager.schedule(get_dht_time(), round_id=i)
                    control = averager._scheduled  # benchmark-only peek: is the group formed yet?
                    while control is not None and control.stage in (AveragingStage.IDLE,
                                                                    AveragingStage.LOOKING_FOR_GROUP):
                        time.sleep(0.002)
                    matchmaking = slowest(time.perf_counter() - start)
                    start = time.perf_counter()
                    result = averager.all_reduce([tensor], 1.0, round_id=i)
                    elapsed = slowest(time.perf_counter() - start)
                    size_ok = all_true(result is not None and result.group_size == world)
                    if i == 0 and size_ok:
                        entry["swarm_max_error"] = float((tensor - base - expected_shift).abs().max())
                    if i >= args.warmup:
                        if size_ok:
                            mm_times.append(matchmaking)
                            ar_times.append(elapsed)
                        else:
                            failures += 1
                        group_sizes.append(0 if result is None else result.group_size)
            finally:
                averager.shutdown()
            entry["swarm_matchmaking_s"] = quantiles(mm_times) if mm_times else None
            entry["swarm_allreduce_s"] = quantiles(ar_times) if ar_times else None
            entry["swarm_group_sizes"] = group_sizes
            entry["swarm_failed_rounds"] = failures
            results.append(entry)
            if rank == 0:
                print(f"size {size}: gloo {entry['gloo_s']['median']:.3f} s, swarm_opt "
                      f"{entry['swarm_allreduce_s']['median'] if ar_times else float('nan'):.3f} s", flush=True)
            del base, original, tensor
        if rank == 0:
            Path(args.result).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()
        dht.shutdown()


# --- orchestrator ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args: argparse.Namespace, world: int, tmp: Path) -> List[dict]:
    run_dir = tmp / f"world{world}"
    run_dir.mkdir()
    result_file = run_dir / "result.json"
    port = free_port()
    procs, logs = [], []
    try:
        for rank in range(world):
            log = run_dir / f"rank{rank}.log"
            worker_args = [__file__, "--worker", "--rank", str(rank), "--world", str(world), "--port", str(port),
                           "--tmp", str(run_dir), "--result", str(result_file), "--sizes", *map(str, args.sizes),
                           "--reps", str(args.reps), "--warmup", str(args.warmup),
                           "--matchmaking-time", str(args.matchmaking_time),
                           "--averaging-timeout", str(args.averaging_timeout)]
            procs.append(launch(worker_args, log, env_extra={"OMP_NUM_THREADS": str(args.threads)}))
            logs.append(log)
        wait_all(procs, timeout=args.timeout, logs=logs)
    finally:
        kill_all(procs)
        left = leftovers(procs)
        if left:
            print(f"WARNING: processes left behind: {left}", file=sys.stderr)
    return json.loads(result_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=lambda s: int(float(s)), default=[1_000_000, 10_000_000, 50_000_000],
                        help="number of float32 parameters (1e6 style accepted)")
    parser.add_argument("--peers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--reps", type=int, default=3, help="timed calls per size and method")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per peer count")
    parser.add_argument("--out", default="allreduce.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    print(f"command: {command_line()}", flush=True)
    rows, all_results = [], []
    with tempfile.TemporaryDirectory(prefix="swarm_allreduce_") as tmp:
        for world in args.peers:
            started = time.monotonic()
            entries = run_world(args, world, Path(tmp))
            print(f"  {world} peers done in {time.monotonic() - started:.0f} s", flush=True)
            all_results.extend(entries)
    for e in all_results:
        gloo = e["gloo_s"]["median"]
        ar = e["swarm_allreduce_s"]
        swarm = ar["median"] if ar else float("nan")
        mm = e["swarm_matchmaking_s"]["median"] if e["swarm_matchmaking_s"] else float("nan")
        e["gloo_mb_s"] = e["mb"] / gloo
        e["swarm_mb_s"] = e["mb"] / swarm
        e["throughput_ratio_to_gloo"] = e["swarm_mb_s"] / e["gloo_mb_s"]
        rows.append([e["world"], f"{e['size'] / 1e6:g}M", f"{e['mb']:.0f}", f"{gloo:.3f}", f"{e['gloo_mb_s']:.0f}",
                     f"{swarm:.3f}", f"{ar['iqr'] if ar else float('nan'):.3f}", f"{e['swarm_mb_s']:.0f}",
                     f"{e['throughput_ratio_to_gloo']:.3f}", f"{swarm / gloo:.1f}x", f"{mm:.2f}",
                     e["swarm_failed_rounds"], f"{e.get('swarm_max_error', float('nan')):.1e}"])
    print()
    print(table(["peers", "params", "MB", "gloo s", "gloo MB/s", "swarm_opt s", "IQR s", "swarm_opt MB/s",
                 "MB/s ratio", "slowdown", "matchmaking s", "failed", "max err"], rows))
    path = write_json(args.out, {"benchmark": "allreduce", "reps": args.reps, "warmup": args.warmup,
                                 "matchmaking_time": args.matchmaking_time, "worker_threads": args.threads,
                                 "results": all_results})
    print(f"\nwrote {path}")
    if not args.no_plot:
        png = plot(all_results, Path(args.out).with_suffix(".png").name)
        print(f"wrote {png}")
    print(f"reproduce: {command_line()}")


def plot(results: List[dict], name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for world in sorted({e["world"] for e in results}):
        es = sorted((e for e in results if e["world"] == world), key=lambda e: e["size"])
        xs = [e["size"] / 1e6 for e in es]
        ax.plot(xs, [e["gloo_mb_s"] for e in es], "o--", label=f"gloo, {world} peers")
        ax.plot(xs, [e["swarm_mb_s"] for e in es], "s-", label=f"swarm_opt, {world} peers")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float32 parameters (millions)")
    ax.set_ylabel("tensor MB / s (median)")
    ax.set_title("All-reduce on loopback, 2-core CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS_DIR / name
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    sys.exit(main())
