"""Switch off hivemind's value caching in a DHT node that swarm_opt reads.

swarm_opt's tracker and hivemind's averager read every key with ``latest=True``: a search that visits the key's
nodes whatever the local cache holds, so a cached value never spares a search. The cache then only adds traffic:
each read that found a value is read again in the background shortly before the value expires
(``cache_refresh_before_expiry``), each store to a key read before triggers a read at once (``cache_on_store``),
and each read pushes the value it found to one more node (``cache_nearest``). Matchmaking keys live a few seconds,
so these extra searches ran about as often as the reads themselves, each visiting every node of a small swarm.

The node's attributes are read at each operation, so the switch applies to a running DHT, the user's included;
its only other effect is on ``latest=False`` reads (e.g. hivemind's mixture-of-experts lookups), which then always
search.
"""

from __future__ import annotations

from typing import Any

from hivemind.dht import DHT


async def _switch_off(dht: DHT, node: Any) -> None:
    node.cache_locally, node.cache_nearest, node.cache_on_store = False, 0, False
    node.cache_refresh_before_expiry = 0
    node.protocol.cache.clear()
    node.cache_refresh_queue.clear()


def read_latest_only(dht: DHT) -> None:
    """Switch off value caching in ``dht``'s node (its process), for the reasons above. Idempotent."""
    dht.run_coroutine(_switch_off)
