"""A stranger that writes a validly signed progress record full of lies neither halts nor speeds up a run."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from swarm_opt import testing

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

LIAR = Path(__file__).with_name("liar.py")
TARGET = 64
BATCH = 8


def start_liar(swarm, **lie) -> subprocess.Popen:
    cfg = dict(initial_peers=swarm.initial_peers, run_id="test_run", out=str(swarm.tmp / "liar.started"), **lie)
    path = swarm.tmp / "liar.json"
    path.write_text(json.dumps(cfg))
    return testing.start([str(LIAR), str(path)], log=swarm.tmp / "liar.log")


def run_with_liar(swarm, epochs: int, **lie) -> list:
    """Three honest peers train ``epochs`` epochs while the liar lies; they start once its first record is stored."""
    for rank in range(3):
        (swarm.tmp / f"peer{rank}.pt.hold").touch()
        swarm.start(rank, inner="sgd", batch_size=BATCH, target_batch_size=TARGET, epochs=epochs, step_sleep=0.02,
                    expect_peers=3, hold_at_epoch=0, max_seconds=150)
    liar = start_liar(swarm, **lie)
    try:
        deadline = time.monotonic() + 60
        while not (swarm.tmp / "liar.started").exists():
            assert liar.poll() is None and time.monotonic() < deadline, (swarm.tmp / "liar.log").read_text()
            time.sleep(0.1)
        time.sleep(1.5)  # the honest peers' trackers read the lie
        for rank in range(3):
            (swarm.tmp / f"peer{rank}.pt.hold").unlink()
        swarm.wait(timeout=180)
    finally:
        testing.kill([liar])
    return [swarm.result(rank) for rank in range(3)]


def assert_identical_and_done(results: list, epochs: int, swarm) -> None:
    """Every honest peer reached ``epochs`` with the others' parameters, and never jumped to an epoch the lie made
    up: a peer that missed a round under load catches up to an epoch that its honest groupmates committed, no
    further (each catch-up downloads or skips to the swarm's epoch, which the lie must not move)."""
    committed = {rep["epoch"] for r in results for rep in r["reports"] if not rep["caught_up"]}
    for rank, r in enumerate(results):
        assert r["epoch"] == epochs, swarm.round_events()
        jumps = [rep["epoch"] for rep in r["reports"] if rep["caught_up"]]
        assert all(epoch in committed for epoch in jumps), (jumps, swarm.round_events())
        loaded = [int(line.rsplit(" ", 1)[1]) for line in swarm.log(rank).splitlines()
                  if "Loaded the swarm's state at epoch" in line]
        assert all(epoch in committed for epoch in loaded), (loaded, swarm.round_events())
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))


def test_a_stranger_claiming_an_epoch_far_ahead_neither_stalls_nor_moves_the_run(swarm):
    epochs = 8
    results = run_with_liar(swarm, epochs, epochs_ahead=1000)
    assert_identical_and_done(results, epochs, swarm)


def test_a_stranger_claiming_a_billion_samples_does_not_set_the_batch_size(swarm):
    epochs = 8
    results = run_with_liar(swarm, epochs, samples=10**9, samples_per_second=1e9)
    assert_identical_and_done(results, epochs, swarm)
    # every round of the three honest peers averaged the real samples of a full global batch, not what the liar said.
    # Each peer joins a round at its share of the target to the nearest step (shares follow speeds, which load makes
    # noisy): those rounds spread around the target, up to half a step per peer short of it on average; believing
    # the liar's samples made every round fire at a fraction of the target (42 of 64 before bounded trust). (A round
    # that a peer missed under load holds the others' samples only: it says nothing about when the round fired.)
    full = {}
    for r in results:
        for rep in r["reports"]:
            if rep["epoch"] > 1 and not rep["caught_up"] and rep["group_size"] == 3:
                full.setdefault(rep["epoch"], []).append(rep["samples"])
    full = {epoch: sum(samples) for epoch, samples in full.items() if len(samples) == 3}
    assert len(full) >= 3, (full, swarm.round_events())
    assert sum(full.values()) / len(full) >= TARGET - 3 * BATCH / 2, (full, swarm.round_events())
    assert any("Ignoring peer" in swarm.log(rank) for rank in range(3))


def test_a_newcomer_skips_a_donor_whose_state_differs_from_the_majoritys(swarm):
    """The best-announced donor serves perturbed parameters; the newcomer checks them against the parameters'
    digest that the majority of peers at that epoch publish, skips that donor for good, and takes the state of
    another; it then trains in step with the swarm."""
    epochs = 6
    for rank in range(3):
        (swarm.tmp / f"peer{rank}.pt.hold").touch()
        swarm.start(rank, inner="sgd", batch_size=BATCH, target_batch_size=TARGET, epochs=epochs, expect_peers=3,
                    hold_at_epoch=3, serve_perturbed=rank == 0, max_seconds=150)
    deadline = time.monotonic() + 120
    reached = ("epoch 3:", "Loaded the swarm's state at epoch 3")  # a peer that missed round 3 under load downloads
    while not all(any(line in swarm.log(rank) for line in reached) for rank in range(3)):
        assert time.monotonic() < deadline, [swarm.log(rank)[-2000:] for rank in range(3)]
        time.sleep(0.1)
    swarm.start(3, inner="sgd", batch_size=8, target_batch_size=TARGET, epochs=epochs, max_seconds=150)
    while "Loaded the swarm's state" not in swarm.log(3):
        assert time.monotonic() < deadline + 60, swarm.log(3)
        time.sleep(0.1)
    for rank in range(3):
        (swarm.tmp / f"peer{rank}.pt.hold").unlink()
    swarm.wait(timeout=150)
    newcomer = swarm.log(3)
    assert newcomer.count("Skipping donor") == 1 and "Loaded the swarm's state at epoch 3" in newcomer, newcomer
    assert "Sending our state" in swarm.log(0)  # the liar was asked first
    results = [swarm.result(rank) for rank in range(4)]
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"])), swarm.round_events()
