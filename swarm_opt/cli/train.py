"""``swarm-opt train``: one volunteer peer that joins a run, trains a task and leaves cleanly.

The loop is the one in the README: draw a batch, backward (in the recipe's precision), ``Optimizer.step(batch_size=
...)``. Around it: the task's recipe with the command line's overrides (``apply_recipe``), a check that the run's
live peers train with the same settings (one line naming the setting that differs, otherwise), a live progress bar
of the swarm toward the next global epoch, one line per global epoch with the evaluation's metrics, atomic
checkpoints, and a shutdown that always runs (first Ctrl-C or SIGTERM: stop after the current step; a second one:
abandon the step; a streaming source that runs out or fails: at once), so the peer withdraws from the swarm
instead of being waited for until its record expires.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from swarm_opt import protocol, strategies
from swarm_opt._hivemind.beacon import Beacon
from swarm_opt._hivemind.node import start_dht
from swarm_opt.cli.options import private_run, start_metrics
from swarm_opt.cli.stop import StopRequest
from swarm_opt.cli.tasks import evaluate, load_task
from swarm_opt.errors import ConfigError
from swarm_opt.recipe import DataShard, Recipe, check_run_recipe, fingerprint, recipe_beacon
from swarm_opt.shard_claims import claim_shard
from swarm_opt.strategies.base import Strategy

logger = logging.getLogger(__name__)

_BAR_PERIOD = 0.2  # seconds between progress bar refreshes


def make_strategy(args: argparse.Namespace) -> Strategy:
    """The strategy named by ``--strategy`` (a key of ``swarm_opt.strategies.STRATEGIES``), built from the
    command-line options its class declares (``Strategy.cli_options``); an option given for another strategy only
    is refused."""
    registered = strategies.STRATEGIES
    strategy = registered.get(args.strategy)
    if strategy is None:
        raise ConfigError(f"unknown strategy '{args.strategy}'; choose one of {', '.join(registered)}")
    for dest in {dest for other in registered.values() for dest in other.cli_options} - set(strategy.cli_options):
        if _given(args, dest):
            names = " or ".join(name for name, other in registered.items() if dest in other.cli_options)
            raise ConfigError(f"--{dest.replace('_', '-')} applies to --strategy {names}, not {args.strategy}")
    return strategy.from_options({dest: getattr(args, dest) for dest in strategy.cli_options})


def _given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the volunteer set an option (in a config file, the environment or a flag)."""
    return dest in getattr(args, "explicit", frozenset())


def make_inner_optimizer(args: argparse.Namespace) -> Callable[[Any], torch.optim.Optimizer]:
    if args.worker_momentum is not None and args.momentum:
        raise ConfigError("--worker-momentum replaces the inner optimizer's momentum: drop --momentum (or pass 0)")
    lr = args.lr
    momentum = args.momentum if args.momentum is not None else 0.0 if args.worker_momentum is not None else 0.9
    if args.optimizer == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


#: recipe settings -> the option that overrides them (named in a refusal when the volunteer typed it)
_SETTING_FLAGS = {"lr": "--lr", "optimizer": "--optimizer", "momentum": "--momentum",
                  "clip_grad_norm": "--clip-grad-norm", "precision": "--precision",
                  "target_batch_size": "--target-batch-size", "strategy": "--strategy",
                  "fedprox_mu": "--fedprox-mu", "outer_lr": "--outer-lr", "outer_momentum": "--outer-momentum"}


