"""Frozen configuration dataclasses of the run (``SwarmConfig``, ``Timeouts``, ``TrackerConfig``, ``Groups``,
``TrustConfig``), each checked in ``__post_init__`` with messages that name the fix. Other options are checked where
their objects are built: each codec, aggregation, strategy and ``Gloo`` in its own constructor, their pairings when
the optimizer is built."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from swarm_opt.errors import ConfigError, ConfigTypeError

_RUN_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
SHARES = ("speed", "equal")  # TrackerConfig.shares


def _positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be a positive int, got {value!r} of type {type(value).__name__}")
    if value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value}; pass e.g. {name}=32")


def _positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a positive number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive, finite number of seconds, got {value}")


@dataclass(frozen=True)
class Timeouts:
    """How long each network phase may take, in seconds.

    :param matchmaking_time: peers spend this long forming an averaging group before each round. Increase it if the
        log says rounds average in groups smaller than the swarm (peers on slow links miss the group).
    :param averaging_timeout: a round that has not finished this long after it was due is abandoned; the peer keeps
        its local progress and retries. Increase it for large models on slow links.
    :param state_download_timeout: a newcomer or a peer that fell behind gives up downloading the swarm's state after
        this long and raises StateDownloadError, unless the state is arriving: a download goes on while it receives at
        least 32 KiB/s, however large the state and slow the link (``swarm_opt.deadlines.DownloadDeadline``).
    :param adaptive: ``True`` (default): each round's averaging deadline follows the swarm's measured round times (a
        high quantile of this peer's recent committed rounds, with a wide margin) and ``averaging_timeout`` is its
        upper bound: a fast swarm drops a member that stopped sending mid-round within seconds, and a round that
        misses its deadline puts it back to the bound (``swarm_opt.deadlines``). ``matchmaking_time`` is used as
        given (groups assemble as soon as every contributing peer joined; it only bounds the wait for one that does
        not come). ``False``: every round uses exactly these numbers, as hivemind does.
    """

    matchmaking_time: float = 5.0
    averaging_timeout: float = 60.0
    state_download_timeout: float = 120.0
    adaptive: bool = True

    def __post_init__(self) -> None:
        _positive_float("matchmaking_time", self.matchmaking_time)
        _positive_float("averaging_timeout", self.averaging_timeout)
        _positive_float("state_download_timeout", self.state_download_timeout)
        if not isinstance(self.adaptive, bool):
            raise ConfigTypeError(f"adaptive must be True (deadlines follow the measured rounds, the numbers are upper "
                                  f"bounds) or False (the numbers as they are), got {self.adaptive!r}")
        if self.averaging_timeout <= self.matchmaking_time:
            raise ConfigError(
                f"averaging_timeout ({self.averaging_timeout}) must exceed matchmaking_time ({self.matchmaking_time}): "
                f"a round spends matchmaking_time forming a group before it can average"
            )

    @property
    def request_timeout(self) -> float:
        """hivemind requires its request timeout to be below the matchmaking time, or it warns and may deadlock."""
        return min(3.0, self.matchmaking_time * 0.5)

    @property
    def next_chunk_timeout(self) -> float:
        """A member of an all-reduce that sends nothing for this long is dropped (and the round fails)."""
        return self.averaging_timeout / 3


@dataclass(frozen=True)
class TrustConfig:
    """How far the tracker believes other peers' progress records.

    :param max_rate_vs_median: a peer's samples count at most at this many times the swarm's median throughput.
        Raise it for swarms whose peers differ a lot in speed (a fast peer's extra samples then still count).
    :param burst_seconds: slack, in seconds of a peer's plausible throughput, for samples carried over from the
        previous epoch and for records read a little late.
    :param ahead_grace: seconds a peer may claim an epoch two or more ahead of the one a majority confirms before it
        is ignored (one ahead is where an honest peer stands after a round the others missed: never held against it).
    :param ignore_seconds: how long a peer that failed the checks is ignored the first time (doubles each time).
    """

    max_rate_vs_median: float = 4.0
    burst_seconds: float = 3.0
    ahead_grace: float = 10.0
    ignore_seconds: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_rate_vs_median", "burst_seconds", "ahead_grace", "ignore_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"TrustConfig.{name} must be a positive, finite number, got {value!r}")
        if self.max_rate_vs_median < 1:
            raise ConfigError(f"TrustConfig.max_rate_vs_median must be >= 1 (1 = no peer faster than the median), "
                              f"got {self.max_rate_vs_median}")


@dataclass(frozen=True)
class TrackerConfig:
    """How peers publish and read training progress on the DHT.

    :param heartbeat_period: a peer re-publishes its progress at least this often, so that the swarm sees it alive.
    :param record_ttl: a progress record expires this long after it was published; a peer that stopped reporting
        (crashed, disconnected) is forgotten after at most this many seconds.
    :param refresh_period: read the swarm's progress at least this often (more often near the end of an epoch).
    :param max_extrapolation: between reads, each peer's samples are extrapolated at its throughput for at most this
        many seconds past its last record, so that rounds start on time; 0 counts only reported samples (rounds
        then never start before every counted sample was reported, a little later on average) and turns off the other
        estimate from speeds, each peer's share of the global batch (rounds are then as deterministic as the steps).
    :param shares: how the global batch is split among the peers computing an epoch, each of which stops at its
        share and waits for the round. ``"speed"`` (default): in proportion to their compute speeds, so that all
        finish together and nobody waits for a slow peer (a volunteer swarm). ``"equal"``: the same number of
        samples each, hence the same number of local steps per round (federated learning's schedule: FedAvg's K
        local steps, SCAFFOLD's control variates); every round then lasts as long as its slowest peer takes, at
        most ``averaging_timeout`` past the others. Every peer of a run must use the same.
    :param trust: how far other peers' claims are believed (``TrustConfig``).
    :param forget_after: a peer whose record vanished without its owner leaving (it crashed, or the network cut it
        off from this peer) still counts in the swarm's size, which a round's majority is measured against, for this
        many seconds (a peer seen live for less time than that: that long, at least ``record_ttl``; a volunteer
        whose process crashes and restarts in a loop, a new identity each time, would otherwise leave a ghost per
        restart that outnumbers the live peers). A peer cut off from the swarm (its Wi-Fi dropped, a VPN
        reconnects) therefore commits no epoch without a majority of the peers it saw, and trains no second version
        of the run, for that long; the price is
        that a swarm of which more than half crashed at once waits as long before the rest trains on. Peers that
        leave cleanly (``Optimizer.shutdown``) say so and are forgotten at once. Small swarms only (a sharded view
        is a sample: its count is used as it is).
    :param exact_up_to: swarms up to this many peers keep every record under one key and every peer reads them all
        at every refresh: exact tracking, which short epochs need. Larger swarms are sharded. A private run is never
        sharded (its donors admit a newcomer by its record under that key), so its tracking costs each peer O(N).
    :param shard_size: how many records a peer reads at a time in a sharded swarm: records are spread over more DHT
        keys as the swarm grows, so that each key holds about this many (``swarm_opt.sharding``). The DHT bytes a
        peer spends on tracking grow with it; the sampled estimate's error shrinks like its square root.
    :param sample_horizon: in a sharded swarm, a peer keeps the shards it read for this many seconds and estimates
        the swarm from them; longer is more precise in a steady swarm, shorter follows churn sooner.
    :param sampled_period: in a sharded swarm, a peer reads one shard and re-publishes its record this often (its
        records then live ``record_ttl / heartbeat_period`` times as long); estimates are extrapolated in between.
        The DHT bytes a peer spends on tracking are inversely proportional to it. Keep it well below an epoch's
        duration: a record many epochs old cannot tell when its owner stopped at its share, and rounds then hold
        from a fraction to several times the target batch.
    """

    heartbeat_period: float = 1.0
    record_ttl: float = 6.0
    refresh_period: float = 1.0
    max_extrapolation: float = 2.0
    shares: str = "speed"
    trust: TrustConfig = TrustConfig()
    exact_up_to: int = 16
    shard_size: int = 8
    sample_horizon: float = 30.0
    sampled_period: float = 3.0
    forget_after: float = 60.0

    def __post_init__(self) -> None:
        _positive_float("forget_after", self.forget_after)
        _positive_float("heartbeat_period", self.heartbeat_period)
        _positive_float("record_ttl", self.record_ttl)
        _positive_float("refresh_period", self.refresh_period)
        _positive_int("exact_up_to", self.exact_up_to)
        _positive_int("shard_size", self.shard_size)
        _positive_float("sample_horizon", self.sample_horizon)
        _positive_float("sampled_period", self.sampled_period)
        extrapolation = self.max_extrapolation
        if isinstance(extrapolation, bool) or not isinstance(extrapolation, (int, float)) \
                or not 0 <= extrapolation < math.inf:
            raise ConfigError(f"max_extrapolation must be a finite number of seconds >= 0, got {extrapolation!r}")
        if self.record_ttl <= 2 * self.heartbeat_period:
            raise ConfigError(
                f"record_ttl ({self.record_ttl}) must exceed twice heartbeat_period ({self.heartbeat_period}), "
                f"or live peers will flicker out of the swarm between heartbeats"
            )
        if self.shares not in SHARES:
            raise ConfigError(f"shares must be one of {', '.join(map(repr, SHARES))}, got {self.shares!r}: 'speed' "
                              f"splits the global batch by compute speed, 'equal' gives every peer the same steps")
        if not isinstance(self.trust, TrustConfig):
            raise ConfigTypeError(f"trust must be swarm_opt.TrustConfig(...), got {self.trust!r}")


@dataclass(frozen=True)
class SwarmConfig:
    """What identifies a run and how big its global batch is.

    :param run_id: peers with the same run_id train together; letters, digits, '_' and '-' only.
    :param target_batch_size: the swarm steps once every peer's samples add up to this many (the global batch).
    :param batch_size_per_step: samples per local step() unless step(batch_size=...) says otherwise.
    """

    run_id: str
    target_batch_size: int
    batch_size_per_step: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _RUN_ID.match(self.run_id):
            raise ConfigError(
                f"run_id must be 1-128 characters of letters, digits, '_' or '-', got {self.run_id!r}; "
                f"e.g. run_id='mnist_run42'"
            )
        _positive_int("target_batch_size", self.target_batch_size)
        _positive_int("batch_size_per_step", self.batch_size_per_step, allow_none=True)


@dataclass(frozen=True)
class Groups:
    """Moshpit group averaging (Ryabinin et al., 2021): rounds average in groups of at most ``size`` peers over a
    grid of the live peers, along one dimension per round, instead of in one group of the whole swarm
    (``swarm_opt.groups``). A swarm of at most ``size`` peers is one group, as without ``Groups``.

    :param size: the most peers in one averaging group, e.g. 16. Each round then costs a peer O(size) streams
        whatever the swarm's size; a complete grid gives the swarm's exact mean after log_size(N) rounds.
    """

    size: int = 16

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            raise ConfigTypeError(f"Groups(size=...) must be an int, got {self.size!r}; e.g. Groups(size=16)")
        if self.size < 2:
            raise ConfigError(f"Groups(size={self.size}) cannot average anything: pass size >= 2, e.g. "
                              f"Groups(size=16), or groups=None for one group of the whole swarm")
