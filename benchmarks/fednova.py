"""Peers that take different numbers of local steps: FedNova against FedAvg (and SCAFFOLD), same run.

Heterogeneous least-squares problems ``f_i(w) = ½‖A_i w − b_i‖²`` (dimension 5, 16 rows, ``A_i`` scaled by
``1 + 0.5 i``, ``b_i`` shifted by ``i``; float64, full gradients, plain SGD), peer ``i`` taking ``τ_i`` local steps
every round (default 2, 5, 10, 20), rounds driven through ``swarm_opt.simulation.average_in_process`` (the strategies'
own code). Reported after ``--rounds`` rounds, per learning rate: the distance of the model to the optimum of
``Σ f_i`` (what FedNova and SCAFFOLD weigh every peer equally toward) and to the optimum of ``Σ τ_i² f_i`` (where
FedAvg, weighing each peer by its samples and moving it ``τ_i`` steps, settles as the learning rate goes to 0).

    python benchmarks/fednova.py                     # lr 0.02, 0.01, 0.005; 300 rounds; JSON to /tmp/fednova.json
    python benchmarks/fednova.py --steps 1 4 16 64 --lrs 0.002 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List, Sequence

import torch
from _common import command_line, machine, table  # also puts the repo on sys.path for swarm_opt

import swarm_opt
from swarm_opt.simulation import average_in_process

DIM, ROWS = 5, 16
STRATEGIES = ("local", "fednova", "scaffold")  # keys of swarm_opt.strategies.STRATEGIES


def problems(n: int, seed: int = 0) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(ROWS, DIM, generator=g, dtype=torch.float64) / 4 * (1 + 0.5 * i),
             torch.randn(ROWS, generator=g, dtype=torch.float64) * 3 + i) for i in range(n)]


def optimum(probs: Sequence[tuple], weights: Sequence[float]) -> torch.Tensor:
    return torch.linalg.solve(sum(w * a.T @ a for w, (a, _) in zip(weights, probs)),
                              sum(w * a.T @ b for w, (a, b) in zip(weights, probs)))


def train(name: str, probs: Sequence[tuple], steps: Sequence[int], lr: float, rounds: int) -> torch.Tensor:
    peers = []
    for a, b in probs:
        w = torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64))
        inner = torch.optim.SGD([w], lr=lr)
        strategy = swarm_opt.strategies.STRATEGIES[name]()
        strategy.bind([w], inner)
        peers.append((w, inner, strategy, a, b))
    for _ in range(rounds):
        for (w, inner, strategy, a, b), k in zip(peers, steps):
            for _ in range(k):
                inner.zero_grad()
                (0.5 * (a @ w - b).pow(2).sum()).backward()
                assert strategy.local_step(1)
        average_in_process([strategy for _, _, strategy, _, _ in peers])
    return peers[0][0].detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 5, 10, 20], help="local steps of each peer")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.02, 0.01, 0.005])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", default="/tmp/fednova.json", help="where the JSON results go")
    args = parser.parse_args()
    probs = problems(len(args.steps))
    uniform = optimum(probs, [1.0] * len(probs))
    by_steps = optimum(probs, [k * k for k in args.steps])
    rows: List[list] = []
    results: List[Dict] = []
    for lr in args.lrs:
        for name in STRATEGIES:
            start = time.perf_counter()
            w = train(name, probs, args.steps, lr, args.rounds)
            entry = {"strategy": name, "lr": lr, "to_optimum": (w - uniform).norm().item(),
                     "to_steps_weighted_optimum": (w - by_steps).norm().item(), "seconds": time.perf_counter() - start}
            results.append(entry)
            rows.append([name, lr, f"{entry['to_optimum']:.3g}", f"{entry['to_steps_weighted_optimum']:.3g}"])
    print(table(["strategy", "lr", "‖w − argmin Σ f_i‖", "‖w − argmin Σ τ_i² f_i‖"], rows))
    with open(args.out, "w") as f:
        json.dump({"command": command_line(), "machine": machine(), "steps": args.steps, "rounds": args.rounds,
                   "results": results}, f, indent=2)
    print(f"\n{command_line()}\nJSON: {args.out}")


if __name__ == "__main__":
    main()
