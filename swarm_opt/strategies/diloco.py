"""DiLoCo (Douillard et al., 2023): local updates, then an outer optimizer steps on the averaged pseudo-gradient."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import torch

from swarm_opt.errors import ConfigTypeError, IncompatibleStateError
from swarm_opt.strategies.anchor import entry
from swarm_opt.strategies.local_updates import Anchored
from swarm_opt.strategies.partial import DriftedLayers, KeepLocal
from swarm_opt.strategies.peer_dp import PeerDP

OuterFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class DiLoCo(Anchored):
    """Keep an anchor copy ``x`` of the parameters (fp32, on CPU); after each round's average ``ybar`` the
    pseudo-gradient ``x - ybar`` is given to the outer optimizer, which steps from ``x``; every peer then continues
    from the new ``x``.

    :param outer_optimizer: a factory over the anchor tensors returning any ``torch.optim.Optimizer``, typically
        ``lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)``.
    :param exchange: ``KeepLocal(model, where)``: parameters that never leave this peer, trained by the inner
        optimizer alone (the outer optimizer steps on the averaged ones). ``select=`` and ``peer_dp=`` are refused
        (``Anchored``).

    A peer that missed a round downloads the swarm's state: the anchor and outer optimizer must be the swarm's.

    Memory: the anchor (1x the trainable parameters, fp32), the outer optimizer's state and the averaging buffer;
    the pseudo-gradient is computed in place. torch's multi-tensor ("foreach") SGD allocates a parameter-sized
    temporary for Nesterov momentum at each outer step; ``torch.optim.SGD(..., foreach=False)`` keeps it to one
    tensor.
    """

    name = "diloco"

    def __init__(self, outer_optimizer: OuterFactory, *, average_optimizer_state: Sequence[str] = (),
                 exchange: Optional[KeepLocal] = None, select: Optional[DriftedLayers] = None,
                 peer_dp: Optional[PeerDP] = None) -> None:
        super().__init__(average_optimizer_state=average_optimizer_state, exchange=exchange, select=select,
                         peer_dp=peer_dp)
        if isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer):
            raise ConfigTypeError(
                "outer_optimizer must be a factory over the anchor parameters, e.g. "
                "outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)"
            )
        self._outer_factory = outer_optimizer

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.outer = self._outer_factory(self.anchor.tensors)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ConfigTypeError(f"outer_optimizer returned {type(self.outer).__name__}, not a torch.optim.Optimizer")

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
