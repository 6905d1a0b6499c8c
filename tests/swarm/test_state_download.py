"""One real peer in this process (a real DHT on loopback) downloading the swarm's state: the timeouts it honours and
the reason a failed download gives."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import swarm_opt
from swarm_opt import (
    ConfigError,
    ConfigTypeError,
    IncompatibleStateError,
    ProgressTracker,
    StateDownloadError,
    Timeouts,
)
from swarm_opt.digest import parameter_digest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def make(dht, run_id, **timeouts):
    model = torch.nn.Linear(4, 2)
    return swarm_opt.Optimizer(dht=dht, run_id=run_id, target_batch_size=64, params=model.parameters(),
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **timeouts)


def test_timeouts_are_given_as_keywords_or_as_one_timeouts_object_not_both(dht):
    with make(dht, "timeouts_kw", matchmaking_time=1.0, averaging_timeout=7.0) as opt:
        assert opt.timeouts == Timeouts(matchmaking_time=1.0, averaging_timeout=7.0)
    timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=7.0, state_download_timeout=3.0)
    with make(dht, "timeouts_obj", timeouts=timeouts) as opt:
        assert opt.timeouts is timeouts
    with pytest.raises(ConfigError, match=r"averaging_timeout given both .* Timeouts\(averaging_timeout=7.0"):
        make(dht, "timeouts_both", averaging_timeout=7.0, timeouts=timeouts)
    with pytest.raises(ConfigTypeError, match="swarm_opt.Timeouts"):
        make(dht, "timeouts_bad", timeouts={"averaging_timeout": 7.0})


def _a_peer_ahead(opt, epoch: int, params_digest=None) -> ProgressTracker:
    """A peer of ``opt``'s run and model that reports ``epoch`` (and ``params_digest``) but serves no state (as one
    whose averager died)."""
    ahead = ProgressTracker(opt._tracker.dht, opt.config.run_id, opt.config.target_batch_size,
                            model_schema=opt.model_schema)
    ahead.mark_joined()  # it holds a state of the run: its epoch is evidence of the swarm's
    ahead.report(epoch, 0, params_digest=params_digest)
    ahead.start()
    deadline = time.monotonic() + 20
    while opt._tracker.progress.epoch < epoch:
        assert time.monotonic() < deadline, "the optimizer never saw the peer ahead"
        time.sleep(0.1)
    return ahead


def _catch_up_seconds(opt) -> float:
    opt._synced_epoch = None  # as a peer that missed a round of gradient averaging: it must download
    started = time.monotonic()
    opt._catch_up(opt._tracker.progress.epoch)  # what step() does when the swarm is ahead
    return time.monotonic() - started


def test_catching_up_gives_up_after_state_download_timeout_not_averaging_timeout(dht, caplog):
    timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=60.0, state_download_timeout=3.0)
    with make(dht, "catch_up_timeout", timeouts=timeouts) as opt, caplog.at_level(logging.WARNING, "swarm_opt"):
        ahead = _a_peer_ahead(opt, 3)
        try:
            elapsed = _catch_up_seconds(opt)
        finally:
            ahead.shutdown()
        assert opt.local_epoch == 0
    assert 2.5 < elapsed < 20, elapsed
    assert "could not download the swarm's state within 3 s" in caplog.text
    assert "no peer sent its state" in caplog.text


def test_catching_up_stops_when_the_peers_ahead_leave(dht, caplog):
    timeouts = Timeouts(matchmaking_time=1.0, averaging_timeout=5.0, state_download_timeout=60.0)
    with make(dht, "catch_up_left", timeouts=timeouts) as opt, caplog.at_level(logging.WARNING, "swarm_opt"):
        ahead = _a_peer_ahead(opt, 3)
        leaving = threading.Timer(2.0, ahead.shutdown)  # withdraws its record, as a peer that finished its run
        leaving.start()
        try:
            elapsed = _catch_up_seconds(opt)
        finally:
            leaving.join()
        assert opt.local_epoch == 0
    assert elapsed < 30, elapsed  # not the whole state_download_timeout
    assert "could not download" not in caplog.text  # nothing failed: there is nothing to catch up with any more


def test_a_failed_download_says_why(dht, monkeypatch):
    with make(dht, "download_reason", timeouts=Timeouts(matchmaking_time=1.0, averaging_timeout=5.0)) as opt:
        with pytest.raises(StateDownloadError, match="no peer sent its state"):
            opt.load_state_from_peers(timeout=1.0)

        def broken(timeout=None, **_):
            raise ConnectionResetError("the averager's connection to the p2p daemon was reset")
        monkeypatch.setattr(opt._averager._engine, "load_state_from_peers", broken)
        with pytest.raises(StateDownloadError, match="ConnectionResetError: the averager's connection .* was reset"):
            opt.load_state_from_peers(timeout=1.0)


def test_a_donor_must_serve_the_parameters_it_published_when_no_majority_vouches(dht):
    """A single other peer at the donor's epoch is no majority; the donor's own record still says which parameters
    it holds at that epoch (they change only with it): a state that matches it is taken, one that differs from it
    (a bit flip after the round, a bug) is refused, and its donor skipped from then on."""
    with make(dht, "donor_digest") as opt:
        served = [p.detach().clone() for p in opt._params]  # what the donor serves: opt's own parameters
        peer = opt._tracker.dht.peer_id.to_bytes()  # the donor's tracker shares opt's DHT, so its peer id
        for epoch, published in ((3, served), (5, [served[0] + 0.05] + served[1:])):
            metadata, tensors = opt._shareable_state()
            metadata["epoch"] = epoch
            donor = _a_peer_ahead(opt, epoch, params_digest=parameter_digest(published))
            try:
                if published is served:
                    opt._apply_downloaded_state(metadata, tensors, peer, min_epoch=0)
                    assert opt.local_epoch == epoch
                else:
                    with pytest.raises(IncompatibleStateError, match="differ from those it published for that"):
                        opt._apply_downloaded_state(metadata, tensors, peer, min_epoch=0)
                    assert opt.local_epoch == 3 and peer in opt._bad_donors
            finally:
                donor.shutdown()


def test_taking_a_majoritys_older_version_is_not_a_checkpoint_to_catch_up_from(dht, caplog):
    """A peer of a side that trained on alone in a partition takes the majority's state when the links come back:
    a state at an epoch older than its own (``Optimizer._take_other_version``). That state is the swarm's; applied
    as if it were a user's old checkpoint, it sent the peer looking for a state at its own old epoch, which only its
    side held (seen in the partition test: the peer silent for a minute, its step() held, its state lock taken)."""
    with make(dht, "older_version", timeouts=Timeouts(state_download_timeout=20.0)) as opt:
        peer = opt._tracker.dht.peer_id.to_bytes()
        metadata, tensors = opt._shareable_state()
        opt._apply_downloaded_state({**metadata, "epoch": 9}, tensors, peer, min_epoch=0)  # its side's epoch 9
        assert opt.local_epoch == 9
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="swarm_opt"):
            opt._apply_downloaded_state({**metadata, "epoch": 4}, tensors, peer, min_epoch=4)  # the majority's
        assert opt.local_epoch == 4 and time.monotonic() - started < 5
        assert "older than the state this peer held" not in caplog.text
