"""A Hugging Face ``Trainer`` test peer: a tiny GPT-2 built from a config (no download) trained through
``swarm_opt.transformers.SwarmCallback``.

Run as ``python trainer_peer.py CONFIG.json`` (through ``tests/swarm/conftest.py``'s ``Swarm.start(script=...)``);
writes CONFIG["out"] (torch.save) with the final parameters, the parameters at every global epoch, the round reports
and, as ``tests/swarm/peer.py`` does, the samples this peer committed to each epoch (``committed``) and those it
dropped when it caught up (``discarded``). Each rank trains on its own shard of ``make_data()`` with its own
``per_device_train_batch_size`` x ``gradient_accumulation_steps``; a data collator logs the indices of every batch.
With ``checkpoint``, Trainer saves a checkpoint every ``save_steps`` of this peer; ``resume`` restarts from one.
With ``"local": {"rank": r, "size": n, "port": p}`` the process is rank r of a machine of n DDP processes (one peer),
launched as ``torchrun`` launches them (its environment variables; gloo on loopback port p); the machine's data
shard is ``rank``'s, which Trainer splits between its processes.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import TrainerCallback  # noqa: E402

from swarm_opt import testing  # noqa: E402
from tests.swarm.peer import configure_logging  # noqa: E402

VOCAB, SEQ, SAMPLES = 64, 12, 960


def make_data() -> torch.Tensor:
    """SAMPLES token sequences of length SEQ (a fixed draw)."""
    return torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))


def shard(rank: int, peers: int) -> list:
    """The indices of rank's samples: every peers-th sample."""
    return list(range(rank, SAMPLES, peers))


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # founders share one initial model
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.4)  # gradients above max_grad_norm
    return GPT2LMHeadModel(config)


def training_arguments(cfg: dict, output_dir: str, **extra):
    """What every peer and the one-process reference share: AdamW with weight decay, warmup + linear decay over
    ``epochs`` global epochs, ``max_grad_norm``. ``adam_epsilon=1e-6``: some gradients are zero but for float32
    rounding (attention's key biases: softmax ignores a constant), and Adam with its default 1e-8 would turn that
    rounding, which differs between one process and the swarm's sums, into steps of the full learning rate."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=cfg.get("max_steps", cfg["epochs"]), learning_rate=cfg.get("lr", 3e-3),
        weight_decay=0.1, adam_epsilon=1e-6, lr_scheduler_type="linear", warmup_steps=cfg.get("warmup_steps", 2),
        max_grad_norm=cfg.get("max_grad_norm", 1.0),
        report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True, logging_steps=5, **extra)


class Shard(torch.utils.data.Dataset):
    """This rank's samples, repeated: a peer needs more steps than one Trainer would make."""

    def __init__(self, data: torch.Tensor, indices: list, repeat: int) -> None:
        self.data, self.indices, self.repeat = data, indices, repeat

    def __len__(self) -> int:
        return len(self.indices) * self.repeat

    def __getitem__(self, i: int) -> dict:
        index = self.indices[i % len(self.indices)]
        return {"index": index, "input_ids": self.data[index]}


