"""Whether this peer's DHT node knows any other node: a node that knows none is alone in the world of its run."""

from __future__ import annotations

from hivemind.dht import DHT, DHTNode


async def _known_nodes(dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def knows_other_nodes(dht: DHT, timeout: float) -> bool:
    """Whether ``dht``'s routing table holds any other node (a bootstrap node, a peer that joined through us)."""
    return dht.run_coroutine(_known_nodes, return_future=True).result(timeout=timeout) > 0
