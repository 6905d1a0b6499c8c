"""Opacus-private peers (DP-SGD local steps) in a real 3-peer swarm, with FedAvg (and SCAFFOLD, extended): they train
together, and every round's log line reports the ε that Opacus's own accountant gives for the DP steps the peer had
taken by then."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("opacus")

from opacus.accountants import RDPAccountant  # noqa: E402

from tests.swarm.dp_peer import DELTA, NOISE  # noqa: E402

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

PEERS, EPOCHS = 3, 3
DP_PEER = Path(__file__).with_name("dp_peer.py")
ROUND_LINE = re.compile(r"epoch (\d+): averaged with \d+ of \d+ peer\(s\).*, ε ([0-9.e+-]+) at δ 1e-05$", re.M)


def expected_epsilon(steps: int, sample_rate: float) -> float:
    """What Opacus's accountant says for ``steps`` DP-SGD steps at this noise and sample rate."""
    accountant = RDPAccountant()
    accountant.history = [(NOISE, sample_rate, steps)]
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("strategy", ["local", pytest.param("scaffold", marks=pytest.mark.extended)])
def test_private_peers_train_together_and_report_opacus_epsilon(swarm, strategy):
    for rank in range(PEERS):  # 4 DP steps of 32 expected samples per peer and round
        swarm.start(rank, script=DP_PEER, strategy=strategy, target_batch_size=PEERS * 4 * 32, epochs=EPOCHS,
                    expect_peers=PEERS)
    swarm.wait(timeout=200)
    results = [swarm.result(rank) for rank in range(PEERS)]
    for rank, result in enumerate(results):
        log = swarm.log(rank)
        assert "Traceback" not in log and "WARNING" not in log and "Warning" not in log, log
        assert result["rounds"] and result["rounds"][-1]["epoch"] == EPOCHS, result["rounds"]
        logged = {int(epoch): float(eps) for epoch, eps in ROUND_LINE.findall(log)}
        for rnd in result["rounds"]:  # the ε of each round's log line is the accountant's for the steps so far
            expected = expected_epsilon(rnd["steps"], result["sample_rate"])
            assert rnd["epsilon"] == pytest.approx(expected, rel=1e-12)
            if rnd["group_size"] > 0:  # a committed round (not a catch-up) logged its line
                assert logged[rnd["epoch"]] == pytest.approx(expected, rel=1e-5), (logged, rnd)
        assert result["epsilon"] == pytest.approx(expected_epsilon(result["steps"], result["sample_rate"]))
        assert result["epsilon"] > 0
    # they trained together: every member of a full round ends it with the group's mean, the same on every peer
    full = [{rnd["epoch"]: rnd["params"] for rnd in r["rounds"] if rnd["group_size"] == PEERS} for r in results]
    common = set.intersection(*(set(f) for f in full))
    assert common, [[(rnd["epoch"], rnd["group_size"]) for rnd in r["rounds"]] for r in results]
    for epoch in common:
        for a, b in zip(full[0][epoch], full[1][epoch]):
            assert torch.equal(a, b)
