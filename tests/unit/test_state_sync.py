"""What a donor serves and the checks a downloaded state passes (``swarm_opt.state_sync``), without a network."""

from __future__ import annotations

import pytest
import torch

from swarm_opt.errors import IncompatibleStateError
from swarm_opt.state_sync import DonorBehind, parse_state, snapshot, with_own_entries, with_own_personal_state


def _served(epoch: int = 3, schema: str = "s"):
    params = [torch.ones(2, 3), torch.full((4,), 2.0)]
    optimizer = {"state": {0: {"momentum_buffer": torch.ones(2, 3)}, 1: {"momentum_buffer": torch.ones(4)}},
                 "param_groups": [{"lr": 0.1, "params": [0, 1]}]}
    return params, snapshot(params, optimizer, personal={1}, schema=schema, epoch=epoch)


def test_a_served_state_parses_back_with_personal_parameters_zeroed_and_their_state_left_out():
    params, (metadata, tensors) = _served()
    epoch, state = parse_state(metadata, tensors, schema="s", params=params, min_epoch=3)
    assert epoch == 3 and torch.equal(state["params"][0], params[0]) and not state["params"][1].any()
    assert set(state["optimizer"]["state"]) == {0}


@pytest.mark.parametrize("change, error", [
    (lambda m, t: ({**m, "format": 99}, t), "format"),
    (lambda m, t: ({**m, "schema": "other"}, t), "different model"),
    (lambda m, t: ({**m, "epoch": True}, t), "bad epoch"),
    (lambda m, t: ({**m, "epoch": -1}, t), "bad epoch"),
    (lambda m, t: (m, t[:1]), None),  # fewer tensors than the skeleton names
    (lambda m, t: (m, [torch.full_like(t[0], float("nan"))] + t[1:]), "non-finite"),
    (lambda m, t: (m, [torch.ones(3, 2)] + t[1:]), "does not match"),
])
def test_a_state_that_does_not_fit_is_refused(change, error):
    params, (metadata, tensors) = _served()
    with pytest.raises(IncompatibleStateError, match=error):
        parse_state(*change(metadata, list(tensors)), schema="s", params=params, min_epoch=0)


def test_a_donor_behind_the_needed_epoch_says_so():
    params, (metadata, tensors) = _served(epoch=3)
    with pytest.raises(DonorBehind):
        parse_state(metadata, tensors, schema="s", params=params, min_epoch=4)


def test_a_peer_keeps_its_own_entries_and_its_personal_parameters_state():
    downloaded = {"state": {0: "donor's", 1: "donor's"}, "swarm_opt": {"strategy": {"momentum": "donor's", "x": 1}}}
    mine = with_own_personal_state(downloaded, {1: "mine"}, {1})
    assert mine["state"] == {0: "donor's", 1: "mine"}
    mine = with_own_entries(mine, {"momentum": "mine"}, ("momentum",))
    assert mine["swarm_opt"]["strategy"] == {"momentum": "mine", "x": 1}
    assert with_own_entries(downloaded, {}, ()) is downloaded
