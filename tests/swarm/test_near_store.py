"""Direct stores of sharded progress records (``swarm_opt._hivemind.near_store``) on real hivemind DHTs, each in its
own process: a record stored straight to a shard's nearest nodes is read back by another peer, a second store
reuses the nodes found by the first, and the DHT still rejects what it rejected before (a record signed for another
peer's key, a record outside the schema)."""

from __future__ import annotations

import functools

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm_opt._hivemind.near_store import _NEAREST, store_near
from swarm_opt.progress import _ShardedSchemaValidator, parse_records, progress_validators
from swarm_opt.sharding import owner_hash, shard_key, shard_of

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

RUN = "near_store"
LEVEL = 2
LIAR_KEY = RSAPrivateKey()


@pytest.fixture(scope="module")
def dhts():
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    peers = [first] + [hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    start=True) for _ in range(3)]
    for dht in peers[:3]:
        dht.add_validators(progress_validators(RUN))
    # the last peer signs with a key of its own (one signer per process: the others share the test's key)
    peers[3].add_validators([_ShardedSchemaValidator(RUN), RSASignatureValidator(LIAR_KEY)])
    yield peers
    for dht in peers:
        dht.shutdown()


def record(epoch: int, instance: str) -> dict:
    return {"peer_id": b"p" * 38, "instance": instance, "epoch": epoch, "samples": 40,
            "samples_per_second": 10.0, "time": get_dht_time(), "client_mode": False, "model_schema": "m",
            "target_batch_size": 1000, "params_digest": None}


def store(dht: hivemind.DHT, subkey: bytes, value: dict) -> bool:
    key = shard_key(RUN, shard_of(owner_hash(subkey), LEVEL))
    return dht.run_coroutine(functools.partial(store_near, key=key, subkey=subkey, value=value,
                                               expiration_time=get_dht_time() + 30, beam_size=5))


def read(dht: hivemind.DHT, subkey: bytes) -> list:
    """The epochs of the records under ``subkey``'s shard whose instance is the subkey's suffix."""
    shard = shard_of(owner_hash(subkey), LEVEL)
    raw = dht.get(shard_key(RUN, shard), latest=True)
    records = parse_records(raw, model_schema="m", now=get_dht_time(), shard=shard)[0]
    return [r.epoch for r in records if r.instance == subkey.rsplit(b"/", 1)[1].decode()]


async def _found_at(_dht, node, *, key: str):
    entry = _NEAREST.get(node, {}).get(DHTID.generate(source=key))
    return None if entry is None else (entry[0], len(entry[1]))


def test_direct_store_is_read_back_and_reuses_the_nodes_it_found(dhts):
    subkey = RSASignatureValidator().local_public_key + b"/writer"
    key = shard_key(RUN, shard_of(owner_hash(subkey), LEVEL))
    assert store(dhts[0], subkey, record(3, "writer"))
    found = dhts[0].run_coroutine(functools.partial(_found_at, key=key))
    assert found is not None and found[1] >= 2  # the nodes were found (this one and others)
    assert read(dhts[1], subkey) == [3]

    assert store(dhts[0], subkey, record(4, "writer"))  # no new search: the same nodes, found at the same time
    assert dhts[0].run_coroutine(functools.partial(_found_at, key=key)) == found
    assert read(dhts[2], subkey) == [4]


def test_direct_store_is_validated_as_any_store(dhts):
    honest = RSASignatureValidator().local_public_key + b"/victim"
    assert store(dhts[0], honest, record(5, "victim"))
    # a peer with another key cannot write the victim's record (its signature does not match the subkey's key) ...
    assert not store(dhts[3], honest, record(99, "victim"))
    # ... nor a record outside the schema under its own key
    own = RSASignatureValidator(LIAR_KEY).local_public_key + b"/liar"
    assert not store(dhts[3], own, record(-1, "liar"))
    assert read(dhts[1], honest) == [5]
