"""Storing a record on the DHT nodes nearest to its key without a search that downloads the key's value each time.

hivemind's ``DHTNode.store`` first searches for the key's nearest nodes, and every node the search visits answers
with the key's **whole value**: writing one ~1 KB record to a key that holds 16 records moves ~100 KB. A peer that
re-publishes its progress record every few seconds writes the same key to the same few nodes each time, so
``store_near`` remembers them per key: it finds them by searching for a *neighbouring* id (the key's id with its
lowest bit flipped: the same nearest nodes in the same order, but no node holds a value there, so each answers with
routing only), then sends one small store RPC to each. It searches again after ``refresh`` seconds (nodes join and
leave), or at once when fewer than half of the remembered nodes answer; when none answers it falls back to
hivemind's own store (a node that answers and rejects the record would reject it through any store). The record is
signed by the node's validators exactly as ``DHTNode.store`` signs it, and each receiving node validates it as it
validates any store: nothing about what the DHT accepts changes.

Used for every record swarm_opt writes repeatedly: progress records (every level) and every write of the averager
process (matchmaking and state-sharing declarations, ``averager._write_near``). A read that must see every record
still searches with hivemind's full beam, and finds a record on whichever of the key's nodes holds it.

Runs inside the DHT process: ``dht.run_coroutine(functools.partial(store_near, key=..., ...))``. It never raises
(hivemind logs a traceback for a coroutine that does): a failure returns False, as a failed ``DHT.store`` does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import weakref
from typing import Any, Dict, MutableMapping, Optional, Tuple

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

WRITE_BEAM = 5  # the beam of the value-less search for a key's nearest nodes
REFRESH = 30.0  # seconds a key's nearest nodes are remembered
_REMEMBERED_KEYS = 256  # per node, before keys not refreshed for REFRESH seconds are forgotten

# per DHT node (several in one process in benchmarks): key id -> (when found, nearest nodes nearest-first)
_NEAREST: MutableMapping[DHTNode, Dict[DHTID, Tuple[float, Dict[DHTID, PeerID]]]] = weakref.WeakKeyDictionary()


def neighbour_id(key_id: DHTID) -> DHTID:
    """An id whose nearest nodes are the key's (XOR distances to both differ in the lowest bit only) and under which
    no node stores anything: a search for it costs routing, not the key's value."""
    return DHTID(int(key_id) ^ 1)


async def nearest_nodes(node: DHTNode, key_id: DHTID, *, beam_size: int, refresh: float,
                        now: float) -> Dict[DHTID, PeerID]:
    """The key's ``node.num_replicas`` nearest nodes (this one included if it is among them), remembered for
    ``refresh`` seconds."""
    known = _NEAREST.setdefault(node, {})
    found = known.get(key_id)
    if found is not None and now - found[0] < refresh:
        return found[1]
    if len(known) >= _REMEMBERED_KEYS:  # matchmaking keys change with the grid's lines: keep the live ones only
        for stale in [k for k, (when, _) in known.items() if now - when >= refresh]:
            del known[stale]
    probe = neighbour_id(key_id)
    result = await node.find_nearest_nodes([probe], k_nearest=node.num_replicas, beam_size=beam_size)
    nodes = result.get(probe, {})
    known[key_id] = (now, nodes)
    return nodes


def forget(node: DHTNode, key: Any) -> None:
    """Search for the key's nearest nodes again at its next store."""
    _NEAREST.get(node, {}).pop(DHTID.generate(source=key), None)


async def store_near(_dht: object, node: DHTNode, *, key: Any, subkey: Any, value: Any, expiration_time: float,
                     beam_size: int = WRITE_BEAM, refresh: float = REFRESH) -> bool:
    """Store ``value`` under ``key``/``subkey`` on the key's remembered nearest nodes; True if at least one of them
    (or hivemind's fallback store) accepted it. Signature and arguments as ``DHT.run_coroutine`` passes them."""
    try:
        return await _store_near(node, key, subkey, value, expiration_time, beam_size, refresh)
    except Exception as e:  # noqa: BLE001 (a failed store is reported as False, like DHT.store)
        logger.debug("Direct store of %r failed: %r", key, e)
        return False


async def _store_near(node: DHTNode, key: Any, subkey: Any, value: Any, expiration_time: float, beam_size: int,
                      refresh: float) -> bool:
    if expiration_time <= get_dht_time():  # every node would reject it (hivemind withdraws expired declarations)
        return False
    key_id = DHTID.generate(source=key)
    nodes = await nearest_nodes(node, key_id, beam_size=beam_size, refresh=refresh, now=get_dht_time())
    protocol = node.protocol
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                       expiration_time)
    if protocol.record_validator is not None:  # signed as DHTNode.store_many signs it
        record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))

    async def one(node_id: DHTID, peer_id: PeerID) -> Optional[bool]:
        if node_id == node.node_id:  # validated and stored locally, as DHTNode.store_many does for itself
            if protocol.record_validator is not None and not protocol.record_validator.validate(record):
                return False
            return bool(protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey))
        answer = await protocol.call_store(peer_id, keys=[key_id], values=[record.value],
                                           expiration_time=[expiration_time], subkeys=[subkey])
        return None if answer is None else bool(answer[0])

    answers = [answer for answer in await asyncio.gather(*(one(node_id, peer_id) for node_id, peer_id in nodes.items()))
               if answer is not None]
    if key_id in protocol.cache:  # as DHTNode.store_many: a cached copy of the key must not hide our new record
        protocol.cache.store_subkey(key_id, subkey, record.value, expiration_time)
    if len(answers) < math.ceil(len(nodes) / 2) or not nodes:
        _NEAREST.get(node, {}).pop(key_id, None)  # search again next time
    if not answers:
        return bool(await node.store(key, value, expiration_time, subkey=subkey, beam_size=beam_size))
    return any(answers)  # a node that answered False rejected the record (expired, older, invalid): so would others
