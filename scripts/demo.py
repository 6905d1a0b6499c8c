#!/usr/bin/env python
"""Train an MNIST MLP with a local swarm of volunteers started through the real command line; compare with one process.

``python scripts/demo.py`` runs, on this machine, exactly what volunteers run: ``swarm-opt dht`` (a bootstrap node),
``--peers`` times ``swarm-opt train --task mnist`` and, mid-run, ``swarm-opt monitor --once``. Each is a separate
OS process in its own session, so that it can be stopped with everything it started (hivemind's DHT and averager
processes, the p2pd daemon). The parent follows the peers' epoch lines to draw one progress bar for the swarm.

At the end every peer has saved a checkpoint; the parent evaluates each on the 1000 held-out digits, trains a
single process on the same global batch for the same number of steps from the same initialisation, and prints PASS
when the swarm reaches ``--min-accuracy`` (exit status 0) or FAIL (exit status 1).

``--workdir DIR`` keeps each process's output (bootstrap.log, peer<N>.log, monitor.log) and checkpoints.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python scripts/demo.py` from a checkout
    sys.path.insert(0, str(REPO))

from swarm_opt import testing  # noqa: E402 (needs the checkout on sys.path)

RUN_ID = "mnist_demo"
BATCH_SIZE = 32
LR, MOMENTUM = 0.1, 0.9  # the peers' inner SGD (swarm-opt train's defaults, passed explicitly) and the baseline's
# what `swarm-opt train` prints at each global epoch, e.g.
# "epoch 3: test accuracy 71.20%, test loss 0.9612, averaged with 3 of 3 peer(s) (96 samples from this peer)"
EPOCH_LINE = re.compile(r"^epoch (\d+): (.*)$", re.MULTILINE)
AVERAGED = re.compile(r"averaged with (\d+) of \d+ peer\(s\) \((\d+) samples from this peer\)")


class DemoError(Exception):
    """Something went wrong with the swarm itself (a peer crashed, the run timed out): reported in one line."""


class LocalSwarm:
    """The bootstrap node, the peers and the monitor, each a process group of its own; ``stop()`` always cleans them
    all up."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.procs: Dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, command: Sequence[str]) -> subprocess.Popen:
        """``python -m swarm_opt COMMAND...`` (what the ``swarm-opt`` script runs), output to ``name.log``."""
        self.procs[name] = testing.start(["-m", "swarm_opt", *command], log=self.workdir / f"{name}.log")
        return self.procs[name]

    def start_bootstrap(self, timeout: float = 60.0) -> List[str]:
        """Start ``swarm-opt dht`` on loopback; returns the addresses it prints for ``--initial-peers``."""
        proc = self.spawn("bootstrap", ["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            maddrs = [line for line in self.log("bootstrap").splitlines() if line.startswith("/ip4/")]
            if maddrs and "running" in self.log("bootstrap"):
                return maddrs
            if proc.poll() is not None:
                raise DemoError(f"the bootstrap node exited with status {proc.returncode}:\n"
                                f"{self.log_tail('bootstrap')}")
            time.sleep(0.05)
        raise DemoError(f"the bootstrap node printed no address within {timeout:.0f} s")

    def start_peers(self, initial_peers: List[str]) -> None:
        a = self.args
        for rank in range(a.peers):
            self.spawn(f"peer{rank}", [
                "train", "--run-id", RUN_ID, "--initial-peers", *initial_peers,
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--task", "mnist", "--seed", str(a.seed),
                "--data-seed", str(a.seed * 1000 + rank), "--batch-size", str(BATCH_SIZE),
                "--target-batch-size", str(a.target_batch_size), "--epochs", str(a.epochs),
                "--lr", str(LR), "--momentum", str(MOMENTUM), "--min-peers", str(a.peers),
                "--matchmaking-time", str(a.matchmaking_time), "--averaging-timeout", str(a.averaging_timeout),
                "--checkpoint-dir", str(self.workdir / f"peer{rank}"), "--checkpoint-every", str(a.epochs),
            ] + (["-v"] if a.verbose else []))

    def log(self, name: str) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, name: str, lines: int = 15) -> str:
        return "\n".join("    " + line for line in self.log(name).splitlines()[-lines:]) or "    (no output)"

    def epochs(self) -> List[List[re.Match]]:
        """Each peer's epoch lines so far."""
        return [list(EPOCH_LINE.finditer(self.log(f"peer{rank}"))) for rank in range(self.args.peers)]

    def check_peers(self) -> bool:
        """True once every peer exited after its last epoch; raises if the bootstrap node or a peer failed."""
        peers = {name: proc.poll() for name, proc in self.procs.items() if name.startswith("peer")}
        failed = [name for name, status in peers.items() if status not in (None, 0)]
        if self.procs["bootstrap"].poll() is not None:
            failed.insert(0, "bootstrap")
        if failed:
            name = failed[0]
            raise DemoError(f"{name} exited with status {self.procs[name].returncode} before the end of the run; "
                            f"last lines of its output:\n{self.log_tail(name)}")
        return all(status == 0 for status in peers.values())

    def stop(self, grace: float = 10.0) -> None:
        """Ask everyone to leave (SIGINT: what Ctrl-C does), wait a little, then kill each process group."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup is bounded; a second Ctrl-C must not cut it short
        for proc in self.procs.values():
            if proc.poll() is None:
                testing.signal_group(proc, signal.SIGINT)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        testing.kill(self.procs.values(), timeout=5)  # whatever a process left behind in its group (p2pd, averagers)


def train_swarm(args: argparse.Namespace, workdir: Path) -> dict:
    from tqdm import tqdm

    swarm = LocalSwarm(args, workdir)
    started = time.monotonic()
    bar = tqdm(total=args.epochs, desc="swarm", unit="epoch", file=sys.stderr, dynamic_ncols=True,
               mininterval=0.1, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} epochs [{elapsed}{postfix}]")
    monitor: Optional[subprocess.Popen] = None
    try:
        bar.set_postfix_str("starting the bootstrap node")
        initial_peers = swarm.start_bootstrap()
        bar.set_postfix_str(f"starting {args.peers} peers (swarm-opt train --task mnist)")
        swarm.start_peers(initial_peers)
        deadline = started + args.timeout
        first_epoch: Optional[float] = None
        while not swarm.check_peers():
            epoch = max((int(lines[-1].group(1)) for lines in swarm.epochs() if lines), default=0)
            if epoch >= 1 and first_epoch is None:
                first_epoch = time.monotonic()
                monitor = swarm.spawn("monitor", ["monitor", "--run-id", RUN_ID, "--once", "--initial-peers",
                                                  *initial_peers])  # what a volunteer sees, mid-run
            status = f"{sum(bool(lines) for lines in swarm.epochs())}/{args.peers} peers training" if epoch \
                else "peers joining"
            if (epoch, status) != (bar.n, bar.postfix):  # redraw on news only (stderr may be a file)
                bar.set_postfix_str(status, refresh=False)
                bar.update(min(epoch, args.epochs) - bar.n)
                bar.refresh()
            if time.monotonic() > deadline:
                raise DemoError(f"the swarm did not finish {args.epochs} epochs within {args.timeout} s "
                                f"(reached epoch {epoch}); raise --timeout or lower --epochs")
            time.sleep(0.2)
        finished = time.monotonic()
        bar.update(args.epochs - bar.n)
        bar.set_postfix_str("done")
        snapshot = _monitor_output(swarm, monitor)
    finally:
        bar.close()
        swarm.stop()
    return dict(epochs=swarm.epochs(), seconds=finished - started, monitor=snapshot,
                seconds_training=finished - (first_epoch or started))


def _monitor_output(swarm: LocalSwarm, monitor: Optional[subprocess.Popen]) -> str:
    """The snapshot ``swarm-opt monitor --once`` printed mid-run (empty if it could not take one)."""
    if monitor is None:
        return ""
    try:
        monitor.wait(30)
    except subprocess.TimeoutExpired:
        return ""
    return swarm.log("monitor").strip() if monitor.returncode == 0 else ""


def train_single_process(args: argparse.Namespace) -> dict:
    """The reference: one process, the peers' initialisation, one step per global batch drawn from all the training
    data."""
    from swarm_opt.cli.tasks import evaluate, load_task

    task = load_task("mnist", seed=args.seed)
    x_train, y_train = task.train_data.tensors
    opt = torch.optim.SGD(task.model.parameters(), lr=LR, momentum=MOMENTUM)
    generator = torch.Generator().manual_seed(args.seed)
    started = time.monotonic()
    for _ in range(args.epochs):
        idx = torch.randint(len(y_train), (args.target_batch_size,), generator=generator)
        opt.zero_grad()
        task.loss_fn(task.model(x_train[idx]), y_train[idx]).backward()
        opt.step()
    return dict(accuracy=evaluate(task)["accuracy"], seconds=time.monotonic() - started, task=task)


def report(args: argparse.Namespace, swarm: dict, single: dict, workdir: Path) -> bool:
    from swarm_opt import load_checkpoint
    from swarm_opt.cli.tasks import evaluate

    task = single["task"]  # its model is overwritten with each peer's parameters in turn
    print(f"swarm: {args.peers} peers, {args.epochs} epochs of {args.target_batch_size} samples, wall time "
          f"{swarm['seconds']:.1f} s ({swarm['seconds_training']:.1f} s from the first epoch on)")
    samples_per_epoch: Dict[int, int] = {}
    states = []
    for rank, lines in enumerate(swarm["epochs"]):
        checkpoints = sorted((workdir / f"peer{rank}").glob("epoch-*.pt"))
        if not checkpoints:
            raise DemoError(f"peer {rank} saved no checkpoint in {workdir / f'peer{rank}'}")
        checkpoint = load_checkpoint(checkpoints[-1])
        states.append(checkpoint["model"])
        task.model.load_state_dict(checkpoint["model"])
        averaged = [(int(line.group(1)), m) for line in lines if (m := AVERAGED.search(line.group(2)))]
        for epoch, m in averaged:
            samples_per_epoch[epoch] = samples_per_epoch.get(epoch, 0) + int(m.group(2))
        groups = f"{sum(int(m.group(1)) for _, m in averaged) / len(averaged):.2f}" if averaged else "-"
        print(f"  peer {rank}: epoch {checkpoint['epoch']}, test accuracy {evaluate(task)['accuracy']:6.2%}  "
              f"({len(averaged)} rounds averaged, mean group {groups} peers, {len(lines) - len(averaged)} caught up "
              f"by download)")
    mean_state = {k: torch.stack([s[k] for s in states]).mean(dim=0) for k in states[0]}
    spread = max(float((s[k] - mean_state[k]).abs().max()) for s in states for k in s)
    task.model.load_state_dict(mean_state)
    swarm_accuracy = evaluate(task)["accuracy"]
    print(f"  swarm (mean of the peers' parameters, which differ from it by at most {spread:.1e}): "
          f"test accuracy {swarm_accuracy:6.2%}")
    if samples_per_epoch:
        mean_samples = sum(samples_per_epoch.values()) / len(samples_per_epoch)
        print(f"  samples averaged per global epoch: {mean_samples:.0f} on average, "
              f"{mean_samples / args.target_batch_size:.2f}x the target of {args.target_batch_size}")
    if swarm["monitor"]:
        print("the run mid-way, as `swarm-opt monitor --once` showed it:")
        print("\n".join("  " + line for line in swarm["monitor"].splitlines()))
    print(f"single process: {args.epochs} steps of {args.target_batch_size} samples, same init, "
          f"wall time {single['seconds']:.2f} s, test accuracy {single['accuracy']:6.2%}")
    passed = swarm_accuracy >= args.min_accuracy
    print(f"{'PASS' if passed else 'FAIL'}: swarm test accuracy {swarm_accuracy:.2%} "
          f"{'>=' if passed else '<'} {args.min_accuracy:.0%} required")
    return passed


# --- command line ---------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--peers", type=_positive_int, default=4, help="volunteer peers to start")
    parser.add_argument("--epochs", type=_positive_int, default=40, help="global epochs (swarm steps) to train")
    parser.add_argument("--target-batch-size", type=_positive_int, default=256,
                        help="samples the swarm accumulates per epoch (the global batch)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and of the batches")
    parser.add_argument("--min-accuracy", type=float, default=0.85, help="test accuracy the swarm must reach for PASS")
    parser.add_argument("--timeout", type=_positive_int, default=600, help="give up after this many seconds")
    parser.add_argument("--matchmaking-time", type=float, default=1.0,
                        help="seconds peers spend forming an averaging group")
    parser.add_argument("--averaging-timeout", type=float, default=30.0,
                        help="seconds after which a failed averaging round is retried")
    parser.add_argument("--workdir", help="keep each process's output and the peers' checkpoints in this directory")
    parser.add_argument("--verbose", action="store_true", help="peers also log swarm_opt's INFO lines (see --workdir)")
    args = parser.parse_args(argv)
    if not 0 <= args.min_accuracy <= 1:
        parser.error(f"--min-accuracy is a fraction between 0 and 1, got {args.min_accuracy}")
    if args.target_batch_size < BATCH_SIZE:
        parser.error(f"--target-batch-size must be at least the per-step batch of {BATCH_SIZE}")
    return args  # the peers' own command line checks the timeouts and says what to fix


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the peers too, like Ctrl-C
    try:
        with tempfile.TemporaryDirectory(prefix="swarm_opt_demo_") as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            for old in workdir.glob("peer*/epoch-*.pt"):
                old.unlink()  # a reused --workdir must not resume, or report, the last run's peers
            swarm = train_swarm(args, workdir)
            single = train_single_process(args)
            return 0 if report(args, swarm, single, workdir) else 1
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; all peers were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
