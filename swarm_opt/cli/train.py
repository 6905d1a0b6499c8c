"""``swarm-opt train``: one volunteer peer that joins a run, trains a task and leaves cleanly.

The loop is the one in the README: draw a batch, backward, ``Optimizer.step(batch_size=...)``. Around it: a live
progress bar of the swarm toward the next global epoch, one line per global epoch with the test metrics, atomic
checkpoints, and a shutdown that always runs (first Ctrl-C or SIGTERM: stop after the current step; a second one:
abandon the step), so the peer withdraws from the swarm instead of being waited for until its record expires.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from swarm_opt._hivemind.node import StopRequest, children_ignore_sigint, start_dht
from swarm_opt.cli.commands import private_run, start_metrics
from swarm_opt.cli.tasks import Task, evaluate, load_task
from swarm_opt.errors import ConfigError
from swarm_opt.strategies import STRATEGIES, DiLoCo, FedProx, GradientAveraging, Strategy

logger = logging.getLogger(__name__)

_BAR_PERIOD = 0.2  # seconds between progress bar refreshes


def _diloco_options(args: argparse.Namespace) -> Dict[str, Any]:
    lr, momentum = args.outer_lr, args.outer_momentum
    return {"outer_optimizer": lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, nesterov=momentum > 0)}


#: the command-line options of the strategies that take any (every other one is built with its defaults)
_STRATEGY_OPTIONS: Dict[type, Callable[[argparse.Namespace], Dict[str, Any]]] = {
    GradientAveraging: lambda args: {"momentum": args.worker_momentum},
    FedProx: lambda args: {"mu": args.fedprox_mu},
    DiLoCo: _diloco_options,
}


def make_strategy(args: argparse.Namespace) -> Strategy:
    """The strategy named by ``--strategy`` (a key of ``swarm_opt.strategies.STRATEGIES``), with its options."""
    strategy = STRATEGIES.get(args.strategy)
    if strategy is None:
        raise ConfigError(f"unknown strategy '{args.strategy}'; choose one of {', '.join(STRATEGIES)}")
    if args.worker_momentum is not None and strategy is not GradientAveraging:
        raise ConfigError(f"--worker-momentum applies to --strategy grad, not {args.strategy}")
    options = _STRATEGY_OPTIONS.get(strategy)
    return strategy(**(options(args) if options is not None else {}))


def make_inner_optimizer(args: argparse.Namespace) -> Callable[[Any], torch.optim.Optimizer]:
    if args.worker_momentum is not None and args.momentum:
        raise ConfigError("--worker-momentum replaces the inner optimizer's momentum: drop --momentum (or pass 0)")
    lr = args.lr
    momentum = args.momentum if args.momentum is not None else 0.0 if args.worker_momentum is not None else 0.9
    if args.optimizer == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def _batches(task: Task, batch_size: int, seed: int) -> Iterator[tuple]:
    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(task.train_dataset, batch_size=batch_size, shuffle=True,
                                         generator=generator)
    while True:
        yield from loader


def _duration(seconds: float) -> str:
    if seconds == float("inf") or seconds > 99 * 3600:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}h{seconds % 3600 // 60:02d}"


class _ProgressBar:
    """The swarm's progress toward the next global epoch; a tqdm bar on a terminal, nothing otherwise."""

    def __init__(self, target: int) -> None:
        self._bar = None
        self._last = 0.0
        try:
            from tqdm import tqdm
        except ImportError:  # the bar is a nicety; epoch lines still show progress
            return
        self._bar = tqdm(total=target, unit="sample", file=sys.stderr, disable=None, dynamic_ncols=True,
                         leave=False, bar_format="{desc} {n}/{total} samples{postfix} |{bar}|")

    def update(self, opt: Any, *, force: bool = False) -> None:
        now = time.monotonic()
        if self._bar is None or self._bar.disable or (not force and now - self._last < _BAR_PERIOD):
            return
        self._last = now
        p = opt.progress
        self._bar.set_description_str(f"epoch {p.epoch} -> {p.epoch + 1}:", refresh=False)
        self._bar.n = min(p.samples_accumulated, p.target_batch_size)
        self._bar.set_postfix_str(f"{p.num_peers} peer(s), {p.samples_per_second:,.0f} samples/s, "
                                  f"ETA {_duration(p.eta_seconds)}", refresh=False)
        self._bar.refresh()

    def write(self, line: str) -> None:
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _EpochLoss:
    """The mean training loss of the steps of one epoch, summed on the loss's device (no sync per step)."""

    def __init__(self) -> None:
        self._sum: Any = 0.0
        self._count = 0

    def add(self, loss: torch.Tensor) -> None:
        self._sum = self._sum + loss.detach()
        self._count += 1

    def take(self) -> Optional[float]:
        mean = float(self._sum) / self._count if self._count else None
        self._sum, self._count = 0.0, 0
        return mean


