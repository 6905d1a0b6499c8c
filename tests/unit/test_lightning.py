"""SwarmCallback without a swarm: construction, the setups it refuses, failures and interruptions mid-fit.

The refusals happen before any DHT starts; the failures after it (a strategy that refuses the inner optimizer, an
exception or a Ctrl-C inside fit) must leave no process behind."""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.demos.boring_classes import BoringModel, ManualOptimBoringModel  # noqa: E402

import swarm_opt  # noqa: E402
from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError  # noqa: E402
from swarm_opt.lightning import SwarmCallback  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def callback(**overrides) -> SwarmCallback:
    kwargs = dict(run_id="unit", target_batch_size=8, host_maddrs=LOOPBACK, matchmaking_time=0.5,
                  averaging_timeout=2.0)
    return SwarmCallback(**dict(kwargs, **overrides))


def trainer(cb: SwarmCallback, **overrides) -> L.Trainer:
    kwargs = dict(max_steps=4, callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, accelerator="cpu", devices=1, limit_val_batches=0)
    return L.Trainer(**dict(kwargs, **overrides))


def test_construction_has_no_side_effects_and_pickles(no_leftovers):
    cb = callback(strategy=swarm_opt.Scaffold(), tracker=swarm_opt.TrackerConfig())
    assert cb.dht is None and cb.optimizer is None
    copy = pickle.loads(pickle.dumps(cb))
    assert copy.config == cb.config and isinstance(copy.strategy, swarm_opt.Scaffold)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(strategy="scaffold"), ConfigTypeError, "swarm_opt strategy"),
    (dict(strategy=torch.optim.SGD), ConfigTypeError, "swarm_opt strategy"),
    (dict(run_id="has space"), ConfigError, "run_id"),
    (dict(target_batch_size=0), ConfigError, "target_batch_size"),
    (dict(batch_size=-1), ConfigError, "batch_size"),
    (dict(matchmaking_time=5.0, averaging_timeout=1.0), ConfigError, "averaging_timeout"),
    (dict(initial_peers="/ip4/127.0.0.1/tcp/1"), ConfigTypeError, "list of multiaddrs"),
    (dict(initial_peers=["/ip4/127.0.0.1/tcp/1"]), ConfigError, "/p2p/PEER_ID"),
    (dict(dht=object()), ConfigTypeError, "hivemind.DHT"),
    (dict(tracker=dict(record_ttl=1)), ConfigTypeError, "TrackerConfig"),
    (dict(offload=True), ConfigTypeError, "swarm_opt.Offload"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        callback(**kwargs)


class TwoSchedulers(BoringModel):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]


class Plateau(BoringModel):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                                                   "monitor": "loss"}}


class NoOptimizer(BoringModel):
    def configure_optimizers(self):
        return None


class Adam(BoringModel):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


@pytest.mark.parametrize("module, match", [
    (ManualOptimBoringModel, "automatic_optimization = False.*swarm_opt.Optimizer"),
    (TwoSchedulers, "one LR scheduler.*SequentialLR"),
    (Plateau, "ReduceLROnPlateau.*StepLR"),
    (NoOptimizer, "no optimizer"),
])
@pytest.mark.filterwarnings("ignore:`LightningModule.configure_optimizers` returned `None`")
def test_unsupported_modules_are_refused_before_any_dht_starts(module, match, no_leftovers):
    cb = callback()
    with pytest.raises(ConfigError, match=match):
        trainer(cb).fit(module())
    assert cb.dht is None