def apply_recipe(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    """The recipe with the command line's overrides; ``args``' strategy and batch sizes become the recipe's defaults
    unless typed. A flag, an environment variable or a config file entry wins over the recipe, the recipe over the
    command line's defaults."""
    given = getattr(args, "explicit", frozenset())
    for dest in ("strategy", "batch_size", "target_batch_size"):
        if dest not in given and getattr(recipe, dest) is not None:
            setattr(args, dest, getattr(recipe, dest))
    changes: Dict[str, Any] = {}
    if "clip_grad_norm" in given or recipe.clip_grad_norm is None:
        changes["clip_grad_norm"] = args.clip_grad_norm
    if "precision" in given:
        changes["precision"] = args.precision
    if recipe.optimizer is None or "optimizer" in given:
        changes["optimizer"] = make_inner_optimizer(args)
    else:
        for dest in ("momentum", "worker_momentum"):
            if dest in given:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(f"{flag} sets the command line's optimizer, and this task's recipe declares its "
                                  f"own: drop {flag}, or replace the recipe's optimizer with --optimizer sgd")
        if "lr" in given:
            changes["optimizer"] = _with_lr(recipe.build_optimizer, args.lr)
    if getattr(args, "eval_every", None) is not None:
        if recipe.evaluation is None:
            raise ConfigError("--eval-every: this task's recipe has no evaluation (Recipe(evaluation=...)); drop it")
        changes["evaluation"] = replace(recipe.evaluation, every_epochs=args.eval_every)
    return replace(recipe, **changes)


def _with_lr(factory: Callable[[Any], torch.optim.Optimizer], lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    """``--lr`` over a recipe's optimizer: the first group's learning rate; the others keep their ratio to it."""
    def build(groups: Any) -> torch.optim.Optimizer:
        optimizer = factory(groups)
        first = optimizer.param_groups[0]["lr"]
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr"] / first if first else lr
        return optimizer
    return build


@dataclass
class _Batches:
    """The peer's batches: a map-style dataset shuffled by the data seed, forever; or its shard of a streaming
    source, until it runs out (``exhausted``) or fails (``failure``)."""

    recipe: Recipe
    batch_size: int
    seed: int
    shard: Optional[DataShard] = None
    samples: int = 0
    exhausted: bool = False
    failure: Optional[str] = None

    def __post_init__(self) -> None:
        self._source = None if self.shard is None else self.recipe.stream(self.shard)
        self._iterator = self._stream() if self.shard is not None else self._shuffled()

    def _shuffled(self) -> Iterator[Any]:
        generator = torch.Generator().manual_seed(self.seed)
        loader = torch.utils.data.DataLoader(self.recipe.train_data, batch_size=self.batch_size,  # type: ignore
                                             shuffle=True, generator=generator, collate_fn=self.recipe.collate)
        while True:
            yield from loader

    def _stream(self) -> Iterator[Any]:
        assert self.shard is not None
        collate = self.recipe.collate or torch.utils.data.default_collate
        source = self._source
        while True:
            samples: List[Any] = []
            for sample in source:
                samples.append(sample)
                if len(samples) == self.batch_size:
                    break
            if not samples:
                return
            yield collate(samples)
            if len(samples) < self.batch_size:
                return

    def next(self) -> Optional[Any]:
        """The next batch, or None when the stream ran out or failed."""
        try:
            batch = next(self._iterator)
        except StopIteration:
            self.exhausted = True
            return None
        except Exception as e:  # the user's source failed: the peer leaves cleanly and says why
            self.failure = f"{type(e).__name__}: {e}"
            return None
        self.samples += _batch_size_of(batch[1])
        return batch


def _shard(args: argparse.Namespace, recipe: Recipe, dht: Any,
           seed: int) -> Tuple[Optional[DataShard], Optional[Beacon]]:
    """A streaming recipe's shard for this peer, and the claim to stop when it leaves: ``--shard``, or the
    least-claimed shard of the run (``swarm_opt.shard_claims``). None for map-style data."""
    if not recipe.streaming:
        if args.shard is not None:
            raise ConfigError(f"--shard applies to tasks with a streaming source; task {args.task} trains on a "
                              f"dataset that every peer shuffles: drop --shard")
        return None, None
    if args.shard is not None:
        return DataShard(args.shard[0], args.shard[1], seed), None
    return claim_shard(dht, args.run_id, recipe.num_shards, seed=seed)


def _batch_size_of(targets: Any) -> int:
    return len(targets)


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


class _LongestStep:
    """The longest ``step()`` of the run, and the epoch it ended at: said when the peer leaves. A step blocks for a
    round, a catch-up download or a partition's reconciliation, each bounded (``docs/optimizer.md``); a long one
    tells a volunteer where its time went. A step that ends after a stop was requested is not counted: the peer is
    leaving, and so may its groupmates be (a Ctrl-C to a whole swarm)."""

    def __init__(self, stop: StopRequest) -> None:
        self.seconds, self.epoch = 0.0, 0
        self._stop = stop

    @contextmanager
    def timing(self, opt: Any) -> Iterator[None]:
        started = time.monotonic()
        yield
        took = time.monotonic() - started
        if took > self.seconds and not self._stop.requested:
            self.seconds, self.epoch = took, opt.local_epoch

    def describe(self) -> str:
        return f" (the longest step() took {self.seconds:.1f} s, at epoch {self.epoch})" if self.seconds else ""


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


def _evaluate_if_due(opt: Any, recipe: Recipe) -> Dict[str, float]:
    """The recipe's evaluation at this epoch, if it is due (``Evaluation.every_epochs``); {} otherwise."""
    evaluation = recipe.evaluation
    due = evaluation is not None and opt.local_epoch % evaluation.every_epochs == 0
    return evaluate(recipe) if due else {}


def _epoch_line(opt: Any, metrics: Dict[str, float]) -> str:
    parts = []
    if "accuracy" in metrics:
        parts.append(f"test accuracy {metrics['accuracy']:.2%}")
    if "loss" in metrics:
        parts.append(f"test loss {metrics['loss']:.4f}")
    parts += [f"test {name} {value:.2f}" for name, value in metrics.items() if name not in ("accuracy", "loss")]
    r = opt.last_round
    if r is not None and r.epoch == opt.local_epoch:
        parts.append(f"caught up by downloading the swarm's state ({r.samples} local samples dropped)"
                     if r.caught_up else
                     f"averaged with {r.group_size} of {r.num_peers} peer(s) ({r.samples} samples from this peer)")
    return f"epoch {opt.local_epoch}: " + ", ".join(parts)


@dataclass(frozen=True)
class _Identity:
    """What this peer must share with the run's peers: its settings, their fingerprint, and its schema before
    (``base``) and after (``schema``) the fingerprint is mixed in (``Optimizer.model_schema``)."""

    settings: Dict[str, Any]
    fingerprint: str
    base: str
    schema: str
    legacy: Tuple[str, ...] = ()  # the schema older releases gave these settings: their checkpoints resume


def _identity(recipe: Recipe, strategy: Strategy, args: argparse.Namespace) -> _Identity:
    from swarm_opt.optimizer import identified_schema, model_schema

    settings = recipe.settings(target_batch_size=args.target_batch_size,
                               strategy=f"{args.strategy}{strategy.variant}")
    # the strategy's command-line options that change training (a run's peers must agree on them)
    settings.update({dest: getattr(args, dest) for dest in type(strategy).identity_options()})
    # the protocol, published with the recipe: a volunteer of another release, older ones included, is refused in
    # the recipe check's one line naming the release to install (swarm_opt.protocol)
    if protocol.label() is not None:
        settings[protocol.SETTING] = protocol.label()
    params = [p for group in recipe.groups() for p in (group["params"] if isinstance(group, dict) else [group])]
    base = model_schema(params, strategy.name + strategy.variant)  # = strategy_schema: the CLI keeps no parameter local
    identity = fingerprint(settings)
    legacy = tuple(identified_schema(model_schema(params, strategy.name + strategy.variant, protocol=p),
                                     fingerprint(_settings_of(settings, p))) for p in range(1, protocol.current()))
    return _Identity(settings, identity, base, identified_schema(base, identity), legacy)


def _settings_of(settings: Dict[str, Any], release_protocol: int) -> Dict[str, Any]:
    """``settings`` as a release of ``release_protocol`` published them (protocol 1 published none)."""
    older = {k: v for k, v in settings.items() if k != protocol.SETTING}
    label = protocol.label(release_protocol)
    return older if label is None else {**older, protocol.SETTING: label}


def _check_recipe(dht: Any, args: argparse.Namespace, identity: _Identity) -> Beacon:
    """Refuse (ConfigError) to join a run whose live peers train with other settings; otherwise publish ours."""
    given = getattr(args, "explicit", frozenset())
    flags = {setting: flag for setting, flag in _SETTING_FLAGS.items() if flag.lstrip("-").replace("-", "_") in given}
    why = check_run_recipe(dht, args.run_id, identity.settings, identity.schema, flags=flags)
    if why is not None:
        raise ConfigError(f"run '{args.run_id}': {why}; peers with different settings never train "
                          f"together: use the run's (the same --task and options as its peers) or another --run-id")
    return recipe_beacon(dht, args.run_id, identity.settings, identity.base, identity.schema)


def run_train(args: argparse.Namespace, stop: StopRequest) -> int:
    """The ``train`` command. Returns the exit status; raises ConfigError for bad input. ``stop``, installed before
    this module was imported, ends the start-up at its next step (``KeyboardInterrupt``), or the training after the
    current step."""
    import swarm_opt
    from swarm_opt.config import SwarmConfig, Timeouts

    # everything that needs no network first, so that a typo or a broken recipe costs no DHT start-up
    recipe = apply_recipe(load_task(args.task, seed=args.seed), args)
    SwarmConfig(args.run_id, args.target_batch_size, args.batch_size)
    Timeouts(matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout)
    if args.batch_size > args.target_batch_size:
        raise ConfigError(f"--batch-size ({args.batch_size}) must not exceed --target-batch-size "
                          f"({args.target_batch_size})")
    if args.gloo_lane is not None and args.aggregation is not None:
        raise ConfigError("--aggregation needs hivemind's averaging path (the gloo lane computes the plain weighted "
                          "mean): drop --gloo-lane or --aggregation")
    strategy = make_strategy(args)
    identity = _identity(recipe, strategy, args)
    transport = None if args.gloo_lane is None else swarm_opt.Gloo(*args.gloo_lane)
    data_seed = args.data_seed if args.data_seed is not None else int.from_bytes(os.urandom(4), "little")

    if args.auxiliary and args.client_mode:
        raise ConfigError("--auxiliary peers reduce what trainers send them, so they must accept connections: "
                          "drop --client-mode")
    board = None
    if args.log_dir is not None:
        from swarm_opt.monitor.tensorboard import TensorBoardLog

        board = TensorBoardLog(args.log_dir)  # an unwritable directory fails here, before the DHT starts
    metrics = start_metrics(args)  # and so does a port in use
    ckpt = _Checkpoints(args, identity) if args.checkpoint_dir else None  # and a directory it cannot write
    stop.raise_if_requested()
    dht = start_dht(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                    announce_maddrs=args.announce_maddrs, client_mode=args.client_mode,
                    identity_path=args.identity_path, private_run=private_run(args),
                    join_timeout=args.join_timeout, stop=stop.event)
    claim: Optional[Beacon] = None
    beacon: Optional[Beacon] = None
    try:  # a source that cannot open its shard says so before this peer joins
        if not args.auxiliary:  # a helper trains nothing: it claims no data
            shard, claim = _shard(args, recipe, dht, data_seed)
            batches = _Batches(recipe, args.batch_size, data_seed, shard)
        beacon = _check_recipe(dht, args, identity)
        from swarm_opt.monitor.stats import StatsPublisher

        role = "auxiliary" if args.auxiliary else "client" if args.client_mode else "trainer"
        stats = StatsPublisher(dht, args.run_id, role=role)  # what monitors show of this peer (one store per epoch)
        stop.raise_if_requested()
    except BaseException:  # a bad shard or recipe, or a Ctrl-C: leave before joining
        if claim is not None:
            claim.stop()
        if beacon is not None:
            beacon.stop(withdraw=False)
        dht.shutdown()
        raise
    if metrics is not None:
        metrics.watch(dht=dht)
    if args.auxiliary:
        return _run_auxiliary(args, recipe, strategy, dht, stop, identity.fingerprint, beacon, stats, metrics)
    opt: Optional[swarm_opt.Optimizer] = None
    bar: Optional[_ProgressBar] = None
    longest: Optional[_LongestStep] = None
    model, scaler = recipe.model, recipe.grad_scaler()
    try:
        # joining may download the swarm's state for a while: a Ctrl-C meanwhile stops the peer before its first step
        stop.message = _STOPPING
        opt = swarm_opt.Optimizer(
            dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
            batch_size_per_step=args.batch_size, params=recipe.groups(),
            optimizer=recipe.build_optimizer, scheduler=recipe.schedule, strategy=strategy,
            matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
            transport=transport, aggregation=args.aggregation, clip_grad_norm=recipe.clip_grad_norm,
            identity=identity.fingerprint,
        )
        opt.observe(stats)
        stats.watch(opt)
        if metrics is not None:
            metrics.watch(opt)
            opt.observe(metrics)
        shard = f", data shard {batches.shard}" if batches.shard is not None else ""
        _say(f"joined run '{args.run_id}' as peer {dht.peer_id} "
             f"({'client mode' if args.client_mode else 'accepting connections'}); "
             f"task {args.task}, strategy {args.strategy}{shard}")
        if not args.client_mode:
            for maddr in dht.get_visible_maddrs():
                _say(f"others can join through {maddr}")
        if (slow := recipe.emulated_precision()) is not None:
            _say(f"note: {slow}")
        if ckpt is not None:
            ckpt.restore(opt, model)
        _wait_for_peers(opt, args.min_peers, stop)

        bar = _ProgressBar(args.target_batch_size)
        last_epoch = opt.local_epoch
        stats.publish(last_epoch)
        losses = _EpochLoss()
        longest = _LongestStep(stop)
        model.train()
        while not stop.requested and (args.epochs is None or opt.local_epoch < args.epochs):
            batch = batches.next()
            if batch is None:
                break
            x, y = batch
            opt.zero_grad()
            with recipe.autocast():
                loss = recipe.loss_fn(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                with longest.timing(opt):
                    scaler.step(opt, batch_size=_batch_size_of(y))
                scaler.update()
            else:
                loss.backward()
                with longest.timing(opt):
                    opt.step(batch_size=_batch_size_of(y))
            losses.add(loss)
            if opt.local_epoch != last_epoch:
                last_epoch = opt.local_epoch
                test_metrics = _evaluate_if_due(opt, recipe)
                epoch_loss = losses.take()
                stats.publish(last_epoch, epoch_loss)
                if board is not None:
                    board.log_epoch(opt, loss=epoch_loss, test_metrics=test_metrics)
                bar.write(_epoch_line(opt, test_metrics))
                if ckpt is not None:
                    ckpt.maybe_save(opt, model)
                bar.update(opt, force=True)
            else:
                stats.publish(last_epoch)  # a heartbeat: stores only once a minute within an epoch
                bar.update(opt)
        if args.epochs is not None and opt.local_epoch >= args.epochs:
            _stay_for_stragglers(opt, stop)
    except KeyboardInterrupt:  # a second Ctrl-C: abandon the step, still leave cleanly
        pass
    finally:
        beacon.stop(withdraw=False)
        if claim is not None:
            claim.stop()
        if bar is not None:
            bar.close()
        save = None if ckpt is None or not ckpt.restored else lambda: ckpt.save_at_exit(opt, model)
        _leave(opt, dht, save, stats, metrics, board)
    epoch = opt.local_epoch if opt else 0
    if batches.failure is not None:
        _say(f"the training source of data shard {batches.shard} failed after {batches.samples:,} samples at "
             f"epoch {epoch}: {batches.failure}; left the run. Fix the task's streaming source (train_data)")
        return 1
    if batches.exhausted:
        _say(f"the training source of data shard {batches.shard} ran out after {batches.samples:,} samples at "
             f"epoch {epoch}; left the run. To train on, give the task's source more data (or let it repeat), or "
             f"join with another --shard")
        return 0
    steps = "" if longest is None else longest.describe()
    if stop.requested:
        _say(f"stopped by {stop.signal_name} at epoch {epoch}{steps}")
    else:
        lane = f", {opt._averager.lane_rounds} round(s) over the gloo lane" if args.gloo_lane else ""
        _say(f"reached epoch {epoch}{lane}; done{steps}")
    return 1 if ckpt is not None and ckpt.exit_failed else 0


_STOPPING = "swarm-opt train: stopping after the current step (Ctrl-C again to stop at once)"


def _run_auxiliary(args: argparse.Namespace, recipe: Recipe, strategy: Any, dht: Any, stop: StopRequest,
                   identity: str, beacon: Beacon, stats: Any, metrics: Any) -> int:
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
        stop.message = _STOPPING
        params = [p for group in recipe.groups() for p in (group["params"] if isinstance(group, dict) else [group])]
        helper = swarm_opt.AuxiliaryPeer(dht=dht, run_id=args.run_id, params=params,
                                         strategy=strategy, matchmaking_time=args.matchmaking_time,
                                         averaging_timeout=args.averaging_timeout,
                                         aggregation=args.aggregation, identity=identity)
        stats.watch(helper)
        if metrics is not None:
            metrics.watch(helper)
        _say(f"helping run '{args.run_id}' as auxiliary peer {dht.peer_id}: reduces a share of every round, "
             f"trains nothing")
        helper.run(epochs=args.epochs, stop=stop.event)
    except KeyboardInterrupt:
        pass
    finally:
        done.set()
        beacon.stop(withdraw=False)
        _leave(helper, dht, None, stats, metrics)
    helped = helper.rounds_helped if helper is not None else 0
    _say(f"helped {helped} round(s), reduced {helper.values_reduced if helper else 0:,} values; done")
    return 0


_QUIET_STAY = 3.0  # seconds a finished peer stays without a word: its last round's groupmates publish it meanwhile


def _stay_for_stragglers(opt: Any, stop: StopRequest) -> None:
    """Having reached ``--epochs``, stay a donor while live peers of the run still stand at an earlier epoch: one
    late to the last round then downloads the final state, instead of computing a second version of that epoch alone
    once the others left (clean leavers are not waited for). At most the round deadline; a dead peer's record expires
    within seconds (``TrackerConfig.record_ttl``)."""
    began = time.monotonic()
    deadline, said = began + opt.timeouts.averaging_timeout, False
    while not stop.requested and time.monotonic() < deadline and (behind := opt.progress.behind) > 0:
        if not said and time.monotonic() - began > _QUIET_STAY:  # (groupmates of the last round republish first)
            _say(f"staying up to {opt.timeouts.averaging_timeout:.0f} s for {behind} peer(s) still at an earlier "
                 f"epoch to take the final state (Ctrl-C leaves now)")
            said = True
        time.sleep(0.2)


def _wait_for_peers(opt: Any, min_peers: int, stop: StopRequest) -> None:
    if opt.progress.num_peers >= min_peers:
        return
    _say(f"waiting for {min_peers} peers to train together ({opt.progress.num_peers} now)")
    while opt.progress.num_peers < min_peers and not stop.requested:
        stop.wait(0.1)


class _Checkpoints:
    """``--checkpoint-dir``: resume from it, save every ``--checkpoint-every`` epochs and at exit. A directory that
    cannot be written at start is bad input (one line, before the DHT starts); a save that fails later (disk full,
    directory made read-only) is one line and training goes on, the next save tries again and says when saves work
    again; a failed save at exit makes the exit status 1. What was saved before stays intact (``Checkpointer``)."""

    def __init__(self, args: argparse.Namespace, identity: _Identity) -> None:
        import swarm_opt

        self._args, self._identity = args, identity
        try:
            self._writer = swarm_opt.Checkpointer(args.checkpoint_dir, every_epochs=args.checkpoint_every,
                                                  keep_last=3)
        except swarm_opt.CheckpointWriteError as e:
            raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: {e}") from None
        self._failing: Optional[int] = None  # errno of the failure said last, until a save works again
        self.restored = False  # nothing is saved over a checkpoint that was not restored (another run's)
        self.exit_failed = False

    def restore(self, opt: Any, model: torch.nn.Module) -> None:
        import swarm_opt

        try:
            restored = self._writer.restore(opt, model, schemas=self._identity.legacy)
        except swarm_opt.IncompatibleStateError:
            self._writer.close()  # and nothing is saved over it
            raise ConfigError(f"cannot resume from --checkpoint-dir {self._args.checkpoint_dir}: its checkpoint was "
                              f"saved with another model, strategy or recipe settings; start with a fresh "
                              f"--checkpoint-dir, or with the settings it was saved with") from None
        self.restored = True
        if restored is not None:
            _say(f"resumed from {self._writer.latest()} (epoch {restored['epoch']}); the swarm's newer state, if "
                 f"any, is downloaded at the first step")

    def maybe_save(self, opt: Any, model: torch.nn.Module) -> None:
        import swarm_opt

        try:
            path = self._writer.maybe_save(opt, model, extra=self._extra())
        except swarm_opt.CheckpointWriteError as e:
            if e.errno != self._failing:  # said once per cause, not at every epoch it persists
                _say(f"{e}; training continues, and the next checkpoint tries again")
            self._failing = e.errno
            return
        if path is not None and self._failing is not None:
            self._failing = None
            _say(f"checkpoints are saved again: {path} (epoch {opt.local_epoch})")

    def save_at_exit(self, opt: Any, model: torch.nn.Module) -> None:
        import swarm_opt

        try:
            path = self._writer.save(opt, model, extra=self._extra())
        except swarm_opt.CheckpointWriteError as e:
            self.exit_failed = True
            _say(f"{e}; leaving without a checkpoint of epoch {opt.local_epoch}")
            return
        _say(f"saved checkpoint {path} (epoch {opt.local_epoch})")

    def _extra(self) -> Dict[str, Any]:
        args = self._args
        return {"run_id": args.run_id, "task": args.task, "strategy": args.strategy, "time": time.time(),
                "recipe": self._identity.fingerprint}


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
