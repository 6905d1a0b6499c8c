"""Byzantine peers on MNIST-5k: how far 1 or 2 attackers among 8 peers move gradient averaging, with the plain mean,
the default norm-bounded ``Mean()``, the robust aggregations (``swarm_opt.aggregation``), with peers sending their
momentum (``GradientAveraging(momentum=WorkerMomentum(0.9))``), with audited reducers (``Audited``), and with reducers
that remember senders across rounds (``Reputation``; see ``Judges``).

Setup (kept small for a shared 2-core machine): MNIST-5k (``_common.load_mnist``: 4000 train / 1000 test), split IID
into 8 equal shards; MLP 784-64-10; gradient averaging with a global batch of 8 × ``--batch`` (32), SGD lr 0.1
momentum 0.9 (columns "+ momentum": every peer sends ``WorkerMomentum(0.9)``'s momentum of its gradients, computed by
the strategy's own ``send``/``advance``, and the inner SGD has lr 1.0 and no momentum: the same steps as lr 0.1 on an
undampened momentum), ``--epochs`` passes over the training set (default 4, ~60 global steps). Every global step,
each of the 8 peers computes its gradient at the shared parameters; the attackers replace what they send; the
reducer maths combine them exactly as a swarm's reducers do: the flattened values are cut into the parts a
``TensorAverager`` would use (a part never spans two tensors, about 1/16 of the model), and each part goes through
``swarm_opt.aggregation.reduce_part``. Every peer applies the same result (what the all-reduce guarantees), so one
model stands for all.

In-process, not 8 real peers: the maths per part are the reducer's own, and the swarm tests (tests/swarm/
test_byzantine.py) show the same code inside real all-reduces; 8 peer processes per run x 100 runs would not fit the
machine. ``--real`` measures instead what each aggregation costs a round in a real loopback swarm (seconds per round).

Attacks (weights: every attacker claims the same samples as an honest peer; what they attack is what they send, the
gradients or, with momentum, their momentum):
  sign      -v (its own honest values, sign flipped)
  x100      100 v
  noise     Gaussian noise, std 1 per coordinate (honest gradients are ~1e-2)
  nan       NaN everywhere (a broken peer; a real honest peer sits such rounds out, a hostile one sends them)
  alie      "a little is enough" (Baruch et al. 2019): every attacker sends mean - z·std of the honest values,
            coordinate-wise, z = 1
  alie-signs  the same shift with a fixed random sign per value (one that ``Reputation``'s shift score cannot see)
  reducer   the attackers send honest values and lie as reducers: each round's members are put in a random order
            (hivemind shuffles a group), part j is reduced by the (j mod n)-th member, and a lying reducer adds
            ``--lie`` (0.01) to every mean it returns, the same to everyone. Without ``Audited`` nothing notices.
            With it, every part is reduced a second time by the next member of the order
            (``swarm_opt._hivemind.allreduce.audit_order``), a round whose two results of any part differ fails
            (nothing is applied), and a member named a liar (``liars``: it disagreed with two partners) is left out
            of every later round, as the averager does for the length of such a run (its first ban: 10 minutes).

Reported: final test accuracy (mean over ``--seeds``) per attack, attackers and column, against the honest-only
run of the same column; and the reducer's compute per round (all parts of one global step) and per 2 MiB part
(8 senders), the cost each aggregation adds to a round.

    python benchmarks/byzantine.py                   # 6 attacks x {1, 2} attackers x 8 columns, 2 seeds
    python benchmarks/byzantine.py --epochs 2 --seeds 0 --settings "CenteredClip() + momentum"
    python benchmarks/byzantine.py --real            # seconds per round, 4 real peers (~10 min)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from _common import (  # also puts the repo on sys.path for swarm_opt
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

import swarm_opt
from swarm_opt._hivemind.allreduce import audit_order, liars
from swarm_opt.aggregation import Reputations, RoundScores, judge_part, left_out, reduce_part, reputation_of

PEERS = 8


@dataclass(frozen=True)
class Setting:
    """One column: the reducers' aggregation, and whether peers send their momentum (``WorkerMomentum``)."""

    aggregation: swarm_opt.Aggregation
    momentum: Optional[swarm_opt.WorkerMomentum] = None