class LoggingCollator:
    """Stacks a batch and logs its sample indices, in the order the data loader produced them."""

    def __init__(self) -> None:
        self.batches: collections.deque = collections.deque()

    def __call__(self, features: list) -> dict:
        self.batches.append([f["index"] for f in features])
        ids = torch.stack([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids}


def main(config_path: str) -> None:
    configure_logging(json.load(open(config_path))["out"])
    from transformers import Trainer

    import swarm_opt
    from swarm_opt.transformers import SwarmCallback

    cfg = json.load(open(config_path))
    local = cfg.get("local")
    if local:  # what torchrun sets for each of its processes: Trainer (Accelerate) starts DDP over gloo from them
        os.environ.update(RANK=str(local["rank"]), LOCAL_RANK=str(local["rank"]), WORLD_SIZE=str(local["size"]),
                          LOCAL_WORLD_SIZE=str(local["size"]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(local["port"]))
    data = make_data()
    model = make_model()
    collator = LoggingCollator()
    swarm = SwarmCallback(
        run_id=cfg.get("run_id", "trainer_run"), target_batch_size=cfg["target_batch_size"],
        initial_peers=testing.initial_peers(cfg) if not local or local["rank"] == 0 else [],  # (rank 0's DHT only)
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        matchmaking_time=cfg.get("matchmaking_time", 1.0), averaging_timeout=cfg.get("averaging_timeout", 15.0),
        tracker=swarm_opt.TrackerConfig(max_extrapolation=cfg.get("max_extrapolation", 2.0)))
    checkpoints = dict(save_strategy="steps", save_steps=cfg.get("save_steps", 2), save_total_limit=3) \
        if cfg.get("checkpoint") else dict(save_strategy="no")
    args = training_arguments(cfg, cfg["out"] + ".trainer", per_device_train_batch_size=cfg["batch_size"],
                              gradient_accumulation_steps=cfg.get("accumulate", 1), bf16=cfg.get("bf16", False),
                              **checkpoints)
    recorder = Recorder(cfg, swarm, collator)
    machine = cfg.get("machine", cfg["rank"])  # the data shard: one per peer (a machine's ranks share theirs)
    trainer = Trainer(model=model, args=args, train_dataset=Shard(data, shard(machine, cfg["peers"]), 100),
                      data_collator=collator, callbacks=[recorder, swarm, LogTap(recorder)])
    if cfg.get("resume"):  # started early (imports are slow): resume once the test put the checkpoint there
        open(cfg["out"] + ".ready", "w").close()
        _wait_for_file(os.path.join(cfg["resume"], "trainer_state.json"))
    trainer.train(resume_from_checkpoint=cfg.get("resume"))


def _wait_for_file(path: str) -> None:
    deadline = time.monotonic() + 90
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)


class Recorder(TrainerCallback):
    """Listed before ``SwarmCallback``: publishes the DHT's addresses and waits for the expected peers at the first
    step, records which batches went into which epoch and the parameters at every epoch change, and at the end
    saves the result and lingers as a donor (before the swarm callback leaves) until the test says stop."""

    def __init__(self, cfg: dict, swarm, collator: LoggingCollator) -> None:
        self.cfg, self.swarm, self.collator = cfg, swarm, collator
        self.committed, self.discarded, self.discarded_versions = {}, {}, {}
        self.pending, self.rounds, self.params, self.lrs, self.logged = [], [], {}, {}, {}
        self.last_round, self.version, self.resumed_at, self.model = None, 0, None, None

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        opt = self.swarm.optimizer
        if self.model is None:  # the first step: the swarm optimizer exists (SwarmCallback.on_train_begin)
            self.model = model
            if self.swarm.dht is not None:  # (a machine's other processes hold none)
                testing.write_addresses(self.swarm.dht.get_visible_maddrs(), self.cfg["out"] + ".maddrs")
            wait_until = time.monotonic() + (30 if self.swarm.dht is not None else 0)
            while opt.progress.num_peers < self.cfg.get("expect_peers", 1) and time.monotonic() < wait_until:
                time.sleep(0.05)
            self.resumed_at = opt.local_epoch if state.global_step > 0 else None
            self.params[opt.local_epoch] = _params(model)
        self.version = opt.local_epoch  # the epoch of the parameters this step's gradients are computed at

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        opt = self.swarm.optimizer
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.pending.append(([i for _ in range(args.gradient_accumulation_steps)
                              for i in self.collator.batches.popleft()], self.version))
        if opt.last_round is self.last_round:
            return
        report = self.last_round = opt.last_round
        self.rounds.append(dict(report.__dict__, time=time.time(), grad_norm=opt.grad_norm))
        if not report.caught_up:  # the round's batches come first (as in peer.py)
            used = report.samples // (per_step * args.world_size)  # a machine's samples: all its processes'
            self.committed[report.epoch] = [b for b, _ in self.pending[:used]]
            self.pending = self.pending[used:]
        else:
            self.discarded[report.epoch] = [b for b, _ in self.pending]
            self.discarded_versions[report.epoch] = [v for _, v in self.pending]
            self.pending = []
        self.params[opt.local_epoch] = _params(self.model)
        self.lrs[opt.local_epoch] = opt.param_groups[0]["lr"]
        together = [r for r in self.rounds if not r["caught_up"] and r["group_size"] > 1]
        if len(together) >= self.cfg.get("signal_after_rounds", float("inf")):
            open(self.cfg["until_file"], "a").close()  # e.g. a resumed peer trained with the others again

    def on_step_end(self, args, state, control, **kwargs) -> None:
        time.sleep(self.cfg.get("step_sleep", 0.0))  # a slower step: epochs longer than a catch-up under load
        until = self.cfg.get("until_file")  # then max_steps is far: the run ends at `epochs` once that file exists
        done = until is not None and self.swarm.optimizer.local_epoch >= self.cfg["epochs"] and os.path.exists(until)
        if done or time.monotonic() - START > self.cfg.get("max_seconds", 150):
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs) -> None:
        opt = self.swarm.optimizer
        result = dict(rank=self.cfg["rank"], epoch=opt.local_epoch, committed=self.committed,
                      discarded=self.discarded, discarded_versions=self.discarded_versions, rounds=self.rounds,
                      params=self.params, final=_params(self.model), lrs=self.lrs, resumed_at=self.resumed_at,
                      global_step=state.global_step, logged=self.logged, max_grad_norm=args.max_grad_norm,
                      checkpoints=sorted(os.listdir(args.output_dir)) if os.path.isdir(args.output_dir) else [])
        torch.save(result, self.cfg["out"] + ".tmp")
        os.replace(self.cfg["out"] + ".tmp", self.cfg["out"])
        linger_until = time.monotonic() + self.cfg.get("linger", 60.0)
        while time.monotonic() < linger_until and not os.path.exists(self.cfg["out"] + ".stop"):
            time.sleep(0.1)


class LogTap(TrainerCallback):
    """Listed after ``SwarmCallback``: keeps the swarm's figures of the last log."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.recorder.logged = {k: v for k, v in (logs or {}).items() if k.startswith("swarm/")}


def _params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


START = time.monotonic()

if __name__ == "__main__":
    main(sys.argv[1])
    gc.freeze()
