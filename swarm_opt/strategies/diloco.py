"""DiLoCo (Douillard et al., 2023): local updates, then an outer optimizer steps on the averaged pseudo-gradient.

**Moshpit groups** (``swarm_opt.groups``): a group's members come from different groups of the previous round and
hold different anchors ``x`` and outer momenta ``m``. Their rounds average ``x`` and ``m`` with the parameters (two
more model-sized tensors: three times the bytes of a round of the whole swarm), and the outer step runs from the
group's mean ``x`` with its mean ``m`` on the mean pseudo-gradient. SGD's outer step (with momentum, Nesterov or not)
is linear in ``(x, m, x - ybar)``, so that step is the mean of the members' own outer steps: every member ends the
round with the same ``x``, and the swarm's mean ``(x, m)`` moves as one DiLoCo over the whole swarm would on the
swarm's mean pseudo-gradient. Adaptive outer optimizers (Adam's steps are not linear in their state) are refused
with groups.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from swarm_opt.buffers import AveragingResult
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError
from swarm_opt.groups import ONE_GROUP, RoundPlan
from swarm_opt.strategies.anchor import entry
from swarm_opt.strategies.base import Overlap, Round
from swarm_opt.strategies.local_updates import Anchored
from swarm_opt.strategies.partial import DriftedLayers, KeepLocal
from swarm_opt.strategies.peer_dp import PeerDP

OuterFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class DiLoCo(Anchored):
    """Keep an anchor copy ``x`` of the parameters (fp32, on CPU); after each round's average ``ybar`` the
    pseudo-gradient ``x - ybar`` is given to the outer optimizer, which steps from ``x``; every peer then continues
    from the new ``x``. Rounds send each peer's pseudo-gradient ``x - y`` (whose mean is ``x - ybar``): a lossy
    codec's error is then relative to the round's change, not to the weights, and ``TopK`` may send only the
    largest changes, delaying the rest by error feedback (``sends_changes``; not in groups, nor with
    ``average_optimizer_state`` or frozen parameters among the optimizer's, whose values travel as they are). With
    ``torch.optim.SGD(p, lr=1.0)`` as the outer optimizer DiLoCo is FedAvg: that is FedAvg with sparse exchange.

    :param outer_optimizer: a factory over the anchor tensors returning any ``torch.optim.Optimizer``, typically
        ``lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)``.
    :param exchange: ``KeepLocal(model, where)``: parameters that never leave this peer, trained by the inner
        optimizer alone (the outer optimizer steps on the averaged ones). ``select=`` and ``peer_dp=`` are refused
        (``Anchored``).
    :param overlap: ``Overlap()``: a round averages in the background while the inner steps go on (as Streaming
        DiLoCo overlaps them, with its full overlap); when it ends, the outer step moves ``x`` and the parameters
        move by as much as ``x`` did since the round's snapshot, keeping the inner steps made meanwhile (they count
        in the next round's pseudo-gradient, measured from the new ``x``). Every peer still holds the same ``x``
        after a round; a failed round gives nothing back, since the next pseudo-gradient, measured from the same
        ``x``, holds its steps too. In groups too (``x`` and the outer momentum, which only the outer step changes,
        travel as they are). Not with ``average_optimizer_state``: the inner steps would change those statistics
        under the round. One more fp32 copy of the averaged parameters.

    A peer that missed a round downloads the swarm's state: the anchor and outer optimizer must be the swarm's.

    Memory: the anchor (1x the trainable parameters, fp32), the outer optimizer's state and the averaging buffer;
    the pseudo-gradient is computed in place. torch's multi-tensor ("foreach") SGD allocates a parameter-sized
    temporary for Nesterov momentum at each outer step; ``torch.optim.SGD(..., foreach=False)`` keeps it to one
    tensor.
    """

    name = "diloco"
    outer: Optional[torch.optim.Optimizer] = None  # made at ``bind``
    dp_safe = True  # the round's change comes from DP-SGD steps
    supports_groups = True
    cli_options = ("outer_lr", "outer_momentum", "overlap")
    cli_settings = ("outer_lr", "outer_momentum")  # peers with and without overlap average together

    @classmethod
    def from_options(cls, options: Dict[str, Any]) -> DiLoCo:
        """The outer Nesterov SGD of ``--outer-lr`` and ``--outer-momentum``, in the background with ``--overlap``."""
        lr, momentum = options["outer_lr"], options["outer_momentum"]
        return cls(outer_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, nesterov=momentum > 0),
                   overlap=Overlap() if options["overlap"] else None)

    def __init__(self, outer_optimizer: OuterFactory, *, average_optimizer_state: Sequence[str] = (),
                 exchange: Optional[KeepLocal] = None, select: Optional[DriftedLayers] = None,
                 peer_dp: Optional[PeerDP] = None, overlap: Optional[Overlap] = None) -> None:
        super().__init__(average_optimizer_state=average_optimizer_state, exchange=exchange, select=select,
                         peer_dp=peer_dp)
        if overlap is not None and not isinstance(overlap, Overlap):
            raise ConfigTypeError(f"overlap must be swarm_opt.Overlap() or None, got {overlap!r}")
        if overlap is not None and self.average_optimizer_state:
            raise ConfigError("DiLoCo(overlap=Overlap()) averages pseudo-gradients while the inner steps go on; the "
                              "inner optimizer's statistics (average_optimizer_state) would change under the round: "
                              "drop one of them")
        self.overlap = overlap
        self._held: Optional[_HeldChange] = None  # a round set aside (overlap), until it is applied or given back
        self._spare: Optional[List[torch.Tensor]] = None
        if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
            raise ConfigTypeError(
                "outer_optimizer must be a factory over the anchor parameters, e.g. "
                "outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)"
            )
        self._outer_factory = outer_optimizer
        self._groups: Optional[Groups] = None
        self._frozen: List[int] = []  # set at bind: averaged parameters without an anchor (requires_grad=False)

    def use_groups(self, groups: Groups) -> None:
        """Accepted with an SGD outer optimizer: rounds then also average ``x`` and the outer momentum (module
        docstring); checked at ``bind``, when the outer optimizer exists."""
        self._groups = groups

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.outer = self._outer_factory(self.anchor.tensors)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ConfigTypeError(f"outer_optimizer returned {type(self.outer).__name__}, not a torch.optim.Optimizer")
        if self._groups is not None:
            _check_linear(self.outer, self._groups)
            _momentum_buffers(self.outer)  # made now: a round that fails must leave the state as it found it
        anchored = {id(p) for p in self.anchor.params}
        #: where each anchored parameter's value sits among the averaged tensors (in the anchor's order)
        self._anchored = [j for j, p in enumerate(self.shared) if id(p) in anchored]
        assert [id(self.shared[j]) for j in self._anchored] == [id(p) for p in self.anchor.params]
        #: averaged parameters without an anchor (``requires_grad=False``): their values travel as they are
        self._frozen = [j for j, p in enumerate(self.shared) if id(p) not in anchored]

    @property
    def variant(self) -> str:
        """Rounds send pseudo-gradients (peers of versions that sent parameters never average with these); peers in
        groups send ``x`` and the outer momentum too: they average only with each other."""
        if self._groups is None:
            return "+changes"
        outer = self.outer  # bound: whether momentum buffers travel
        return "+changes+groups" + ("+momentum" if outer is not None and _momentum_buffers(outer) else "")

    @property
    def sends_changes(self) -> bool:
        """Not in groups nor with ``average_optimizer_state``; once bound, not when a frozen parameter is among the
        averaged ones (it has no anchor, so its value travels as it is)."""
        return self._groups is None and not self.average_optimizer_state and not self._frozen

    def buffer_templates(self) -> List[torch.Tensor]:
        """In groups, ``x`` and the outer momentum follow the parameters."""
        return super().buffer_templates() + self._grouped_state()

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        super().write_round(buffers)  # the parameters y: replaced by the pseudo-gradients x - y
        for x, j in zip(self.anchor.tensors, self._anchored):
            torch.sub(x, buffers[j], out=buffers[j])
        self._send_grouped(buffers)

    def apply_round(self, result: AveragingResult) -> None:
        """In groups, the outer step below starts from the group's mean ``x`` and momentum."""
        if result.averaged is not None:
            self._take_grouped(result.averaged)
            for x, j in zip(self.anchor.tensors, self._anchored):  # ybar = x - the mean pseudo-gradient
                torch.sub(x, result.averaged[j], out=result.averaged[j])
        super().apply_round(result)

    def begin_round(self, plan: RoundPlan = ONE_GROUP) -> Round:
        """Without overlap, a round over the live parameters (the loop waits for it); with ``Overlap()`` the round
        takes this peer's pseudo-gradient ``x - y`` as it is now, and the inner steps go on."""
        if self.overlap is None:
            return super().begin_round(plan)
        self.round_plan = plan
        assert self._held is None, "one round at a time"
        held = self._spare if self._spare is not None else [torch.empty_like(x) for x in self.anchor.tensors]
        for change, x, p in zip(held, self.anchor.tensors, self.anchor.params):
            torch.sub(x, p.detach().to(x.device, x.dtype), out=change)
        self._held, self._spare = _HeldChange(self, held, self._samples), None
        self._samples = 0
        return self._held

    def _apply_held(self, held: _HeldChange, result: AveragingResult) -> None:
        """The round of ``held`` committed: the outer step on the group's mean pseudo-gradient moves ``x``, and the
        parameters move by as much as ``x`` did since the snapshot ``y = x - change`` (the inner steps made since are
        kept). Averaged parameters without an anchor (frozen) take the group's mean as they are."""
        means = result.averaged
        for change, x in zip(held.changes, self.anchor.tensors):
            torch.sub(x, change, out=change)  # the snapshot y, from this peer's own x
        if means is not None:  # in groups: the outer step starts from the group's mean x and momentum
            self._take_grouped(means)
        for change, x, j in zip(held.changes, self.anchor.tensors, self._anchored):
            mean = torch.sub(x, change) if means is None else means[j]  # (alone: this peer's own pseudo-gradient)
            x.grad = mean if (mean.dtype, mean.device) == (x.dtype, x.device) else mean.to(x.device, x.dtype)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for change, x, p in zip(held.changes, self.anchor.tensors, self.anchor.params):
            torch.sub(x, change, out=change)  # how far x moved from y
            p.detach().add_(change.to(p.device, p.dtype))
        if means is not None:
            for j in self._frozen:
                self.shared[j].detach().copy_(means[j])
        self.lr_sums.clear()
        self._spare, self._held = held.changes, None

    def _give_back(self, held: _HeldChange) -> None:
        """The round failed: its inner steps stay in the parameters, and the next round's pseudo-gradient (measured
        from the same ``x``) sends them; only its samples are counted again."""
        self._samples += held.samples
        self._spare, self._held = held.changes, None

    def reset(self) -> None:
        super().reset()
        if self._held is not None:  # (the loop concludes a round before it downloads: this is a safety net)
            self._spare, self._held = self._held.changes, None

    def _send_grouped(self, buffers: Sequence[torch.Tensor]) -> None:
        """In groups, ``x`` and the outer momentum go into the last buffers (only the outer step changes them)."""
        state = self._grouped_state()
        for buffer, tensor in zip(buffers[len(buffers) - len(state):], state):
            buffer.copy_(tensor)

    def _take_grouped(self, means: Sequence[torch.Tensor]) -> None:
        """In groups, the outer step starts from the group's mean ``x`` and outer momentum."""
        state = self._grouped_state()
        for tensor, mean in zip(state, means[len(means) - len(state):]):
            tensor.copy_(mean)

    def _grouped_state(self) -> List[torch.Tensor]:
        if self._groups is None:
            return []
        return list(self.anchor.tensors) + _momentum_buffers(self.outer)

    def start_next_round(self) -> None:
        """The parameters hold the group's mean ``ybar``: the outer optimizer steps from ``x`` on ``x - ybar``, and
        the next round starts from the new ``x``."""
        for x, p in zip(self.anchor.tensors, self.anchor.params):
            y = p.detach()
            if (y.dtype, y.device) == (x.dtype, x.device):  # the pseudo-gradient x - ybar, computed in place in p
                x.grad = torch.sub(x, y, out=y)  # (p is overwritten with the new x below): no model-sized temporary
            else:
                x.grad = x - y.to(x.device, x.dtype)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.anchor.restore()
        self.lr_sums.clear()

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "outer": self.outer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        outer = entry(state, "outer")
        if not isinstance(outer, dict):
            raise IncompatibleStateError("DiLoCo outer: expected the outer optimizer's state_dict")
        load_anchor = self.checked_state(state)
        try:  # torch checks the groups before it changes anything
            self.outer.load_state_dict(outer)
        except (KeyError, ValueError, TypeError) as e:
            raise IncompatibleStateError(f"DiLoCo outer: the outer optimizer's state does not fit: {e!r}") from e
        load_anchor()