SETTINGS: Dict[str, Setting] = {
    "plain mean": Setting(swarm_opt.Mean(max_norm_ratio=None)),
    "Mean() (norm-bounded)": Setting(swarm_opt.Mean()),
    "TrimmedMean(0.25)": Setting(swarm_opt.TrimmedMean(0.25)),
    "CenteredClip()": Setting(swarm_opt.CenteredClip()),
    "TrimmedMean(0.25) + momentum": Setting(swarm_opt.TrimmedMean(0.25), swarm_opt.WorkerMomentum(0.9)),
    "CenteredClip() + momentum": Setting(swarm_opt.CenteredClip(), swarm_opt.WorkerMomentum(0.9)),
    "CenteredClip(tau=1) + momentum": Setting(swarm_opt.CenteredClip(tau=1.0), swarm_opt.WorkerMomentum(0.9)),
    "Audited(CenteredClip()) + momentum": Setting(swarm_opt.Audited(swarm_opt.CenteredClip()),
                                                  swarm_opt.WorkerMomentum(0.9)),
    "Reputation(CenteredClip()) + momentum": Setting(swarm_opt.Reputation(swarm_opt.CenteredClip()),
                                                     swarm_opt.WorkerMomentum(0.9)),
    "Audited(Reputation(CenteredClip())) + momentum": Setting(
        swarm_opt.Audited(swarm_opt.Reputation(swarm_opt.CenteredClip())), swarm_opt.WorkerMomentum(0.9)),
}
AGGREGATIONS: Dict[str, swarm_opt.Aggregation] = {  # the reducer's compute per part
    "plain mean": swarm_opt.Mean(max_norm_ratio=None), "Mean() (norm-bounded)": swarm_opt.Mean(),
    "TrimmedMean(0.25)": swarm_opt.TrimmedMean(0.25), "CenteredClip()": swarm_opt.CenteredClip(),
    "Reputation(CenteredClip())": swarm_opt.Reputation(swarm_opt.CenteredClip())}


