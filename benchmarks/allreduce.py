"""All-reduce throughput: ``swarm_opt._hivemind.tensor_averager.TensorAverager`` against ``torch.distributed`` gloo,
same run.

For every peer count the script starts that many worker processes (this script with ``--worker``, each in its own
session so that its p2pd daemon and averager process can be killed as a group). The workers join one hivemind DHT
and one gloo process group; the gloo group also serves as the barrier that lines the peers up before each timed call.
For each tensor size they time, taking turns within each repetition:

* gloo: ``dist.all_reduce(t); t.div_(world)`` (the average, in place);
* gloo+copy: the same after ``t.copy_(values)`` in the timed call: the copy that a data-parallel trainer makes of its
  gradients into a flat bucket (torch DDP, and torchft on top of it) and that swarm_opt's ``write`` makes (a failed
  round leaves the strategy's values as they were); "vs gloo+copy" is swarm_opt's median throughput over this one's
  (context only: the goals are set against gloo alone);
* swarm_opt: matchmaking is started ahead (``TensorAverager.schedule``) and timed separately until the group is
  formed; then ``TensorAverager.all_reduce(write, weight=1)`` is timed: ``write`` copies ``t`` into the averager's
  shared buffer (as a strategy's ``write_round`` does), then the finiteness checks and the butterfly all-reduce
  through p2pd; the mean is read as a view of the buffer (``result.averaged``), with no copy back. The codec is
  ``swarm_opt.NoCompression()``, the optimizer's default.

A call's time is the slowest peer's. Throughput is the tensor's size divided by that time (MB = 10^6 bytes). The
averaged values are checked against the exact mean once per size and variant. "MB/s ratio" is swarm_opt's median
throughput over gloo's; "paired ratio" is the median over repetitions of gloo's time over swarm_opt's in the same
repetition (the two agree when the machine's load is steady).

    python benchmarks/allreduce.py                               # 1M, 10M, 50M float32 among 2 and 4 peers
    python benchmarks/allreduce.py --sizes 1e6 1e7 --peers 2 --reps 5
    python benchmarks/allreduce.py --sizes 1e7 5e7 --peers 2 4 --helpers 0 1 --codecs none fp16 powersgd4
    python benchmarks/allreduce.py --sizes 1e6 1e7 --peers 2 4 --lane         # gloo, hivemind's path, the lane

Tensors are ``(size / 1000) x 1000`` matrices. ``--codecs`` runs one averager per codec (``CODECS``) in the same
workers, taking turns with gloo in every repetition; a lossy codec's "max err" is its error against the exact mean.
``--helpers 0 1`` runs every peer count twice: without and with one auxiliary peer (``TensorAverager(auxiliary=
True)``, as ``swarm_opt.AuxiliaryPeer`` builds it: a helper process on the same machine that reduces a share of
every round and contributes nothing); the time is still the slowest trainer's.

``--lane`` runs every averager (of a codec the lane carries: none, fp16, PowerSGD) a second time over the gloo lane
(``TensorAverager(lane=swarm_opt.Gloo(host="127.0.0.1"))``, as ``Optimizer(transport=...)`` builds it), taking turns
with gloo and hivemind's path in every repetition. "lane rounds" counts the timed rounds that went over the lane on
every member; "lane setup ms" is the time the member that began the round last took to meet the group on the
rendezvous store (exchanging weights) and find its cached process group: the lane's own cost per round, without the
wait for groupmates that began earlier (the first round of a group, which creates it, is the warm-up).

``--link RATE`` puts every worker on a test host of its own (a network namespace of this machine, ``tests/hosts.py``;
needs root) whose outgoing link ``tc tbf`` limits to RATE (``100mbit``, ``1gbit``): gloo, hivemind's path and the
lane then move their bytes through links slower than the CPU, as between machines. The link is measured first (one
TCP stream). ``--lane-codecs`` names the codecs to run over the lane (instead of ``--lane``'s every ``--codecs``
entry), e.g. the lane's three beside hivemind's uncompressed path:

    python benchmarks/allreduce.py --link 100mbit --peers 4 --sizes 1e7 --reps 3 --codecs none \\
        --lane-codecs none fp16 powersgd4

Tuning experiments (none of this is needed to reproduce the table):

* ``--engine-opt KEY=VALUE`` overrides an argument of hivemind's ``DecentralizedAverager`` as ``TensorAverager``
  builds it (``part_size_bytes``, ``next_chunk_timeout``, ``min_vector_size``...; ``prefetch`` goes to the
  all-reduce's ``TensorPartContainer``; ``mmap_threshold=N`` calls glibc's ``mallopt`` in the averager process so
  that buffers up to N bytes come from the heap rather than from a fresh mmap each);
* ``--variant NAME:KEY=VALUE,...`` (repeatable) runs one averager per variant in the same workers; gloo and every
  variant take turns within each repetition, so that a change in the machine's load hits them alike, and the table
  adds each variant's time relative to the first one, per repetition;
* ``--no-tls`` starts p2pd without TLS (libp2p's Noise still encrypts);
* ``--trace`` adds each timed round's wall-clock window to the JSON (``benchmarks/profile_allreduce.py`` uses it).

    python benchmarks/allreduce.py --sizes 1e7 5e7 --variant default --variant p2m:part_size_bytes=2097152
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch
from _common import (  # also puts the repo on sys.path for swarm_opt
    RESULTS_DIR,
    command_line,
    kill_all,
    launch,
    leftovers,
    link_hosts,
    quantiles,
    require_test_hosts,
    table,
    wait_all,
    wait_for,
    write_json,
)

BYTES_PER_PARAM = 4
COLUMNS = 1000  # tensors are (size / 1000) x 1000 matrices, so that PowerSGD compresses them
CODECS = {  # name -> (label, constructor); PowerSGD's factors are averaged by a protocol of its own
    "none": ("NoCompression()", lambda so: so.NoCompression()), "fp16": ("Float16()", lambda so: so.Float16()),
    "int8": ("Int8Blockwise()", lambda so: so.Int8Blockwise()),
    "uniform8": ("Uniform8Bit()", lambda so: so.Uniform8Bit()),
    "powersgd4": ("PowerSGD(rank=4)", lambda so: so.PowerSGD(rank=4)),
    "powersgd1": ("PowerSGD(rank=1)", lambda so: so.PowerSGD(rank=1)),
}


def make_codec(name: str):
    import swarm_opt

    return CODECS[name][1](swarm_opt)


LANE_CODECS = ("none", "fp16", "powersgd4", "powersgd1")  # the codecs the gloo lane carries
ALLREDUCE_ONLY_OPTS = ("prefetch",)  # options of the all-reduce, not of the averager's constructor
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def parse_engine_opts(items: List[str]) -> Dict[str, Any]:
    """``["part_size_bytes=4194304", "sender_timeout=None"]`` -> ``{"part_size_bytes": 4194304, ...}``."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-opt expects KEY=VALUE, got {item!r}")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def parse_variant(spec: str) -> Tuple[str, Dict[str, Any]]:
    """``"p2m:part_size_bytes=2097152,prefetch=2"`` -> ``("p2m", {"part_size_bytes": 2097152, "prefetch": 2})``;
    ``codec=fp16`` picks the codec (``CODECS``)."""
    name, _, options = spec.partition(":")
    return name, parse_engine_opts([item for item in options.split(",") if item])