class _HeldChange(Round):
    """A DiLoCo round's pseudo-gradients, set aside while it is averaged in the background (``overlap``)."""

    in_background = True

    def __init__(self, owner: DiLoCo, changes: List[torch.Tensor], samples: int) -> None:
        self.owner, self.changes, self.samples = owner, changes, samples

    @property
    def weight(self) -> float:
        return float(self.samples)

    def write(self, buffers: Sequence[torch.Tensor]) -> None:
        owner = self.owner
        for change, j in zip(self.changes, owner._anchored):
            buffers[j].copy_(change)
        for j in owner._frozen:  # frozen parameters: their values, which no inner step changes
            buffers[j].copy_(owner.shared[j].detach())
        owner._send_grouped(buffers)

    def apply(self, result: AveragingResult) -> None:
        if self.owner._held is self:  # not dropped by a reset meanwhile
            self.owner._apply_held(self, result)

    def give_back(self) -> None:
        if self.owner._held is self:
            self.owner._give_back(self)


def _check_linear(outer: torch.optim.Optimizer, groups: Groups) -> None:
    if type(outer) is not torch.optim.SGD or any(group["dampening"] != 0 for group in outer.param_groups):
        raise ConfigError(
            f"DiLoCo in groups ({groups!r}) needs torch.optim.SGD as the outer optimizer (momentum and Nesterov are "
            f"fine, dampening=0): groups average the outer state, and only SGD's step is linear in it. Got "
            f"{type(outer).__name__}; use outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, "
            f"nesterov=True), or groups=None")


def _momentum_buffers(outer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """An SGD outer optimizer's momentum buffers, made (zero) where missing so that rounds in groups average them
    from the first round on: torch's SGD starts a missing buffer at the first gradient, which a zero buffer gives
    too when ``dampening=0`` (``_check_linear``). Read anew each round: loading a state replaces them."""
    buffers = []
    for group in outer.param_groups:
        if group["momentum"] == 0:
            continue
        for x in group["params"]:
            if outer.state[x].get("momentum_buffer") is None:
                outer.state[x]["momentum_buffer"] = torch.zeros_like(x)
            buffers.append(outer.state[x]["momentum_buffer"])
    return buffers
