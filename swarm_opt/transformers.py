"""``SwarmCallback`` for Hugging Face ``Trainer``: ``Trainer(..., callbacks=[SwarmCallback(...)])`` makes it a peer.

An adapter over ``swarm_opt.Optimizer`` with no algorithm of its own. ``Trainer`` builds its optimizer and LR
scheduler from its arguments as usual; when training begins the callback starts a DHT and puts a
``swarm_opt.Optimizer`` around that optimizer, inside Accelerate's wrapper, so that Trainer's loop, mixed precision
and checkpoints drive the swarm optimizer as they would any optimizer. ``TrainingArguments`` keep their meaning, with
the swarm's global batch as the batch:

* a peer's step is ``per_device_train_batch_size * gradient_accumulation_steps`` samples; the swarm steps (a global
  epoch) once the peers together computed ``target_batch_size``;
* ``max_steps`` counts global epochs (global batches), as one Trainer's steps count its batches: the run ends at
  that epoch, and it is the horizon of ``lr_scheduler_type`` and ``warmup_steps``, whose schedule follows the global
  epoch on every peer;
* ``max_grad_norm`` clips the gradient of the global batch (the swarm optimizer's ``clip_grad_norm``), not that of
  each peer's step;
* ``bf16`` / ``fp16`` work as usual (the loss scaler unscales before the swarm sees a gradient; a skipped step never
  reaches it);
* checkpoints (``save_steps``) hold the swarm optimizer's state (inner optimizer and global epoch) as
  ``optimizer.pt``; ``trainer.train(resume_from_checkpoint=...)`` resumes at the checkpoint's epoch and catches up
  with a running swarm;
* logs carry ``swarm/epoch``, ``swarm/peers``, ``swarm/samples_per_second`` (and ``swarm/grad_norm``, the global
  gradient's norm before clipping).

Under ``torchrun --nproc-per-node N`` (Trainer's DDP; CPU: gloo) the machine's N processes are one peer
(``swarm_opt.LocalGroup``, ``docs/ranks.md``): DDP averages their gradients, process 0 alone starts the DHT and
averages with the swarm, and every process takes its results; a step counts the N processes' samples.

``logging_steps``, ``save_steps`` and ``eval_steps`` count this peer's steps (``state.global_step``), as its logged
loss does. ``transformers`` is an optional dependency: ``pip install swarm_opt[transformers]``.
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any, Dict, Optional, Sequence

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.training_args import ParallelMode
except ImportError as e:  # pragma: no cover - exercised by a test that hides transformers
    raise ImportError("swarm_opt.transformers needs Hugging Face transformers: "
                      "pip install swarm_opt[transformers]") from e

import torch

from swarm_opt._hivemind.node import DEFAULT_HOST_MADDRS
from swarm_opt._integration import PeerOptions
from swarm_opt.aggregation import Aggregation
from swarm_opt.clipping import checked_max_norm
from swarm_opt.compression import Compression
from swarm_opt.config import Groups, Timeouts, TrackerConfig
from swarm_opt.errors import ConfigError
from swarm_opt.gloo_lane import Gloo
from swarm_opt.optimizer import Optimizer
from swarm_opt.privacy import OpacusPrivacy
from swarm_opt.ranks import LocalGroup
from swarm_opt.strategies.base import Strategy

logger = logging.getLogger(__name__)

__all__ = ["SwarmCallback"]

#: schedules that need a metric or their own step count, which global epochs do not provide
_UNSUPPORTED_SCHEDULES = ("reduce_lr_on_plateau", "greedy")


class SwarmCallback(TrainerCallback):
    """Train with a Hugging Face ``Trainer`` as one peer of a swarm: ``Trainer(..., callbacks=[SwarmCallback(...)])``.

    The keyword names are those of ``swarm_opt.Optimizer`` (see it for ``run_id``, ``target_batch_size``,
    ``strategy``, ``compression``, ``aggregation``, ``transport``, ``groups``, ``privacy``, ``timeouts`` and
    ``tracker``; the same rules pair them, checked at construction: ``swarm_opt.options``), plus
    ``initial_peers`` / ``host_maddrs`` (the DHT the callback starts and stops) or ``dht`` (a started
    ``hivemind.DHT`` that stays the caller's), as in ``swarm_opt.lightning.SwarmCallback``. What
    ``TrainingArguments`` mean in a swarm: see the module docstring.

    Nothing happens at construction (no DHT, no process). Under ``torchrun`` (Trainer's DDP) the machine's processes
    are one peer (module docstring). Refused when the ``Trainer`` is built, each with the alternative: Trainer's
    sharded and other distributed modes (FSDP, DeepSpeed, several GPUs in one process: use DDP, or one
    single-device peer per device), ``max_steps`` unset, and schedules that need a metric; when training starts: a
    ``swarm_opt.Optimizer`` passed as Trainer's optimizer and LR schedulers that are not ``LambdaLR``.

    Trainer calls no callback when training raises: the swarm is then left at interpreter exit, or at once with
    ``leave()``.
    """

    def __init__(
        self,
        *,
        run_id: str,
        target_batch_size: int,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        dht: Optional[Any] = None,
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
    ) -> None:
        self._options = PeerOptions(
            run_id=run_id, target_batch_size=target_batch_size, initial_peers=initial_peers, host_maddrs=host_maddrs,
            dht=dht, strategy=strategy, compression=compression, aggregation=aggregation, transport=transport,
            groups=groups, privacy=privacy, timeouts=timeouts, matchmaking_time=matchmaking_time,
            averaging_timeout=averaging_timeout, tracker=tracker)
        self._dht: Optional[Any] = None
        self._optimizer: Optional[Optimizer] = None
        self._wrapper: Optional[Any] = None  # Accelerate's optimizer wrapper, whose optimizer we replaced
        self._max_grad_norm = 0.0  # Trainer's max_grad_norm, which the swarm optimizer applies instead

    # --- what a running train() exposes ---------------------------------------------------------------------------
    @property
    def optimizer(self) -> Optional[Optimizer]:
        """The swarm optimizer of the ``train()`` in progress; None outside it."""
        return self._optimizer

    @property
    def dht(self) -> Optional[Any]:
        """The DHT in use during ``train()``: ``dht.get_visible_maddrs()`` are the addresses other peers join."""
        return self._dht

    # --- Trainer events -------------------------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        check_arguments(args)
        _log_before_reporters(self, sys._getframe(1).f_locals.get("self"))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs) -> None:
        check_arguments(args)
        wrapper, inner = _unwrap(optimizer)
        _check_scheduler(lr_scheduler)
        self._max_grad_norm = float(args.max_grad_norm or 0.0)
        clip = checked_max_norm(self._max_grad_norm) if self._max_grad_norm > 0 else None
        ddp = _ddp(args)  # DDP averaged the gradients; process 0 speaks for the machine (swarm_opt.ranks)
        self._dht, self._optimizer = self._options.join(
            inner, clip_grad_norm=clip, starts_dht=args.process_index == 0,
            local_group=LocalGroup(gradients_reduced=True) if ddp else False,
            batch_size_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps)
        atexit.register(self.leave)  # Trainer calls no callback when training raises
        try:
            if state.global_step > 0:  # resumed: Trainer restored the model, optimizer.pt and the scheduler
                # the schedule is positioned on the global epoch (on_optimizer_step): it holds the checkpoint's epoch
                self._optimizer.load_state_dict(dict(inner.state_dict(), swarm_opt={"epoch": lr_scheduler.last_epoch}))
            _rewrap(wrapper, self._optimizer)
            self._wrapper = wrapper
        except BaseException:
            self.leave()
            raise

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        # Trainer clips each step's gradient when max_grad_norm > 0; the swarm optimizer clips the global batch's.
        # Restored at on_step_end, so that checkpoints, logs and evaluation see the user's value
        args.max_grad_norm = 0.0

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, *,
                          lr_scheduler: Any = None, **kwargs) -> None:
        # Trainer steps its scheduler next: from here it lands on the swarm's epoch (LambdaLR is closed-form), so
        # every peer, late joiners included, uses the schedule's value for the global epoch, whatever its own steps
        if self._optimizer is not None and lr_scheduler is not None:
            lr_scheduler.last_epoch = self._optimizer.local_epoch - 1

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        args.max_grad_norm = self._max_grad_norm
        swarm = self._optimizer
        if swarm is None or state.global_step < state.max_steps and swarm.local_epoch < state.max_steps:
            return
        # max_steps counts global epochs; Trainer's own flow (DefaultFlowCallback) ends the run, saves and evaluates
        # by this peer's step count: undo that until the swarm reaches max_steps
        done = swarm.local_epoch >= state.max_steps
        steps = args.save_strategy == "steps"
        control.should_training_stop = done
        control.should_save = steps and (done or state.save_steps > 0 and state.global_step % state.save_steps == 0)
        if args.eval_strategy == "steps":
            control.should_evaluate = done or state.global_step % state.eval_steps == 0

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Optional[Dict[str, float]] = None, **kwargs) -> None:
        swarm = self._optimizer
        if swarm is None or logs is None:
            return
        progress = swarm.progress
        logs["swarm/epoch"] = swarm.local_epoch
        logs["swarm/peers"] = progress.num_peers
        logs["swarm/samples_per_second"] = float(progress.samples_per_second)
        if swarm.grad_norm is not None:
            logs["swarm/grad_norm"] = swarm.grad_norm

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        self.leave()

    def leave(self) -> None:
        """Leave the swarm and stop what this callback started; Trainer's optimizer is its own again. Safe to call
        twice; called at the end of ``train()`` (and at interpreter exit if training raised)."""
        swarm, self._optimizer = self._optimizer, None
        dht, self._dht = self._dht, None
        wrapper, self._wrapper = self._wrapper, None
        atexit.unregister(self.leave)
        if wrapper is not None and swarm is not None:
            _rewrap(wrapper, swarm.inner)
        self._options.leave(swarm, dht)


def _log_before_reporters(callback: TrainerCallback, handler: Any) -> None:
    """Move ``callback`` just before the first report integration (``report_to``: TensorBoard, wandb, ...) of the
    Trainer's ``handler``, so that every log they send carries the swarm's figures (``on_log`` adds them). Trainer
    lists those integrations before the user's callbacks and hands callbacks no handle on itself: ``handler`` is the
    ``CallbackHandler`` that calls ``on_init_end``; anything else is left as it is. A new list, not a reordered one:
    the handler is iterating over the old one."""
    from transformers.integrations import INTEGRATION_TO_CALLBACK
    from transformers.trainer_callback import CallbackHandler

    if not isinstance(handler, CallbackHandler) or callback not in handler.callbacks:
        return
    reporters = tuple(c for c in INTEGRATION_TO_CALLBACK.values() if isinstance(c, type))
    others = [c for c in handler.callbacks if c is not callback]
    first = next((i for i, c in enumerate(others) if isinstance(c, reporters)), None)
    if first is not None and first < handler.callbacks.index(callback):
        handler.callbacks = others[:first] + [callback] + others[first:]


def _ddp(args: TrainingArguments) -> bool:
    """Trainer's plain DDP (``torchrun`` / ``accelerate launch`` without FSDP or DeepSpeed) over several processes."""
    return args.parallel_mode == ParallelMode.DISTRIBUTED and args.world_size > 1 and not (args.deepspeed or args.fsdp)


def check_arguments(args: TrainingArguments) -> None:
    """Refuse ``TrainingArguments`` that cannot work in a swarm, each with the alternative."""
    if args.deepspeed or args.fsdp:
        raise ConfigError(
            f"SwarmCallback does not run under Trainer's {'DeepSpeed' if args.deepspeed else 'FSDP'} (it builds the "
            f"optimizer on the parameters' shards, which the callback cannot hand to swarm_opt, docs/ranks.md): use "
            f"DDP (torchrun --nproc-per-node N train.py: the machine's processes are one swarm peer), or one "
            f"single-process Trainer per device with the same run_id")
    if (args.world_size > 1 or args.parallel_mode == ParallelMode.DISTRIBUTED) and not _ddp(args):
        raise ConfigError(
            f"SwarmCallback runs under Trainer's DDP (torchrun --nproc-per-node N train.py) or in one process, not "
            f"under its {args.parallel_mode.value!r} mode: use torchrun, or one single-process Trainer per device "
            f"with the same run_id")
    if args.n_gpu > 1:
        raise ConfigError(
            f"Trainer would train on {args.n_gpu} GPUs with DataParallel in this process: make each GPU its own "
            f"swarm peer (CUDA_VISIBLE_DEVICES=i python train.py, the same run_id)")
    if args.max_steps is None or args.max_steps <= 0:
        raise ConfigError(
            "SwarmCallback needs TrainingArguments(max_steps=N): in a swarm N counts global epochs (global batches "
            "of target_batch_size), when the run ends and the horizon of lr_scheduler_type and warmup_steps")
    if str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) in _UNSUPPORTED_SCHEDULES:
        raise ConfigError(
            f"lr_scheduler_type='{getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)}' needs metrics "
            f"or steps of its own, which the swarm's global epochs do not provide: use a schedule such as 'linear', "
            f"'cosine' or 'constant_with_warmup', which follow the global epoch")


def _unwrap(optimizer: Any) -> Any:
    """Accelerate's wrapper around Trainer's optimizer, and the optimizer inside it."""
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer) or not hasattr(optimizer, "scaler"):
        raise ConfigError(f"SwarmCallback expected Trainer's optimizer inside Accelerate's AcceleratedOptimizer, got "
                          f"{type(optimizer).__name__}: run a single-process Trainer (no DeepSpeed, no FSDP)")
    if isinstance(inner, Optimizer):
        raise ConfigError("Trainer was given a swarm_opt.Optimizer: pass the plain torch optimizer "
                          "(Trainer(optimizers=(torch.optim.AdamW(...), None)), or none: Trainer builds it from its "
                          "arguments); SwarmCallback wraps it")
    return optimizer, inner


def _rewrap(wrapper: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make Accelerate's ``wrapper`` step ``optimizer``; with a loss scaler, its check that the step ran too."""
    wrapper.optimizer = optimizer
    if wrapper.scaler is not None:
        from accelerate.optimizer import patch_optimizer_step

        wrapper._optimizer_original_step_method = optimizer.step
        wrapper._optimizer_patched_step_method = patch_optimizer_step(wrapper, optimizer.step)


def _check_scheduler(scheduler: Any) -> None:
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise ConfigError(
            f"SwarmCallback positions Trainer's LR scheduler on the global epoch, which needs a LambdaLR (every "
            f"lr_scheduler_type Trainer builds is one), got {type(scheduler).__name__}: let Trainer build it from "
            f"lr_scheduler_type, or pass transformers.get_scheduler(...) / torch.optim.lr_scheduler.LambdaLR in "
            f"Trainer(optimizers=(optimizer, scheduler))")
