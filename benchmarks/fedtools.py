"""The federated toolbox's options on non-IID MNIST-5k, in-process: adaptive FedProx, FedPer (KeepLocal),
adaptive layer exchange (DriftedLayers) and peer-level DP (PeerDP with AdaptiveClip), against FedAvg, same run.

The setup of ``benchmarks/noniid.py`` (its data, Dirichlet split, model MLP 784-64-10, inner SGD lr 0.05, batch 32):
8 peers, α = 0.1, ``--steps`` local steps per peer per round, ``--rounds`` rounds through
``swarm_opt.simulation.average_in_process`` (the strategies' own round code). Reported per variant: global test
accuracy (peer 0's model on the 1000 held-out digits; mean of the last 5 rounds), personalised accuracy (each peer's
model on the test set reweighted to its own label distribution, mean over peers; what FedPer is for), the share of
layers sent per round (DriftedLayers), μ and C at the end.

    python benchmarks/fedtools.py                          # 3 seeds, 30 rounds of 20 steps; JSON to results/
    python benchmarks/fedtools.py --seeds 0 --rounds 5     # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import numpy as np
import torch
from _common import command_line, machine, table, write_json  # also puts the repo on sys.path for swarm_opt
from noniid import accuracy, batch_stream, code_fingerprint, dirichlet_split, load_data, make_model, stream_seed

import swarm_opt
from swarm_opt.simulation import average_in_process

PEERS, ALPHA, LR, BATCH, LAST = 8, 0.1, 0.05, 32, 5


def _head(model: torch.nn.Module) -> swarm_opt.KeepLocal:
    return swarm_opt.KeepLocal(model, lambda name, m: name.startswith("2."))  # the MLP's output layer


def _dp(split: int) -> Callable[[torch.nn.Module], swarm_opt.Strategy]:
    return lambda model: swarm_opt.LocalUpdates(peer_dp=swarm_opt.PeerDP(
        noise_multiplier=1.0, clip=swarm_opt.AdaptiveClip(0.1, target_quantile=0.5), split=split))


VARIANTS: Dict[str, Callable[[torch.nn.Module], swarm_opt.Strategy]] = {
    "FedAvg": lambda model: swarm_opt.LocalUpdates(),
    "FedProx mu=0.01": lambda model: swarm_opt.FedProx(mu=0.01),
    "FedProx adaptive (mu 0.01, delta 0.1, patience 5)": lambda model: swarm_opt.FedProx(
        mu=0.01, adaptive=swarm_opt.AdaptiveMu(delta=0.1, patience=5)),
    "FedPer (head local)": lambda model: swarm_opt.LocalUpdates(exchange=_head(model)),
    "DriftedLayers(0.05)": lambda model: swarm_opt.LocalUpdates(select=swarm_opt.DriftedLayers(0.05)),
    "PeerDP z=1 split=1": _dp(1),
    "PeerDP z=1 split=8": _dp(PEERS),
}


def personalised_accuracy(models: List[torch.nn.Module], label_counts: List[np.ndarray], xt: torch.Tensor,
                          yt: torch.Tensor) -> float:
    """Mean over peers of the accuracy of the peer's model on the test set, each class weighted by the peer's share
    of it in its training shard."""
    scores = []
    with torch.no_grad():
        for model, counts in zip(models, label_counts):
            correct = (model(xt).argmax(dim=1) == yt).float()
            per_class = np.array([float(correct[yt == c].mean()) for c in range(10)])
            scores.append(float((per_class * counts).sum() / counts.sum()))
    return statistics.mean(scores)


def run(name: str, seed: int, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    x, y, xt, yt = load_data(0)
    shards, _ = dirichlet_split(y, PEERS, ALPHA, seed, BATCH)
    models = [make_model(seed) for _ in range(PEERS)]
    strategies, inners, streams = [], [], []
    for rank, (model, shard) in enumerate(zip(models, shards)):
        inner = torch.optim.SGD(model.parameters(), lr=LR)
        strategy = VARIANTS[name](model)
        strategy.bind(list(model.parameters()), inner)
        strategies.append(strategy)
        inners.append(inner)
        streams.append(batch_stream(len(shard), BATCH, stream_seed(seed, rank)))
    counts = [np.bincount(y[s].numpy(), minlength=10) for s in shards]
    acc, personal, sent, start = [], [], [], time.perf_counter()
    for _ in range(rounds):
        for model, inner, strategy, shard, stream in zip(models, inners, strategies, shards, streams):
            for _ in range(steps):
                idx = shard[next(stream)]
                inner.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
                with torch.no_grad():
                    strategy.observe_loss(float(loss))  # what Optimizer.step(closure) / report_loss pass on
                    assert strategy.local_step(len(idx))
        if strategies[0].select is not None:
            sent.append(statistics.mean(statistics.mean(s.select.flags()) for s in strategies))
        average_in_process(strategies)
        acc.append(accuracy(models[0], xt, yt))
        personal.append(personalised_accuracy(models, counts, xt, yt))
    return dict(variant=name, seed=seed, accuracy=acc, personalised=personal, layers_sent=sent,
                mu=getattr(strategies[0], "mu", None),
                clip=None if strategies[0].peer_dp is None else strategies[0].peer_dp.clip,
                seconds=time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    fingerprint = code_fingerprint()
    runs = [run(name, seed, args.rounds, args.steps) for name in VARIANTS for seed in args.seeds]
    rows = []
    for name in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        final = [statistics.mean(r["accuracy"][-LAST:]) for r in mine]
        personal = [statistics.mean(r["personalised"][-LAST:]) for r in mine]
        sent = [statistics.mean(r["layers_sent"]) for r in mine if r["layers_sent"]]
        rows.append([name, f"{100 * statistics.mean(final):.1f} ± {100 * statistics.pstdev(final):.1f}",
                     f"{100 * statistics.mean(personal):.1f} ± {100 * statistics.pstdev(personal):.1f}",
                     f"{100 * statistics.mean(sent):.0f} %" if sent else "all",
                     "" if mine[0]["mu"] is None else " ".join(f"{r['mu']:.2f}" for r in mine),
                     "" if mine[0]["clip"] is None else " ".join(f"{r['clip']:.2f}" for r in mine)])
    print(table(["variant", "global acc %", "personalised acc %", "layers sent", "mu at end", "C at end"], rows))
    path = write_json("fedtools.json", dict(command=command_line(), machine=machine(), code=fingerprint,
                                       args=vars(args), runs=runs))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