def variants_of(args: argparse.Namespace) -> List[Tuple[str, Dict[str, Any]]]:
    """The averagers every worker runs: ``--variant`` experiments, then one per ``--codecs`` entry; with ``--lane``,
    each of those again over the gloo lane (codecs it carries only)."""
    variants = [parse_variant(v) for v in args.variant] + [(c, {"codec": c}) for c in args.codecs]
    variants = variants or [("default", {})]
    if args.lane_codecs:
        variants += [(f"lane-{codec}", {"codec": codec, "lane": True}) for codec in args.lane_codecs]
    elif args.lane:
        variants += [(f"lane-{name}" if name != "default" else "lane", {**options, "lane": True})
                     for name, options in variants if options.get("codec", "none") in LANE_CODECS]
    return variants


@contextlib.contextmanager
def engine_options(options: Dict[str, Any]) -> Iterator[None]:
    """While active, ``TensorAverager`` builds its hivemind averager with ``options`` (benchmark experiments only)."""
    from swarm_opt._hivemind import tensor_averager as averaging

    if not options:
        yield
        return
    options = dict(options)
    mmap_threshold = options.pop("mmap_threshold", None)
    constructor_opts = {k: v for k, v in options.items() if k not in ALLREDUCE_ONLY_OPTS}
    allreduce_opts = {k: v for k, v in options.items() if k in ALLREDUCE_ONLY_OPTS}
    base = averaging._Engine

    class TunedEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **constructor_opts})
            self.allreduce_kwargs.update(allreduce_opts)

        def run(self) -> None:  # in the averager process
            if mmap_threshold:  # serve big buffers from the heap, not from fresh (page-faulting) mmaps each time
                import ctypes

                libc = ctypes.CDLL("libc.so.6")
                libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))
                libc.mallopt(M_TRIM_THRESHOLD, 8 * int(mmap_threshold))
            super().run()

    averaging._Engine = TunedEngine
    try:
        yield
    finally:
        averaging._Engine = base


