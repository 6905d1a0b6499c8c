"""A Lightning test peer: a real ``Trainer`` trains a ``LightningModule`` through ``SwarmCallback``.

Run as ``python lightning_peer.py CONFIG.json`` (through ``tests/swarm/conftest.py``'s ``Swarm.start(script=...)``);
writes CONFIG["out"] (torch.save) with the parameters at every global epoch and the round reports. Modules:

* ``boring``: Lightning's ``BoringModel``, unchanged; ``demo``: Lightning's ``DemoModel`` (Adam) on random data.
* ``lsq`` / ``mlp`` in lockstep (``steps_per_round``): each peer completes exactly that many optimizer steps per
  round on its own data, then waits for the round by stepping with non-finite gradients (skipped, as in
  ``peer.py``'s ``run_lsq``), so that a run is deterministic. ``lsq`` is ``peer.py``'s least-squares problem;
  ``mlp`` takes consecutive micro-batches of ``batch_size`` samples of this rank's data (so accumulation over
  micro-batches of 8 sees the same samples as batches of 32).
* ``mlp`` without ``steps_per_round``: random batches, as ``peer.py``'s ``run_mlp``; ``checkpoint`` saves a Lightning
  checkpoint at every global epoch (``OUT.ckpt``, atomically), ``resume`` restarts from one with ``ckpt_path``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import lightning as L
import torch

from swarm_opt import testing
from tests.swarm.peer import configure_logging, lsq_problem, make_data, make_model, make_strategy


def main(config_path: str) -> None:
    configure_logging(json.load(open(config_path))["out"])
    from lightning.pytorch.plugins.precision import MixedPrecision

    import swarm_opt
    from swarm_opt.lightning import SwarmCallback

    cfg = json.load(open(config_path))
    L.seed_everything(0, verbose=False)  # founders share one initial model
    module, loader = build(cfg)
    # each peer its own data order; under strategy="ddp" each rank (Lightning's launcher sets LOCAL_RANK in rank 1..)
    torch.manual_seed(1000 + cfg["rank"] + 7919 * int(os.environ.get("LOCAL_RANK", "0")))
    swarm = SwarmCallback(
        run_id=cfg.get("run_id", "lightning_run"), target_batch_size=cfg["target_batch_size"],
        initial_peers=testing.initial_peers(cfg), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        strategy=make_strategy(cfg.get("strategy", "grad")), batch_size=cfg.get("callback_batch_size"),
        matchmaking_time=cfg.get("matchmaking_time", 1.0), averaging_timeout=cfg.get("averaging_timeout", 15.0),
        tracker=swarm_opt.TrackerConfig(max_extrapolation=cfg.get("max_extrapolation", 2.0)))
    precision = cfg.get("precision", "32-true")
    plugins = [MixedPrecision("16-mixed", "cpu")] if precision == "16-mixed" else []  # Lightning maps it to bf16
    trainer = L.Trainer(
        max_epochs=10_000, callbacks=[swarm, Recorder(cfg, swarm)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=cfg.get("devices", 1),
        strategy=cfg.get("lightning_strategy", "auto"),  # "ddp" with devices=2: one peer of two ranks
        precision=None if plugins else precision, plugins=plugins,
        accumulate_grad_batches=cfg.get("accumulate", 1), gradient_clip_val=cfg.get("gradient_clip_val"),
        limit_val_batches=cfg.get("limit_val_batches", 0), num_sanity_val_steps=0)
    if cfg.get("resume"):  # started early (imports are slow): resume once the test put the checkpoint there
        open(cfg["out"] + ".ready", "w").close()
        _wait_for_file(cfg["resume"])
    trainer.fit(module, train_dataloaders=loader, ckpt_path=cfg.get("resume"))


def _wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 90
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)


def build(cfg: dict):
    from lightning.pytorch.demos.boring_classes import BoringModel, DemoModel, RandomDataset
    from torch.utils.data import DataLoader

    kind = cfg.get("module", "boring")
    if kind == "boring":
        return BoringModel(), None  # its own data loader
    if kind == "demo":
        return DemoModel(), DataLoader(RandomDataset(32, 4096), batch_size=cfg["batch_size"])
    return LockstepModule(cfg), DataLoader(Counter(), batch_size=cfg["batch_size"])


class Counter(torch.utils.data.Dataset):
    """Placeholder samples: the lockstep module picks its data itself, so that waiting steps consume none."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(1)


