"""What a training step costs through Hugging Face ``Trainer`` and ``swarm_opt.transformers.SwarmCallback``, apart
from the swarm's rounds.

One process, one peer whose ``target_batch_size`` is never reached (no round runs), a tiny GPT-2 built from a config
(2 layers, width 64, sequences of 32 tokens, batches of 8) with AdamW, ``max_grad_norm=1.0`` and a linear schedule.
Four loops over the same batches, interleaved in blocks so that a change of machine load hits all of them alike:

* ``torch``         -- a hand-written loop with the bare AdamW (clipping each step, as Trainer does);
* ``swarm_opt``     -- the same loop with ``swarm_opt.Optimizer(clip_grad_norm=1.0)`` (which clips the global
  batch's gradient instead: with no round, not at all);
* ``trainer``       -- a ``Trainer`` (its own AdamW, schedule and ``max_grad_norm``);
* ``trainer+swarm`` -- the same ``Trainer`` with ``SwarmCallback``.

Reported: microseconds per step (median over blocks) and the callback's own cost, two ways: the loops' difference
less the swarm optimizer's own (``(trainer+swarm - trainer) - (swarm_opt - torch)``, noisy: a difference of
differences, which this machine's load may bury), and what the callback adds to Trainer's dispatch of a step's
events, timed directly (``callback_events``): the goal's figure (<= 0.1 ms of our own per step).

    python benchmarks/trainer_overhead.py
    python benchmarks/trainer_overhead.py --blocks 10 --steps 200
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import torch
from _common import command_line, table, write_json  # also puts the repo on sys.path for swarm_opt

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOOPS = ("torch", "swarm_opt", "trainer", "trainer+swarm")
VOCAB, SEQ = 256, 32


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2))


def batches(steps: int, batch_size: int, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch_size, SEQ), generator=g) for _ in range(steps)]


def hand_loop(make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], data: List[torch.Tensor],
              clip: bool) -> float:
    """Seconds for one pass of a hand-written loop over ``data``."""
    model = make_model()
    opt = make_optimizer(model)
    try:
        start = time.perf_counter()
        for ids in data:
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return time.perf_counter() - start
    finally:
        if hasattr(opt, "shutdown"):
            opt.shutdown()


class Batches(torch.utils.data.Dataset):
    def __init__(self, data: List[torch.Tensor]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def trainer_loop(callbacks: Callable[[], list], data: List[torch.Tensor], workdir: str) -> float:
    """Seconds for one ``Trainer.train`` over ``data`` (timed from the first step's start to the last step's end)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_step_begin(self, *args, **kwargs) -> None:
            if not self.start:
                self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs) -> None:
            self.end = time.perf_counter()

    clock = Clock()
    args = TrainingArguments(output_dir=workdir, max_steps=len(data), per_device_train_batch_size=1,
                             learning_rate=1e-3, max_grad_norm=1.0, lr_scheduler_type="linear", report_to="none",
                             use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=make_model(), args=args, train_dataset=Batches(data),
                      data_collator=lambda items: {"input_ids": items[0], "labels": items[0]},
                      callbacks=[*callbacks(), clock])
    trainer.train()
    # the first step's start was not timed: scale to the whole pass
    return (clock.end - clock.start) * len(data) / max(1, len(data) - 1)


