"""Auxiliary peers: machines with bandwidth but no accelerator that help a swarm average.

An auxiliary peer trains nothing and sends nothing of its own. It joins each round of a run as a reducer: it
receives its share of every trainer's values, averages them and returns the mean, so the trainers' links carry
less (in a butterfly all-reduce each member reduces ``1/group size`` of the values). It counts in no majority, is
never a state donor and publishes no progress, so a run behaves the same with or without helpers.

hivemind's auxiliary mode is broken since its PR #432 (the averager stopped passing the members' modes to the
all-reduce, so an auxiliary peer sends zero-weight copies of its tensors like a trainer and has them overwritten by
the average); swarm_opt's engine passes the modes, so a helper only reduces.

    helper = swarm_opt.AuxiliaryPeer(dht=dht, run_id="mnist_run42", params=model.parameters(),
                                     strategy=swarm_opt.GradientAveraging())
    helper.run()            # until Ctrl-C; run(epochs=100) returns once the run reached epoch 100

The parameters only give the shapes of what the trainers average (the helper never reads their values); the
strategy, its arguments and the codec must be the trainers'.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Iterable, Optional, Sequence

import torch
from hivemind.dht import DHT

from swarm_opt._hivemind.gather import ROUND_KEY
from swarm_opt._hivemind.rebootstrap import watch_dht
from swarm_opt._hivemind.tensor_averager import TensorAverager
from swarm_opt.aggregation import Aggregation
from swarm_opt.auth import run_access
from swarm_opt.compression import Compression
from swarm_opt.config import SwarmConfig, Timeouts, TrackerConfig
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.monitor import RunMonitor, RunSnapshot
from swarm_opt.optimizer import averaging_prefix, identified_schema, strategy_schema
from swarm_opt.options import resolve
from swarm_opt.strategies.base import Strategy

logger = logging.getLogger(__name__)

_REFRESH_PERIOD = 1.0  # seconds between reads of the swarm's progress while no round is near


def _nothing_to_send(buffers: Sequence[torch.Tensor]) -> None:
    """An auxiliary peer's values: none (its buffers only size its share of the all-reduce)."""


