"""Gradient averaging in real loopback swarms: equivalence with one process, schedulers, mixed precision."""

from __future__ import annotations

import itertools
import math
import os
import time

import pytest
import torch

from tests.swarm.peer import make_data, make_inner, make_model, make_scheduler

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def reference_params(results: list, inner: str, epochs: int, scheduler=None, extra=(), clip_grad_norm=None,
                     norms=None) -> list:
    """One process applying the inner optimizer to the union of the batches every peer committed to each epoch
    (plus the ``extra`` (epoch, batches) pairs), with the peers' ``scheduler`` (``peer.make_scheduler``) stepped per
    epoch, and with ``clip_grad_norm`` clipping the union's gradient before each step (``norms``: a list that gets
    each epoch's norm before clipping)."""
    x, y = make_data()
    model = make_model()
    opt = make_inner(inner)(model.parameters())
    factory = make_scheduler(scheduler, epochs)
    sched = factory(opt) if factory is not None else None
    for epoch in range(1, epochs + 1):
        batches = [b for r in results for b in r["committed"].get(epoch, [])]
        batches += [b for e, extra_batches in extra if e == epoch for b in extra_batches]
        assert batches, f"no peer committed batches to epoch {epoch}"
        idx = torch.tensor([i for b in batches for i in b])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if sched:
            sched.step()
    return [p.detach() for p in model.parameters()]


def possible_references(results: list, inner: str, epochs: int, **recipe):
    """A peer whose round failed on its side while its groupmates completed it (the last message of a round can
    always be lost) cannot know whether its gradients made it into that epoch; it drops them and downloads the
    result. Its batches since the last round it committed went into that average up to the attempt that reached the
    group, i.e. some prefix of them (it may have retried after more steps): yield the reference for every prefix."""
    ambiguous = list(ambiguous_batches(results))
    choices = [range(len(batches) + 1) for _, batches in ambiguous]
    assert math.prod(len(c) for c in choices) <= 20_000, ambiguous
    for prefix in itertools.product(*choices):
        yield reference_params(results, inner, epochs,
                               extra=[(epoch, batches[:k]) for (epoch, batches), k in zip(ambiguous, prefix)],
                               **recipe)


def ambiguous_batches(results: list):
    """Each peer's discarded batches as (epoch, batches), by the only round they could have gone into: the one after
    the epoch they were computed at (a peer that caught up reports the epoch it downloaded, which may be later if
    the swarm moved on meanwhile)."""
    for r in results:
        for epoch, batches in r["discarded"].items():
            versions = r["discarded_versions"][epoch]
            for version in sorted(set(versions)):
                yield version + 1, [b for b, v in zip(batches, versions) if v == version]


def assert_one_process(results: list, inner: str, epochs: int, **recipe) -> list:
    """Every peer holds the same parameters, those of one process on the union of each epoch's committed batches
    (for one of the ``possible_references``, with the ``recipe``'s scheduler and clipping); returns those
    references."""
    for r in results[1:]:
        assert _close(r["params"], results[0]["params"], 1e-6)  # one model in the swarm
    references = list(possible_references(results, inner, epochs, **recipe))
    assert any(_close(results[0]["params"], expected) for expected in references), \
        [max((a - b).abs().max().item() for a, b in zip(results[0]["params"], e)) for e in references]
    return references


def _close(a: list, b: list, tol: float = 1e-5) -> bool:
    return all(torch.allclose(x, y, atol=tol, rtol=tol) for x, y in zip(a, b))


def assert_quiet(log: str) -> None:
    if os.environ.get("SWARM_TEST_LOG_LEVEL", "INFO") == "DEBUG":  # hivemind's own messages are shown: not quiet
        return
    for word in ("Traceback", "WARNING", "ERROR", "Warning:"):
        assert word not in log, log


