"""Global-gradient clipping: the gradient the inner optimizer applies is clipped to a largest L2 norm.

``Optimizer(..., clip_grad_norm=1.0)`` clips in one place, the inner optimizer's step (a step pre-hook, removed when
the swarm optimizer shuts down), which every strategy goes through: what is clipped is always the gradient the inner
optimizer is about to apply, all parameters together, as ``torch.nn.utils.clip_grad_norm_`` clips them.

* ``GradientAveraging`` steps once per round on the group's mean gradient: every member clips the same mean, so the
  swarm stays one model and equals one process that clips its accumulated global batch (HF Trainer's
  ``max_grad_norm``, nanoGPT's ``grad_clip``). No micro-batch is clipped on its own.
* ``LocalUpdates`` and its variants (``FedProx``, ``Scaffold``, ``FedNova``, ``DiLoCo``'s inner steps) step at every
  ``step()``: each local step clips its gradient as one process would (FedProx's clipped gradient includes its
  proximal pull; SCAFFOLD's correction is applied to the weights after the step and is not clipped; DiLoCo's outer
  step is not clipped).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from swarm_opt.errors import ConfigError, ConfigTypeError


def checked_max_norm(value: Any) -> Optional[float]:
    """``clip_grad_norm`` as given: None (no clipping) or a positive finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"clip_grad_norm must be a number such as 1.0 (the largest L2 norm of the gradient the "
                              f"inner optimizer applies) or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"clip_grad_norm must be a positive finite number such as 1.0, got {value!r}; pass "
                          f"clip_grad_norm=None to train without clipping")
    return float(value)


def clip_grad_norm(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients of all of ``optimizer``'s parameters together to L2 norm ``max_norm``, in place; return
    their norm before clipping (a tensor: reading it waits for the device)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class GradNormClipping:
    """Clips the gradients at every step of ``inner`` (``clip_grad_norm`` as its step pre-hook) until ``remove()``.

    :param inner: the optimizer whose steps are clipped.
    :param max_norm: the largest L2 norm of the gradient it applies (``checked_max_norm``).
    """

    def __init__(self, inner: torch.optim.Optimizer, max_norm: float) -> None:
        self.max_norm = max_norm
        self._norm: Optional[torch.Tensor] = None
        self._handle = inner.register_step_pre_hook(self._clip)

    def _clip(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self._norm = clip_grad_norm(optimizer, self.max_norm)

    @property
    def last_norm(self) -> Optional[float]:
        """The norm of the gradient of the last clipped step before clipping (None before the first)."""
        return None if self._norm is None else float(self._norm)

    def remove(self) -> None:
        self._handle.remove()
