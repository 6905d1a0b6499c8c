"""A thousand peers in one process: Moshpit group averaging against one group of the whole swarm (issue 16).

Two questions, both answered with the strategy and grid code a real swarm runs (``swarm_opt.simulation.
moshpit_round``: each peer's ``swarm_opt.groups.Grid`` names its line, lines split into groups of at most
``size``, a group commits only with a majority of its line's expected peers, committed members move on the grid):

1. **The mean's error** (no training): every peer holds a random vector, all weights equal. On a complete grid
   (1,000 = 10 x 10 x 10 peers, one per cell, groups of at most 16) the swarm's exact mean is reached after
   d = 3 rounds; from random coordinates, with 10 % of the peers replaced per round by newcomers that hold a random
   peer's values (a state download), the rms distance to the swarm's mean falls geometrically; reported per round.
2. **Training**: MNIST-5k (4000 train / 1000 test, ``benchmarks/_common.load_mnist``), 1,000 peers, label skew:
   each peer draws ``--shard`` training samples from class proportions ~ Dirichlet(alpha) (alpha 0.1: most peers
   see one or two digits; shards overlap, 4000 samples among 1,000 peers). MLP 784-32-10, LocalUpdates (FedAvg)
   with SGD lr 0.05, ``--steps`` local steps of batch ``--batch`` per round. Every round 10 % of the peers leave and
   as many join: a newcomer downloads a random live peer's parameters (what ``load_state_from_peers`` does), draws
   a new shard and starts at new grid coordinates. Compared: one group of the whole swarm (``groups=None``) against
   ``Groups(size=16)`` and ``Groups(size=32)``. Reported: test accuracy of 20 sampled peers' own models (mean), per
   round; the fraction of peers whose group committed. ``--strategy grad``: ``GradientAveraging`` instead (each
   peer accumulates ``--steps`` batches' gradients, one inner step per round on its group's mean; in groups the
   rounds carry the parameters and the inner optimizer's momentum too; newcomers download the optimizer's state
   with the parameters), with ``--momentum``.

    python benchmarks/scale_sim.py                 # 1,000 peers, 30 rounds, sizes none/16/32 (minutes)
    python benchmarks/scale_sim.py --peers 200 --rounds 10
    python benchmarks/scale_sim.py --strategy grad --lr 0.2 --momentum 0.9 --rounds 60 --sizes none,16,32
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from _common import RESULTS_DIR, code_version, command_line, load_mnist, machine, table, write_json

from swarm_opt import Groups
from swarm_opt.groups import Grid, grid_shape
from swarm_opt.simulation import moshpit_round
from swarm_opt.strategies import STRATEGIES, STRATEGY_NAMES, LocalUpdates


class _Holder(LocalUpdates):
    """A peer that only holds values: one zero-lr step per round gives it weight 1."""


def holders(values: torch.Tensor) -> List[tuple]:
    peers = []
    for row in values:
        w = torch.nn.Parameter(row.clone())
        strategy = _Holder()
        strategy.bind([w], torch.optim.SGD([w], lr=0.0))
        peers.append((w, strategy))
    return peers


def mean_error(n: int, size: int, rounds: int, churn: float, complete: bool, seed: int) -> List[float]:
    """The rms distance of the peers' values to the swarm's mean after each round (1.0 before the first)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    values = torch.randn(n, 8, dtype=torch.float64, generator=gen)
    peers = holders(values)
    ids = list(range(n))
    grids = [Grid(size, i) for i in ids]
    if complete:
        dims, side = grid_shape(n, size)
        assert side ** dims == n, "a complete grid needs side ** dims peers"
        for i, grid in enumerate(grids):
            for j in range(dims):
                grid.coords[j] = (i // side ** j) % side

    def rms() -> float:
        stacked = torch.stack([w.detach() for w, _ in peers])
        return float((stacked - stacked.mean(0)).norm(dim=1).pow(2).mean().sqrt())

    first = rms()
    errors = []
    next_id = n
    for r in range(rounds):
        for w, strategy in peers:
            w.grad = torch.zeros_like(w)
            strategy.local_step(1)
        moshpit_round([s for _, s in peers], grids, ids, r)
        errors.append(rms() / first)
        for i in rng.sample(range(n), int(churn * n)):
            donor = peers[rng.randrange(n)][0].detach()
            peers[i] = holders(donor[None])[0]
            ids[i], grids[i] = next_id, Grid(size, next_id)
            next_id += 1
    return errors


class Peer:
    """One simulated peer: its model, inner SGD and strategy (``args.strategy``, in groups of ``size``), started
    from ``model_state`` and, for a newcomer, its donor's ``optimizer_state`` (what a state download gives it)."""

    def __init__(self, args: argparse.Namespace, size: Optional[int], model_state: Dict[str, torch.Tensor],
                 shard: torch.Tensor, seed: int, optimizer_state: Optional[dict] = None) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
        self.model.load_state_dict(model_state)
        self.inner = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum)
        if optimizer_state is not None:
            self.inner.load_state_dict(copy.deepcopy(optimizer_state))
        self.strategy = STRATEGIES[args.strategy]()
        if size is not None:
            self.strategy.use_groups(Groups(size=size))
        self.strategy.bind(list(self.model.parameters()), self.inner)
        self.shard = shard
        self.gen = torch.Generator().manual_seed(seed)

    def local_steps(self, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int) -> None:
        for _ in range(steps):
            idx = self.shard[torch.randint(len(self.shard), (batch,), generator=self.gen)]
            self.inner.zero_grad()
            torch.nn.functional.cross_entropy(self.model(x[idx]), y[idx]).backward()
            self.strategy.local_step(batch)


