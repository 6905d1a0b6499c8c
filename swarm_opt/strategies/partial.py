"""Partial exchange: parameters a peer keeps to itself (FedBN's normalisation layers, FedPer's personal head), and
layers sent only when they drifted (``DriftedLayers``).

``KeepLocal(model, where)`` names them by a predicate on each parameter's name and the module that owns it. A
parameter-averaging strategy given ``exchange=KeepLocal(...)`` leaves them out of its rounds altogether (they are
not in the averaging buffers, so nothing of them goes on the wire; their inner-optimizer statistics neither), and
the optimizer leaves them and their statistics out of the state it serves to peers that download it: a newcomer
keeps its own.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Set

import torch

from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.strategies.anchor import Anchor

_SENT = 1e-6  # a layer whose averaged flag is below this (only reachable by tampering) counts as sent by nobody

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


class DriftedLayers:
    """Each round, send only the parameters (layers) that drifted: ``‖y − x‖ > threshold · ‖x‖``, ``x`` the round's
    start (the last average), ``y`` now (FL4Health's adaptive layer exchange, by a relative threshold). A layer this
    peer does not send travels as zeros with a flag 0 (its values stay here); every member then takes, per layer, the
    weighted mean over the members that sent it, ``Σ w_i f_i y_i / Σ w_i f_i``, and keeps its own values of a layer no
    member sent. So peers exchanging different subsets still average each coordinate over exactly its senders, and
    every member ends a round with the same values of every layer anyone sent.

    It saves no bandwidth by itself (the zeros travel); it limits what leaves a peer, and with a sparse codec the zeros
    cost little. The flags are one more small tensor of the round. Correct with ``Mean()`` (the default aggregation):
    a robust aggregation would count a layer not sent as zeros.

    :param threshold: the relative drift above which a layer is sent (>= 0; 0 sends every layer that moved at all).
    """

    def __init__(self, threshold: float = 0.01) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < math.inf:
            raise ConfigError(f"DriftedLayers threshold must be a number >= 0, got {threshold!r}; e.g. 0.01")
        self.threshold = float(threshold)

    anchor: Optional[Anchor] = None  # the round's start, from ``bind``

    def __repr__(self) -> str:
        return f"DriftedLayers(threshold={self.threshold})"

    def bind(self, shared: Sequence[torch.Tensor]) -> None:
        if self.anchor is not None:
            raise ValueError("This DriftedLayers instance is already used by another strategy; pass a new one")
        self.anchor = Anchor([list(shared)])

    def template(self) -> torch.Tensor:
        return torch.zeros(len(self.anchor.params), dtype=torch.float64)

    def flags(self) -> List[float]:
        """1.0 for each layer that drifted past the threshold since the round's start, else 0.0."""
        flags = []
        for p, x in zip(self.anchor.params, self.anchor.tensors):
            drift = float((p.detach().to(x.dtype) - x).norm())
            flags.append(1.0 if drift > 0 and drift > self.threshold * float(x.norm()) else 0.0)
        return flags


def send_selected(flags: Sequence[float], layers: Sequence[torch.Tensor], flag_buffer: torch.Tensor) -> None:
    """Zero the round's buffers of the layers not sent (``layers[i]`` belongs to layer ``i % len(flags)``: the
    parameters, then each averaged optimizer statistic) and write the flags."""
    for i, buffer in enumerate(layers):
        if not flags[i % len(flags)]:
            buffer.zero_()
    flag_buffer.copy_(torch.tensor(list(flags), dtype=flag_buffer.dtype))


def mean_over_senders(averaged_flags: torch.Tensor, averaged: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """Per layer, the mean over the members that sent it (``mean_w(f·y) / mean_w(f)``); ``None`` for a layer no
    member sent (the member keeps its own)."""
    means = averaged_flags.tolist()
    n = len(means)
    return [None if not means[i % n] > _SENT else mean / means[i % n] for i, mean in enumerate(averaged)]