# Adam: also the gloo lane's equivalence test (tests/swarm/test_gloo_lane.py)
@pytest.mark.parametrize("inner, client_rank", [("sgd", 2), pytest.param("adam", None, marks=pytest.mark.extended)])
def test_three_peers_equal_one_process_on_the_union_of_batches(swarm, inner, client_rank):
    """Peers of unequal batch sizes (one of them behind NAT in client mode for SGD) must end with exactly the
    parameters of one process that applies the inner optimizer to the union of the batches of each epoch."""
    epochs = 4
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=240, inner=inner, epochs=epochs,
                    expect_peers=3, step_sleep=0.03, client_mode=rank == client_rank)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs
        # a peer that missed a round downloads the swarm's state; its batches of that round are then discarded
        assert all(rep["caught_up"] or rep["group_size"] >= 2 for rep in r["reports"]), r["reports"]
        assert sum(rep["group_size"] == 3 for rep in r["reports"]) >= epochs // 2, r["reports"]
        assert_quiet(swarm.log(r["rank"]))
    if client_rank is not None:
        assert any(rep["group_size"] == 3 for rep in results[client_rank]["reports"]), "the client never averaged"
    expected = assert_one_process(results, inner, epochs)[0]
    # the test is only meaningful if training moved the parameters
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(expected, make_model().parameters()))


#: a transformer recipe: AdamW with weight decay 0.1 on the weights only (``peer.make_inner("adamw")``), linear warmup
#: then cosine decay over the global epochs, and the accumulated gradient clipped to a norm its global batches exceed
RECIPE = dict(scheduler="warmup_cosine", clip_grad_norm=0.2)


def test_three_peers_with_a_transformer_recipe_equal_one_process_that_clips_its_accumulated_batch(swarm):
    """Peers of unequal batch sizes with ``RECIPE``: each clips the round's mean gradient, the same on every peer,
    so they end with the parameters of one process that clips the gradient of the union of each epoch's batches
    (``torch.nn.utils.clip_grad_norm_``) before its AdamW step, and whose schedule steps once per epoch."""
    epochs = 6
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=240, inner="adamw", epochs=epochs,
                    expect_peers=3, step_sleep=0.03, **RECIPE)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    clip = RECIPE["clip_grad_norm"]
    for r in results:
        assert r["epoch"] == epochs
        assert all(rep["caught_up"] or rep["group_size"] >= 2 for rep in r["reports"]), r["reports"]
        assert sum(rep["group_size"] == 3 for rep in r["reports"]) >= epochs // 2, r["reports"]
        # the swarm's own evidence that clipping was active: the mean gradients it applied were above the norm
        assert all(rep["grad_norm"] > clip for rep in r["reports"] if not rep["caught_up"]), r["reports"]
        assert r["lrs"][epochs] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 4 / 5)))  # cosine, epoch 6
        assert_quiet(swarm.log(r["rank"]))
    expected = assert_one_process(results, "adamw", epochs, **RECIPE)[0]
    norms: list = []
    unclipped = reference_params(results, "adamw", epochs, scheduler=RECIPE["scheduler"], norms=norms,
                                 clip_grad_norm=math.inf)
    assert sum(n > clip for n in norms) >= epochs - 1, norms  # the one process clipped in (nearly) every epoch
    assert max((a - b).abs().max() for a, b in zip(expected, unclipped)) > 1e-3  # and clipping changed the result


def test_rounds_shorter_than_matchmaking_time_start_once_every_peer_joined(swarm):
    """A round's group assembles as soon as every live peer joined it and its leader is ready, not at the leader's
    matchmaking deadline (at least ``matchmaking_time`` after the search began): rounds of well under a second with
    ``matchmaking_time=20`` follow each other in seconds, and the result is still one process on the union of each
    epoch's batches."""
    epochs, matchmaking_time = 5, 20.0
    for rank, batch_size in enumerate([8, 12, 20]):
        swarm.start(rank, batch_size=batch_size, target_batch_size=240, inner="sgd", epochs=epochs, expect_peers=3,
                    step_sleep=0.03, matchmaking_time=matchmaking_time, averaging_timeout=40.0, max_seconds=200)
    swarm.wait(timeout=230)
    results = [swarm.result(r) for r in range(3)]
    for r in results:
        assert r["epoch"] == epochs
        full = [rep for rep in r["reports"] if rep["group_size"] == 3]
        assert len(full) >= epochs - 1, r["reports"]
        # each of these rounds would have waited out the deadline (20 s after its search began) without early assembly
        gaps = [b["time"] - a["time"] for a, b in zip(full, full[1:])]
        assert gaps and max(gaps) < matchmaking_time / 2, (gaps, r["reports"])
        assert_quiet(swarm.log(r["rank"]))
    assert_one_process(results, "sgd", epochs)


