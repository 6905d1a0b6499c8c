"""Synchronous large-batch training: accumulate toward the global batch, average gradients, step together; or, with
``Overlap()``, average each round's gradients in the background while the next round's are computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from swarm_opt.buffers import AveragingResult
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError
from swarm_opt.groups import ONE_GROUP, RoundPlan
from swarm_opt.strategies.anchor import checked_tensors, copy_into, entry
from swarm_opt.strategies.base import (
    MAX_ROUNDS_ON_LOCAL_STATE,
    Overlap,
    Round,
    Strategy,
    grads_are_finite,
    state_dtype,
)
from swarm_opt.strategies.statistics import OptimizerStatistics


@dataclass(frozen=True)
class WorkerMomentum:
    """Each peer sends the momentum of its own round gradients instead of the gradients, and the group's aggregate
    of the momenta is what the inner optimizer steps on: ``GradientAveraging(momentum=WorkerMomentum(0.9))``, with
    an inner optimizer that has no momentum of its own (``torch.optim.SGD(p, lr)``; its ``lr`` is the step per unit
    of momentum, about ``lr / (1 − β)`` of an undampened momentum's: SGD(lr=0.1, momentum=0.9) becomes lr 1.0).

    Peer ``i``'s momentum after a committed round whose gradients (its sample-weighted mean since the last round) are
    ``g_i``: ``m_i ← β·m_i + (1 − β)·g_i``, and ``m_i = g_i`` in its first round. What for: Byzantine-robust
    aggregation (``CenteredClip``, ``TrimmedMean``) tells attackers apart from honest members by how far their
    copies lie from the others'. One round's gradients are noisy; an attacker that stays inside that noise ("a
    little is enough") moves every round's result and is never cut. Momentum averages about ``(1 + β)/(1 − β)``
    rounds, shrinking the honest members' spread (by √((1 − β)/(1 + β)), 0.23 at β = 0.9) while a steady shift keeps
    its size, so it no longer hides (Karimireddy, He and Jaggi 2021, "Learning from History for Byzantine Robust
    Optimization"). Use it with a robust aggregation; with the plain mean it only changes the optimizer.

    **Sync-equivalence:** with the plain mean, equal weights and every peer in every round, the mean of the members'
    momenta is the momentum of the mean gradients, so a swarm equals one process running ``SGD(lr, momentum=β,
    dampening=β)`` on the union of the batches (torch's first step included: its buffer starts at ``g``). It is not
    exact when members' weights change from round to round (a mean of momenta weighted by this round's samples is
    not the momentum of the weighted means) or a member misses rounds (its momentum does not see their gradients);
    every member still applies the same update. Momentum is each peer's own: it is in the strategy's state
    (checkpoints); a peer that downloads the swarm's state keeps its own, or starts one, never its donor's. Peers
    with and without it, or with another β, never average together. Costs one more fp32 buffer per parameter; the
    bytes of a round are the same.

    :param beta: the momentum, in [0, 1) (0: each round's gradients, as without it); default 0.9.
    """

    beta: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise ConfigTypeError(f"WorkerMomentum(beta=...) must be a number, e.g. 0.9; got {self.beta!r}")
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"WorkerMomentum(beta={self.beta!r}) must be in [0, 1), e.g. 0.9")

    def send(self, momentum: Optional[Sequence[torch.Tensor]], gradients: Sequence[torch.Tensor],
             buffers: Sequence[torch.Tensor]) -> None:
        """Write ``β·m + (1 − β)·g`` into ``buffers`` (``g`` itself without a momentum yet); ``m`` is unchanged."""
        for i, (buffer, gradient) in enumerate(zip(buffers, gradients)):
            buffer.copy_(gradient)
            if momentum is not None:
                buffer.lerp_(momentum[i].to(buffer.dtype), self.beta)

    def advance(self, momentum: Optional[List[torch.Tensor]], gradients: Sequence[torch.Tensor]
                ) -> List[torch.Tensor]:
        """The momentum after a committed round with ``gradients``: ``momentum`` updated in place, or a new one."""
        if momentum is None:
            return [g.clone() for g in gradients]
        for m, g in zip(momentum, gradients):
            m.lerp_(g.to(m.dtype), 1.0 - self.beta)
        return momentum


class GradientAveraging(Strategy):
    """Each peer keeps the sample-weighted mean of its gradients since the last round; the swarm all-reduces these
    means weighted by samples and every peer applies the inner optimizer to the same average. Without failures and
    compression this equals one process training on the union of all peers' batches.

    :param overlap: ``Overlap()`` averages in the background while the next round's gradients are computed (see
        ``Overlap`` for the staleness this implies). Default: rounds block ``step()`` until they are applied.
    :param momentum: ``WorkerMomentum(β)``: each peer sends its own momentum, for Byzantine-robust aggregation (see
        ``WorkerMomentum`` for what it changes). Default: each round's gradients, the exact large-batch equivalence.

    Extra memory: one fp32 buffer per parameter (the running mean) plus hivemind's averaging buffer; one more with
    ``Overlap()``, one more with ``WorkerMomentum``.

    **In Moshpit groups** (``Optimizer(groups=Groups(...))``, ``swarm_opt.groups``) a round averages within each
    group, and groups stepping on their own mean gradients would drift apart for good. So rounds in groups also carry
    each member's parameters and every statistic of its inner optimizer (momentum buffers; Adam's moments and step):
    the members step from their group's mean state with their group's mean gradient and leave the round identical,
    and the next rounds mix the groups along the grid. What sync-equivalence becomes: with ``torch.optim.SGD`` as
    the inner optimizer (momentum, Nesterov and weight decay included) the step is linear in the parameters, the
    momentum and the gradient, so the swarm's mean (weighted by the round's samples) moves exactly as one process
    stepping on the global batch's mean gradient, except that each peer computed its gradients at its own
    parameters, not at the mean: the peers' spread, which each round's mixing shrinks and the groups' different
    gradients renew, is the whole difference (Moshpit SGD, Ryabinin et al., 2021). An adaptive optimizer (Adam)
    still leaves each group identical, but its step is not linear in its state, so the mean is one Adam step only
    approximately. A swarm that fits one group is one group: every peer applies the same update, as without groups.
    Costs: a round sends the parameters and the statistics beside the gradients (three times the bytes with SGD's
    momentum, four with Adam), even while the swarm fits one group; a peer that missed a round (its group failed)
    goes on from its own parameters for a few rounds, as ``LocalUpdates`` does, instead of downloading the
    swarm's state.
    """

    name = "grad"
    supports_groups = True
    cli_options = ("worker_momentum", "overlap")
    cli_settings = ()  # the momentum is in ``variant``; peers with and without overlap average together

    @classmethod
    def from_options(cls, options: Dict[str, Any]) -> GradientAveraging:
        return cls(momentum=options["worker_momentum"], overlap=Overlap() if options["overlap"] else None)

    def privacy_refusal(self) -> Optional[str]:
        return ("GradientAveraging sends each round's raw accumulated gradients to its groupmates and runs the DP "
                "step only afterwards, so nothing it sends is clipped or noised: use strategy=swarm_opt.LocalUpdates()"
                " (FedAvg), Scaffold() or DiLoCo(...), whose local steps are DP-SGD steps")

    def __init__(self, *, overlap: Optional[Overlap] = None, momentum: Optional[WorkerMomentum] = None) -> None:
        if overlap is not None and not isinstance(overlap, Overlap):
            raise ConfigTypeError(f"overlap must be swarm_opt.Overlap() or None, got {overlap!r}")
        if momentum is not None and not isinstance(momentum, WorkerMomentum):
            hint = " (pass an instance: WorkerMomentum(0.9))" if momentum is WorkerMomentum else ""
            raise ConfigTypeError(f"momentum must be swarm_opt.WorkerMomentum(beta) or None, got {momentum!r}{hint}")
        self.overlap = overlap
        self.momentum = momentum
        self._groups: Optional[Groups] = None

    @property
    def variant(self) -> str:
        """Peers with and without ``WorkerMomentum`` (or another β), in groups or not, never average together."""
        momentum = "" if self.momentum is None else f"+momentum{self.momentum.beta!r}"
        return momentum + ("" if self._groups is None else "+groups")

    @property
    def sends_changes(self) -> bool:
        """Not in groups: rounds then also send the parameters and the optimizer's statistics."""
        return self._groups is None

    @property
    def averages_gradients(self) -> bool:
        """Not in groups (as ``sends_changes``); with ``WorkerMomentum``, the momenta of the round gradients."""
        return self._groups is None

    @property
    def shares_parameters(self) -> bool:
        """Not in groups: peers of different lines hold different parameters until the next rounds mix them."""
        return self._groups is None

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._mean = [torch.zeros_like(p, dtype=state_dtype(p)) for p in self.params]
        self._samples = 0
        self._spare: Optional[List[torch.Tensor]] = None  # a zeroed mean to accumulate into while a round is held
        self._held: Optional[_HeldGradients] = None  # a round set aside (Overlap), until it is applied or given back
        self._momentum: Optional[List[torch.Tensor]] = None  # this peer's own (WorkerMomentum), from its first round
        #: in groups, the inner optimizer's statistics a round averages with the parameters (class docstring)
        self._statistics = OptimizerStatistics.kept_by(inner) if self._groups is not None else None

    def local_step(self, batch_size: int) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads_are_finite(grads):
            return False
        fraction = batch_size / (self._samples + batch_size)
        for mean, p in zip(self._mean, self.params):
            if p.grad is None:
                mean.mul_(1.0 - fraction)
            else:
                mean.lerp_(p.grad.detach().to(mean.dtype), fraction)
        self._samples += batch_size
        return True

    def buffer_templates(self) -> List[torch.Tensor]:
        """The round's gradients; in groups, then the parameters and the inner optimizer's statistics."""
        return self._mean + self._group_state()

    def _group_state(self) -> List[torch.Tensor]:
        """What a round in groups averages beside the gradients: the live parameters and optimizer statistics."""
        if self._statistics is None:
            return []
        return list(self.params) + self._statistics.tensors()

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        self._send(self._mean, buffers)

    def averaging_weight(self) -> float:
        return float(self._samples)

    def apply_round(self, result: AveragingResult) -> None:
        self._apply(self._mean, result)
        self.reset()

    def _send(self, means: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        """What this peer sends for a round whose gradients are ``means``: them, or its momentum with them; in
        groups, then its parameters and optimizer statistics (unchanged until the round is applied)."""
        if self.momentum is None:
            for buffer, mean in zip(buffers, means):
                buffer.copy_(mean)
        else:
            self.momentum.send(self._momentum, means, buffers)
        for buffer, tensor in zip(buffers[len(means):], self._group_state()):
            buffer.copy_(tensor.detach())

    def _apply(self, means: List[torch.Tensor], result: AveragingResult) -> None:
        """A round with gradients ``means`` committed: step on the group's result (on what this peer sent, for a
        round alone), after advancing this peer's momentum; in groups, from the group's mean state."""
        if result.averaged is not None and self._statistics is not None:
            for p, mean in zip(self.params, result.averaged[len(means):]):
                p.detach().copy_(mean)
            self._statistics.adopt(result.averaged[len(means) + len(self.params):])
        if self.momentum is not None:
            self._momentum = self.momentum.advance(self._momentum, means)
            if result.averaged is None:  # a copy: the inner optimizer may change p.grad in place
                self._step_with([m.clone() for m in self._momentum])
                return
        self._step_with(means if result.averaged is None else result.averaged)

    def use_groups(self, groups: Groups) -> None:
        """Accepted: rounds in groups also average the parameters and the inner optimizer's statistics (class
        docstring), found when the strategy is bound."""
        self._groups = groups

    def begin_round(self, plan: RoundPlan = ONE_GROUP) -> Round:
        """Without overlap, a round over the running mean (the loop waits for it); with ``Overlap()`` the round
        takes the mean with it (the loop polls it) and the next round accumulates into a spare buffer."""
        self.round_plan = plan
        if self.overlap is None:
            return super().begin_round(plan)
        assert self._held is None, "one round at a time"
        spare = self._spare if self._spare is not None else [torch.zeros_like(m) for m in self._mean]
        self._held = _HeldGradients(self, self._mean, self._samples)
        self._mean, self._spare, self._samples = spare, None, 0
        return self._held

    def _step_with(self, means: Sequence[torch.Tensor]) -> None:
        for p, mean in zip(self.params, means):
            # the averaged buffer itself when it fits: no copy (it is not touched again until the next round)
            p.grad = mean if (mean.dtype, mean.device) == (p.dtype, p.device) else mean.to(p.device, p.dtype)
        self.inner.step()
        for p in self.params:
            p.grad = None

    def _release(self, held: _HeldGradients) -> None:
        for mean in held.means:
            mean.zero_()
        self._spare, self._held = held.means, None

    def reset(self) -> None:
        for mean in self._mean:
            mean.zero_()
        self._samples = 0
        if self._held is not None:
            self._release(self._held)

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        """In groups, for a few rounds (its parameters are averaged back in at its next round); otherwise never: a
        peer must not step from stale parameters while the others hold the swarm's."""
        return self._groups is not None and missed_rounds <= MAX_ROUNDS_ON_LOCAL_STATE

    def own_state(self) -> Tuple[str, ...]:
        return ("momentum",)  # each peer's own: a hostile donor's would make a newcomer send its attack

    def state_dict(self) -> Dict[str, Any]:
        # a round's partial accumulation is local and transient: a resumed or newly joined peer starts a fresh one
        if self._momentum is None:
            return {}
        return {"momentum": [m.clone() for m in self._momentum]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.momentum is None or not isinstance(state, dict) or not state:
            super().load_state_dict(state)  # no state: only {} fits
            self._momentum = None
            return
        saved = checked_tensors(self._mean, entry(state, "momentum"), "GradientAveraging momentum")
        if not all(bool(torch.isfinite(m).all()) for m in saved):  # it would make every round this peer's last
            raise IncompatibleStateError("GradientAveraging momentum: non-finite values")
        if self._momentum is None:
            self._momentum = [torch.zeros_like(m) for m in self._mean]
        copy_into(self._momentum, saved)


class _HeldGradients(Round):
    """The mean gradient of a round set aside while it is averaged in the background."""

    in_background = True

    def __init__(self, owner: GradientAveraging, means: List[torch.Tensor], samples: int) -> None:
        self.owner, self.means, self.samples = owner, means, samples

    @property
    def weight(self) -> float:
        return float(self.samples)

    def write(self, buffers: Sequence[torch.Tensor]) -> None:
        self.owner._send(self.means, buffers)

    def apply(self, result: AveragingResult) -> None:
        if self.owner._held is self:  # not dropped by a reset meanwhile
            self.owner._apply(self.means, result)
            self.owner._release(self)

    def give_back(self) -> None:
        if self.owner._held is not self:
            return
        owner, total = self.owner, self.samples + self.owner._samples
        if total > 0:  # the pooled mean: what one accumulation over both would hold
            for mean, held in zip(owner._mean, self.means):
                mean.lerp_(held, self.samples / total)
        owner._samples = total
        owner._release(self)
