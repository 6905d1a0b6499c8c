"""A machine of two data-parallel ranks as ONE swarm peer (``swarm_opt.LocalGroup``) against the same two processes
as two peers: bytes over the swarm link, progress records on the DHT, and what the local group costs.

Part 1, the swarm (real peers on loopback, ``tests/swarm/peer.py``, gradient averaging of an MLP 16-W-4): a
*machine* of two ranks (batches of 16 each, joined by gloo) beside one single-process *partner* (32 per step),
against the same two ranks started as two peers of their own beside the same partner. Bytes are the kernel's
``bytes_sent`` of every TCP socket of the peers' ``p2pd`` daemons (everything that crosses the swarm link:
averaging, DHT, state), read once every peer reached the last epoch; the rank's gloo sockets (the local link) are
counted apart. Records: the live peers the partner's tracker counts (one record per peer).

Part 2, the local group alone (two processes, gloo on loopback, no swarm): the time of one step's gradient
combine (one all-reduce of the model's gradients and the samples), of the step's message when nothing else
happened, and of the state broadcast after a round (parameters and the inner optimizer's state, SGD momentum),
for models of several sizes, against the baseline of one plain all-reduce of as many floats (what DDP's backward
pays); medians over repeats.

    python benchmarks/ranks.py                       # both parts, ~4 min on 2 idle cores
    python benchmarks/ranks.py --width 2048 --epochs 6 --sizes 1e4 1e6
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
from _common import REPO, RESULTS_DIR, command_line, quantiles, table, tcp_bytes_sent, write_json

from swarm_opt import testing

PEER = REPO / "tests" / "swarm" / "peer.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_swarm(machine_ranks: bool, args: argparse.Namespace, workdir: Path) -> Dict[str, float]:
    """The two ranks as one machine (``machine_ranks``) or as two peers, beside a partner; returns the bytes."""
    workdir.mkdir(parents=True)
    common = dict(target_batch_size=64 * 8, inner="sgd", epochs=args.epochs, step_sleep=0.02, width=args.width,
                  matchmaking_time=1.0, averaging_timeout=30.0, linger=120.0)
    port = _free_port()
    configs = []
    for r in range(2):
        cfg = dict(common, rank=r, batch_size=16, expect_peers=2 if machine_ranks else 3)
        if machine_ranks:
            cfg.update(local=dict(rank=r, size=2, port=port), machine_batch_size=32)
        configs.append(cfg)
    configs.append(dict(common, rank=2, batch_size=32, expect_peers=2 if machine_ranks else 3))
    procs = []
    for cfg in configs:
        cfg["out"] = str(workdir / f"peer{cfg['rank']}.pt")
        if cfg["rank"] == 0:
            cfg["initial_peers"] = []
        else:
            cfg["initial_peers_file"] = str(workdir / "peer0.pt.maddrs")
        path = workdir / f"peer{cfg['rank']}.json"
        path.write_text(json.dumps(cfg))
        procs.append(testing.start([str(PEER), str(path)], log=workdir / f"peer{cfg['rank']}.log"))
    try:
        deadline = time.monotonic() + args.timeout
        for cfg, proc in zip(configs, procs):
            while not Path(cfg["out"]).exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"peer {cfg['rank']} failed: see {workdir}")
                time.sleep(0.1)
        ranks, partner = procs[:2], procs[2:]
        # the ranks' own sockets are gloo's (the local link); a forked DHT process (and its p2pd) inherits them, so
        # a socket the rank process holds is never counted as the swarm's
        local = tcp_bytes_sent([p.pid for p in ranks])
        swarm_link = sum(v for k, v in tcp_bytes_sent(testing.processes_named(ranks, "p2pd")).items()
                         if k not in local)
        partner_link = sum(tcp_bytes_sent(testing.processes_named(partner, "p2pd")).values())
        local_link = sum(local.values())
        results = [torch.load(cfg["out"]) for cfg in configs]
        seen = [rep["num_peers"] for rep in results[2]["reports"] if not rep["caught_up"]]
    finally:
        for cfg in configs:
            Path(cfg["out"] + ".stop").touch()
        testing.kill(procs)
    params = sum(p.numel() for p in results[0]["params"])
    return dict(ranks_swarm_bytes=swarm_link, partner_swarm_bytes=partner_link, ranks_local_bytes=local_link,
                records=max(seen) if seen else 0, epochs=min(r["epoch"] for r in results), params=params)


# --- part 2: the local group alone --------------------------------------------------------------------------------
def _local_worker(rank: int, port: int, sizes: List[int], repeats: int, out: str) -> None:
    import torch.distributed as dist

    from swarm_opt.ranks import LocalGroup, _Link, _Ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    timings = {}
    for size in sizes:
        model = torch.nn.Linear(size // 16, 16, bias=False)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, size // 16)).sum().backward()
        inner.step()  # a momentum buffer: the state a round's broadcast carries

        class Opt:  # what the local group reads of a swarm optimizer
            _params = list(model.parameters())

        link = _Link(dist, dist.group.WORLD, 60.0)
        ranks = _Ranks.__new__(_Ranks)
        ranks.link, ranks.config, ranks._buffer = link, LocalGroup(), None
        state = {"params": Opt._params, "optimizer": inner.state_dict()}
        combine, message, broadcast, plain = [], [], [], []
        flat = torch.randn(size)
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(flat)  # the baseline: what DDP's backward pays for the same gradients
            plain.append(time.perf_counter() - t)
            model.weight.grad = torch.randn_like(model.weight)
            dist.barrier()
            t = time.perf_counter()
            ranks.combine(Opt, 16)
            combine.append(time.perf_counter() - t)
            header = torch.zeros(4, dtype=torch.float64)
            dist.barrier()
            t = time.perf_counter()
            link.broadcast(header, "bench")
            message.append(time.perf_counter() - t)
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                link.send_state(1.0, state, 0, "bench")
            else:
                received = torch.zeros(4, dtype=torch.float64)
                link.broadcast(received, "bench")
                link.receive_state(received[3].item(), "bench")
            broadcast.append(time.perf_counter() - t)
        timings[size] = dict(plain=quantiles(plain), combine=quantiles(combine), message=quantiles(message),
                             state=quantiles(broadcast))
    if rank == 0:
        Path(out).write_text(json.dumps(timings))
    dist.destroy_process_group()


def run_local(args: argparse.Namespace, workdir: Path) -> Dict[str, dict]:
    import torch.multiprocessing as mp

    out = workdir / "local.json"
    mp.start_processes(_local_worker, args=(_free_port(), [int(float(s)) for s in args.sizes], args.repeats,
                                            str(out)), nprocs=2, start_method="fork")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP 16-W-4 (part 1)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--sizes", nargs="+", default=["1e4", "1e5", "1e6"], help="parameters (part 2)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="ranks.json")
    args = parser.parse_args()
    started = time.time()
    work = RESULTS_DIR / "ranks_work"  # the peers' logs stay there (results/ is not committed)
    shutil.rmtree(work, ignore_errors=True)
    one = run_swarm(True, args, work / "machine")
    two = run_swarm(False, args, work / "peers")
    with tempfile.TemporaryDirectory() as tmp:
        local = run_local(args, Path(tmp))
    print(f"Part 1: two ranks (16 samples each per step) beside a partner, gradient averaging, MLP 16-{args.width}-4 "
          f"({one['params']} parameters, {one['params'] * 4 / 1e6:.2f} MB fp32), {args.epochs} epochs\n")
    print(table(["the two ranks as", "epochs", "records the partner counts", "their swarm bytes (MB)",
                 "partner's swarm bytes (MB)", "their local-link bytes (MB)"],
                [[label, r["epochs"], r["records"], f"{r['ranks_swarm_bytes'] / 1e6:.2f}",
                  f"{r['partner_swarm_bytes'] / 1e6:.2f}", f"{r['ranks_local_bytes'] / 1e6:.2f}"]
                 for label, r in (("one peer (LocalGroup)", one), ("two peers", two))]))
    ratio = one["ranks_swarm_bytes"] / max(1, two["ranks_swarm_bytes"])
    print(f"\nswarm bytes of the two ranks, one peer / two peers: {ratio:.2f}; records {one['records']} vs "
          f"{two['records']}\n")
    print("Part 2: the local group alone (2 processes, gloo on loopback), median ms (p90)\n")
    print(table(["parameters", "baseline: one all_reduce (DDP's)", "combine gradients (every step)",
                 "step message (every step)", "state broadcast (after a round)", "combine / baseline"],
                [[f"{int(size):,}", *(f"{t[k]['median'] * 1e3:.2f} ({t[k]['p90'] * 1e3:.2f})"
                                      for k in ("plain", "combine", "message", "state")),
                  f"{t['combine']['median'] / t['plain']['median']:.2f}"] for size, t in local.items()]))
    path = write_json(args.out, {"width": args.width, "epochs": args.epochs, "one_peer": one, "two_peers": two,
                                 "swarm_bytes_ratio": ratio, "local": local, "seconds": time.time() - started})
    print(f"\nwritten {path}; reproduce: {command_line()}")


if __name__ == "__main__":
    main()
