"""Where progress records live on the DHT, and which of them a peer reads: a per-peer cost that does not grow with N.

Reading every peer's record at every refresh costs each peer O(N) and the swarm O(N^2), and hammers the few DHT
nodes that store the run's key. Instead, records are **sharded**: at level ``c`` there are ``K = 2^c`` keys, and a
peer's record goes to shard ``sha256(owner key) mod K``, where the owner key is the RSA public key that signs the
record. A peer picks its level from its estimate of the swarm's size so that a shard holds about ``shard_size``
records (level 0, one key, holds up to ``exact_up_to``), and reads **one shard every** ``sampled_period``, the one
it read least recently, from the DHT node nearest to its key (a beam of 1: each node a hivemind search visits answers
with its routing table and, if it holds the key, its whole value); it writes its own record straight to its
shard's nearest nodes, without a search (``swarm_opt._hivemind.near_store``). It keeps what it read for
``sample_horizon`` seconds and estimates the swarm from the shards it holds: if they cover a fraction ``f`` of the
shards (``coverage``), each record held stands for ``1/f`` peers (``scale``).
Per period a peer reads about ``shard_size`` records and writes its own once or twice, whatever N; the DHT load
spreads over K keys. The cost per peer is then a constant set by ``shard_size`` and ``sampled_period``.

* **Small swarms are exact.** Up to ``exact_up_to`` peers (more with the hysteresis below) everything is under one
  key (level 0, the run's historical key), a peer reads it at every refresh and the view is today's view. This
  bound is apart from ``shard_size``: small swarms stay exact (short epochs need it), while large swarms read small
  shards (the bytes per peer are about proportional to ``shard_size``). While the shards a peer holds cover the
  whole swarm (``K`` refreshes within the horizon: 10 shards by default, i.e. up to level 3, about 80 peers) nothing
  is scaled either; held records are extrapolated at their throughput, so the only error is a throughput that
  changed, or a peer that left, within the horizon.
* **Large swarms are sampled.** Shards are random subsets of the peers (a hash), so with ``n = f N`` records held
  the estimated total has a relative standard error of about ``sqrt((1 - f) / n) * sqrt(1 + CV^2)``, ``CV`` being
  the spread of per-peer samples (with the defaults at 1,000 peers: 10 shards of 128 held, n = 78, about 11 %), and
  no bias. Consecutive estimates share all but
  one shard, so the estimate moves smoothly and the epoch trigger does not fire early on a lucky draw.
* **Majorities need a bound, not an estimate.** A round commits only in a group holding a strict majority of the
  live peers (``swarm_opt.round``); measured against an estimate that came out low (a newcomer's first shard, a
  sample that missed a busy shard), two disjoint groups could each look like a majority. A sampled view therefore
  also gives an upper confidence bound (``peers_upper_bound``: the swarm size at which what it holds would lie two
  standard deviations below the mean), and the commit rule measures against that: exact when every shard is held,
  about 16 % above the estimate at 1,000 peers (under the live peers in a few % of draws, where the estimate is
  in half), and far above it for a newcomer that holds one shard (a group takes its members' tightest bound, so
  this holds back only a group of newcomers).
* **Agreeing on the level.** Peers choose levels from their own estimates, with hysteresis (up above 1.25x a
  level's capacity, down below 1/1.25 of the level below), and **publish** at every level whose range, widened by
  1.6, holds their estimate: a reader whose estimate differs from the writer's by less than 1.6 / 1.25 = 1.28x still
  finds the record where it reads. A newcomer (or a peer that finds nobody) probes its own shard at every level once
  and takes the level with the most records.

What a liar can do to a sampled estimate (on top of ``swarm_opt.trust``, which bounds each record's claim and
applies unchanged to whatever records a peer holds):

* **Its shard is not its choice.** A reader drops any record stored under a shard its owner's key does not hash to,
  so one key counts in one shard per level. Grinding keys to land in a chosen shard costs about ``K`` RSA key
  generations per identity: cheap, so this stops a single key from filling several shards, not a Sybil.
* **Amplification.** A held record counts ``1/f`` times: a liar's bounded claim (at most ``max_rate_vs_median`` x
  the median throughput) moves a reader that holds its shard by up to ``max_rate_vs_median / n`` of the total
  (about 2.5 % per liar at 1,000 peers), and readers that do not hold it not at all: unbiased over readers, ``1/f``
  more variable than at level 0.
* **Epochs.** ``believed_epoch`` needs half of the records a reader holds, i.e. about ``f N / 2`` identities packed
  into the shards it holds, instead of ``N / 2``: the Sybil bound weakens by ``f``, no further. Held records are up
  to a horizon old, so a reader re-reads its held shards at once when the one it read last says the swarm moved on
  (``SampledRecords.confirm``): fresher evidence under the same rule, at most one burst of reads per epoch
  believed.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from functools import lru_cache
from typing import Dict, FrozenSet, Optional, Sequence, Tuple

MAX_LEVEL = 7  # 128 shards: ~1,300 peers at the default shard size, shards grow beyond (the DHT process gets every
# key's hash: 8 KB here; at 2,047 keys the 53 KB validator message crashed hivemind's DHT process)
_HYSTERESIS = 1.25  # a reader changes level once its estimate leaves the level's range by this factor
_PUBLISH_MARGIN = 1.6  # a writer publishes at every level whose range, widened by this factor, holds its estimate
_SMOOTHING = 0.3  # weight of a new observation in the estimate of the swarm's size
_OWNER = re.compile(rb"\[owner:(.+?)\]")

Shard = Tuple[int, int]  # (level, index)


def progress_key(run_id: str) -> str:
    """The run's level-0 key: every record of a small swarm."""
    return f"{run_id}_swarm_progress"


