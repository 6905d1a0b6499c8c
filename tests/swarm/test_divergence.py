"""A swarm never silently trains several models: peers that must hold the same parameters (gradient averaging)
compare digests every round, and a member outside its group's majority downloads the majority's state; a peer of
local updates that keeps missing rounds downloads the swarm's state."""

from __future__ import annotations

import re

import pytest
import torch

from swarm_opt.strategies.local_updates import MAX_ROUNDS_ON_LOCAL_STATE
from tests.swarm.peer import make_model
from tests.swarm.test_grad_averaging import assert_quiet

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

_COMMON = dict(batch_size=16, target_batch_size=240, inner="sgd", expect_peers=3, step_sleep=0.03)


def _assert_one_model(results: list) -> None:
    for r in results[1:]:
        for got, want in zip(r["params"], results[0]["params"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_founders_seeded_differently_end_with_one_model(swarm):
    epochs = 4
    for rank in range(3):
        swarm.start(rank, epochs=epochs, model_seed=10 + rank, **_COMMON)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    inits = [list(make_model(seed=10 + rank).parameters()) for rank in range(3)]
    assert not torch.allclose(inits[0][0], inits[1][0])  # the test means something only if they started apart
    for r in results:
        assert r["epoch"] == epochs
        assert_quiet(swarm.log(r["rank"]))  # founders seeded differently is a normal start: no warning
    _assert_one_model(results)
    downloads = sum("downloading theirs" in swarm.log(rank) for rank in range(3))
    assert downloads >= 1, swarm.round_events()


def test_a_perturbed_peer_is_resynced_within_one_round(swarm):
    epochs, perturbed_at = 6, 2
    for rank in range(3):
        swarm.start(rank, epochs=epochs, perturb_at_epoch=perturbed_at if rank == 1 else None, **_COMMON)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs
    _assert_one_model(results)
    log = swarm.log(1)
    assert log.count("differed from those of its group's majority") == 1, swarm.round_events()
    # the first round after the perturbation (for epoch 3) showed it: with all three in it, the perturbed peer is
    # the minority; that round commits on no member (its mean would mix gradients computed at other parameters), and
    # the perturbed peer downloads the others' state before it commits any epoch past the perturbation
    reports = results[1]["reports"]
    after = [rep for rep in reports if rep["epoch"] >= perturbed_at][1:]  # the report of epoch 2's own round first
    assert after[0]["caught_up"] and after[0]["epoch"] >= perturbed_at, reports


def test_a_peer_of_local_updates_that_keeps_missing_rounds_downloads_instead_of_drifting(swarm):
    """Peers of local updates hold different parameters between rounds, so no digest can flag one that drifts. One
    that misses a round goes on from its own model (its steps are averaged back in next round), but one that misses
    every round (always a little late for its group, as a peer starved of CPU) must not train on alone for the rest
    of the run: after ``MAX_ROUNDS_ON_LOCAL_STATE`` missed rounds it downloads the swarm's state. Nothing trains
    (lr 0, peer i starts at i): peers 0 and 1 average to 0.5, and peer 2 (never in a group) ends there too."""
    epochs = 6  # a download at epoch 4, then two rounds on its own again
    for rank in range(3):
        swarm.start(rank, task="lsq", strategy="local", init_by_rank=True, lsq_lr=0.0, expect_peers=3, batch_size=16,
                    target_batch_size=3 * 16 * 5, epochs=epochs, step_sleep=0.02, averaging_timeout=10.0,
                    never_averages=rank == 2)
    swarm.wait(timeout=200)
    results = [swarm.result(rank) for rank in range(3)]
    assert all(rnd["caught_up"] for rnd in results[2]["rounds"]), results[2]["rounds"]  # it never averaged
    synced, downloads = 0, 0
    for line in swarm.log(2).splitlines():  # its epochs on its own model never run more than the bound ahead
        if (skip := re.search(r"The swarm is at epoch (\d+); continuing from the local model", line)) is not None:
            assert int(skip.group(1)) - synced <= MAX_ROUNDS_ON_LOCAL_STATE, swarm.log(2)
        elif (load := re.search(r"Loaded the swarm's state at epoch (\d+)", line)) is not None:
            synced, downloads = int(load.group(1)), downloads + 1
    assert downloads >= 1, swarm.log(2)
    torch.testing.assert_close(results[0]["w"], torch.full_like(results[0]["w"], 0.5))
    for r in results[1:]:
        torch.testing.assert_close(r["w"], results[0]["w"])
    assert_quiet(swarm.log(2))
