"""Scored checkpointers (best by loss, by a metric, latest, a function) side by side, and one writer per file: a
second writer of the same file is refused, in the same process and in another one, until the first lets go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import swarm_opt
from swarm_opt import BestLoss, BestMetric, Checkpointer, ConfigError, Latest, ScoredCheckpointer, load_checkpoint
from tests.swarm.test_checkpoint import _FakeOpt

REPO = Path(__file__).resolve().parents[2]


#: epoch -> metrics of a scripted run: loss is lowest at 3, accuracy highest at 4, F1 (a custom score) at 2
METRICS = {1: dict(loss=0.9, accuracy=0.50, f1=0.1), 2: dict(loss=0.5, accuracy=0.70, f1=0.9),
           3: dict(loss=0.2, accuracy=0.60, f1=0.3), 4: dict(loss=0.4, accuracy=0.80, f1=0.2),
           5: dict(loss=float("nan"), accuracy=0.75)}


def _f1(epoch, metrics):
    return metrics.get("f1")


def _train(writers, epochs=range(1, 6)):
    opt, model = _FakeOpt(), torch.nn.Linear(2, 2)
    for epoch in epochs:
        opt.local_epoch = epoch
        with torch.no_grad():
            model.weight.fill_(epoch)
        for writer in writers:
            writer.maybe_save(opt, model, metrics=METRICS[epoch])


def _epoch_of(path: Path) -> int:
    state = load_checkpoint(path, expected_schema="s")
    assert torch.all(state["model"]["weight"] == state["epoch"])  # the file holds the state of that epoch
    return state["epoch"]


def test_each_scored_checkpointer_keeps_its_own_best_under_its_own_name(tmp_path):
    writers = [ScoredCheckpointer(tmp_path, score=BestLoss()),
               ScoredCheckpointer(tmp_path, score=BestMetric("accuracy", mode="max")),
               ScoredCheckpointer(tmp_path, score=Latest()),
               ScoredCheckpointer(tmp_path, score=_f1, name="best-f1"),
               Checkpointer(tmp_path, keep_last=2)]
    _train(writers)
    names = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert names == ["best-accuracy.pt", "best-f1.pt", "best-loss.pt", "epoch-00000004.pt", "epoch-00000005.pt",
                     "latest.pt"]
    assert _epoch_of(tmp_path / "best-loss.pt") == 3  # epoch 5's NaN loss is not scored
    assert _epoch_of(tmp_path / "best-accuracy.pt") == 4
    assert _epoch_of(tmp_path / "latest.pt") == 5
    assert _epoch_of(tmp_path / "best-f1.pt") == 2  # epoch 5 has no f1: not scored
    opt, model = _FakeOpt(), torch.nn.Linear(2, 2)
    assert writers[0].restore(opt, model)["epoch"] == 3 and opt.local_epoch == 3
    assert float(model.weight.detach()[0, 0]) == 3.0
    for writer in writers:
        writer.close()


def test_a_restarted_checkpointer_only_replaces_its_file_with_a_better_state(tmp_path):
    first = ScoredCheckpointer(tmp_path, score=BestMetric("accuracy", mode="max"))
    _train([first], epochs=[2])
    first.close()
    again = ScoredCheckpointer(tmp_path, score=BestMetric("accuracy", mode="max"))
    assert again.best_score == pytest.approx(0.70)
    _train([again], epochs=[1, 3])  # both worse than epoch 2's 0.70
    assert _epoch_of(again.path) == 2
    _train([again], epochs=[4])
    assert _epoch_of(again.path) == 4
    again.close()


def test_two_writers_of_one_file_in_one_process_are_refused(tmp_path):
    loss = ScoredCheckpointer(tmp_path, score=BestLoss())
    with pytest.raises(ConfigError, match=r"already writes .*best-loss.pt \(in this or .*give each its own name="):
        ScoredCheckpointer(tmp_path / ".." / tmp_path.name, score=BestMetric("loss"))  # same file, another spelling
    other = ScoredCheckpointer(tmp_path, score=BestLoss(), name="best-loss-copy")  # another name is fine
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(ConfigError, match="another Checkpointer already writes to .*own directory"):
        Checkpointer(tmp_path)
    for writer in (loss, other, ckpt):
        writer.close()
    ScoredCheckpointer(tmp_path, score=BestLoss()).close()  # released by close()
    Checkpointer(tmp_path).close()


def test_checkpointers_best_file_has_one_writer(tmp_path):
    ckpt = Checkpointer(tmp_path / "a", best=BestLoss())
    with pytest.raises(ConfigError, match="already writes .*best.pt"):
        ScoredCheckpointer(tmp_path / "a", score=Latest(), name="best")
    ckpt.close()
    with ScoredCheckpointerHeld(tmp_path / "a", "best"):
        with pytest.raises(ConfigError, match="already writes .*best.pt"):
            Checkpointer(tmp_path / "a", best=BestLoss())
        Checkpointer(tmp_path / "a").close()  # the numbered checkpoints' lock was released with the refusal


class ScoredCheckpointerHeld:
    def __init__(self, directory, name):
        self.writer = ScoredCheckpointer(directory, score=Latest(), name=name)

    def __enter__(self):
        return self.writer

    def __exit__(self, *exc):
        self.writer.close()


HOLDER = """
import sys, time
from swarm_opt.checkpoint import Checkpointer, Latest, ScoredCheckpointer
held = [ScoredCheckpointer(sys.argv[1], score=Latest()), Checkpointer(sys.argv[1])]
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_writer_in_another_process_is_refused_until_it_dies(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        with pytest.raises(ConfigError, match="in this or another process"):
            ScoredCheckpointer(tmp_path, score=Latest())
        with pytest.raises(ConfigError, match="in this or another process"):
            Checkpointer(tmp_path)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ScoredCheckpointer(tmp_path, score=Latest()).close()  # the kernel released a killed writer's locks
    Checkpointer(tmp_path).close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(score=_f1), "needs name="),
    (dict(score="loss"), "score must be"),
    (dict(score=Latest(), name="epoch-00000003"), "numbered checkpoints"),
    (dict(score=Latest(), name="../elsewhere"), "plain file name"),
    (dict(score=Latest(), every_epochs=0), "every_epochs"),
])
def test_scored_checkpointer_validation(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ScoredCheckpointer(tmp_path, **kwargs)


def test_scores_are_exported():
    assert BestLoss().name == "loss" and BestLoss()(1, {"loss": 2.0}) == -2.0
    assert BestMetric("acc", mode="max")(1, {"acc": True}) is None  # not a number
    assert {swarm_opt.ScoredCheckpointer, swarm_opt.BestLoss, swarm_opt.Latest} <= \
        {getattr(swarm_opt, n) for n in swarm_opt.__all__}


@pytest.mark.timeout(60)
def test_a_forked_child_does_not_keep_a_writers_lock(tmp_path):
    """The averager process is forked from the training process, maybe after a checkpointer was created: closing the
    checkpointer must free its files for a new one, whatever the child still holds."""
    ckpt = Checkpointer(tmp_path)
    child = os.fork()
    if child == 0:  # the child only outlives the parent's close, as an averager process would
        time.sleep(3)
        os._exit(0)
    try:
        ckpt.close()
        Checkpointer(tmp_path).close()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
