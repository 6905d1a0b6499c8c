"""Peers agree on who reads which shard of a streaming source through the DHT (``swarm_opt.shard_claims``), on real
hivemind DHTs: peers that claim at the same moment end on different shards, more peers than shards spread evenly,
a departed peer's shard is free for the next one, and malformed claims are ignored."""

from __future__ import annotations

import collections
import threading

import hivemind
import pytest
from hivemind.utils import get_dht_time

from swarm_opt.shard_claims import claim_shard, claims_key, read_claims

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


@pytest.fixture
def dhts():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    initial_peers=first.get_visible_maddrs()) for _ in range(5)]
    yield nodes
    for node in reversed(nodes):
        node.shutdown()


def _claim_together(nodes, run_id, count):
    """Every node claims at the same moment (threads released by one barrier)."""
    barrier, results = threading.Barrier(len(nodes)), [None] * len(nodes)

    def claim(i):
        barrier.wait()
        results[i] = claim_shard(nodes[i], run_id, count, seed=7)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(result is not None for result in results), "a claim did not finish"
    return results


def test_peers_that_claim_together_read_different_shards_and_more_peers_spread_evenly(dhts):
    # 4 peers, 4 shards: a hash of peer ids would give two of them one shard 91 % of the time
    claims = _claim_together(dhts[:4], "claims_run", 4)
    try:
        assert sorted(shard.index for shard, _ in claims) == [0, 1, 2, 3]
        assert all(shard.count == 4 and shard.seed == 7 for shard, _ in claims)
    finally:
        for _, beacon in claims:
            beacon.stop()

    claims = _claim_together(dhts, "crowded_run", 4)  # 6 peers, 4 shards: two shards read twice, none thrice
    try:
        load = collections.Counter(shard.index for shard, _ in claims)
        assert sorted(load.values()) == [1, 1, 2, 2], load
    finally:
        for _, beacon in claims:
            beacon.stop()


def test_a_departed_peers_shard_is_free_and_malformed_claims_are_ignored(dhts):
    first, second, newcomer = dhts[:3]
    (a, a_claim), (b, b_claim) = claim_shard(first, "leave_run", 3, seed=0), claim_shard(second, "leave_run", 3, seed=0)
    assert a.index != b.index
    # hostile records under the claims key: a string, an index out of range, a negative one, a bool
    for subkey, value in [("x", "1"), ("y", 9), ("z", -1), ("w", True)]:
        assert first.store(claims_key("leave_run"), value, get_dht_time() + 30, subkey=subkey)
    assert read_claims(newcomer, "leave_run", 3, own=str(newcomer.peer_id)) == {
        str(first.peer_id): a.index, str(second.peer_id): b.index}

    b_claim.stop()  # leaves cleanly: its claim is withdrawn at once
    c, c_claim = claim_shard(newcomer, "leave_run", 3, seed=0)
    try:
        assert c.index != a.index and read_claims(first, "leave_run", 3, own="") == {
            str(first.peer_id): a.index, str(newcomer.peer_id): c.index}
    finally:
        a_claim.stop()
        c_claim.stop()
