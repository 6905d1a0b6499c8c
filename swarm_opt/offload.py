"""Offloading: the inner optimizer, its state and swarm_opt's buffers live in host memory; the model stays where it is.

For accelerator users whose device memory is the limit. The model's parameters keep their device; the inner optimizer
steps host-memory *master copies* of them, so its state (momentum, Adam moments) and every buffer a strategy keeps
(accumulated gradients, anchors, SCAFFOLD controls; the averaging buffers are always in host memory) stay off the
device. Each ``step()`` copies the gradients to the host; parameters travel only when one side changed them.

Which side changed is read from PyTorch's per-tensor version counters, so weights the user writes into the model after
creating the optimizer (``model.load_state_dict(...)``, an in-place edit under ``no_grad``) are taken up at the next
``step()`` instead of being overwritten by stale master copies — the bug of hivemind's offloaded optimizer, which
reverts such weights at the next global step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List

import torch

from swarm_opt.errors import ConfigTypeError


@dataclass(frozen=True)
class Offload:
    """Keep the inner optimizer and swarm_opt's buffers in host memory: ``Optimizer(..., offload=Offload())``.

    :param pin_memory: page-lock the host copies when CUDA is available (faster, asynchronous-capable transfers).

    Needs an optimizer factory (``optimizer=lambda p: torch.optim.AdamW(p, ...)``, ``params=model.parameters()``):
    the inner optimizer is built over the host copies. Master copies keep the parameters' dtype. To clip gradients,
    pass ``clip_grad_norm=`` to the swarm optimizer: it clips the host copies' gradients at the inner step
    (``swarm_opt.clipping``). With a ``torch.cuda.amp.GradScaler``, unscale the gradients on the model rather than
    through the optimizer's ``param_groups``, which hold the host copies.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ConfigTypeError(f"Offload(pin_memory=...) must be True or False, got {self.pin_memory!r}")


class OffloadedParameters:
    """Host master copies of the model's parameters, kept in step with the model through version counters."""

    def __init__(self, params: List[Any], config: Offload) -> None:
        pin = config.pin_memory and torch.cuda.is_available()
        # each group's "params" is read twice below: a generator (``{"params": m.parameters()}``) must become a list
        params = [dict(item, params=_as_list(item["params"])) if isinstance(item, dict) else item for item in params]
        self.model: List[torch.Tensor] = []
        self._masters: Dict[int, torch.Tensor] = {}
        for p in _flat(params):
            if id(p) in self._masters:
                continue
            master = p.detach().to("cpu", copy=True)
            master = torch.nn.Parameter(master.pin_memory() if pin else master, requires_grad=p.requires_grad)
            self._masters[id(p)] = master
            self.model.append(p)
        self.masters = [self._masters[id(p)] for p in self.model]
        #: ``params`` as the user passed them (tensors or param-group dicts), each parameter replaced by its host copy
        self.groups = self._master_groups(params)
        self._versions = [(-1, -1)] * len(self.model)
        self._record_all()

    def _master_groups(self, params: List[Any]) -> List[Any]:
        if params and isinstance(params[0], dict):
            return [dict(group, params=[self._masters[id(p)] for p in group["params"]]) for group in params]
        return [self._masters[id(p)] for p in params]

    def pull(self) -> None:
        """Before the strategy runs: model writes since our last push go to the masters; gradients always do."""
        for i, (p, m) in enumerate(zip(self.model, self.masters)):
            if p._version != self._versions[i][0]:
                m.detach().copy_(p.detach())
                self._record(i)
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.detach().to("cpu", m.dtype, copy=True)
            else:
                m.grad.copy_(p.grad.detach())

    def push(self) -> None:
        """After the strategy ran: masters that the optimizer, a round or a download changed go to the model."""
        for i, (p, m) in enumerate(zip(self.model, self.masters)):
            if m._version != self._versions[i][1]:
                p.detach().copy_(m.detach(), non_blocking=True)
                self._record(i)
        if any(p.device.type == "cuda" for p in self.model):
            torch.cuda.synchronize()

    def zero_grad(self, set_to_none: bool) -> None:
        for p in self.model:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def _record(self, i: int) -> None:
        self._versions[i] = (self.model[i]._version, self.masters[i]._version)

    def _record_all(self) -> None:
        for i in range(len(self.model)):
            self._record(i)


def _as_list(params: Any) -> List[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _flat(params: Iterable[Any]) -> Iterable[torch.Tensor]:
    for item in params:
        if isinstance(item, dict):
            yield from _as_list(item["params"])
        else:
            yield item
