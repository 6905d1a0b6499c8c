"""Local updates with periodic state averaging: local SGD / FedAvg without a server, and FedProx on top of it."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError
from swarm_opt.strategies.base import Strategy, grads_are_finite, state_dtype


class LocalUpdates(Strategy):
    """Every ``step()`` applies the inner optimizer at once; each round (one global epoch: the swarm processed
    ``target_batch_size`` samples) peers average their parameters weighted by the samples of the round.

    :param average_optimizer_state: names of inner-optimizer statistics to average with the parameters, e.g.
        ``("momentum_buffer",)`` for SGD or ``("exp_avg", "exp_avg_sq")`` for Adam. Default: none (kept local).

    A peer whose round failed keeps its local model and joins the next round; one that missed rounds goes on from
    its own model (it is averaged back in at the next round).
    """

    name = "local"

    def __init__(self, *, average_optimizer_state: Sequence[str] = ()) -> None:
        if isinstance(average_optimizer_state, str) or not all(isinstance(n, str) for n in average_optimizer_state):
            raise ConfigTypeError("average_optimizer_state must be a sequence of state names, e.g. ('exp_avg',)")
        self.average_optimizer_state = tuple(average_optimizer_state)

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._samples = 0
        # statistics the inner optimizer has not created yet are averaged as zeros with zero effect on us
        self._stat_templates = [torch.zeros_like(p, dtype=state_dtype(p)) for _ in self.average_optimizer_state
                                for p in self.params]

    # --- the local step -------------------------------------------------------------------------------------------
    def local_step(self, batch_size: int) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads_are_finite(grads):
            return False
        self.before_inner_step()
        self.inner.step()
        self.after_inner_step()
        self._samples += batch_size
        return True

    def before_inner_step(self) -> None:
        """Hook for variants that change the gradient (FedProx)."""

    def after_inner_step(self) -> None:
        """Hook for variants that correct the weights after the step (SCAFFOLD)."""

    # --- the round ----------------------------------------------------------------------------------------------------
    def tensors_to_average(self) -> List[torch.Tensor]:
        return list(self.params) + self._optimizer_statistics()

    def _optimizer_statistics(self) -> List[torch.Tensor]:
        stats, i = [], 0
        for name in self.average_optimizer_state:
            for p in self.params:
                value = self.inner.state.get(p, {}).get(name)
                stats.append(value if isinstance(value, torch.Tensor) and value.shape == p.shape
                             else self._stat_templates[i])
                i += 1
        return stats

    def averaging_weight(self) -> float:
        return float(self._samples)

    def apply_round(self, result: AveragingResult) -> None:
        if result.averaged is not None:
            for tensor, mean in zip(LocalUpdates.tensors_to_average(self), result.averaged):
                tensor.detach().copy_(mean)
        self._samples = 0

    def reset(self) -> None:
        self._samples = 0

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        return True


class FedProx(LocalUpdates):
    """LocalUpdates with the proximal term ``mu/2 * ||y - x||^2`` pulling local steps toward the round's starting
    point ``x`` (Li et al., 2020): the gradient gets ``mu * (y - x)`` before each inner step.

    :param mu: strength of the pull; 0 is plain LocalUpdates. Typical values 0.001-1.
    """

    name = "fedprox"

    def __init__(self, mu: float = 0.01, *, average_optimizer_state: Sequence[str] = ()) -> None:
        super().__init__(average_optimizer_state=average_optimizer_state)
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not mu >= 0:
            raise ConfigError(f"FedProx mu must be a non-negative number, got {mu!r}; e.g. FedProx(mu=0.01)")
        self.mu = float(mu)

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._anchor = [p.detach().to("cpu", state_dtype(p), copy=True) for p in self.params]

    def before_inner_step(self) -> None:
        for p, x in zip(self.params, self._anchor):
            if p.grad is not None:
                p.grad.add_((p.detach() - x.to(p.device, p.dtype)), alpha=self.mu)

    def apply_round(self, result: AveragingResult) -> None:
        super().apply_round(result)
        self._restart_anchor()

    def reset(self) -> None:
        super().reset()
        self._restart_anchor()

    def _restart_anchor(self) -> None:
        for x, p in zip(self._anchor, self.params):
            x.copy_(p.detach())

    def state_dict(self) -> Dict[str, Any]:
        return {"anchor": [x.clone() for x in self._anchor]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        _copy_into(self._anchor, _checked_tensors(self._anchor, _entry(state, "anchor"), "FedProx anchor"))


def _entry(state: Any, key: str) -> Any:
    """``state[key]`` of a saved strategy state, which may come from another strategy or model (or a hostile peer)."""
    if not isinstance(state, dict):
        raise IncompatibleStateError(f"a strategy state must be a dict, got {type(state).__name__}")
    return state.get(key)


def _checked_tensors(into: List[torch.Tensor], values: Any, what: str) -> List[torch.Tensor]:
    """Saved tensors that fit ``into`` one for one; a state loads only once every part of it was checked."""
    if not isinstance(values, list) or len(values) != len(into):
        raise IncompatibleStateError(f"{what}: expected {len(into)} tensors")
    for dst, src in zip(into, values):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            raise IncompatibleStateError(f"{what}: a tensor does not match the model")
    return values


def _copy_into(into: List[torch.Tensor], values: List[torch.Tensor]) -> None:
    for dst, src in zip(into, values):
        dst.copy_(src)