def test_a_swarm_optimizer_from_configure_optimizers_is_refused():
    cb = callback()

    class Swarmy(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            swarm = object.__new__(swarm_opt.Optimizer)  # only its type matters here: refused before it is used
            swarm.__dict__.update(inner=opt)
            return swarm

    with pytest.raises(ConfigError, match="return the plain torch optimizer"):
        trainer(cb).fit(Swarmy())


def test_several_optimizers_are_refused_by_lightning_itself():
    class Two(BoringModel):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(RuntimeError, match="multiple optimizers is only supported with manual optimization"):
        trainer(callback()).fit(Two())


def test_lightning_distributed_strategies_other_than_ddp_are_refused(monkeypatch, no_leftovers):
    """DDP's own strategy is one peer of several ranks (tests/swarm/test_lightning.py); any other, even one built
    on it (DeepSpeed's, FSDP's), or DDP started by spawning, is refused at setup."""
    from lightning.pytorch.strategies import DDPStrategy

    class Sharded(DDPStrategy):  # stands for DeepSpeedStrategy, which subclasses DDPStrategy
        pass

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as probe:  # a free port for the one-process group Lightning's DDP sets up first
        probe.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(probe.getsockname()[1]))
    with pytest.raises(ConfigError, match="not run under Lightning's Sharded: use Trainer\\(strategy='ddp'"):
        trainer(callback(), strategy=Sharded()).fit(BoringModel())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_a_strategy_that_refuses_the_inner_optimizer_stops_the_dht_it_started(no_leftovers):
    cb = callback(strategy=swarm_opt.Scaffold())
    with pytest.raises(ConfigError, match="Scaffold supports torch.optim.SGD"):
        trainer(cb).fit(Adam())
    assert cb.dht is None and cb.optimizer is None


def test_a_batch_whose_size_cannot_be_read_names_the_option(no_leftovers):
    class Opaque(BoringModel):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(8), batch_size=2, collate_fn=lambda items: object())

        def training_step(self, batch, batch_idx):
            return self.step(torch.ones(2, 32))

    with pytest.raises(ConfigError, match="SwarmCallback\\(batch_size=N\\)"):
        trainer(callback()).fit(Opaque())


class Fails(BoringModel):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise self.error
        return super().training_step(batch, batch_idx)


def test_an_exception_inside_fit_leaves_the_swarm_and_stops_everything(no_leftovers):
    cb = callback()
    with pytest.raises(ValueError, match="boom"):
        trainer(cb).fit(Fails(ValueError("boom")))
    assert cb.dht is None and cb.optimizer is None


def test_ctrl_c_inside_fit_leaves_the_swarm_and_stops_everything(no_leftovers):
    cb = callback()
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown ends in sys.exit(1)
            trainer(cb).fit(Fails(KeyboardInterrupt()))
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores further Ctrl-C while it shuts down
    assert cb.dht is None and cb.optimizer is None


def test_single_peer_fit_wraps_the_optimizer_and_moves_the_scheduler(no_leftovers):
    cb = callback()
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["optimizer"] = trainer.optimizers[0]
            seen["schedulers"] = list(trainer.lr_scheduler_configs)

    t = trainer(cb, max_steps=12, callbacks=[cb, Probe()])
    t.fit(BoringModel())  # batches of 1, target 8: one global epoch per 8 steps
    opt = seen["optimizer"]
    assert isinstance(opt, swarm_opt.Optimizer) and opt is t.optimizers[0]
    assert seen["schedulers"] == []
    assert opt.local_epoch == 1 and opt.scheduler is not None
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # BoringModel's StepLR(step_size=1): once, globally
    assert t.callback_metrics["swarm/epoch"] == 1
    assert "swarm/peers" in t.callback_metrics and "swarm/samples_per_second" in t.callback_metrics
    assert cb.dht is None and cb.optimizer is None  # left at teardown


