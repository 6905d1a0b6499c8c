"""``Overlap()``: rounds average in the background while the peers compute on.

Gradient averaging, the exact claim: every epoch's update is the sample-weighted mean of the gradients of the batches
the swarm committed to it, each gradient taken at the parameters it was computed at (the epoch before, or, for a
batch computed while the previous round was still in flight, the epoch before that: never older). DiLoCo: the inner
steps go on while a round averages, and every peer still holds the same ``x`` after every round (its maths against
DiLoCo without overlap: ``tests/unit/test_diloco_overlap.py``).
"""

from __future__ import annotations

import copy
import itertools
import math
import time

import pytest
import torch

from tests.swarm.peer import make_data, make_inner, make_model
from tests.swarm.test_grad_averaging import _close, assert_quiet

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def delayed_reference(results: list, epochs: int, extra=()) -> list:
    """One process applying SGD, each epoch, to the mean gradient of the committed batches (plus ``extra`` (epoch,
    batches, versions) triples), every batch's gradient taken at the parameters of its version."""
    x, y = make_data()
    model = make_model()
    opt = make_inner("sgd")(model.parameters())
    trajectory = {0: copy.deepcopy(model)}
    for epoch in range(1, epochs + 1):
        batches = [(b, v) for r in results for b, v in zip(r["committed"].get(epoch, []), r["versions"].get(epoch, []))]
        batches += [(b, v) for e, bs, vs in extra if e == epoch for b, v in zip(bs, vs)]
        assert batches, f"no peer committed batches to epoch {epoch}"
        assert all(epoch - 2 <= v <= epoch - 1 for _, v in batches), f"a batch more than one update stale: {epoch}"
        total = sum(len(b) for b, _ in batches)
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for batch, version in batches:
            at = trajectory[version]
            at.zero_grad()
            idx = torch.tensor(batch)
            (torch.nn.functional.cross_entropy(at(x[idx]), y[idx]) * len(batch) / total).backward()
            for g, p in zip(grads, at.parameters()):
                g.add_(p.grad)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        trajectory[epoch] = copy.deepcopy(model)
    return [p.detach() for p in model.parameters()]


def run_three(swarm, epochs: int, **config) -> list:
    """Three peers of unequal batches, every one reaching ``epochs`` with most rounds of all three, quietly. Epochs
    of ~1 s (6 steps of each peer, 0.15 s apart): in epochs of 0.2 s a peer slowed by a loaded machine missed every
    round and downloaded each epoch (one model all along, but no round of three)."""
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=240, epochs=epochs, expect_peers=3,
                    step_sleep=0.15, **config)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs
        assert sum(rep["group_size"] == 3 for rep in r["reports"]) >= epochs // 2, r["reports"]
        assert_quiet(swarm.log(r["rank"]))
    return results


def test_overlapped_rounds_apply_each_epochs_gradients_at_the_parameters_they_were_computed_at(swarm):
    epochs = 6
    results = run_three(swarm, epochs, strategy="grad_overlap", inner="sgd")
    stale = sum(v == e - 2 for r in results for e, vs in r["versions"].items() for v in vs)
    assert stale > 0, "no gradient was computed while a round was in flight: nothing overlapped"
    for r in results[1:]:
        assert _close(r["params"], results[0]["params"], 1e-6)  # one model in the swarm
    # a peer that caught up by downloading may or may not have had a prefix of its discarded batches averaged in
    ambiguous = [(e, r["discarded"][e], r["discarded_versions"][e]) for r in results for e in r["discarded"]]
    assert math.prod(len(b) + 1 for _, b, _ in ambiguous) <= 2_000, ambiguous
    references = [delayed_reference(results, epochs, [(e, b[:k], v[:k]) for (e, b, v), k in zip(ambiguous, prefix)])
                  for prefix in itertools.product(*(range(len(b) + 1) for _, b, _ in ambiguous))]
    assert any(_close(results[0]["params"], expected) for expected in references), \
        [max((a - b).abs().max().item() for a, b in zip(results[0]["params"], e)) for e in references]
    # and the staleness mattered: applying every epoch's gradients at the latest parameters gives another model
    fresh = copy.deepcopy(results)
    for r in fresh:
        r["versions"] = {e: [e - 1] * len(vs) for e, vs in r["versions"].items()}
    assert not _close(results[0]["params"], delayed_reference(fresh, epochs), 1e-5)


def test_diloco_peers_step_on_while_rounds_average_and_hold_one_x_after_every_round(swarm):
    epochs = 5
    results = run_three(swarm, epochs, strategy="diloco_overlap", inner="adam")
    for r in results:
        assert r["steps_in_flight"] > 0, "no inner step was made while a round averaged: nothing overlapped"
        # the steps made meanwhile are the next epoch's: published for this one, they would start the next round
        # short of the global batch (0.9x it in benchmarks/lm.py before)
        assert r["published_ahead"] == 0
        assert all(torch.isfinite(p).all() for p in r["params"])
    compared = 0
    for epoch in range(1, epochs + 1):
        held = [r["anchors"][epoch] for r in results if epoch in r["anchors"]]
        for anchor in held[1:]:
            assert all(torch.equal(a, b) for a, b in zip(anchor, held[0])), f"peers hold two x at epoch {epoch}"
        compared += len(held) - 1
    assert compared >= epochs, "too few rounds that several peers committed to compare their x"
    # a peer stands where x is, moved by the inner steps it made while the last round averaged (without overlap
    # it would stand at x)
    assert any(not _close(r["params"], r["anchors"][epochs], 1e-6) for r in results if epochs in r["anchors"])


@pytest.mark.parametrize("strategy", [pytest.param("grad", marks=pytest.mark.extended), "grad_overlap"])
def test_a_bug_inside_a_round_is_raised_from_step_whether_the_round_blocks_or_runs_in_the_background(swarm,
                                                                                                      strategy):
    """One round protocol for both: an unexpected error in a round's ``write`` gives the round back and surfaces
    from ``step()`` (a background round's at the next ``step()``), instead of being logged and retried forever."""
    swarm.start(0, batch_size=8, target_batch_size=64, inner="sgd", epochs=3, expect_peers=2, strategy=strategy)
    buggy = swarm.start(1, batch_size=8, target_batch_size=64, inner="sgd", epochs=3, expect_peers=2,
                        strategy=strategy, bug_in_write=True)
    deadline = time.monotonic() + 150  # start-up takes most of it on a loaded machine; the peer exits at its round
    while buggy.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    log = swarm.log(1)
    assert buggy.returncode not in (None, 0), log
    assert "RuntimeError: injected bug in write" in log and "in step" in log, log
    assert "keeping local progress" not in log and "failed unexpectedly" not in log, log
