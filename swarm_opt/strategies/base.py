"""The interface between the optimizer's fixed step loop and an algorithm.

The loop calls ``local_step`` on every ``Optimizer.step()``; when the swarm has processed ``target_batch_size``
samples it lets the strategy write its values into the averaging buffers (``write_round``; by default a copy of
``tensors_to_average()``), all-reduces them weighted by ``averaging_weight()`` and calls ``apply_round`` with the
group's mean. A round that failed is never applied: the strategy keeps its local state and the loop retries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, List, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.errors import IncompatibleStateError


class Strategy(ABC):
    """One training algorithm. Instances are bound to one optimizer; pass a fresh instance per optimizer."""

    #: a short stable name; peers only average with peers running the same strategy
    name: str = "strategy"

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        """Attach to the trainable parameters and the inner optimizer; allocate buffers."""
        if getattr(self, "_bound", False):
            raise ValueError(
                f"This {type(self).__name__} instance is already used by another optimizer; "
                f"pass a new instance, e.g. strategy={type(self).__name__}()"
            )
        self._bound = True
        self.params: List[torch.Tensor] = list(params)
        self.inner = inner

    @abstractmethod
    def local_step(self, batch_size: int) -> bool:
        """Consume the gradients of one local step of ``batch_size`` samples. Return False if the step was skipped
        (non-finite gradients): its samples then do not count."""

    @abstractmethod
    def tensors_to_average(self) -> List[torch.Tensor]:
        """This peer's values for a round; their shapes and dtypes (the same every round) size the buffers."""

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        """Write this peer's values of the round into the averaging buffers (fp32 or wider, on the CPU). Override
        to compute them straight into the buffers instead of through a tensor of one's own."""
        for buffer, tensor in zip(buffers, self.tensors_to_average()):
            buffer.copy_(tensor.detach())

    @abstractmethod
    def averaging_weight(self) -> float:
        """This peer's weight in the round's weighted mean."""

    @abstractmethod
    def apply_round(self, result: AveragingResult) -> None:
        """Finish the round from the group's mean, ``result.averaged`` (in ``write_round``'s order; ``None`` for a
        round alone, whose mean is this peer's own values)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget local progress of the current round (after the peer caught up by downloading the swarm's state)."""

    @property
    def runs_rounds_in_background(self) -> bool:
        """Whether rounds run while local steps go on (``hold_round``), instead of blocking ``step()``."""
        return False

    def hold_round(self) -> HeldRound:
        """Set this round's values aside for averaging in the background; later local steps start the next round.
        Only called if ``runs_rounds_in_background``."""
        raise NotImplementedError(f"{type(self).__name__} does not average in the background")

    @property
    def shares_parameters(self) -> bool:
        """Whether every member must start each round with the same parameters (true when rounds average updates,
        not the parameters themselves): members then compare digests of their parameters, and one outside its
        group's majority downloads the state of a member of the majority (``swarm_opt.digest``)."""
        return False

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        """The swarm finished ``missed_rounds`` rounds without this peer. Return True if the strategy can go on from
        its local state (it will be averaged back in next round); False if the peer must download the swarm's
        state (the default: e.g. gradient averaging must never step from stale parameters)."""
        return False

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a state that does not fit raises ``IncompatibleStateError``."""
        if not isinstance(state, dict):
            raise IncompatibleStateError(f"{type(self).__name__} state must be a dict, got {type(state).__name__}")
        if state:
            raise IncompatibleStateError(f"{type(self).__name__} has no state, but got keys {sorted(map(str, state))}")


class HeldRound(ABC):
    """A round's values set aside by ``Strategy.hold_round`` while they are averaged in the background. Used from
    two threads: ``write`` (and ``weight``) from the round's, ``apply`` or ``give_back`` from the training loop's,
    after the round ended; the strategy never touches held values in between."""

    @property
    @abstractmethod
    def weight(self) -> float:
        """This peer's weight in the round's weighted mean."""

    @abstractmethod
    def write(self, buffers: Sequence[torch.Tensor]) -> None:
        """Write the held values into the averaging buffers."""

    @abstractmethod
    def apply(self, result: AveragingResult) -> None:
        """The round succeeded: apply the group's mean (as ``Strategy.apply_round``), keeping the next round's
        progress."""

    @abstractmethod
    def give_back(self) -> None:
        """The round failed: fold the held values back into the round in progress, to be averaged next time."""


def state_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Buffers that accumulate over many steps (means, anchors, controls) keep at least fp32 precision."""
    return torch.promote_types(tensor.dtype, torch.float32)


def grads_are_finite(grads: List[torch.Tensor]) -> bool:
    """One fused pass over the gradients (the kernel GradScaler uses), falling back to a plain check."""
    if not grads:
        return True
    found_inf = torch.zeros(1, device=grads[0].device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.ones(1, device=grads[0].device))
    except (RuntimeError, TypeError, NotImplementedError):  # e.g. dtypes the fused kernel does not take
        return all(bool(torch.isfinite(g).all()) for g in grads)
    return not bool(found_inf.item())
