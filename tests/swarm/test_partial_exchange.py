"""Partial exchange (``exchange=KeepLocal(...)``, FedPer) in a real loopback swarm: the personal head never leaves a
peer, checked on the wire (what each peer writes into its averager's buffers, all that its averager sends) and in
the state it serves to downloading peers; the shared layers end each round as the mean of what their members sent."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

PEERS = 3


def test_a_personal_head_stays_on_its_peer_and_shared_layers_are_the_mean_of_what_was_sent(swarm):
    for rank in range(PEERS):
        swarm.start(rank, strategy="local_keep_head", inner="sgd", batch_size=16, target_batch_size=PEERS * 16 * 4,
                    epochs=4, expect_peers=PEERS, record_sent=True, matchmaking_time=1.0, averaging_timeout=15.0)
    swarm.wait(timeout=180)
    results = [swarm.result(rank) for rank in range(PEERS)]
    shared_shapes = [(32, 16), (32,)]  # the MLP's first layer; its head (2.weight: 4x32, 2.bias: 4) stays local
    for r in results:
        assert r["epoch"] == 4, swarm.round_events()
        assert r["sent"], "the peer never averaged"
        for _, buffers in r["sent"].values():
            assert [tuple(b.shape) for b in buffers] == shared_shapes
        # the state it serves: zeros in the head's place, and no optimizer state (momentum) of the head
        served = r["served"]["params"]
        assert served[2].abs().max() == 0 and served[3].abs().max() == 0
        torch.testing.assert_close(served[0], r["params"][0])
        assert r["served"]["optimizer_keys"] == [0, 1] and r["served"]["own_optimizer_keys"] == [0, 1, 2, 3]
    checked = 0
    for epoch in range(1, 5):
        members = [r for r in results
                   if any(rep["epoch"] == epoch and not rep["caught_up"] for rep in r["reports"])]
        sizes = {rep["group_size"] for r in members for rep in r["reports"] if rep["epoch"] == epoch}
        if not members or sizes != {len(members)}:
            continue  # a member's report is missing (it failed its side of the round): nothing to compare
        total = sum(r["sent"][epoch][0] for r in members)
        for layer in range(2):
            mean = sum(r["sent"][epoch][0] * r["sent"][epoch][1][layer] for r in members) / total
            for r in members:
                torch.testing.assert_close(r["after"][epoch][layer], mean, atol=1e-5, rtol=0)  # fp32 reducers
        heads = [r["after"][epoch][2] for r in members]
        assert all((h - heads[0]).abs().max() > 1e-4 for h in heads[1:]), "the personal heads were averaged"
        checked += 1
    assert checked >= 2, swarm.round_events()