class AuxiliaryPeer:
    """Help the trainers of ``run_id`` average: reduce a share of every round without contributing to it.

    :param dht: a started ``hivemind.DHT`` that accepts connections (not ``client_mode``: reducers are dialled).
    :param run_id: the run to help.
    :param params: the trainers' parameters (or tensors of the same shapes and dtypes), in the same order.
    :param strategy: the trainers' strategy (a fresh instance with the same arguments); default
        ``GradientAveraging()``.
    :param compression: the trainers' codec; PowerSGD runs a protocol of its own, which helpers cannot join.
    :param aggregation: the trainers' aggregation (``Mean()`` by default): this helper reduces parts with it.
    :param timeouts: the trainers' ``Timeouts(...)``; ``matchmaking_time=`` and ``averaging_timeout=`` are accepted
        as aliases (not together with ``timeouts=``).
    :param identity: the trainers' ``Optimizer(identity=...)``, if any.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        params: Iterable[torch.Tensor],
        strategy: Optional[Strategy] = None,
        compression: Optional[Compression] = None,
        aggregation: Optional[Aggregation] = None,
        timeouts: Optional[Timeouts] = None,
        matchmaking_time: Optional[float] = None,  # alias of Timeouts(matchmaking_time=...)
        averaging_timeout: Optional[float] = None,  # alias of Timeouts(averaging_timeout=...)
        identity: Optional[str] = None,
    ) -> None:
        SwarmConfig(run_id, target_batch_size=1)  # validates the run id
        # every rule that pairs two options, checked before anything is bound (swarm_opt.options)
        averaging = resolve(strategy=strategy, compression=compression, aggregation=aggregation, timeouts=timeouts,
                            matchmaking_time=matchmaking_time, averaging_timeout=averaging_timeout, auxiliary=True)
        self.timeouts, strategy = averaging.timeouts, averaging.strategy
        codec, aggregation = averaging.compression, averaging.aggregation
        if not isinstance(dht, DHT):
            raise ConfigTypeError(f"dht must be a started hivemind.DHT, got {type(dht).__name__}")
        if dht.client_mode:
            raise ConfigError("an auxiliary peer reduces parts that the trainers send to it, so it must accept "
                              "connections: start its DHT without client_mode")
        watch_dht(dht)  # re-bootstraps it if it loses sight of the swarm; once per DHT, ends with the DHT process
        params = [p for p in params]
        if not params:
            raise ConfigError("params is empty: pass the parameters of the model the trainers train")
        # the strategy says what a round averages (its shapes); a zero-lr optimizer binds it without training
        strategy.bind(params, torch.optim.SGD(params, lr=0.0))
        averaging.check_bound()
        self.run_id = run_id
        self.model_schema = identified_schema(strategy_schema(params, strategy), identity)
        # the ETA a trainer's tracker sees (samples extrapolated since each record), so that the helper declares for
        # the trainers' deadline
        self._monitor = RunMonitor(dht, run_id, model_schema=self.model_schema,
                                   max_extrapolation=TrackerConfig().max_extrapolation)
        self._averager = TensorAverager(
            dht, prefix=averaging_prefix(run_id, strategy.name, self.model_schema),
            templates=strategy.buffer_templates(), timeouts=self.timeouts, compression=codec, aggregation=aggregation,
            auxiliary=True, access=run_access(dht, run_id))
        self._snapshot: Optional[RunSnapshot] = None
        self._snapshot_time = -float("inf")
        self.rounds_helped = 0
        self._epoch_seen = 0  # the highest global epoch this helper has seen the run reach
        self._trainers_seen: Optional[float] = None  # when this helper last saw a trainer's record
        self._reported = 0
        self._values_per_round = sum(t.numel() for t in strategy.buffer_templates())
        self._closed = False

    def _read(self, max_age: float) -> RunSnapshot:
        if self._snapshot is None or time.monotonic() - self._snapshot_time > max_age:
            self._snapshot, self._snapshot_time = self._monitor.read(), time.monotonic()
        return self._snapshot

    def run(self, *, epochs: Optional[int] = None, stop: Optional[threading.Event] = None) -> None:
        """Help every round until the run reaches global epoch ``epochs``, or its trainers are gone for
        ``averaging_timeout`` (default: until ``stop`` is set or the process is interrupted)."""
        stop = stop or threading.Event()
        while not stop.is_set() and not self._closed and not self._run_is_over(epochs):
            snapshot = self._read(max_age=_REFRESH_PERIOD)  # the one just read
            eta = snapshot.eta_seconds
            if not snapshot.peers or eta is None or eta > self.timeouts.matchmaking_time:
                wait = _REFRESH_PERIOD if eta is None else min(_REFRESH_PERIOD, eta - self.timeouts.matchmaking_time)
                if snapshot.peers and eta == math.inf:  # no throughput reported yet: the first epoch may be short
                    wait = _REFRESH_PERIOD / 4
                stop.wait(max(0.05, wait))
                continue
            # a helper never gives up a round it is looking for a group for (a trainer would then hold stale
            # values; a helper holds none): if the swarm completes this round without it, it follows the next
            result = self._averager.all_reduce(_nothing_to_send, 0.0, snapshot.epoch + 1,
                                               lambda: self._run_is_over(epochs, max_age=_REFRESH_PERIOD))
            if result is None:
                logger.debug(f"Could not help round {snapshot.epoch + 1}")
                continue
            rounds = [info.get(ROUND_KEY) for info in result.gathered.values() if isinstance(info, dict)]
            round_id = max((r for r in rounds if isinstance(r, int)), default=snapshot.epoch + 1)
            # the trainers may leave as soon as they commit the last round: it counts as reached
            self._epoch_seen = max(self._epoch_seen, round_id)
            reduced, self._reported = self._averager.values_reduced - self._reported, self._averager.values_reduced
            if reduced:
                self.rounds_helped += 1
                logger.info(f"Helped round {round_id}: reduced {reduced:,} of {self._values_per_round:,} values for "
                            f"{result.group_size} trainer(s)")
            else:  # a part never spans two tensors: a few large tensors may leave a member without a share
                logger.debug(f"Joined round {round_id} but was given no part of it to reduce")
            deadline = time.monotonic() + self.timeouts.matchmaking_time  # the trainers publish their new epoch
            while not stop.is_set() and self._read(max_age=0.0).epoch < round_id and time.monotonic() < deadline:
                stop.wait(0.1)

    def _run_is_over(self, epochs: Optional[int], max_age: float = 0.0) -> bool:
        """Whether the run has reached global epoch ``epochs``, as far as this helper has seen; or, ``epochs``
        given, its trainers are gone: none seen for ``averaging_timeout`` since the last. Trainers withdraw their
        records as they leave, and a helper that missed the last rounds would otherwise never see their epoch."""
        snapshot = self._read(max_age)
        self._epoch_seen = max(self._epoch_seen, snapshot.epoch)
        if snapshot.peers:
            self._trainers_seen = time.monotonic()
        if epochs is None:
            return False
        if self._epoch_seen >= epochs:
            return True
        if self._trainers_seen is not None and time.monotonic() - self._trainers_seen > self.timeouts.averaging_timeout:
            logger.info(f"No trainer seen for {self.timeouts.averaging_timeout:g} s since epoch {self._epoch_seen} "
                        f"(of {epochs}): the run is over or stopped; done helping")
            return True
        return False

    @property
    def values_reduced(self) -> int:
        """Values this helper has reduced for the trainers so far (each sent to it once and returned averaged)."""
        return self._averager.values_reduced

    def shutdown(self) -> None:
        """Leave the swarm; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._averager.shutdown()

    def __enter__(self) -> AuxiliaryPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
