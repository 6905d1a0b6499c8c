"""swarm_opt against FL4Health itself, in one run: FedAvg, FedProx, SCAFFOLD and DP-SCAFFOLD on non-IID MNIST-5k,
8 clients / peers, Dirichlet α = 0.1.

FL4Health (``fl4health`` 0.4.2 from the package index, on Flower 1.18) runs as its examples do
(``examples/{basic,fedprox,scaffold,dp_scaffold}_example``): one server process, ``flwr.server.start_server`` with
FL4Health's server and strategy, and one process per client, ``flwr.client.start_client`` with FL4Health's client
classes, over gRPC on loopback. swarm_opt runs real peers on loopback with ``noniid.py``'s ``--real`` machinery
(one hivemind DHT per peer, no server). Both sides use ``noniid.py``'s data and Dirichlet split, the MLP 784-64-10
from the same seeded initialisation, inner SGD lr 0.05, batch 32, ``--steps`` local steps per round, ``--rounds``
rounds and the same sleep per local step (``--step-sleep``: a stand-in for a bigger model's compute, the same on both
sides). Non-private runs draw the same batch stream as ``noniid.py``'s simulated peer i on both sides; DP runs use
Opacus's Poisson sampling (rate batch / shard size) on both sides.

Settings made equal on purpose, where FL4Health's examples differ: FedAvg averages uniformly
(``BasicFedAvg(weighted_aggregation=False)``; every client takes the same number of steps of the same batch size, as
swarm_opt weighs its peers by the round's samples); FedProx's μ = 0.01, fixed (``FedAvgWithAdaptiveConstraint(
adapt_loss_weight=False)``); SCAFFOLD's controls start at zero (``warm_start=False``: the examples' warm start runs
an extra training pass that swarm_opt does not, and that DP-SCAFFOLD's accountant does not count); every client in
every round (fraction 1.0); swarm_opt's peers split each round's global batch equally
(``TrackerConfig(shares="equal")``, ``--shares``), so that each takes ``--steps`` steps per round as FL4Health's
clients do, rather than in proportion to its speed (the default for volunteer swarms). FL4Health's federated
evaluation is off: the server evaluates its aggregated model centrally (``evaluate_fn``) on the 1000 held-out digits
after every round; swarm_opt's peers evaluate their model after every round they commit (they hold the same one).

Reported per algorithm and side: test accuracy per round and its mean over the last 5 rounds; wall time per round
(median time between successive round ends from round 2 on: round 1 includes start-up); payload bytes per round
computed from the tensors exchanged (no framing); for DP-SCAFFOLD, ε at ``--delta``: FL4Health's server's own
figure (its accountant, which turns local steps into whole epochs of the largest shard), FL4Health's accountant on
the steps actually taken, and swarm_opt's peers' ``progress.epsilon`` (Opacus's RDP accountant over each peer's
own DP-SGD steps; the largest over peers).

    python benchmarks/vs_fl4health.py                                    # 4 algorithms x 2 sides, 15 rounds of 50
    python benchmarks/vs_fl4health.py --algorithms fedavg --rounds 3     # a quick look

FL4Health 0.4.2 declares Python < 3.11 and torch == 2.6.0; this machine has Python 3.11 and torch 2.13, so it is
installed without its dependencies (see benchmarks/NOTEBOOK.md, "swarm_opt vs FL4Health", for the exact commands).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
from _common import STRATEGIES, command_line, launch, stop_workers, table, tail, write_json
from noniid import (
    LAST,
    PeerSetup,
    accuracy,
    batch_stream,
    code_fingerprint,
    default_setup,
    dirichlet_split,
    load_data,
    make_inner,
    make_model,
    run_swarm,
    stream_seed,
    swarm_per_round,
    worker,
)

import swarm_opt
from swarm_opt.config import SHARES

MU = 0.01  # FedProx's μ on both sides: noniid.py's "fedprox" entry
assert STRATEGIES["fedprox"].make().mu == MU


@dataclass(frozen=True)
class Algorithm:
    label: str
    swarm_name: str  # the strategy's name in _common.STRATEGIES, or "dpscaffold" (this file's setup)
    private: bool = False


ALGORITHMS: Dict[str, Algorithm] = {
    "fedavg": Algorithm("FedAvg", "local"),
    "fedprox": Algorithm(f"FedProx mu={MU}", "fedprox"),
    "scaffold": Algorithm("SCAFFOLD", "scaffold"),
    "dpscaffold": Algorithm("DP-SCAFFOLD", "dpscaffold", private=True),
}


def quiet_opacus() -> None:
    """Opacus's advice about its secure RNG (off: fine for a benchmark) and torch's note on its backward hooks are
    neither swarm_opt's nor FL4Health's."""
    warnings.filterwarnings("ignore", message="Secure RNG turned off")
    warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
    warnings.filterwarnings("ignore", message="Optimal order is the (largest|smallest) alpha")


def poisson_batches(loader: torch.utils.data.DataLoader) -> Iterator[tuple]:
    """Endless passes over an Opacus (Poisson-sampled) loader, skipping the empty batches it can draw."""
    while True:
        for inputs, labels in loader:
            if len(inputs):
                yield inputs, labels


# --- swarm_opt's peers ----------------------------------------------------------------------------------------------
def swarm_setup(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, shard: torch.Tensor) -> PeerSetup:
    """``noniid.py``'s peer, or for DP-SCAFFOLD: Scaffold over an Opacus-private SGD, ε from its accountant."""
    if args.strategy_name != "dpscaffold":
        return default_setup(args, x, y, shard)
    from opacus import PrivacyEngine

    quiet_opacus()
    cfg = json.loads((Path(args.tmp) / "config.json").read_text())
    model = make_model(args.seed)
    engine = PrivacyEngine(accountant="rdp")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[shard], y[shard]),
                                         batch_size=args.batch_size)
    model, dp_sgd, loader = engine.make_private(
        module=model, optimizer=make_inner(model.parameters(), args.lr), data_loader=loader,
        noise_multiplier=cfg["noise_multiplier"], max_grad_norm=cfg["clip"])
    return PeerSetup(model, dp_sgd, swarm_opt.Scaffold(), poisson_batches(loader),
                     swarm_opt.OpacusPrivacy(engine, delta=cfg["delta"]))