def callback_events(dht, run_id: str, steps: int) -> float:
    """Seconds per step that SwarmCallback adds to Trainer's event dispatch: the events Trainer raises around a step
    (``on_step_begin``, ``on_pre_optimizer_step``, ``on_optimizer_step``, ``on_step_end``), sent through Trainer's
    ``CallbackHandler`` with the callback (on a live swarm optimizer whose rounds never start) less without it."""
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler

    from swarm_opt.transformers import SwarmCallback

    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda epoch: 1.0)
    wrapper = type("AcceleratedOptimizer", (), dict(optimizer=inner, scaler=None))()
    with tempfile.TemporaryDirectory() as workdir:
        args = TrainingArguments(output_dir=workdir, max_steps=10 ** 9, max_grad_norm=1.0, report_to="none",
                                 use_cpu=True)
    cb = SwarmCallback(dht=dht, run_id=run_id, target_batch_size=10 ** 12)
    seconds = []
    try:
        for callbacks in ([cb], []):
            handler = CallbackHandler(callbacks, model, None, wrapper, scheduler)
            state, control = TrainerState(max_steps=10 ** 9), TrainerControl()
            handler.on_train_begin(args, state, control)
            start = time.perf_counter()
            for step in range(steps):
                handler.on_step_begin(args, state, control)
                handler.on_pre_optimizer_step(args, state, control)
                handler.on_optimizer_step(args, state, control)
                state.global_step = step + 1
                handler.on_step_end(args, state, control)
            seconds.append((time.perf_counter() - start) / steps)
    finally:
        cb.leave()
    return seconds[0] - seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per loop (after one warm-up block)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="trainer_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import hivemind
    import transformers

    import swarm_opt
    from swarm_opt.transformers import SwarmCallback

    transformers.logging.set_verbosity_error()
    logging.getLogger("swarm_opt").setLevel(logging.WARNING)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    never = 10 ** 12  # no round ever starts: only the per-step cost remains
    runs = iter(range(10 ** 6))  # a run_id per optimizer: no two share records
    workdir = tempfile.mkdtemp(prefix="trainer_overhead")
    loops: Dict[str, Callable[[List[torch.Tensor]], float]] = {
        "torch": lambda data: hand_loop(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), data, clip=True),
        "swarm_opt": lambda data: hand_loop(lambda m: swarm_opt.Optimizer(
            optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3), dht=dht, run_id=f"overhead{next(runs)}",
            target_batch_size=never, batch_size_per_step=args.batch_size, clip_grad_norm=1.0), data, clip=False),
        "trainer": lambda data: trainer_loop(lambda: [], data, workdir),
        "trainer+swarm": lambda data: trainer_loop(lambda: [SwarmCallback(
            dht=dht, run_id=f"overhead{next(runs)}", target_batch_size=never)], data, workdir),
    }
    seconds: Dict[str, List[float]] = {name: [] for name in LOOPS}
    events: List[float] = []
    try:
        for block in range(args.blocks + 1):
            data = batches(args.steps, args.batch_size, seed=block)
            order = LOOPS if block % 2 == 0 else LOOPS[::-1]
            for name in order:
                elapsed = loops[name](data)
                if block > 0:  # block 0 warms up every path
                    seconds[name].append(elapsed / args.steps)
            per_step = callback_events(dht, f"overhead{next(runs)}", steps=20 * args.steps)
            if block > 0:
                events.append(per_step)
    finally:
        dht.shutdown()

    us = {name: 1e6 * statistics.median(values) for name, values in seconds.items()}
    own_by_difference = (us["trainer+swarm"] - us["trainer"]) - (us["swarm_opt"] - us["torch"])
    own_direct = 1e6 * statistics.median(events)
    print(table(["loop", "µs / step (median)", "spread over blocks"],
                [(name, f"{us[name]:.0f}", f"{1e6 * min(seconds[name]):.0f}–{1e6 * max(seconds[name]):.0f}")
                 for name in LOOPS]))
    print(table(["figure", "value"], [
        ("trainer+swarm vs trainer", f"{us['trainer+swarm'] / us['trainer']:.3f}×"),
        ("the callback's own cost, loops' difference (µs / step)", f"{own_by_difference:.0f}"),
        ("the callback's own cost, its events through Trainer's dispatch (µs / step; goal ≤ 100)",
         f"{own_direct:.1f} ({1e6 * min(events):.1f}–{1e6 * max(events):.1f})"),
    ]))
    path = write_json(args.out, {"command": command_line(), "args": vars(args), "us_per_step": us,
                                 "seconds_per_step": seconds, "callback_events_seconds_per_step": events,
                                 "own_us_by_difference": own_by_difference, "own_us_direct": own_direct})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
