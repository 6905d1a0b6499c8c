"""Training progress of the swarm, published on and read from the DHT.

Each peer publishes one signed record (epoch, samples accumulated in that epoch, throughput, time) under the run's
key. Reading all records gives the global epoch, the samples toward ``target_batch_size``, the live peers and an ETA.
Records are validated twice: by hivemind's DHT validators when they are stored (schema and RSA signature, so a peer
cannot write another peer's record) and again here when they are read (ranges, clock sanity, model schema, shard),
because a hostile peer's DHT node may serve anything. What a valid record claims is believed only as far as its owner
plausibly could have progressed (``swarm_opt.trust``). A small swarm keeps every record under one key and every peer
reads them all; a large one shards them and each peer reads a sample (``swarm_opt.sharding``), so that tracking costs
a peer the same at 10 or 1,000 peers.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import pydantic.v1 as pydantic
from hivemind.dht import DHT
from hivemind.utils import ValueWithExpiration, get_dht_time

from swarm_opt._hivemind.dht_cache import read_latest_only
from swarm_opt._hivemind.near_store import store_near
from swarm_opt._hivemind.validation import KeysSchemaValidator, RememberingSignatureValidator, SignedSubkey
from swarm_opt.config import TrackerConfig
from swarm_opt.digest import majority, valid_digest
from swarm_opt.protocol import mismatch as protocol_mismatch
from swarm_opt.sharding import (
    MAX_LEVEL,
    Shard,
    ShardSample,
    all_shard_keys,
    owner_hash,
    peers_upper_bound,
    progress_key,
    shard_key,
    shard_of,
)
from swarm_opt.trust import ClaimChecker, believed_epoch

logger = logging.getLogger(__name__)

# A sharded read follows a beam of 1 to the DHT node nearest to the shard's key (one of the 5 that store it) instead
# of a beam of 20: each node a search visits answers with ~1 KB of routing and, if it holds the key, its whole value,
# so the beam, not the shard, dominates a peer's bytes (one node's copy may miss a record stored while it was away:
# the estimate is a sample anyway); level 0 reads with hivemind's full beam (the exact view of a small swarm). Every
# write stores straight to the key's 5 nearest nodes (``store_near``: the search that finds them downloads no value).
_SHARD_READ_BEAM = 1
_MAX_CLOCK_SKEW = 60.0  # seconds a record's timestamp may lie in the future before we distrust it
_MAX_SAMPLES_PER_SECOND = 1e9


class ProgressRecord(pydantic.BaseModel):
    """What one peer says about itself. Strict types: the DHT schema validator requires them."""

    peer_id: pydantic.StrictBytes  # the libp2p peer id of the peer's DHT node
    instance: pydantic.constr(max_length=32, strict=True)  # type: ignore[valid-type]  # one per tracker
    epoch: pydantic.conint(ge=0, strict=True)  # type: ignore[valid-type]
    samples: pydantic.conint(ge=0, strict=True)  # type: ignore[valid-type]
    samples_per_second: pydantic.confloat(ge=0.0, le=_MAX_SAMPLES_PER_SECOND, strict=True)  # type: ignore[valid-type]
    time: pydantic.StrictFloat
    client_mode: pydantic.StrictBool
    model_schema: pydantic.constr(max_length=64, strict=True)  # type: ignore[valid-type]
    target_batch_size: pydantic.conint(ge=1, strict=True)  # type: ignore[valid-type]
    # the digest of the peer's parameters at this epoch (``swarm_opt.digest``), where every peer at an epoch holds
    # the same parameters (``Strategy.shares_parameters``): what a newcomer checks a downloaded state against
    params_digest: Optional[pydantic.conlist(pydantic.StrictFloat, max_items=8)] = None  # type: ignore[valid-type]
    # with Moshpit groups: the line of the averaging grid (its matchmaking key's group bits) in which the peer
    # committed the round that brought it to this epoch; what a line still looking for its group follows
    line: Optional[pydantic.constr(max_length=64, regex=r"^[01]*$", strict=True)] = None  # type: ignore[valid-type]

    def dict(self, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """The record as stored, and as hivemind's schema validator compares it with what it parsed: without
        ``line`` while it is None, so that a record outside Moshpit groups is exactly what releases before the field
        store and accept (their validator refuses a record with a field it does not know), and their records pass
        ours."""
        values = super().dict(**kwargs)
        if values.get("line", "") is None:
            del values["line"]
        return values

    @pydantic.validator("samples_per_second", "time")
    def _finite(cls, value: float) -> float:  # noqa: N805 (pydantic validators are classmethods)
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value


class _ProgressSchema(pydantic.BaseModel):
    swarm_progress: Dict[SignedSubkey, Optional[ProgressRecord]]


class _ShardedSchemaValidator(KeysSchemaValidator):
    """The progress schema under the run's key and under each of its shard keys."""

    def __init__(self, run_id: str) -> None:
        super().__init__(_ProgressSchema, prefix=run_id, field="swarm_progress", keys=all_shard_keys(run_id))


def progress_validators(run_id: str) -> list:
    """The DHT validators of a run's progress records: the schema, and an RSA signature so that nobody can write
    another peer's record. hivemind keeps one signer per DHT, so the process-wide key is shared. Both remember their
    verdicts (``swarm_opt._hivemind.validation``): a record is re-read far more often than it changes."""
    return [_ShardedSchemaValidator(run_id), RememberingSignatureValidator()]


def use_progress_records(dht: DHT, run_id: str) -> list:
    """Make ``dht`` ready to read and write the run's progress records: their validators added (returned), and
    hivemind's value cache off (``swarm_opt._hivemind.dht_cache``: every read of ours, and of the averager's, is
    ``latest=True``, so caching only adds searches)."""
    validators = progress_validators(run_id)
    dht.add_validators(validators)
    read_latest_only(dht)
    return validators


