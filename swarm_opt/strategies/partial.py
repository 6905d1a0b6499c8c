"""Personalisation: parameters a peer keeps to itself (FedBN's normalisation layers, FedPer's personal head).

``KeepLocal(model, where)`` names them by a predicate on each parameter's name and the module that owns it. A
parameter-averaging strategy given ``exchange=KeepLocal(...)`` leaves them out of its rounds altogether (they are
not in the averaging buffers, so nothing of them goes on the wire; their inner-optimizer statistics neither), and
the optimizer leaves them and their statistics out of the state it serves to peers that download it: a newcomer
keeps its own.
"""

from __future__ import annotations

from typing import Callable, List, Sequence, Set

import torch

from swarm_opt.errors import ConfigError, ConfigTypeError

Where = Callable[[str, torch.nn.Module], bool]


class KeepLocal:
    """The parameters of ``model`` for which ``where(name, module)`` is true stay on this peer; the others are
    averaged. ``name`` is the parameter's full name (``"head.weight"``), ``module`` the module that holds it.

    Examples: FedBN ``KeepLocal(model, lambda name, m: isinstance(m, torch.nn.modules.batchnorm._BatchNorm))``
    (BatchNorm's running statistics are buffers, never averaged anyway); FedPer
    ``KeepLocal(model, lambda name, m: name.startswith("head."))``. Every peer of a run keeps the same parameters.
    """

    def __init__(self, model: torch.nn.Module, where: Where) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigTypeError(f"KeepLocal needs the model (a torch.nn.Module), got {type(model).__name__}")
        if not callable(where):
            raise ConfigTypeError("KeepLocal's where must be a function (name, module) -> bool, e.g. "
                                  "lambda name, m: name.startswith('head.')")
        self.names: List[str] = []
        self._kept: Set[int] = set()
        for module_name, module in model.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if where(name, module) and id(param) not in self._kept:
                    self._kept.add(id(param))
                    self.names.append(name)
        self._model_params = {id(p) for p in model.parameters()}

    def __repr__(self) -> str:
        return f"KeepLocal({', '.join(self.names)})"

    def split(self, params: Sequence[torch.Tensor]) -> List[bool]:
        """For each of the optimizer's ``params``, whether it stays local; refuses a selection that keeps nothing or
        everything, or a model that is not the one the optimizer trains."""
        if not any(id(p) in self._model_params for p in params):
            raise ConfigError("KeepLocal was given another model than the one whose parameters the optimizer trains")
        kept = [id(p) in self._kept for p in params]
        if not any(kept):
            raise ConfigError("KeepLocal's where= matched no parameter the optimizer trains: nothing would stay "
                              "local; check the names (model.named_parameters())")
        if all(kept):
            raise ConfigError(f"KeepLocal keeps every parameter ({', '.join(self.names)}): nothing would be averaged")
        return kept