def _epoch_line(opt: Any, metrics: Dict[str, float]) -> str:
    parts = []
    if "accuracy" in metrics:
        parts.append(f"test accuracy {metrics['accuracy']:.2%}")
    if "loss" in metrics:
        parts.append(f"test loss {metrics['loss']:.4f}")
    r = opt.last_round
    if r is not None and r.epoch == opt.local_epoch:
        parts.append("caught up by downloading the swarm's state" if r.caught_up
                     else f"averaged with {r.group_size} of {r.num_peers} peer(s) ({r.samples} samples from this peer)")
    return f"epoch {opt.local_epoch}: " + ", ".join(parts)


def run_train(args: argparse.Namespace) -> int:
    """The ``train`` command. Returns the exit status; raises ConfigError for bad input."""
    import swarm_opt
    from swarm_opt.config import SwarmConfig, Timeouts

    # validate everything that needs no network first, so a typo costs no DHT start-up
    SwarmConfig(args.run_id, args.target_batch_size, args.batch_size)
    Timeouts(matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)
    if args.batch_size > args.target_batch_size:
        raise ConfigError(f"--batch-size ({args.batch_size}) must not exceed --target-batch-size "
                          f"({args.target_batch_size})")
    if args.gloo_lane is not None and args.aggregation is not None:
        raise ConfigError("--aggregation needs hivemind's averaging path (the gloo lane computes the plain weighted "
                          "mean): drop --gloo-lane or --aggregation")
    task = load_task(args.task, seed=args.seed)
    strategy = make_strategy(args)
    transport = None if args.gloo_lane is None else swarm_opt.Gloo(*args.gloo_lane)
    data_seed = args.data_seed if args.data_seed is not None else int.from_bytes(os.urandom(4), "little")

    if args.auxiliary and args.client_mode:
        raise ConfigError("--auxiliary peers reduce what trainers send them, so they must accept connections: "
                          "drop --client-mode")
    stop = StopRequest("swarm-opt train: stopping after the current step (Ctrl-C again to stop at once)")
    board = None
    if args.log_dir is not None:
        from swarm_opt.monitor.tensorboard import TensorBoardLog

        board = TensorBoardLog(args.log_dir)  # an unwritable directory fails here, before the DHT starts
    metrics = start_metrics(args)  # and so does a port in use
    dht = start_dht(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                    announce_maddrs=args.announce_maddrs, client_mode=args.client_mode,
                    identity_path=args.identity_path, private_run=private_run(args),
                    join_timeout=args.join_timeout)
    from swarm_opt.monitor.stats import StatsPublisher

    role = "auxiliary" if args.auxiliary else "client" if args.client_mode else "trainer"
    stats = StatsPublisher(dht, args.run_id, role=role)  # what monitors show of this peer (one store per epoch)
    if metrics is not None:
        metrics.watch(dht=dht)
    if args.auxiliary:
        return _run_auxiliary(args, task, strategy, dht, stop, stats, metrics)
    opt: Optional[swarm_opt.Optimizer] = None
    bar: Optional[_ProgressBar] = None
    ckpt: Optional[swarm_opt.Checkpointer] = None
    try:
        with children_ignore_sigint():  # the optimizer's averager is a child process too
            opt = swarm_opt.Optimizer(
                dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
                batch_size_per_step=args.batch_size, params=task.model.parameters(),
                optimizer=make_inner_optimizer(args), strategy=strategy,
                matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
                transport=transport, aggregation=args.aggregation,
            )
        opt.observe(stats)
        stats.watch(opt)
        if metrics is not None:
            metrics.watch(opt)
            opt.observe(metrics)
        stop.install()
        _say(f"joined run '{args.run_id}' as peer {dht.peer_id} "
             f"({'client mode' if args.client_mode else 'accepting connections'}); "
             f"task {args.task}, strategy {args.strategy}")
        if not args.client_mode:
            for maddr in dht.get_visible_maddrs():
                _say(f"others can join through {maddr}")
        if args.checkpoint_dir:
            ckpt = swarm_opt.Checkpointer(args.checkpoint_dir, every_epochs=args.checkpoint_every, keep_last=3)
            restored = ckpt.restore(opt, task.model)
            if restored is not None:
                _say(f"resumed from {ckpt.latest()} (epoch {restored['epoch']}); the swarm's newer state, if any, "
                     f"is downloaded at the first step")
        _wait_for_peers(opt, args.min_peers, stop)

        bar = _ProgressBar(args.target_batch_size)
        batches = _batches(task, args.batch_size, data_seed)
        last_epoch = opt.local_epoch
        stats.publish(last_epoch)
        losses = _EpochLoss()
        task.model.train()
        while not stop.requested and (args.epochs is None or opt.local_epoch < args.epochs):
            x, y = next(batches)
            opt.zero_grad()
            loss = task.loss_fn(task.model(x), y)
            loss.backward()
            losses.add(loss)
            opt.step(batch_size=len(y))
            if opt.local_epoch != last_epoch:
                last_epoch = opt.local_epoch
                test_metrics = evaluate(task)
                epoch_loss = losses.take()
                stats.publish(last_epoch, epoch_loss)
                if board is not None:
                    board.log_epoch(opt, loss=epoch_loss, test_metrics=test_metrics)
                bar.write(_epoch_line(opt, test_metrics))
                if ckpt is not None:
                    ckpt.maybe_save(opt, task.model, extra=_checkpoint_extra(args))
                bar.update(opt, force=True)
            else:
                stats.publish(last_epoch)  # a heartbeat: stores only once a minute within an epoch
                bar.update(opt)
    except KeyboardInterrupt:  # a second Ctrl-C: abandon the step, still leave cleanly
        pass
    finally:
        if bar is not None:
            bar.close()
        save = None if ckpt is None else lambda: _save_checkpoint(opt, task, args, ckpt)  # ckpt exists only with opt
        _leave(opt, dht, save, stats, metrics, board)
    if stop.requested:
        _say(f"stopped by {stop.signal_name} at epoch {opt.local_epoch if opt else 0}")
    else:
        lane = f", {opt._averager.lane_rounds} round(s) over the gloo lane" if args.gloo_lane else ""
        _say(f"reached epoch {opt.local_epoch}{lane}; done")
    return 0