# --- worker ---------------------------------------------------------------------------------------------------------
def make_averager(dht: Any, world: int, size: int, name: str, options: Dict[str, Any], engine_opts: Dict[str, Any],
                  timeouts: Any, template: Any, auxiliary: bool = False, host: str = "127.0.0.1") -> Any:
    import swarm_opt
    from swarm_opt._hivemind.tensor_averager import TensorAverager

    options = dict(options)
    codec = make_codec(options.pop("codec", "none"))
    lane = swarm_opt.Gloo(host=host) if options.pop("lane", False) else None
    with engine_options({**engine_opts, **options}):
        return TensorAverager(dht, prefix=f"bench_allreduce_w{world}_n{size}_{name}", templates=[template],
                              timeouts=timeouts, compression=codec, auxiliary=auxiliary, lane=lane)


def helper(args: argparse.Namespace) -> None:
    """An auxiliary peer: for each size, one averager per variant that joins every round until rank 0 is done."""
    import logging
    import threading

    import hivemind
    import torch

    import swarm_opt

    logging.basicConfig(level=logging.WARNING, format=f"[helper {args.rank}] %(levelname)s %(name)s: %(message)s")
    tmp = Path(args.tmp)
    wait_for(tmp / "maddrs.json", 60, "rank 0 did not publish its DHT address")
    dht = hivemind.DHT(initial_peers=json.loads((tmp / "maddrs.json").read_text()),
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    timeouts = swarm_opt.Timeouts(matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)
    engine_opts = parse_engine_opts(args.engine_opt)
    try:
        for size in args.sizes:
            done = tmp / f"done{size}"
            template = torch.zeros(size // COLUMNS, COLUMNS)
            # as swarm_opt.AuxiliaryPeer: no helper for a codec with a protocol of its own (PowerSGD's two phases)
            averagers = [make_averager(dht, args.world, size, name, options, engine_opts, timeouts, template,
                                       auxiliary=True) for name, options in variants_of(args)
                         if make_codec(options.get("codec", "none")).elementwise]

            def serve(averager: Any, done: Path = done) -> None:
                while not done.exists():
                    averager.all_reduce(lambda buffers: None, 0.0, 0, done.exists)

            threads = [threading.Thread(target=serve, args=(a,), daemon=True) for a in averagers]
            for thread in threads:
                thread.start()
            (tmp / f"helper{args.rank}_ready{size}").touch()
            for thread in threads:
                thread.join()
            for averager in averagers:
                averager.shutdown()
    finally:
        dht.shutdown()


def worker(args: argparse.Namespace) -> None:
    import logging

    import hivemind
    import torch.distributed as dist
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    import swarm_opt

    logging.basicConfig(level=logging.WARNING, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    rank, world, host = args.rank, args.world, args.host
    engine_opts = parse_engine_opts(args.engine_opt)
    variants = variants_of(args)
    dht_opts = {"tls": False} if args.no_tls else {}
    maddrs_file = Path(args.tmp) / "maddrs.json"
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], start=True, **dht_opts)
        tmp_file = maddrs_file.with_suffix(".tmp")
        tmp_file.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        os.replace(tmp_file, maddrs_file)
    else:
        deadline = time.monotonic() + 60
        while not maddrs_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 did not publish its DHT address within 60 s")
            time.sleep(0.05)
        dht = hivemind.DHT(initial_peers=json.loads(maddrs_file.read_text()), host_maddrs=[f"/ip4/{host}/tcp/0"],
                           start=True, **dht_opts)
    # rank 0's address hosts the baseline's rendezvous (on --link runs, gloo's own device is eth0: GLOO_SOCKET_IFNAME)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=world)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def fastest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return float(t.item())

    def all_true(flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    timeouts = swarm_opt.Timeouts(matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)

    def measure(size: int) -> List[dict]:
        """Time gloo and every variant on a tensor of ``size`` float32 values; one entry per variant."""
        results: List[dict] = []
        base = torch.randn(size // COLUMNS, COLUMNS, generator=torch.Generator().manual_seed(0))
        original = base + rank  # peers differ by a constant: the exact mean is base + (world - 1) / 2
        expected_shift = (world - 1) / 2
        tensor = original.clone()
        entry = {"size": size, "mb": size * BYTES_PER_PARAM / 1e6, "world": world, "helpers": args.helpers}

        def write(buffers: List[torch.Tensor]) -> None:  # what a strategy's write_round does
            buffers[0].copy_(original)

        def gloo_round(copy: bool = False) -> float:
            """gloo's average in place; with ``copy``, of a copy of the values made in the timed call, as a
            data-parallel trainer copies its gradients into a flat bucket (DDP) and swarm_opt's ``write`` does."""
            if not copy:
                tensor.copy_(original)
            dist.barrier()
            start = time.perf_counter()
            if copy:
                tensor.copy_(original)
            dist.all_reduce(tensor)
            tensor.div_(world)
            return slowest(time.perf_counter() - start)

        def swarm_round(averager: Any, i: int) -> Tuple[float, float, Any, Tuple[float, float]]:
            dist.barrier()
            start = time.perf_counter()
            averager.schedule(get_dht_time(), round_id=i)
            control = averager._scheduled  # benchmark-only peek: is the group formed yet?
            while control is not None and control.stage in (AveragingStage.IDLE,
                                                            AveragingStage.LOOKING_FOR_GROUP):
                time.sleep(0.002)
            matchmaking = slowest(time.perf_counter() - start)
            wall_start, start = time.time(), time.perf_counter()
            result = averager.all_reduce(write, 1.0, round_id=i)
            elapsed = slowest(time.perf_counter() - start)
            return matchmaking, elapsed, result, (wall_start, wall_start + elapsed)

        averagers: Dict[str, Any] = {}
        stats = {name: {"mm": [], "ar": [], "groups": [], "failures": 0, "windows": [], "paired": {}, "setup": [],
                        "lane_rounds": 0}
                 for name, _ in variants}
        gloo_times, gloo_copy_times = [], []
        try:
            for name, options in variants:
                averagers[name] = make_averager(dht, world, size, name, options, engine_opts, timeouts, tensor,
                                                host=host)
            if rank == 0:  # the helpers' averagers of this size are up too
                for h in range(args.helpers):
                    wait_for(Path(args.tmp) / f"helper{h}_ready{size}", 120, f"helper {h} did not start")
            dist.barrier()  # every averager process is up before the first matchmaking
            names = list(averagers)
            for i in range(args.warmup + args.reps):
                # gloo and each variant run back to back in every repetition (variants in rotating order), so
                # that a change in the machine's load hits them alike; ratios are also taken per repetition
                elapsed = gloo_round()
                if i == 0:
                    entry["gloo_max_error"] = float((tensor - base - expected_shift).abs().max())
                copied = gloo_round(copy=True)
                if i >= args.warmup:
                    gloo_times.append(elapsed)
                    gloo_copy_times.append(copied)
                for name in names[i % len(names):] + names[:i % len(names)]:
                    st = stats[name]
                    lane_rounds = averagers[name].lane_rounds
                    matchmaking, elapsed, result, window = swarm_round(averagers[name], i)
                    size_ok = all_true(result is not None and result.group_size == world)
                    on_lane = all_true(averagers[name].lane_rounds > lane_rounds)  # every member's round was
                    if on_lane and i >= args.warmup:
                        st["lane_rounds"] += 1
                        # the member that arrived last waits for nobody: its setup is the lane's own cost
                        st["setup"].append(fastest(averagers[name].lane_setup_seconds))
                    if size_ok and "max_error" not in st:  # the first round of the full group
                        st["max_error"] = float((result.averaged[0] - base - expected_shift).abs().max())
                    if i >= args.warmup:
                        st["windows"].append(window)
                        if size_ok:
                            st["mm"].append(matchmaking)
                            st["ar"].append(elapsed)
                            st["paired"][i] = elapsed
                        else:
                            st["failures"] += 1
                        st["groups"].append(0 if result is None else result.group_size)
        finally:
            for averager in averagers.values():
                averager.shutdown()
            if rank == 0:
                (Path(args.tmp) / f"done{size}").touch()  # the helpers move on
        first = stats[variants[0][0]]["paired"]
        gloo_by_rep = dict(zip(range(args.warmup, args.warmup + args.reps), gloo_times))
        for name, options in variants:
            st = stats[name]
            e = dict(entry, variant=name, engine_opts={**engine_opts, **options}, gloo_s=quantiles(gloo_times),
                     gloo_copy_s=quantiles(gloo_copy_times))
            e["swarm_matchmaking_s"] = quantiles(st["mm"]) if st["mm"] else None
            e["swarm_allreduce_s"] = quantiles(st["ar"]) if st["ar"] else None
            e["swarm_group_sizes"] = st["groups"]
            e["swarm_failed_rounds"] = st["failures"]
            e["lane_rounds"] = st["lane_rounds"]  # timed rounds that went over the gloo lane
            e["lane_setup_s"] = quantiles(st["setup"]) if st["setup"] else None  # the last member's, per round
            if "max_error" in st:
                e["swarm_max_error"] = st["max_error"]
            # per repetition: gloo time / this variant's time, and this variant's time / the first variant's
            ratios = [gloo_by_rep[i] / t for i, t in st["paired"].items()]
            e["paired_ratio_to_gloo"] = quantiles(ratios) if ratios else None
            vs_first = [t / first[i] for i, t in st["paired"].items() if i in first]
            e["paired_time_vs_first"] = quantiles(vs_first) if vs_first else None
            if args.trace:
                e["swarm_windows"] = st["windows"]
            results.append(e)
            if rank == 0:
                print(f"size {size} {name}: gloo {e['gloo_s']['median']:.3f} s, swarm_opt "
                      f"{e['swarm_allreduce_s']['median'] if st['ar'] else float('nan'):.3f} s", flush=True)
        return results

    results = []
    try:
        for size in args.sizes:
            results.extend(measure(size))
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


def run_world(args: argparse.Namespace, world: int, helpers: int, tmp: Path) -> List[dict]:
    run_dir = tmp / f"world{world}_helpers{helpers}"
    run_dir.mkdir()
    result_file = run_dir / "result.json"
    port = free_port()
    procs, logs = [], []
    hosts, link_mbit_s = None, None
    if args.link:  # one test host (network namespace) per worker, each one's outgoing link limited by tc tbf
        hosts = link_hosts(world, args.link)
    address = (lambda rank: hosts.address(rank)) if hosts else (lambda rank: "127.0.0.1")
    try:
        if hosts:
            link_mbit_s = hosts.measure_link()
            print(f"  {world} test hosts, links limited to {args.link}: one TCP stream measured at "
                  f"{link_mbit_s:.1f} Mbit/s", flush=True)
        for rank in range(world):
            log = run_dir / f"rank{rank}.log"
            worker_args = [__file__, "--worker", "--rank", str(rank), "--world", str(world), "--port", str(port),
                           "--tmp", str(run_dir), "--result", str(result_file), "--sizes", *map(str, args.sizes),
                           "--host", address(rank), "--master", address(0),
                           "--reps", str(args.reps), "--warmup", str(args.warmup),
                           "--matchmaking-time", str(args.matchmaking_time),
                           "--averaging-timeout", str(args.averaging_timeout), "--helpers", str(helpers),
                           *(["--trace"] if args.trace else []), *(["--no-tls"] if args.no_tls else []),
                           *(["--lane"] if args.lane else []),
                           *(["--lane-codecs", *args.lane_codecs] if args.lane_codecs else []),
                           *[a for opt in args.engine_opt for a in ("--engine-opt", opt)],
                           *[a for variant in args.variant for a in ("--variant", variant)],
                           *(["--codecs", *args.codecs] if args.codecs else [])]
            env = {"OMP_NUM_THREADS": str(args.threads), **({"GLOO_SOCKET_IFNAME": "eth0"} if hosts else {})}
            procs.append(launch(worker_args, log, env_extra=env, prefix=hosts.prefix(rank) if hosts else ()))
            logs.append(log)
        for h in range(helpers):
            log = run_dir / f"helper{h}.log"
            helper_args = [__file__, "--helper", "--rank", str(h), "--world", str(world), "--tmp", str(run_dir),
                           "--sizes", *map(str, args.sizes), "--matchmaking-time", str(args.matchmaking_time),
                           "--averaging-timeout", str(args.averaging_timeout),
                           *[a for opt in args.engine_opt for a in ("--engine-opt", opt)],
                           *[a for variant in args.variant for a in ("--variant", variant)],
                           *(["--codecs", *args.codecs] if args.codecs else [])]
            procs.append(launch(helper_args, log, env_extra={"OMP_NUM_THREADS": str(args.threads)}))
            logs.append(log)
        wait_all(procs[:world], timeout=args.timeout, logs=logs[:world])  # helpers are stopped, not awaited
    finally:
        kill_all(procs)
        left = leftovers(procs)
        if left:
            print(f"WARNING: processes left behind: {left}", file=sys.stderr)
        if hosts:
            hosts.close()
    return [dict(e, link=args.link, link_mbit_s=link_mbit_s) for e in json.loads(result_file.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=lambda s: int(float(s)), default=[1_000_000, 10_000_000, 50_000_000],
                        help="number of float32 parameters (1e6 style accepted)")
    parser.add_argument("--peers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--helpers", nargs="+", type=int, default=[0],
                        help="auxiliary peers (swarm_opt.AuxiliaryPeer's mode) added to each swarm, e.g. 0 1")
    parser.add_argument("--codecs", nargs="+", default=[], choices=sorted(CODECS),
                        help="one averager per codec (default: NoCompression only)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per size and method")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--averaging-timeout", type=float, default=120.0)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per peer count")
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="override an argument of hivemind's averager (experiments), e.g. part_size_bytes=4194304")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME[:KEY=VALUE,...]",
                        help="an averager with these --engine-opt settings; all variants and gloo take turns in "
                             "every repetition (experiments; default: one averager as swarm_opt builds it)")
    parser.add_argument("--no-tls", action="store_true", help="start p2pd without TLS (experiments)")
    parser.add_argument("--lane", action="store_true",
                        help="also run every averager over the gloo lane (swarm_opt.Gloo), in the same workers")
    parser.add_argument("--lane-codecs", nargs="+", default=[], choices=LANE_CODECS,
                        help="run these codecs over the gloo lane (instead of --lane's every --codecs entry)")
    parser.add_argument("--link", metavar="RATE",
                        help="run each worker on a test host of its own (a network namespace, tests/hosts.py) whose "
                             "outgoing link tc tbf limits to RATE, e.g. 100mbit or 1gbit (needs root; no helpers)")
    parser.add_argument("--trace", action="store_true", help="record each timed round's wall-clock window")
    parser.add_argument("--out", default="allreduce.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--helper", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)  # this worker's address
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)  # rank 0's address
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.helpers = args.helpers[0]  # this world's helper count
        return worker(args)
    if args.helper:
        return helper(args)

    if args.link:
        require_test_hosts("--link")
        if args.helpers != [0]:
            raise SystemExit("--link runs no helpers: drop --helpers")
    print(f"command: {command_line()}", flush=True)
    rows, all_results = [], []
    with tempfile.TemporaryDirectory(prefix="swarm_allreduce_") as tmp:
        for world in args.peers:
            for helpers in args.helpers:
                started = time.monotonic()
                entries = run_world(args, world, helpers, Path(tmp))
                print(f"  {world} peers + {helpers} helper(s) done in {time.monotonic() - started:.0f} s",
                      flush=True)
                all_results.extend(entries)
    variants = [name for name, _ in variants_of(args)]
    lane = any(options.get("lane") for _, options in variants_of(args))  # lane columns
    nan = float("nan")
    for e in all_results:
        gloo = e["gloo_s"]["median"]
        ar = e["swarm_allreduce_s"]
        swarm = ar["median"] if ar else nan
        mm = e["swarm_matchmaking_s"]["median"] if e["swarm_matchmaking_s"] else nan
        e["gloo_mb_s"] = e["mb"] / gloo
        e["swarm_mb_s"] = e["mb"] / swarm
        e["throughput_ratio_to_gloo"] = e["swarm_mb_s"] / e["gloo_mb_s"]
        e["throughput_ratio_to_gloo_copy"] = e["gloo_copy_s"]["median"] / swarm
        paired = e["paired_ratio_to_gloo"]["median"] if e["paired_ratio_to_gloo"] else nan
        vs_first = e["paired_time_vs_first"]["median"] if e["paired_time_vs_first"] else nan
        rows.append([e["world"], e["helpers"], f"{e['size'] / 1e6:g}M", f"{e['mb']:.0f}",
                     *([e["variant"]] if len(variants) > 1 else []), f"{gloo:.3f}", f"{e['gloo_mb_s']:.0f}",
                     f"{swarm:.3f}", f"{ar['iqr'] if ar else nan:.3f}", f"{e['swarm_mb_s']:.0f}",
                     f"{e['throughput_ratio_to_gloo']:.3f}", f"{paired:.3f}",
                     f"{e['throughput_ratio_to_gloo_copy']:.3f}",
                     *([f"{vs_first:.2f}"] if len(variants) > 1 else []), f"{swarm / gloo:.1f}x", f"{mm:.2f}",
                     e["swarm_failed_rounds"], f"{e.get('swarm_max_error', nan):.1e}",
                     *([f"{e['lane_rounds']}", f"{e['lane_setup_s']['median'] * 1e3:.1f}" if e["lane_setup_s"]
                        else "-"] if lane else [])])
    print()
    if args.link:
        print("links: " + ", ".join(sorted({f"{e['world']} peers {e['link_mbit_s']:.1f} Mbit/s measured"
                                            for e in all_results})) + f" (tc tbf {args.link})")
    # MB/s ratio: ratio of the medians; paired ratio: median over repetitions of gloo's time / swarm_opt's time in
    # the same repetition (robust to load that changes during the run); time vs first: the same against the first
    # variant
    print(table(["peers", "helpers", "params", "MB", *(["variant"] if len(variants) > 1 else []), "gloo s", "gloo MB/s",
                 "swarm_opt s", "IQR s", "swarm_opt MB/s", "MB/s ratio", "paired ratio", "vs gloo+copy",
                 *([f"time vs {variants[0]}"] if len(variants) > 1 else []), "slowdown", "matchmaking s", "failed",
                 "max err", *(["lane rounds", "lane setup ms"] if lane else [])], rows))
    path = write_json(args.out, {"benchmark": "allreduce", "reps": args.reps, "warmup": args.warmup,
                                 "matchmaking_time": args.matchmaking_time, "worker_threads": args.threads,
                                 "link": args.link,
                                 "engine_opts": parse_engine_opts(args.engine_opt), "tls": not args.no_tls,
                                 "variants": [{"name": n, "engine_opts": o} for n, o in variants_of(args)],
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
    variants = list(dict.fromkeys(e["variant"] for e in results))
    for world, helpers in sorted({(e["world"], e.get("helpers", 0)) for e in results}):
        for index, variant in enumerate(variants):
            es = sorted((e for e in results if e["world"] == world and e.get("helpers", 0) == helpers
                         and e["variant"] == variant), key=lambda e: e["size"])
            xs = [e["size"] / 1e6 for e in es]
            if index == 0 and helpers == 0:
                ax.plot(xs, [e["gloo_mb_s"] for e in es], "o--", label=f"gloo, {world} peers")
            label = (f"swarm_opt{'' if len(variants) == 1 else ' ' + variant}, {world} peers"
                     f"{f' + {helpers} helper(s)' if helpers else ''}")
            ax.plot(xs, [e["swarm_mb_s"] for e in es], "s-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("float32 parameters (millions)")
    ax.set_ylabel("tensor MB / s (median)")
    link = results[0].get("link") if results else None
    ax.set_title(f"All-reduce {f'over {link} links' if link else 'on loopback'}, 2-core CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS_DIR / name
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    sys.exit(main())