def attack_sign(g: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    return -g


def attack_x100(g: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    return 100 * g


def attack_noise(g: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(g)


def attack_nan(g: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    return torch.full_like(g, float("nan"))


def attack_alie(g: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    return honest.mean(0) - 1.0 * honest.std(0)


def attack_alie_signs(g: torch.Tensor, honest: torch.Tensor) -> torch.Tensor:
    """ALIE with a fixed random sign per value: evades ``Reputation``'s shift score (its mean shift is ~0)."""
    signs = torch.randint(0, 2, (g.numel(),), generator=torch.Generator().manual_seed(7)).float() * 2 - 1
    return honest.mean(0) - 1.0 * honest.std(0) * signs


ATTACKS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sign": attack_sign, "x100": attack_x100, "noise": attack_noise, "nan": attack_nan, "alie": attack_alie,
    "alie-signs": attack_alie_signs}
REDUCER_ATTACK = "reducer"  # the attackers send honest values and lie as reducers (see lying_reducers)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def part_bounds(model: torch.nn.Module) -> List[tuple]:
    """(start, end) of each part in the flattened gradient, cut as ``TensorAverager`` cuts: parts of about 1/16 of
    the model, never spanning two tensors."""
    sizes = [p.numel() for p in model.parameters()]
    part = max(256, sum(sizes) // 16)
    bounds, offset = [], 0
    for size in sizes:
        for start in range(0, size, part):
            bounds.append((offset + start, offset + min(size, start + part)))
        offset += size
    return bounds


def reduce(aggregation: swarm_opt.Aggregation, grads: torch.Tensor, bounds: Sequence[tuple],
           weights: Optional[List[float]] = None) -> torch.Tensor:
    """Every part through ``reduce_part``, as its reducer combines it (``weights``: every sender's, default 32)."""
    weights = [32.0] * len(grads) if weights is None else weights
    return torch.cat([reduce_part(aggregation, list(grads[:, a:b]), weights) for a, b in bounds])


class Judges:
    """``Reputation`` as the averager runs it: every peer's reducer keeps its own memory (``Reputations``) of the
    parts it reduces (each round part j goes to the (j mod n)-th member of a shuffled order), honest peers name in
    the gather whom they distrust, the attackers all name the first honest peer, and a sender that more than half of
    the members name counts with weight 0 (``left_out``)."""

    def __init__(self, reputation: swarm_opt.Reputation, attackers: int, seed: int) -> None:
        self.memories = [Reputations(reputation) for _ in range(PEERS)]
        self.attackers, self.orders = attackers, torch.Generator().manual_seed(seed + 1000)

    def weights(self, members: List[int]) -> List[float]:
        votes = [[self.attackers] if m < self.attackers else self.memories[m].distrusted() for m in members]
        out = left_out(members, votes)
        return [0.0 if m in out else 32.0 for m in range(PEERS)]

    def record(self, sent: torch.Tensor, result: torch.Tensor, bounds: Sequence[tuple], members: List[int],
               weights: List[float]) -> None:
        order = [members[i] for i in torch.randperm(len(members), generator=self.orders).tolist()]
        totals: Dict[int, RoundScores] = {}
        for j, (a, b) in enumerate(bounds):
            scores = judge_part(list(sent[members, a:b]), [weights[m] for m in members], result[a:b])
            totals.setdefault(order[j % len(order)], RoundScores()).add(members, scores, b - a)
        for reducer, scores in totals.items():
            self.memories[reducer].record(scores.means())


def lying_reducers(aggregation: swarm_opt.Aggregation, sent: torch.Tensor, bounds: Sequence[tuple],
                   members: List[int], attackers: int, g: torch.Generator, lie: float,
                   weights: Optional[List[float]] = None) -> tuple:
    """One round of ``members`` (peer ranks; ranks below ``attackers`` lie as reducers) in a random order, as
    hivemind shuffles a group: part ``j`` is reduced by the ``j % n``-th member of the order, and a liar adds
    ``lie`` to every mean it returns. ``Audited``: each part is reduced again by the next member of the order
    (``audit_order``), the round fails if any part's two results differ, and ``liars`` names who disagreed with two
    partners. Returns (the result or None for a failed round, the ranks named liars)."""
    order = [members[i] for i in torch.randperm(len(members), generator=g).tolist()]
    honest = reduce(aggregation, sent[members], bounds, None if weights is None else [weights[m] for m in members])
    results = [honest.clone() for _ in range(2)]
    audited = isinstance(aggregation, swarm_opt.Audited)
    second = audit_order(order, [1.0] * len(order)) if audited else order
    pairs = set()
    for j, (a, b) in enumerate(bounds):
        reducers = (order[j % len(order)], second[j % len(order)])
        for result, reducer in zip(results, reducers):
            if reducer < attackers:
                result[a:b] += lie
        if audited and aggregation.disagree(results[0][a:b], results[1][a:b]):
            pairs.add(reducers)
    return (None if pairs else results[0]), liars(pairs)


def run(setting: Setting, attack: Optional[str], attackers: int, seed: int, epochs: int, data: tuple,
        batch: int = 32, lie: float = 0.01) -> dict:
    x, y, xt, yt = data
    model = make_model(seed)
    params = list(model.parameters())
    # with momentum sent by the peers the inner optimizer has none: lr 1.0 on a momentum dampened by (1 - 0.9)
    # takes the steps of lr 0.1 on an undampened one
    opt = torch.optim.SGD(params, lr=1.0) if setting.momentum else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    bounds = part_bounds(model)
    g = torch.Generator().manual_seed(seed)
    shards = torch.randperm(len(x), generator=g).reshape(PEERS, -1)
    steps = epochs * shards.shape[1] // batch
    reduce_s: List[float] = []
    momentum: Optional[List[torch.Tensor]] = None  # every peer's, one row each
    members, failed = list(range(PEERS)), 0
    left = [0, 0]  # member-rounds left out by Reputation: honest, attackers
    orders = torch.Generator().manual_seed(seed)  # the groups' orders, apart from the batches
    reputation = reputation_of(setting.aggregation)
    judges = None if reputation is None else Judges(reputation, attackers if attack else 0, seed)
    for _ in range(steps):
        grads = []
        for rank in range(PEERS):
            idx = shards[rank, torch.randint(0, shards.shape[1], (batch,), generator=g)]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        stacked = torch.stack(grads)
        if setting.momentum is not None:  # the values each peer sends (the strategy's own maths)
            sent = torch.empty_like(stacked)
            setting.momentum.send(momentum, list(stacked), list(sent))
        else:
            sent = stacked
        if attack in ATTACKS:
            honest = sent[attackers:].clone()
            sent = sent.clone()
            for rank in range(attackers):
                sent[rank] = ATTACKS[attack](sent[rank], honest)
        t0 = time.perf_counter()
        weights = None if judges is None else judges.weights(members)
        if weights is not None:  # Reputation's verdicts: attackers are the ranks below `attackers`
            for rank in members:
                if weights[rank] == 0:
                    left[rank < attackers and attack is not None] += 1
        if attack == REDUCER_ATTACK:
            mean, named = lying_reducers(setting.aggregation, sent, bounds, members, attackers, orders, lie, weights)
            members = [m for m in members if m not in named]  # left out of every later group
        else:
            mean = reduce(setting.aggregation, sent, bounds, weights)
        reduce_s.append(time.perf_counter() - t0)
        if mean is None:  # an audited round that failed: nothing is applied, nothing advances
            failed += 1
            continue
        if judges is not None:  # each reducer judges against the result it computed (a liar's own lie aside)
            honest = mean if attack != REDUCER_ATTACK else reduce(setting.aggregation, sent[members], bounds,
                                                                  [weights[m] for m in members])
            judges.record(sent, honest, bounds, members, weights)
        if setting.momentum is not None:  # a committed round: every peer's own momentum advances
            momentum = setting.momentum.advance(momentum, list(stacked))
        offset = 0
        for p in params:
            p.grad = mean[offset:offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
        opt.step()
    with torch.no_grad():
        finite = all(bool(torch.isfinite(p).all()) for p in params)
        acc = float((model(xt).argmax(1) == yt).float().mean()) if finite else 0.0
    return {"accuracy": acc, "finite": finite, "steps": steps, "failed_rounds": failed,
            "left_out_honest": left[0], "left_out_attackers": left[1],
            "reduce_s_per_round": statistics.median(reduce_s)}


def part_cost(repeats: int = 5) -> Dict[str, float]:
    """Seconds to reduce one 2 MiB part (524,288 fp32 values) from 8 senders, median of ``repeats`` (``Reputation``:
    and to score the copies against the result)."""
    parts = list(torch.randn(PEERS, 2**19))
    out = {}
    for name, aggregation in AGGREGATIONS.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = reduce_part(aggregation, parts, [1.0] * PEERS)
            if reputation_of(aggregation) is not None:
                judge_part(parts, [1.0] * PEERS, result)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


# --- wall time per round in a real swarm (--real) --------------------------------------------------------------------
REAL_SETTINGS: Dict[str, Optional[swarm_opt.Aggregation]] = {
    "plain mean": swarm_opt.Mean(max_norm_ratio=None), "Mean() (default)": None,
    "TrimmedMean(0.25)": swarm_opt.TrimmedMean(0.25), "CenteredClip()": swarm_opt.CenteredClip(),
    "Audited(CenteredClip())": swarm_opt.Audited(swarm_opt.CenteredClip()),
    "Reputation(CenteredClip())": swarm_opt.Reputation(swarm_opt.CenteredClip()),
    "Audited(Reputation(CenteredClip()))": swarm_opt.Audited(swarm_opt.Reputation(swarm_opt.CenteredClip())),
}


def real_worker(args: argparse.Namespace) -> None:
    """One peer of the real swarm: for each setting in turn, ``--rounds`` rounds of gradient averaging of an MLP
    784-2048-1024-10 (3.7M parameters, batches of random data: the round's cost, not learning, is measured), one
    local step per peer per round; records each committed round's seconds (``RoundReport.seconds``: from the round's
    start to its commit, the all-reduce and the wait for the slowest member)."""
    logging.basicConfig(level=logging.WARNING, format=f"[peer {args.rank}] %(asctime)s %(levelname)s %(name)s: "
                                                      f"%(message)s")
    logging.getLogger("swarm_opt").setLevel(logging.INFO)
    torch.set_num_threads(1)
    tmp = Path(args.tmp)
    dht = join_loopback_swarm(tmp, args.rank)
    g = torch.Generator().manual_seed(args.rank)
    try:
        for index, name in enumerate(list(args.aggregations) * args.passes):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(784, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                                        torch.nn.ReLU(), torch.nn.Linear(1024, 10))
            opt = swarm_opt.Optimizer(
                dht=dht, run_id=f"byzantine_real{index}", target_batch_size=args.peers * 16, batch_size_per_step=16,
                params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                aggregation=REAL_SETTINGS[name], matchmaking_time=1.0, averaging_timeout=60.0,
                tracker=swarm_opt.TrackerConfig(max_extrapolation=0.0))
            try:
                deadline = time.monotonic() + 120
                while opt.progress.num_peers < args.peers and time.monotonic() < deadline:
                    time.sleep(0.05)
                rounds, last, stepped = [], None, False
                started = time.monotonic()
                while opt.local_epoch < args.rounds and time.monotonic() < started + 600:
                    opt.zero_grad()
                    x, y = torch.randn(16, 784, generator=g), torch.randint(0, 10, (16,), generator=g)
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    if stepped:  # this peer's share of the round is in: wait for the others without samples
                        model[-1].bias.grad.fill_(float("nan"))
                        time.sleep(0.01)
                    opt.step()
                    stepped = True
                    if opt.last_round is not last:
                        last, stepped = opt.last_round, False
                        rounds.append(dict(last.__dict__))
                (tmp / f"result{index}_{args.rank}.json").write_text(json.dumps(rounds))
                wait_for(tmp / f"done{index}", 900, "no stop signal")
            finally:
                opt.shutdown()
    finally:
        dht.shutdown()


def real(args: argparse.Namespace) -> None:
    """Seconds per round of each aggregation in a real loopback swarm of ``--peers`` processes, fresh processes for
    each aggregation and pass (an averager process forked from a worker that had already run other optimizers
    segfaulted twice in audited rounds: see NOTEBOOK.md)."""
    started = time.monotonic()
    results: Dict[str, dict] = {}
    seconds_of: Dict[str, List[float]] = {setting: [] for setting in args.aggregations}
    for setting in list(args.aggregations) * args.passes:
        with tempfile.TemporaryDirectory(prefix="byzantine_real_") as name:
            tmp = Path(name)
            logs = [tmp / f"peer{rank}.log" for rank in range(args.peers)]
            procs = [launch([__file__, "--worker", "--rank", str(rank), "--peers", str(args.peers), "--rounds",
                             str(args.rounds), "--passes", "1", "--tmp", str(tmp), "--aggregations", setting], log,
                            env_extra={"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
                     for rank, log in enumerate(logs)]
            try:
                paths = [tmp / f"result0_{rank}.json" for rank in range(args.peers)]
                for path, proc, log in zip(paths, procs, logs):
                    while not path.exists():
                        if proc.poll() is not None:
                            raise RuntimeError(f"a peer exited: {log.read_text()[-3000:]}")
                        time.sleep(0.1)
                (tmp / "done0").touch()
                rounds = [json.loads(path.read_text()) for path in paths]
                wait_all(procs, 120, logs)
            finally:
                stop_workers(procs, logs, keep_logs_as=Path(args.out).stem)
        # the first two rounds are warm-up (peers still meeting, first matchmaking)
        seconds_of[setting] += [r["seconds"] for peer in rounds for r in peer[2:] if not r["caught_up"]]
        previous = results.get(setting, {"group_sizes": [], "caught_up": 0})
        results[setting] = {"round_s": quantiles(seconds_of[setting]),
                            "group_sizes": previous["group_sizes"] + [r["group_size"] for peer in rounds for r in peer],
                            "caught_up": previous["caught_up"] + sum(r["caught_up"] for peer in rounds for r in peer)}
        print(f"  {setting}: median {results[setting]['round_s']['median']:.2f} s per round "
              f"[{time.monotonic() - started:.0f} s]", flush=True)
    base = results["plain mean"]["round_s"]["median"] if "plain mean" in results else float("nan")
    rows = [[name, f"{r['round_s']['median']:.2f}", f"{r['round_s']['iqr']:.2f}",
             f"{r['round_s']['median'] / base:.2f}x", r["round_s"]["n"], r["caught_up"]] for name, r in results.items()]
    print(f"\n{args.peers} real peers on loopback, MLP 784-2048-1024-10 (3.7M params), gradient averaging, "
          f"{args.passes} passes of {args.rounds} rounds per setting (first 2 of each dropped): seconds per round "
          f"(RoundReport.seconds: from the round's start to its commit)\n")
    print(table(["aggregation", "median s", "IQR s", "vs plain mean", "rounds", "caught up"], rows))
    path = write_json(args.out, {"benchmark": "byzantine_real", "args": vars(args), "results": results,
                                 "elapsed_s": time.monotonic() - started})
    print(f"wrote {path}\nreproduce: {command_line()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true",
                        help="instead: seconds per round of each aggregation in a real swarm of --peers processes")
    parser.add_argument("--peers", type=int, default=4, help="--real: peer processes")
    parser.add_argument("--rounds", type=int, default=10, help="--real: rounds per aggregation and pass")
    parser.add_argument("--passes", type=int, default=2, help="--real: passes over the aggregations (interleaved, so "
                                                              "that a change of load hits them all)")
    parser.add_argument("--aggregations", nargs="+", default=list(REAL_SETTINGS), choices=list(REAL_SETTINGS),
                        metavar="AGGREGATION", help=f"--real: which (default: all): {', '.join(REAL_SETTINGS)}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="samples per peer per round (global batch: 8x this)")
    parser.add_argument("--lie", type=float, default=0.01, help="what a lying reducer adds to every mean it returns "
                                                                "(an honest gradient's values are ~1e-2)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    attacks = [*ATTACKS, REDUCER_ATTACK]
    parser.add_argument("--attacks", nargs="+", default=attacks, choices=attacks)
    parser.add_argument("--attackers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="SETTING",
                        help=f"columns (default: all): {', '.join(SETTINGS)}")
    parser.add_argument("--out", default=None, help="results file under benchmarks/results/ (default: byzantine.json, "
                                                    "byzantine_real.json with --real)")
    args = parser.parse_args()
    if args.worker:
        real_worker(args)
        return
    if args.real:
        args.out = args.out or "byzantine_real.json"
        real(args)
        return
    args.out = args.out or "byzantine.json"
    torch.set_num_threads(1)
    data = load_mnist(0)
    started = time.monotonic()
    results: Dict[str, Dict[str, dict]] = {}
    cases = [("honest", None, 0)] + [(f"{a} x{m}", a, m) for m in args.attackers for a in args.attacks]
    for label, attack, attackers in cases:
        results[label] = {}
        for name in args.settings:
            runs = [run(SETTINGS[name], attack, attackers, seed, args.epochs, data, args.batch, args.lie)
                    for seed in args.seeds]
            results[label][name] = {
                "accuracy": statistics.fmean(r["accuracy"] for r in runs),
                "per_seed": [r["accuracy"] for r in runs], "finite": all(r["finite"] for r in runs),
                "failed_rounds": [r["failed_rounds"] for r in runs],
                "left_out_honest": [r["left_out_honest"] for r in runs],
                "left_out_attackers": [r["left_out_attackers"] for r in runs],
                "reduce_s_per_round": statistics.fmean(r["reduce_s_per_round"] for r in runs),
            }
        print(f"  {label}: " + ", ".join(f"{n} {100 * v['accuracy']:.1f}" for n, v in results[label].items())
              + f"  [{time.monotonic() - started:.0f} s]", flush=True)
    honest = {name: results["honest"][name]["accuracy"] for name in args.settings}
    rows = [[label] + [f"{100 * v['accuracy']:.1f}" + ("" if v["finite"] else " (inf)") +
                       ("" if label == "honest" else f" ({100 * (v['accuracy'] - honest[n]):+.1f})")
                       for n, v in results[label].items()] for label in results]
    print(f"\nMNIST-5k, {PEERS} peers x {args.batch} samples per round, {args.epochs} epochs, seeds {args.seeds}: "
          f"test accuracy % "
          f"(in brackets: pp against the honest-only run of the same column; '+ momentum': WorkerMomentum(0.9), "
          f"inner SGD lr 1.0)\n")
    print(table(["attack x attackers", *args.settings], rows))
    costs = part_cost()
    per_round = {n: statistics.fmean(results[label][n]["reduce_s_per_round"] for label in results)
                 for n in args.settings}
    print("\nreducer compute: " + ", ".join(f"{n} {1e3 * per_round[n]:.1f} ms/round" for n in args.settings))
    print("per 2 MiB part of 8 senders: " + ", ".join(f"{n} {1e3 * c:.0f} ms" for n, c in costs.items()))
    for name in args.settings:
        if reputation_of(SETTINGS[name].aggregation) is not None:
            print(f"{name}: member-rounds left out (honest / attackers, summed over seeds): " + ", ".join(
                f"{label} {sum(v[name]['left_out_honest'])}/{sum(v[name]['left_out_attackers'])}"
                for label, v in results.items()))
    worst = {n: min(results[label][n]["accuracy"] - honest[n] for label in results if label != "honest")
             for n in args.settings}
    print("worst drop against honest-only: " + ", ".join(f"{n} {100 * w:+.1f} pp" for n, w in worst.items()))
    path = write_json(args.out, {"benchmark": "byzantine", "args": vars(args), "results": results,
                                 "reduce_s_per_round": per_round, "part_cost_s": costs, "worst_drop": worst,
                                 "elapsed_s": time.monotonic() - started})
    print(f"wrote {path}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