def shard_key(run_id: str, shard: Shard) -> str:
    level, index = shard
    return progress_key(run_id) if level == 0 else f"{progress_key(run_id)}_{level}_{index}"


@lru_cache(maxsize=8)
def all_shard_keys(run_id: str) -> Tuple[str, ...]:
    """Every key a record of the run may be stored under (the DHT validators must know them by name)."""
    return tuple(shard_key(run_id, (level, index)) for level in range(MAX_LEVEL + 1) for index in range(2 ** level))


def owner_hash(subkey: bytes) -> Optional[int]:
    """The hash of the RSA public key that signs the record stored under ``subkey`` (None if it names none)."""
    found = _OWNER.search(subkey) if isinstance(subkey, bytes) else None
    return None if found is None else int.from_bytes(hashlib.sha256(found.group(1)).digest()[:8], "little")


def shard_of(owner: int, level: int) -> Shard:
    return level, owner % (2 ** level)


def peers_upper_bound(held: float, coverage: float, z: float = 2.0) -> float:
    """An upper confidence bound on how many peers a sample stands for: ``held`` records found in shards covering a
    fraction ``coverage`` of the swarm. A peer's record lands in a held shard with probability ``coverage`` (shards
    are hashes), so of ``N`` peers ``held ~ Binomial(N, coverage)``; the bound is the ``N`` at which ``held`` lies
    ``z`` standard deviations below its mean. ``held`` itself when every shard is held."""
    if coverage >= 1.0:
        return float(held)
    if coverage <= 0.0:
        return math.inf
    spread = z * math.sqrt(coverage * (1.0 - coverage))
    root = (spread + math.sqrt(spread * spread + 4.0 * coverage * max(0.0, held))) / (2.0 * coverage)
    return root * root


def _overlap(a: Shard, b: Shard) -> bool:
    low = min(a[0], b[0])
    return a[1] % 2 ** low == b[1] % 2 ** low


