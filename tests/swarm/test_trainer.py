"""``swarm_opt.transformers.SwarmCallback`` in real loopback swarms: three Hugging Face ``Trainer`` peers, each in its
own process (``tests/swarm/trainer_peer.py``, launched and reaped by ``conftest.py``'s ``Swarm``), training a tiny
GPT-2 built from a config."""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import time

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.swarm.conftest import (  # noqa: E402
    OLDER_CHECKPOINT,
    PEER_SCRIPT,
    assert_quiet,
    assert_same_params_at_each_epoch,
)
from tests.swarm.test_grad_averaging import ambiguous_batches  # noqa: E402
from tests.swarm.test_ranks import free_port  # noqa: E402
from tests.swarm.trainer_peer import make_data, make_model, training_arguments  # noqa: E402

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

SCRIPT = PEER_SCRIPT.with_name("trainer_peer.py")
PEERS = 3
#: unequal steps: per_device_train_batch_size x gradient_accumulation_steps = 8, 6 and 10 samples
STEPS = [dict(batch_size=4, accumulate=2), dict(batch_size=6), dict(batch_size=10)]
RECIPE = dict(epochs=6, warmup_steps=2, max_grad_norm=1.0, lr=3e-3)


def one_trainer(results: list, tmp_path, extra=(), norms=None, **recipe) -> list:
    """One ``Trainer``'s optimizer and schedule (``create_optimizer_and_scheduler``: AdamW with weight decay on the
    weights, warmup then linear decay over ``epochs`` steps) applied to the union of the batches every peer committed
    to each epoch (plus ``extra`` (epoch, batches)), the union's gradient clipped to ``max_grad_norm`` first, as
    Trainer clips its accumulated batch."""
    from transformers import Trainer

    data = make_data()
    model = make_model()
    trainer = Trainer(model=model, args=training_arguments(recipe, str(tmp_path / "reference")))
    trainer.create_optimizer_and_scheduler(num_training_steps=recipe["epochs"])
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    for epoch in range(1, recipe["epochs"] + 1):
        batches = [b for r in results for b in r["committed"].get(epoch, [])]
        batches += [b for e, extra_batches in extra if e == epoch for b in extra_batches]
        assert batches, f"no peer committed batches to epoch {epoch}"
        ids = data[torch.tensor([i for b in batches for i in b])]
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["max_grad_norm"])
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        sched.step()
    return [p.detach() for p in model.parameters()]


def assert_one_trainer(results: list, tmp_path, **recipe) -> list:
    """The peers end equal to ``one_trainer`` for one of the possible prefixes of the batches a peer dropped when its
    side of a round failed (``test_grad_averaging.possible_references``); returns that reference."""
    ambiguous = list(ambiguous_batches(results))
    choices = [range(len(batches) + 1) for _, batches in ambiguous]
    assert math.prod(len(c) for c in choices) <= 200, ambiguous
    errors = []
    for prefix in itertools.product(*choices):
        extra = [(epoch, batches[:k]) for (epoch, batches), k in zip(ambiguous, prefix)]
        expected = one_trainer(results, tmp_path, extra=extra, **recipe)
        error = max((a - b).abs().max().item() for a, b in zip(results[0]["final"], expected))
        if error < 1e-4:  # float32: AdamW normalises each coordinate, the swarm sums its gradients in other orders
            return expected
        errors.append(error)
    pytest.fail(f"no one-Trainer reference matches the swarm: errors {errors}")


