"""Serverless SCAFFOLD through Lightning: the non-IID setting of ``noniid.py``, with every peer a Lightning Trainer.

MNIST-5k, ``--peers`` real peer processes on loopback, Dirichlet(α) label split, MLP 784-64-10, inner SGD lr 0.05,
batch 32, K = 100 steps per peer per round: data, split, model, batch order, peer protocol and per-round records are
``noniid.py``'s (its ``--real`` mode), only the training loop differs. For each α, LocalUpdates (FedAvg) and Scaffold
run once through the plain loop (``noniid.worker``: ``opt.step()`` by hand) and once through Lightning (this file's
``worker``: a ``LightningModule`` that knows nothing of the swarm, ``Trainer(callbacks=[SwarmCallback(...)])``).

Reported: test accuracy per round (mean over the peers that committed it), the final accuracy (mean of the last 5
rounds), SCAFFOLD's gain over FedAvg, and wall time per round (median of the intervals between rounds, which include
the K steps, matchmaking and the all-reduce): SCAFFOLD against FedAvg, Lightning against the plain loop. Real peers
do not run exactly K steps per round (rounds start when the swarm's samples reach the target), so each run is also
replayed in one process with its own schedule (``noniid.replay``): the real run must match its replay, whatever the
loop; differences between the loops that their replays share come from the schedule.

    python benchmarks/lightning_scaffold.py                          # α 0.1 and 0.01, 15 rounds
    python benchmarks/lightning_scaffold.py --alphas 0.1 --rounds 8  # shorter
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import noniid
import torch
from _common import STRATEGIES, command_line, join_loopback_swarm, table, wait_for, write_json

LOOPS = ("plain", "lightning")
NAMES = ("local", "scaffold")  # keys of _common.STRATEGIES


# --- one Lightning peer ---------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """``noniid.worker`` with Lightning in place of the hand-written loop: same files, arguments and records."""
    logging.basicConfig(level=logging.WARNING, format=f"[peer {args.rank}] %(asctime)s %(levelname)s %(name)s: "
                                                      f"%(message)s")
    logging.getLogger("swarm_opt").setLevel(logging.INFO)
    torch.set_num_threads(1)
    import lightning as L

    from swarm_opt.lightning import SwarmCallback

    class Classifier(L.LightningModule):  # a plain LightningModule: nothing in it knows about the swarm
        def __init__(self, model: torch.nn.Module, lr: float) -> None:
            super().__init__()
            self.model, self.lr = model, lr

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return noniid.make_inner(self.parameters(), self.lr)

    class ShardBatches(torch.utils.data.IterableDataset):  # noniid's endless batch stream over this peer's shard
        def __init__(self, x: torch.Tensor, y: torch.Tensor, shard: torch.Tensor) -> None:
            self.x, self.y, self.shard = x, y, shard

        def __iter__(self):
            for positions in noniid.batch_stream(len(self.shard), args.batch_size,
                                                 noniid.stream_seed(args.seed, args.rank)):
                idx = self.shard[positions]
                yield self.x[idx], self.y[idx]

    class Rounds(L.Callback):
        """The start protocol of ``noniid.run_swarm`` and ``noniid.worker``'s per-round records."""

        def __init__(self, tmp: Path, xt: torch.Tensor, yt: torch.Tensor) -> None:
            self.tmp, self.xt, self.yt = tmp, xt, yt
            self.rounds: List[dict] = []
            self.steps, self.last, self.start = 0, None, 0.0

        def on_fit_start(self, trainer, module) -> None:
            opt = trainer.optimizers[0]
            deadline = time.monotonic() + 120
            while opt.progress.num_peers < args.peers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"saw only {opt.progress.num_peers} of {args.peers} peers after 120 s")
                time.sleep(0.05)
            (self.tmp / f"ready{args.rank}").touch()
            wait_for(self.tmp / "go", 300, "the orchestrator did not give the start signal")
            time.sleep(max(0.0, float((self.tmp / "go").read_text()) - time.time()))
            self.rounds = [dict(epoch=0, accuracy=noniid.accuracy(module.model, self.xt, self.yt), steps=0, t=0.0)]
            self.start = time.perf_counter()
            self.stop_at = time.monotonic() + args.max_seconds

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            opt = trainer.optimizers[0]
            self.steps += 1
            if opt.last_round is not self.last:
                self.last = opt.last_round
                self.rounds.append(dict(self.last.__dict__, accuracy=noniid.accuracy(module.model, self.xt, self.yt),
                                        steps=self.steps, t=time.perf_counter() - self.start))
                self.steps = 0
            if opt.local_epoch >= args.rounds or time.monotonic() > self.stop_at:
                trainer.should_stop = True
            time.sleep(args.step_sleep)

        def on_train_end(self, trainer, module) -> None:
            opt = trainer.optimizers[0]
            result = dict(rank=args.rank, epoch=opt.local_epoch, wall_s=time.perf_counter() - self.start,
                          rounds=self.rounds, payload_bytes=noniid.payload_bytes(opt.strategy.buffer_templates()))
            torch.save([p.detach().clone() for p in module.parameters()], self.tmp / f"params{args.rank}.pt")
            (self.tmp / f"result{args.rank}.tmp").write_text(json.dumps(result))
            os.replace(self.tmp / f"result{args.rank}.tmp", self.tmp / f"result{args.rank}.json")
            wait_for(self.tmp / "stop", args.max_seconds, "the orchestrator did not send the stop signal")

    tmp = Path(args.tmp)
    data = torch.load(tmp / "data.pt")
    x, y, xt, yt, shard = data["x"], data["y"], data["xt"], data["yt"], data["shards"][args.rank]
    module = Classifier(noniid.make_model(args.seed), args.lr)
    dht = join_loopback_swarm(tmp, args.rank, timeout=120)
    try:
        swarm = SwarmCallback(
            dht=dht, run_id=f"noniid_{args.strategy_name}", target_batch_size=args.peers * args.steps * args.batch_size,
            batch_size=args.batch_size, strategy=STRATEGIES[args.strategy_name].make(),
            matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)
        trainer = L.Trainer(max_epochs=1, callbacks=[swarm, Rounds(tmp, xt, yt)], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu", devices=1, num_sanity_val_steps=0)
        trainer.fit(module, torch.utils.data.DataLoader(ShardBatches(x, y, shard), batch_size=None))
    finally:
        dht.shutdown()


# --- the comparison -------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    fingerprint = noniid.code_fingerprint()
    x, y, xt, yt = noniid.load_data(args.split_seed)
    runs: Dict[str, Dict[str, Dict[str, dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="lightning_scaffold_") as tmp_name:
        tmp = Path(tmp_name)
        for alpha in args.alphas:
            shards, _ = noniid.dirichlet_split(y, args.peers, alpha, args.seed, args.min_samples)
            torch.save(dict(x=x, y=y, xt=xt, yt=yt, shards=shards), tmp / "data.pt")
            runs[str(alpha)] = {loop: {} for loop in LOOPS}
            for name in NAMES:
                for loop in LOOPS:  # the two loops back to back, so that they see the same machine load
                    swarm_args = argparse.Namespace(**vars(args), real_seed=args.seed, real_rounds=args.rounds,
                                                    out_real=f"lightning_scaffold_{loop}")
                    script = noniid.__file__ if loop == "plain" else __file__
                    started = time.monotonic()
                    try:
                        peers = noniid.run_swarm(swarm_args, name, tmp, script=script)
                    except RuntimeError as e:  # a peer died: keep the other runs, say which one failed and why
                        print(f"  alpha={alpha} {loop} {name}: FAILED: {str(e).splitlines()[0][:200]}", flush=True)
                        runs[str(alpha)][loop][name] = dict(failed=str(e)[-2000:])
                        continue
                    per_round = noniid.swarm_per_round(peers, args.rounds)
                    # the same code in one process with this run's own schedule (steps per peer per round): a
                    # difference between the loops' accuracies that the replays share is the schedule's, not a bug
                    replay = noniid.replay(name, peers, shards, swarm_args)
                    runs[str(alpha)][loop][name] = dict(per_round=per_round, peers=peers, replay=replay,
                                                        elapsed_s=time.monotonic() - started,
                                                        **stats(per_round, replay))
                    r = runs[str(alpha)][loop][name]
                    print(f"  alpha={alpha} {loop} {name}: final {100 * r['final']:.2f} %, round "
                          f"{r['round_s']:.2f} s (median), max |real - replay| {100 * r['vs_replay']:.2f} pp",
                          flush=True)
    report(runs, args)
    if noniid.code_fingerprint() != fingerprint:
        print("WARNING: swarm_opt's source changed during the run", file=sys.stderr)
    path = write_json(args.out, {"benchmark": "lightning_scaffold", "args": vars(args), "runs": runs,
                                 "swarm_opt_source": fingerprint, "command": command_line()})
    print(f"wrote {path}\nreproduce: {command_line()}")


def stats(per_round: List[dict], replay: dict) -> dict:
    accs = [p["accuracy_mean"] for p in per_round if p["accuracy_mean"] is not None]
    times = [b["t"] - a["t"] for a, b in zip(per_round, per_round[1:]) if a["t"] is not None and b["t"] is not None]
    vs_replay = max(abs(p["accuracy_mean"] - r) for p, r in zip(per_round, replay["accuracy"][1:])
                    if p["accuracy_mean"] is not None)
    return dict(final=statistics.fmean(accs[-noniid.LAST:]), round_s=statistics.median(times), vs_replay=vs_replay,
                replay_exact=replay["exact"])


def report(runs: dict, args: argparse.Namespace) -> None:
    runs = {alpha: loops for alpha, loops in runs.items()
            if not any("failed" in r for loop in loops.values() for r in loop.values())}  # tables need all four
    for alpha, loops in runs.items():
        headers = ["round"] + [f"{loop} {name}" for loop in LOOPS for name in NAMES]
        rows = [[r + 1] + [f"{100 * (loops[loop][name]['per_round'][r]['accuracy_mean'] or 0):.2f}"
                           for loop in LOOPS for name in NAMES] for r in range(args.rounds)]
        print(f"\nalpha = {alpha}: test accuracy (%) per round")
        print(table(headers, rows))
    headers = ["alpha", "loop", "FedAvg %", "SCAFFOLD %", "gain pp", "round s FedAvg", "round s SCAFFOLD",
               "SCAFFOLD / FedAvg", "vs plain (FedAvg, SCAFFOLD)", "replay gap pp"]
    rows = []
    for alpha, loops in runs.items():
        for loop in LOOPS:
            f, s = loops[loop]["local"], loops[loop]["scaffold"]
            vs_plain = [loops[loop][n]["round_s"] / loops["plain"][n]["round_s"] for n in NAMES]
            rows.append([alpha, loop, f"{100 * f['final']:.2f}", f"{100 * s['final']:.2f}",
                         f"{100 * (s['final'] - f['final']):+.2f}", f"{f['round_s']:.2f}", f"{s['round_s']:.2f}",
                         f"{s['round_s'] / f['round_s']:.3f}x",
                         ", ".join(f"{ratio:.3f}x" for ratio in vs_plain),
                         f"{100 * max(f['vs_replay'], s['vs_replay']):.2f}"])
    print(f"\nfinal accuracy = mean of the last {noniid.LAST} rounds; round time = median interval between rounds")
    print(table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100, help="K: local steps per peer per round")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="inner SGD learning rate")
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--min-samples", type=int, default=10)
    parser.add_argument("--matchmaking-time", type=float, default=2.0)
    parser.add_argument("--averaging-timeout", type=float, default=60.0)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds of sleep per peer step")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="a peer stops training after this long")
    parser.add_argument("--out", default="lightning_scaffold.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--strategy-name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    torch.set_num_threads(1)
    print(f"command: {command_line()}", flush=True)
    run(args)


if __name__ == "__main__":
    sys.exit(main())