class ShardSample:
    """One peer's choice of shards and the records it holds from them; no network (the tracker reads and writes).

    ``records`` are whatever the caller stores per shard (validated progress records); the sample only keeps them
    with the time they were read and says how many peers each stands for (``scale``)."""

    def __init__(self, *, exact_up_to: int, shard_size: int, horizon: float, rng: Optional[random.Random] = None
                 ) -> None:
        self.exact_up_to, self.shard_size, self.horizon = exact_up_to, shard_size, horizon
        self.level = 0
        self.peers: Optional[float] = None  # smoothed estimate of the live peers, ourselves included
        self._held: Dict[Shard, Tuple[float, list, list]] = {}  # disjoint shards -> (time read, records, owners)
        self._rng = rng or random.Random()

    # --- which keys -------------------------------------------------------------------------------------------------
    def next_read(self) -> Shard:
        """The shard of our level read least recently (never read first), ties broken at random so that peers
        spread their reads over the shards."""
        def read_at(index: int) -> float:
            return max((t for shard, (t, _, _) in self._held.items()
                        if shard[0] <= self.level and _overlap(shard, (self.level, index))), default=-math.inf)

        indices = list(range(2 ** self.level))
        self._rng.shuffle(indices)
        return self.level, min(indices, key=read_at)

    def publish_levels(self) -> FrozenSet[int]:
        """Our level and every level whose range, widened by ``_PUBLISH_MARGIN``, holds our estimate."""
        levels = {self.level}
        if self.peers is not None:
            for level in range(MAX_LEVEL + 1):
                if level > 0 and self._capacity(level) <= self._capacity(level - 1):
                    continue  # a level no reader stays at (see _capacity)
                low = 0.0 if level == 0 else self._capacity(level - 1) / _PUBLISH_MARGIN
                if low <= self.peers <= self._capacity(level) * _PUBLISH_MARGIN:
                    levels.add(level)
        return frozenset(levels)

    # --- what was read ----------------------------------------------------------------------------------------------
    def add(self, shard: Shard, records: list, now: float, owners: Optional[Sequence[Optional[int]]] = None) -> None:
        """Hold ``records`` as shard ``shard``'s content at ``now``, replacing whatever overlapped it. ``owners``: the
        hash of each record's signer (``owner_hash``; None where unknown). A coarser shard replaced by a finer one
        leaves its records that belong to its other parts held as those finer shards, read when it was: a peer that
        moves up a level keeps the whole swarm in view until it has read each finer shard, instead of estimating
        from one shard scaled up (a lucky draw that could fire the epoch trigger early, as at a swarm's start)."""
        owners = list(owners) if owners is not None else [None] * len(records)
        for held in [s for s in self._held if _overlap(s, shard)]:
            read, held_records, held_owners = self._held.pop(held)
            if held[0] < shard[0]:
                self._refile(held, read, held_records, held_owners, taken=shard)
        self._held[shard] = (now, list(records), owners)
        self._expire(now)

    def _refile(self, coarse: Shard, read: float, records: list, owners: list, taken: Shard) -> None:
        """Hold the records of ``coarse`` as its shards at ``taken``'s level, all but ``taken`` (records whose owner
        is unknown cannot be placed: dropped)."""
        level = taken[0]
        for index in range(coarse[1], 2 ** level, 2 ** coarse[0]):
            if index != taken[1]:
                part = [(r, o) for r, o in zip(records, owners)
                        if o is not None and shard_of(o, level) == (level, index)]
                self._held[(level, index)] = (read, [r for r, _ in part], [o for _, o in part])

    def records(self, now: float) -> list:
        self._expire(now)
        return [record for _, records, _ in self._held.values() for record in records]

    @property
    def coverage(self) -> float:
        """The fraction of the swarm's shards held (1 when every peer's record is among ``records``)."""
        return sum(2.0 ** -level for level, _ in self._held)

    @property
    def shards_held(self) -> int:
        return len(self._held)

    @property
    def scale(self) -> float:
        """How many peers each held record stands for."""
        return 1.0 / self.coverage if self.coverage > 0 else 1.0

    def observe(self, peers: float) -> None:
        """Update the swarm's size estimate (ourselves included) and, past the hysteresis, our level."""
        self.peers = peers if self.peers is None or self.level == 0 else \
            (1 - _SMOOTHING) * self.peers + _SMOOTHING * peers
        while self.level < MAX_LEVEL and self.peers > _HYSTERESIS * self._capacity(self.level):
            self.level += 1
        while self.level > 0 and self.peers < self._capacity(self.level - 1) / _HYSTERESIS:
            self.level -= 1

    def settle(self, counts: Sequence[int]) -> Optional[int]:
        """After a probe of our own shard at every level (``counts[level]`` other peers' records found there): take
        the level that held the most records, estimate the swarm from it and return it (None if nobody was found;
        then nothing changes)."""
        best = max(range(len(counts)), key=lambda level: (counts[level], -level))
        if counts[best] == 0:
            return None
        self.peers, self.level = None, 0
        self.observe(1 + counts[best] * 2 ** best)
        return best

    def _capacity(self, level: int) -> float:
        """How many peers ``level`` is for: one key up to ``exact_up_to``, then ``shard_size`` per shard (levels
        whose shards would hold fewer than ``exact_up_to`` in all are passed through on the way up and down)."""
        return float(self.exact_up_to if level == 0 else max(self.exact_up_to, self.shard_size * 2 ** level))

    def _expire(self, now: float) -> None:
        for shard in [s for s, (t, _, _) in self._held.items() if now - t > self.horizon]:
            del self._held[shard]
