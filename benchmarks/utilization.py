"""Compute utilization across slow links: the share of wall time each peer spends computing.

Four peers, each on its own test host (a network namespace of this machine; ``tests/hosts.py``), on one bridge;
every host's outgoing link is limited by ``tc tbf`` to ``--rate`` (default 100 Mbit/s). A peer's compute is a fixed
sleep per step (``--step-seconds``) followed by fixed gradients, so that the machine's two cores are not what limits
the swarm: everything else a step takes (the optimizer, accumulation, a blocking round) is time not computing.

Workload: an MLP of ``--params`` parameters (default 2.5M: 10 MB in fp32), batch 32 per step, SGD, 0.1 s of
compute per step.
* gradient averaging: ``target_batch_size = 4 peers × --grad-steps × 32`` (one global step per 32 local steps of
  each peer by default: 3.2 s of compute), measured over ``--grad-rounds`` (8) global epochs;
* local updates / DiLoCo: one round per ``--local-steps`` (500, as OpenDiLoCo: 50 s of compute) local steps of each
  peer, measured over ``--local-rounds`` (2) rounds (DiLoCo: inner SGD, outer Nesterov SGD lr 0.7).
Both swarm_opt and ``hivemind.Optimizer`` (the peer our users would otherwise pick) run the same workloads:
hivemind's gradient averaging, with ``delay_optimizer_step`` + ``delay_grad_averaging`` as its overlap, and its
``use_local_updates``. Codecs: none and fp16 (hivemind's ``Float16Compression`` for hivemind), and PowerSGD rank 4
for swarm_opt's gradient averaging. System ``lane`` is swarm_opt with ``transport=swarm_opt.Gloo(host=...)``: its
rounds move over the gloo fast lane (each peer's lane on its test host's address) instead of hivemind's path.

Each peer measures from its first epoch change (the swarm has formed) to ``rounds`` epochs later:
utilization = seconds in the compute sleep / wall seconds, plus samples per round against the target (overlap lets
rounds grow when a round takes longer than an epoch's compute) and the seconds per round. Reported: the mean over the
four peers. The link is probed before the runs (a TCP stream between two hosts) and its measured rate is reported.

    python benchmarks/utilization.py                                   # all configurations, ~15 min
    python benchmarks/utilization.py --configs swarm_opt/grad/none swarm_opt/diloco/fp16 --rate 50mbit
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from _common import (
    join_loopback_swarm,
    kill_all,
    launch,
    leftovers,
    link_hosts,
    require_test_hosts,
    table,
    tail,
    write_json,
)

PEERS = 4
BATCH = 32
CONFIGS = [  # system/strategy/codec
    "swarm_opt/grad/none", "swarm_opt/grad/fp16", "swarm_opt/grad/powersgd4",
    "swarm_opt/grad+overlap/none", "swarm_opt/grad+overlap/fp16",
    "swarm_opt/local/fp16", "swarm_opt/diloco/none", "swarm_opt/diloco/fp16",
    "hivemind/grad/none", "hivemind/grad/fp16", "hivemind/grad+overlap/fp16", "hivemind/local/fp16",
    "lane/grad/none", "lane/grad+overlap/none", "lane/grad/powersgd4",
]


# --- worker ---------------------------------------------------------------------------------------------------------
def make_model(params: int):
    import torch

    hidden = max(1, params // (1024 + 10))  # Linear(1024, hidden) + Linear(hidden, 10)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def make_optimizer(args: argparse.Namespace, dht: Any, model: Any, target: int) -> Any:
    import hivemind
    import torch

    import swarm_opt

    system, strategy, codec = args.config.split("/")
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    common = dict(dht=dht, run_id="utilization", target_batch_size=target, batch_size_per_step=BATCH,
                  params=model.parameters(), optimizer=sgd, matchmaking_time=args.matchmaking_time,
                  averaging_timeout=args.averaging_timeout)
    if system in ("swarm_opt", "lane"):  # lane: swarm_opt with its rounds over the gloo lane (transport=Gloo)
        strategies = {
            "grad": swarm_opt.GradientAveraging, "local": swarm_opt.LocalUpdates,
            "grad+overlap": lambda: swarm_opt.GradientAveraging(overlap=swarm_opt.Overlap()),
            "diloco": lambda: swarm_opt.DiLoCo(
                outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)),
        }
        codecs = {"none": swarm_opt.NoCompression, "fp16": swarm_opt.Float16,
                  "powersgd4": lambda: swarm_opt.PowerSGD(rank=4)}
        transport = swarm_opt.Gloo(host=args.host) if system == "lane" else None
        return swarm_opt.Optimizer(strategy=strategies[strategy](), compression=codecs[codec](), transport=transport,
                                   **common)
    from hivemind.compression import Float16Compression, NoCompression

    compression = {"none": NoCompression(), "fp16": Float16Compression()}[codec]
    options = {"grad": {}, "local": dict(use_local_updates=True),
               "grad+overlap": dict(delay_optimizer_step=True, delay_grad_averaging=True, offload_optimizer=True)}
    return hivemind.Optimizer(grad_compression=compression, state_averaging_compression=compression,
                              verbose=False, **options[strategy], **common)


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    dht = join_loopback_swarm(workdir, args.rank, timeout=120, host=args.host)
    model = make_model(args.params)
    strategy = args.config.split("/")[1]
    steps = args.grad_steps if strategy.startswith("grad") else args.local_steps
    rounds = args.grad_rounds if strategy.startswith("grad") else args.local_rounds
    target = PEERS * steps * BATCH
    opt = make_optimizer(args, dht, model, target)
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]

    def epoch() -> int:
        return opt.local_epoch

    (workdir / f"ready{args.rank}").touch()
    deadline = time.monotonic() + 120
    while not (workdir / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    start_epoch, marks, computing, wall_start, longest = epoch(), [], 0.0, None, 0.0
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        began = time.perf_counter()
        time.sleep(args.step_seconds)  # the simulated forward and backward pass, which leaves the gradients:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        spent = time.perf_counter() - began
        before = epoch()
        stepped = time.perf_counter()
        opt.step()
        if wall_start is not None:
            computing += spent
            longest = max(longest, time.perf_counter() - stepped)
        if epoch() != before:
            marks.append((time.perf_counter(), epoch()))
            if wall_start is None:
                wall_start, first = time.perf_counter(), epoch()
            elif epoch() >= first + rounds:
                break
    wall = time.perf_counter() - wall_start if wall_start is not None else float("nan")
    epochs_measured = epoch() - first if wall_start is not None else 0
    result = dict(rank=args.rank, config=args.config, utilization=computing / wall if wall else None, wall=wall,
                  computing=computing, epochs=epochs_measured, start_epoch=start_epoch, marks=marks, target=target,
                  longest_step=longest, lane_rounds=getattr(getattr(opt, "_averager", None), "lane_rounds", None),
                  seconds_per_round=wall / epochs_measured if epochs_measured else None)
    (workdir / f"result{args.rank}.json").write_text(json.dumps(result))
    while not (workdir / "stop").exists():  # stay until every peer is done: a leaving peer stalls the others
        time.sleep(0.05)
    opt.shutdown()
    dht.shutdown()


# --- orchestrator ---------------------------------------------------------------------------------------------------
def run_config(args: argparse.Namespace, hosts: Any, config: str) -> Dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="swarm_util_"))
    logs = [workdir / f"worker{r}.log" for r in range(PEERS)]
    procs = []
    try:
        for rank in range(PEERS):
            worker_args = [str(Path(__file__).resolve()), "--worker", "--rank", str(rank), "--workdir", str(workdir),
                           "--host", hosts.address(rank), "--config", config, *args.passthrough]
            procs.append(launch(worker_args, logs[rank], {"OMP_NUM_THREADS": "1"},
                                prefix=hosts.prefix(rank)))
        deadline = time.monotonic() + 180
        while not all((workdir / f"ready{r}").exists() for r in range(PEERS)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"a worker exited early:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not start in 180 s:\n" + "\n".join(tail(log, 10) for log in logs))
            time.sleep(0.1)
        (workdir / "go").touch()
        deadline = time.monotonic() + args.max_seconds + 120
        while not all((workdir / f"result{r}.json").exists() for r in range(PEERS)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None and proc.returncode != 0:
                    raise RuntimeError(f"a worker failed:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not finish:\n" + "\n".join(tail(log, 10) for log in logs))
            time.sleep(0.2)
        (workdir / "stop").touch()
        results = [json.loads((workdir / f"result{r}.json").read_text()) for r in range(PEERS)]
        noisy = [r for r, log in enumerate(logs) if "Traceback" in log.read_text(errors="replace")]
        return dict(config=config, peers=results, tracebacks_in_logs=noisy)
    except RuntimeError as e:
        return dict(config=config, failed=str(e)[-3000:])
    finally:
        time.sleep(1.0)
        kill_all(procs)
        left = leftovers(procs)
        if left:
            print(f"  warning: leftover processes {left}", file=sys.stderr)


def summarize(run: Dict[str, Any]) -> List[Any]:
    system, strategy, codec = run["config"].split("/")
    if "failed" in run:
        return [system, strategy, codec, "failed", "-", "-", "-", "-", "-", "-"]
    peers = run["peers"]
    done = [p for p in peers if p["utilization"] is not None and p["epochs"]]
    if not done:
        return [system, strategy, codec, "no rounds", "-", "-", "-", "-", "-", "-"]
    util = sum(p["utilization"] for p in done) / len(done)
    per_round = sum(p["seconds_per_round"] for p in done) / len(done)
    # samples per round: 4 peers × (steps between rounds) × batch, from each peer's compute time per round
    steps_per_round = sum(p["computing"] / p["epochs"] for p in done) / len(done) / run["step_seconds"]
    samples = PEERS * steps_per_round * BATCH
    longest = max(p.get("longest_step", float("nan")) for p in done)
    return [system, strategy, codec, f"{100 * util:.1f} %", f"{per_round:.2f}", f"{samples / done[0]['target']:.2f}x",
            f"{longest:.2f}", f"{min(p['epochs'] for p in done)}", f"{min(p['utilization'] for p in done) * 100:.1f} %",
            "-" if system != "lane" else f"{min(p.get('lane_rounds') or 0 for p in done)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="system/strategy/codec triples")
    parser.add_argument("--rate", default="100mbit", help="each host's outgoing link (tc tbf rate)")
    parser.add_argument("--params", type=int, default=2_500_000)
    parser.add_argument("--step-seconds", type=float, default=0.1, help="simulated compute per step")
    parser.add_argument("--grad-steps", type=int, default=32, help="local steps per global step (gradient averaging)")
    parser.add_argument("--grad-rounds", type=int, default=8)
    parser.add_argument("--local-steps", type=int, default=500,
                        help="local steps per round (local updates, DiLoCo; OpenDiLoCo uses 500)")
    parser.add_argument("--local-rounds", type=int, default=2)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--averaging-timeout", type=float, default=60.0)
    parser.add_argument("--max-seconds", type=float, default=240.0, help="a run's time limit")
    parser.add_argument("--out", default="utilization.json", help="the JSON's name under benchmarks/results/")
    args = parser.parse_args()
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "params", "step_seconds", "grad_steps", "grad_rounds", "local_steps", "local_rounds", "matchmaking_time",
        "averaging_timeout", "max_seconds")]
    if args.worker:
        worker(args)
        return

    require_test_hosts()
    hosts = link_hosts(PEERS, args.rate)
    runs: List[Dict[str, Any]] = []
    started = time.time()
    try:
        link = hosts.measure_link()
        print(f"{PEERS} hosts, links limited to {args.rate}: one TCP stream measured at {link:.1f} Mbit/s")
        for config in args.configs:
            t0 = time.time()
            run = dict(run_config(args, hosts, config), step_seconds=args.step_seconds)
            runs.append(run)
            print(f"  {config}: {summarize(run)[3]} utilization, {time.time() - t0:.0f} s", flush=True)
    finally:
        hosts.close()
    headers = ["system", "strategy", "codec", "utilization (mean of peers)", "s / round", "samples / round vs target",
               "longest step() s", "rounds measured", "lowest peer", "lane rounds (fewest of peers)"]
    print(f"\nUtilization, 4 peers on {args.rate} links ({link:.0f} Mbit/s measured), {args.params / 1e6:.1f}M params, "
          f"{args.step_seconds:.2f} s compute per step; gradient averaging: a global step per {args.grad_steps} local "
          f"steps, local updates/DiLoCo: a round per {args.local_steps} local steps")
    print(table(headers, [summarize(run) for run in runs]))
    path = write_json(args.out, dict(rate=args.rate, link_mbit_s=link, params=args.params,
                                               step_seconds=args.step_seconds, runs=runs,
                                               seconds=time.time() - started))
    print(f"wrote {path}\nreproduce: python benchmarks/utilization.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
