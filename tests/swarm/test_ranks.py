"""A machine of several data-parallel ranks is one peer (``swarm_opt.ranks``): real swarms on loopback, each rank a
process of its own, the ranks of a machine joined by gloo."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.swarm.conftest import assert_quiet
from tests.swarm.test_grad_averaging import assert_one_process

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_machine(swarm, first: int, batch_sizes, **config) -> None:
    """Start one peer of ``len(batch_sizes)`` ranks (swarm process ids ``first``, ``first + 1``, ...), rank r taking
    batches of ``batch_sizes[r]``."""
    port, total = free_port(), sum(batch_sizes)
    for r, batch_size in enumerate(batch_sizes):
        swarm.start(first + r, batch_size=batch_size, machine_batch_size=total,
                    local=dict(rank=r, size=len(batch_sizes), port=port), **config)


@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_a_two_rank_peer_and_a_one_rank_peer_equal_one_process_on_the_union_of_batches(swarm, inner):
    """Ranks of 8 and 12 samples on one machine and a peer of 20 end with the parameters of one process on the
    union of every epoch's batches, all three processes identical; the machine publishes one progress record."""
    epochs = 4
    common = dict(target_batch_size=240, inner=inner, epochs=epochs, expect_peers=2, step_sleep=0.03)
    start_machine(swarm, 0, [8, 12], **common)
    swarm.start(2, batch_size=20, **common)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs
    for p, q in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p, q), "the ranks of the machine disagree"
    # one record per machine: every peer saw two peers of the swarm, never three
    peers_seen = {rep["num_peers"] for r in (results[0], results[2]) for rep in r["reports"] if not rep["caught_up"]}
    assert peers_seen == {2}, peers_seen
    assert_one_process(results, inner, epochs)
    assert_quiet(swarm)