# --- FL4Health's server and clients ---------------------------------------------------------------------------------
class StreamSampler(torch.utils.data.Sampler):
    """``noniid.batch_stream`` as a DataLoader's batch sampler: FL4Health's client keeps one iterator over its train
    loader across rounds, so its client i takes exactly the batches of ``noniid.py``'s simulated peer i."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.stream = batch_stream(n, batch_size, seed)

    def __iter__(self):
        for batch in self.stream:
            yield batch.tolist()

    def __len__(self) -> int:
        return 1 << 40


def fit_config(cfg: dict, current_round: int) -> dict:
    out = {"local_steps": cfg["steps"], "batch_size": cfg["batch_size"], "n_server_rounds": cfg["rounds"],
           "current_server_round": current_round}
    if cfg["algorithm"] == "dpscaffold":
        out.update(noise_multiplier=cfg["noise_multiplier"], clipping_bound=cfg["clip"])
    return out


def fl4h_server(args: argparse.Namespace) -> None:
    """FL4Health's server for ``cfg["algorithm"]``, built as its examples build it; evaluates the aggregated model
    centrally after every round and writes ``fl4h_result.json`` (accuracy and time per round, payload size, ε)."""
    from functools import partial

    import flwr as fl
    from fl4health.client_managers.poisson_sampling_manager import PoissonSamplingClientManager
    from fl4health.metrics.metric_aggregation import evaluate_metrics_aggregation_fn, fit_metrics_aggregation_fn
    from fl4health.servers.adaptive_constraint_servers.fedprox_server import FedProxServer
    from fl4health.servers.base_server import FlServer
    from fl4health.servers.scaffold_server import DPScaffoldServer, ScaffoldServer
    from fl4health.strategies.basic_fedavg import BasicFedAvg
    from fl4health.strategies.fedavg_with_adaptive_constraint import FedAvgWithAdaptiveConstraint
    from fl4health.strategies.scaffold import OpacusScaffold, Scaffold
    from fl4health.utils.parameter_extraction import get_all_model_parameters
    from fl4health.utils.privacy_utilities import map_model_to_opacus_model
    from flwr.server.client_manager import SimpleClientManager

    quiet_opacus()
    torch.set_num_threads(1)
    tmp = Path(args.tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    data = torch.load(tmp / "data.pt")
    xt, yt, n = data["xt"], data["yt"], cfg["peers"]
    model, evaluated = make_model(cfg["seed"]), make_model(cfg["seed"])
    keys = list(evaluated.state_dict())
    rounds: List[dict] = []
    start = time.perf_counter()

    def evaluate_fn(server_round: int, arrays: list, config: dict):
        # the global parameters start with the model's state (then SCAFFOLD's controls or FedProx's μ)
        evaluated.load_state_dict({k: torch.from_numpy(np.array(a)) for k, a in zip(keys, arrays)})
        acc = accuracy(evaluated, xt, yt)
        rounds.append(dict(round=server_round, t=time.perf_counter() - start, accuracy=acc,
                           payload_bytes=int(sum(np.asarray(a).nbytes for a in arrays))))
        return 0.0, {"accuracy": acc}

    common = dict(fraction_evaluate=0.0, min_available_clients=n, evaluate_fn=evaluate_fn,
                  on_fit_config_fn=partial(fit_config, cfg), on_evaluate_config_fn=partial(fit_config, cfg),
                  fit_metrics_aggregation_fn=fit_metrics_aggregation_fn,
                  evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn, accept_failures=False)
    fl_config = {"n_server_rounds": cfg["rounds"], "n_clients": n, "local_steps": cfg["steps"],
                 "batch_size": cfg["batch_size"]}
    algorithm = cfg["algorithm"]
    if algorithm == "fedavg":
        strategy = BasicFedAvg(**common, min_fit_clients=n, initial_parameters=get_all_model_parameters(model),
                               weighted_aggregation=False)
        server = FlServer(client_manager=SimpleClientManager(), fl_config=fl_config, strategy=strategy,
                          accept_failures=False)
    elif algorithm == "fedprox":
        strategy = FedAvgWithAdaptiveConstraint(**common, min_fit_clients=n,
                                                initial_parameters=get_all_model_parameters(model),
                                                initial_loss_weight=MU, adapt_loss_weight=False,
                                                weighted_aggregation=False)
        server = FedProxServer(client_manager=SimpleClientManager(), fl_config=fl_config, strategy=strategy,
                               accept_failures=False)
    elif algorithm == "scaffold":
        strategy = Scaffold(**common, initial_parameters=get_all_model_parameters(model), model=model)
        server = ScaffoldServer(client_manager=PoissonSamplingClientManager(), fl_config=fl_config,
                                strategy=strategy, warm_start=False, accept_failures=False)
    else:
        strategy = OpacusScaffold(**common, model=map_model_to_opacus_model(model))
        server = DPScaffoldServer(client_manager=PoissonSamplingClientManager(), fl_config=fl_config,
                                  noise_multiplier=cfg["noise_multiplier"], batch_size=cfg["batch_size"],
                                  num_server_rounds=cfg["rounds"], strategy=strategy, local_steps=cfg["steps"],
                                  delta=cfg["delta"], warm_start=False, accept_failures=False)
    fl.server.start_server(server=server, server_address=f"127.0.0.1:{args.port}",
                           config=fl.server.ServerConfig(num_rounds=cfg["rounds"]))
    result = dict(rounds=rounds)
    if algorithm == "dpscaffold":
        result["epsilon_reported"] = [server.accountant.get_epsilon(r, cfg["delta"])
                                      for r in range(1, cfg["rounds"] + 1)]
        result["epsilon_steps_taken"] = exact_steps_epsilon(cfg, [len(s) for s in data["shards"]])
    server.shutdown()
    (tmp / "fl4h_result.tmp").write_text(json.dumps(result))
    os.replace(tmp / "fl4h_result.tmp", tmp / "fl4h_result.json")


def exact_steps_epsilon(cfg: dict, shard_sizes: List[int]) -> List[float]:
    """FL4Health's accountant (dp-accounting's RDP moments accountant, Poisson sampling at batch / shard size) over the
    DP-SGD steps each client actually takes (``steps`` per round), the largest over clients, after each round."""
    from fl4health.privacy.moments_accountant import MomentsAccountant, PoissonSampling

    accountant = MomentsAccountant()
    return [max(accountant.get_epsilon(PoissonSampling(cfg["batch_size"] / size), cfg["noise_multiplier"],
                                       r * cfg["steps"], cfg["delta"]) for size in shard_sizes)
            for r in range(1, cfg["rounds"] + 1)]


def fl4h_client(args: argparse.Namespace) -> None:
    """FL4Health's client for ``cfg["algorithm"]`` (its BasicClient, FedProxClient, ScaffoldClient or DPScaffoldClient)
    on this rank's shard, as its examples run one."""
    import flwr as fl
    from fl4health.clients.basic_client import BasicClient
    from fl4health.clients.fed_prox_client import FedProxClient
    from fl4health.clients.scaffold_client import DPScaffoldClient, ScaffoldClient
    from fl4health.metrics import Accuracy

    quiet_opacus()
    torch.set_num_threads(1)
    tmp = Path(args.tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    data = torch.load(tmp / "data.pt")
    shard = data["shards"][args.rank]
    train_set = torch.utils.data.TensorDataset(data["x"][shard], data["y"][shard])
    test_set = torch.utils.data.TensorDataset(data["xt"], data["yt"])
    base = {"fedavg": BasicClient, "fedprox": FedProxClient, "scaffold": ScaffoldClient,
            "dpscaffold": DPScaffoldClient}[cfg["algorithm"]]

    class Client(base):  # type: ignore[misc, valid-type]
        def get_data_loaders(self, config):
            if cfg["algorithm"] == "dpscaffold":  # Opacus replaces it with Poisson sampling at 1 / len(loader)
                train = torch.utils.data.DataLoader(train_set, batch_size=cfg["batch_size"])
            else:
                train = torch.utils.data.DataLoader(train_set, batch_sampler=StreamSampler(
                    len(shard), cfg["batch_size"], stream_seed(cfg["seed"], args.rank)))
            return train, torch.utils.data.DataLoader(test_set, batch_size=len(test_set))

        def get_model(self, config):
            return make_model(cfg["seed"])

        def get_optimizer(self, config):
            return make_inner(self.model.parameters(), cfg["lr"])

        def get_criterion(self, config):
            return torch.nn.CrossEntropyLoss()

        def update_after_step(self, step, current_round=None):
            super().update_after_step(step, current_round)
            time.sleep(cfg["step_sleep"])

    client = Client(data_path=tmp, metrics=[Accuracy("accuracy")], device=torch.device("cpu"),
                    client_name=f"client{args.rank}")
    fl.client.start_client(server_address=f"127.0.0.1:{args.port}", client=client.to_client())
    client.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fl4health(args: argparse.Namespace, tmp: Path) -> dict:
    """FL4Health's server and ``args.peers`` clients, each its own process, until the server finished its rounds."""
    port, procs, logs = free_port(), [], []
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.monotonic()
    (tmp / "fl4h_result.json").unlink(missing_ok=True)
    try:
        logs.append(tmp / "fl4h_server.log")
        procs.append(launch([__file__, "--fl4h-server", "--tmp", str(tmp), "--port", str(port)], logs[0], env))
        deadline = time.monotonic() + 300
        while True:  # the clients connect once the server listens
            if procs[0].poll() is not None:
                raise RuntimeError(f"FL4Health's server exited with {procs[0].returncode}:\n{tail(logs[0])}")
            if time.monotonic() > deadline:
                raise RuntimeError("FL4Health's server did not listen within 300 s")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        for rank in range(args.peers):
            logs.append(tmp / f"fl4h_client{rank}.log")
            procs.append(launch([__file__, "--fl4h-client", "--tmp", str(tmp), "--port", str(port), "--rank",
                                 str(rank)], logs[-1], env))
        procs[0].wait(args.max_seconds + 300)
        if procs[0].returncode != 0:
            raise RuntimeError(f"FL4Health's server exited with {procs[0].returncode}:\n{tail(logs[0])}")
        result = json.loads((tmp / "fl4h_result.json").read_text())
        result["elapsed_s"] = time.monotonic() - started
        return result
    finally:
        stop_workers(procs, logs, keep_logs_as=f"{Path(args.out).stem}_fl4h_{args.algorithm}")


def swarm_side(args: argparse.Namespace, tmp: Path) -> dict:
    """``args.peers`` real swarm_opt peers (``noniid.run_swarm`` with this file's worker)."""
    started = time.monotonic()
    args.out_real = f"{Path(args.out).stem}_swarm_{args.algorithm}.json"  # names the kept logs
    peers = run_swarm(args, ALGORITHMS[args.algorithm].swarm_name, tmp, script=__file__)
    per_round = swarm_per_round(peers, args.rounds)
    epsilons = [max((rec.get("epsilon") or 0.0 for p in peers for rec in p["rounds"] if rec["epoch"] == r),
                    default=None) for r in range(1, args.rounds + 1)]
    return dict(peers=peers, per_round=per_round, elapsed_s=time.monotonic() - started,
                epsilon=epsilons if ALGORITHMS[args.algorithm].private else None,
                payload_bytes=peers[0]["payload_bytes"],
                max_param_diff_between_peers=max(p["max_param_diff_vs_peer0"] for p in peers))


def in_process_side(args: argparse.Namespace, tmp: Path, data: dict) -> dict:
    """swarm_opt's strategy code without a network (``swarm_opt.simulation.average_in_process``): the peers of
    ``swarm_setup`` (Opacus-private for DP-SCAFFOLD) each take exactly ``--steps`` steps per round and every peer is
    in every round, as FL4Health's clients are: what is left between this and FL4Health is the algorithm."""
    from swarm_opt.simulation import average_in_process

    started = time.monotonic()
    peers, inners = [], []
    for rank, shard in enumerate(data["shards"]):
        peer_args = argparse.Namespace(**{**vars(args), "rank": rank, "tmp": str(tmp),
                                          "strategy_name": ALGORITHMS[args.algorithm].swarm_name})
        peer = swarm_setup(peer_args, data["x"], data["y"], shard)
        inner = peer.optimizer if isinstance(peer.optimizer, torch.optim.Optimizer) else \
            peer.optimizer(list(peer.model.parameters()))
        params = [q for group in inner.param_groups for q in group["params"]]
        if peer.privacy is not None:
            peer.privacy.check(peer.strategy, inner)
        peer.strategy.bind(params, inner)
        peers.append(peer)
        inners.append(inner)
    per_round, epsilons, t0 = [], [], time.perf_counter()
    for epoch in range(1, args.rounds + 1):
        for peer, inner in zip(peers, inners):
            for _ in range(args.steps):
                inputs, labels = next(peer.batches)
                inner.zero_grad()
                torch.nn.functional.cross_entropy(peer.model(inputs), labels).backward()
                with torch.no_grad():
                    assert peer.strategy.local_step(args.batch_size)
        average_in_process([peer.strategy for peer in peers])
        per_round.append(dict(epoch=epoch, accuracy_mean=accuracy(peers[0].model, data["xt"], data["yt"]),
                              t=time.perf_counter() - t0, committed=len(peers), steps=[args.steps] * len(peers)))
        if peers[0].privacy is not None:
            epsilons.append(max(peer.privacy.epsilon() for peer in peers))
    with torch.no_grad():
        spread = max(float((a - b).abs().max()) for peer in peers[1:]
                     for a, b in zip(peer.model.parameters(), peers[0].model.parameters()))
    return dict(peers=[], per_round=per_round, elapsed_s=time.monotonic() - started, epsilon=epsilons or None,
                payload_bytes=4 * sum(t.numel() for t in peers[0].strategy.buffer_templates()),
                max_param_diff_between_peers=spread)


# --- the report -----------------------------------------------------------------------------------------------------
def median_round_s(ends: List[Optional[float]]) -> Optional[float]:
    """Median time between successive round ends, from round 2 on (``ends[0]``: the start or round 0)."""
    gaps = [b - a for a, b in zip(ends[1:], ends[2:]) if a is not None and b is not None]
    return statistics.median(gaps) if gaps else None


def summarize(name: str, fl4h: dict, swarm: dict, peers: int) -> dict:
    f_acc = [r["accuracy"] for r in sorted(fl4h["rounds"], key=lambda r: r["round"])]  # round 0 = the initial model
    s_acc = [f_acc[0]] + [r["accuracy_mean"] for r in swarm["per_round"]]
    f_ends = [r["t"] for r in sorted(fl4h["rounds"], key=lambda r: r["round"])]
    s_ends = [0.0] + [r["t"] for r in swarm["per_round"]]
    down = fl4h["rounds"][-1]["payload_bytes"]  # what the server sends each client; a client sends about as much
    out = dict(
        algorithm=name, fl4h_accuracy=f_acc, swarm_accuracy=s_acc,
        fl4h_final=statistics.fmean(f_acc[1:][-LAST:]),
        swarm_final=statistics.fmean(a for a in s_acc[1:][-LAST:] if a is not None),
        fl4h_round_s=median_round_s(f_ends), swarm_round_s=median_round_s(s_ends),
        fl4h_bytes_per_client=2 * down, fl4h_bytes_total=2 * peers * down,
        # hivemind's all-reduce: each peer sends (n-1)/n of its payload to the reducers and gets (n-1)/n back
        swarm_bytes_per_peer=2 * (peers - 1) * swarm["payload_bytes"] // peers,
        swarm_bytes_total=2 * (peers - 1) * swarm["payload_bytes"],
        fl4h_elapsed_s=fl4h["elapsed_s"], swarm_elapsed_s=swarm["elapsed_s"],
        swarm_committed_per_round=[r["committed"] for r in swarm["per_round"]],
        swarm_steps_per_round=[r["steps"] for r in swarm["per_round"]],
        swarm_max_param_diff_between_peers=swarm["max_param_diff_between_peers"],
    )
    if "epsilon_reported" in fl4h:
        out.update(fl4h_epsilon_reported=fl4h["epsilon_reported"], fl4h_epsilon_steps_taken=fl4h["epsilon_steps_taken"],
                   swarm_epsilon=swarm["epsilon"])
    return out


def fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def report(summaries: List[dict], args: argparse.Namespace) -> List[str]:
    rows = []
    for r in range(args.rounds + 1):
        row = [r]
        for s in summaries:
            a, b = s["fl4h_accuracy"][r], s["swarm_accuracy"][r]
            row += [f"{100 * a:.2f}" if a is not None else "-", f"{100 * b:.2f}" if b is not None else "-"]
        rows.append(row)
    headers = ["round"] + [f"{s['algorithm']} {side}" for s in summaries for side in ("FL4Health", "swarm_opt")]
    print(table(headers, rows))
    print()
    rows = []
    for s in summaries:
        eps = "" if "swarm_epsilon" not in s else (
            f"{s['fl4h_epsilon_reported'][-1]:.1f} / {s['fl4h_epsilon_steps_taken'][-1]:.1f} / "
            f"{s['swarm_epsilon'][-1]:.1f}")
        ratio = (s["swarm_round_s"] / s["fl4h_round_s"]) if s["swarm_round_s"] and s["fl4h_round_s"] else None
        rows.append([ALGORITHMS[s["algorithm"]].label, f"{100 * s['fl4h_final']:.2f}", f"{100 * s['swarm_final']:.2f}",
                     f"{100 * (s['swarm_final'] - s['fl4h_final']):+.2f}", f"{s['fl4h_round_s']:.2f}",
                     f"{s['swarm_round_s']:.2f}", f"{ratio:.2f}" if ratio else "-",
                     f"{fmt_bytes(s['fl4h_bytes_per_client'])} ({fmt_bytes(s['fl4h_bytes_total'])})",
                     f"{fmt_bytes(s['swarm_bytes_per_peer'])} ({fmt_bytes(s['swarm_bytes_total'])})", eps])
    print(table(["algorithm", f"FL4Health acc (last {LAST})", "swarm_opt acc", "swarm - FL4H (pp)",
                 "FL4Health s/round", "swarm_opt s/round", "ratio", "FL4Health bytes/round/client (all)",
                 "swarm_opt bytes/round/peer (all)", "ε FL4H reported / FL4H steps taken / swarm_opt"], rows))
    lines = []
    for s in summaries:
        gap = 100 * (s["swarm_final"] - s["fl4h_final"])
        faster = s["swarm_round_s"] is not None and s["fl4h_round_s"] is not None and \
            s["swarm_round_s"] <= s["fl4h_round_s"]
        lines.append(f"{ALGORITHMS[s['algorithm']].label}: accuracy {gap:+.2f} pp vs FL4Health (goal >= -0.5: "
                     f"{'met' if gap >= -0.5 else 'MISSED'}); time per round {'met' if faster else 'MISSED'}; "
                     f"swarm_opt peers committed per round {s['swarm_committed_per_round']}")
    print()
    for line in lines:
        print(line)
    return lines


def run(args: argparse.Namespace) -> None:
    fingerprint = code_fingerprint()
    x, y, xt, yt = load_data(0)
    shards, _ = dirichlet_split(y, args.peers, args.alpha, args.seed, args.min_samples)
    results, summaries = {}, []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vs_fl4health_") as tmp_name:
        tmp = Path(tmp_name)
        torch.save(dict(x=x, y=y, xt=xt, yt=yt, shards=shards), tmp / "data.pt")
        for name in args.algorithms:
            args.algorithm = name
            cfg = dict(algorithm=name, peers=args.peers, steps=args.steps, rounds=args.rounds,
                       batch_size=args.batch_size, lr=args.lr, seed=args.seed, step_sleep=args.step_sleep,
                       noise_multiplier=args.noise_multiplier, clip=args.clip, delta=args.delta)
            (tmp / "config.json").write_text(json.dumps(cfg))
            if args.in_process:  # FL4Health's side from a saved run of this script with the same settings
                fl4h = json.loads(Path(args.in_process).read_text())["runs"][name]["fl4health"]
                swarm = in_process_side(args, tmp, torch.load(tmp / "data.pt"))
                print(f"{name}: swarm_opt in process in {swarm['elapsed_s']:.0f} s", flush=True)
            else:
                print(f"{name}: FL4Health (server + {args.peers} clients) ...", flush=True)
                fl4h = run_fl4health(args, tmp)
                print(f"{name}: FL4Health done in {fl4h['elapsed_s']:.0f} s; swarm_opt ({args.peers} peers) ...",
                      flush=True)
                swarm = swarm_side(args, tmp)
                print(f"{name}: swarm_opt done in {swarm['elapsed_s']:.0f} s", flush=True)
            results[name] = dict(fl4health=fl4h, swarm_opt=swarm)
            summaries.append(summarize(name, fl4h, swarm, args.peers))
    print()
    lines = report(summaries, args)
    from importlib.metadata import version

    versions = {p: version(p) for p in ("fl4health", "flwr", "opacus", "torch", "hivemind")}
    path = write_json(args.out, dict(benchmark="vs_fl4health", args=vars(args), versions=versions,
                                     swarm_opt_source=fingerprint, elapsed_s=time.monotonic() - started,
                                     shard_sizes=[len(s) for s in shards], summaries=summaries, goals=lines,
                                     runs=results))
    print(f"wrote {path}")
    print(f"reproduce: {command_line()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=50, help="local steps per client / peer per round")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="model init, split and batch order")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--min-samples", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds of sleep per local step, both sides")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="DP-SGD's sigma, both sides")
    parser.add_argument("--clip", type=float, default=1.0, help="DP-SGD's per-sample clipping bound, both sides")
    parser.add_argument("--delta", type=float, default=1e-5, help="the delta epsilon is reported at")
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--shares", choices=SHARES, default="equal", help="how swarm_opt splits a round's global "
                        "batch among its peers (TrackerConfig.shares): 'equal', --steps each as FL4Health's clients")
    parser.add_argument("--averaging-timeout", type=float, default=60.0)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="a side stops training after this long")
    parser.add_argument("--out", default="vs_fl4health.json")
    parser.add_argument("--in-process", metavar="JSON", help="run swarm_opt's side in one process (every peer exactly "
                        "--steps steps and in every round; times not comparable) against FL4Health's results in JSON, "
                        "a saved run of this script with the same settings")
    parser.add_argument("--fl4h-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fl4h-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--strategy-name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fl4h_server:
        return fl4h_server(args)
    if args.fl4h_client:
        return fl4h_client(args)
    if args.worker:
        return worker(args, swarm_setup)
    # noniid.run_swarm's names for the real run's settings
    args.real_seed, args.real_rounds = args.seed, args.rounds
    torch.set_num_threads(1)
    print(f"command: {command_line()}", flush=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
