"""A swarm of dozens, as ``benchmarks/many_peers.py`` runs it: 24 real peers in Moshpit groups of 8, a quarter of them
SIGKILLed mid-run and replaced by newcomers. Extended (about 5 minutes on this machine): ``bash scripts/test.sh -m
extended``."""

from __future__ import annotations

import argparse
import sys

import pytest

from tests.swarm.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from many_peers import run, simulated_spread  # noqa: E402  (the benchmark's own launcher and simulation)


@pytest.mark.extended
@pytest.mark.solo  # 24 peers are ~100 processes: beside other swarms, every one of them starves
@pytest.mark.slow
@pytest.mark.timeout(480)  # its own run gives up after max_seconds (400)
def test_two_dozen_peers_in_groups_survive_a_quarter_killed_and_end_within_the_simulated_bound(tmp_path):
    """Epochs keep completing (every survivor reaches the last), every newcomer joins the running swarm, and the
    survivors' final spread is within the largest the in-process simulation of the same swarm ends with when each
    peer misses each round at the rate this run measured."""
    args = argparse.Namespace(peers=24, size=8, epochs=20, kill=0.25, kill_at=5, matchmaking_time=2.0, strategy="local",
                              averaging_timeout=20.0, max_seconds=400.0)
    result = run(args, args.size, tmp_path)
    assert len(result["killed"]) == 6 and result["newcomers_joined"] == 6, result
    assert result["epochs_reached"] == [args.epochs] * args.peers, result
    bound = max(simulated_spread(args, args.size, 1 - result["success_rate"], seed) for seed in range(20))
    assert result["final_spread"] <= bound, (result, bound)
