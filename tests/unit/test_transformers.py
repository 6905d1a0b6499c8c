"""``swarm_opt.transformers.SwarmCallback`` in one process: the setups it refuses (before any DHT starts), one peer
alone training a tiny GPT-2 built from a config, and resuming from its Trainer checkpoint."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import Trainer, TrainingArguments  # noqa: E402

import swarm_opt  # noqa: E402
from swarm_opt.errors import ConfigError, ConfigTypeError  # noqa: E402
from swarm_opt.transformers import SwarmCallback, _rewrap, _unwrap, check_arguments  # noqa: E402
from tests.swarm.trainer_peer import LoggingCollator, Shard, make_data, make_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def callback(**overrides) -> SwarmCallback:
    kwargs = dict(run_id="unit_trainer", target_batch_size=16, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                  matchmaking_time=0.5, averaging_timeout=2.0)
    return SwarmCallback(**dict(kwargs, **overrides))


def arguments(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, learning_rate=1e-3, warmup_steps=1, max_grad_norm=0.5,
                  report_to="none", use_cpu=True, remove_unused_columns=False, disable_tqdm=True, logging_steps=1,
                  save_strategy="no")
    return TrainingArguments(**dict(kwargs, **overrides))


def trainer(cb: SwarmCallback, args: TrainingArguments, **kwargs) -> Trainer:
    data = Shard(make_data(), list(range(64)), 10)
    return Trainer(model=make_model(), args=args, train_dataset=data, eval_dataset=data,
                   data_collator=LoggingCollator(), callbacks=[cb], **kwargs)


def test_construction_starts_nothing_and_checks_the_options():
    cb = callback()
    assert cb.dht is None and cb.optimizer is None
    with pytest.raises(ConfigTypeError, match="list of multiaddrs"):
        callback(initial_peers="/ip4/127.0.0.1/tcp/1")


@pytest.mark.parametrize("overrides, match", [
    (dict(max_steps=-1), r"max_steps=N.*global epochs"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps", eval_steps=1), "'linear', 'cosine'"),
])
def test_arguments_that_cannot_work_in_a_swarm_are_refused_when_the_trainer_is_built(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        trainer(callback(), arguments(tmp_path, **overrides))


@pytest.mark.parametrize("prop, value, match", [
    ("world_size", 2, r"one single-process Trainer per device.*same run_id"),
    ("n_gpu", 4, r"4 GPUs with DataParallel.*CUDA_VISIBLE_DEVICES"),
])
def test_distributed_trainers_are_refused_with_one_peer_per_device(tmp_path, monkeypatch, prop, value, match):
    args = arguments(tmp_path)
    monkeypatch.setattr(TrainingArguments, prop, property(lambda self: value))
    with pytest.raises(ConfigError, match=match):
        check_arguments(args)


def test_trainers_ddp_is_accepted_and_its_sharded_modes_are_refused_naming_ddp(tmp_path, monkeypatch):
    """torchrun's DDP makes the machine's processes one peer (tests/swarm/test_trainer.py); FSDP and DeepSpeed shard
    the parameters, which the local group does not average: the error names DDP."""
    from transformers.training_args import ParallelMode

    args = arguments(tmp_path)
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    monkeypatch.setattr(TrainingArguments, "parallel_mode", property(lambda self: ParallelMode.DISTRIBUTED))
    check_arguments(args)
    args.fsdp = "full_shard"
    with pytest.raises(ConfigError, match=r"Trainer's FSDP .*shards.*use DDP \(torchrun --nproc-per-node N"):
        check_arguments(args)


def test_a_scheduler_that_is_not_lambda_lr_is_refused_before_any_dht_starts(tmp_path, no_leftovers):
    cb = callback()
    model_trainer = trainer(cb, arguments(tmp_path))
    opt = torch.optim.AdamW(model_trainer.model.parameters(), lr=1e-3)
    model_trainer.optimizer, model_trainer.lr_scheduler = opt, torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ConfigError, match="needs a LambdaLR"):
        model_trainer.train()
    assert cb.dht is None


def test_a_swarm_optimizer_given_to_trainer_is_refused():
    swarm = object.__new__(swarm_opt.Optimizer)  # only its type matters here: refused before it is used
    wrapper = type("AcceleratedOptimizer", (), dict(optimizer=swarm, scaler=None))()
    with pytest.raises(ConfigError, match="pass the plain torch optimizer"):
        _unwrap(wrapper)


def test_one_peer_trains_to_max_steps_global_epochs_checkpoints_and_resumes(tmp_path, no_leftovers):
    """Alone, the peer steps the swarm every 16 samples (two of its steps of 4 x 2): ``max_steps=3`` ends at global
    epoch 3, after 6 of its steps; logs carry the swarm's figures; its checkpoint's ``optimizer.pt`` holds the swarm
    state; Trainer's optimizer and ``max_grad_norm`` are its own again afterwards. Resumed with ``max_steps=5``, it
    goes on from global epoch 3."""
    cb = callback()
    logged = []

    class Tap(__import__("transformers").TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs))

    first = trainer(cb, arguments(tmp_path, save_strategy="steps", save_steps=100))
    first.add_callback(Tap())
    first.train()
    assert cb.dht is None and cb.optimizer is None  # left at the end of train()
    assert first.state.global_step == 6
    assert type(first.optimizer.optimizer) is torch.optim.AdamW and first.args.max_grad_norm == 0.5
    swarm_logs = [entry for entry in logged if "swarm/epoch" in entry]
    assert swarm_logs and swarm_logs[-1]["swarm/epoch"] == 3 and swarm_logs[-1]["swarm/peers"] == 1
    assert "swarm/grad_norm" in swarm_logs[-1] and "swarm/samples_per_second" in swarm_logs[-1]
    checkpoint = tmp_path / "out" / "checkpoint-6"  # the final save
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-6"]  # none at its steps 3-5, past max_steps of its own
    assert torch.load(checkpoint / "optimizer.pt", weights_only=True)["swarm_opt"]["epoch"] == 3
    assert first.lr_scheduler.last_epoch == 3  # the schedule followed the global epoch

    cb = callback()
    epochs_seen = []

    class Epochs(__import__("transformers").TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            epochs_seen.append(cb.optimizer.local_epoch)

    second = trainer(cb, arguments(tmp_path, max_steps=5))
    second.add_callback(Epochs())
    second.train(resume_from_checkpoint=str(checkpoint))
    assert epochs_seen[0] == 3 and second.lr_scheduler.last_epoch == 5
    assert second.state.global_step == 10


def test_import_swarm_opt_does_not_import_transformers():
    code = ("import sys, swarm_opt; "
            "assert 'transformers' not in sys.modules and 'swarm_opt.transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_the_callback_without_transformers_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "transformers" or m.startswith(("transformers.",
                                                                                "swarm_opt.transformers"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an environment without transformers looks like
    with pytest.raises(ImportError, match=r"pip install swarm_opt\[transformers\]"):
        importlib.import_module("swarm_opt.transformers")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_the_swarm(tmp_path, precision, no_leftovers):
    """With bf16 or fp16 autocast the peer alone reaches global epoch 3 with finite parameters. (On CPU Accelerate
    uses no loss scaler with fp16; the next test covers the scaler's path.)"""
    cb = callback()
    epochs = []

    class Epochs(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            epochs.append(cb.optimizer.local_epoch)

    t = trainer(cb, arguments(tmp_path, **{precision: True}))
    t.add_callback(Epochs())
    t.train()
    assert epochs[-1] == 3 and t.lr_scheduler.last_epoch == 3
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_with_a_loss_scaler_accelerates_wrapper_steps_the_optimizer_put_in_it():
    """Accelerate's wrapper steps through the scaler with a patched copy of the step method it was built with:
    ``_rewrap`` must patch the swarm optimizer's step instead, or the scaler would step the bare optimizer."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    first, second = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    steps = []
    first.register_step_post_hook(lambda *args: steps.append("first"))
    second.register_step_post_hook(lambda *args: steps.append("second"))
    scaler = torch.amp.GradScaler("cpu")
    wrapper = AcceleratedOptimizer(first, scaler=scaler)
    _rewrap(wrapper, second)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    wrapper.step()
    assert steps == ["second"] and not wrapper.step_was_skipped


def test_report_integrations_log_the_swarms_figures(tmp_path, no_leftovers, monkeypatch):
    """Trainer lists its report integrations (``report_to``) before the user's callbacks: the swarm callback moves
    itself before them, so that what they log carries ``swarm/*`` too; Trainer's own flow callback stays first."""
    from transformers.integrations import TensorBoardCallback

    seen = []
    monkeypatch.setattr(TensorBoardCallback, "on_log",
                        lambda self, args, state, control, logs=None, **kwargs: seen.append(dict(logs or {})))
    cb = callback()
    t = trainer(cb, arguments(tmp_path, report_to="tensorboard"))
    names = [type(c).__name__ for c in t.callback_handler.callbacks]
    assert names[0] == "DefaultFlowCallback" and names.index("SwarmCallback") < names.index("TensorBoardCallback")
    t.train()
    assert any("swarm/epoch" in logs and "swarm/peers" in logs for logs in seen), seen
