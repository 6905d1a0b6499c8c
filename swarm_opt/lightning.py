"""``SwarmCallback``: any ``LightningModule`` becomes a swarm peer through one Lightning callback.

An adapter over ``swarm_opt.Optimizer`` with no algorithm of its own. At ``on_fit_start`` it starts a DHT (unless it
was given one) and replaces the module's optimizer with a ``swarm_opt.Optimizer`` around it, so that Lightning's
loop, precision plugins and checkpoints drive the swarm optimizer as they would any optimizer. Lightning's norm
clipping (``Trainer(gradient_clip_val=...)``) becomes the swarm optimizer's ``clip_grad_norm``, which clips the
gradient of the global batch rather than that of each optimizer step.
The module's LR scheduler moves to the swarm optimizer, which steps it once per global epoch. Lightning then
checkpoints and restores the swarm optimizer's whole state (inner optimizer, global epoch, scheduler, strategy
state) as its own optimizer state; the callback's own state names the run and strategy it belongs to.

``lightning`` is an optional dependency: ``pip install swarm_opt[lightning]``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Sequence

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
except ImportError as e:  # pragma: no cover - exercised by a test that hides lightning
    raise ImportError("swarm_opt.lightning needs PyTorch Lightning: pip install swarm_opt[lightning]") from e

import torch

from swarm_opt._hivemind.node import DEFAULT_HOST_MADDRS
from swarm_opt._integration import PeerOptions
from swarm_opt.aggregation import Aggregation
from swarm_opt.clipping import checked_max_norm
from swarm_opt.compression import Compression
from swarm_opt.config import Groups, SwarmConfig, Timeouts, TrackerConfig
from swarm_opt.errors import ConfigError, IncompatibleStateError
from swarm_opt.gloo_lane import Gloo
from swarm_opt.offload import Offload
from swarm_opt.optimizer import Optimizer
from swarm_opt.privacy import OpacusPrivacy
from swarm_opt.ranks import LocalGroup
from swarm_opt.strategies.base import Strategy

logger = logging.getLogger(__name__)

__all__ = ["SwarmCallback"]


class SwarmCallback(Callback):
    """Train a ``LightningModule`` as one peer of a swarm: ``Trainer(callbacks=[SwarmCallback(...)])``.

    The keyword names are those of ``swarm_opt.Optimizer`` (see it for ``run_id``, ``target_batch_size``,
    ``strategy``, ``compression``, ``aggregation``, ``transport``, ``groups``, ``privacy``, ``timeouts`` and
    ``tracker``; the same rules pair them, checked at construction: ``swarm_opt.options``), plus:

    :param initial_peers: multiaddrs of live peers of the run (``[]`` for the first peer); the callback starts a
        DHT listening on ``host_maddrs`` and stops it at teardown.
    :param host_maddrs: where the DHT the callback starts listens (default: any interface, any free port).
    :param dht: a started ``hivemind.DHT`` to use instead; it stays the caller's (not stopped at teardown).
    :param batch_size: samples per batch; by default read from each batch, as Lightning does for logging.
    :param offload: ``swarm_opt.Offload()`` keeps the inner optimizer's state and swarm_opt's buffers in host memory
        (the model stays on its device): the module's optimizer steps host copies of its parameters. Lightning's
        clipping by value and 16-bit loss scaling act on the optimizer's parameters, the host copies, so they are
        refused with it (``precision="bf16-mixed"`` needs no scaling); clipping by norm is the swarm's (below).

    **Gradient clipping.** ``Trainer(gradient_clip_val=...)`` with the norm algorithm (Lightning's default) is
    routed to the swarm optimizer's ``clip_grad_norm``: Lightning no longer clips the gradient of each optimizer step
    (a part of the global batch, different on every peer); the swarm clips the gradient the inner optimizer applies,
    with ``GradientAveraging`` the global batch's mean gradient, the same on every peer, as one ``Trainer`` clips its
    accumulated batch (with local updates, each local step's). A module's own ``configure_gradient_clipping`` is
    then called with ``gradient_clip_val=None``. ``gradient_clip_algorithm="value"`` stays Lightning's, per optimizer
    step. The swarm's norm before clipping is logged as ``swarm/grad_norm``.

    **Several devices.** Under ``Trainer(strategy="ddp", devices=N)`` (gloo: ``accelerator="cpu"``) the machine's N
    ranks are one peer of the swarm (``swarm_opt.LocalGroup``, ``docs/ranks.md``): DDP averages their gradients,
    rank 0 alone starts the DHT and averages with the swarm, and every rank takes its results; no change to the
    module.

    Nothing happens at construction (no DHT, no process; the callback pickles). Refused at setup, each with the
    alternative: manual optimization, several optimizers, Lightning's other distributed strategies (FSDP,
    DeepSpeed, ...: use strategy="ddp", or one single-device peer per device), ``ReduceLROnPlateau`` and several
    LR schedulers.
    """

    def __init__(
        self,
        *,
        run_id: str,
        target_batch_size: int,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        dht: Optional[Any] = None,
        batch_size: Optional[int] = None,
        strategy: Optional[Strategy] = None,
        compression: Optional[Compression] = None,
        aggregation: Optional[Aggregation] = None,
        transport: Optional[Gloo] = None,
        groups: Optional[Groups] = None,
        privacy: Optional[OpacusPrivacy] = None,
        timeouts: Optional[Timeouts] = None,
        matchmaking_time: Optional[float] = None,  # alias of Timeouts(matchmaking_time=...)
        averaging_timeout: Optional[float] = None,  # alias of Timeouts(averaging_timeout=...)
        tracker: Optional[TrackerConfig] = None,
        offload: Optional[Offload] = None,
    ) -> None:
        self._options = PeerOptions(
            run_id=run_id, target_batch_size=target_batch_size, initial_peers=initial_peers, host_maddrs=host_maddrs,
            dht=dht, batch_size=batch_size, strategy=strategy, compression=compression, aggregation=aggregation,
            transport=transport, groups=groups, privacy=privacy, timeouts=timeouts, matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout, tracker=tracker, offload=offload)
        self._dht: Optional[Any] = None  # the DHT in use during fit (ours or the caller's)
        self._optimizer: Optional[Optimizer] = None
        self._pending_samples = 0  # samples of the micro-batches since the last optimizer step
        self._logged_epoch = -1  # the swarm epoch last logged (on_train_batch_end)
        self._restored: Optional[Dict[str, Any]] = None
        self._routed_clip: Optional[Any] = None  # the trainer whose gradient_clip_val the swarm optimizer took over

    # --- what a running fit exposes -------------------------------------------------------------------------------
    @property
    def config(self) -> SwarmConfig:
        return self._options.config

    @property
    def strategy(self) -> Strategy:
        """The strategy template: each fit binds a copy."""
        return self._options.strategy

    @property
    def optimizer(self) -> Optional[Optimizer]:
        """The swarm optimizer of the fit in progress (also ``trainer.optimizers[0]``); None outside ``fit``."""
        return self._optimizer

    @property
    def dht(self) -> Optional[Any]:
        """The DHT in use during ``fit``: e.g. ``dht.get_visible_maddrs()`` are the addresses other peers join."""
        return self._dht

    # --- Lightning hooks ------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "SwarmCallback drives Lightning's automatic optimization; with automatic_optimization = False, "
                "build swarm_opt.Optimizer(...) in configure_optimizers yourself and call "
                "opt.step(batch_size=...) in training_step, without the callback")
        if not isinstance(trainer.strategy, SingleDeviceStrategy) and not _ddp(trainer):
            raise ConfigError(
                f"SwarmCallback does not run under Lightning's {type(trainer.strategy).__name__}: use "
                f"Trainer(strategy='ddp', devices=N) (the machine's ranks are one swarm peer) or Trainer(devices=1) "
                f"and one peer per device with the same run_id")
        if _norm_clipping(trainer) is not None:
            checked_max_norm(trainer.gradient_clip_val)  # the swarm optimizer's clip_grad_norm: refused now if bad
        elif self._options.offload is not None and trainer.gradient_clip_val:
            raise ConfigError("SwarmCallback(offload=...) with gradient_clip_algorithm='value' and gradient_clip_val: "
                              "Lightning would clip the host copies' gradients, not the model's. Clip by norm (the "
                              "default algorithm, which the swarm optimizer does itself), by value in the module "
                              "(on_before_optimizer_step, torch.nn.utils.clip_grad_value_(self.parameters(), ...)), "
                              "or drop offload")
        if self._options.offload is not None and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ConfigError("SwarmCallback(offload=...) with a loss scaler (precision='16-mixed'): Lightning would "
                              "unscale the host copies' gradients, not the model's. Use precision='bf16-mixed' (no "
                              "scaler) or drop offload")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        inner = _single_optimizer(trainer.strategy.optimizers)
        scheduler = _single_scheduler(trainer.strategy.lr_scheduler_configs)
        self._check_restored_identity()
        clip = _norm_clipping(trainer)
        ddp = _ddp(trainer)  # DDP averaged the gradients; rank 0 speaks for the machine
        self._dht, self._optimizer = self._options.join(
            inner, scheduler=scheduler, clip_grad_norm=clip, starts_dht=trainer.global_rank == 0,
            local_group=LocalGroup(gradients_reduced=True) if ddp else False)
        if clip is not None:  # the swarm optimizer clips instead of Lightning (class docstring); given back at the end
            trainer.gradient_clip_val, self._routed_clip = None, (trainer, clip)
        trainer.strategy.optimizers = [self._optimizer]
        trainer.strategy.lr_scheduler_configs = []  # the swarm optimizer steps it, on the global epoch
        self._pending_samples = 0
        self._logged_epoch = -1

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._pending_samples += self._batch_size(batch)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # the coming step() consumes every micro-batch since the last one (accumulate_grad_batches). Lightning calls
        # step() without a sample count, so the swarm optimizer reads it from its config. If the loss scaler skips
        # the step (overflow), step() is never called and these samples count nowhere
        swarm = self._optimizer
        if swarm is not None and 0 < self._pending_samples != swarm.config.batch_size_per_step:
            swarm.config = dataclasses.replace(swarm.config, batch_size_per_step=self._pending_samples)
        self._pending_samples = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        swarm = self._optimizer
        if swarm is None:
            return
        # Lightning's log() costs about a millisecond per call; loggers write every log_every_n_steps batches and
        # the progress bar keeps the last value, so the swarm's figures are logged then, and when its epoch changes
        every = max(1, trainer.log_every_n_steps)
        if batch_idx % every != 0 and swarm.local_epoch == self._logged_epoch:
            return
        self._logged_epoch = swarm.local_epoch
        progress = swarm.progress
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("swarm/epoch", float(swarm.local_epoch), prog_bar=True, **log)
        pl_module.log("swarm/peers", float(progress.num_peers), prog_bar=True, **log)
        pl_module.log("swarm/samples_per_second", float(progress.samples_per_second), **log)
        if swarm.grad_norm is not None:
            pl_module.log("swarm/grad_norm", swarm.grad_norm, **log)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._leave()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._leave()  # Lightning calls no teardown hook after an exception or a Ctrl-C

    # --- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Which run and strategy a checkpoint belongs to; the swarm optimizer's state itself is Lightning's
        ``optimizer_states`` entry (``trainer.optimizers[0]`` is the swarm optimizer)."""
        state: Dict[str, Any] = {"run_id": self.config.run_id, "strategy": self.strategy.name}
        if self._optimizer is not None:
            state["global_epoch"] = self._optimizer.local_epoch
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def _check_restored_identity(self) -> None:
        restored, self._restored = self._restored, None
        if restored and restored.get("strategy") != self.strategy.name:
            raise IncompatibleStateError(
                f"the checkpoint was written by a swarm training with strategy '{restored.get('strategy')}', this "
                f"callback uses '{self.strategy.name}': resume with the checkpoint's strategy, or start without "
                f"ckpt_path")

    # --- helpers --------------------------------------------------------------------------------------------------
    def _batch_size(self, batch: Any) -> int:
        if self.config.batch_size_per_step is not None:
            return self.config.batch_size_per_step
        try:
            return extract_batch_size(batch)
        except (MisconfigurationException, RecursionError):
            raise ConfigError(f"could not read the number of samples from a batch of type {type(batch).__name__}; "
                              f"pass SwarmCallback(batch_size=N), the samples per batch") from None

    def _leave(self) -> None:
        """Leave the swarm and stop what this callback started; safe to call twice."""
        swarm, self._optimizer = self._optimizer, None
        dht, self._dht = self._dht, None
        routed, self._routed_clip = self._routed_clip, None
        if routed is not None:
            routed[0].gradient_clip_val = routed[1]
        self._options.leave(swarm, dht)


def _ddp(trainer: Trainer) -> bool:
    """Lightning's own DDP, its processes started by ``strategy="ddp"`` (not spawned: a spawned process cannot
    start a DHT), not a strategy built on it (DeepSpeed)."""
    return type(trainer.strategy) is DDPStrategy and getattr(trainer.strategy, "_start_method", "popen") == "popen"


def _norm_clipping(trainer: Trainer) -> Optional[float]:
    """The trainer's ``gradient_clip_val`` if it clips by norm (Lightning's default algorithm), else None."""
    clipping = trainer.gradient_clip_val
    return clipping if clipping and trainer.gradient_clip_algorithm in (None, "norm") else None


def _single_optimizer(optimizers: List[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    if len(optimizers) != 1:
        raise ConfigError(
            f"SwarmCallback trains exactly one optimizer, configure_optimizers returned {len(optimizers)}: return "
            f"one optimizer, with a param group per set of parameters that needs its own settings")
    if isinstance(optimizers[0], _MockOptimizer):
        raise ConfigError("configure_optimizers returned no optimizer: return the torch optimizer that SwarmCallback "
                          "should wrap, e.g. torch.optim.SGD(self.parameters(), lr=0.1)")
    if isinstance(optimizers[0], Optimizer):
        raise ConfigError("configure_optimizers returned a swarm_opt.Optimizer: return the plain torch optimizer "
                          "(e.g. torch.optim.SGD(self.parameters(), lr=0.1)); SwarmCallback wraps it")
    return optimizers[0]


def _single_scheduler(configs: List[Any]) -> Optional[Any]:
    if not configs:
        return None
    if len(configs) > 1:
        raise ConfigError(f"SwarmCallback steps one LR scheduler per global epoch, configure_optimizers returned "
                          f"{len(configs)}: chain them into one, e.g. torch.optim.lr_scheduler.SequentialLR")
    if configs[0].reduce_on_plateau:
        raise ConfigError("ReduceLROnPlateau needs a metric each step, which the swarm's global epochs do not "
                          "provide: use a schedule such as StepLR or CosineAnnealingLR, which step on the global "
                          "epoch")
    return configs[0].scheduler