def test_offload_moves_the_modules_optimizer_onto_host_copies_and_trains_the_same(no_leftovers, recwarn):
    """``offload=Offload()``: the module's optimizer steps host copies of the parameters (its param groups now point
    at them), its scheduler stays bound, and a single-peer fit ends with the parameters of the same fit without
    offload."""
    def fit(offload):
        L.seed_everything(0, verbose=False)
        module, cb = BoringModel(), callback(offload=offload)
        seen = {}

        class Probe(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                seen["optimizer"] = trainer.optimizers[0]

        trainer(cb, max_steps=12, callbacks=[cb, Probe()]).fit(module)
        return [p.detach().clone() for p in module.parameters()], seen["optimizer"]

    plain, _ = fit(None)
    offloaded, opt = fit(swarm_opt.Offload(pin_memory=False))
    model_params = set(map(id, opt._offload.model))
    assert model_params and not any(id(p) in model_params for group in opt.param_groups for p in group["params"])
    assert opt.local_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.01)  # StepLR moved along
    for a, b in zip(plain, offloaded):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not [w for w in recwarn if "swarm_opt" in str(w.filename) or "lr_scheduler" in str(w.message)]


def test_offload_with_lightnings_gradient_clipping_by_value_is_refused_before_any_dht_starts(no_leftovers):
    """Clipping by value stays Lightning's, which would clip the host copies (clipping by norm is the swarm's)."""
    cb = callback(offload=swarm_opt.Offload(pin_memory=False))
    with pytest.raises(ConfigError, match="gradient_clip_val: Lightning would clip the host"):
        trainer(cb, gradient_clip_val=1.0, gradient_clip_algorithm="value").fit(BoringModel())
    assert cb.dht is None


@pytest.mark.parametrize("offload", [None, pytest.param(swarm_opt.Offload(pin_memory=False),
                                                        marks=pytest.mark.extended)], ids=["plain", "offload"])
def test_lightnings_norm_clipping_becomes_the_swarm_optimizers(offload, no_leftovers):
    """``gradient_clip_val`` (by norm) is the swarm optimizer's ``clip_grad_norm`` during the fit (Lightning clips
    nothing itself), with or without offload (then no longer refused), and the trainer's own setting is given back
    at the end. One epoch of 8 steps: the clipped fit differs from the unclipped one, and offload changes nothing."""
    def fit(clip, offload):
        L.seed_everything(0, verbose=False)
        module, cb = BoringModel(), callback(offload=offload)
        seen = {}

        class Probe(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                opt = trainer.optimizers[0]
                seen.update(lightning=trainer.gradient_clip_val, norm=opt.grad_norm,
                            swarm=None if opt._clipping is None else opt._clipping.max_norm)

        t = trainer(cb, max_steps=12, callbacks=[cb, Probe()], gradient_clip_val=clip)
        t.fit(module)
        assert t.gradient_clip_val == clip
        return [p.detach().clone() for p in module.parameters()], seen, t

    unclipped, _, _ = fit(None, None)
    clipped, seen, t = fit(0.01, offload)
    assert seen["lightning"] is None and seen["swarm"] == 0.01
    assert seen["norm"] > 0.01 and t.callback_metrics["swarm/grad_norm"] == pytest.approx(seen["norm"])
    assert max((a - b).abs().max() for a, b in zip(clipped, unclipped)) > 1e-4
    if offload is not None:
        plain, _, _ = fit(0.01, None)
        for a, b in zip(plain, clipped):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_checkpoint_of_another_strategy_is_refused(tmp_path, no_leftovers):
    cb = callback()
    t = trainer(cb, max_steps=2)
    t.fit(BoringModel())
    t.save_checkpoint(tmp_path / "grad.ckpt")
    other = callback(strategy=swarm_opt.LocalUpdates())
    with pytest.raises(IncompatibleStateError, match="strategy 'grad', this callback uses 'local'"):
        trainer(other, max_steps=4).fit(BoringModel(), ckpt_path=tmp_path / "grad.ckpt")


def test_import_swarm_opt_does_not_import_lightning():
    code = "import sys, swarm_opt; assert 'lightning' not in sys.modules and 'swarm_opt.lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_the_callback_without_lightning_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "swarm_opt.lightning"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)  # what an environment without lightning looks like
    with pytest.raises(ImportError, match=r"pip install swarm_opt\[lightning\]"):
        importlib.import_module("swarm_opt.lightning")
