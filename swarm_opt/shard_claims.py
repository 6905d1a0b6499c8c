"""Which shard of a streaming source each peer reads, agreed through the DHT without a coordinator.

A peer reads the claims under ``{run_id}_shards`` (subkey: peer id, value: shard index), claims the least-claimed
shard and keeps its claim alive (a ``Beacon``: refreshed every ``CLAIM_PERIOD`` s, expiring ``CLAIM_TTL`` s after
the last refresh, withdrawn when the peer leaves). Two peers that picked the same shard at once see each other when
they read the claims back: the one with the larger peer id moves on. So no two live peers read the same shard while
another lies unread, and a dead peer's shard is free again within ``CLAIM_TTL``. Claims are hints between honest
peers: a peer that lies about its claims can only make others share shards (as a hash of peer ids would), never keep
data from them."""

from __future__ import annotations

import logging
import random
import time
from typing import Any, Dict, List, Tuple

from hivemind.utils import ValueWithExpiration

from swarm_opt._hivemind.beacon import Beacon
from swarm_opt.recipe import DataShard

logger = logging.getLogger(__name__)

CLAIM_TTL, CLAIM_PERIOD = 45.0, 15.0
_MAX_CLAIMS = 10_000  # records read at most (a flood of fake claims costs a reader no more)


def claims_key(run_id: str) -> str:
    return f"{run_id}_shards"


def read_claims(dht: Any, run_id: str, count: int, *, own: str) -> Dict[str, int]:
    """The live claims of other peers: peer id -> shard index, malformed or out-of-range records left out."""
    found = dht.get(claims_key(run_id), latest=True)
    entries = found.value if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict) else {}
    claims: Dict[str, int] = {}
    for subkey, entry in list(entries.items())[:_MAX_CLAIMS]:
        value = getattr(entry, "value", None)
        if isinstance(subkey, str) and len(subkey) <= 128 and subkey != own and type(value) is int \
                and 0 <= value < count:
            claims[subkey] = value
    return claims


def _least_loaded(claims: Dict[str, int], count: int) -> Tuple[List[int], List[int]]:
    load = [0] * count
    for index in claims.values():
        load[index] += 1
    least = min(load)
    return load, [i for i in range(count) if load[i] == least]


def claim_shard(dht: Any, run_id: str, count: int, *, seed: int, rounds: int = 12,
                settle: float = 0.3) -> Tuple[DataShard, Beacon]:
    """Claim a shard of ``count`` for this peer (``dht``'s peer id) and keep the claim alive until the returned
    beacon's ``stop()``. Reads the claims back after every pick (``settle`` s later, ``rounds`` picks at most) and
    moves while a peer with a smaller id holds the same shard and a less-claimed one exists: the claim returned is
    one that a read confirmed, unless ``rounds`` picks in a row collided."""
    own = str(dht.peer_id)
    rng = random.Random(own)  # ties drawn per peer: peers starting together rarely pick alike
    beacon = Beacon(dht, claims_key(run_id), own, None, period=CLAIM_PERIOD, ttl=CLAIM_TTL, name="ShardClaim")
    index = -1
    for picks in range(rounds + 1):
        claims = read_claims(dht, run_id, count, own=own)
        load, least = _least_loaded(claims, count)
        if index >= 0:
            rivals = [peer for peer, claimed in claims.items() if claimed == index]
            if not rivals or load[index] <= load[least[0]] or own < min(rivals):
                break
            if picks == rounds:
                logger.debug("Data shard %s/%s is still claimed by %s after %s picks: keeping it", index, count,
                             min(rivals), rounds)
                break
            logger.debug("Data shard %s/%s is claimed by %s too: moving on", index, count, min(rivals))
        index = rng.choice(least)
        beacon.publish(index)
        time.sleep(settle)
    return DataShard(index, count, seed), beacon.start()