@dataclass(frozen=True)
class SwarmProgress:
    """A snapshot of the swarm as one peer sees it. ``eta`` is an absolute DHT time (seconds since the epoch).
    ``epsilon``: the privacy this peer spent so far, ε at its ``OpacusPrivacy``'s δ (sample-level), or without
    ``privacy=`` at its ``PeerDP``'s δ (peer-level; ``Optimizer.progress`` only; ``None`` when neither accounts).
    ``max_peers``: an upper bound on the live peers, what a round's majority is measured against: ``num_peers`` when
    every record was read (a small swarm), above it by the sampling error when the view is a sample
    (``swarm_opt.sharding.peers_upper_bound``). ``share``: the samples this peer computes in the epoch before it
    waits for the round (``TrackerConfig.shares``); ``None`` while it knows no other peer's speed (and for an
    observer). ``recent_peers``: the live peers this peer saw within ``TrackerConfig.forget_after`` that did not
    leave, itself included (0 for a sampled view): a round's majority is measured against at least this many, so
    that a peer cut off from the swarm does not train a second version of the run (``max_peers`` includes it).
    ``contributors``: the live peers that will send something to the epoch's round, this peer included if it will:
    those that computed samples in it, or whose compute speed is measured; a peer that sits every round out (all its
    steps skipped: non-finite gradients) publishes neither, and a round's leader does not wait for it. ``behind``:
    the other live peers whose records stand at an earlier epoch (late to the last round, or catching up)."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int
    num_peers: int
    num_clients: int
    samples_per_second: float
    eta: float
    time: float
    epsilon: Optional[float] = None
    max_peers: int = 0
    share: Optional[float] = None
    recent_peers: int = 0
    contributors: int = 0
    behind: int = 0

    @property
    def eta_seconds(self) -> float:
        return max(0.0, self.eta - self.time)

    @property
    def ready(self) -> bool:
        return self.samples_accumulated >= self.target_batch_size


def aggregate_progress(
    records: Iterable[ProgressRecord], local: Optional[ProgressRecord], target_batch_size: int, now: float,
    epoch_started: Optional[float] = None, max_extrapolation: float = 2.0, scale: float = 1.0, ahead: int = 0,
    shares: str = "speed", recent_peers: int = 0,
) -> SwarmProgress:
    """Combine validated records of other peers with this peer's own into a global view.

    Samples of each peer are extrapolated from its record's time at its reported throughput, so that the estimate
    stays tight between reads; only peers in the global (highest) epoch count toward it. Just after a round, the
    records of the peers that finished it with us still say the previous epoch: those peers are counted as if they
    had started the new epoch when we did (``epoch_started``), or every peer would fill the target alone.
    Peers republish new samples at least every ``max_extrapolation / 2`` seconds, so a record older than
    ``max_extrapolation`` belongs to a peer that stopped adding samples (waiting for the round, or gone): it is not
    extrapolated further; nor past the peer's share of the target (``TrackerConfig.shares``: its share of the
    swarm's speed, or an equal share of the peers that compute this epoch), where it stops computing and waits for
    the round; with equal shares the ETA is when the last of them will have computed its share. Without ``local``
    (an observer such as the monitor), only the records count. Each record stands for ``scale`` peers (a sample of a
    sharded swarm, ``swarm_opt.sharding``); ``local`` for one. ``ahead``: other live peers whose records stand ahead
    of the swarm's epoch (``swarm_opt.trust``): in ``num_peers`` only. ``recent_peers``: see ``SwarmProgress``.
    """
    peers = [r for r in records if local is None or r.instance != local.instance]
    if local is not None:
        peers.append(local)
    if not peers:
        return SwarmProgress(0, 0, target_batch_size, 0, 0, 0.0, now + 3600.0, now)
    epoch = max(r.epoch for r in peers)
    weights = [1.0 if r is local else scale for r in peers]
    measured = [r.samples_per_second for r in peers if r.samples_per_second > 0]
    typical = statistics.median(measured) if measured else 0.0
    fresh = local is not None and epoch_started is not None and now - epoch_started < max_extrapolation
    speeds = [_speed(r, epoch, typical, fresh) for r in peers]
    throughput = sum(w * speed for w, speed in zip(weights, speeds))
    # the peers computing this epoch: those in it, and those that finished the last round with us (see above)
    computing = [r.epoch == epoch or (local is not None and r.epoch == epoch - 1 == local.epoch - 1
                                      and epoch_started is not None) for r in peers]
    sharers = sum(w for w, speed, counted in zip(weights, speeds, computing) if counted and speed > 0)
    equal = shares == "equal"
    if equal:
        share_of = (lambda speed: target_batch_size / sharers if speed > 0 else 0.0)  # noqa: E731
    else:
        share_of = (lambda speed: target_batch_size * speed / throughput if throughput > 0 else 0.0)  # noqa: E731
    samples, last_done = 0.0, now  # last_done (equal shares): when the slowest peer computing will be done
    for record, speed, counted in zip(peers, speeds, computing):
        share = share_of(speed)
        if record is local:
            done = record.samples if record.epoch == epoch else 0
            samples += done
        elif record.epoch == epoch:
            guess = record.samples_per_second * min(max_extrapolation, max(0.0, now - record.time))
            done = record.samples + min(guess, max(0.0, share - record.samples))
            samples += scale * done
        elif counted:
            done = min(share, record.samples_per_second * min(max_extrapolation, max(0.0, now - epoch_started)))
            samples += scale * done
        else:
            continue
        if equal and counted and speed > 0:
            last_done = max(last_done, now + max(0.0, share - done) / speed)
    num_peers = round(sum(weights) + scale * ahead)
    others = len(peers) - (local is not None) + ahead
    missing = max(0.0, target_batch_size - samples)
    if missing == 0:
        eta = now
    elif equal and last_done > now:
        eta = last_done
    elif throughput > 0:
        eta = now + missing / throughput
    else:
        eta = now + 3600.0
    own_share = None  # this peer stops at it, only once it knows others compute too (``contributed_share``)
    if local is not None and local.samples_per_second > 0 and (
            sharers > 1 if equal else throughput > 1.01 * local.samples_per_second):
        own_share = share_of(local.samples_per_second)
    return SwarmProgress(
        epoch=epoch,
        samples_accumulated=int(samples),
        target_batch_size=target_batch_size,
        num_peers=num_peers,
        num_clients=round(sum(w for w, r in zip(weights, peers) if r.client_mode)),
        samples_per_second=throughput,
        eta=eta,
        time=now,
        max_peers=max(num_peers, recent_peers,
                      math.ceil((local is not None) + peers_upper_bound(others, 1.0 / scale))),
        share=own_share,
        recent_peers=recent_peers,
        contributors=round(sum(w for w, r, counted in zip(weights, peers, computing)
                               if counted and (r.samples > 0 or r.samples_per_second > 0))),
        behind=round(sum(w for w, r in zip(weights, peers) if r is not local and r.epoch < epoch)),
    )


def other_version(records: Iterable[ProgressRecord], me: Tuple[bytes, str], epoch: int, digest: Sequence[float],
                  tolerance: float, published_after: float) -> Optional[Tuple[int, List[bytes]]]:
    """The version of the run that outnumbers this peer's, as (its epoch, the peer ids that hold it), or None.

    Peers publish the digest of their parameters at each epoch (where every peer at an epoch holds the same ones),
    so two versions of an epoch show as two digests. At our ``epoch``: the largest group of agreeing digests, ours
    included, if we are not in it (``swarm_opt.digest.majority``: a tie goes to the group holding the smallest
    peer, so exactly one side of a tie moves). At an earlier epoch (a part of the swarm that trained on alone, cut
    off, is ahead of the rest): a strict majority of all the live peers, each of whose records holds the same
    digest at that epoch and was published after ``published_after`` (DHT time: a while after we reached our
    epoch), so that peers that merely have not published our round yet never count."""
    records = list(records)
    same = {(r.peer_id, r.instance): d for r in records
            if r.epoch == epoch and (d := valid_digest(r.params_digest)) is not None}
    if same:
        winners = majority({**same, me: tuple(digest)}, tolerance)
        if me not in winners:
            return epoch, [peer for peer, _ in winners]
    for earlier in sorted({r.epoch for r in records if r.epoch < epoch}, reverse=True):
        at = {(r.peer_id, r.instance): d for r in records if r.epoch == earlier and r.time > published_after
              and (d := valid_digest(r.params_digest)) is not None}
        winners = majority(at, tolerance)
        if 2 * len(winners) > len(records) + 1:
            return earlier, [peer for peer, _ in winners]
    return None


def _speed(record: ProgressRecord, epoch: int, typical: float, fresh: bool) -> float:
    """The compute speed ``record``'s peer is counted at in the swarm's speed, hence in every peer's share of the
    target and in the ETA. A peer in its first steps has no measured speed yet (``_Throughput`` publishes one after
    its second step): during the epoch's first ``max_extrapolation`` seconds (``fresh``) it is counted at the median
    measured speed (``typical``), or each peer that knows its own speed would compute the whole target alone while
    the others' records travel. Never extrapolated at that guess (its samples count as published), and only for
    those seconds: a peer still unmeasured after them is slow (or skips every step) and is not counted, so a fast
    peer does not stop at a share that a slow one would never fill."""
    if record.samples_per_second > 0:
        return record.samples_per_second
    return typical if fresh and record.epoch >= epoch - 1 else 0.0


def mismatch_line(run_id: str, schemas: Sequence[str], legacy: Mapping[str, int]) -> str:
    """One line about the peers of ``run_id`` whose records carry another ``schemas`` than ours: peers of an older
    release when their schema is one an older protocol gives our model (``legacy``), another model otherwise."""
    older = sorted({legacy[s] for s in schemas if s in legacy})
    if older:
        count = sum(s in legacy for s in schemas)
        return (f"{count} peer(s) in run '{run_id}' train this model with {protocol_mismatch(older[-1])}; they are "
                f"kept apart")
    return (f"{len(schemas)} peer(s) in run '{run_id}' train a different model or recipe (parameter shapes or "
            f"dtypes, strategy or Optimizer(identity=...) differ), or run another swarm_opt version; they are kept "
            f"apart. Give each model its own run_id, and every peer the same swarm_opt release.")


def parse_records(raw: object, *, model_schema: Optional[str], now: float, shard: Shard = (0, 0),
                  departed: Optional[set] = None, owners: Optional[list] = None
                  ) -> tuple[List[ProgressRecord], List[str]]:
    """Validate what the DHT returned for ``shard``. Returns the usable records and the schemas of those that came
    from a different model (or protocol); the instance of each peer that withdrew its record (it left) is added to
    ``departed``, and the hash of each usable record's signer (None if unsigned) to ``owners``, in order.

    Anything malformed, out of range, from the far future, stored under a shard its signer's key does not hash to
    or (unless ``model_schema`` is None: an observer) from a peer with another model is dropped.
    """
    if not isinstance(raw, ValueWithExpiration) or not isinstance(raw.value, dict):
        return [], []
    records: List[ProgressRecord] = []
    mismatched: List[str] = []
    for subkey, entry in raw.value.items():
        value = entry.value if isinstance(entry, ValueWithExpiration) else None
        if value is None:
            if departed is not None and isinstance(entry, ValueWithExpiration) and isinstance(subkey, bytes):
                departed.add(subkey.rsplit(b"/", 1)[-1].decode(errors="replace"))
            continue
        owner = owner_hash(subkey)
        if shard[0] > 0:
            if owner is None or shard_of(owner, shard[0]) != shard:
                logger.debug("Ignoring a progress record stored under another peer's shard: %r", subkey)
                continue
        try:
            record = ProgressRecord.parse_obj(value)
        except (pydantic.ValidationError, TypeError, ValueError):
            logger.debug("Ignoring a malformed progress record: %r", value)
            continue
        if record.time > now + _MAX_CLOCK_SKEW:
            logger.debug("Ignoring a progress record from the future: %r", record)
            continue
        if model_schema is not None and record.model_schema != model_schema:
            mismatched.append(record.model_schema)
            continue
        records.append(record)
        if owners is not None:
            owners.append(owner)
    return records, mismatched


#: bounds on how long a peer's view of the swarm must stay unchanged before it counts as settled (``settled``)
_MIN_SETTLE, _MAX_SETTLE = 2.0, 30.0
#: seconds between two reads while this peer computes and no peer's speed is measured yet (a run's first steps)
_UNMEASURED_PERIOD = 0.2
#: seconds between two reads once the swarm reached the target: the round is being formed, and a read only tells
#: whether the swarm moved on without this peer (a new epoch wakes the thread at once)
_READY_PERIOD = 0.5


def remembered_for(known_for: float, config: TrackerConfig) -> float:
    """How long a peer whose record vanished without a goodbye still counts (``recent_peers``, and as a voter on the
    swarm's epoch: ``swarm_opt.trust``), given how long this peer had seen it live: as long as that, at least a
    record's lifetime (a read that missed it), at most ``TrackerConfig.forget_after``. A peer cut off by a
    partition had been seen for long and is remembered in full; a peer that crashes and restarts under a new
    identity again and again (a crash loop) leaves about one such ghost at a time, not one per restart within
    ``forget_after``: those would outnumber the live peers, and the swarm would then commit nothing (no majority of
    the peers remembered) while a peer behind believed no epoch ahead of its own (and took those ahead for liars)."""
    return min(config.forget_after, max(known_for, config.record_ttl))


def read_interval(progress: SwarmProgress, local_samples: int, sampled: bool, config: TrackerConfig,
                  filling: bool = False, watched: bool = False) -> float:
    """Seconds until the tracker's next read: often near the end of an epoch, where the trigger's accuracy depends
    on fresh records, and seldom once the target is reached (each read is a DHT request that the nodes storing the
    key serve to every peer). A sampled view is read every ``sampled_period`` (its estimate is extrapolated between
    reads: no rush near the end), at the refresh pace while it is ``filling`` (``SampledRecords.filling``: a
    newcomer's bound on the swarm's size, which its rounds' majority is measured against, narrows with each shard)
    or ``watched`` (``ProgressTracker.epoch_reached``: a round looking for its group, which the swarm may complete
    without this peer)."""
    if sampled:
        return min(config.refresh_period, config.sampled_period) if filling or watched else config.sampled_period
    if progress.samples_per_second == 0 and local_samples > 0:
        # a run's first steps: no speed is measured yet, so there is no ETA to pace reads by, and the peers learn
        # that the swarm reached the target only from each other's samples
        return min(config.refresh_period, _UNMEASURED_PERIOD)
    if progress.ready:
        return min(config.refresh_period, _READY_PERIOD)
    return min(config.refresh_period, max(0.05, progress.eta_seconds / 3))


class _Throughput:
    """Samples per second of compute: a moving average over the intervals between two reports of one epoch that
    added samples (one training step each), so that neither the time spent in rounds nor a wait before training
    (start-up, data loading, a paused loop) dilutes it; peers extrapolate each other, and share the global batch, at
    this speed. A peer that stopped adding samples is no longer extrapolated once its record is old (see
    ``aggregate_progress``)."""

    def __init__(self) -> None:
        self._last = 0.0
        self._mark: Optional[Tuple[int, float]] = None  # (samples, monotonic time) when this epoch's samples last grew
        # the first interval may hold the wait before training: its rate is a lower bound, replaced by the next one
        self._provisional = True

    def restart(self) -> None:
        self._mark = None

    def update(self, samples: int) -> float:
        now = time.monotonic()
        if self._mark is None or samples < self._mark[0]:
            self._mark = (samples, now)
        elif samples > self._mark[0] and now - self._mark[1] > 1e-4:
            rate = (samples - self._mark[0]) / (now - self._mark[1])
            if self._provisional or self._last == 0:
                self._provisional, self._last = self._last == 0, rate
            else:
                self._last = 0.7 * self._last + 0.3 * rate
            self._mark = (samples, now)
        # a provisional speed is not published: others would bound this peer's claims (and their own, through the
        # median) by a speed diluted by the start-up wait, and strike honest founders
        return 0.0 if self._provisional else self._last


class SampledRecords:
    """Reads a run's records from the DHT one shard per call and holds a sample of the swarm (``swarm_opt.sharding``):
    in a small swarm, the one key that holds every record. Shared by trackers and observers (the monitor)."""

    def __init__(self, dht: DHT, run_id: str, *, model_schema: Optional[str], config: TrackerConfig,
                 owner: Optional[int] = None, exclude_instance: Optional[str] = None) -> None:
        self.dht, self.run_id, self.model_schema, self.config = dht, run_id, model_schema, config
        self.sample = ShardSample(exact_up_to=config.exact_up_to, shard_size=config.shard_size,
                                  horizon=config.sample_horizon)
        self.owner = owner if owner is not None else int.from_bytes(os.urandom(8), "little")
        self._exclude = exclude_instance
        self._probe_period = max(30.0, 5 * config.record_ttl)
        self._last_probe = -math.inf
        self._latest: List[ProgressRecord] = []  # the records of the shard read last
        self._burst_epoch = -1  # the newest epoch a burst of reads was for (see ``confirm``)
        self._burst = 0  # reads left in the current burst
        self.departed: set = set()  # the instances of the peers whose withdrawn records were read (they left)

    @property
    def max_extrapolation(self) -> float:
        """A sampled shard's records were re-timed when read (``_hold``): extrapolate them until read again."""
        return self.config.max_extrapolation + (self.config.sample_horizon if self.sample.level > 0 else 0.0)

    @property
    def filling(self) -> bool:
        """Whether the sample covers less of the swarm than a horizon of reads does once settled (a newcomer's
        first reads, or a sample whose oldest shards just expired): reading faster then costs no more reads on
        average, each shard being kept for a horizon either way."""
        settled = min(1.0, self.config.sample_horizon / self.config.sampled_period / 2 ** self.sample.level)
        return self.sample.level > 0 and self.sample.coverage < settled

    @property
    def bursting(self) -> bool:
        """Whether to read the next shard at once rather than after ``sampled_period`` (see ``confirm``)."""
        return self._burst > 0

    def confirm(self, believed: int) -> bool:
        """After a read: whether to read the next shard at once (``bursting``). ``believed_epoch`` takes the
        epoch that half of the records held reached (``swarm_opt.trust``), and most of them were read up to a horizon
        ago, rounds before: when the shard read last says that most of its peers passed the ``believed`` epoch, the
        held shards are re-read, least recently read first, until the belief follows or each was re-read once. The
        majority rule is unchanged, only its evidence fresher; one burst per epoch believed, so a shard packed with
        liars, whatever epochs it claims, costs each reader at most one burst per round of the swarm."""
        latest = believed_epoch([r.epoch for r in self._latest], None) if self._latest else believed
        if self.sample.level == 0 or latest <= believed:
            self._burst = 0
        elif believed + 1 > self._burst_epoch:
            self._burst_epoch, self._burst = believed + 1, self.sample.shards_held - 1
        else:
            self._burst = max(0, self._burst - 1)
        return self.bursting

    def read(self, timeout: float) -> Tuple[List[ProgressRecord], List[str]]:
        """Read the next shard; return every record held (other peers') and the schemas of those read that came from
        another model.
        A reader that holds nobody's record probes every level (a newcomer to a large swarm, or a lonely peer)."""
        if not self.sample.records(get_dht_time()) and time.monotonic() - self._last_probe > self._probe_period:
            mismatched = self.probe(timeout)
        else:
            shard = self.sample.next_read()
            now = get_dht_time()
            records, owners, mismatched = self._parse(shard, self._get(shard, timeout), now)
            self._hold(shard, records, now, owners)
        return self.sample.records(get_dht_time()), mismatched

    def probe(self, timeout: float) -> List[str]:
        """Read our own shard at every level at once and settle on the level that holds the most records."""
        self._last_probe = time.monotonic()
        shards = [shard_of(self.owner, level) for level in range(MAX_LEVEL + 1)]
        futures = [self._request(shard) for shard in shards]
        now = get_dht_time()
        found = []
        for shard, future in zip(shards, futures):
            try:
                raw = future.result(timeout=timeout)
            except Exception as e:  # a level that does not answer counts as empty
                logger.debug("Progress probe of %s failed: %r", shard, e)
                raw = None
            found.append(self._parse(shard, raw, now))
        level = self.sample.settle([len(records) for records, _, _ in found])
        records, owners, mismatched = found[level if level is not None else 0]
        self._hold(shards[level if level is not None else 0], records, now, owners)
        return mismatched

    def _get(self, shard: Shard, timeout: float) -> object:
        return self._request(shard).result(timeout=timeout)

    def _request(self, shard: Shard):
        """The only place that reads the swarm's records."""
        beam = {} if shard[0] == 0 else {"beam_size": _SHARD_READ_BEAM}
        return self.dht.get(shard_key(self.run_id, shard), latest=True, return_future=True, **beam)

    def _parse(self, shard: Shard, raw: object, now: float
               ) -> Tuple[List[ProgressRecord], List[Optional[int]], List[str]]:
        """The records of ``shard`` (not ours), their signers' hashes, and the schemas of other models'."""
        owners: List[Optional[int]] = []
        records, mismatched = parse_records(raw, model_schema=self.model_schema, now=now, shard=shard,
                                            departed=self.departed, owners=owners)
        kept = [(r, o) for r, o in zip(records, owners) if r.instance != self._exclude]
        return [r for r, _ in kept], [o for _, o in kept], mismatched

    def _hold(self, shard: Shard, records: List[ProgressRecord], now: float,
              owners: Optional[List[Optional[int]]] = None) -> None:
        if shard[0] > 0:  # held for up to a horizon: a record stale when read stays as stale as it was then
            oldest = now - self.config.max_extrapolation
            records = [r if r.time >= oldest else r.copy(update={"time": oldest}) for r in records]
        self._latest = records
        self.sample.add(shard, records, now, owners=owners)


class ProgressTracker:
    """Publishes this peer's progress and keeps a fresh view of the swarm's, in a background thread.

    ``report()`` and ``progress`` are cheap (no network), so ``Optimizer.step()`` may call them every step.
    """

    def __init__(
        self,
        dht: DHT,
        run_id: str,
        target_batch_size: int,
        *,
        model_schema: str,
        config: TrackerConfig = TrackerConfig(),
        digest_tolerance: float = 0.0,
        legacy_schemas: Mapping[str, int] = {},
    ) -> None:
        self.dht, self.target_batch_size, self.config = dht, target_batch_size, config
        self._legacy_schemas = dict(legacy_schemas)  # this model's schema under older protocols -> the protocol
        self._digest_tolerance = digest_tolerance
        self.key = progress_key(run_id)
        self.model_schema = model_schema
        self.client_mode = bool(dht.client_mode)
        validators = use_progress_records(dht, run_id)
        # one subkey per tracker: several trackers in one process share the signing key but not the record
        self._instance = os.urandom(8).hex()
        self._subkey = validators[-1].local_public_key + b"/" + self._instance.encode()
        self._owner = owner_hash(self._subkey)
        self._records = SampledRecords(dht, run_id, model_schema=model_schema, config=config, owner=self._owner,
                                       exclude_instance=self._instance)
        self._run_id = run_id
        self._stored_until: Dict[int, float] = {}  # level -> when our record stored there expires (DHT time)
        self._peer_id = dht.peer_id.to_bytes()
        self._lock = threading.Lock()
        self._epoch, self._samples = 0, 0
        self._params_digest: Optional[List[float]] = None
        self._line: Optional[str] = None  # the grid line in which this peer committed its epoch (``report``)
        self._joined = False  # see ``mark_joined``
        self._epoch_started: Optional[float] = None
        self._first_step: Optional[float] = None  # epoch 0's start for ``aggregate_progress`` (not for trust checks)
        self._throughput = _Throughput()
        self._checker = ClaimChecker(config.trust)
        self._others: List[ProgressRecord] = []
        self._ahead = 0  # live peers ahead of the swarm's epoch, not among ``_others``
        self._scale = 1.0  # how many peers each of ``_others`` stands for
        self._mismatch_reported = False
        self._published: Optional[tuple] = None
        self._published_samples = 0
        self._last_publish = -math.inf
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._reads = threading.Condition()  # counts the background thread's reads: see ``read_again``
        self._reads_started = self._reads_done = 0
        self._last_read = -math.inf  # monotonic
        self._watched_until = -math.inf  # monotonic: see ``epoch_reached``
        # what this peer saw of the swarm (monotonic times): see ``recent_peers``, ``settled`` and ``other_version``
        self._memory: Dict[Tuple[bytes, str], Tuple[float, float]] = {}  # peers seen live: when first, when last
        self._quiet_since = math.inf  # when our record was first stored, or a read that saw a new peer began
        self._last_read_began = -math.inf
        self._view_size, self._reads_since_growth = 0, 0
        self._read_seconds = 0.0  # how long reads take: the slowest recent one, decaying
        self._version: Optional[Tuple[int, List[bytes]]] = None
        self._version_streak = 0
        self._thread = threading.Thread(target=self._run, name="swarm_opt.ProgressTracker", daemon=True)

    # --- what the optimizer calls -----------------------------------------------------------------------------------
    @property
    def checker(self) -> ClaimChecker:
        return self._checker

    def start(self) -> None:
        self._records.probe(timeout=10.0)
        self.refresh()
        self._thread.start()

    def report(self, epoch: int, samples: int, params_digest: Optional[List[float]] = None,
               line: Optional[str] = None) -> None:
        """Record local progress; published by the background thread (at once when the epoch changed). A new epoch
        forgets the parameters' digest and the line of the grid it was committed in unless they come along."""
        with self._lock:
            if epoch != self._epoch:
                self._throughput.restart()
                self._epoch_started = get_dht_time()
                self._params_digest = None
                self._line = line
                self._version, self._version_streak = None, 0
                self._wake.set()
            if params_digest is not None:
                self._params_digest = params_digest
                self._wake.set()
            if self._first_step is None and samples > 0:
                self._first_step = get_dht_time()
            self._epoch, self._samples = epoch, samples
            self._throughput.update(samples)

    def mark_joined(self) -> None:
        """This peer holds a state of the run (it founded it, committed a round, downloaded a state or resumed a
        checkpoint): from now on it publishes its record, which other peers count, and its epoch counts as evidence
        of the swarm's (``swarm_opt.trust``). A newcomer still deciding whether to download publishes nothing, so
        that newcomers arriving together do not outvote the peers they join."""
        with self._lock:
            if not self._joined:
                self._joined = True
                self._wake.set()

    @property
    def settled(self) -> bool:
        """Whether this peer's view of the swarm has settled: its last two reads showed no new peer, and the last
        one began three reads' time (at least ``_MIN_SETTLE`` seconds) after its own record was first stored and
        after the read that last showed a new peer began. Peers that start (publish) within that time of each other
        see each other before either settles; until then a peer does not commit the run's first epoch, nor any epoch
        alone (``Optimizer``), or each of several peers that have not yet seen the others would commit its own
        version of it. A peer that really is alone pays that time once, at its first round."""
        with self._lock:
            settle = min(_MAX_SETTLE, max(_MIN_SETTLE, 3 * self._read_seconds))
            quiet = self._last_read_began - self._quiet_since
            return self._reads_since_growth >= 2 and quiet >= settle

    @property
    def other_version(self) -> Optional[Tuple[int, List[bytes]]]:
        """Another version of the run that outnumbers this peer's, as (its epoch, the peer ids that hold it), when
        two reads in a row showed it (``other_version``, the function): this peer should take their state."""
        with self._lock:
            return self._version if self._version_streak >= 2 else None

    @property
    def sampled(self) -> bool:
        """Whether this peer's view is a sample of sharded records (``swarm_opt.sharding``), not every record."""
        return self._records.sample.level > 0

    @property
    def joined(self) -> bool:
        with self._lock:
            return self._joined

    def read_again(self, timeout: float) -> bool:
        """Have the background thread read the records at once, and wait (up to ``timeout``) until a read that
        started after this call ended: for a decision that records read a moment ago could get wrong. Only that
        thread reads, so reads never race."""
        with self._reads:
            wanted = self._reads_started + 1
            self._wake.set()
            return self._reads.wait_for(lambda: self._reads_done >= wanted, timeout)

    def epoch_reached(self, epoch: int) -> bool:
        """Whether the swarm reached ``epoch``. Asked again and again by a round that looks for its group (which the
        swarm may complete without this peer), it keeps a sampled view reading at the refresh pace, not once per
        ``sampled_period``, for as long as it is asked (each time for ``refresh_period``)."""
        now = time.monotonic()
        if now >= self._watched_until and now - self._last_read >= self.config.refresh_period:
            self._wake.set()
        self._watched_until = now + self.config.refresh_period
        return self.progress.epoch >= epoch

    def line_reached(self, epoch: int, line: str) -> bool:
        """Whether the round that ends at ``epoch`` is over for the peers of the grid's ``line`` (Moshpit groups):
        a peer published that it committed it in that line (at most one group per line holds a majority), or the
        swarm is a round further. Lines average on their own, so another line's commit says nothing of this one's;
        asked like ``epoch_reached``, which it reads through."""
        if self.epoch_reached(epoch + 1):
            return True
        with self._lock:
            return any(r.epoch == epoch and r.line == line for r in self._others)

    def holders(self, epoch: int) -> List[bytes]:
        """The peers whose counted records stand at ``epoch`` (the swarm's epoch, as this peer believes it), in
        random order: the donors a peer catching up asks, rather than the most advanced donor listed on the DHT,
        which may be a part of the swarm that a partition cut off and that trained on alone (``believed_epoch``).
        Empty in a sampled view (its records are a sample: any listed donor then)."""
        with self._lock:
            peers = [] if self.sampled else list({r.peer_id for r in self._others if r.epoch == epoch})
        random.shuffle(peers)
        return peers

    def expected_params_digest(self, epoch: int, donor: bytes, tolerance: float
                               ) -> Optional[Tuple[Tuple[float, ...], str]]:
        """The parameters' digest that a state downloaded at ``epoch`` from ``donor`` must match, and whose it is: the
        one a strict majority (and at least two) of the other peers at that epoch publish; failing that, the one the
        donor itself published for that epoch (a peer's parameters change only with its epoch, so it serves what it
        published); None when neither is known."""
        with self._lock:
            records = [r for r in self._others if r.epoch == epoch]
        digests = {(r.peer_id, r.instance): digest for r in records
                   if (digest := valid_digest(r.params_digest)) is not None}
        agreeing = majority(digests, tolerance)
        if len(agreeing) >= 2 and 2 * len(agreeing) > len(digests):
            return digests[agreeing[0]], "the majority of peers at that epoch hold"
        own = [digest for (peer, _), digest in digests.items() if peer == donor]
        return (own[0], "it published for that epoch") if len(own) == 1 else None

    @property
    def progress(self) -> SwarmProgress:
        with self._lock:
            local, others, ahead, scale = self._local_record(), self._others, self._ahead, self._scale
            started = self._epoch_started if self._epoch_started is not None else self._first_step
            recent = self._recent_peers()
        return aggregate_progress(others, local, self.target_batch_size, get_dht_time(), started,
                                  max_extrapolation=self._records.max_extrapolation, scale=scale, ahead=ahead,
                                  shares=self.config.shares, recent_peers=recent)

    def refresh(self, timeout: float = 10.0) -> SwarmProgress:
        """Publish and read right now (blocking), e.g. before deciding whether to download state."""
        self._publish(force=True, timeout=timeout)
        self._fetch(timeout=timeout)
        return self.progress

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the thread and withdraw our record, so that the swarm stops counting us at once."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        try:
            now = get_dht_time()
            # an empty record, kept for a record's lifetime: readers forget us at once (``parse_records``'s
            # ``departed``), where a record that merely vanished counts for ``TrackerConfig.forget_after``
            self._store([level for level, until in self._stored_until.items() if until > now], None,
                        now + self.config.record_ttl, timeout)
        except Exception as e:  # the DHT may already be gone; leaving is best effort
            logger.debug("Could not withdraw the progress record: %r", e)

    # --- background thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._publish(force=False, timeout=self.config.record_ttl)
                with self._reads:
                    self._reads_started += 1
                    started = self._reads_started
                try:
                    self._fetch(timeout=self.config.record_ttl)
                finally:
                    with self._reads:
                        self._reads_done = started
                        self._reads.notify_all()
            except Exception as e:  # a failed read or write is retried at the next tick; it must not kill the thread
                logger.debug("Progress tracker tick failed: %r", e)
            self._wake.wait(self._next_interval())
            self._wake.clear()

    def _next_interval(self) -> float:
        if self._records.bursting:
            return 0.0
        return read_interval(self.progress, self._samples, self.sampled, self.config, self._records.filling,
                             watched=time.monotonic() < self._watched_until)

    def _remember(self, live: frozenset, present: set, departed: set, began: float, took: float) -> None:
        """After a read (under the lock): the peers seen live now are remembered (``recent_peers``) until they leave,
        are ignored (``swarm_opt.trust``), restart (a new instance of the same peer id) or stay unseen for
        ``remembered_for``; the view's growth and the read's duration go into ``settled``."""
        now = time.monotonic()
        for key in live:
            self._memory[key] = (self._memory.get(key, (now, now))[0], now)
        live_ids = {peer for peer, _ in live}  # a remembered instance of one of them is one that restarted
        for key, (first, last) in list(self._memory.items()):
            if (key[1] in departed or (key in present and key not in live) or (key[0] in live_ids and key not in live)
                    or now - last > remembered_for(last - first, self.config)):
                del self._memory[key]
        if len(live) > self._view_size:
            self._quiet_since, self._reads_since_growth = max(self._quiet_since, began), 0
        else:
            self._reads_since_growth += 1
        self._view_size, self._last_read_began = len(live), began
        self._read_seconds = max(took, 0.8 * self._read_seconds)

    def live_peers(self) -> Optional[List[bytes]]:
        """The ids of the peers seen live recently (``recent_peers``), this one included; None in a sampled view,
        which knows only some of them."""
        with self._lock:
            if self.sampled:
                return None
            return [self._peer_id, *{peer for peer, _ in self._memory}]

    def _recent_peers(self) -> int:
        return 0 if self.sampled else 1 + len(self._memory)

    def _judge_versions(self) -> None:
        """After a read (under the lock): whether another version of the run outnumbers ours (``other_version``)."""
        own = valid_digest(self._params_digest)
        found = None
        if own is not None and self._joined and not self.sampled and self._epoch_started is not None:
            found = other_version(self._others, (self._peer_id, self._instance), self._epoch, own,
                                  self._digest_tolerance, self._epoch_started + 2 * self.config.heartbeat_period)
        same = found is not None and self._version is not None and found[0] == self._version[0]
        self._version, self._version_streak = found, (self._version_streak + 1 if same else int(found is not None))

    def _local_record(self) -> ProgressRecord:
        """This peer's record. Its samples stop at the global batch: a peer that keeps accumulating while its rounds
        fail (cut off by the network: ``Optimizer._cut_off``) computes many global batches in one epoch, which tell
        nobody anything more and which ``swarm_opt.trust`` takes for a lie (it would ignore the honest peer as the
        network heals, and the peers that ignore it would each see too few peers to commit)."""
        # our own values need no validation, and step() reads this every call: skip pydantic's checks
        return ProgressRecord.construct(
            peer_id=self._peer_id, instance=self._instance, epoch=self._epoch,
            samples=min(self._samples, self.target_batch_size),
            samples_per_second=float(self._throughput.update(self._samples)), time=float(get_dht_time()),
            client_mode=self.client_mode, model_schema=self.model_schema, target_batch_size=self.target_batch_size,
            params_digest=self._params_digest, line=self._line,
        )

    def _publish(self, *, force: bool, timeout: float) -> None:
        with self._lock:
            if not self._joined:
                return
            record = self._local_record()
        levels = self._records.sample.publish_levels()
        # published at once: a new epoch, digest or shard level, reaching the share (this peer then stops computing
        # and waits for the round), and every sample until a speed is measured (nothing to extrapolate before it);
        # other new samples at most every ``max_extrapolation / 2`` (others extrapolate them meanwhile; at every
        # change with ``max_extrapolation=0``), not at every read; and the heartbeat
        share = self.progress.share
        reached = share is not None and record.samples >= share
        milestone = record.samples if record.samples_per_second == 0 else reached
        state = (record.epoch, milestone, record.params_digest, levels)
        now = time.monotonic()
        heartbeat = self.config.sampled_period if self.sampled else self.config.heartbeat_period
        moving = (record.samples != self._published_samples
                  and now - self._last_publish >= self._records.max_extrapolation / 2)
        if not force and state == self._published and not moving and now - self._last_publish < heartbeat:
            return
        expiration = get_dht_time() + self.config.record_ttl * heartbeat / self.config.heartbeat_period
        if self._quiet_since == math.inf:
            with self._lock:
                self._quiet_since = now  # others may see this peer from now on (see ``settled``)
        self._store(levels, record.dict(), expiration, timeout)
        self._published, self._published_samples, self._last_publish = state, record.samples, now
        self._stored_until.update(dict.fromkeys(levels, expiration))

    def _store(self, levels: Iterable[int], value: Optional[dict], expiration_time: float, timeout: float) -> None:
        """Straight to the nodes the key's last search found (``store_near``): hivemind's store searches first, and
        every node its search visits answers with the key's whole value."""
        futures = [self.dht.run_coroutine(functools.partial(
            store_near, key=shard_key(self._run_id, shard_of(self._owner, level)), subkey=self._subkey, value=value,
            expiration_time=expiration_time), return_future=True) for level in sorted(levels)]
        for future in futures:
            future.result(timeout=timeout)

    def _fetch(self, *, timeout: float) -> None:
        began = time.monotonic()
        records, mismatched = self._records.read(timeout)
        took = time.monotonic() - began
        now = get_dht_time()
        if mismatched and not self._mismatch_reported:
            self._mismatch_reported = True
            logger.error(mismatch_line(self.key[:-len('_swarm_progress')], mismatched, self._legacy_schemas))
        with self._lock:
            local, started, joined = self._local_record(), self._epoch_started, self._joined
            remembered = () if self.sampled else tuple(self._memory)  # see ``recent_peers``
        checked = self._checker.check(records, local, now, self.target_batch_size, started, local_votes=joined,
                                      remembered=remembered)
        scale = self._records.sample.scale
        departed, self._records.departed = self._records.departed, set()
        with self._lock:
            self._others, self._ahead, self._scale = checked.records, checked.ahead, scale
            self._remember(checked.live, {(r.peer_id, r.instance) for r in records}, departed, began, took)
            self._judge_versions()
        self._records.sample.observe(1 + scale * (len(checked.records) + checked.ahead))
        self._last_read = time.monotonic()
        self._records.confirm(self.progress.epoch)
