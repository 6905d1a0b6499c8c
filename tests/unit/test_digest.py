"""The parameter digest: equal models agree, different ones do not, round-off does not count, ties are decided."""

from __future__ import annotations

import torch

from swarm_opt.digest import DIGEST_SIZE, digest_tolerance, digests_agree, majority, parameter_digest, valid_digest


def _model(seed: int, dtype: torch.dtype = torch.float32) -> list:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(dtype)
    return [p.detach() for p in net.parameters()]


def test_the_same_parameters_give_the_same_digest_and_others_a_different_one():
    a, b, other = _model(0), _model(0), _model(1)
    tolerance = digest_tolerance(a)
    assert parameter_digest(a) == parameter_digest(b)
    assert len(parameter_digest(a)) == DIGEST_SIZE
    assert not digests_agree(parameter_digest(a), parameter_digest(other), tolerance)
    # one value changed by a training-step-sized amount is caught; the order of the tensors matters
    changed = [p.clone() for p in a]
    changed[2][0, 7] += 1e-2
    assert not digests_agree(parameter_digest(a), parameter_digest(changed), tolerance)
    assert not digests_agree(parameter_digest(a), parameter_digest(a[::-1]), tolerance)


def test_round_off_drift_is_tolerated():
    for dtype in (torch.float32, torch.bfloat16):
        a = _model(0, dtype)
        eps = torch.finfo(dtype).eps
        # every value one ulp off, in random directions: what peers on different hardware may drift apart by
        drifted = [p + p * eps * torch.randint(-1, 2, p.shape).to(dtype) for p in a]
        assert drifted[0].ne(a[0]).any()
        assert digests_agree(parameter_digest(a), parameter_digest(drifted), digest_tolerance(a)), dtype


def test_majority_and_its_deterministic_tie_break():
    same, other, third = parameter_digest(_model(0)), parameter_digest(_model(1)), parameter_digest(_model(2))
    tolerance = digest_tolerance(_model(0))
    assert majority({"b": same, "a": other, "c": same}, tolerance) == ["b", "c"]
    # a tie: the group holding the smallest peer id wins, whatever order the digests arrive in
    assert majority({"b": same, "a": other}, tolerance) == ["a"]
    assert majority({"c": third, "b": same, "a": other}, tolerance) == ["a"]


def test_a_groupmates_digest_is_validated():
    good = parameter_digest(_model(0))
    assert valid_digest(good) == tuple(good)
    for bad in (None, "abc", good[:-1], good + [1.0], [float("nan")] * DIGEST_SIZE, [True] * DIGEST_SIZE,
                ["1"] * DIGEST_SIZE, {"a": 1}):
        assert valid_digest(bad) is None, bad
