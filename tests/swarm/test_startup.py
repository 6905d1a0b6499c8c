"""Peers that start together: one version of every epoch from the first round on, whatever the machine's load."""

from __future__ import annotations

import pytest

from tests.swarm.test_grad_averaging import assert_one_process

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


@pytest.mark.parametrize("inner", ["sgd", pytest.param("adam", marks=pytest.mark.extended)])
def test_peers_started_together_without_waiting_for_each_other_equal_one_process(swarm, inner):
    """Three peers of unequal batch sizes start at once and train at once, as users start them (no wait until each
    saw the others), on short epochs: none commits an epoch alone while the others commit it together."""
    epochs = 4
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=120, inner=inner, epochs=epochs,
                    step_sleep=0.03)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs, swarm.round_events()
    assert_one_process(results, inner, epochs)


def test_peers_started_together_behind_slow_dht_reads_keep_one_version_of_every_epoch(swarm):
    """Every read of the swarm's records comes back 1.5 s late (a loaded machine, or slow links), so each peer sees
    the others seconds after they started: still no epoch is committed in two versions."""
    epochs = 4
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=120, inner="sgd", epochs=epochs,
                    step_sleep=0.03, slow_reads=1.5)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs, swarm.round_events()
    assert_one_process(results, "sgd", epochs)