def test_equal_shares_give_peers_of_different_speeds_the_same_samples_per_round(swarm):
    """``TrackerConfig(shares="equal")``, federated learning's schedule: peers 1x, 2x and 4x as slow each compute a
    third of the global batch per round (to the nearest step), where speed shares would give the fastest four
    times the slowest's; the result is still one process on the union of each epoch's batches."""
    epochs, n, batch, target = 6, 3, 8, 144
    for rank, sleep in enumerate([0.02, 0.04, 0.08]):
        swarm.start(rank, batch_size=batch, target_batch_size=target, inner="sgd", epochs=epochs, expect_peers=n,
                    step_sleep=sleep, tracker={"shares": "equal"})
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(n)]
    per_epoch = {}
    for r in results:
        assert r["epoch"] == epochs
        assert_quiet(swarm.log(r["rank"]))
        for rep in r["reports"]:
            if not rep["caught_up"]:
                per_epoch.setdefault(rep["epoch"], {})[r["rank"]] = rep["samples"]
    # the first round starts before the speeds are known; from the second, every peer stops at 48 samples (a round
    # that one peer missed, committed by the other two, is not counted: that peer caught up by downloading)
    full = [by_rank for epoch, by_rank in per_epoch.items() if epoch > 1 and len(by_rank) == n]
    assert len(full) >= 3, (per_epoch, [r["reports"] for r in results])
    assert all(abs(samples - target / n) <= batch / 2 for by_rank in full for samples in by_rank.values()), per_epoch
    assert_one_process(results, "sgd", epochs)


@pytest.mark.extended
def test_peers_whose_progress_records_are_sharded_still_equal_one_process(swarm):
    """Five peers with ``shard_size=2, exact_up_to=2`` keep their progress records under several DHT keys (level 1 or
    2) and each reads one key per period: the epoch trigger works from a sample of the swarm (the path of a swarm of
    hundreds), rounds still gather the peers, every epoch averages about one global batch, and the result is still
    exactly one process on the union of each epoch's batches."""
    n, epochs, target = 5, 7, 320
    for rank in range(n):
        swarm.start(rank, batch_size=8, target_batch_size=target, inner="sgd", epochs=epochs, expect_peers=n,
                    step_sleep=0.05, tracker={"shard_size": 2, "exact_up_to": 2, "sampled_period": 0.5})
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(n)]
    per_epoch = {}
    for r in results:
        assert r["epoch"] == epochs
        assert max(rep["tracker_level"] for rep in r["reports"]) >= 1, r["reports"]  # the sampled path ran
        assert_quiet(swarm.log(r["rank"]))
        for rep in r["reports"]:
            if not rep["caught_up"]:
                per_epoch.setdefault(rep["epoch"], {})[r["rank"]] = rep["samples"]
    # the samples of the rounds every peer took part in: each peer stops at its share of the target to the nearest
    # step (up to one step short); a trigger that misread the sampled records would fire at a multiple or a
    # fraction of the target (a shard held for the whole swarm, or not extrapolated)
    totals = [sum(by_rank.values()) for by_rank in per_epoch.values() if len(by_rank) == n]
    assert len(totals) >= 3 and all(target - n * 8 <= t <= 1.5 * target for t in totals), per_epoch
    assert_one_process(results, "sgd", epochs)


