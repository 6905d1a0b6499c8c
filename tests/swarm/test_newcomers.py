"""Newcomers joining together spread over the donors: a donor serves at most ``MAX_UPLOADS_AT_ONCE`` state downloads
at a time and sends the others on (an empty answer); they come back with backoff, and every one of them gets the
state. In process: one donor ahead of three newcomers, each with its own DHT on loopback; the newcomers are client-mode
peers (behind NAT, say), which never serve state themselves, so the donor is the only one they can ask."""

from __future__ import annotations

import threading
import time

import hivemind
import pytest
import torch

import swarm_opt
from swarm_opt._hivemind import engine as engine_module

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _optimizer(dht, model):
    return swarm_opt.Optimizer(dht=dht, run_id="newcomers", target_batch_size=16, batch_size_per_step=8,
                               params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               matchmaking_time=0.5, averaging_timeout=10.0)


def test_a_busy_donor_sends_newcomers_on_and_every_newcomer_gets_the_state(monkeypatch):
    monkeypatch.setattr(engine_module, "MAX_UPLOADS_AT_ONCE", 1)  # read in the averager process, forked below
    dhts, opts = [hivemind.DHT(host_maddrs=LOOPBACK, start=True)], []
    try:
        donor_model = torch.nn.Linear(16, 4)
        donor = _optimizer(dhts[0], donor_model)
        opts.append(donor)
        while donor.local_epoch < 1:  # alone: its rounds commit by themselves, and it is the swarm's epoch 1
            donor.zero_grad()
            donor_model(torch.ones(8, 16)).sum().backward()
            donor.step()
        snapshot = donor._shareable_state

        def slow_snapshot():  # each download holds the donor's slot for a while: the three overlap for sure
            time.sleep(1.0)
            return snapshot()

        donor._averager._engine.state_provider = slow_snapshot
        newcomer_models = [torch.nn.Linear(16, 4) for _ in range(3)]
        for model in newcomer_models:
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=LOOPBACK, client_mode=True,
                                     start=True))
            opts.append(_optimizer(dhts[-1], model))
        start, errors = threading.Barrier(3), []

        def join(opt):
            try:
                start.wait()
                opt.load_state_from_peers(timeout=60)
            except Exception as e:  # reported below, with the others'
                errors.append(e)

        threads = [threading.Thread(target=join, args=(opt,)) for opt in opts[1:]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not errors, errors
        for opt, model in zip(opts[1:], newcomer_models):
            assert opt.local_epoch == 1 and torch.equal(model.weight, donor_model.weight)
        uploads = donor._averager.uploads
        assert uploads.most == 1, uploads  # never two at once
        assert uploads.declined >= 1, uploads  # three newcomers asked at once: the donor sent some on
        assert uploads.served >= 3, uploads  # one per newcomer (more only if one gave up on a whole download)
    finally:
        for opt in opts:
            opt.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_newcomers_arriving_together_join_a_founder_that_trained_alone():
    """A founder trains alone to epoch 2; two newcomers arrive one after the other. Neither may take the other for a
    majority that outvotes the founder (the swarm would split in two): each downloads the founder's state as it
    joins (before its first step, which would otherwise be computed at its own initial parameters and thrown away),
    and the three then train one swarm."""
    dhts, opts = [hivemind.DHT(host_maddrs=LOOPBACK, start=True)], []
    models = [torch.nn.Linear(16, 4) for _ in range(3)]
    try:
        opts.append(_optimizer(dhts[0], models[0]))
        while opts[0].local_epoch < 2:
            _train_step(opts[0], models[0])
        for model in models[1:]:
            dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=LOOPBACK, start=True))
            opts.append(_optimizer(dhts[-1], model))
        for opt, model in zip(opts[1:], models[1:]):  # each holds the founder's state from the start
            assert opt.local_epoch == 2 and torch.equal(model.weight, models[0].weight)
        errors = []

        def train(opt, model):
            try:
                while opt.local_epoch < 4:
                    _train_step(opt, model)
            except Exception as e:  # reported below, with the others'
                errors.append(e)

        threads = [threading.Thread(target=train, args=pair) for pair in zip(opts, models)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert all(opt.local_epoch == 4 for opt in opts), [opt.local_epoch for opt in opts]
        for model in models[1:]:
            assert torch.equal(model.weight, models[0].weight)
    finally:
        for opt in opts:
            opt.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_a_newcomer_that_loads_an_older_checkpoint_after_joining_keeps_the_swarms_state_without_downloading_again(
        caplog):
    """A peer restarted with its checkpoint downloads the swarm's newer state while its optimizer is built, then its
    loop loads the checkpoint (the CLI, Hugging Face's Trainer and Lightning all do it in that order): the state it
    joined with goes over the checkpoint again, with no second download (which over a slow link costs as much as the
    first), and it steps first at the swarm's state."""
    dhts = [hivemind.DHT(host_maddrs=LOOPBACK, start=True)]
    models, opts = [torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)], []
    try:
        opts.append(_optimizer(dhts[0], models[0]))
        while opts[0].local_epoch < 1:
            _train_step(opts[0], models[0])
        checkpoint = {"model": {k: v.clone() for k, v in models[0].state_dict().items()},
                      "optimizer": opts[0].state_dict()}  # the restarted peer's, saved at epoch 1
        while opts[0].local_epoch < 3:
            _train_step(opts[0], models[0])
        dhts.append(hivemind.DHT(initial_peers=dhts[0].get_visible_maddrs(), host_maddrs=LOOPBACK, start=True))
        opts.append(_optimizer(dhts[1], models[1]))
        assert opts[1].local_epoch == 3 and opts[0]._averager.uploads.served == 1
        with caplog.at_level("INFO", "swarm_opt"):
            models[1].load_state_dict(checkpoint["model"])  # what Checkpointer.restore does
            opts[1].load_state_dict(checkpoint["optimizer"])
        assert opts[1].local_epoch == 3 and torch.equal(models[1].weight, models[0].weight)
        assert opts[0]._averager.uploads.served == 1  # the state was downloaded once
        assert "older than the swarm's state this peer downloaded as it joined" in caplog.text
    finally:
        for opt in opts:
            opt.shutdown()
        for dht in dhts:
            dht.shutdown()


def _train_step(opt, model):
    opt.zero_grad()
    model(torch.ones(8, 16)).sum().backward()
    opt.step()
