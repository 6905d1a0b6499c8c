"""What ``vs_nvflare.py``'s Lightning scripts share: the LightningModule, one client's data, the per-round records.

``lit_plain.py`` is a plain Lightning script (one client training alone); ``lit_nvflare.py`` is it with NVFlare's
Lightning client API, ``lit_swarm.py`` with ``swarm_opt.lightning.SwarmCallback``. The three import everything else
from here, so that what differs between them is what each framework asks of a user's script.

The module is ``noniid.py``'s model (MLP 784-64-10, ``torch.manual_seed(seed)``) and inner optimizer (SGD, no
momentum); the batches are ``noniid.py``'s stream of client i over its Dirichlet shard, one stream for the whole run
(NVFlare calls ``trainer.fit`` once per round: the stream goes on where the last round left it). NVFlare's client API
is built on ``pytorch_lightning``, ``SwarmCallback`` on ``lightning.pytorch``: the same module code is a subclass of
either's ``LightningModule`` (``classifier``).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

#: where a client's time goes, per round: forward and backward (``compute``); the optimizer's step (``step``); the
#: step that ran swarm_opt's round, or NVFlare's time between two ``fit`` calls (send, aggregate, receive: ``round``);
#: the stand-in compute (``sleep``). The rest of a round is Lightning's loop and other callbacks' hooks.
PHASES = ("compute", "step", "round", "sleep")


def parse_args() -> argparse.Namespace:
    """The options every script takes (vs_nvflare.py passes them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tmp", required=True, help="folder with data.pt; records are written here")
    parser.add_argument("--rank", type=int, default=0, help="which shard (NVFlare: from the site name)")
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="local steps per round")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--strategy", default="LocalUpdates", help="swarm_opt's strategy class")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[client {args.rank}] %(asctime)s %(levelname)s %(name)s: "
                                                      f"%(message)s")
    logging.getLogger("swarm_opt").setLevel(logging.INFO)  # one line per round, in the peers' logs
    return args


class ClassifierCode:
    """The LightningModule's own code, written once; ``classifier`` puts it on a Lightning package's base.
    ``seed`` and ``lr`` are kept as attributes: NVFlare rebuilds the server's copy from them."""

    def __init__(self, seed: int = 0, lr: float = 0.05) -> None:
        import noniid

        super().__init__()
        self.seed, self.lr = seed, lr
        self.model = noniid.make_model(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        import noniid

        return noniid.make_inner(self.parameters(), self.lr)


_CLASSES: Dict[str, type] = {}


def classifier(pl: Any) -> type:
    """The LightningModule class on ``pl`` (``pytorch_lightning`` or ``lightning.pytorch``), importable by its name
    from this module (NVFlare's job names the server's initial model by its import path)."""
    name = "Classifier_" + pl.__name__.replace(".", "__")
    if name not in _CLASSES:
        _CLASSES[name] = type(name, (ClassifierCode, pl.LightningModule), {"__module__": __name__})
    return _CLASSES[name]


def __getattr__(name: str) -> Any:  # NVFlare's server process: `lit_mnist.Classifier_pytorch_lightning`
    if name.startswith("Classifier_"):
        return classifier(importlib.import_module(name[len("Classifier_"):].replace("__", ".")))
    raise AttributeError(name)


class ShardBatches(torch.utils.data.IterableDataset):
    """Client ``rank``'s endless batch stream (``noniid.batch_stream``), one stream for the whole run. Lightning
    fetches a batch ahead; a batch it fetched and never trained (the one after a round's last step, when NVFlare's
    client ends a ``fit``) comes first in the next iterator, so that every side trains on the same batches."""

    def __init__(self, args: argparse.Namespace) -> None:
        import noniid

        data = torch.load(Path(args.tmp) / "data.pt")
        self.x, self.y, shard = data["x"], data["y"], data["shards"][args.rank]
        positions = noniid.batch_stream(len(shard), args.batch_size, noniid.stream_seed(args.seed, args.rank))
        self.stream = (shard[p] for p in positions)
        self.fetched: List[torch.Tensor] = []  # handed to Lightning, not trained yet (``trained``)

    def __iter__(self):
        ahead, self.fetched = self.fetched, []
        for idx in itertools.chain(ahead, self.stream):
            self.fetched.append(idx)
            yield self.x[idx], self.y[idx]

    def trained(self) -> None:
        """Lightning trained the oldest batch it fetched."""
        self.fetched.pop(0)


def loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ShardBatches(args), batch_size=None)


def initial_peers(args: argparse.Namespace) -> List[str]:
    """swarm_opt's peers on loopback: none for rank 0 (it publishes its DHT's addresses in ``maddrs.json`` as its
    fit starts: ``RoundsCode.on_fit_start``), rank 0's for the others."""
    if args.rank == 0:
        return []
    from _common import wait_for

    wait_for(Path(args.tmp) / "maddrs.json", 120, "rank 0 did not publish its DHT address")
    return json.loads((Path(args.tmp) / "maddrs.json").read_text())