def test_late_joiner_downloads_state_and_follows_the_global_lr_schedule(swarm):
    common = dict(batch_size=16, target_batch_size=240, inner="sgd", epochs=7, step_sleep=0.03, scheduler=True)
    swarm.start(0, expect_peers=2, **common)
    swarm.start(1, expect_peers=2, **common)
    deadline = time.monotonic() + 60
    while "epoch 2:" not in swarm.log(0) and time.monotonic() < deadline:
        time.sleep(0.1)
    swarm.start(2, expect_peers=1, **common)
    swarm.wait(timeout=180)
    results = [swarm.result(r) for r in range(3)]
    late = results[2]
    assert late["reports"][0]["caught_up"] and late["reports"][0]["epoch"] >= 2, late["reports"]
    for r in results:
        assert r["epoch"] == 7
        assert r["lrs"][7] == pytest.approx(0.1 * 0.5**7)
        assert_quiet(swarm.log(r["rank"]))
    for r in results[1:]:
        for got, want in zip(r["params"], results[0]["params"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_bf16_peers_train_together_and_a_different_model_is_kept_apart(swarm):
    """Two bf16 peers average with each other; a float32 peer of the same run_id is told apart, never mixed in."""
    common = dict(batch_size=16, target_batch_size=160, inner="sgd", epochs=3, step_sleep=0.03)
    swarm.start(0, dtype="bfloat16", expect_peers=2, **common)
    swarm.start(1, dtype="bfloat16", expect_peers=2, **common)
    swarm.start(2, dtype="float32", expect_peers=1, **common)
    swarm.wait(timeout=150)
    bf16 = [swarm.result(r) for r in (0, 1)]
    for r in bf16:
        assert r["params"][0].dtype == torch.bfloat16
        assert all(rep["group_size"] in (1, 2) for rep in r["reports"])
    # hivemind's all-reduce returns each peer "own + (average - own)", exact in fp32 only up to round-off, so bf16
    # peers can differ by a few bf16 ulps after momentum; they must still be far closer than independent training
    for got, want in zip(bf16[0]["params"], bf16[1]["params"]):
        torch.testing.assert_close(got, want, atol=5e-3, rtol=2e-2)
    lone = swarm.result(2)
    assert lone["epoch"] == 3 and all(rep["group_size"] == 1 for rep in lone["reports"]), lone["reports"]
    assert "train a different model" in swarm.log(2)


@pytest.mark.parametrize("victim, delay", [(0, 0.0), pytest.param(2, 0.6, marks=pytest.mark.extended)])
def test_a_peer_killed_at_any_moment_does_not_stall_or_corrupt_the_others(swarm, victim, delay):
    """SIGKILL one of four peers right after a round (everyone computing, victim 0 being the peer whose address the
    others joined through) or 0.6 s later (matchmaking for the next round is under way)."""
    epochs = 9
    for rank in range(4):
        swarm.start(rank, batch_size=16, target_batch_size=256, inner="sgd", epochs=epochs, expect_peers=4,
                    step_sleep=0.03, averaging_timeout=15.0)
    deadline = time.monotonic() + 90
    while "epoch 3:" not in swarm.log(victim) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(delay)
    swarm.kill(victim)
    survivors = [r for r in range(4) if r != victim]
    swarm.wait(timeout=150)
    results = [swarm.result(r) for r in survivors]
    for r in results:
        assert r["epoch"] == epochs
        assert_quiet(swarm.log(r["rank"]))
        # no round waited out a long timeout for the dead peer
        assert max(rep["seconds"] for rep in r["reports"]) < 12.0, r["reports"]
        assert all(torch.isfinite(p).all() for p in r["params"])
    for r in results[1:]:
        for got, want in zip(r["params"], results[0]["params"]):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    last = [rep for rep in results[0]["reports"] if not rep["caught_up"]][-1]
    assert last["group_size"] == 3  # the swarm went on with the survivors
