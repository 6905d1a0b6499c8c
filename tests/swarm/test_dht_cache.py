"""hivemind's value caching switched off (``swarm_opt._hivemind.dht_cache``) on real DHTs, each in its own process:
a default node caches what a ``latest=True`` read found and schedules a background re-read of it (the traffic the
switch removes); a switched node reads the same values and caches, schedules and pushes nothing, after reads or
stores."""

from __future__ import annotations

import functools

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from swarm_opt._hivemind.dht_cache import read_latest_only

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def dhts():
    # one replica per key: the readers below hold no copy of their own, which a node never caches
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], num_replicas=1, start=True)
    peers = [first] + [hivemind.DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    num_replicas=1, start=True) for _ in range(4)]
    yield peers
    for dht in peers:
        dht.shutdown()


async def _cache_state(dht: hivemind.DHT, node) -> tuple:
    return len(node.protocol.cache), len(node.cache_refresh_queue)


async def _holds(dht: hivemind.DHT, node, key: str) -> tuple:
    """Whether the node stores ``key`` (as one of its nearest nodes), and whether it caches it."""
    key_id = DHTID.generate(source=key)
    return node.protocol.storage.get(key_id) is not None, node.protocol.cache.get(key_id) is not None


def _readers(dhts: list, key: str) -> list:
    """The nodes that hold no copy of ``key`` (a read there searches, and may cache)."""
    return [dht for dht in dhts if not dht.run_coroutine(functools.partial(_holds, key=key))[0]]


def _write(dht: hivemind.DHT, key: str, subkey: str, value: int) -> None:
    assert dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + 20)


def test_a_default_node_caches_and_schedules_re_reads(dhts):
    writer = dhts[0]
    _write(writer, "cache_default", "a", 1)
    reader = _readers(dhts[1:3], "cache_default")[0]
    for _ in range(2):  # the second read finds the value in the cache too, which schedules its re-read
        found = reader.get("cache_default", latest=True)
        assert found is not None and found.value["a"].value == 1
    cached, scheduled = reader.run_coroutine(_cache_state)
    assert cached >= 1 and scheduled >= 1  # what read_latest_only removes; if hivemind stops it, drop the switch


def test_a_switched_node_reads_the_same_and_caches_nothing(dhts):
    writer = dhts[3]
    _write(writer, "cache_off", "a", 1)
    reader = _readers(dhts[:3] + dhts[4:], "cache_off")[-1]
    read_latest_only(reader)
    read_latest_only(reader)  # idempotent
    for _ in range(2):
        found = reader.get("cache_off", latest=True)
        assert found is not None and found.value["a"].value == 1
    _write(reader, "cache_off", "b", 2)  # a store to a key read before: a default node re-reads it at once
    _write(writer, "cache_off", "a", 3)
    found = reader.get("cache_off", latest=True)
    assert {k: v.value for k, v in found.value.items()} == {"a": 3, "b": 2}
    assert reader.run_coroutine(_cache_state) == (0, 0)
    # nor did its reads push the value into another node's cache (cache_nearest)
    assert not any(dht.run_coroutine(functools.partial(_holds, key="cache_off"))[1] for dht in dhts)
