"""Bounded trust in what other peers claim about their progress.

A progress record is signed, so nobody can write another peer's record, but its owner can still lie in it. A record
moves the swarm only as far as its owner plausibly could:

* **Epochs** ahead of ours count only once at least half of the live peers are there. A round commits only in a
  majority group, so an honest swarm always confirms its newest epoch; a single peer claiming epoch +1000 is not
  believed, so nobody waits on it or tries to download its state. One epoch ahead is where an honest peer stands
  after a round the others missed (a founder that trained alone while the others started; a group they did not
  join): it is neither believed nor counted toward our epoch, nor held against the peer, but it is a live peer: a
  round's majority is measured against it too, or laggards that miss a majority's round could commit their own.
  Only peers that hold a state of the run vote: a newcomer still deciding whether to download publishes no record
  and does not count its own epoch (else newcomers arriving together would outvote the founder they join, who
  trained alone); one that finds that no peer ahead serves a state (``Optimizer``) joins, so a lone liar in a run's
  first seconds delays it, no more.
* **Samples** grow no faster than a plausible throughput: at most ``max_rate_vs_median`` times the swarm's median
  throughput (a lower median, so that one liar among two peers cannot raise it), from when this peer saw the epoch
  begin (or from its first sight of the claimant, whose samples it then takes as they are, up to one global batch).
* A peer whose claims fail these checks grossly (samples above twice the bound and twice the global batch) or for
  long (two or more epochs ahead, unconfirmed) is **ignored** for ``ignore_seconds``, doubling at each repeat: its
  record counts for nothing, not even as a live peer. One WARNING line says so. A peer ignored for standing ahead
  counts again as soon as its record stands with the swarm: the side of a healed partition that trained on alone
  stands ahead until it takes the majority's state (``docs/partitions.md``), honest all along; a liar that withdraws
  its claim gains nothing, and its next one suspends it twice as long. Its epoch still votes once a second peer
  stands ahead too: a healed partition's majority whose records reach us one at a time is then believed once half
  of them are read, where one alone far ahead may be a liar.

What this cannot stop: many identities that each claim plausible progress (a Sybil attack). A private run
(``RunSecret``) keeps strangers out of the DHT altogether.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Collection, Dict, FrozenSet, Generic, Hashable, List, NamedTuple, Optional, Tuple, TypeVar

from hivemind.p2p import PeerID

from swarm_opt.config import TrustConfig
from swarm_opt.metrics import NO_METRICS, Metrics

logger = logging.getLogger(__name__)

_MAX_IGNORE_SECONDS = 3600.0
Key = TypeVar("Key", bound=Hashable)


class Suspensions(Generic[Key]):
    """Peers suspended for a while, longer at each repeat: ``first`` seconds, then twice as long at every new
    offence, up to ``longest``. Forgiveness that a hostile peer cannot exploit cheaply: one that offends again as
    soon as it is let back in is suspended ``first·(2^k − 1)`` seconds after ``k`` offences, so its offences grow
    with the logarithm of time; one named by mistake (a bit flip, a bug fixed by a restart) comes back.

    Bounded memory: at most ``capacity`` peers; when full, the one whose suspension ended first (or ends first) is
    forgotten. A peer's count of offences is kept while it is suspended and for ``longest`` after (so that
    offending again at once doubles), or until ``forget`` drops it. Not thread-safe: one owner calls it.
    """

    def __init__(self, first: float, longest: float, capacity: int = 4096) -> None:
        if not 0 < first <= longest < float("inf") or capacity < 1:
            raise ValueError(f"Suspensions needs 0 < first <= longest < inf and capacity >= 1, got {first}, "
                             f"{longest}, {capacity}")
        self.first, self.longest, self.capacity = float(first), float(longest), int(capacity)
        self._entries: Dict[Key, Tuple[int, float]] = {}  # peer -> (offences, suspended until)

    def suspend(self, key: Key, now: float) -> float:
        """Record an offence of ``key`` at ``now``; returns how many seconds it is suspended."""
        self._expire(now)
        offences = self._entries.pop(key, (0, 0.0))[0]
        seconds = min(self.longest, self.first * 2.0 ** min(offences, 64))
        if len(self._entries) >= self.capacity:
            del self._entries[min(self._entries, key=lambda k: self._entries[k][1])]
        self._entries[key] = (offences + 1, now + seconds)
        return seconds

    def suspended(self, key: Key, now: float) -> bool:
        entry = self._entries.get(key)
        return entry is not None and now < entry[1]

    def offences(self, key: Key) -> int:
        """How many offences of ``key`` are remembered (0 once forgotten)."""
        return self._entries.get(key, (0, 0.0))[0]

    def remembered(self) -> List[Key]:
        """Every peer with a record (suspended now, or suspended recently)."""
        return list(self._entries)

    def lift(self, key: Key, now: float) -> None:
        """End ``key``'s suspension now; its offences stay remembered: offending again suspends it for longer."""
        entry = self._entries.get(key)
        if entry is not None and now < entry[1]:
            self._entries[key] = (entry[0], now)

    def forget(self, key: Key, now: float) -> None:
        """Drop ``key``'s record if its suspension is over (a peer gone from the swarm starts afresh if it comes
        back after that)."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] <= now:
            del self._entries[key]

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, until) in self._entries.items() if until + self.longest <= now]:
            del self._entries[key]


def believed_epoch(epochs: List[int], local_epoch: Optional[int], voters: int = 0) -> int:
    """The newest epoch that at least half of the peers (``epochs``, ours included; or ``voters``, if more) have
    reached, and never less than our own: one peer cannot pull the swarm ahead, a majority that committed a round
    can. ``voters``: the peers this peer knows to be in the run (seen live lately, ``TrackerConfig.forget_after``),
    some of whose records a read may miss: right after a partition heals, a read may reach only one side's DHT
    nodes, and the side that trained on alone must not pass for the swarm there."""
    if not epochs:
        return local_epoch or 0
    ordered = sorted(epochs, reverse=True)
    n = max(len(ordered), voters)
    believed = ordered[-1]
    for count, epoch in enumerate(ordered, start=1):
        if 2 * count >= n:
            believed = epoch
            break
    return max(believed, local_epoch if local_epoch is not None else believed)


def lower_median(values: List[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class Checked(NamedTuple):
    """What ``ClaimChecker.check`` found: the ``records`` that count toward the swarm's epoch (samples and
    throughput bounded), and how many other peers are live but stand ahead of that epoch (``ahead``; within the
    grace): live peers all the same, so they count wherever the swarm's size matters. ``live``: the (peer id,
    instance) of every peer counted in either."""

    records: list
    ahead: int
    live: FrozenSet[Tuple[bytes, str]] = frozenset()


@dataclass
class _Credit:
    epoch: int
    base_samples: float
    base_time: float


class ClaimChecker:
    """Filters and bounds other peers' progress records (see the module docstring). Thread-safe; keeps a little
    state per peer (its credit in the current epoch, its strikes), forgotten once the peer is gone."""

    metrics: Metrics = NO_METRICS  # told of every record it starts ignoring

    def __init__(self, config: TrustConfig = TrustConfig()) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._credits: Dict[Tuple[bytes, str], _Credit] = {}
        self._epoch_began: Dict[int, float] = {}  # epochs whose start we witnessed, and when
        self._newest_seen: Optional[int] = None
        self._ahead_since: Dict[Tuple[bytes, str], float] = {}
        self._ignored_ahead: Dict[Tuple[bytes, str], None] = {}  # ignored for standing ahead (see ``_reinstate``)
        self._ignored: Suspensions[Tuple[bytes, str]] = Suspensions(config.ignore_seconds,
                                                                    max(config.ignore_seconds, _MAX_IGNORE_SECONDS))
        self._reference_rate = 0.0

    def check(self, records: list, local, now: float, target_batch_size: int,
              local_epoch_started: Optional[float] = None, *, local_votes: bool = True,
              remembered: Collection[Tuple[bytes, str]] = ()) -> Checked:
        """Return the records that count, with samples and throughput bounded, and how many peers are ahead.
        ``local`` is our own record (None for an observer); ``now`` and ``local_epoch_started`` are DHT times;
        ``local_votes``: whether our own epoch is evidence of the swarm's (not while we are a newcomer deciding
        whether to download; unless nobody else publishes one). ``remembered``: the (peer id, instance) of the
        other peers seen live lately, whether or not this read found their records: an epoch ahead of ours is
        believed only once half of them and of this read's peers stand there (``believed_epoch``)."""
        with self._lock:
            return self._check(records, local, now, target_batch_size, local_epoch_started, local_votes, remembered)

    def _check(self, records: list, local, now: float, target_batch_size: int,
               local_epoch_started: Optional[float], local_votes: bool,
               remembered: Collection[Tuple[bytes, str]]) -> Checked:
        local_epoch = None if local is None else local.epoch
        live = [r for r in records if not self._ignored.suspended(_key(r), now)]
        standing_ahead = [r for r in records
                          if _key(r) in self._ignored_ahead and self._ignored.suspended(_key(r), now)]
        known = {key for key in remembered if not self._ignored.suspended(key, now)}

        def believe(voting: list) -> int:
            own = [local_epoch] if local is not None and (local_votes or not voting) else []
            return believed_epoch([r.epoch for r in voting] + own, local_epoch,
                                  len(known.union(_key(r) for r in voting)) + len(own))

        epoch = believe(live)
        # peers ignored for standing ahead vote again once another peer stands ahead too: two signed identities
        # there are a side of a healed partition whose records reach us one by one (each would be ignored before
        # the next arrives, and the majority never believed), where one alone may be a liar
        if len({_key(r) for r in live + standing_ahead if r.epoch > epoch + 1}) >= 2:
            epoch = believe(live + standing_ahead)
        self._reinstate(records, max(epoch, self._newest_seen or 0), now)
        live = [r for r in records if not self._ignored.suspended(_key(r), now)]
        self._note_epoch(epoch, now, local_epoch, local_epoch_started)

        counted, ahead = [], []
        for record in live:
            key = _key(record)
            if record.epoch > epoch + 1:
                since = self._ahead_since.setdefault(key, now)
                if now - since >= self.config.ahead_grace:
                    self._ignore(key, now, f"it claims epoch {record.epoch} while the swarm is at {epoch} (a side "
                                           f"of a partition that trained on alone, or a liar; counted again once it "
                                           f"stands with the swarm)", "epoch_ahead")
                else:
                    ahead.append(key)
                continue
            self._ahead_since.pop(key, None)
            if record.epoch > epoch:  # one ahead: plausible (see the module docstring), not counted in ours
                ahead.append(key)
                continue
            counted.append(record)

        # peers without a measured speed count as 0: a speed is believed once at least half of the peers have one,
        # or a single liar's would be the median while the honest peers take their first steps
        rates = [r.samples_per_second for r in counted if r.epoch == epoch]
        if local is not None and local.epoch == epoch:
            rates.append(local.samples_per_second)
        median = lower_median(rates)
        if median > 0:
            self._reference_rate = median
        if self._reference_rate == 0:  # no speed to bound by yet (first steps): count reported samples only
            self._forget_absent({_key(r) for r in records}, now)
            return _checked([r.copy(update={"samples": min(r.samples, target_batch_size), "samples_per_second": 0.0})
                             for r in counted], ahead)
        rate_cap = self.config.max_rate_vs_median * self._reference_rate

        bounded = []
        for record in counted:
            update = {"samples_per_second": min(record.samples_per_second, rate_cap)}
            # this epoch's samples, and the last epoch's: a record one behind counts as computing this epoch with us
            # (see progress); older ones count as live peers only
            if record.epoch >= epoch - 1:
                allowed = self._allowed(record, now, target_batch_size, rate_cap)
                # struck only when no honest peer could claim it: one stops at its share of the global batch, while
                # the rate bound is as low as the swarm's median speed (a peer 100x faster than a slow median is
                # honest)
                if record.samples > 2 * max(allowed, target_batch_size):
                    self._ignore(_key(record), now, f"it claims {record.samples} samples where at most "
                                                    f"{allowed:.0f} were plausible", "implausible_samples")
                    continue
                if record.epoch == epoch:
                    update["samples"] = int(min(record.samples, allowed))
            bounded.append(record.copy(update=update))
        self._forget_absent({_key(r) for r in records}, now)
        return _checked(bounded, ahead)

    def _allowed(self, record, now: float, target_batch_size: int, rate_cap: float) -> float:
        """The most samples ``record``'s owner could plausibly hold in its epoch by ``now``: from when we saw that
        epoch begin, or from our first sight of it there (its word taken then, up to one global batch)."""
        key = _key(record)
        credit = self._credits.get(key)
        if credit is None or credit.epoch != record.epoch:
            began = self._epoch_began.get(record.epoch)
            if began is not None:
                credit = _Credit(record.epoch, 0.0, began)
            else:
                credit = _Credit(record.epoch, float(min(record.samples, target_batch_size)), now)
            self._credits[key] = credit
        return credit.base_samples + rate_cap * (max(0.0, now - credit.base_time) + self.config.burst_seconds)

    def _note_epoch(self, epoch: int, now: float, local_epoch: Optional[int], local_started: Optional[float]) -> None:
        """Remember when the swarm's epoch began, if we saw it begin: the epoch became the believed one after our
        first check (a peer that joins, or downloads a state, finds its epoch long begun: it knows no start)."""
        if self._newest_seen is not None and epoch > self._newest_seen:
            began = local_started if local_epoch == epoch and local_started is not None else now
            self._epoch_began[epoch] = min(began, now)
        self._newest_seen = epoch if self._newest_seen is None else max(self._newest_seen, epoch)
        for old in [e for e in self._epoch_began if e < epoch - 1]:
            del self._epoch_began[old]

    def _reinstate(self, records: list, newest: int, now: float) -> None:
        """Count again the peers ignored for standing ahead whose records no longer do: at most one epoch ahead of
        ``newest``, the newest epoch believed (our own, at least)."""
        for record in records:
            key = _key(record)
            if key in self._ignored_ahead and record.epoch <= newest + 1:
                del self._ignored_ahead[key]
                if self._ignored.suspended(key, now):
                    self._ignored.lift(key, now)
                    logger.info(f"Peer {_describe(key)} stands with the swarm again (epoch {record.epoch}): "
                                f"counting it again")

    def _ignore(self, key: Tuple[bytes, str], now: float, why: str, reason: str) -> None:
        if reason == "epoch_ahead":
            self._ignored_ahead[key] = None
        seconds = self._ignored.suspend(key, now)
        self.metrics.record_refused(reason, key[0], why, seconds)
        self._credits.pop(key, None)
        self._ahead_since.pop(key, None)
        logger.warning(f"Ignoring peer {_describe(key)} for {seconds:.0f} s: {why}")

    def _forget_absent(self, present: set, now: float) -> None:
        for table in (self._credits, self._ahead_since):
            for key in [k for k in table if k not in present]:
                del table[key]
        for key in [k for k in self._ignored.remembered() if k not in present]:
            self._ignored.forget(key, now)
        for key in [k for k in self._ignored_ahead if not self._ignored.offences(k)]:
            del self._ignored_ahead[key]  # bounded by the suspensions' table


def _checked(records: list, ahead: List[Tuple[bytes, str]]) -> Checked:
    return Checked(records, len(ahead), frozenset(ahead).union(_key(r) for r in records))


def _key(record) -> Tuple[bytes, str]:
    return record.peer_id, record.instance


def _describe(key: Tuple[bytes, str]) -> str:
    return f"{PeerID(key[0])}/{key[1][:8]}"