def rounds_callback(pl: Any, args: argparse.Namespace) -> Any:
    """The benchmark's own callback on ``pl`` (the same line in every script): per-round records, the stand-in
    compute (``--step-sleep`` per step) and, for swarm_opt's peers, the start protocol of ``noniid.run_swarm``."""
    return type("Rounds", (RoundsCode, pl.Callback), {})(args)


class RoundsCode:
    """Records, per round: the test accuracy of the model that round produced, when it ended, the steps taken, where
    the time went (``PHASES``) and (swarm_opt) the bytes its all-reduces moved so far.

    swarm_opt: a round ends when the swarm optimizer's ``last_round`` changes (recorded after that step).
    NVFlare: each ``trainer.fit`` is one round, started with the global model of the round before; every client
    evaluates it at its first batch, so round r's model is recorded at the start of round r + 1 (the last one by
    ``vs_nvflare.py``, from the model the server saved), with round r's phases."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.tmp = Path(args.tmp)
        data = torch.load(self.tmp / "data.pt")
        self.xt, self.yt = data["xt"], data["yt"]
        self.rounds: List[Dict[str, Any]] = []
        self.steps = 0
        self.start: Optional[float] = None
        self.first_batch = False
        self.last = None
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.batch_started = self.stepping = 0.0
        self.fit_ended: Optional[float] = None

    def accuracy(self, module: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((module(self.xt).argmax(dim=1) == self.yt).float().mean())

    def record(self, module: torch.nn.Module, now: float, **extra: Any) -> None:
        self.rounds.append(dict(extra, accuracy=self.accuracy(module), steps=self.steps, t=now - self.start,
                                **self.phases))
        self.steps = 0
        self.phases = dict.fromkeys(PHASES, 0.0)

    def on_fit_start(self, trainer, module) -> None:
        opt = trainer.optimizers[0]
        if hasattr(opt, "progress") and self.start is None:  # a swarm_opt peer: noniid.run_swarm's start protocol
            from _common import wait_for

            if self.args.rank == 0:
                dht = next(cb.dht for cb in trainer.callbacks if getattr(cb, "dht", None) is not None)
                (self.tmp / "maddrs.tmp").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
                os.replace(self.tmp / "maddrs.tmp", self.tmp / "maddrs.json")
            deadline = time.monotonic() + 120
            while opt.progress.num_peers < self.args.peers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"saw only {opt.progress.num_peers} of {self.args.peers} peers after 120 s")
                time.sleep(0.05)
            (self.tmp / f"ready{self.args.rank}").touch()
            wait_for(self.tmp / "go", 300, "the orchestrator did not give the start signal")
            time.sleep(max(0.0, float((self.tmp / "go").read_text()) - time.time()))
            self.start = time.perf_counter()
            self.record(module, self.start, epoch=0)
            self.stop_at = time.monotonic() + self.args.max_seconds
        self.first_batch = not hasattr(opt, "progress")

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.batch_started = now = time.perf_counter()
        if self.first_batch:  # NVFlare: the first batch of a round; the global model is loaded by now
            self.first_batch = False
            if self.start is None:
                self.start = now
            self.phases["round"] = 0.0 if self.fit_ended is None else now - self.fit_ended
            self.record(module, now, epoch=len(self.rounds))

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.stepping = time.perf_counter()
        self.phases["compute"] += self.stepping - self.batch_started

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.steps += 1
        trainer.train_dataloader.dataset.trained()
        opt = trainer.optimizers[0]
        committed = hasattr(opt, "progress") and opt.last_round is not self.last
        self.phases["round" if committed else "step"] += now - self.stepping
        if committed:
            self.last = opt.last_round
            sent, received = opt._averager.traffic
            self.record(module, now, **self.last.__dict__, bytes_sent=sent, bytes_received=received)
        if hasattr(opt, "progress") and (opt.local_epoch >= self.args.rounds or time.monotonic() > self.stop_at):
            trainer.should_stop = True
        time.sleep(self.args.step_sleep)
        self.phases["sleep"] += time.perf_counter() - now

    def on_train_end(self, trainer, module) -> None:
        self.fit_ended = time.perf_counter()
        result = dict(rank=self.args.rank, rounds=self.rounds, wall_s=self.fit_ended - (self.start or self.fit_ended))
        opt = trainer.optimizers[0]
        if hasattr(opt, "progress"):
            result.update(epoch=opt.local_epoch, payload_bytes=4 * sum(t.numel()
                                                                      for t in opt.strategy.buffer_templates()))
            torch.save([p.detach().clone() for p in module.parameters()], self.tmp / f"params{self.args.rank}.pt")
        (self.tmp / f"result{self.args.rank}.tmp").write_text(json.dumps(result))
        os.replace(self.tmp / f"result{self.args.rank}.tmp", self.tmp / f"result{self.args.rank}.json")
        if hasattr(opt, "progress"):  # stay a state donor until every peer is done
            from _common import wait_for

            wait_for(self.tmp / "stop", self.args.max_seconds, "the orchestrator did not send the stop signal")
