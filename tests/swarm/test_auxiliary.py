"""Auxiliary peers in real loopback swarms: a helper reduces shares of the trainers' rounds and changes nothing
they compute (hivemind's helpers have sent zero-weight tensors like trainers since its PR #432)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.swarm.test_grad_averaging import _close, assert_quiet, possible_references

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def test_a_helper_reduces_shares_of_the_rounds_and_the_trainers_still_equal_one_process(swarm):
    epochs = 5
    for rank, batch_size in enumerate([8, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=224, inner="sgd", epochs=epochs, expect_peers=2,
                    step_sleep=0.03)
    swarm.start(2, auxiliary=True, epochs=epochs, inner="sgd", target_batch_size=224, batch_size=8)
    swarm.wait(timeout=200)
    trainers = [swarm.result(r) for r in range(2)]
    helper = swarm.result(2)
    for r in trainers:
        assert r["epoch"] == epochs
        rounds = [rep for rep in r["reports"] if not rep["caught_up"]]
        assert all(rep["group_size"] <= 2 and rep["num_peers"] == 2 for rep in rounds), rounds  # helpers not counted
        assert sum(rep["helpers"] == 1 for rep in rounds) >= epochs // 2, rounds
        assert_quiet(swarm.log(r["rank"]))
    assert helper["rounds_helped"] >= epochs // 2
    assert helper["values_reduced"] > 0  # its share: whole tensors of this small model, so it varies by round
    assert "Helped round" in swarm.log(2)
    assert_quiet(swarm.log(2))
    assert all(torch.equal(a, b) for a, b in zip(trainers[0]["params"], trainers[1]["params"]))  # identical means
    assert any(_close(trainers[0]["params"], expected) for expected in possible_references(trainers, "sgd", epochs))


@pytest.mark.extended
def test_a_helper_given_epochs_leaves_once_the_trainers_are_gone(swarm):
    """A helper asked to help up to epoch 8 of a run whose trainers stop at 4: they withdraw their records as they
    leave, so it never sees epoch 8 (nor, had it missed the last rounds, 4); it leaves once no trainer has been seen
    for ``averaging_timeout``, where it waited forever. Started first, so that it sees the trainers however fast
    their rounds (it may still miss them: a helper reads the run's progress about once a second)."""
    swarm.start(0, auxiliary=True, epochs=8, averaging_timeout=4.0, inner="sgd", target_batch_size=64, batch_size=8)
    for rank in (1, 2):
        swarm.start(rank, batch_size=16, target_batch_size=64, inner="sgd", epochs=4, expect_peers=2, step_sleep=0.1,
                    linger=1.0)
    swarm.wait(timeout=120)
    assert [swarm.result(rank)["epoch"] for rank in (1, 2)] == [4, 4]
    assert re.search(r"No trainer seen for 4 s since epoch \d \(of 8\)", swarm.log(0)), swarm.log(0)
    assert_quiet(swarm.log(0))


def test_helpers_refuse_setups_they_cannot_serve():
    import hivemind
    import torch

    import swarm_opt

    params = [torch.zeros(4, 4)]
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        client = hivemind.DHT(initial_peers=dht.get_visible_maddrs(), client_mode=True, start=True)
        try:
            with pytest.raises(swarm_opt.ConfigError, match="accept connections"):
                swarm_opt.AuxiliaryPeer(dht=client, run_id="r", params=params)
        finally:
            client.shutdown()
        with pytest.raises(swarm_opt.ConfigError, match="protocol of its own"):
            swarm_opt.AuxiliaryPeer(dht=dht, run_id="r", params=params, compression=swarm_opt.PowerSGD(rank=1))
        with pytest.raises(swarm_opt.ConfigError, match="params is empty"):
            swarm_opt.AuxiliaryPeer(dht=dht, run_id="r", params=[])
    finally:
        dht.shutdown()
