"""A checkpoint write that meets a full disk or a read-only directory: one clear error, nothing lost, the next save
works once the disk is fixed (real file systems: a tmpfs of a few MiB, see tests/disks.py)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

import swarm_opt
from tests.disks import tiny_disk


class _Optimizer:
    """What a Checkpointer reads of an Optimizer: its epoch, model schema and state (here 1.2 MB of it)."""

    def __init__(self) -> None:
        self.local_epoch, self.model_schema = 1, "schema"
        self.state = {"momentum": torch.arange(300_000, dtype=torch.float32)}

    def state_dict(self) -> dict:
        return {"swarm_opt": {"epoch": self.local_epoch}, **self.state}


def test_a_full_disk_and_a_read_only_directory_raise_one_line_and_keep_the_previous_checkpoint(tmp_path):
    opt, model = _Optimizer(), torch.nn.Linear(4, 2)
    with tiny_disk(tmp_path / "disk", size="4m") as disk:
        ckpt = swarm_opt.Checkpointer(disk.path / "ckpt", every_epochs=1, keep_last=2)
        first = ckpt.save(opt, model)

        disk.fill()
        opt.local_epoch = 2
        with pytest.raises(swarm_opt.CheckpointWriteError) as full:
            ckpt.maybe_save(opt, model)
        assert full.value.errno == errno.ENOSPC and isinstance(full.value, OSError)
        message = str(full.value)
        assert "\n" not in message and "No space left on device (ENOSPC)" in message, message
        assert "epoch-00000002.pt" in message and f"the previous checkpoint {first} is intact" in message
        assert ckpt.maybe_save(opt, model) is None  # the failed epoch is not retried at every step
        assert ckpt.checkpoints() == [first] and not list(ckpt.directory.glob(".*.tmp"))  # no partial file
        assert swarm_opt.load_checkpoint(first)["epoch"] == 1

        disk.free()
        opt.local_epoch = 3
        third = ckpt.maybe_save(opt, model)
        assert ckpt.checkpoints() == [first, third]

        disk.read_only(ckpt.directory)
        opt.local_epoch = 4
        with pytest.raises(swarm_opt.CheckpointWriteError, match=r"Read-only file system \(EROFS\); .*remount") \
                as read_only:
            ckpt.save(opt, model)
        assert f"the previous checkpoint {third} is intact" in str(read_only.value)
        assert ckpt.checkpoints() == [first, third]
        torch.testing.assert_close(swarm_opt.load_checkpoint(third)["optimizer"]["momentum"], opt.state["momentum"])
        ckpt.close()

        # a directory that cannot be written is refused when the checkpointer starts, before any training
        with pytest.raises(swarm_opt.CheckpointWriteError, match=r"cannot write checkpoints in .*\(EROFS\)"):
            swarm_opt.Checkpointer(ckpt.directory)
        with pytest.raises(swarm_opt.CheckpointWriteError, match=r"cannot create the checkpoint directory"):
            swarm_opt.ScoredCheckpointer(ckpt.directory / "best", score=swarm_opt.Latest())


def test_a_directory_that_turns_read_only_between_a_write_and_the_pruning_keeps_the_new_checkpoint(tmp_path,
                                                                                                   monkeypatch,
                                                                                                   caplog):
    """The race the CLI met (``test_cli_disk``): the new checkpoint written, the old one's deletion refused. The save
    succeeded: one line, and a later save deletes what is left over."""
    opt, model = _Optimizer(), torch.nn.Linear(4, 2)
    ckpt = swarm_opt.Checkpointer(tmp_path / "ckpt", every_epochs=1, keep_last=2)
    first = ckpt.save(opt, model)
    opt.local_epoch = 2
    second = ckpt.save(opt, model)
    real_unlink = type(first).unlink

    def refused(self, missing_ok=False):  # the numbered checkpoints' deletion only (the write's own files go)
        if self.name.startswith("epoch-"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(type(first), "unlink", refused)
    opt.local_epoch = 3
    with caplog.at_level("WARNING", logger="swarm_opt.checkpoint"):
        third = ckpt.save(opt, model)
    assert ckpt.checkpoints() == [first, second, third]
    # (this logger's records only: a test that ran before in this process may still have a thread that logs)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and r.name == "swarm_opt.checkpoint"] == [
        f"Could not delete the old checkpoint {first} (Read-only file system); it is kept until a later save deletes "
        f"it"]
    monkeypatch.setattr(type(first), "unlink", real_unlink)
    opt.local_epoch = 4
    fourth = ckpt.save(opt, model)
    assert ckpt.checkpoints() == [third, fourth]
    ckpt.close()
