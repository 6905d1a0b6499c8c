"""The round's starting point ``x`` and the learning rates spent since, shared by the strategies that need them.

FedProx pulls its local steps toward ``x``; DiLoCo's outer optimizer steps from it; SCAFFOLD and FedNova measure the
round's update ``x - y`` from it and divide it by ``S``, the sum of the learning rates of the inner steps completed
since ``x`` (not ``K * lr``: schedules, warm-up and skipped steps change it). Also the checks every strategy state
goes through on loading (it may come from another model, another strategy, or a hostile peer).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence

import torch

from swarm_opt.errors import IncompatibleStateError
from swarm_opt.strategies.base import state_dtype


class Anchor:
    """A copy ``x`` (``tensors``) of ``params`` at the start of the round: fp32 or wider, on the CPU.

    :param groups: the parameters to anchor, one list per param group of the inner optimizer.
    """

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        self.groups = [list(group) for group in groups]
        self.params = [p for group in self.groups for p in group]
        # (shape-only ``meta`` parameters stay so: the stand-ins of a sharded model's ranks other than 0 take no
        # memory, swarm_opt.shards)
        self.tensors = [p.detach().to("meta" if p.is_meta else "cpu", state_dtype(p), copy=True) for p in self.params]

    @classmethod
    def of_trainable(cls, inner: torch.optim.Optimizer, among: Optional[Sequence[torch.Tensor]] = None) -> Anchor:
        """The parameters the inner optimizer trains (``requires_grad``), by param group; only those in ``among``
        if given (the averaged ones: those ``KeepLocal`` keeps are no part of the swarm's ``x``)."""
        kept = None if among is None else {id(p) for p in among}
        return cls([[p for p in group["params"] if p.requires_grad and (kept is None or id(p) in kept)]
                    for group in inner.param_groups])

    def restart(self) -> None:
        """A new round starts from the parameters as they are: ``x <- p``."""
        for x, p in zip(self.tensors, self.params):
            x.copy_(p.detach())

    def restore(self) -> None:
        """Go back to the round's start: ``p <- x``."""
        for x, p in zip(self.tensors, self.params):
            p.detach().copy_(x)

    def state(self) -> List[torch.Tensor]:
        return [x.clone() for x in self.tensors]

    def check(self, saved: Any, what: str) -> List[torch.Tensor]:
        return checked_tensors(self.tensors, saved, what)

    def load(self, checked: List[torch.Tensor]) -> None:
        """Copy ``check``'s output in (check every part of a state before loading any of it)."""
        copy_into(self.tensors, checked)


class LrSums:
    """``S``: the sum of the learning rates of the inner steps completed this round, one per param group."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.values = [0.0 for _ in inner.param_groups]

    def add_step(self) -> None:
        """Count one completed inner step (call after it)."""
        for index, group in enumerate(self.inner.param_groups):
            self.values[index] += float(group["lr"])

    def clear(self) -> None:
        self.values = [0.0 for _ in self.values]

    def check(self, saved: Any, what: str) -> List[float]:
        if not isinstance(saved, list) or len(saved) != len(self.values) \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf
                           for v in saved):
            raise IncompatibleStateError(f"{what}: expected one finite number >= 0 per param group")
        return [float(v) for v in saved]


def entry(state: Any, key: str) -> Any:
    """``state[key]`` of a saved strategy state, which may come from another strategy or model (or a hostile peer)."""
    if not isinstance(state, dict):
        raise IncompatibleStateError(f"a strategy state must be a dict, got {type(state).__name__}")
    return state.get(key)


def checked_tensors(into: List[torch.Tensor], values: Any, what: str) -> List[torch.Tensor]:
    """Saved tensors that fit ``into`` one for one; a state loads only once every part of it was checked."""
    if not isinstance(values, list) or len(values) != len(into):
        raise IncompatibleStateError(f"{what}: expected {len(into)} tensors")
    for dst, src in zip(into, values):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape:
            raise IncompatibleStateError(f"{what}: a tensor does not match the model")
    return values


def copy_into(into: List[torch.Tensor], values: List[torch.Tensor]) -> None:
    for dst, src in zip(into, values):
        dst.copy_(src)