def _run_auxiliary(args: argparse.Namespace, task: Task, strategy: Any, dht: Any, stop: StopRequest, stats: Any,
                   metrics: Any) -> int:
    """``train --auxiliary``: help every round of the run until it reaches --epochs or Ctrl-C."""
    import threading

    import swarm_opt

    helper: Optional[swarm_opt.AuxiliaryPeer] = None
    done = threading.Event()

    def heartbeat() -> None:  # what monitors show of a helper: the rounds it helped
        while not done.wait(5.0):
            if helper is not None:
                stats.publish(getattr(helper, "_epoch_seen", 0), rounds={"helped": helper.rounds_helped})

    threading.Thread(target=heartbeat, name="swarm_opt.HelperStats", daemon=True).start()
    try:
        with children_ignore_sigint():
            helper = swarm_opt.AuxiliaryPeer(dht=dht, run_id=args.run_id, params=task.model.parameters(),
                                             strategy=strategy, matchmaking_time=args.matchmaking_time,
                                             averaging_timeout=args.averaging_timeout,
                                             aggregation=args.aggregation)
        stats.watch(helper)
        if metrics is not None:
            metrics.watch(helper)
        stop.install()
        _say(f"helping run '{args.run_id}' as auxiliary peer {dht.peer_id}: reduces a share of every round, "
             f"trains nothing")
        helper.run(epochs=args.epochs, stop=stop.event)
    except KeyboardInterrupt:
        pass
    finally:
        done.set()
        _leave(helper, dht, None, stats, metrics)
    helped = helper.rounds_helped if helper is not None else 0
    _say(f"helped {helped} round(s), reduced {helper.values_reduced if helper else 0:,} values; done")
    return 0


def _wait_for_peers(opt: Any, min_peers: int, stop: StopRequest) -> None:
    if opt.progress.num_peers >= min_peers:
        return
    _say(f"waiting for {min_peers} peers to train together ({opt.progress.num_peers} now)")
    while opt.progress.num_peers < min_peers and not stop.requested:
        stop.wait(0.1)


def _checkpoint_extra(args: argparse.Namespace) -> Dict[str, Any]:
    return {"run_id": args.run_id, "task": args.task, "strategy": args.strategy, "time": time.time()}


def _save_checkpoint(opt: Any, task: Task, args: argparse.Namespace, ckpt: Any) -> None:
    path = ckpt.save(opt, task.model, extra=_checkpoint_extra(args))
    _say(f"saved checkpoint {path} (epoch {opt.local_epoch})")


def _leave(member: Any, dht: Any, save: Optional[Callable[[], None]] = None, stats: Any = None, metrics: Any = None,
           board: Any = None) -> None:
    """Save first (no network), then leave the swarm (an Optimizer or AuxiliaryPeer, if it was created, and the
    monitors' statistics record), then stop the DHT and the exporters. Runs once; a Ctrl-C is ignored."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup is bounded; a further Ctrl-C must not cut it short
    try:
        if save is not None:
            save()
        if member is not None:
            member.shutdown()
        if stats is not None:
            stats.withdraw()
    finally:
        dht.shutdown()
        for exporter in (metrics, board):
            if exporter is not None:
                exporter.close()


def _say(line: str) -> None:
    print(f"swarm-opt train: {line}", file=sys.stderr, flush=True)