def test_three_trainer_peers_equal_one_trainer_on_the_union_of_their_batches(swarm, tmp_path):
    """Three Trainer peers (distinct data shards, steps of 8, 6 and 10 samples, one accumulating two micro-batches)
    with AdamW, warmup + linear decay over ``max_steps`` global epochs and ``max_grad_norm=1.0`` end with the
    parameters of one Trainer that takes each epoch's union of their batches as one batch: its schedule, its weight
    decay groups, and clipping of the accumulated gradient (active in most epochs) all match."""
    # epochs of ~1 s (8 steps of each peer, 0.1 s apart): in epochs of 0.15 s a peer that a loaded machine slowed
    # missed a round by 0.8 s, and every later epoch was over before its download ended (CI)
    for rank in range(PEERS):
        swarm.start(rank, script=SCRIPT, peers=PEERS, expect_peers=PEERS, target_batch_size=192, step_sleep=0.1,
                    **STEPS[rank], **RECIPE)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(PEERS)]
    epochs = RECIPE["epochs"]
    assert_same_params_at_each_epoch(results, epochs)
    for r in results:
        assert r["epoch"] == epochs
        assert sum(rep["group_size"] == PEERS for rep in r["rounds"]) >= epochs // 2, r["rounds"]
        assert r["max_grad_norm"] == 1.0  # given back to Trainer after each step
        assert r["logged"]["swarm/peers"] == PEERS and r["logged"]["swarm/epoch"] >= 1
    norms: list = []
    expected = assert_one_trainer(results, tmp_path, norms=norms, **RECIPE)
    assert sum(n > RECIPE["max_grad_norm"] for n in norms) >= epochs // 2, norms  # clipping was in effect
    for got, want in zip(results[0]["final"], expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert any((a - b).abs().max() > 2e-3 for a, b in zip(expected, make_model().parameters()))  # it trained
    assert_quiet(swarm)


@pytest.mark.extended
def test_a_two_process_ddp_trainer_and_a_one_process_trainer_equal_one_trainer_on_the_union_of_batches(swarm,
                                                                                                        tmp_path):
    """A machine of two Trainer processes launched as torchrun does (DDP over gloo, 4 samples each per step) is one
    peer beside a one-process Trainer (6 samples per step): its processes hold the same parameters at every epoch
    and the swarm ends with those of one Trainer on the union of every epoch's batches (of all three processes);
    the swarm counts two peers."""
    port = free_port()
    machine = dict(script=SCRIPT, peers=2, machine=0, expect_peers=2, target_batch_size=96, batch_size=4, **RECIPE)
    for rank in range(2):
        swarm.start(rank, local=dict(rank=rank, size=2, port=port), **machine)
    swarm.start(2, script=SCRIPT, peers=2, machine=1, expect_peers=2, target_batch_size=96, batch_size=6, **RECIPE)
    swarm.wait(timeout=200)
    results = [swarm.result(r) for r in range(3)]
    epochs = RECIPE["epochs"]
    assert_same_params_at_each_epoch(results, epochs)
    for r in results:
        assert r["epoch"] == epochs
        assert sum(rep["group_size"] == 2 for rep in r["rounds"]) >= epochs // 2, r["rounds"]
    assert results[0]["logged"]["swarm/peers"] == 2 and results[2]["logged"]["swarm/peers"] == 2  # one record
    for a, b in zip(results[0]["committed"].values(), results[1]["committed"].values()):
        assert len(a) == len(b) and not set(map(tuple, a)) & set(map(tuple, b))  # each process its own batches
    expected = assert_one_trainer(results, tmp_path, **RECIPE)
    for got, want in zip(results[0]["final"], expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert_quiet(swarm)


@pytest.mark.extended
def test_a_killed_trainer_peer_resumes_from_its_checkpoint_into_the_running_swarm(swarm, tmp_path):
    """Peer 2 saves Trainer checkpoints every 2 of its steps; it is SIGKILLed mid-run and restarted with
    ``trainer.train(resume_from_checkpoint=...)`` on a copy of its last checkpoint, whose ``optimizer.pt`` holds the
    swarm's state: it resumes at the checkpoint's global epoch, catches up with the swarm, trains two more rounds with
    the others and holds everyone's parameters at every epoch."""
    until = str(tmp_path / "resumed_trained")
    common = dict(script=SCRIPT, peers=PEERS, target_batch_size=96, max_steps=1000, checkpoint=True,
                  save_steps=2, until_file=until, **RECIPE | dict(epochs=8))
    for rank in range(PEERS):
        swarm.start(rank, expect_peers=PEERS, **STEPS[rank], **common)
    deadline = time.monotonic() + 120
    while "epoch 2:" not in swarm.log(2) and time.monotonic() < deadline:
        time.sleep(0.1)
    resume = tmp_path / "resume"  # its replacement imports while they train, then waits for this checkpoint
    swarm.start(3, expect_peers=PEERS - 1, resume=str(resume), signal_after_rounds=2, **STEPS[2], **common)
    while not ("epoch 3:" in swarm.log(2) and (tmp_path / "peer3.pt.ready").exists()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    swarm.kill(2)
    output = tmp_path / "peer2.pt.trainer"
    complete = [d for d in output.iterdir() if (d / "trainer_state.json").exists() and (d / "optimizer.pt").exists()]
    assert complete, swarm.log(2)
    last = max(complete, key=lambda d: int(d.name.split("-")[1]))
    saved_epoch = torch.load(last / "optimizer.pt", weights_only=True)["swarm_opt"]["epoch"]
    assert saved_epoch >= 2  # the checkpoint holds the swarm's state
    shutil.copytree(last, resume)
    swarm.wait(timeout=180)
    survivors = [swarm.result(r) for r in (0, 1)]
    resumed = swarm.result(3)
    if resumed["resumed_at"] != saved_epoch:  # the swarm had moved on: it loaded the checkpoint, then caught up at once
        assert re.search(f"The checkpoint is at epoch {saved_epoch}, {OLDER_CHECKPOINT}", swarm.log(3)), \
            resumed["resumed_at"]
    assert resumed["global_step"] > int(last.name.split("-")[1])  # Trainer's own state resumed as well
    assert sum(not rnd["caught_up"] and rnd["group_size"] == PEERS for rnd in resumed["rounds"]) >= 2
    assert_same_params_at_each_epoch(survivors + [resumed], 8)
