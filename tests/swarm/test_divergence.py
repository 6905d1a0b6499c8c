"""Peers that must hold the same parameters (gradient averaging) compare digests every round: a member outside its
group's majority downloads the majority's state, so a swarm never silently trains several models."""

from __future__ import annotations

import pytest
import torch

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
    # the first round after the perturbation (epoch 3) showed it; with all three in it, the perturbed peer is the
    # minority and downloads at once
    reports = results[1]["reports"]
    first = next(i for i, rep in enumerate(reports) if rep["epoch"] == perturbed_at + 1)
    if not reports[first]["caught_up"] and reports[first]["group_size"] == 3:
        assert reports[first + 1]["caught_up"] and reports[first + 1]["epoch"] >= perturbed_at + 1, reports
