"""Moshpit group averaging in a real loopback swarm: four peers in groups of two (a 2 x 2 grid)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


@pytest.mark.extended  # ~30 s on this machine under load, mostly starting four peers
@pytest.mark.parametrize("strategy", ["local", "diloco"])
def test_groups_of_two_commit_partial_rounds_and_mix_four_peers_to_one_value(swarm, strategy):
    """Peers start at 0, 1, 2, 3 and do not train (lr 0): only averaging moves them. Rounds average in groups of
    two of the four live peers, along the grid's two dimensions in turn, and commit (a majority of a line of two);
    the peers end at one common value, inside the range they started in. DiLoCo's rounds in groups carry its
    anchors and outer momenta too (with no local progress its outer step only mixes the anchors)."""
    n = 4
    for rank in range(n):
        swarm.start(rank, task="lsq", strategy=strategy, groups=2, init_by_rank=True, lsq_lr=0.0, expect_peers=n,
                    batch_size=16, target_batch_size=n * 16 * 5, epochs=12, step_sleep=0.02, matchmaking_time=1.0,
                    averaging_timeout=10.0)
    swarm.wait(timeout=240)
    results = [swarm.result(r) for r in range(n)]
    committed = [rnd for r in results for rnd in r["rounds"] if not rnd["caught_up"]]
    assert len(committed) >= 2 * n, swarm.round_events()
    assert all(rnd["group_size"] == 2 for rnd in committed), committed  # never a group of the whole swarm
    assert sum(rnd["num_peers"] == n for rnd in committed) >= n, committed  # partial by design: 2 of 4 live peers
    finals = torch.stack([r["w"] for r in results])
    assert float(finals.max() - finals.min()) < 1e-2, finals  # one value (from a spread of 3)
    assert 0.0 < float(finals.mean()) < 3.0
