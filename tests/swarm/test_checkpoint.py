"""Checkpoints: crash-and-resume equals an uninterrupted run (bitwise, every strategy); killed writers never leave
a broken checkpoint; validation and the rules of several checkpointers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import swarm_opt
from swarm_opt import BestMetric, Checkpointer, ConfigError, IncompatibleStateError, load_checkpoint

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _run(tmp: Path, *args, expect_kill=False):
    """Run resume_peer.py in its own session; afterwards kill the session (a SIGKILLed peer orphans its DHT)."""
    log = tmp / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "tests/swarm/resume_peer.py"), *map(str, args)],
                                stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=REPO, start_new_session=True)
        try:
            proc.wait(120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, text
    else:
        assert proc.returncode == 0, text
        assert "Traceback" not in text and "WARNING" not in text, text


@pytest.mark.swarm
@pytest.mark.timeout(200)
# extended only: local and fedprox keep no state beyond the anchor; diloco's outer optimizer and fednova's step
# counts are strategy state, whose round trip the conformance tests check for every strategy
@pytest.mark.parametrize("strategy", ["grad", pytest.param("local", marks=pytest.mark.extended),
                                      pytest.param("fedprox", marks=pytest.mark.extended), "scaffold",
                                      pytest.param("diloco", marks=pytest.mark.extended),
                                      pytest.param("fednova", marks=pytest.mark.extended)])
def test_crash_and_resume_equals_an_uninterrupted_run(tmp_path, strategy):
    epochs = 6  # 4 steps per epoch; the crash comes 2 steps after the checkpoint of epoch 3
    _run(tmp_path, strategy, epochs, tmp_path / "full_ckpt", tmp_path / "full.pt")
    _run(tmp_path, strategy, epochs, tmp_path / "ckpt", tmp_path / "crashed.pt", 14, expect_kill=True)
    assert not (tmp_path / "crashed.pt").exists()
    assert load_checkpoint(Checkpointer(tmp_path / "ckpt").latest())["epoch"] == 3
    _run(tmp_path, strategy, epochs, tmp_path / "ckpt", tmp_path / "resumed.pt")
    full, resumed = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    for a, b in zip(full, resumed):
        assert torch.equal(a, b)


WRITER = """
import sys, time, torch
from swarm_opt.checkpoint import Checkpointer
class Opt:
    model_schema, local_epoch = "schema", 0
    def state_dict(self): return {"state": {}, "param_groups": [], "swarm_opt": {"epoch": self.local_epoch}}
opt, model = Opt(), torch.nn.Linear(512, 512)
ckpt = Checkpointer(sys.argv[1], keep_last=3)
print("ready", flush=True)
while True:
    opt.local_epoch += 1
    with torch.no_grad():
        model.weight.fill_(opt.local_epoch)
    ckpt.save(opt, model)
"""


@pytest.mark.timeout(120)
def test_a_writer_killed_at_any_moment_never_leaves_a_broken_checkpoint(tmp_path):
    rng = random.Random(0)
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=ENV,
                                start_new_session=True)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.6))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ckpt = Checkpointer(tmp_path, keep_last=3)  # also removes the killed writer's temporary file
        assert not list(tmp_path.glob("*.tmp"))
        assert ckpt.checkpoints(), "the writer saved nothing"
        for path in ckpt.checkpoints():
            state = load_checkpoint(path, expected_schema="schema")
            assert torch.all(state["model"]["weight"] == state["epoch"])
        ckpt.close()


def test_checkpointer_rules_and_validation(tmp_path):
    first = Checkpointer(tmp_path / "a")
    with pytest.raises(ConfigError, match="another Checkpointer already writes"):
        Checkpointer(tmp_path / "a")
    first.close()
    Checkpointer(tmp_path / "a").close()
    with pytest.raises(ConfigError, match="keep nothing"):
        Checkpointer(tmp_path / "b", keep_last=0)
    with pytest.raises(ConfigError, match="'min' or 'max'"):
        BestMetric("loss", mode="lowest")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(IncompatibleStateError, match="not a readable"):
        load_checkpoint(tmp_path / "junk.pt")


class _FakeOpt:
    model_schema = "s"

    def __init__(self):
        self.local_epoch = 0

    def state_dict(self):
        return {"state": {}, "param_groups": [], "swarm_opt": {"epoch": self.local_epoch}}

    def load_state_dict(self, state):
        self.local_epoch = state["swarm_opt"]["epoch"]


def test_keeps_the_last_n_and_the_best_by_metric_and_refuses_another_model(tmp_path):
    opt, model = _FakeOpt(), torch.nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path, every_epochs=2, keep_last=2, best=BestMetric("accuracy", mode="max"))
    accuracy = {2: 0.5, 4: 0.9, 6: 0.7, 8: 0.8}
    for epoch in range(1, 9):
        opt.local_epoch = epoch
        ckpt.maybe_save(opt, model, metrics={"accuracy": accuracy.get(epoch, 0.0)})
    assert [p.name for p in ckpt.checkpoints()] == ["epoch-00000006.pt", "epoch-00000008.pt"]
    assert load_checkpoint(tmp_path / "best.pt")["epoch"] == 4
    with pytest.raises(IncompatibleStateError, match="different model"):
        load_checkpoint(ckpt.latest(), expected_schema="another")
    ckpt.close()
    assert swarm_opt.Checkpointer is Checkpointer