class LockstepModule(L.LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.task = cfg["module"]
        if self.task == "lsq":
            self.net = torch.nn.Linear(5, 1, bias=False).to(torch.float64)
            torch.nn.init.zeros_(self.net.weight)
            self.a, self.b = lsq_problem(cfg["rank"])
        else:
            self.net = make_model(torch.float64 if cfg.get("float64") else torch.float32)
            x, y = make_data()
            g = torch.Generator().manual_seed(1000 + cfg["rank"])
            order = torch.randperm(len(x), generator=g)
            self.x, self.y = x[order], y[order]
        self.steps_per_round = cfg.get("steps_per_round")
        self.steps_in_round, self.waiting, self.cursor = 0, False, 0
        self.overflow_at = cfg.get("overflow_at_step", {}).get(str(cfg["rank"]), -1)  # {rank: micro-batch}
        self.micro = 0

    def training_step(self, batch, batch_idx):
        acc = self.trainer.accumulate_grad_batches
        if batch_idx % acc == 0:  # one decision per optimizer step
            self.waiting = self.steps_per_round is not None and self.steps_in_round >= self.steps_per_round
            if not self.waiting:
                self.steps_in_round += 1
        self.micro += 1
        if self.task == "lsq":
            loss = 0.5 * (self.a @ self.net.weight[0] - self.b).pow(2).sum()
        else:
            bs = len(batch)
            lo = (self.cursor * bs) % len(self.x)
            if self.steps_per_round is not None and not self.waiting:
                self.cursor += 1
            elif self.steps_per_round is None:
                lo = int(torch.randint(0, len(self.x) - bs, (1,)))
            x, y = self.x[lo:lo + bs], self.y[lo:lo + bs]
            loss = torch.nn.functional.cross_entropy(self.net(x.to(self.net[0].weight.dtype)), y)
        if self.waiting:
            time.sleep(self.cfg.get("wait_sleep", 0.005))
            return loss * float("nan")
        if self.micro == self.overflow_at:
            return loss * float("inf")
        time.sleep(self.cfg.get("step_sleep", 0.0))
        return loss

    def configure_optimizers(self):
        if self.task == "lsq":
            return torch.optim.SGD(self.parameters(), lr=0.05)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Recorder(L.Callback):
    """Publishes the DHT's addresses, waits for the expected peers, records every epoch change, stops the run at
    ``epochs`` and lingers as a donor until the test says stop."""

    def __init__(self, cfg: dict, swarm) -> None:
        self.cfg, self.swarm = cfg, swarm
        self.rounds, self.params, self.last_round = [], {}, None

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:  # (the other ranks of a ddp peer hold no DHT)
            testing.write_addresses(self.swarm.dht.get_visible_maddrs(), self.cfg["out"] + ".maddrs")
        opt = trainer.optimizers[0]
        assert isinstance(opt, __import__("swarm_opt").Optimizer), type(opt)
        wait_until = time.monotonic() + (self.cfg.get("expect_wait", 30) if trainer.global_rank == 0 else 0)
        while opt.progress.num_peers < self.cfg.get("expect_peers", 1) and time.monotonic() < wait_until:
            time.sleep(0.05)
        if not self.cfg.get("resume"):  # a resumed peer's epoch is restored after this hook
            self.params[opt.local_epoch] = _params(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        opt = trainer.optimizers[0]
        if opt.last_round is not self.last_round:
            self.last_round = opt.last_round
            self.rounds.append(dict(self.last_round.__dict__, time=time.time(), w=_first_row(pl_module),
                                    d=_control(opt)))
            self.params[opt.local_epoch] = _params(pl_module)
            if isinstance(pl_module, LockstepModule):
                pl_module.steps_in_round = 0
            if self.cfg.get("checkpoint"):
                trainer.save_checkpoint(self.cfg["out"] + ".ckpt.tmp", weights_only=False)  # (else a log line)
                os.replace(self.cfg["out"] + ".ckpt.tmp", self.cfg["out"] + ".ckpt")
            together = [r for r in self.rounds if not r["caught_up"] and r["group_size"] > 1]
            if len(together) >= self.cfg.get("signal_after_rounds", float("inf")):
                open(self.cfg["until_file"], "a").close()  # e.g. a restarted peer trained with the others again
        until = self.cfg.get("until_file")  # with it, the run goes on past `epochs` until that file exists
        done = opt.local_epoch >= self.cfg["epochs"] and (until is None or os.path.exists(until))
        stop = done or time.monotonic() - START > self.cfg.get("max_seconds", 120)
        if trainer.world_size > 1:  # DDP's ranks stop at the same batch, or one would wait for the others forever
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        result = dict(rank=self.cfg["rank"], epoch=opt.local_epoch, rounds=self.rounds, params=self.params,
                      w=_first_row(pl_module),
                      final=_params(pl_module), lr=opt.param_groups[0]["lr"], global_step=trainer.global_step,
                      scale=None if scaler is None else scaler.get_scale(),
                      logged={k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("swarm/")})
        out = self.cfg["out"] if trainer.global_rank == 0 else f"{self.cfg['out']}.rank{trainer.global_rank}"
        torch.save(result, out + ".tmp")
        os.replace(out + ".tmp", out)
        linger_until = time.monotonic() + self.cfg.get("linger", 60.0)
        while time.monotonic() < linger_until and not os.path.exists(self.cfg["out"] + ".stop"):
            time.sleep(0.1)


def _params(module) -> list:
    return [p.detach().clone() for p in module.parameters()]


def _first_row(module) -> torch.Tensor:
    return next(iter(module.parameters())).detach().clone()[0]


def _control(opt):
    controls = getattr(opt.strategy, "controls", None)
    return None if controls is None else controls[0].clone()[0]


START = time.monotonic()

if __name__ == "__main__":
    main(sys.argv[1])
    gc.freeze()  # skips the interpreter's final collection of torch's modules (~1 s at exit); nothing left needs it
