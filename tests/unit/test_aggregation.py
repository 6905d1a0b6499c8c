"""The aggregations' maths (no network): what each estimator returns on known input, how far one outlier moves it,
and how the reducer feeds them (every sender's copy at once, unusable copies left out)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException

import swarm_opt
from swarm_opt._hivemind.allreduce import AllOrNothingReducer
from swarm_opt.aggregation import as_aggregation, reduce_part
from swarm_opt.errors import ConfigError, ConfigTypeError


def honest(n: int, d: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g) + 0.1 * torch.randn(n, d, generator=g)


def combine(aggregation, parts: torch.Tensor, weights=None) -> torch.Tensor:
    weights = [1.0] * len(parts) if weights is None else weights
    return reduce_part(aggregation, list(parts), weights)


def test_mean_is_the_weighted_mean():
    parts = honest(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    expected = (torch.tensor(weights).unsqueeze(1) * parts).sum(0) / 10
    assert torch.allclose(combine(swarm_opt.Mean(), parts, weights), expected, atol=1e-6)


def test_mean_bounds_the_norm_of_one_absurd_copy():
    parts = honest(4)
    parts[3] *= 1e6
    plain = combine(swarm_opt.Mean(max_norm_ratio=None), parts)
    bounded = combine(swarm_opt.Mean(), parts)
    honest_norm = float(parts[:3].norm(dim=1).max())
    assert float(plain.norm()) > 1e5 * honest_norm
    # the absurd copy counts as at most 10x the median norm: the mean of 4 lies within (3 + 10) / 4 honest norms
    assert float(bounded.norm()) <= (3 + 10) / 4 * honest_norm * 1.01


def test_mean_bound_leaves_honest_copies_alone():
    parts = honest(5)
    assert torch.allclose(combine(swarm_opt.Mean(), parts), parts.mean(0), atol=1e-6)


def test_trimmed_mean_exact_on_known_input():
    parts = torch.tensor([[1.0, 10.0], [2.0, -50.0], [3.0, 20.0], [100.0, 30.0]])
    # fraction 0.25 of 4: drop the lowest and the highest value of each coordinate
    assert torch.equal(combine(swarm_opt.TrimmedMean(0.25), parts), torch.tensor([2.5, 15.0]))
    # weights of the kept copies apply: coordinate 0 keeps 2 (w=1) and 3 (w=3) -> 2.75
    assert torch.allclose(combine(swarm_opt.TrimmedMean(0.25), parts, [3.0, 1.0, 3.0, 3.0])[:1], torch.tensor([2.75]))
    # ... each capped at the median weight (3): a claim of 300 counts as 3
    assert torch.allclose(combine(swarm_opt.TrimmedMean(0.25), parts, [3.0, 1.0, 300.0, 3.0])[:1],
                          torch.tensor([2.75]))
    # rounded up, at most (n - 1) / 2 per side: 3 members keep their median, 2 their mean
    assert torch.equal(combine(swarm_opt.TrimmedMean(0.25), parts[:3]), torch.tensor([2.0, 10.0]))
    assert torch.equal(combine(swarm_opt.TrimmedMean(0.25), parts[:2]), torch.tensor([1.5, -20.0]))
    assert torch.allclose(combine(swarm_opt.TrimmedMean(0.0), parts), parts.mean(0))


def test_centered_clip_converges_to_the_mean_without_outliers():
    parts = honest(8)
    assert torch.allclose(combine(swarm_opt.CenteredClip(), parts), parts.mean(0), atol=1e-5)


@pytest.mark.parametrize("aggregation", [swarm_opt.CenteredClip(), swarm_opt.TrimmedMean(0.25)], ids=repr)
@pytest.mark.parametrize("attack", ["huge", "sign", "far"])
def test_one_outlier_has_bounded_influence(aggregation, attack):
    parts = honest(8)
    truth = parts[:7].mean(0)
    spread = float((parts[:7] - truth).norm(dim=1).median())
    parts[7] = {"huge": parts[7] * 1e6, "sign": -parts[7] * 100, "far": parts[7] + 1e3}[attack]
    # the outlier moves the result by at most about tau·r/n (CenteredClip) or within the honest range (trimmed)
    error = float((combine(aggregation, parts) - truth).norm())
    assert error < spread, (error, spread)
    assert float((combine(swarm_opt.Mean(max_norm_ratio=None), parts) - truth).norm()) > 10 * spread


def test_a_huge_weight_buys_no_influence_in_robust_aggregations():
    parts = honest(5)
    parts[4] += 100.0
    for aggregation in (swarm_opt.CenteredClip(), swarm_opt.TrimmedMean(0.2)):
        result = combine(aggregation, parts, [1.0, 1.0, 1.0, 1.0, 1e12])
        assert float((result - parts[:4].mean(0)).norm()) < 5.0, aggregation


def test_unusable_copies_count_with_weight_zero():
    parts = honest(3)
    poisoned = parts.clone()
    poisoned[2, 5] = float("nan")
    for aggregation in (swarm_opt.Mean(), swarm_opt.CenteredClip(), swarm_opt.TrimmedMean(0.0)):
        assert torch.allclose(combine(aggregation, poisoned), parts[:2].mean(0), atol=1e-5)
        # a weight that is not a finite number >= 0 is a lie: the copy is left out
        for weight in (float("nan"), float("inf"), -1.0):
            assert torch.allclose(combine(aggregation, parts, [1.0, 1.0, weight]), parts[:2].mean(0), atol=1e-5)
    # nothing left to combine: the part fails (hivemind divided by zero)
    with pytest.raises(ValueError, match="weight above 0"):
        combine(swarm_opt.Mean(), parts, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        combine(swarm_opt.Mean(), torch.full((2, 3), float("nan")))


@pytest.mark.parametrize("make, error, match", [
    (lambda: swarm_opt.Mean(max_norm_ratio=1.0), ConfigError, "> 1"),
    (lambda: swarm_opt.Mean(max_norm_ratio="10"), ConfigTypeError, "number"),
    (lambda: swarm_opt.TrimmedMean(fraction=0.5), ConfigError, r"\[0, 0.5\)"),
    (lambda: swarm_opt.TrimmedMean(fraction=True), ConfigTypeError, "number"),
    (lambda: swarm_opt.CenteredClip(tau=0), ConfigError, "> 0"),
    (lambda: swarm_opt.CenteredClip(tau=float("inf")), ConfigError, "> 0"),
    (lambda: swarm_opt.CenteredClip(iterations=0), ConfigError, "1 to 100"),
    (lambda: swarm_opt.CenteredClip(iterations=2.0), ConfigTypeError, "int"),
    (lambda: as_aggregation(swarm_opt.CenteredClip), ConfigTypeError, r"pass an instance: CenteredClip\(\)"),
    (lambda: as_aggregation("mean"), ConfigTypeError, "aggregation must be one of"),
    (lambda: as_aggregation(swarm_opt.CenteredClip(), swarm_opt.PowerSGD(rank=2)), ConfigError,
     "Leave aggregation unset with PowerSGD"),
    (lambda: as_aggregation(swarm_opt.Audited(), swarm_opt.PowerSGD(rank=2)), ConfigError,
     "Leave aggregation unset with PowerSGD"),
    (lambda: swarm_opt.Audited(swarm_opt.CenteredClip), ConfigTypeError, r"swarm_opt.CenteredClip\(\)"),
    (lambda: swarm_opt.Audited(swarm_opt.Audited()), ConfigTypeError, "must be one of"),
    (lambda: swarm_opt.Audited(tolerance=0.5), ConfigError, r"\(0, 0.1\]"),
    (lambda: swarm_opt.Reputation(swarm_opt.Audited()), ConfigTypeError, r"Audited\(Reputation\(...\)\)"),
    (lambda: swarm_opt.Reputation(swarm_opt.Reputation()), ConfigTypeError, "must be swarm_opt.Mean()"),
    (lambda: swarm_opt.Reputation(memory=1.0), ConfigError, r"\[0, 1\)"),
    (lambda: swarm_opt.Reputation(rounds=0), ConfigError, "≥ 1"),
    (lambda: swarm_opt.Reputation(max_shift=0), ConfigError, "> 0"),
    (lambda: as_aggregation(swarm_opt.Reputation(), swarm_opt.PowerSGD(rank=2)), ConfigError,
     "Leave aggregation unset with PowerSGD"),
])
def test_bad_arguments_name_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_powersgd_averages_with_the_plain_mean():
    assert as_aggregation(None, swarm_opt.PowerSGD(rank=2)) == swarm_opt.Mean(max_norm_ratio=None)
    assert as_aggregation(None, swarm_opt.Float16()) == swarm_opt.Mean()


async def _reduce(aggregation, copies: torch.Tensor, weights) -> list:
    reducer = AllOrNothingReducer([torch.Size([copies.shape[2]])] * copies.shape[1], num_senders=len(copies),
                                  aggregation=aggregation)

    async def sender(index: int) -> list:
        return [await reducer.accumulate_part(index, part, copies[index, part], weight=weights[index])
                for part in range(copies.shape[1])]

    results = await asyncio.wait_for(asyncio.gather(*(sender(i) for i in range(len(copies)))), timeout=10)
    assert reducer.finished.is_set() and not reducer.abandoned
    return results


def test_the_reducer_combines_every_senders_copy_and_answers_all_alike():
    g = torch.Generator().manual_seed(3)
    copies = torch.randn(4, 3, 50, generator=g)  # 4 senders, 3 parts of 50 values
    copies[2] *= 1e6  # an attacker
    results = asyncio.run(_reduce(swarm_opt.CenteredClip(), copies, [1.0, 2.0, 1e9, 1.0]))
    for part in range(3):
        expected = reduce_part(swarm_opt.CenteredClip(), list(copies[:, part]), [1.0, 2.0, 1e9, 1.0])
        assert all(torch.equal(r[part], expected) for r in results)  # the same tensor for every sender
        assert float(expected.norm()) < 100


async def _wrong_shape() -> object:
    """Sender 1 sent its only part; sender 0 sends one of the wrong shape, and gets banned (what hivemind's handler
    does with an exception). What does sender 1 get?"""
    reducer = AllOrNothingReducer([torch.Size([4])], num_senders=2)
    waiting = asyncio.ensure_future(reducer.accumulate_part(1, 0, torch.ones(4)))
    await asyncio.sleep(0)
    with pytest.raises(AllreduceException, match="shape"):
        await reducer.accumulate_part(0, 0, torch.ones(1))  # broadcastable: hivemind's sum would have taken it
    reducer.on_sender_failed(0)
    try:
        return await asyncio.wait_for(waiting, timeout=5)
    except (AllreduceException, asyncio.CancelledError) as e:
        return e


def test_the_reducer_refuses_a_part_of_the_wrong_shape():
    result = asyncio.run(_wrong_shape())
    assert not isinstance(result, torch.Tensor), result  # the round fails, instead of hanging or averaging it


# --- Audited: two reducers per part ---------------------------------------------------------------------------------

def test_audited_reduces_as_its_aggregation_and_tells_results_apart_beyond_the_tolerance():
    parts = torch.randn(5, 100)
    audited = swarm_opt.Audited(swarm_opt.CenteredClip(), tolerance=1e-3)
    assert torch.equal(reduce_part(audited, list(parts), [1.0] * 5),
                       reduce_part(swarm_opt.CenteredClip(), list(parts), [1.0] * 5))
    honest = torch.randn(1000)
    assert not audited.disagree(honest, honest.clone())
    assert not audited.disagree(honest, honest.half().float())  # a codec's rounding
    assert audited.disagree(honest, honest + 0.01)  # a lie of 1 % of an honest value's scale
    assert audited.disagree(honest, torch.full_like(honest, float("nan")))
    assert not audited.disagree(torch.zeros(4), torch.zeros(4))


def test_audit_order_moves_every_share_to_another_reducer_and_leaves_clients_alone():
    from swarm_opt._hivemind.allreduce import audit_order

    peers = ["a", "b", "c", "d"]
    assert audit_order(peers, [0.25] * 4) == ["b", "c", "d", "a"]
    assert audit_order(peers, [0.5, 0.0, 0.5, 0.0]) == ["c", "b", "a", "d"]  # b and d are clients: no share
    assert audit_order(peers, [1.0, 0.0, 0.0, 0.0]) is None  # one reducer: nobody can check it


def test_a_reducer_that_lies_in_both_of_its_roles_is_named_and_one_disagreement_names_nobody():
    from swarm_opt._hivemind.allreduce import audit_order, disagreeing_reducers, liars

    peers = ["a", "b", "c", "d"]
    order = audit_order(peers, [0.25] * 4)
    owners = [(share, 3) for share in range(4)]  # one part of 3 values per share
    honest = [torch.arange(12.0)]
    lied = honest[0].clone()
    lied[3:6] += 1.0  # b's own share, as b reduced it in the first all-reduce
    audited = honest[0].clone()
    audited[0:3] += 1.0  # a's share, as b reduced it in the second
    pairs = disagreeing_reducers(swarm_opt.Audited(), owners, [lied], [audited], peers, order)
    assert pairs == {("a", "b"), ("b", "c")}
    assert liars(pairs) == {"b"}
    assert liars({("a", "b")}) == set()  # a or b
    assert liars({("a", "b"), ("b", "a")}) == set()  # two reducers in all: either could be lying


# --- the command line's forms ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("mean", swarm_opt.Mean()),
    ("mean:none", swarm_opt.Mean(max_norm_ratio=None)),
    ("Mean:20", swarm_opt.Mean(max_norm_ratio=20.0)),
    ("trimmed-mean", swarm_opt.TrimmedMean()),
    ("trimmed-mean:0.1", swarm_opt.TrimmedMean(0.1)),
    ("centered-clip", swarm_opt.CenteredClip()),
    ("centered-clip:1,5", swarm_opt.CenteredClip(tau=1.0, iterations=5)),
    ("centered-clip: tau=1, iterations=5", swarm_opt.CenteredClip(tau=1.0, iterations=5)),
    ("audited:centered-clip:tau=1", swarm_opt.Audited(swarm_opt.CenteredClip(tau=1.0))),
    ("audited:mean", swarm_opt.Audited(swarm_opt.Mean())),
    ("reputation:centered-clip:tau=1", swarm_opt.Reputation(swarm_opt.CenteredClip(tau=1.0))),
    ("audited:reputation:trimmed-mean", swarm_opt.Audited(swarm_opt.Reputation(swarm_opt.TrimmedMean()))),
])
def test_parse_aggregation_reads_every_form(text, expected):
    from swarm_opt.aggregation import parse_aggregation

    assert parse_aggregation(text) == expected


@pytest.mark.parametrize("text, match", [
    ("median", "unknown aggregation 'median'; valid forms: mean"),
    ("audited:audited:mean", "unknown aggregation"),
    ("reputation:audited:mean", "unknown aggregation"),
    ("mean:x", "expected a number, got 'x'"),
    ("centered-clip:tau=1,2", "value after key=value"),
    ("trimmed-mean:0.1,0.2", "too many values"),
    ("centered-clip:rho=1", "centered-clip takes tau, iterations \\(each once\\)"),
    ("centered-clip:tau=1,tau=2", "each once"),
    ("trimmed-mean:0.5", r"\[0, 0.5\)"),
    ("centered-clip:start=previous", "centered-clip takes tau, iterations"),
    ("centered-clip:iterations=1.5", "expected a number"),
])
def test_parse_aggregation_names_the_valid_forms(text, match):
    from swarm_opt.aggregation import parse_aggregation

    with pytest.raises(ConfigError, match=match):
        parse_aggregation(text)


def test_the_cli_option_reads_flags_environment_and_config_files(tmp_path):
    import argparse

    from swarm_opt.cli.commands import resolve_options

    assert resolve_options("train", argparse.Namespace(run_id="r"), {}).aggregation is None  # Mean() by default
    env = resolve_options("train", argparse.Namespace(run_id="r"), {"SWARM_OPT_AGGREGATION": "trimmed-mean:0.2"})
    assert env.aggregation == swarm_opt.TrimmedMean(0.2)
    config = tmp_path / "run.json"
    config.write_text('{"run_id": "r", "aggregation": "audited:centered-clip"}')
    from_file = resolve_options("train", argparse.Namespace(config=str(config)), {})
    assert from_file.aggregation == swarm_opt.Audited(swarm_opt.CenteredClip())
    with pytest.raises(ConfigError, match="SWARM_OPT_AGGREGATION: unknown aggregation"):
        resolve_options("train", argparse.Namespace(run_id="r"), {"SWARM_OPT_AGGREGATION": "krum"})


@pytest.mark.parametrize("liar", ["a", "c", "d"])
def test_a_lying_reducer_is_named_when_some_member_reduces_no_part(liar):
    """hivemind deals whole parts to the shares: with 4 equal fractions of a small model (tensors of 512, 32, 128
    and 4 values, parts of 256) member b reduces no part. The audit rotates among the members that reduce one, so
    a liar in any of those places disagrees with two partners (a rotation through b named it in only half of them)."""
    from types import SimpleNamespace

    from hivemind.averaging.partition import TensorPartContainer

    from swarm_opt._hivemind.allreduce import audit_order, disagreeing_reducers, liars, part_owners

    peers = ["a", "b", "c", "d"]
    tensors = [torch.arange(float(n)) for n in (512, 32, 128, 4)]
    container = TensorPartContainer(tensors, [0.25] * 4, part_size_bytes=1024)
    assert container.num_parts_by_peer[1] == 0  # b reduces nothing
    order = audit_order(peers, container.num_parts_by_peer)
    owners = part_owners(SimpleNamespace(tensor_part_container=container))
    honest = torch.cat(tensors)
    first, second, offset = honest.clone(), honest.clone(), 0
    for share, size in owners:  # every mean the liar returns is off by one, in both all-reduces
        if peers[share] == liar:
            first[offset:offset + size] += 1.0
        if order[share] == liar:
            second[offset:offset + size] += 1.0
        offset += size
    pairs = disagreeing_reducers(swarm_opt.Audited(), owners, [first], [second], peers, order)
    assert liars(pairs) == {liar}, pairs


def test_a_share_whose_reducer_failed_is_no_evidence_against_anyone():
    """hivemind fills the parts of a reducer that failed (a stream lost under load) with this member's own values:
    they differ from the other reducer's mean of that share though nobody lied, and each member sees its own
    values there. Compared, they named honest reducers, and members of one round named different ones (one honest
    peer was then left out of groups for 10 minutes and the others had no majority). The round fails as partial."""
    from types import SimpleNamespace

    from hivemind.averaging.partition import TensorPartContainer

    from swarm_opt._hivemind.allreduce import audit_evidence, audit_order, disagreeing_reducers, part_owners

    peers = ["a", "b", "c", "d"]
    own = [torch.arange(12.0)]  # this member's values; the group's mean is 0 everywhere
    runners = []
    for failed_share in (None, 1):  # the audit all-reduce is complete; the first lost reducer b
        container = TensorPartContainer([t.clone() for t in own], [0.25] * 4, part_size_bytes=12, return_deltas=False)
        for share in range(4):
            if share == failed_share:
                container.register_failed_reducer(share)
            else:
                for index in range(container.num_parts_by_peer[share]):
                    container.register_processed_part(share, index, torch.zeros(3))
        runners.append(SimpleNamespace(tensor_part_container=container, banned_senders=set(),
                                       tensor_part_reducer=SimpleNamespace(abandoned=False)))
    audit, first = runners
    order = audit_order(peers, first.tensor_part_container.num_parts_by_peer)
    owners = part_owners(first)

    async def outputs(runner):
        return [t async for t in runner.tensor_part_container.iterate_output_tensors()]

    first_means, audit_means = asyncio.run(outputs(first)), asyncio.run(outputs(audit))
    assert disagreeing_reducers(swarm_opt.Audited(), owners, first_means, audit_means, peers, order) == {("b", "c")}
    with pytest.raises(AllreduceException, match="partial all-reduce"):
        audit_evidence(swarm_opt.Audited(), [first, audit], owners, first_means, audit_means, peers, order)
    assert audit_evidence(swarm_opt.Audited(), [audit, audit], owners, audit_means, audit_means, peers, order) == set()


# --- Reputation: reducers that remember senders ---------------------------------------------------------------------

def test_scores_tell_a_sign_flipper_and_a_shifter_from_honest_copies():
    """Honest copies point with the result and scatter around it; a flipped copy points against it, and a copy
    shifted by the spread ("a little is enough") sits on one side of it in every value."""
    parts = honest(8, seed=5)
    parts[0] = -parts[0]
    parts[1] = parts[2:].mean(0) - parts[2:].std(0)
    result = combine(swarm_opt.CenteredClip(), parts)
    scores = swarm_opt.aggregation.judge_part(list(parts), [1.0] * 8, result)
    assert scores[0, 0] < 0 < scores[2:, 0].min()
    # the default max_shift (0.4) lies between them; the flipper does not widen the spread the shifter hides in
    assert scores[1, 1] < -0.6 and scores[2:, 1].abs().max() < 0.3, scores
    parts[3, 0] = float("nan")
    assert torch.isnan(swarm_opt.aggregation.judge_part(list(parts), [1.0] * 8, result)[3]).all()


@pytest.mark.parametrize("aggregation", [swarm_opt.Mean(), swarm_opt.CenteredClip()])
def test_a_sign_flipper_in_a_small_group_of_noisy_copies_points_against_the_others(aggregation):
    """Batch-sized gradients are mostly noise: among 4 copies, a flipped one is a quarter of the result and that
    alone points it with the result (cosine about +0.2 here). Judged against the result of the others it points
    against it, and honest copies with it; a copy left out (weight 0) pulled nothing and is judged against the
    result itself."""
    g = torch.Generator().manual_seed(3)
    flipper, others, left_out = [], [], []
    for _ in range(50):
        parts = torch.randn(1000, generator=g) + 2.0 * torch.randn(4, 1000, generator=g)
        parts[3] = -parts[3]
        result = combine(aggregation, parts)
        scores = swarm_opt.aggregation.judge_part(list(parts), [1.0] * 4, result)
        flipper.append(float(scores[3, 0]))
        others.append(float(scores[:3, 0].mean()))
        result = combine(aggregation, parts, [1.0, 1.0, 1.0, 0.0])
        left_out.append(float(swarm_opt.aggregation.judge_part(list(parts), [1.0, 1.0, 1.0, 0.0], result)[3, 0]))
    assert max(flipper) < 0 < min(others), (flipper, others)
    assert max(left_out) < 0, left_out


def test_near_an_optimum_cosines_are_no_evidence():
    """Members' gradients of their own data that add up to about 0 (an optimum of their sum) each point against
    the others' sum, honest or not: where the median cosine is not above 0, no copy's cosine counts (NaN), and the
    shift, which tells an ALIE attacker, still does."""
    g = torch.Generator().manual_seed(0)
    own = torch.randn(5, 1000, generator=g)
    parts = own - own.mean(0) + 0.1 * torch.randn(5, 1000, generator=g)
    result = combine(swarm_opt.CenteredClip(), parts)
    scores = swarm_opt.aggregation.judge_part(list(parts), [1.0] * 5, result)
    assert torch.isnan(scores[:, 0]).all() and torch.isfinite(scores[:, 1]).all(), scores


def test_memory_distrusts_after_enough_rounds_and_forgets_the_oldest():
    from swarm_opt.aggregation import Reputations

    memory = Reputations(swarm_opt.Reputation(rounds=3, memory=0.5), capacity=3)
    for _ in range(2):
        memory.record({"flipper": (-0.4, 0.0), "shifter": (0.5, -0.9), "honest": (0.6, 0.05)})
    assert memory.distrusted() == []  # two rounds are not enough to judge
    memory.record({"flipper": (-0.4, 0.0), "shifter": (0.5, -0.9), "honest": (0.6, 0.05)})
    assert sorted(memory.distrusted()) == ["flipper", "shifter"]
    memory.record({"honest": (float("nan"), 0.0), "new": (-1.0, 0.0)})  # honest sent nothing usable: not judged
    assert memory.distrusted() == ["shifter"]  # the capacity: the sender seen longest ago (flipper) went
    for _ in range(3):  # a sender that turns honest is trusted again once its mean scores recover
        memory.record({"shifter": (0.6, 0.0)})
    assert "shifter" not in memory.distrusted()


def test_memory_wants_confidence_to_distrust_and_a_mean_above_0_to_trust_again():
    """An honest sender whose cosines scatter around a mean just below 0 (late in training, where honest copies
    barely agree) is not distrusted; one whose cosines sit steadily below 0 is, and stays distrusted while its
    mean stays below 0, however noisy (left out, it is judged against a result without it)."""
    from swarm_opt.aggregation import Reputations

    memory = Reputations(swarm_opt.Reputation())
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        noise = torch.randn(2, generator=g).tolist()
        memory.record({"noisy honest": (-0.02 + 0.3 * noise[0], 0.0), "flipper": (-0.3 + 0.05 * noise[1], 0.0)})
        assert "noisy honest" not in memory.distrusted()
    assert memory.distrusted() == ["flipper"]
    for cosine in (-0.6, 0.5, -0.5, 0.4):  # noisy now, its mean still below 0
        memory.record({"flipper": (cosine, 0.0)})
        assert memory.distrusted() == ["flipper"]
    for _ in range(3):
        memory.record({"flipper": (0.5, 0.0)})
    assert memory.distrusted() == []


@pytest.mark.parametrize("votes, expected", [
    ([["c"], ["c"], ["c"], []], {"c"}),  # three of four name c
    ([["c"], ["c"], [], []], set()),  # two of four are no majority
    ([["a"], ["a"], ["b", "b", "b"], "c"], set()),  # a voter counts once; anything but a list names no one
    ([["a", "b"], ["a", "b"], ["a", "b"], []], set()),  # half of the group is never left out: the memories are wrong
    ([["x"], ["x"], ["x"], ["x"]], set()),  # not a member
])
def test_a_group_leaves_out_whom_more_than_half_of_it_names(votes, expected):
    assert swarm_opt.aggregation.left_out(["a", "b", "c", "d"], votes) == expected


async def _judged(copies: torch.Tensor, left_out=()) -> tuple:
    reducer = AllOrNothingReducer([torch.Size([copies.shape[2]])] * copies.shape[1], num_senders=len(copies),
                                  aggregation=swarm_opt.Reputation(), left_out=left_out)

    async def sender(index: int) -> list:
        return [await reducer.accumulate_part(index, part, copies[index, part]) for part in range(copies.shape[1])]

    results = await asyncio.wait_for(asyncio.gather(*(sender(i) for i in range(len(copies)))), timeout=10)
    return results[0], reducer.scores.means()


def test_the_reducer_scores_every_sender_and_leaves_out_the_distrusted():
    copies = torch.stack([honest(5, d=60, seed=s).reshape(5, 3, 20)[:, 0] for s in range(3)], dim=1)
    copies[4] = -copies[4]
    results, scores = asyncio.run(_judged(copies))
    assert sorted(scores) == [0, 1, 2, 3, 4]
    assert scores[4][0] < 0 < min(scores[i][0] for i in range(4))
    kept, _ = asyncio.run(_judged(copies, left_out=[4]))
    for part in range(3):  # the left-out sender's copies count with weight 0
        assert torch.equal(kept[part], reduce_part(swarm_opt.CenteredClip(), list(copies[:4, part]), [1.0] * 4))


def test_round_scores_count_each_part_by_its_size_and_merge_under_names():
    from swarm_opt.aggregation import RoundScores

    one = RoundScores()
    one.add([0, 1], torch.tensor([[1.0, 0.0], [-1.0, 0.5]]), size=3)
    # a NaN cosine: sender 1's is not judged on that part, its shift is
    one.add([0, 1], torch.tensor([[0.0, 0.0], [float("nan"), 0.0]]), size=1)
    assert one.means() == {0: (0.75, 0.0), 1: (-1.0, 0.375)}
    both = RoundScores()
    both.add_all(one, ["a", "b"])
    both.add_all(one, ["b", "a"])
    assert both.means() == {"a": ((3.0 - 3.0) / 7, 0.5 * 3 / 8), "b": ((3.0 - 3.0) / 7, 0.5 * 3 / 8)}
    nothing = RoundScores()
    nothing.add([0], torch.tensor([[float("nan"), float("nan")]]), size=2)
    assert all(math.isnan(x) for x in nothing.means()[0])