def draw_shard(labels_by_class: List[torch.Tensor], alpha: float, samples: int, rng: np.random.Generator
               ) -> torch.Tensor:
    """``samples`` training indices drawn from class proportions ~ Dirichlet(alpha)."""
    props = rng.dirichlet(np.full(len(labels_by_class), alpha))
    classes = rng.choice(len(labels_by_class), size=samples, p=props)
    return torch.tensor([int(rng.choice(labels_by_class[c].numpy())) for c in classes], dtype=torch.long)


def train(args: argparse.Namespace, size: Optional[int], seed: int) -> dict:
    x, y, x_test, y_test = load_mnist(seed)
    by_class = [torch.nonzero(y == c).flatten() for c in range(10)]
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    torch.manual_seed(seed)
    start = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).state_dict()
    peers = [Peer(args, size, start, draw_shard(by_class, args.alpha, args.shard, rng), seed * 100_003 + i)
             for i in range(args.peers)]
    ids = list(range(args.peers))
    grids = [Grid(size, i) for i in ids]
    next_id = args.peers
    accuracy, committed_share, seconds = [], [], []
    for r in range(args.rounds):
        began = time.monotonic()
        for peer in peers:
            peer.local_steps(x, y, args.steps, args.batch)
        committed, _ = moshpit_round([p.strategy for p in peers], grids, ids, r)
        seconds.append(time.monotonic() - began)
        committed_share.append(sum(map(len, committed)) / args.peers)
        with torch.no_grad():
            sample = pick.sample(peers, 20)
            accuracy.append(float(np.mean([(p.model(x_test).argmax(1) == y_test).float().mean() for p in sample])))
        for i in pick.sample(range(args.peers), int(args.churn * args.peers)):  # leave, and a newcomer joins
            donor = peers[pick.randrange(args.peers)]
            peers[i] = Peer(args, size, donor.model.state_dict(), draw_shard(by_class, args.alpha, args.shard, rng),
                            seed * 100_003 + next_id, optimizer_state=donor.inner.state_dict())
            ids[i], grids[i] = next_id, Grid(size, next_id)
            next_id += 1
        print(f"  size={size} seed={seed} round {r + 1}: accuracy {accuracy[-1]:.4f}, "
              f"committed {committed_share[-1]:.0%}, {seconds[-1]:.1f} s", flush=True)
    return {"size": size, "seed": seed, "accuracy": accuracy, "committed_share": committed_share,
            "seconds_per_round": float(np.median(seconds))}


def plot(runs: List[dict], path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for size in sorted({run["size"] or 0 for run in runs}):
        curves = np.array([run["accuracy"] for run in runs if (run["size"] or 0) == size])
        label = "one group (whole swarm)" if size == 0 else f"Groups(size={size})"
        ax.plot(range(1, curves.shape[1] + 1), curves.mean(0) * 100, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy, % (20 sampled peers)")
    ax.set_title(f"{runs[0]['peers']} peers, {STRATEGY_NAMES[runs[0]['strategy']]}, 10 % churn, MNIST-5k label skew")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="none,16,32", help="group sizes; 'none' = one group of the whole swarm")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--churn", type=float, default=0.1)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--shard", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--strategy", choices=["local", "grad"], default="local")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [None if s == "none" else int(s) for s in args.sizes.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]

    print("1. The mean's error (rms distance to the swarm's mean, relative to the start)")
    error_rows, errors = [], {}
    cases = [("complete 10^3 grid, no churn", 1000, 16, 0.0, True), ("random coordinates, no churn", 1000, 16, 0.0,
             False), ("random coordinates, 10 % churn", 1000, 16, 0.1, False),
             ("random coordinates, 10 % churn", 1000, 32, 0.1, False)]
    for name, n, size, churn, complete in cases:
        e = mean_error(n, size, 9, churn, complete, seed=0)
        errors[f"{name}, size {size}"] = e
        rate = f"{(e[-1] / e[2]) ** (1 / 6):.2f}" if e[-1] > 1e-12 else "exact from r3"
        error_rows.append([name, size, *[f"{v:.1e}" for v in e[:6]], f"{e[-1]:.1e}", rate])
    print(table(["grid", "size", *[f"r{i}" for i in range(1, 7)], "r9", "factor/round (r3-r9)"], error_rows))
    print("theory on the complete grid of side 10: rms after k < 3 rounds = 10^(-k/2) (0.32, 0.10), 0 after 3")

    print(f"\n2. Training: {args.peers} peers, {args.rounds} rounds, {args.churn:.0%} churn per round")
    runs = []
    for size in sizes:
        for seed in seeds:
            run = train(args, size, seed)
            run["peers"], run["strategy"] = args.peers, args.strategy
            runs.append(run)
    rows = []
    for size in sizes:
        mine = [run for run in runs if run["size"] == size]
        final = [float(np.mean(run["accuracy"][-5:])) for run in mine]
        rows.append(["one group" if size is None else f"Groups({size})", f"{np.mean(final) * 100:.2f}",
                     f"{np.mean([np.mean(run['committed_share']) for run in mine]):.0%}",
                     f"{np.mean([run['seconds_per_round'] for run in mine]):.1f}"])
    print(table(["averaging", "accuracy % (last 5 rounds)", "peers committed / round", "s / round (sim)"], rows))
    name = "scale_sim" if args.strategy == "local" else f"scale_sim_{args.strategy}"
    png = plot(runs, RESULTS_DIR / f"{name}.png")
    print(f"plot: {png}" if png else "plot: matplotlib is not installed, no PNG")
    path = write_json(name, {"command": command_line(), "code": code_version(), "machine": machine(),
                                    "args": vars(args), "mean_error": errors, "runs": runs, "plot": png})
    print(f"results: {path}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
