"""``swarm_opt.Optimizer``: the fixed step loop that turns a local training loop into a swarm peer.

The loop knows no algorithm. Every ``step()`` hands the gradients to the strategy, reports progress, and when the
swarm has processed ``target_batch_size`` samples it begins the strategy's round and runs it (``swarm_opt.round``:
waiting for it, or polling it when it averages in the background). A round commits only if this peer's group holds
a majority of the live peers (or everyone), so at most one version of each epoch exists; a peer whose round failed
keeps its local progress and retries, and a peer that finds the swarm ahead of it downloads the swarm's state
instead of training on stale parameters.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import os
import random
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm_opt import protocol as swarm_protocol
from swarm_opt import state_sync
from swarm_opt._hivemind.gather import BOUND_KEY, COUNTED_KEY, DIGEST_KEY, PEERS_KEY
from swarm_opt._hivemind.rebootstrap import watch_dht
from swarm_opt._hivemind.tensor_averager import TensorAverager
from swarm_opt._libc import malloc_trim
from swarm_opt.aggregation import Aggregation
from swarm_opt.auth import run_access
from swarm_opt.buffers import AveragingResult
from swarm_opt.clipping import GradNormClipping
from swarm_opt.compression import Compression
from swarm_opt.config import Groups, SwarmConfig, Timeouts, TrackerConfig
from swarm_opt.digest import digest_tolerance, digests_agree, majority, parameter_digest, valid_digest
from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError, StateDownloadError
from swarm_opt.gloo_lane import Gloo
from swarm_opt.groups import Grid, RoundPlan
from swarm_opt.metrics import NO_METRICS, Metrics
from swarm_opt.offload import Offload, OffloadedParameters
from swarm_opt.options import resolve
from swarm_opt.privacy import OpacusPrivacy
from swarm_opt.progress import ProgressTracker, SwarmProgress
from swarm_opt.ranks import LocalGroup, join_local_group, unshard_params
from swarm_opt.round import RoundInFlight, RoundRunner, is_majority
from swarm_opt.strategies.base import Strategy

logger = logging.getLogger(__name__)

#: a private run's tracking stays under one key, read whole (O(N) per peer): its donors check a newcomer's record there
PRIVATE_RUN_EXACT_UP_TO = 2**40


@dataclass(frozen=True)
class RoundReport:
    """What happened at this peer's last epoch change: a committed round, or ``caught_up`` with the swarm without
    averaging: by downloading its state (``downloaded``), or, for local-update strategies, by going on from the
    local model."""

    epoch: int
    group_size: int
    num_peers: int
    samples: int
    weight: float
    seconds: float
    caught_up: bool
    helpers: int = 0  # auxiliary peers that reduced parts of the round (they count in no majority)
    downloaded: bool = False


OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
_CATCH_UP_BACKOFF = 5.0  # seconds between automatic catch-up attempts that found no usable donor


class Optimizer(torch.optim.Optimizer):
    """A drop-in ``torch.optim.Optimizer`` whose steps are coordinated with a swarm of peers over a hivemind DHT.

    :param dht: a started ``hivemind.DHT``; its ``client_mode`` decides whether this peer accepts connections.
    :param run_id: peers with the same run_id train together.
    :param target_batch_size: the global batch: the swarm makes one step (an *epoch*) per this many samples.
    :param optimizer: the inner optimizer: a factory ``lambda params: torch.optim.SGD(params, ...)`` or an instance.
    :param params: the parameters (or param groups) to train; required with a factory, forbidden with an instance.
    :param batch_size_per_step: samples per ``step()`` unless ``step(batch_size=...)`` is given.
    :param scheduler: a factory ``lambda opt: StepLR(opt, ...)`` (or an instance bound to the given optimizer);
        it steps once per global epoch, so every peer, late joiners included, uses the same learning rate.
    :param strategy: the algorithm; default ``GradientAveraging()`` (synchronous large-batch training).
    :param timeouts: how long each network phase may take, ``Timeouts(matchmaking_time=..., averaging_timeout=...,
        state_download_timeout=...)`` (default ``Timeouts()``). ``matchmaking_time=`` and ``averaging_timeout=`` are
        accepted as aliases (hivemind's names), not together with ``timeouts=``.
    :param compression: the codec of the averaged tensors: ``NoCompression()`` (default), ``Float16()``,
        ``Int8Blockwise()`` or ``Uniform8Bit()`` (see ``swarm_opt.compression`` for their error bounds), or, with
        gradient averaging, ``PowerSGD(rank=4)`` (low-rank factors with error feedback,
        ``swarm_opt.compression.powersgd``).
    :param aggregation: how each averaged part is combined: ``Mean()`` (default: the weighted mean, each member's
        norm bounded), or a Byzantine-robust ``CenteredClip()`` or ``TrimmedMean()`` (``swarm_opt.aggregation``),
        each optionally within ``Reputation(...)`` (members whose values keep pointing the wrong way, round after
        round, left out) and ``Audited(...)`` (every part reduced twice and compared: contains a lying reducer, at
        2x the bytes). Every peer of a run passes the same.
    :param tracker: how often progress is published and read (``TrackerConfig``).
    :param offload: ``Offload()`` keeps the inner optimizer and swarm_opt's buffers in host memory (accelerator
        users); needs an optimizer factory.
    :param privacy: ``OpacusPrivacy(engine, delta=...)`` when ``optimizer`` is an Opacus-private (DP-SGD) optimizer:
        strategies that would let un-noised data out are refused, and each round's log line reports ε
        (``swarm_opt.privacy``).
    :param transport: ``Gloo(host=...)`` averages rounds over torch.distributed's gloo when every member of the
        round's group offers it (much faster than hivemind's path; trusted networks only, see ``swarm_opt.Gloo``);
        default ``None``: hivemind's path. Carries ``NoCompression()``, ``Float16()`` and ``PowerSGD(...)``.
    :param groups: ``Groups(size=16)`` averages each round in groups of at most that many peers over a Moshpit grid
        of the live peers (``swarm_opt.groups``: the groups mix the swarm over log_size(N) rounds) instead of in one
        group of the whole swarm; a swarm of at most ``size`` peers is one group. Every strategy but ``FedNova``
        (``GradientAveraging``'s rounds then carry the parameters and optimizer statistics too: see its docstring);
        default ``None``: one group.
    :param clip_grad_norm: clip the gradient the inner optimizer applies to this L2 norm, all parameters together
        (``swarm_opt.clipping``): with ``GradientAveraging`` the round's mean gradient, the same on every member, so
        the swarm equals one process that clips its accumulated global batch; with local updates each local step's.
        With a ``GradScaler``, ``scaler.step(opt)`` unscales before any clipping. Do not also clip before ``step()``:
        that clips each micro-batch. Default ``None``: no clipping.
    :param identity: anything else the run's peers must share to train together (e.g. ``Recipe.fingerprint``: the
        learning rate, schedule, precision): mixed into ``model_schema``, so that peers whose identities differ never
        average, download each other's state or count each other's progress. Default ``None``: the model and
        strategy alone.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        optimizer: Union[torch.optim.Optimizer, OptimizerFactory],
        params: Optional[Iterable[Any]] = None,
        batch_size_per_step: Optional[int] = None,
        scheduler: Optional[Union[SchedulerFactory, Any]] = None,
        strategy: Optional[Strategy] = None,
        timeouts: Optional[Timeouts] = None,
        matchmaking_time: Optional[float] = None,  # alias of Timeouts(matchmaking_time=...)
        averaging_timeout: Optional[float] = None,  # alias of Timeouts(averaging_timeout=...)
        compression: Optional[Compression] = None,
        aggregation: Optional[Aggregation] = None,
        tracker: Optional[TrackerConfig] = None,
        offload: Optional[Offload] = None,
        transport: Optional[Gloo] = None,
        privacy: Optional[OpacusPrivacy] = None,
        groups: Optional[Groups] = None,
        clip_grad_norm: Optional[float] = None,
        identity: Optional[str] = None,
        local_group: Union[LocalGroup, Any, None] = None,
    ) -> None:
        self.config = SwarmConfig(run_id, target_batch_size, batch_size_per_step)
        # every rule that pairs two options, checked before anything is bound (swarm_opt.options)
        averaging = resolve(strategy=strategy, compression=compression, aggregation=aggregation, transport=transport,
                            groups=groups, privacy=privacy, timeouts=timeouts, matchmaking_time=matchmaking_time,
                            averaging_timeout=averaging_timeout, clip_grad_norm=clip_grad_norm)
        max_norm, self.timeouts, strategy = averaging.clip_grad_norm, averaging.timeouts, averaging.strategy
        if dht is not None and not isinstance(dht, DHT):
            raise ConfigTypeError(f"dht must be a started hivemind.DHT, got {type(dht).__name__}")
        # a model sharded over the machine's ranks (FSDP2): rank 0 trains one full copy of it (swarm_opt.shards)
        params, shards = unshard_params(local_group, optimizer, params)
        self._offload = _make_offload(offload, optimizer, params)
        if self._offload is not None and params is not None:
            params = self._offload.groups
        self.inner = _make_inner_optimizer(optimizer, params)
        self.scheduler = _make_scheduler(scheduler, self.inner,
                                         optimizer_is_factory=not isinstance(optimizer, torch.optim.Optimizer))
        self._params = [p for group in self.inner.param_groups for p in group["params"]]
        self.strategy = strategy
        self.privacy = averaging.privacy
        if self.privacy is not None:
            self.privacy.check_optimizer(self.inner)
        self.strategy.bind(self._params, self.inner)
        averaging.check_bound()  # bound: what the strategy's rounds send is known
        compression, aggregation = averaging.compression, averaging.aggregation

        self._init_torch_hooks()
        self._epoch, self._samples = 0, 0
        self._loss_sum, self._loss_count = 0.0, 0
        self._state_lock = threading.RLock()
        self._next_catch_up = 0.0
        # the epoch at which this peer last held the swarm's state (founded it, committed a round, downloaded or
        # resumed it); None before: catching up by the strategy's local rule counts the rounds missed since then
        self._synced_epoch: Optional[int] = None
        self._step_returned: Optional[float] = None  # when step() last returned (monotonic)
        self._closed = False
        self._resync_donors: Tuple[Any, ...] = ()  # set when a round showed our parameters outside the majority's
        self._cut_off_said = False  # whether the last ``_cut_off`` said this peer is cut off
        self._digest_tolerance = digest_tolerance(self._params)
        self.last_round: Optional[RoundReport] = None
        self.metrics: Metrics = NO_METRICS  # see observe()
        self.model_schema = identified_schema(strategy_schema(self._params, strategy), identity)
        #: the schemas older releases give this model -> their protocol (swarm_opt.protocol): resumable checkpoints,
        #: and the peers the tracker names as another version
        self.legacy_schemas = legacy_schemas(self._params, strategy, identity)
        # the machine's other ranks (swarm_opt.ranks): collective; on a follower, rank 0 is this peer's swarm part
        self._ranks = join_local_group(local_group, self, dht=dht, offloaded=self._offload is not None,
                                       report_type=RoundReport, shards=shards)
        self._leave_at_exit = _LeaveAtExit(self)  # a script that ends without shutdown() still leaves cleanly
        if self._ranks.follows:
            self._clipping = None if max_norm is None else GradNormClipping(self.inner, max_norm)
            self._ranks.joined(self)  # takes rank 0's state once it joined the swarm
            return
        if dht is None:
            raise ConfigTypeError("dht must be a started hivemind.DHT, got None")
        watch_dht(dht)  # re-bootstraps it if it loses sight of the swarm; once per DHT, ends with the DHT process

        access = run_access(dht, run_id)
        tracker = tracker or TrackerConfig()
        if access is not None:  # a private run's donors admit peers by their record under the run's one key
            tracker = replace(tracker, exact_up_to=PRIVATE_RUN_EXACT_UP_TO)  # (RunAccess): it is never sharded
        self._tracker = ProgressTracker(dht, run_id, target_batch_size, model_schema=self.model_schema, config=tracker,
                                        digest_tolerance=self._digest_tolerance, legacy_schemas=self.legacy_schemas)
        self._averager = TensorAverager(
            dht, prefix=averaging_prefix(run_id, strategy.name, self.model_schema),
            templates=self.strategy.buffer_templates(), timeouts=self.timeouts,
            compression=compression, aggregation=aggregation, state_provider=self._shareable_state,
            member_info=self._member_info, access=access, lane=transport,
            target_group_size=None if groups is None else groups.size,
        )
        self._grid = Grid(None if groups is None else groups.size, self._averager.peer_id,
                          live_peers=self._tracker.live_peers)
        self._averager.group_key = lambda round_id: self._grid.plan(round_id, self._tracker.progress.num_peers).cell
        self._rounds = RoundRunner(self._averager, lock=self._state_lock, on_commit=self._committed,
                                   await_target=self._await_target, agrees=self._agrees, grid=self._grid)
        self._bad_donors: set = set()  # peers that served a state the majority of the swarm disowned
        #: the swarm's state downloaded as this peer joined, kept until its first step: a checkpoint loaded after
        #: construction (and older) is then put under it again instead of downloaded twice (``_resume``)
        self._joined_state: Optional[Tuple[Any, List[torch.Tensor], bytes]] = None
        self._clipping = None
        try:
            self._tracker.report(0, 0, params_digest=self._params_digest())
            self._tracker.start()
            # founders of a run (nobody ahead of epoch 0) start from the same model if they seed it identically; if
            # not, their first round's digests tell them apart: it commits on none, and all but one group download
            # (_agrees) (a newcomer publishes no record, and its epoch is no evidence, until it holds a state: see
            # mark_joined)
            if self._tracker.progress.epoch == 0:
                self._mark_synced()
                self._averager.offer_state(self._epoch)
            else:
                self._join_running_swarm(self._tracker.progress.epoch)
        except BaseException:  # e.g. a Ctrl-C while a newcomer downloads: leave the swarm it was joining
            self.shutdown()
            raise
        # last, once nothing can fail: a hook on the user's optimizer is removed only at shutdown. It clips every step
        # of the inner optimizer, the one place every strategy goes through (swarm_opt.clipping)
        self._clipping = None if max_norm is None else GradNormClipping(self.inner, max_norm)
        self._ranks.joined(self)  # the machine's other ranks take this state (swarm_opt.ranks)

    # --- torch.optim.Optimizer surface ------------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Dict[Any, Any]:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @property
    def local_epoch(self) -> int:
        """The global epoch this peer's parameters belong to."""
        return self._epoch

    @property
    def progress(self) -> SwarmProgress:
        """The swarm's progress as this peer sees it (no network call). ``epsilon`` is the privacy this peer spent so
        far: with ``privacy=``, its DP-SGD's (Opacus's accountant, sample-level); otherwise the strategy's peer-level
        DP's (``PeerDP(..., delta=...)``), if any."""
        progress = self._ranks.progress if self._ranks.follows else self._tracker.progress
        epsilon = self.privacy.epsilon() if self.privacy is not None else self.strategy.epsilon()
        return progress if epsilon is None else replace(progress, epsilon=epsilon)

    @property
    def deadlines(self) -> Tuple[float, float]:
        """``(matchmaking_time, averaging_timeout)`` of this peer's next round: with ``Timeouts(adaptive=True)`` (the
        default) they follow the swarm's measured round times, within the given ones (``swarm_opt.deadlines``)."""
        return self._averager.deadlines.now

    @property
    def grad_norm(self) -> Optional[float]:
        """With ``clip_grad_norm``: the L2 norm, before clipping, of the gradient the inner optimizer applied last
        (the round's mean gradient with ``GradientAveraging``, the last local step's with local updates); None
        before the first step or without clipping."""
        return None if self._clipping is None else self._clipping.last_norm

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise ConfigError("swarm_opt.Optimizer does not support add_param_group; pass all param groups at creation")

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._offload is not None:  # the host copies' gradients are overwritten at every step
            self._offload.zero_grad(set_to_none)
        else:
            self.inner.zero_grad(set_to_none=set_to_none)

    def _push_offloaded(self) -> None:
        if self._offload is not None:
            with torch.no_grad(), self._state_lock:
                self._offload.push()

    def step(self, closure: Optional[Callable[[], Any]] = None, batch_size: Optional[int] = None) -> Any:  # type: ignore[override]
        """Consume this step's gradients; when the swarm reaches the global batch, average and update together."""
        if self._closed:
            raise RuntimeError("this swarm_opt.Optimizer was shut down; create a new one to keep training")
        if self._ranks.follows:  # this machine's rank 0 does the swarm's part of the step (swarm_opt.ranks)
            return self._ranks.follow(self, closure, batch_size)
        self._note_step_period()
        if self._joined_state is not None:  # its tensors may be the inner optimizer's own, which this step changes
            self._joined_state = None
            malloc_trim()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batch_size = self._ranks.combine(self, self._resolve_batch_size(batch_size))  # the machine's, over its ranks
        if loss is not None:
            self.report_loss(loss)

        with torch.no_grad(), self._state_lock:
            if self._offload is not None:
                self._offload.pull()
            stepped = self.strategy.local_step(batch_size)
            if stepped:
                self._samples += batch_size
            else:
                logger.debug("Skipped a step with non-finite gradients; it is not averaged into the swarm")
        # while a round is in flight in the background, the samples computed since it began are the next epoch's:
        # publishing them for this one would let the swarm start its next round short of the global batch
        in_flight = self._rounds.samples_in_flight
        self._tracker.report(self._epoch, self._samples if in_flight is None else in_flight)

        progress = self._tracker.progress
        if self._rounds.in_flight:  # a round in the background: nothing else starts until it is concluded
            self._rounds.poll()
        elif (version := self._tracker.other_version) is not None:
            self._take_other_version(*version)
        elif progress.epoch > self._epoch:
            self._catch_up(progress.epoch)
            self._look_ahead(self._tracker.progress, contributes=stepped)
        elif progress.ready or self._reached_share(progress, batch_size):
            # the swarm reached the global batch, or will without another step of ours
            progress = self._await_settled(progress)
            if progress.epoch <= self._epoch and self._cut_off(progress):
                self._averager.cancel_scheduled()  # keeps accumulating; leaves no group waiting for this peer
            elif progress.epoch <= self._epoch:
                self._run_round(progress)
            ahead = self._tracker.progress.epoch
            if not self._rounds.in_flight and ahead > self._epoch:
                # the swarm completed the round without us: catching up now spares a step computed at parameters
                # it has left (whose gradients the catch-up would drop), and lets a slow peer make the next round
                self._catch_up(ahead)
                self._look_ahead(self._tracker.progress, contributes=stepped)
        else:
            self._look_ahead(progress, contributes=self._samples > 0)
        if self._resync_donors:
            self._resync()
        self._push_offloaded()
        self._ranks.publish(self)  # the machine's other ranks repeat the local step, or take the new state
        self._step_returned = time.monotonic()
        return loss

    def report_loss(self, loss: Union[float, torch.Tensor]) -> None:
        """This step's training loss, for a loop that does not pass ``step(closure)`` (which reports it itself): call
        it once per step, before ``step()``. Each round's log line shows the mean, and strategies that adapt to the
        loss average it with the round (``FedProx(adaptive=AdaptiveMu())``). A non-finite loss is ignored."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ConfigError(f"report_loss takes a scalar loss, got a tensor of shape {tuple(loss.shape)}")
            loss = loss.detach().item()
        if isinstance(loss, bool) or not isinstance(loss, (int, float)):
            raise ConfigTypeError(f"report_loss takes a number or a one-element tensor, got {type(loss).__name__}")
        if not math.isfinite(loss):
            return
        with self._state_lock:
            self._loss_sum, self._loss_count = self._loss_sum + float(loss), self._loss_count + 1
            self.strategy.observe_loss(float(loss))

    def observe(self, metrics: Metrics) -> None:
        """Tell ``metrics`` (a ``swarm_opt.metrics.Metrics``, e.g. ``monitor.prometheus.PrometheusMetrics``) how each
        round ends and which peers' records are refused, besides the observers already attached."""
        self.metrics = self._rounds.metrics = self._tracker.checker.metrics = self.metrics.joined(metrics)

    def _note_step_period(self) -> None:
        """How long the training loop computes between two steps (a moving average): groupmates wait about twice
        that for this peer to start sending, since it joins an all-reduce only at its next step."""
        if self._step_returned is not None:
            computed = time.monotonic() - self._step_returned
            self._averager.step_period = computed if self._averager.step_period == 0 else \
                0.7 * self._averager.step_period + 0.3 * computed

    # --- rounds -----------------------------------------------------------------------------------------------------
    def _run_round(self, progress: SwarmProgress) -> None:
        if self._samples == 0:  # nothing to contribute: others may still be finishing; wait for their epoch
            self._averager.cancel_scheduled()  # and leave no group waiting for this peer
            return
        round_id = self._epoch + 1
        plan = self._grid.plan(round_id, progress.num_peers)
        with torch.no_grad(), self._state_lock:
            begun = self.strategy.begin_round(plan)
        self._rounds.run(begun, round_id=round_id, num_peers=progress.max_peers, samples=self._samples,
                         round_is_over=self._round_is_over(round_id, plan), plan=plan)

    def _round_is_over(self, round_id: int, plan: RoundPlan) -> Callable[[], Optional[str]]:
        """Why round ``round_id`` is over for this peer, asked while it looks for its group (None while it is not): the
        swarm completed it without this peer, or this peer was cut off from the swarm meanwhile (no group it can
        find holds a majority: waiting on would hold ``step()`` until the averaging deadline), or more peers hold
        another version of the run (a healed partition: nobody would join this round). With Moshpit groups
        every line of the grid averages on its own: another line's commit does not end this line's round, only a
        commit in this peer's own line does (``ProgressTracker.line_reached``), or another line's once this peer has
        looked for ``matchmaking_time`` since the round began (a line too short to form a group then gives up, as
        without groups, rather than at its averaging deadline)."""
        began = time.monotonic()

        def completed() -> bool:
            if plan.whole_swarm:
                return self._tracker.epoch_reached(round_id)
            return self._tracker.line_reached(round_id, plan.cell) or (
                time.monotonic() - began > self.timeouts.matchmaking_time and self._tracker.epoch_reached(round_id))

        def over() -> Optional[str]:
            if completed():
                return f"the swarm completed round {round_id} without this peer"
            progress = self._tracker.progress
            if progress.num_peers == 1 and progress.recent_peers == 1:  # the others withdrew their records: the
                return "every other peer left the swarm"  # next step commits alone, not after the deadline
            if self._cut_off(progress):
                return "this peer was cut off from the swarm"
            if self._tracker.other_version is not None:  # the next step takes the other version's state
                return "another version of the run outnumbers this peer's"
            return None

        return over

    def _committed(self, flight: RoundInFlight, result: AveragingResult, num_peers: int) -> None:
        """The round was applied and committed (under the state lock): move to its epoch. ``num_peers``: the swarm
        size its majority was measured against."""
        self.last_round = RoundReport(flight.round_id, result.group_size, num_peers, flight.samples,
                                      flight.round.weight, time.monotonic() - flight.started, caught_up=False,
                                      helpers=len(result.helpers))
        self._advance_epoch(self.last_round, self._tracker.progress.samples_per_second,
                            line=None if flight.plan.whole_swarm else flight.plan.cell)

    def _look_ahead(self, progress: SwarmProgress, *, contributes: bool) -> None:
        """Start looking for the next round's group if the swarm is due to reach its target within
        ``matchmaking_time``: this peer is then in the group when it forms, and sends at its next step (its groupmates
        wait for it, knowing its step period). Only for a peer that will contribute (``contributes``): a group waits
        for each of its members to send, and one that has nothing (all its steps skipped, e.g. non-finite gradients)
        would never start. Right after a catch-up too: a peer whose steps are slower than the swarm's rounds that
        waited for its next step would always arrive after the next round had formed, and catch up again."""
        if self._rounds.in_flight or progress.epoch > self._epoch or not contributes or progress.num_peers <= 1 \
                or self._cut_off(progress) or (self._epoch == 0 and not self._tracker.settled):
            return
        if progress.eta - get_dht_time() <= self.timeouts.matchmaking_time:
            self._averager.schedule(progress.eta, self._epoch + 1)

    def _await_settled(self, progress: SwarmProgress) -> SwarmProgress:
        """Before the run's first round or a round alone, wait (not computing) until this peer's view of the swarm
        has settled (``ProgressTracker.settled``), at most ``averaging_timeout``: peers that start together must
        see each other first, or each would commit its own version of the epoch. Returns the progress then."""
        if not (self._epoch == 0 or progress.num_peers <= 1) or self._tracker.settled:
            return progress
        deadline = time.monotonic() + self.timeouts.averaging_timeout
        self._ranks.expect(self, self.timeouts.averaging_timeout, "the swarm's first round")  # (swarm_opt.ranks)
        while not self._tracker.settled and time.monotonic() < deadline and not self._closed:
            time.sleep(0.02)
        return self._tracker.progress

    def _cut_off(self, progress: SwarmProgress) -> bool:
        """Whether this peer sees fewer than a majority of the peers it saw within ``TrackerConfig.forget_after``
        (the network cut it off from the swarm, or more than half of it crashed): it must not begin a round, which
        would commit a second version of the run; it keeps accumulating. Says so once, and once when it is over."""
        cut_off = progress.recent_peers > 0 and not is_majority(progress.num_peers, progress.recent_peers)
        if cut_off != self._cut_off_said:
            self._cut_off_said = cut_off
            if cut_off:
                logger.info(f"This peer sees {progress.num_peers} of the {progress.recent_peers} peers it saw in the "
                            f"last {self._tracker.config.forget_after:.0f} s: it commits no epoch until it sees a "
                            f"majority of them again, or has not seen the others for that long")
            else:
                logger.info(f"This peer sees {progress.num_peers} of the {progress.max_peers} peers it saw lately "
                            f"again: training on with the swarm")
        return cut_off

    def _take_other_version(self, epoch: int, donors: Sequence[bytes]) -> None:
        """More peers hold another version of the run than ours (``ProgressTracker.other_version``: peers that
        started apart, or a part of the swarm cut off by the network, trained on alone): take their state, dropping
        this peer's work since the versions parted."""
        logger.info(f"{len(donors)} peer(s) hold another version of the run (epoch {epoch}) than this peer "
                    f"(epoch {self._epoch}) and outnumber it (the swarm was split: peers that started apart, or a "
                    f"network partition); taking their state")
        self._averager.cancel_scheduled()
        try:
            self.load_state_from_peers(timeout=self.timeouts.averaging_timeout, _min_epoch=epoch,
                                       _donors=tuple(random.sample(list(donors), len(donors))))
        except StateDownloadError as e:
            logger.warning(f"{e}; training on, and trying again at the next read of the swarm's progress")
            return
        # the records counted at the last read were judged against our old epoch, ahead of theirs: a peer of our old
        # side that has not switched yet would pass for the swarm, ahead, and we would download its state back
        self._tracker.read_again(timeout=state_sync.RECORDS_READ_TIMEOUT)

    def _reached_share(self, progress: SwarmProgress, batch_size: int) -> bool:
        """Whether this peer computed its share of the global batch (``contributed_share``); never alone, nor when
        the tracker estimates nothing from speeds (``TrackerConfig.max_extrapolation=0``)."""
        return progress.num_peers > 1 and self._tracker.config.max_extrapolation > 0 and contributed_share(
            samples=self._samples, batch_size=batch_size, share=progress.share)

    def _await_target(self, round_id: int) -> None:
        """Having computed its share before the swarm reached the target, wait (not computing) until the target is
        due within ``matchmaking_time``, so that this peer looks for its group when the others do, or until the
        group it was already matched into waits for it; bounded by ``averaging_timeout`` in case the others' speeds
        were overrated. Runs before each round's all-reduce, in the thread that runs the round."""
        deadline = time.monotonic() + self.timeouts.averaging_timeout
        self._ranks.expect(self, self.timeouts.averaging_timeout, "the swarm's target")  # (swarm_opt.ranks)
        progress = self._tracker.progress
        while (not progress.ready and progress.epoch < round_id and not self._closed and time.monotonic() < deadline
               and progress.eta - get_dht_time() > self.timeouts.matchmaking_time
               and not self._averager.matched(round_id)):
            time.sleep(0.02)
            progress = self._tracker.progress
        self._ranks.expect(self, self._averager.round_bound(round_id), "a round")  # its deadlines, adaptive ones too

    def _member_info(self) -> Dict[str, Any]:
        """What this peer sends its groupmates with each round: the digest of the parameters the round's update
        applies to, when the strategy needs every member to hold the same (``swarm_opt.digest``), how many live
        peers it sees, estimated and at most (``swarm_opt.round.swarm_size_seen_by``), and, where it read every
        record, how many of them will contribute to the round (``SwarmProgress.contributors``: a leader assembles
        its group once that many joined, ``docs/hivemind.md``)."""
        progress = self._tracker.progress
        info: Dict[str, Any] = {PEERS_KEY: progress.num_peers, BOUND_KEY: progress.max_peers}
        if not self._tracker.sampled:  # a leader waits for these, not for live peers that sit the round out
            info[COUNTED_KEY] = progress.contributors
        if self.strategy.shares_parameters:
            with self._state_lock:
                info[DIGEST_KEY] = parameter_digest(self._params)
        return info

    def _agrees(self, result: AveragingResult) -> bool:
        """Before a round is applied: whether its members held the same parameters (the digests they sent in the
        gather), where the strategy needs it. A round that mixed two versions of the run (founders seeded
        differently, or peers that trained apart met again) is given back on every member (each decides from the
        same gather): its mean would hold gradients computed at other parameters. Members outside the largest
        group of agreeing digests (``swarm_opt.digest.majority``) then download a majority member's state
        (``_resync``); the others retry without them."""
        if not self.strategy.shares_parameters:
            return True
        digests = {peer: digest for peer, info in result.gathered.items()
                   if peer in result.peers and isinstance(info, dict)
                   and (digest := valid_digest(info.get(DIGEST_KEY))) is not None}
        agreeing = majority(digests, self._digest_tolerance)
        if len(agreeing) == len(digests):
            return True
        me = self._averager.peer_id
        if me not in agreeing:
            self._resync_donors = tuple(random.sample(agreeing, len(agreeing)))  # spread the downloads
        if self._epoch == 0:  # founders that were not seeded identically: expected, said once
            if me not in agreeing:
                logger.info(f"This peer's initial parameters differ from those of {len(agreeing)} of its "
                            f"{len(digests) - 1} groupmates (founders seeded differently); downloading theirs")
        elif me not in agreeing:
            logger.warning(f"This peer's parameters before epoch {self._epoch + 1} differed from those of its group's "
                           f"majority ({len(agreeing)} of {len(digests)} members agree): the round commits on no "
                           f"member; downloading their state")
        else:
            logger.info(f"Round for epoch {self._epoch + 1}: {len(digests) - len(agreeing)} member(s) held other "
                        f"parameters than this peer and {len(agreeing) - 1} other(s); it commits on no member, and "
                        f"they download the majority's state")
        return False

    def _resync(self) -> None:
        """Replace our state with that of a member of the majority of our last round (it applied the same round)."""
        donors, self._resync_donors = self._resync_donors, ()
        self._averager.cancel_scheduled()
        try:
            self.load_state_from_peers(timeout=self.timeouts.averaging_timeout, _min_epoch=self._epoch,
                                       _donors=donors)
        except StateDownloadError as e:
            logger.warning(f"{e}; training on, the next round compares the parameters again")

    def _mark_synced(self) -> None:
        self._synced_epoch = self._epoch
        self._tracker.mark_joined()

    def _skip_to_epoch(self, epoch: int) -> None:
        logger.info(f"The swarm is at epoch {epoch}; continuing from the local model (epoch {self._epoch})")
        self.last_round = RoundReport(epoch, 0, 0, self._samples, 0.0, 0.0, caught_up=True)
        self.metrics.round_concluded("skipped", 0.0, 0)
        while self._epoch < epoch:
            self._epoch += 1
            if self.scheduler is not None:
                self.scheduler.step()
        self._samples = 0  # the strategy keeps its own round's weight: its local work is averaged in next round
        self._tracker.report(self._epoch, 0)
        self._averager.offer_state(self._epoch)

    def _advance_epoch(self, report: RoundReport, samples_per_second: float, line: Optional[str] = None) -> None:
        self._epoch += 1
        self._samples -= report.samples  # what remains was computed while a background round was in flight
        self._mark_synced()
        if self.scheduler is not None:
            self.scheduler.step()
        self._tracker.report(self._epoch, self._samples, params_digest=self._params_digest(), line=line)
        self._averager.offer_state(self._epoch)
        loss = f", loss {self._loss_sum / self._loss_count:.4f}" if self._loss_count else ""
        self._loss_sum, self._loss_count = 0.0, 0
        privacy = self.privacy.log_suffix() if self.privacy is not None else ""
        peer_epsilon = self.strategy.epsilon()
        if peer_epsilon is not None:
            privacy += f", peer-level ε {peer_epsilon:.6g}"
        norm = self.grad_norm
        clipped = "" if norm is None else f", grad norm {norm:.3g}"
        logger.info(f"epoch {self._epoch}: averaged with {report.group_size} of {report.num_peers} peer(s), "
                    f"{samples_per_second:.0f} samples/s{loss}{clipped}{privacy}")

    # --- state sharing ----------------------------------------------------------------------------------------------
    def _join_running_swarm(self, epoch: int) -> None:
        """A newcomer to a swarm already at ``epoch``: download its state now, before the training loop computes a
        first step at this peer's initial parameters that the catch-up at that step would throw away. Within
        ``state_sync.NEWCOMER_PATIENCE``: failing that, ``step()`` catches up as for any peer behind."""
        logger.info(f"The swarm is at epoch {epoch}: downloading its state before the first step (giving up after "
                    f"{state_sync.NEWCOMER_PATIENCE:.0f} s unless it is arriving)")
        try:
            self.load_state_from_peers(timeout=state_sync.NEWCOMER_PATIENCE, _min_epoch=epoch, _keep=True)
        except StateDownloadError as e:
            logger.info(f"{e}; catching up at the first step instead")
            self._next_catch_up = time.monotonic() + _CATCH_UP_BACKOFF

    def _catch_up(self, global_epoch: int) -> None:
        """The swarm finished rounds without us: go on from our own state if the strategy allows it (local updates
        are averaged back in next round), otherwise download the swarm's state."""
        if (self._synced_epoch is not None
                and self.strategy.keeps_local_state_when_behind(global_epoch - self._synced_epoch)):
            with self._state_lock:
                self._skip_to_epoch(global_epoch)
            return
        if time.monotonic() < self._next_catch_up:
            return
        self._averager.cancel_scheduled()
        try:  # from a peer at the swarm's epoch, not from the most advanced one (a side of a partition, ahead)
            self.load_state_from_peers(_min_epoch=self._epoch + 1,  # within Timeouts.state_download_timeout
                                       _donors=self._tracker.holders(global_epoch))
        except StateDownloadError as e:
            logger.warning(f"{e}; training on and retrying in {_CATCH_UP_BACKOFF:.0f} s")
            self._next_catch_up = time.monotonic() + _CATCH_UP_BACKOFF

    def load_state_from_peers(self, timeout: Optional[float] = None, *, _min_epoch: int = 0,
                              _donors: Sequence[Any] = (), _keep: bool = False) -> None:
        """Download parameters, optimizer, scheduler, epoch and strategy state from a peer of the swarm.

        Retries with backoff until ``timeout`` (default ``Timeouts.state_download_timeout``), then raises
        ``StateDownloadError``; a download that still receives the state goes on past it
        (``swarm_opt.deadlines.DownloadDeadline``). With a local group every rank calls it: rank 0 downloads, the
        others take its state.
        """
        try:
            self._ranks.around_download(self, lambda: self._download_state(timeout, _min_epoch, _donors, _keep))
        finally:  # the downloaded state and the backup of ours, freed: glibc would keep their memory for itself
            malloc_trim()

    def _download_state(self, timeout: Optional[float], _min_epoch: int, _donors: Sequence[Any],
                        keep: bool = False) -> None:
        timeout = self.timeouts.state_download_timeout if timeout is None else timeout
        # a round in the background ends first; then each try's record reads (swarm_opt.ranks: the other ranks wait)
        settle = self.timeouts.averaging_timeout + self._averager.round_bound(self._epoch + 1) \
            if self._rounds.in_flight else 0.0
        self._ranks.expect(self, settle + timeout + 2 * state_sync.RECORDS_READ_TIMEOUT, "a download")
        self._rounds.settle()
        started = time.monotonic()
        deadline, delay, attempts = started + timeout, 0.5, 0
        while True:
            remaining = deadline - time.monotonic()
            downloaded = self._averager.load_state(
                timeout=max(1.0, remaining), donors=_donors, exclude=tuple(self._bad_donors),
                on_extend=lambda seconds: self._ranks.expect(  # the state still arrives: the other ranks wait on
                    self, seconds + 2 * state_sync.RECORDS_READ_TIMEOUT, "a download"))
            attempts, nobody_ahead = attempts + 1, False
            if downloaded is None:
                reason = self._averager.last_download_failure
            else:
                try:
                    epoch = self._apply_downloaded_state(*downloaded, min_epoch=_min_epoch)
                    logger.info(f"Loaded the swarm's state at epoch {epoch}")
                    if keep:
                        self._joined_state = downloaded
                    return
                except IncompatibleStateError as e:
                    reason = f"a peer sent an unusable state ({e})"
                    nobody_ahead = isinstance(e, state_sync.DonorBehind)  # donors are asked most advanced first
            logger.debug(f"State download attempt {attempts} failed: {reason}")
            patience_over = time.monotonic() - started >= state_sync.NEWCOMER_PATIENCE
            if not self._tracker.joined and (nobody_ahead or patience_over):
                # the peers ahead serve no state: count our own epoch from now on, so that a lone peer claiming to
                # be ahead (a liar, or one unreachable) holds the newcomers of a run no longer
                logger.info(f"No peer ahead of this one served its state; this peer's epoch ({self._epoch}) now "
                            f"counts in the swarm's")
                self._tracker.mark_joined()
            if _min_epoch > self._epoch and self._tracker.progress.epoch <= self._epoch:
                # catching up, and the peers that were ahead left (or we caught up by a round): train on
                logger.debug("The swarm is no longer ahead of this peer; not downloading its state")
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StateDownloadError(
                    f"could not download the swarm's state within {timeout:.0f} s ({attempts} attempt(s); the "
                    f"last: {reason}). Check that initial_peers point to a live peer of run '{self.config.run_id}'"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 10.0)

    def _shareable_state(self):
        """Called by hivemind when a peer downloads our state: a consistent snapshot, copied under the lock."""
        with self._state_lock:
            # the personal parameters never leave this peer: zeros, and no optimizer state
            metadata, tensors = state_sync.snapshot(self._params, self.state_dict(), personal=self._personal_indices(),
                                                    schema=self.model_schema, epoch=self._epoch)
        logger.info(f"Sending our state (epoch {metadata['epoch']}) to a peer that joins or catches up")
        return metadata, tensors

    def _apply_downloaded_state(self, metadata: Any, tensors: List[torch.Tensor], donor: bytes, *,
                                min_epoch: int) -> int:
        epoch, state = state_sync.parse_state(metadata, tensors, schema=self.model_schema, params=self._params,
                                              min_epoch=min_epoch)
        params = state["params"]
        digest = parameter_digest(params) if self.strategy.shares_parameters else None
        expected = self._expected_digest(epoch, donor) if digest is not None else None
        if expected is not None and not digests_agree(digest, expected[0], self._digest_tolerance):
            self._bad_donors.add(donor)
            logger.warning(f"Skipping donor {PeerID(donor)} from now on: its parameters at epoch {epoch} differ from "
                           f"those {expected[1]}")
            raise IncompatibleStateError(f"the donor's parameters differ from those {expected[1]}")
        with torch.no_grad(), self._state_lock:
            backup = [p.detach().clone() for p in self._params]
            try:
                personal = self._personal_indices()  # the donor sent none of its own: we keep ours, and their state
                for i, (p, new) in enumerate(zip(self._params, params)):
                    if i not in personal:
                        p.copy_(new)
                optimizer = state["optimizer"]
                if personal:
                    optimizer = state_sync.with_own_personal_state(optimizer, self.inner.state_dict()["state"],
                                                                   personal)
                own = self.strategy.own_state()  # the strategy's own entries: ours, never the donor's
                optimizer = state_sync.with_own_entries(optimizer, self.strategy.state_dict() if own else {}, own)
                # not ``load_state_dict``: that is a user's checkpoint, which catches up when older than the state
                # held, where this state is the swarm's, older when this peer takes a majority's other version
                self._load_state_locally(optimizer)
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                for p, old in zip(self._params, backup):
                    p.copy_(old)
                raise IncompatibleStateError(f"could not load the optimizer state: {e}") from e
            self.last_round = RoundReport(epoch, 0, 0, self._samples, 0.0, 0.0, caught_up=True, downloaded=True)
            self.metrics.round_concluded("downloaded", 0.0, 0)
            self._epoch = epoch
            self._mark_synced()
            self._samples = 0
            self.strategy.reset()
        self._tracker.report(self._epoch, 0, params_digest=digest)
        self._averager.offer_state(self._epoch)
        self._push_offloaded()
        return epoch

    def _personal_indices(self) -> set:
        """Positions (in the optimizer's parameter order, that of its state_dict) of the parameters that never leave
        this peer (``Strategy.personal_parameters``)."""
        return personal_indices(self._params, self.strategy)

    def _expected_digest(self, epoch: int, donor: bytes) -> Optional[Tuple[Tuple[float, ...], str]]:
        """What a state downloaded at ``epoch`` must match (``ProgressTracker.expected_params_digest``); the records
        read last may predate the epoch (the donor reached it a moment ago), so read them again before trusting a
        state unchecked."""
        expected = self._tracker.expected_params_digest(epoch, donor, self._digest_tolerance)
        if expected is None and self._tracker.read_again(timeout=state_sync.RECORDS_READ_TIMEOUT):
            expected = self._tracker.expected_params_digest(epoch, donor, self._digest_tolerance)
        return expected  # still None: the first round compares the parameters anyway

    def _params_digest(self) -> Optional[List[float]]:
        """What a newcomer compares a downloaded state with (None where peers at an epoch hold different parameters):
        published with our progress at each new epoch."""
        if not self.strategy.shares_parameters:
            return None
        with self._state_lock:
            return parameter_digest(self._params)

    # --- checkpoints ------------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        state = self.inner.state_dict()
        state["swarm_opt"] = {
            "epoch": self._epoch,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "strategy": self.strategy.state_dict(),
        }
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned (a checkpoint). A checkpoint older than the state this peer held (it
        downloaded the swarm's newer state as it joined: Hugging Face's ``Trainer`` and most loops load the
        optimizer's checkpoint after building it) goes under the swarm's state again: the state downloaded at
        joining, kept until the first step, is applied over it (the checkpoint's own strategy state and personal
        parameters kept, as in any download); later, or if the swarm's records disown that state, the peer catches
        up with the swarm at once, as its next step would have. So no step computes gradients at a state that never
        existed. On a machine of several ranks every rank calls it (as it would ``torch.optim.Optimizer.
        load_state_dict``): rank 0 loads and catches up, and the other ranks take its state (``swarm_opt.ranks``)."""
        if self._ranks.follows:  # rank 0's state: the checkpoint's, or the swarm's; or the error rank 0 met
            self._ranks.around_download(self, lambda: None)
            return
        held = self._epoch
        self._rounds.settle()
        try:
            self._ranks.around_download(self, lambda: self._resume(state_dict, held))
        finally:  # the state replaced (and the one kept from joining), freed: glibc would keep their memory
            malloc_trim()

    def _resume(self, state_dict: Dict[str, Any], held: int) -> None:
        """``load_state_dict``'s work on the peer that speaks for its machine (``held``: its epoch before)."""
        joined, self._joined_state = self._joined_state, None
        if not self._load_state_locally(state_dict):
            return
        self._mark_synced()  # our own history; if the swarm moved on, we catch up below (or step() does)
        self._tracker.report(self._epoch, 0, params_digest=self._params_digest())
        self._averager.offer_state(self._epoch)
        if self._epoch >= held:
            return
        if joined is not None:  # the swarm's state this peer joined with, over the checkpoint: as if loaded after it
            saved = self._epoch
            try:
                self._apply_downloaded_state(*joined, min_epoch=held)
                logger.info(f"The checkpoint is at epoch {saved}, older than the swarm's state this peer downloaded "
                            f"as it joined: went on from the swarm's (epoch {self._epoch}), with this peer's own "
                            f"state from the checkpoint")
                return
            except IncompatibleStateError as e:  # the swarm's records disown it now: download as below
                logger.debug(f"The state downloaded at joining no longer fits: {e}")
        logger.info(f"The checkpoint is at epoch {self._epoch}, older than the state this peer held (epoch "
                    f"{held}): catching up with the swarm")
        self._catch_up(max(held, self._tracker.progress.epoch))

    def _load_state_locally(self, state_dict: Dict[str, Any]) -> bool:
        """Load ``state_dict()``'s output into the inner optimizer, scheduler and strategy; True if it held an epoch
        (which this peer then is at)."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise IncompatibleStateError("expected a state_dict produced by swarm_opt.Optimizer.state_dict()")
        extra = state_dict.get("swarm_opt", {})
        with self._state_lock:
            self.inner.load_state_dict({k: v for k, v in state_dict.items() if k != "swarm_opt"})
            if self.scheduler is not None and extra.get("scheduler") is not None:
                self.scheduler.load_state_dict(extra["scheduler"])
            self.strategy.load_state_dict(extra.get("strategy") or {})
            if "epoch" in extra:
                self._epoch, self._samples = int(extra["epoch"]), 0
        return "epoch" in extra

    # --- lifetime ---------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Leave the swarm: withdraw our progress record and stop the averager. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._leave_at_exit.cancel()
        if not self._ranks.follows:  # a follower holds no part of the swarm
            self._tracker.shutdown()
            self._averager.shutdown()  # a round in flight returns at once
            self._rounds.abandon(timeout=10.0)
        if self._clipping is not None:  # the inner optimizer is the user's: it steps unclipped again
            self._clipping.remove()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"swarm_opt.Optimizer(run_id={self.config.run_id!r}, strategy={type(self.strategy).__name__}, "
                f"epoch={self._epoch}, inner={type(self.inner).__name__})")

    # --- helpers ----------------------------------------------------------------------------------------------------
    def _resolve_batch_size(self, batch_size: Optional[int]) -> int:
        batch_size = self.config.batch_size_per_step if batch_size is None else batch_size
        if batch_size is None:
            raise ConfigError("step() needs the number of samples: pass step(batch_size=N) or "
                              "Optimizer(..., batch_size_per_step=N)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(f"batch_size must be a positive int, got {batch_size!r}")
        return batch_size

    def _init_torch_hooks(self) -> None:
        # torch.optim.Optimizer.__init__ would build its own param_groups; we only need its hook registries
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()


class _LeaveAtExit:
    """``Optimizer.shutdown`` at the interpreter's exit, for a script that ends without it (no ``with opt:``):
    the peer withdraws its record, so the others drop it at once instead of remembering it as possibly cut off (up
    to ``TrackerConfig.forget_after``: a swarm of two then stalls), and no daemon thread of a round is left running
    into the interpreter's finalization. Holds the optimizer weakly; does nothing in a forked child."""

    def __init__(self, opt: Optimizer) -> None:
        self._opt, self._pid = weakref.ref(opt), os.getpid()
        atexit.register(self)

    def __call__(self) -> None:
        opt = self._opt()
        if opt is not None and os.getpid() == self._pid:
            opt.shutdown()

    def cancel(self) -> None:
        atexit.unregister(self)


def _make_inner_optimizer(optimizer: Any, params: Optional[Iterable[Any]]) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        if params is not None:
            raise ConfigError("pass params only with an optimizer factory; an optimizer instance already has them")
        inner = optimizer
    elif callable(optimizer):
        if params is None:
            raise ConfigError("params is required with an optimizer factory: "
                              "Optimizer(params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))")
        params = list(params)
        if not params:
            raise ConfigError("params is empty: the model has no parameters to train")
        inner = optimizer(params)
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigTypeError(f"the optimizer factory returned {type(inner).__name__}, not a torch.optim.Optimizer")
    else:
        raise ConfigTypeError("optimizer must be a torch.optim.Optimizer or a factory such as "
                              f"lambda params: torch.optim.SGD(params, lr=0.1), got {optimizer!r}")
    if not any(group["params"] for group in inner.param_groups):
        raise ConfigError("the inner optimizer has no parameters to train")
    return inner


def _make_offload(offload: Any, optimizer: Any, params: Optional[Iterable[Any]]) -> Optional[OffloadedParameters]:
    if offload is None:
        return None
    if not isinstance(offload, Offload):
        raise ConfigTypeError(f"offload must be swarm_opt.Offload(...) or None, got {offload!r}")
    if isinstance(optimizer, torch.optim.Optimizer):
        # a ready optimizer steps the host copies once its param groups point at them: sound while it has no state
        if optimizer.state:
            raise ConfigError("offload=Offload() moves the optimizer onto host copies of the parameters, which needs "
                              "an optimizer that has not stepped yet (its state would stay on the device): create "
                              "the swarm optimizer before training, or pass a factory, optimizer=lambda p: "
                              "torch.optim.AdamW(p, lr=...), params=model.parameters()")
        offloaded = OffloadedParameters([dict(group) for group in optimizer.param_groups], offload)
        for group, host in zip(optimizer.param_groups, offloaded.groups):
            group["params"] = host["params"]
        return offloaded
    if params is None:
        raise ConfigError("offload=Offload() with an optimizer factory needs the parameters: "
                          "optimizer=lambda p: torch.optim.AdamW(p, lr=...), params=model.parameters()")
    return OffloadedParameters(list(params), offload)


def _make_scheduler(scheduler: Any, inner: torch.optim.Optimizer, *, optimizer_is_factory: bool) -> Any:
    if scheduler is None:
        return None
    if hasattr(scheduler, "step") and hasattr(scheduler, "state_dict"):
        if optimizer_is_factory or getattr(scheduler, "optimizer", None) is not inner:
            raise ConfigError("a ready scheduler must be bound to the optimizer instance you pass; with an optimizer "
                              "factory pass a scheduler factory: scheduler=lambda opt: StepLR(opt, step_size=10)")
        return scheduler
    if callable(scheduler):
        made = scheduler(inner)
        if not (hasattr(made, "step") and hasattr(made, "state_dict")):
            raise ConfigTypeError(f"the scheduler factory must return an LR scheduler, got {type(made).__name__}")
        return made
    raise ConfigTypeError(f"scheduler must be a factory such as lambda opt: StepLR(opt, 10), got {scheduler!r}")


def contributed_share(*, samples: int, batch_size: int, share: Optional[float]) -> bool:
    """Whether a peer computed its ``share`` of the global batch (``SwarmProgress.share``: by compute speed, or equal,
    ``TrackerConfig.shares``), to the nearest step of ``batch_size``: it then joins the round rather than computing
    another step. Every step computed at an epoch's parameters belongs to that epoch (or the epoch would no longer be
    one step on the union of its batches), so without this each peer's steps until it sees the swarm reach the
    target would be averaged too, and with fast steps the global batch grows by whatever the swarm computes while
    the peers' records travel. Speed shares come from compute speeds, which change little from epoch to epoch, not
    from the samples the others reported, which lag behind. A peer that stops adding samples before its share still
    joins the round once the swarm's total reaches the target (``progress.ready``), as without shares; so does a
    peer before the others' speeds are known (``share`` None: a run's first steps; a share guessed then would stall
    a peer whose groupmates never compute, e.g. every step skipped, until ``averaging_timeout``)."""
    return share is not None and samples > 0 and samples + batch_size / 2 >= share


def model_schema(params: List[torch.Tensor], strategy_name: str, kept: Sequence[int] = (),
                 protocol: Optional[int] = None) -> str:
    """What peers must share to average together: the strategy, every parameter's shape and dtype, which of them
    stay on each peer (``KeepLocal``: peers keeping different ones, even of the same shapes, must not average), and
    the protocol they speak (``swarm_opt.protocol``; default this release's; protocol 1 mixed in nothing)."""
    description = strategy_name + ";" + ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    if kept:
        description += ";kept:" + ",".join(map(str, kept))
    protocol = swarm_protocol.current() if protocol is None else protocol
    if protocol > 1:
        description += f";protocol:{protocol}"
    return hashlib.sha256(description.encode()).hexdigest()[:32]


def personal_indices(params: Sequence[torch.Tensor], strategy: Strategy) -> set:
    """Positions in ``params`` of the parameters ``strategy`` keeps on this peer (``Strategy.personal_parameters``)."""
    personal = {id(p) for p in strategy.personal_parameters()}
    return {i for i, p in enumerate(params) if id(p) in personal}


def strategy_schema(params: Sequence[torch.Tensor], strategy: Strategy, protocol: Optional[int] = None) -> str:
    """``model_schema`` of ``params`` trained by ``strategy``: its name and the options that change what peers
    exchange (``Strategy.variant``), and the parameters it keeps local."""
    return model_schema(list(params), strategy.name + strategy.variant,
                        kept=sorted(personal_indices(params, strategy)), protocol=protocol)


def legacy_schemas(params: Sequence[torch.Tensor], strategy: Strategy, identity: Optional[str]) -> Dict[str, int]:
    """The schema each older protocol gives this model and identity -> that protocol: how a peer recognises peers
    (and checkpoints) of an older release."""
    return {identified_schema(strategy_schema(params, strategy, protocol=p), identity): p
            for p in range(1, swarm_protocol.current())}


def identified_schema(schema: str, identity: Optional[str]) -> str:
    """``schema`` with ``identity`` mixed in (``Optimizer(identity=...)``); ``schema`` itself when there is none."""
    if identity is None:
        return schema
    return hashlib.sha256(f"{schema};identity:{identity}".encode()).hexdigest()[:32]


def averaging_prefix(run_id: str, strategy_name: str, schema: str) -> str:
    """The DHT prefix under which a run's peers of one model look for averaging groups."""
    return f"{run_id}_{strategy_name}_{schema[:12]}"
