"""What a training step costs through Lightning and ``SwarmCallback``, apart from the swarm's rounds.

One process, one peer whose ``target_batch_size`` is never reached (no round runs), MNIST-5k batches of 32 and the
non-IID benchmarks' MLP 784-64-10 with SGD: a step is a forward, a backward and the swarm optimizer's bookkeeping.
Four loops over the same batches, in the same process, interleaved in blocks so that a change of machine load hits
all of them alike:

* ``torch``           -- a hand-written loop with the bare inner optimizer (the baseline);
* ``swarm_opt``       -- the same loop with ``swarm_opt.Optimizer`` (what ``lightning_scaffold.py`` calls the
  plain loop);
* ``lightning``       -- a ``Trainer`` with the bare inner optimizer (Lightning's own cost);
* ``lightning+swarm`` -- the same ``Trainer`` with ``SwarmCallback`` (what the callback adds).

Reported: microseconds per step (median over blocks) and the ratios that ``benchmarks/lightning_scaffold.py``'s
goal is about: Lightning + swarm against the plain swarm loop, split into Lightning's own cost and the callback's.

    python benchmarks/lightning_overhead.py
    python benchmarks/lightning_overhead.py --blocks 10 --steps 300
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Callable, Dict, List

import torch
from _common import command_line, load_mnist, table, write_json  # also puts the repo on sys.path for swarm_opt

LOOPS = ("torch", "swarm_opt", "lightning", "lightning+swarm")


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def batches(x: torch.Tensor, y: torch.Tensor, steps: int, batch_size: int, seed: int) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(x[idx], y[idx]) for idx in (torch.randint(len(x), (batch_size,), generator=g) for _ in range(steps))]


def hand_loop(make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer], data: List[tuple]) -> float:
    """Seconds for one pass of a hand-written loop over ``data``."""
    model = make_model(0)
    opt = make_optimizer(model)
    try:
        start = time.perf_counter()
        for xb, yb in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        return time.perf_counter() - start
    finally:
        if hasattr(opt, "shutdown"):
            opt.shutdown()


def lightning_loop(callbacks: Callable[[], list], data: List[tuple], lr: float) -> float:
    """Seconds for one ``Trainer.fit`` over ``data`` (timed from the first to the last training batch)."""
    import lightning as L

    class Classifier(L.LightningModule):  # knows nothing about the swarm
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(0)

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return torch.nn.functional.cross_entropy(self.model(xb), yb)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_start(self, *args) -> None:
            if not self.start:
                self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.end = time.perf_counter()

    clock = Clock()
    trainer = L.Trainer(max_epochs=1, callbacks=[*callbacks(), clock], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        num_sanity_val_steps=0)
    trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=None))
    # the first batch's start was not timed: scale to the whole pass
    return (clock.end - clock.start) * len(data) / max(1, len(data) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per loop (after one warm-up block)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="lightning_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import hivemind

    import swarm_opt
    from swarm_opt.lightning import SwarmCallback

    for name in ("lightning.pytorch", "lightning.fabric"):  # set after the import: Lightning sets them at import
        logging.getLogger(name).setLevel(logging.ERROR)

    x, y, _, _ = load_mnist(0)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    never = 10 ** 12  # no round ever starts: only the per-step cost remains
    runs = iter(range(10 ** 6))  # a run_id per optimizer: no two share records
    loops: Dict[str, Callable[[List[tuple]], float]] = {
        "torch": lambda data: hand_loop(lambda m: torch.optim.SGD(m.parameters(), lr=args.lr), data),
        "swarm_opt": lambda data: hand_loop(lambda m: swarm_opt.Optimizer(
            optimizer=torch.optim.SGD(m.parameters(), lr=args.lr), dht=dht, run_id=f"overhead{next(runs)}",
            target_batch_size=never, batch_size_per_step=args.batch_size), data),
        "lightning": lambda data: lightning_loop(lambda: [], data, args.lr),
        "lightning+swarm": lambda data: lightning_loop(lambda: [SwarmCallback(
            dht=dht, run_id=f"overhead{next(runs)}", target_batch_size=never, batch_size=args.batch_size)],
            data, args.lr),
    }
    seconds: Dict[str, List[float]] = {name: [] for name in LOOPS}
    try:
        for block in range(args.blocks + 1):
            data = batches(x, y, args.steps, args.batch_size, seed=block)
            order = LOOPS if block % 2 == 0 else LOOPS[::-1]
            for name in order:
                elapsed = loops[name](data)
                if block > 0:  # block 0 warms up every path
                    seconds[name].append(elapsed / args.steps)
    finally:
        dht.shutdown()

    us = {name: 1e6 * statistics.median(values) for name, values in seconds.items()}
    ratios = {
        "lightning+swarm vs swarm_opt (the goal's ratio)": us["lightning+swarm"] / us["swarm_opt"],
        "lightning vs torch (Lightning's own cost)": us["lightning"] / us["torch"],
        "lightning+swarm vs lightning (the callback + optimizer)": us["lightning+swarm"] / us["lightning"],
        "swarm_opt vs torch (the optimizer)": us["swarm_opt"] / us["torch"],
    }
    print(table(["loop", "µs / step (median)", "spread over blocks"],
                [(name, f"{us[name]:.0f}", f"{1e6 * min(seconds[name]):.0f}–{1e6 * max(seconds[name]):.0f}")
                 for name in LOOPS]))
    print(table(["ratio", "value"], [(k, f"{v:.2f}×") for k, v in ratios.items()]))
    path = write_json(args.out, {"command": command_line(), "args": vars(args), "us_per_step": us,
                                 "seconds_per_step": seconds, "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
